"""Worker primitives: claim_next, complete_many, fenced transactions, delayed release,
revoke, delete (tombstones) and poisoned jobs, on every backend.

Most tests run on the caller's clock (``now=T0 + ...``) so that expiry is exact; the
database-clock tests say so in their names.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, select

from fencing import (
    DatabaseError,
    InvalidArgument,
    InvalidArgumentType,
    JobState,
    JobStore,
    Lease,
    LeaseLost,
)
from tests.backends import engine_for
from tests.processes import reap

T0 = 1_000.0
TTL = 10.0
TIMEOUT = 60.0
PROCESSES = 4
PROCESS_JOBS = 200
THREADS = 4
THREAD_JOBS = 100
BATCH = 5


def state(store: JobStore, job_id: str) -> JobState:
    found = store.state(job_id)
    assert found is not None, f"{job_id!r} should exist"
    return found


def ids(leases: list[Lease]) -> list[str]:
    return [lease.job_id for lease in leases]


def claimed(store: JobStore, job_id: str, owner: str = "w", *, now: float = T0, ttl: float = TTL) -> Lease:
    lease = store.claim(job_id, owner, now=now, ttl=ttl)
    assert lease is not None, f"{job_id!r} should be claimable at {now}"
    return lease


def claim_one(store: JobStore, owner: str = "w", **kwargs: Any) -> Lease:
    """``claim_next`` with the default ``limit=1``: exactly one lease expected."""
    batch = store.claim_next(owner, **kwargs)
    assert len(batch) == 1, f"claim_next(limit=1) returned {ids(batch)}"
    return batch[0]


def snapshot(store: JobStore, job_ids: list[str]) -> dict[str, JobState | None]:
    return {job_id: store.state(job_id) for job_id in job_ids}


def make_updates_fail(engine: Engine, column: str, value: str) -> None:
    """A trigger: any UPDATE of the jobs table that writes ``value`` into ``column`` fails.

    A database error in the middle of a batch shows whether the batch is one transaction.
    """
    dialect = engine.dialect.name
    with engine.begin() as conn:
        if dialect == "sqlite":
            conn.exec_driver_sql(
                f"CREATE TRIGGER fail_update BEFORE UPDATE ON jobs WHEN NEW.{column} = '{value}' "
                "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
            )
        elif dialect == "postgresql":
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION fail_update() RETURNS trigger AS $$ BEGIN "
                f"IF NEW.{column} = '{value}' THEN RAISE EXCEPTION 'injected failure'; END IF; "
                "RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            conn.exec_driver_sql(
                "CREATE TRIGGER fail_update BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION fail_update()"
            )
        else:
            conn.exec_driver_sql(
                "CREATE TRIGGER fail_update BEFORE UPDATE ON jobs FOR EACH ROW BEGIN "
                f"IF NEW.{column} = '{value}' THEN "
                "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected failure'; END IF; END"
            )


# -- claim_next: what it takes ------------------------------------------------------------


def test_claim_next_takes_only_ready_jobs(store: JobStore) -> None:
    now = T0
    for job in ["ready", "expired", "released", "done", "held", "deferred", "poisoned", "deleted"]:
        assert store.enqueue(job, ready_at=now + 5.0 if job == "deferred" else 0.0)
    claimed(store, "expired", now=now - 20.0)  # until = now - 10: expired
    assert store.release(claimed(store, "released", now=now - 5.0))
    assert store.complete(claimed(store, "done", now=now - 5.0), "r", now=now - 5.0)
    claimed(store, "held", now=now - 5.0)  # until = now + 5: live
    for attempt in range(3):
        lease = claimed(store, "poisoned", now=now - 100.0 + attempt)
        assert store.release(lease)
    assert store.delete("deleted")
    untouched = ["done", "held", "deferred", "poisoned", "deleted"]
    before = snapshot(store, untouched)

    leases = store.claim_next("n", ttl=TTL, now=now, limit=100, max_attempts=3)

    assert sorted(ids(leases)) == ["expired", "ready", "released"]
    assert snapshot(store, untouched) == before
    # and with nothing ready left, nothing at all
    assert store.claim_next("n", ttl=TTL, now=now, limit=100, max_attempts=3) == []


def test_claim_next_on_an_empty_table_returns_an_empty_list(store: JobStore) -> None:
    assert store.claim_next("w", ttl=TTL, now=T0) == []
    assert store.claim_next("w", ttl=TTL, now=T0, limit=50) == []


def test_claim_next_takes_the_longest_ready_first(store: JobStore) -> None:
    # insertion order is not readiness order: an implementation taking rows in key or
    # insertion order would come out wrong
    order = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
    for n in order:
        assert store.enqueue(f"j{n}", ready_at=T0 + n)
    taken = [claim_one(store, ttl=TTL, now=T0 + 100.0).job_id for _ in order]
    assert taken == [f"j{n}" for n in range(10)]
    assert store.claim_next("w", ttl=TTL, now=T0 + 100.0) == []


def test_claim_next_counts_an_expired_lease_or_a_retry_from_when_it_became_ready(store: JobStore) -> None:
    store.enqueue("fresh", ready_at=T0 + 30.0)
    store.enqueue("expired", ready_at=0.0)
    store.enqueue("retried", ready_at=0.0)
    claimed(store, "expired", now=T0 + 10.0, ttl=10.0)  # ready again at T0 + 20
    assert store.release(claimed(store, "retried", now=T0), delay=40.0, now=T0)  # ready at T0 + 40
    store.enqueue("oldest", ready_at=T0 + 1.0)
    taken = [claim_one(store, ttl=TTL, now=T0 + 50.0).job_id for _ in range(4)]
    assert taken == ["oldest", "expired", "fresh", "retried"]


def test_claim_next_claims_at_most_limit_jobs(store: JobStore) -> None:
    jobs = [f"j{n}" for n in range(10)]
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
    for limit in (1, 3):
        before = snapshot(store, jobs)
        leases = store.claim_next(f"w{limit}", ttl=TTL, now=T0, limit=limit)
        assert len(leases) == limit
        changed = [job for job in jobs if store.state(job) != before[job]]
        assert sorted(changed) == sorted(ids(leases)), "claim_next took jobs it did not return"


def test_claim_next_batch_takes_the_longest_ready_jobs(store: JobStore) -> None:
    for n in [4, 0, 3, 1, 5, 2]:
        store.enqueue(f"j{n}", ready_at=T0 + n)
    batch = store.claim_next("w", ttl=TTL, now=T0 + 10.0, limit=3)
    assert sorted(ids(batch)) == ["j0", "j1", "j2"]


def test_claim_next_claims_a_whole_batch_with_the_next_fences(store: JobStore) -> None:
    jobs = [f"job-{n:03d}" for n in range(150)]
    for n, job in enumerate(jobs):
        if n % 3 == 0:
            store.enqueue(job, ready_at=0.0)
            claimed(store, job, now=T0 + n - TTL)  # fence 1, expired at T0 + n: ready again
        else:
            store.enqueue(job, ready_at=T0 + n)
    before = {job: state(store, job) for job in jobs}
    now = T0 + 500.0

    leases = store.claim_next("batch", ttl=30.0, now=now, limit=100)

    assert len(leases) == 100
    assert sorted(ids(leases)) == jobs[:100]
    for lease in leases:
        assert lease.owner == "batch"
        assert lease.fence == before[lease.job_id].fence + 1
        assert lease.until == now + 30.0
        assert state(store, lease.job_id) == JobState(
            lease.job_id, "batch", now + 30.0, lease.fence, None, False
        )
    # the rest were not touched
    for job in jobs[100:]:
        assert state(store, job) == before[job]


def test_claim_next_batch_is_all_or_nothing(store: JobStore, engine: Engine) -> None:
    jobs = [f"j{n}" for n in range(6)]
    for n, job in enumerate(jobs):
        store.enqueue(job, ready_at=T0 + n)
    make_updates_fail(engine, "id", "j3")
    with pytest.raises(DatabaseError):
        store.claim_next("w", ttl=TTL, now=T0 + 10.0, limit=6)
    # the failure on one row undid the claims of the rows before it
    for job in jobs:
        assert state(store, job).fence == 0
        assert state(store, job).owner is None


def test_claim_next_reclaims_an_expired_lease_with_a_higher_fence(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    first = claim_one(store, "a", ttl=10.0, now=T0)
    assert (first.fence, first.until) == (1, T0 + 10.0)
    assert store.claim_next("b", ttl=10.0, now=T0 + 9.999) == []
    # until == now is expired
    second = claim_one(store, "b", ttl=10.0, now=T0 + 10.0)
    assert (second.job_id, second.owner, second.fence) == ("j", "b", 2)
    assert not store.complete(first, "late", now=T0 + 10.0)
    assert store.complete(second, "ok", now=T0 + 10.0) is True


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"limit": 0}, InvalidArgument),
        ({"limit": -1}, InvalidArgument),
        ({"limit": True}, InvalidArgumentType),
        ({"limit": 1.5}, InvalidArgumentType),
        ({"limit": "3"}, InvalidArgumentType),
        ({"max_attempts": 0}, InvalidArgument),
        ({"max_attempts": -2}, InvalidArgument),
        ({"max_attempts": False}, InvalidArgumentType),
        ({"owner": None}, InvalidArgumentType),
        ({"owner": b"w"}, InvalidArgumentType),
        ({"ttl": 0}, InvalidArgument),
        ({"ttl": -1.0}, InvalidArgument),
        ({"ttl": float("nan")}, InvalidArgument),
        ({"now": float("inf")}, InvalidArgument),
        ({"now": "1000"}, InvalidArgumentType),
    ],
)
def test_claim_next_rejects_bad_arguments_and_changes_nothing(
    store: JobStore, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    store.enqueue("j", ready_at=0.0)
    before = snapshot(store, ["j"])
    call: dict[str, Any] = {"owner": "w", "ttl": TTL, "now": T0, "limit": 5, **kwargs}
    owner = call.pop("owner")
    with pytest.raises(error):
        store.claim_next(owner, **call)
    assert snapshot(store, ["j"]) == before
    [lease] = store.claim_next("w", ttl=TTL, now=T0)
    assert lease.fence == 1


# -- claim_next under concurrency --------------------------------------------------------------


def _claim_until_empty(target: str, name: str, out: Any, barrier: Any) -> None:
    """In a spawned process: its own engine and store; claims batches until none is left."""
    engine = engine_for(target)
    store = JobStore(engine)
    try:
        barrier.wait(timeout=TIMEOUT)
        seen: list[tuple[str, int]] = []
        while batch := store.claim_next(name, ttl=3600.0, limit=BATCH):
            assert len(batch) <= BATCH, f"claim_next(limit={BATCH}) returned {len(batch)} leases"
            seen.extend((lease.job_id, lease.fence) for lease in batch)
        out.put(("ok", name, seen))
    except BaseException:
        out.put(("error", name, traceback.format_exc()))
    finally:
        store.engine.dispose()
        engine.dispose()


@pytest.mark.slow
def test_claim_next_hands_each_job_to_exactly_one_process(store: JobStore, target: str) -> None:
    jobs = [f"p{n:03d}" for n in range(PROCESS_JOBS)]
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(PROCESSES)
    procs = [
        ctx.Process(target=_claim_until_empty, args=(target, f"proc-{p}", out, barrier))
        for p in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        by_worker: dict[str, list[tuple[str, int]]] = {}
        for _ in procs:
            try:
                status, name, value = out.get(timeout=TIMEOUT)
            except queue.Empty:
                pytest.fail("a worker process did not report back")
            assert status == "ok", f"{name} failed:\n{value}"
            by_worker[name] = value
    finally:
        reap(procs, 30)
    everything = [item for seen in by_worker.values() for item in seen]
    # with leases that outlive the test, every job is handed out exactly once, at fence 1
    assert sorted(everything) == [(job, 1) for job in jobs]
    owners = {job: name for name, seen in by_worker.items() for job, _ in seen}
    for job in jobs:
        assert state(store, job).owner == owners[job]
        assert state(store, job).fence == 1


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
def test_claim_next_hands_each_job_to_exactly_one_thread(store: JobStore) -> None:
    jobs = [f"t{n:03d}" for n in range(THREAD_JOBS)]
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
    barrier = threading.Barrier(THREADS)
    seen: list[list[tuple[str, int]]] = [[] for _ in range(THREADS)]

    def work(i: int) -> None:
        barrier.wait(timeout=TIMEOUT)
        while batch := store.claim_next(f"thread-{i}", ttl=3600.0, limit=BATCH):
            assert len(batch) <= BATCH, f"claim_next(limit={BATCH}) returned {len(batch)} leases"
            seen[i].extend((lease.job_id, lease.fence) for lease in batch)

    _in_threads(work)
    assert sorted(item for items in seen for item in items) == [(job, 1) for job in jobs]


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
def test_claim_next_never_hands_one_fence_twice_while_leases_expire(store: JobStore) -> None:
    """Threads claim, sometimes stall past the lease, and complete: database clock."""
    jobs = [f"e{n:03d}" for n in range(THREAD_JOBS)]
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
    barrier = threading.Barrier(THREADS)
    claims: list[list[tuple[str, int]]] = [[] for _ in range(THREADS)]
    accepted: list[list[tuple[str, int]]] = [[] for _ in range(THREADS)]
    stalled: list[list[bool]] = [[] for _ in range(THREADS)]

    def work(i: int) -> None:
        barrier.wait(timeout=TIMEOUT)
        rounds = 0
        while batch := store.claim_next(f"thread-{i}", ttl=0.5, limit=BATCH):
            assert len(batch) <= BATCH, f"claim_next(limit={BATCH}) returned {len(batch)} leases"
            rounds += 1
            claims[i].extend((lease.job_id, lease.fence) for lease in batch)
            stall = rounds == 2
            if stall:
                time.sleep(0.7)  # the leases expire meanwhile
            verdicts = store.complete_many([(lease, f"{lease.job_id}@{lease.fence}") for lease in batch])
            if stall:
                stalled[i].extend(verdicts)
            accepted[i].extend(
                (lease.job_id, lease.fence) for lease, ok in zip(batch, verdicts, strict=True) if ok
            )

    _in_threads(work)
    every_claim = [item for items in claims for item in items]
    duplicates = [item for item, n in Counter(every_claim).items() if n > 1]
    assert duplicates == [], "a fence was handed to two leases"
    assert any(stalled), "no thread stalled: the test did not exercise expiry"
    assert not any(ok for verdicts in stalled for ok in verdicts), "a stalled worker completed"
    completions = [item for items in accepted for item in items]
    assert sorted(job for job, _ in completions) == jobs  # each job completed exactly once
    highest = {job: max(f for j, f in every_claim if j == job) for job in jobs}
    for job, fence in completions:
        # only the newest lease can complete, and the result is the one it wrote
        assert fence == highest[job]
        row = state(store, job)
        assert (row.done, row.fence, row.result) == (True, fence, f"{job}@{fence}")
    assert any(f > 1 for f in highest.values()), "no stalled job was claimed again"


def _in_threads(work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a worker thread is stuck"
    if errors:
        raise errors[0]


# -- SKIP LOCKED ---------------------------------------------------------------------------


def _promptly(
    call: Callable[[], list[Lease]], release: Callable[[], None], limit: float = 2.0
) -> list[Lease]:
    """``call()`` on a thread; fails if it has not returned within ``limit`` seconds
    (after ``release()`` has unblocked it, so the test never hangs)."""
    result: list[list[Lease]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(limit)
    blocked = thread.is_alive()
    waited = time.monotonic() - started
    release()
    thread.join(TIMEOUT)
    assert not blocked, f"claim_next waited {waited:.1f}s for rows another transaction holds"
    if errors:
        raise errors[0]
    return result[0]


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
@pytest.mark.backend("postgresql", "mysql")
def test_claim_next_skips_rows_another_claimer_has_locked(store: JobStore, engine: Engine) -> None:
    for n in range(6):
        store.enqueue(f"j{n}", ready_at=T0 + n)
    with engine.connect() as conn:
        tx = conn.begin()
        held = store.claim_next("a", ttl=TTL, now=T0 + 10.0, limit=3, conn=conn)
        assert sorted(ids(held)) == ["j0", "j1", "j2"]
        other = _promptly(lambda: store.claim_next("b", ttl=TTL, now=T0 + 10.0, limit=3), tx.rollback)
    assert sorted(ids(other)) == ["j3", "j4", "j5"]
    assert all(lease.fence == 1 for lease in other)
    # the rolled-back claims left their jobs as they were
    again = store.claim_next("c", ttl=TTL, now=T0 + 10.0, limit=10)
    assert sorted((lease.job_id, lease.fence) for lease in again) == [("j0", 1), ("j1", 1), ("j2", 1)]


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
@pytest.mark.backend("postgresql", "mysql")
def test_claim_next_returns_nothing_rather_than_wait_for_locked_rows(store: JobStore, engine: Engine) -> None:
    for n in range(3):
        store.enqueue(f"j{n}", ready_at=T0 + n)
    with engine.connect() as conn:
        tx = conn.begin()
        assert len(store.claim_next("a", ttl=TTL, now=T0 + 10.0, limit=3, conn=conn)) == 3
        other = _promptly(lambda: store.claim_next("b", ttl=TTL, now=T0 + 10.0, limit=3), tx.rollback)
    assert other == []


# -- complete_many -----------------------------------------------------------------------------


def test_complete_many_gives_a_verdict_per_item_in_input_order(store: JobStore) -> None:
    results = ["plain", "", "naïve ✓ 🚀", "Trailing ", None, "x" * 70_000]
    jobs = [f"c{n}" for n in range(len(results))]
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
    leases = [claimed(store, job) for job in jobs]
    stale = leases[2]
    assert store.revoke(stale.job_id)
    newer = claimed(store, stale.job_id, "other")
    before_stale = state(store, stale.job_id)

    verdicts = store.complete_many(list(zip(leases, results, strict=True)), now=T0 + 1.0)

    assert [bool(v) for v in verdicts] == [True, True, False, True, True, True]
    for job, result, ok in zip(jobs, results, verdicts, strict=True):
        if ok:
            row = state(store, job)
            assert (row.done, row.result) == (True, result)
    # the stale writer stored nothing; the current holder still can
    assert state(store, stale.job_id) == before_stale
    assert store.complete(newer, "fresh", now=T0 + 1.0) is True


def test_complete_many_completes_a_job_listed_twice_once(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j")
    assert [bool(v) for v in store.complete_many([(lease, "first"), (lease, "second")], now=T0)] == [
        True,
        False,
    ]
    assert state(store, "j").result == "first"


def test_complete_many_refuses_expired_leases(store: JobStore) -> None:
    for job in ["a", "b"]:
        store.enqueue(job, ready_at=0.0)
    a = claimed(store, "a", now=T0, ttl=10.0)
    b = claimed(store, "b", now=T0 + 5.0, ttl=10.0)
    # at T0 + 10 the lease on "a" has just expired; "b" is live
    assert [bool(v) for v in store.complete_many([(a, "ra"), (b, "rb")], now=T0 + 10.0)] == [False, True]
    assert state(store, "a").done is False
    assert state(store, "b").result == "rb"


def test_complete_many_is_one_transaction(store: JobStore, engine: Engine) -> None:
    jobs = ["a", "b", "c", "d"]
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
    leases = [claimed(store, job) for job in jobs]
    make_updates_fail(engine, "result", "boom")
    with pytest.raises(DatabaseError):
        store.complete_many(list(zip(leases, ["ra", "rb", "boom", "rd"], strict=True)), now=T0)
    # the failure on the third item undid the first two
    for job in jobs:
        assert (state(store, job).done, state(store, job).result) == (False, None)
    assert store.complete_many(list(zip(leases, ["ra", "rb", "rc", "rd"], strict=True)), now=T0) == [True] * 4


def test_complete_many_with_nothing_returns_an_empty_list(store: JobStore) -> None:
    assert [bool(v) for v in store.complete_many([], now=T0)] == []


def test_complete_many_checks_every_item_before_writing_any(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j")
    with pytest.raises(InvalidArgumentType):
        store.complete_many([(lease, "ok"), (lease, 42)], now=T0)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentType):
        store.complete_many([(lease, "ok"), ("not a lease", "r")], now=T0)  # type: ignore[list-item]
    assert state(store, "j").done is False


# -- fenced --------------------------------------------------------------------------------------


@pytest.fixture
def invoices(engine: Engine) -> Table:
    """The application's own table, written inside fenced blocks."""
    table = Table(
        "invoices",
        MetaData(),
        Column("job", String(100), primary_key=True),
        Column("total", Integer, nullable=False),
    )
    table.create(engine)
    return table


def write_invoice(
    store: JobStore,
    lease: Lease,
    table: Table,
    then: Callable[[], object] = lambda: None,
    **fenced: Any,
) -> None:
    """The application's work: one insert in a fenced block, then ``then()`` inside it."""
    with store.fenced(lease, **fenced) as conn:
        conn.execute(table.insert().values(job=lease.job_id, total=99))
        then()


def invoice_rows(engine: Engine, table: Table) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(table).order_by(table.c.job))]


def test_fenced_commits_the_applications_write_with_the_completion(
    store: JobStore, engine: Engine, invoices: Table
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j")
    with store.fenced(lease, now=T0 + 1.0, complete=True, result="paid") as conn:
        conn.execute(invoices.insert().values(job="j", total=99))
    assert invoice_rows(engine, invoices) == [("j", 99)]
    row = state(store, "j")
    assert (row.done, row.result, row.fence) == (True, "paid", 1)


def test_fenced_without_complete_commits_and_keeps_the_lease(
    store: JobStore, engine: Engine, invoices: Table
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j")
    before = state(store, "j")
    with store.fenced(lease, now=T0 + 1.0) as conn:
        conn.execute(invoices.insert().values(job="j", total=5))
    assert invoice_rows(engine, invoices) == [("j", 5)]
    assert state(store, "j") == before
    assert store.complete(lease, "r", now=T0 + 1.0) is True


@pytest.mark.parametrize("how", ["revoked", "reclaimed", "completed", "deleted", "expired", "at_until"])
def test_fenced_with_a_stale_lease_raises_lease_lost_and_commits_nothing(
    store: JobStore, engine: Engine, invoices: Table, how: str
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j", now=T0, ttl=TTL)
    now = T0 + 1.0
    if how == "revoked":
        assert store.revoke("j")
    elif how == "reclaimed":
        assert store.revoke("j")
        claimed(store, "j", "other", now=now)
    elif how == "completed":
        assert store.complete(lease, "r", now=now)
    elif how == "deleted":
        assert store.delete("j")
    elif how == "expired":
        now = T0 + TTL + 1.0
    else:
        now = T0 + TTL  # until == now is expired
    before = store.state("j")
    ran: list[bool] = []
    for complete in (False, True):
        with pytest.raises(LeaseLost):
            write_invoice(
                store, lease, invoices, lambda: ran.append(True), now=now, complete=complete, result="x"
            )
    assert ran == []  # the block never started
    assert invoice_rows(engine, invoices) == []
    assert store.state("j") == before


def test_fenced_block_that_raises_commits_nothing_and_keeps_the_lease(
    store: JobStore, engine: Engine, invoices: Table
) -> None:
    class Boom(Exception):
        pass

    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j")
    before = state(store, "j")

    def fail() -> None:
        raise Boom

    with pytest.raises(Boom):
        write_invoice(store, lease, invoices, fail, now=T0 + 1.0, complete=True, result="paid")
    assert invoice_rows(engine, invoices) == []
    assert state(store, "j") == before
    assert store.complete(lease, "later", now=T0 + 1.0) is True


@pytest.mark.parametrize("complete", [True, False])
def test_fenced_write_of_a_stalled_worker_is_rolled_back(
    store: JobStore, engine: Engine, invoices: Table, complete: bool
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "slow", ttl=0.3)  # database clock
    assert lease is not None
    # the lease expires on the database's clock before the block ends
    with pytest.raises(LeaseLost):
        write_invoice(store, lease, invoices, lambda: time.sleep(0.5), complete=complete, result="late")
    assert invoice_rows(engine, invoices) == []
    row = state(store, "j")
    assert (row.done, row.result, row.fence) == (False, None, 1)
    # the job goes on with the next worker, above the stalled one's fence
    fresh = store.claim("j", "next", ttl=30.0)
    assert fresh is not None and fresh.fence == 2


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
def test_fenced_block_holds_off_claimers_until_commit(
    store: JobStore, engine: Engine, invoices: Table
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j", now=T0, ttl=TTL)
    outcome: list[Lease | None] = []
    with store.fenced(lease, now=T0 + 1.0, complete=True, result="paid") as conn:
        conn.execute(invoices.insert().values(job="j", total=99))
        # a claimer whose clock says the lease has expired must wait for the block
        claimer = threading.Thread(
            target=lambda: outcome.append(store.claim("j", "thief", now=T0 + TTL + 1.0, ttl=TTL)), daemon=True
        )
        claimer.start()
        claimer.join(0.5)
        assert claimer.is_alive(), "a claim went through while the fenced block held the job"
    claimer.join(TIMEOUT)
    assert outcome == [None]  # by then the job was done
    assert invoice_rows(engine, invoices) == [("j", 99)]
    assert state(store, "j").result == "paid"


# -- revoke -------------------------------------------------------------------------------------


def test_revoke_makes_the_holders_token_stale_for_every_later_write(
    store: JobStore, engine: Engine, invoices: Table
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j", now=T0, ttl=TTL)
    assert store.revoke("j") is True
    row = state(store, "j")
    assert (row.owner, row.until, row.fence, row.done) == (None, 0.0, lease.fence + 1, False)
    now = T0 + 1.0  # well inside the revoked lease's time
    assert not store.renew(lease, ttl=TTL, now=now)
    assert not store.complete(lease, "late", now=now)
    assert [bool(v) for v in store.complete_many([(lease, "late")], now=now)] == [False]
    assert not store.release(lease)
    with pytest.raises(LeaseLost):
        write_invoice(store, lease, invoices, now=now)
    assert invoice_rows(engine, invoices) == []
    assert state(store, "j") == row


def test_revoked_job_is_claimable_again_two_fences_on(store: JobStore) -> None:
    store.enqueue("a", ready_at=0.0)
    store.enqueue("b", ready_at=0.0)
    a = claimed(store, "a", now=T0, ttl=TTL)
    b = claimed(store, "b", now=T0, ttl=TTL)
    assert store.revoke("a") and store.revoke("b")
    again = claimed(store, "a", "next", now=T0 + 1.0)
    assert again.fence == a.fence + 2
    [next_b] = store.claim_next("next", ttl=TTL, now=T0 + 1.0)
    assert (next_b.job_id, next_b.fence) == ("b", b.fence + 2)


def test_revoke_of_a_done_missing_or_deleted_job_returns_false_and_changes_nothing(store: JobStore) -> None:
    store.enqueue("done", ready_at=0.0)
    assert store.complete(claimed(store, "done"), "r", now=T0)
    store.enqueue("deleted", ready_at=0.0)
    assert store.delete("deleted")
    before = snapshot(store, ["done", "deleted", "missing"])
    assert store.revoke("done") is False
    assert store.revoke("deleted") is False
    assert store.revoke("missing") is False
    assert snapshot(store, ["done", "deleted", "missing"]) == before
    assert store.state("missing") is None


# -- delete and enqueue again -------------------------------------------------------------------


def test_delete_and_enqueue_again_never_reissues_an_old_fence(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    seen = [claimed(store, "j", now=T0, ttl=TTL).fence]
    seen.append(claimed(store, "j", now=T0 + TTL, ttl=TTL).fence)  # the first lease expired
    assert store.revoke("j")
    seen.append(claimed(store, "j", now=T0 + TTL).fence)
    last = claimed(store, "j", now=T0 + 3 * TTL)
    seen.append(last.fence)
    assert store.complete(last, "r", now=T0 + 3 * TTL)
    for generation in range(3):
        assert store.delete("j") is True
        assert store.enqueue("j", ready_at=0.0) is True
        row = state(store, "j")
        assert (row.owner, row.result, row.done) == (None, None, False)
        lease = claimed(store, "j", now=T0 + 10 * TTL * (generation + 1))
        assert lease.fence > max(seen), f"fence {lease.fence} was handed out before: {seen}"
        seen.append(lease.fence)
    assert seen == sorted(set(seen))


def test_deleted_job_has_no_state_and_is_never_claimed(store: JobStore) -> None:
    for job in ["unclaimed", "held", "done"]:
        store.enqueue(job, ready_at=0.0)
    held = claimed(store, "held")
    assert store.complete(claimed(store, "done"), "r", now=T0)
    for job in ["unclaimed", "held", "done"]:
        assert store.delete(job) is True
        assert store.state(job) is None
        assert store.claim(job, "w", now=T0 + 100.0, ttl=TTL) is None
    assert store.claim_next("w", ttl=TTL, now=T0 + 100.0, limit=10) == []
    # the holder of a deleted job can write nothing more
    assert not store.complete(held, "late", now=T0 + 1.0)
    assert not store.renew(held, ttl=TTL, now=T0 + 1.0)
    with pytest.raises(LeaseLost), store.fenced(held, now=T0 + 1.0):
        pass  # the check at the start refuses


def test_delete_of_a_missing_or_deleted_job_returns_false(store: JobStore) -> None:
    assert store.delete("missing") is False
    assert store.state("missing") is None
    store.enqueue("j", ready_at=0.0)
    assert store.delete("j") is True
    assert store.delete("j") is False


@pytest.mark.parametrize("how", ["unclaimed", "held", "expired", "done"])
def test_enqueue_of_an_existing_job_returns_false_and_changes_nothing(store: JobStore, how: str) -> None:
    assert store.enqueue("j", ready_at=T0 - 50.0) is True
    if how == "held":
        claimed(store, "j", now=T0, ttl=TTL)
    elif how == "expired":
        claimed(store, "j", now=T0 - 20.0, ttl=TTL)
    elif how == "done":
        assert store.complete(claimed(store, "j"), "r", now=T0)
    before = state(store, "j")
    assert store.enqueue("j", ready_at=0.0) is False
    assert store.enqueue("j", ready_at=T0 + 500.0) is False
    assert store.enqueue("j", ready_at=None) is False
    assert state(store, "j") == before


def test_reenqueued_job_is_ready_at_its_new_time(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    claimed(store, "j")
    assert store.delete("j")
    assert store.enqueue("j", ready_at=T0 + 50.0) is True
    assert store.claim_next("w", ttl=TTL, now=T0 + 49.0) == []
    [lease] = store.claim_next("w", ttl=TTL, now=T0 + 50.0)
    assert lease.fence == 2


# -- release with a delay ------------------------------------------------------------------------


def test_release_with_delay_defers_the_job_and_keeps_the_fence(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j", now=T0, ttl=TTL)
    assert store.release(lease, delay=5.0, now=T0 + 1.0) is True
    row = state(store, "j")
    assert (row.owner, row.until, row.fence, row.done) == (None, T0 + 6.0, lease.fence, False)
    assert store.claim("j", "b", now=T0 + 5.999, ttl=TTL) is None
    assert store.claim_next("b", ttl=TTL, now=T0 + 5.999) == []
    # claimable exactly at now + delay, with the next fence
    [again] = store.claim_next("b", ttl=TTL, now=T0 + 6.0)
    assert (again.job_id, again.fence) == ("j", lease.fence + 1)


def test_release_with_delay_is_claimable_by_claim_at_the_boundary(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j", now=T0, ttl=TTL)
    assert store.release(lease, delay=2.5, now=T0 + 1.0)
    assert store.claim("j", "b", now=T0 + 3.4, ttl=TTL) is None
    again = store.claim("j", "b", now=T0 + 3.5, ttl=TTL)
    assert again is not None and again.fence == lease.fence + 1


def test_release_without_delay_is_claimable_at_once(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j", now=T0, ttl=TTL)
    assert store.release(lease)
    [again] = store.claim_next("b", ttl=TTL, now=T0 + 0.001)
    assert again.fence == lease.fence + 1


def test_release_with_delay_by_a_stale_lease_changes_nothing(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    old = claimed(store, "j", now=T0, ttl=TTL)
    new = claimed(store, "j", "b", now=T0 + TTL, ttl=TTL)
    before = state(store, "j")
    assert not store.release(old, delay=100.0, now=T0 + TTL + 1.0)
    assert state(store, "j") == before
    assert store.complete(new, "ok", now=T0 + TTL + 1.0) is True


@pytest.mark.parametrize(
    ("delay", "error"), [(0, InvalidArgument), (-1.0, InvalidArgument), ("5", InvalidArgumentType)]
)
def test_release_rejects_a_bad_delay_and_changes_nothing(
    store: JobStore, delay: Any, error: type[Exception]
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = claimed(store, "j")
    before = state(store, "j")
    with pytest.raises(error):
        store.release(lease, delay=delay, now=T0 + 1.0)
    assert state(store, "j") == before


# -- poisoned jobs -----------------------------------------------------------------------------


def _claim_and_expire(store: JobStore, job_id: str, times: int, start: float) -> float:
    """Claim ``job_id`` ``times`` times, each lease left to expire; returns the last until."""
    now = start
    for _ in range(times):
        lease = claim_one(store, ttl=TTL, now=now, max_attempts=times + 1)
        assert lease.job_id == job_id
        assert lease.until is not None
        now = lease.until
    return now


def test_job_claimed_max_attempts_times_is_skipped_and_listed_as_poisoned(store: JobStore) -> None:
    store.enqueue("p", ready_at=0.0)
    expired_at = _claim_and_expire(store, "p", 3, T0)
    assert state(store, "p").fence == 3
    store.enqueue("healthy", ready_at=0.0)
    now = expired_at + 1.0
    [lease] = store.claim_next("w", ttl=TTL, now=now, limit=10, max_attempts=3)
    assert lease.job_id == "healthy"
    assert store.claim_next("w", ttl=TTL, now=now, limit=10, max_attempts=3) == []
    assert [row.job_id for row in store.poisoned(3, now=now)] == ["p"]
    assert store.poisoned(3, now=now)[0] == state(store, "p")
    # one more attempt allowed: not poisoned, and claimable
    assert store.poisoned(4, now=now) == []
    [fourth] = store.claim_next("w", ttl=TTL, now=now, max_attempts=4)
    assert (fourth.job_id, fourth.fence) == ("p", 4)


def test_job_claimed_fewer_times_than_max_attempts_is_not_poisoned(store: JobStore) -> None:
    store.enqueue("p", ready_at=0.0)
    expired_at = _claim_and_expire(store, "p", 2, T0)
    assert store.poisoned(3, now=expired_at) == []
    [lease] = store.claim_next("w", ttl=TTL, now=expired_at, max_attempts=3)
    assert lease.fence == 3


def test_poisoned_lists_neither_done_nor_held_nor_deleted_jobs(store: JobStore) -> None:
    for job in ["done", "held", "deleted", "listed"]:
        store.enqueue(job, ready_at=0.0)
        for attempt in range(3):
            lease = claimed(store, job, now=T0 + attempt * TTL)
        if job == "done":
            assert store.complete(lease, "r", now=T0 + 2 * TTL)
        elif job == "deleted":
            assert store.delete(job)
    now = T0 + 2 * TTL + 1.0  # the third leases are live
    assert store.poisoned(3, now=now) == []
    assert store.release(claimed(store, "listed", now=T0 + 3 * TTL), delay=1.0, now=T0 + 3 * TTL)
    # "held"'s third lease has expired; "listed" was claimed a fourth time and released
    later = T0 + 3 * TTL + 1.0
    assert [row.job_id for row in store.poisoned(3, now=later)] == ["held", "listed"]
    # a held poisoned job drops off the list while its lease is live
    claimed(store, "held", now=later)
    assert [row.job_id for row in store.poisoned(3, now=later)] == ["listed"]


def test_poisoned_lists_the_longest_ready_first(store: JobStore) -> None:
    for job, start in [("b", T0 + 5.0), ("a", T0)]:
        store.enqueue(job, ready_at=0.0)
        for attempt in range(2):
            claimed(store, job, now=start + attempt * TTL)
    now = T0 + 100.0
    assert [row.job_id for row in store.poisoned(2, now=now)] == ["a", "b"]


@pytest.mark.parametrize(
    ("value", "error"), [(0, InvalidArgument), (True, InvalidArgumentType), (2.0, InvalidArgumentType)]
)
def test_poisoned_rejects_a_bad_max_attempts(store: JobStore, value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        store.poisoned(value, now=T0)


# -- the database's clock ----------------------------------------------------------------------


def test_claim_next_on_the_database_clock(store: JobStore) -> None:
    store.enqueue("a", ready_at=None)
    time.sleep(0.02)
    store.enqueue("b", ready_at=None)
    stamped = state(store, "a").until
    assert abs(stamped - time.time()) < 2.0  # the server runs here: its clock agrees with ours
    before = time.time()
    first = claim_one(store, ttl=30.0)
    after = time.time()
    assert first.job_id == "a"  # enqueued first, ready longest
    assert first.until is not None
    assert before + 30.0 - 1.0 <= first.until <= after + 30.0 + 1.0
    assert state(store, "a").until == first.until
    [second] = store.claim_next("w", ttl=30.0, limit=10)
    assert second.job_id == "b"
    assert store.claim_next("w", ttl=30.0, limit=10) == []


def test_claim_next_on_the_database_clock_reclaims_an_expired_lease(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    first = claim_one(store, "a", ttl=0.3)
    assert store.claim_next("b", ttl=30.0) == []
    time.sleep(0.4)
    [second] = store.claim_next("b", ttl=30.0)
    assert second.fence == first.fence + 1
    assert not store.complete(first, "late")
    assert [bool(v) for v in store.complete_many([(first, "late"), (second, "ok")])] == [False, True]


def test_release_with_delay_on_the_database_clock(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "a", ttl=30.0)
    assert lease is not None
    released_at = time.time()
    # a delay long enough that the reads below come before it ends on a loaded machine too
    # (CI saw more than 0.5 s pass between the release and the next claim)
    assert store.release(lease, delay=2.0) is True
    until = state(store, "j").until
    assert released_at + 2.0 - 1.0 <= until <= released_at + 2.0 + 1.0
    assert store.claim_next("b", ttl=30.0) == []
    assert store.claim("j", "b", ttl=30.0) is None
    time.sleep(2.2)
    [again] = store.claim_next("b", ttl=30.0)
    assert again.fence == lease.fence + 1


def test_poisoned_on_the_database_clock(store: JobStore) -> None:
    store.enqueue("p", ready_at=0.0)
    for _ in range(3):
        lease = store.claim("p", "w", ttl=30.0)
        assert lease is not None
        assert store.poisoned(3) == []  # held
        assert store.release(lease)
    assert [row.job_id for row in store.poisoned(3)] == ["p"]
    assert store.claim_next("w", ttl=30.0, max_attempts=3) == []
