"""claim_next takes the oldest enqueued first: ``enqueue`` stamps the database's now by
default, and jobs ready at the same instant have a fixed tie-break, the id. On every
backend."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import Engine

from fencing import JobStore, Lease

pytestmark = pytest.mark.dialect

TTL = 60.0
#: ids whose key order is the reverse of the order they are enqueued in, so that an
#: implementation taking jobs by id would come out wrong
N = 24
NEWEST_FIRST_IDS = [f"job-{N - k:03d}" for k in range(N)]


def ids(leases: list[Lease]) -> list[str]:
    return [lease.job_id for lease in leases]


def enqueue_all(store: JobStore, job_ids: list[str], **kwargs: float) -> None:
    for job_id in job_ids:
        assert store.enqueue(job_id, **kwargs) is True


def enqueue_apart(store: JobStore, job_ids: list[str]) -> None:
    """Enqueue on the database's clock, each at a later reading of it: SQLite's counts
    milliseconds, and two jobs enqueued within one are ready at the same instant (their tie
    is broken by id, see below); the servers' count microseconds."""
    for job_id in job_ids:
        assert store.enqueue(job_id) is True
        if store.engine.dialect.name == "sqlite":
            time.sleep(store.clock_resolution * 1.5)


def test_default_enqueue_stamps_the_database_clock(store: JobStore) -> None:
    before = time.time()
    store.enqueue("j")
    after = time.time()
    row = store.state("j")
    assert row is not None
    # the server runs on this machine: its clock agrees with ours to well within a second
    assert before - 1.0 <= row.until <= after + 1.0
    assert (row.owner, row.fence, row.result, row.done) == (None, 0, None, False)


def test_job_enqueued_with_the_database_clock_is_claimable_at_once(store: JobStore) -> None:
    store.enqueue("j")
    [lease] = store.claim_next("w", ttl=TTL)
    assert (lease.job_id, lease.fence) == ("j", 1)
    store.enqueue("k")
    assert store.claim("k", "w", ttl=TTL) is not None


def test_default_enqueues_come_out_one_by_one_in_enqueue_order(store: JobStore) -> None:
    enqueue_apart(store, NEWEST_FIRST_IDS)
    taken = []
    for _ in NEWEST_FIRST_IDS:
        taken += ids(store.claim_next("w", ttl=TTL))
    assert taken == NEWEST_FIRST_IDS
    assert store.claim_next("w", ttl=TTL) == []


@pytest.mark.parametrize("limit", [2, 5, 8])
def test_default_enqueues_come_out_in_batches_in_enqueue_order(store: JobStore, limit: int) -> None:
    enqueue_apart(store, NEWEST_FIRST_IDS)
    for start in range(0, N, limit):
        batch = store.claim_next(f"w{start}", ttl=TTL, limit=limit)
        # the batch is the `limit` oldest jobs left (the order inside the list is the database's)
        assert sorted(ids(batch)) == sorted(NEWEST_FIRST_IDS[start : start + limit])
    assert store.claim_next("w", ttl=TTL, limit=limit) == []


def test_default_and_explicit_ready_times_come_out_by_ready_time(store: JobStore) -> None:
    t = time.time()
    store.enqueue("d1")  # the database's now, about t
    store.enqueue("p-old", ready_at=t - 100.0)
    store.enqueue("d2")
    store.enqueue("p-mid", ready_at=t - 50.0)
    store.enqueue("future", ready_at=t + 3600.0)
    store.enqueue("d3")
    taken = []
    for _ in range(6):
        batch = store.claim_next("w", ttl=TTL)
        assert store.complete_many([(lease, "ok") for lease in batch]) == [True] * len(batch)
        taken.append(ids(batch))
    assert taken == [["p-old"], ["p-mid"], ["d1"], ["d2"], ["d3"], []]
    # and the deferred job comes when the clock reaches it
    assert ids(store.claim_next("w", ttl=TTL, now=t + 3600.0)) == ["future"]


def test_explicit_ready_times_come_out_by_ready_time_not_by_enqueue_order(store: JobStore) -> None:
    for n in [3, 0, 4, 1, 2]:
        store.enqueue(f"j{n}", ready_at=100.0 + n)
    taken = [lease.job_id for _ in range(5) for lease in store.claim_next("w", ttl=TTL, now=200.0)]
    assert taken == ["j0", "j1", "j2", "j3", "j4"]


def test_jobs_ready_at_the_same_instant_have_a_fixed_tie_break(store: JobStore) -> None:
    # the contract's rows: all ready at 0
    enqueue_all(store, ["c", "a", "d", "b"], ready_at=0.0)
    taken = [lease.job_id for _ in range(4) for lease in store.claim_next("w", ttl=TTL, now=10.0)]
    # by id on every backend: the order of the ready index (done, until, id), so no sort
    assert taken == ["a", "b", "c", "d"]


def test_poisoned_lists_jobs_ready_at_the_same_instant_in_the_claim_order(store: JobStore) -> None:
    enqueue_all(store, ["c", "a", "b"], ready_at=0.0)
    for job_id in ["c", "a", "b"]:
        lease = store.claim(job_id, "w", now=1.0, ttl=1.0)  # expires at 2.0, all alike
        assert lease is not None
    listed = [row.job_id for row in store.poisoned(1, now=5.0)]
    assert listed == ["a", "b", "c"]


@pytest.mark.backend("sqlite")
def test_sqlite_revived_tombstone_keeps_its_place_among_jobs_ready_at_the_same_instant(
    store: JobStore,
) -> None:
    # documented: the revive updates the old row, whose rowid is kept. With the default
    # (database-clock) enqueue the revived job is stamped later than everything enqueued
    # before, so this only shows among jobs ready at exactly the same instant
    enqueue_all(store, ["a", "b"], ready_at=0.0)
    assert store.delete("a")
    assert store.enqueue("a", ready_at=0.0) is True
    taken = [lease.job_id for _ in range(2) for lease in store.claim_next("w", ttl=TTL, now=10.0)]
    assert taken == ["a", "b"]


def test_revived_tombstone_enqueued_with_the_database_clock_comes_after_older_jobs(store: JobStore) -> None:
    store.enqueue("a")
    assert store.delete("a")
    store.enqueue("b")
    time.sleep(0.002)  # past SQLite's millisecond clock: a and b are not ready at the same instant
    assert store.enqueue("a") is True
    taken = [lease.job_id for _ in range(2) for lease in store.claim_next("w", ttl=TTL)]
    assert taken == ["b", "a"]


def _sqlite_plan(engine: Engine, stmt: object, params: dict[str, object]) -> list[str]:
    compiled = stmt.compile(dialect=engine.dialect)  # type: ignore[attr-defined]
    values = compiled.construct_params(params)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "EXPLAIN QUERY PLAN " + compiled.string, tuple(values[name] for name in compiled.positiontup)
        ).all()
    return [row[-1] for row in rows]


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize("clock", ["caller", "database"])
def test_sqlite_claim_next_orders_through_the_index_without_a_sort(
    store: JobStore, engine: Engine, clock: str
) -> None:
    s = store._ctx.by_caller if clock == "caller" else store._ctx.by_database
    params = {"holder": "w", "limit": 10, "max_fence": 5, "now": 1.0, "new_until": 2.0, "ttl": 1.0}
    for stmt in (s.pick_ready, s.claim_next_returning, s.poisoned):
        plan = _sqlite_plan(engine, stmt, params)
        assert any("USING INDEX ix_jobs_ready" in step for step in plan), plan
        assert not any("TEMP B-TREE" in step for step in plan), plan
