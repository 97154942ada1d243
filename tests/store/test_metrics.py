"""What ``store.metrics`` times, and the log lines besides refusals (``fencing._runtime.events``).

Timings: claim latency, how long leases were held, lock waits. Lines: a lost lease
(``fencing.heartbeat``), ``DatabaseBusy`` (``fencing.busy``), a retried lock race
(``fencing.retry``), a claim of a job's last attempt (``fencing.poisoned``). The lock races
are real ones on each database: another transaction holds the job's row (the servers) or
the write lock (SQLite) while the store waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Engine

import fencing
from fencing import DatabaseBusy, FenceMarks, JobStore, Lease, LeaseLost
from fencing._runtime import execution
from fencing._runtime import metrics as metrics_module
from fencing._runtime.metrics import BUCKETS, StoreMetrics, Timing
from fencing._store.heartbeat import Heartbeat
from tests import backends

TTL = 10.0


def records(caplog: pytest.LogCaptureFixture, name: str, *fields: str) -> list[dict[str, Any]]:
    return [
        {k: getattr(r, k) for k in fields} | {"level": r.levelname} for r in caplog.records if r.name == name
    ]


def claimed(store: Any, job: str = "job", owner: str = "a", now: float | None = 100.0) -> Lease:
    store.enqueue(job, ready_at=0.0)
    lease = store.claim(job, owner, ttl=TTL, now=now)
    assert lease is not None
    return lease


# -- timings -------------------------------------------------------------------------------------


def test_claims_are_timed_once_per_call(store: Any) -> None:
    for job in ("a", "b", "c"):
        store.enqueue(job, ready_at=0.0)
    assert len(store.claim_next("w", ttl=TTL, now=100.0, limit=2)) == 2
    assert store.claim_next("w", ttl=TTL, now=100.0, limit=2) != []
    assert store.claim_next("w", ttl=TTL, now=100.0) == []  # nothing left: still a call, timed
    assert store.claim("a", "x", ttl=TTL, now=100.0) is None
    timings = store.metrics.timings()
    latency = timings["claim_next.latency"]
    assert latency.count == 3
    assert 0 < latency.min <= latency.mean <= latency.max < 60
    assert sum(latency.buckets) == 3
    assert timings["claim.latency"].count == 1
    counts = store.metrics.snapshot()
    assert (counts["claim_next.calls"], counts["claim_next.jobs"], counts["claim.empty"]) == (3, 3, 1)


def test_a_lease_is_timed_from_its_claim_to_its_complete_or_release(store: Any) -> None:
    first = claimed(store, "first")
    [second] = [claimed(store, "second")]
    time.sleep(0.05)
    assert store.complete(first, "r", now=101.0)
    assert store.release(second, now=101.0)
    timings = store.metrics.timings()
    assert timings["complete.held"].count == timings["release.held"].count == 1
    assert 0.05 <= timings["complete.held"].min < 30
    assert store.metrics.tracked() == 0
    # a renewal keeps the lease: it is timed once, when it ends
    [third] = store.claim_next("w", ttl=TTL, now=102.0)
    renewed = store.renew(third, ttl=TTL, now=103.0)
    assert isinstance(renewed, Lease)
    assert store.complete(renewed, "r", now=104.0)
    assert store.metrics.timings()["complete.held"].count == 2


def test_a_lease_that_ended_otherwise_is_not_timed(store: Any) -> None:
    stale = claimed(store, "taken")
    assert store.claim("taken", "b", ttl=TTL, now=200.0) is not None  # the lease ran out: taken over
    claimed(store, "revoked")
    claimed(store, "deleted")
    assert store.metrics.tracked() == 3
    assert not store.complete(stale, "late", now=201.0)  # refused: its lease is over
    assert store.revoke("revoked")
    assert store.delete("deleted")
    assert store.metrics.tracked() == 1  # only b's lease on "taken" is still held
    assert "complete.held" not in store.metrics.timings()


def test_a_fenced_block_is_counted_accepted_only_when_it_passes_its_final_check(engine: Engine) -> None:
    store = JobStore(engine)
    store.create_table()
    for job in ("own", "joined", "lost"):
        store.enqueue(job, ready_at=0)
    own = store.claim("own", "w", ttl=30)
    joined = store.claim("joined", "w", ttl=30)
    lost = store.claim("lost", "w", ttl=30)
    assert own is not None and joined is not None and lost is not None
    with store.fenced(own, complete=True, result="r"):
        pass
    with engine.begin() as conn, store.fenced(joined, conn=conn):
        pass
    assert store.revoke("lost")
    with pytest.raises(LeaseLost), store.fenced(lost):
        pass
    counts = store.metrics.snapshot()
    assert counts["fenced.accepted"] == 2
    assert counts["fenced.refused.stale fence"] == 1


def test_the_leases_remembered_are_bounded(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "HELD_TRACKED", 3)
    for i in range(5):
        store.enqueue(f"j{i}", ready_at=float(i))
    leases = store.claim_next("w", ttl=TTL, now=100.0, limit=5)
    assert len(leases) == 5
    assert store.metrics.tracked() == 3
    for lease in leases:
        assert store.complete(lease, "r", now=101.0)
    assert store.metrics.timings()["complete.held"].count == 3  # the oldest two were forgotten


class CountingLock:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taken = 0

    def __enter__(self) -> None:
        self.taken += 1
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_a_claim_next_takes_the_metrics_lock_once(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # a BEGIN IMMEDIATE slower than LOCK_WAIT_MIN counts a lock wait besides (a loaded machine's
    # scheduling can make it one): not what is counted here
    monkeypatch.setattr(execution, "LOCK_WAIT_MIN", float("inf"))
    store = JobStore(engine)
    store.create_table()
    for job in ("a", "b"):
        store.enqueue(job, ready_at=0.0)
    counting = CountingLock()
    store.metrics._lock = counting
    assert len(store.claim_next("w", ttl=TTL, now=100.0, limit=2)) == 2
    assert counting.taken == 1
    assert store.claim_next("w", ttl=TTL, now=100.0) == []
    assert counting.taken == 2


def test_a_timing_summary() -> None:
    metrics = StoreMetrics()
    for seconds in (0.0001, 0.002, 0.002, 7200.0):
        metrics.time("x", seconds)
    t = metrics.timings()["x"]
    assert (t.count, t.min, t.max) == (4, 0.0001, 7200.0)
    assert t.sum == pytest.approx(7200.0041)
    assert t.buckets[0] == 1  # <= 0.5 ms
    assert t.buckets[BUCKETS.index(0.0025)] == 2
    assert t.buckets[-1] == 1  # past the last bound
    assert t.quantile(0.5) == 0.0025
    assert t.quantile(1.0) == 7200.0
    assert Timing(0, 0.0, 0.0, 0.0, (0,) * (len(BUCKETS) + 1)).mean == 0.0


def test_fence_marks_count_what_they_accept_and_record(engine: Engine) -> None:
    marks = FenceMarks(engine)
    marks.create_tables()
    assert marks.accept("r", 3)
    assert not marks.accept("r", 2)
    assert marks.record_once("k")
    assert not marks.record_once("k")
    counts = marks.metrics.snapshot()
    assert counts == {
        "accept.accepted": 1,
        "accept.refused.older fence": 1,
        "record_once.recorded": 1,
        "record_once.duplicate": 1,
    }
    assert marks.metrics.refused() == 1


# -- the last attempt ---------------------------------------------------------------------------


def test_the_claim_of_a_jobs_last_attempt_is_logged(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fencing")
    store.enqueue("job", ready_at=0.0)
    [first] = store.claim_next("w", ttl=TTL, now=100.0, max_attempts=2)
    assert records(caplog, "fencing.poisoned") == []
    assert store.release(first, now=101.0)
    [last] = store.claim_next("w", ttl=TTL, now=102.0, max_attempts=2)
    fields = ("job_id", "owner", "fence", "max_attempts")
    assert records(caplog, "fencing.poisoned", *fields) == [
        {"job_id": "job", "owner": "w", "fence": 2, "max_attempts": 2, "level": "INFO"}
    ]
    assert store.release(last, now=103.0)
    assert store.claim_next("w", ttl=TTL, now=104.0, max_attempts=2) == []  # poisoned: skipped
    assert [j.job_id for j in store.poisoned(2, now=104.0)] == ["job"]
    _, leases = store.complete_and_claim_next([], "w", ttl=TTL, now=105.0, max_attempts=3)
    assert [lease.fence for lease in leases] == [3]
    assert [r["max_attempts"] for r in records(caplog, "fencing.poisoned", "max_attempts")] == [2, 3]


# -- a lost lease ---------------------------------------------------------------------------------

LOST_FIELDS = ("path", "job_id", "owner", "fence", "reason", "error")


def test_a_heartbeat_that_loses_its_lease_logs_it_once(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fencing")
    store = JobStore(engine)
    store.create_table()
    store.enqueue("job", ready_at=0.0)
    lease = store.claim("job", "a", ttl=5.0)
    assert lease is not None
    with Heartbeat(store, lease, ttl=5.0, interval=0.05) as hb:
        assert store.revoke("job")
        assert hb.lost.wait(10.0)
    [line] = records(caplog, "fencing.heartbeat", *LOST_FIELDS)
    assert line == {
        "path": "heartbeat",
        "job_id": "job",
        "owner": "a",
        "fence": 1,
        "reason": hb.reason,
        "error": None,
        "level": "WARNING",
    }
    assert "refused" in line["reason"]
    # the refused renewal said why, on its own line
    assert [r.reason for r in caplog.records if r.name == "fencing.refused"] == ["stale fence"]


def test_a_refused_first_renewal_is_logged(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fencing")
    store = JobStore(engine)
    store.create_table()
    lease = claimed(store, now=None)
    assert store.revoke("job")
    hb = Heartbeat(store, lease, ttl=5.0)
    with pytest.raises(LeaseLost):
        hb.start()
    [line] = records(caplog, "fencing.heartbeat", *LOST_FIELDS)
    assert (line["job_id"], line["fence"], line["reason"]) == ("job", 1, hb.reason)


def test_an_async_heartbeat_that_loses_its_lease_logs_it_once(
    target: str, caplog: pytest.LogCaptureFixture
) -> None:
    from fencing.asyncio import AsyncHeartbeat, AsyncJobStore

    caplog.set_level(logging.INFO, logger="fencing")

    async def main() -> str | None:
        engine = backends.async_engine_for(target)
        try:
            store = AsyncJobStore(engine)
            await store.create_table()
            await store.enqueue("job", ready_at=0.0)
            lease = await store.claim("job", "a", ttl=5.0)
            assert lease is not None
            async with AsyncHeartbeat(store, lease, ttl=5.0, interval=0.05) as hb:
                assert await store.revoke("job")
                await asyncio.wait_for(hb.lost.wait(), 10.0)
            return hb.reason
        finally:
            await engine.dispose()

    reason = asyncio.run(main())
    [line] = records(caplog, "fencing.heartbeat", *LOST_FIELDS)
    assert (line["job_id"], line["owner"], line["fence"], line["reason"]) == ("job", "a", 1, reason)


# -- lock races: retried, waited for, and DatabaseBusy ------------------------------------------


def waiting_engine(target: str, *, wait: float) -> Engine:
    """An engine whose lock waits give up after about ``wait`` seconds (MariaDB: 1 s at least)."""
    if "://" not in target:
        return fencing.create_sqlite_engine(target, busy_timeout=wait)
    url = sqlalchemy.make_url(target)
    if url.get_backend_name() == "postgresql":
        args: dict[str, Any] = {"options": f"-c lock_timeout={int(wait * 1000)}"}
    else:
        args = {"init_command": f"SET SESSION innodb_lock_wait_timeout = {max(1, round(wait))}"}
    return sqlalchemy.create_engine(url, connect_args=args)


@contextlib.contextmanager
def row_held(engine: Engine, lease: Lease, seconds: float) -> Iterator[None]:
    """Another thread holds the lease's row in a fenced block (SQLite: the write lock) for
    ``seconds``, or until the block ends."""
    holding = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with JobStore(engine).fenced(lease, now=100.0):
            holding.set()
            done.wait(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(10.0)
        yield
    finally:
        done.set()
        thread.join()


def test_a_lock_race_the_store_retries_is_logged_and_waited_for(
    engine: Engine, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="fencing")
    sqlite = engine.dialect.name == "sqlite"
    mariadb = engine.dialect.name in ("mysql", "mariadb")
    waiting = waiting_engine(target, wait=30.0 if sqlite else 1.0 if mariadb else 0.1)
    try:
        store = JobStore(waiting)
        store.create_table()
        lease = claimed(store)
        hold = 1.6 if mariadb else 0.4
        with row_held(engine, lease, hold):
            started = time.monotonic()
            assert store.complete(lease, "r", now=101.0)  # waits for the block, however it can
            waited = time.monotonic() - started
        metrics = store.metrics
        [wait] = [metrics.timings()["lock.wait"]]
        assert wait.count == 1
        assert hold / 4 < wait.max <= waited + 0.01
        retries = records(caplog, "fencing.retry", "job_id", "attempt", "waited", "error")
        if sqlite:  # the wait is in BEGIN IMMEDIATE: nothing to retry
            assert retries == []
            assert "lock.retried" not in metrics.snapshot()
        else:  # each attempt timed out waiting for the row, and was run again
            assert len(retries) == metrics.snapshot()["lock.retried"] >= 1
            assert [r["attempt"] for r in retries] == list(range(1, len(retries) + 1))
            assert {r["job_id"] for r in retries} == {"job"}
            assert {r["level"] for r in retries} == {"DEBUG"}
        assert records(caplog, "fencing.busy") == []
    finally:
        waiting.dispose()


def test_a_retried_unit_is_logged_with_its_attempts(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Any database: a unit that loses two races (SQLite's own error, which every runner
    takes for one), then commits."""
    caplog.set_level(logging.DEBUG, logger="fencing")
    store = JobStore(engine)
    store.create_table()
    tries = []

    def unit(x: Any) -> str:
        tries.append(1)
        if len(tries) < 3:
            raise sqlite3.OperationalError("database is locked")
        return "done"

    assert store._ctx.run_jobs(unit, None, job="j") == "done"
    retries = records(caplog, "fencing.retry", "job_id", "attempt", "error")
    assert [(r["job_id"], r["attempt"], r["error"]) for r in retries] == [
        ("j", 1, "OperationalError: database is locked"),
        ("j", 2, "OperationalError: database is locked"),
    ]
    assert store.metrics.snapshot()["lock.retried"] == 2
    assert store.metrics.timings()["lock.wait"].count == 1


def test_database_busy_is_logged(engine: Engine, target: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fencing")
    sqlite = engine.dialect.name == "sqlite"
    waiting = waiting_engine(target, wait=0.2)
    try:
        store = JobStore(waiting)
        store.create_table()
        lease = claimed(store)
        with row_held(engine, lease, 30.0):
            if sqlite:  # the store's own transaction waited its whole busy_timeout
                with pytest.raises(DatabaseBusy):
                    store.complete(lease, "r", now=101.0)
            else:  # the caller's transaction lost the race (a lock wait timeout)
                with waiting.connect() as conn, conn.begin(), pytest.raises(DatabaseBusy):
                    store.complete(lease, "r", now=101.0, conn=conn)
        [line] = records(caplog, "fencing.busy", "job_id", "table", "reason", "error")
        assert (line["job_id"], line["table"], line["reason"], line["level"]) == (
            "job",
            "jobs",
            "database busy",
            "WARNING",
        )
        assert store.metrics.snapshot()["lock.busy"] == 1
        assert store.complete(lease, "r", now=101.0)  # nothing was changed
    finally:
        waiting.dispose()


@pytest.mark.backend("postgresql")
def test_database_busy_after_every_retry_is_logged(
    engine: Engine, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL (a short lock_timeout): the store's own transaction lost every race."""
    caplog.set_level(logging.DEBUG, logger="fencing")
    waiting = waiting_engine(target, wait=0.02)
    try:
        store = JobStore(waiting)
        store.create_table()
        lease = claimed(store)
        with row_held(engine, lease, 60.0), pytest.raises(DatabaseBusy, match="lock races"):
            store.complete(lease, "r", now=101.0)
        [line] = records(caplog, "fencing.busy", "job_id")
        assert line["job_id"] == "job"
        counts = store.metrics.snapshot()
        assert (counts["lock.busy"], counts["lock.retried"]) == (1, 20)
        assert store.metrics.timings()["lock.wait"].count == 1
    finally:
        waiting.dispose()
