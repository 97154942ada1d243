"""What named locks and elections count and log (``fencing._runtime.metrics``, ``.events``).

Counters and timings on the store's metrics (``locks.metrics``): ``acquire.*``,
``hold.lost``, ``election.*``; lines on ``fencing.locks`` and ``fencing.election``. The
rules are shared by the fronts, so the async front is checked too: through the ``locks``
fixture's async run where the test body can drive it, and with asyncio code of its own
where a heartbeat or a campaign must run in a task meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine

from fencing import Election, Lease, LeaseLost, Locks, LockTimeout
from fencing._runtime.metrics import StoreMetrics
from tests import asyncfront, backends

TTL = 60.0


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def locks(request: pytest.FixtureRequest, engine: Engine, target: str) -> Iterator[Any]:
    """Locks on a fresh database whose locks table exists, and (``async``) the async front
    driven from the test body."""
    if request.param == asyncfront.ASYNC:
        from fencing.asyncio import AsyncLocks

        loop = asyncio.new_event_loop()
        async_engine = backends.async_engine_for(target)
        try:
            front = asyncfront.BlockingAsyncLocks(AsyncLocks(async_engine, poll=0.05), loop)
            front.create_table()
            request.node._fencing_loop = loop  # type: ignore[attr-defined]  # the body runs on it
            yield front
        finally:
            asyncfront.dispose(async_engine, loop)
            loop.close()
        return
    sync = Locks(engine, poll=0.05)
    sync.create_table()
    yield sync


@pytest.fixture
def sync_locks(engine: Engine) -> Locks:
    made = Locks(engine, poll=0.05)
    made.create_table()
    return made


def counted(metrics: StoreMetrics, prefix: str) -> dict[str, int]:
    return {name: n for name, n in metrics.snapshot().items() if name.startswith(prefix)}


def lines(caplog: pytest.LogCaptureFixture, logger: str, *fields: str) -> list[dict[str, Any]]:
    return [
        {"level": r.levelname, **{f: getattr(r, f) for f in fields}}
        for r in caplog.records
        if r.name == logger
    ]


# -- acquire ---------------------------------------------------------------------------------------


def test_acquire_counts_what_it_got_and_what_it_gave_up(locks: Any) -> None:
    metrics = locks.metrics
    assert metrics is locks.store.metrics  # one object: fencing.otel exports it as a store's
    held = locks.try_acquire("nightly", "a", ttl=TTL)
    assert held is not None
    assert counted(metrics, "acquire.") == {}  # try_acquire is one claim: the store's claim.*
    assert locks.acquire("nightly", "b", ttl=TTL, timeout=0.1) is None  # queued, then gave up
    assert locks.acquire("nightly", "b", ttl=TTL) is None  # timeout 0: one try, no queue
    assert counted(metrics, "acquire.") == {"acquire.queued": 1, "acquire.timeout": 2}
    assert "acquire.wait" not in metrics.timings()  # a wait that got nothing is not timed
    assert locks.release(held)
    lease = locks.acquire("nightly", "b", ttl=TTL)
    assert lease is not None and lease.fence == 2
    assert counted(metrics, "acquire.") == {"acquire.queued": 1, "acquire.timeout": 2, "acquire.acquired": 1}
    wait = metrics.timings()["acquire.wait"]
    assert wait.count == 1 and 0 < wait.max < 5.0


def test_hold_that_times_out_counts_a_timeout(locks: Any) -> None:
    assert locks.try_acquire("nightly", "a", ttl=TTL) is not None
    with pytest.raises(LockTimeout), locks.hold("nightly", "b", ttl=TTL, timeout=0.05):
        pass
    assert counted(locks.metrics, "acquire.") == {"acquire.queued": 1, "acquire.timeout": 1}


def test_acquire_wait_is_timed_from_the_call_to_the_lease(sync_locks: Locks) -> None:
    lease = sync_locks.try_acquire("nightly", "a", ttl=TTL)
    assert lease is not None
    releasing: list[float] = []

    def release() -> None:
        releasing.append(time.perf_counter())  # nobody can take the lock before this
        sync_locks.release(lease)

    releaser = threading.Timer(0.3, release)
    releaser.start()
    called = time.perf_counter()
    try:
        taken = sync_locks.acquire("nightly", "b", ttl=TTL, timeout=30.0)
    finally:
        releaser.join()
    assert taken is not None
    wait = sync_locks.metrics.timings()["acquire.wait"]
    # from the call (within a scheduler's slice of it) to the lease, which came after the release
    # began: a Timer that fires on time can release less than 0.3 s after the call
    assert wait.count == 1 and releasing[0] - called - 0.05 <= wait.max < 10.0
    assert counted(sync_locks.metrics, "acquire.") == {"acquire.queued": 1, "acquire.acquired": 1}


def test_lock_metrics_are_exported_through_opentelemetry(sync_locks: Locks) -> None:
    pytest.importorskip("opentelemetry.sdk.metrics")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from fencing.otel import instrument

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instrument(sync_locks, provider)
    assert sync_locks.acquire("nightly", "a", ttl=TTL) is not None
    assert sync_locks.acquire("nightly", "b", ttl=TTL) is None
    data = reader.get_metrics_data()
    assert data is not None
    found = {
        (metric.name, tuple(sorted((p.attributes or {}).items()))): p.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for p in metric.data.data_points
    }
    table = ("fencing.table", "fencing_locks")
    for outcome in ("acquired", "timeout"):
        key = ("fencing.operations", (table, ("operation", "acquire"), ("outcome", outcome)))
        assert found[key] == 1, sorted(found)
    assert found[("fencing.duration.count", (table, ("timing", "acquire.wait")))] == 1
    provider.shutdown()


# -- a held lock, lost -------------------------------------------------------------------------------


def test_a_lost_lock_is_counted_and_logged_once(sync_locks: Locks, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fencing.locks")
    with sync_locks.hold("nightly", "a", ttl=3.0, interval=0.05):
        pass
    assert counted(sync_locks.metrics, "hold.") == {}  # released at its end: not lost
    told: list[Any] = []
    with sync_locks.hold("nightly", "a", ttl=3.0, interval=0.05, on_lost=told.append) as lock:
        assert sync_locks.revoke("nightly")
        assert lock.lost.wait(5.0)
    assert told == [lock]  # the application's on_lost still called, once
    assert counted(sync_locks.metrics, "hold.") == {"hold.lost": 1}
    [line] = lines(caplog, "fencing.locks", "event", "lock", "owner", "token", "reason")
    assert line["level"] == "WARNING" and line["reason"]
    assert (line["event"], line["lock"], line["owner"], line["token"]) == ("lost", "nightly", "a", 2)


def test_a_lock_lost_before_its_first_renewal_is_counted(
    sync_locks: Locks, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fencing.locks")
    taken = sync_locks.acquire

    def revoked_at_once(*args: Any, **kwargs: Any) -> Lease | None:
        lease = taken(*args, **kwargs)
        assert lease is not None and sync_locks.revoke(lease.job_id)  # before hold renews it
        return lease

    monkeypatch.setattr(sync_locks, "acquire", revoked_at_once)
    with pytest.raises(LeaseLost), sync_locks.hold("nightly", "a", ttl=3.0):
        pass
    assert counted(sync_locks.metrics, "hold.") == {"hold.lost": 1}
    assert [line["event"] for line in lines(caplog, "fencing.locks", "event")] == ["lost"]


@pytest.mark.sync_only("drives the async locks from asyncio code of its own")
def test_an_async_lost_lock_is_counted_and_logged_once(target: str, caplog: pytest.LogCaptureFixture) -> None:
    from fencing.asyncio import AsyncLocks

    caplog.set_level(logging.WARNING, logger="fencing.locks")
    told: list[int] = []

    async def main() -> StoreMetrics:
        engine = backends.async_engine_for(target)
        try:
            locks = AsyncLocks(engine, poll=0.05)
            await locks.create_table()

            async def on_lost(held: Any) -> None:  # a coroutine: awaited by the heartbeat's task
                told.append(held.token)

            async with locks.hold("nightly", "a", ttl=3.0, interval=0.05, on_lost=on_lost) as lock:
                assert await locks.revoke("nightly")
                await asyncio.wait_for(lock.lost.wait(), 5.0)
            return locks.metrics
        finally:
            await engine.dispose()

    metrics = asyncio.run(main())
    assert told == [1]
    assert counted(metrics, "hold.") == {"hold.lost": 1}
    assert counted(metrics, "acquire.") == {"acquire.acquired": 1}
    [line] = lines(caplog, "fencing.locks", "event", "lock", "owner", "token")
    assert (line["level"], line["event"], line["lock"], line["owner"], line["token"]) == (
        "WARNING",
        "lost",
        "nightly",
        "a",
        1,
    )


# -- elections ---------------------------------------------------------------------------------------

ELECTION_FIELDS = ("event", "lock", "owner", "term")


def test_an_elections_terms_are_counted_and_logged(
    sync_locks: Locks, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fencing.election")
    deposed = threading.Event()
    election = Election(
        sync_locks, "scheduler", "a", ttl=2.0, interval=0.05, retry=0.05, on_deposed=lambda *_: deposed.set()
    )
    with election:
        assert election.elected.wait(10.0) and election.term == 1
        assert sync_locks.revoke("scheduler")  # the term is taken from it: fence 2
        assert deposed.wait(5.0)
        deadline = time.monotonic() + 10.0
        while election.term is None:  # it campaigns again
            assert time.monotonic() < deadline, "never elected again"
            time.sleep(0.02)
        assert election.term == 3
    # stopped while leading: it resigned
    metrics = sync_locks.metrics
    assert counted(metrics, "election.") == {
        "election.elected": 2,
        "election.deposed": 1,
        "election.resigned": 1,
    }
    assert metrics.timings()["election.term"].count == 2
    logged = lines(caplog, "fencing.election", *ELECTION_FIELDS)
    assert [(r["level"], r["event"], r["owner"], r["term"]) for r in logged] == [
        ("INFO", "elected", "a", 1),
        ("WARNING", "deposed", "a", 1),
        ("INFO", "elected", "a", 3),
        ("INFO", "resigned", "a", 3),
    ]
    assert all(r["lock"] == "scheduler" for r in logged)
    [lost] = [r for r in caplog.records if r.name == "fencing.election" and r.levelname == "WARNING"]
    # the lock as the deposed leader found it: revoked, so nobody holds it, one term on
    assert (lost.holder, lost.current_term) == (None, 2)  # type: ignore[attr-defined]
    assert lost.reason and lost.held > 0  # type: ignore[attr-defined]


def test_a_leader_stopped_without_resigning_is_counted_stopped(
    sync_locks: Locks, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fencing.election")
    election = Election(sync_locks, "scheduler", "a", ttl=5.0, retry=0.05).start()
    try:
        assert election.elected.wait(10.0)
    finally:
        election.stop(resign=False)
    assert counted(sync_locks.metrics, "election.") == {"election.elected": 1, "election.stopped": 1}
    holder = sync_locks.holder("scheduler")  # not released: its term runs out at its until
    assert holder is not None and holder.owner == "a"
    assert [r["event"] for r in lines(caplog, "fencing.election", *ELECTION_FIELDS)] == ["elected", "stopped"]


@pytest.mark.sync_only("drives the async election from asyncio code of its own")
def test_an_async_elections_terms_are_counted_and_logged_alike(
    target: str, caplog: pytest.LogCaptureFixture
) -> None:
    from fencing.asyncio import AsyncElection, AsyncLocks

    caplog.set_level(logging.INFO, logger="fencing.election")

    async def main() -> StoreMetrics:
        engine = backends.async_engine_for(target)
        try:
            locks = AsyncLocks(engine)
            await locks.create_table()
            deposed = asyncio.Event()
            election = AsyncElection(
                locks,
                "scheduler",
                "a",
                ttl=2.0,
                interval=0.05,
                retry=0.05,
                on_deposed=lambda *_: deposed.set(),
            )
            async with election:
                await asyncio.wait_for(election.elected.wait(), 10.0)
                assert await locks.revoke("scheduler")
                await asyncio.wait_for(deposed.wait(), 5.0)
                deadline = time.monotonic() + 10.0
                while election.term is None:
                    assert time.monotonic() < deadline, "never elected again"
                    await asyncio.sleep(0.02)
            return locks.metrics
        finally:
            await engine.dispose()

    metrics = asyncio.run(main())
    assert counted(metrics, "election.") == {
        "election.elected": 2,
        "election.deposed": 1,
        "election.resigned": 1,
    }
    assert metrics.timings()["election.term"].count == 2
    logged = lines(caplog, "fencing.election", *ELECTION_FIELDS)
    assert [(r["event"], r["term"]) for r in logged] == [
        ("elected", 1),
        ("deposed", 1),
        ("elected", 3),
        ("resigned", 3),
    ]
    [lost] = [r for r in caplog.records if r.name == "fencing.election" and r.levelname == "WARNING"]
    assert (lost.holder, lost.current_term) == (None, 2)  # type: ignore[attr-defined]
