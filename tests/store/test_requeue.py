"""Requeue of a poisoned job: its attempts given back, its fence never lowered.

Each test runs on the database under test. ``claim_next(max_attempts=N)`` skips a job claimed
``N`` times; ``requeue`` lets it be claimed ``N`` times more, counted from its fence then (a
base kept in the attempts table: the jobs table keeps the contract's columns). Every token
handed out before stays stale; a held job is not requeued; a store without the attempts table
says what it needs; bad input changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Column, Engine, Integer, MetaData, Table, inspect, select

from fencing import (
    ConfigurationError,
    History,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    Lease,
    attempts_table,
    history_table,
    jobs_table,
)
from fencing._sql.checks import FENCE_MAX
from fencing._sql.schema import as_text
from tests import asyncfront

TTL = 30.0


def tables() -> dict[str, Any]:
    metadata = MetaData()
    return {
        "table": jobs_table(metadata, "rq_jobs"),
        "history": History(history_table(metadata, "rq_history"), retention=None),
        "attempts": attempts_table(metadata, "rq_attempts"),
    }


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def store(request: pytest.FixtureRequest, engine: Engine, target: str) -> Iterator[Any]:
    """A store that requeues (its own jobs and attempts tables), recording its history; on
    each front (the async one's calls made from the test body, as conftest's store)."""
    yield from asyncfront.store_on_front(request, engine, target, tables())


def claim_until_poisoned(
    store: JobStore, job_id: str, max_attempts: int, now: float
) -> tuple[list[Lease], float]:
    """Claim ``job_id`` and let each lease run out until ``claim_next`` skips it."""
    leases = []
    while got := store.claim_next("w", ttl=TTL, now=now, max_attempts=max_attempts):
        assert [lease.job_id for lease in got] == [job_id]
        leases += got
        now += TTL  # the lease has run out
    return leases, now


def bases(store: JobStore) -> dict[str, int]:
    assert store.attempts is not None
    a = store.attempts
    with store.engine.connect() as conn:
        return {row[0]: row[1] for row in conn.execute(select(as_text(a.c.id), a.c.base))}


def test_a_poisoned_job_requeued_gets_its_attempts_back_and_its_fence_goes_on(store: JobStore) -> None:
    assert store.enqueue("a", ready_at=0.0)
    leases, now = claim_until_poisoned(store, "a", 2, 100.0)
    assert [lease.fence for lease in leases] == [1, 2]
    assert [j.job_id for j in store.poisoned(2, now=now)] == ["a"]

    assert store.requeue("a", now=now) is True
    assert store.poisoned(2, now=now) == []
    assert bases(store) == {"a": 2}
    again, now = claim_until_poisoned(store, "a", 2, now)
    # two attempts more, the fence above every one handed out before
    assert [lease.fence for lease in again] == [3, 4]
    assert [j.job_id for j in store.poisoned(2, now=now)] == ["a"]
    # every token handed out before is stale, the last one's lease run out
    for lease in leases + again:
        assert not store.complete(lease, "late", now=now)
    state = store.state("a")
    assert state is not None and (state.fence, state.done, state.result) == (4, False, None)
    # without max_attempts the job was always claimable
    assert [lease.fence for lease in store.claim_next("w", ttl=TTL, now=now)] == [5]


def test_a_requeued_job_keeps_its_place_and_a_deferred_one_is_ready_at_once(store: JobStore) -> None:
    store.enqueue("old", ready_at=0.0)
    claim_until_poisoned(store, "old", 1, 10.0)
    store.enqueue("later", ready_at=1_000.0)
    store.enqueue("fresh", ready_at=50.0)
    assert store.requeue("old", now=100.0) and store.requeue("later", now=100.0)
    after = {j: store.state(j) for j in ("old", "later")}
    assert after["old"] is not None and after["old"].until == 10.0 + TTL and after["old"].owner is None
    assert after["later"] is not None and after["later"].until == 100.0  # ready now, not at 1,000
    # claimed longest ready first: the requeued job at its old place, the deferred one last
    got = [store.claim_next("w", ttl=TTL, now=100.0, max_attempts=1) for _ in range(4)]
    assert [[lease.job_id for lease in g] for g in got] == [["old"], ["fresh"], ["later"], []]


def test_a_held_done_deleted_or_missing_job_is_not_requeued(store: JobStore) -> None:
    for job in ("held", "done", "deleted"):
        store.enqueue(job, ready_at=0.0)
    held = store.claim("held", "w", ttl=TTL, now=10.0)
    assert held is not None
    done = store.claim("done", "w", ttl=TTL, now=10.0)
    assert done is not None and store.complete(done, "r", now=11.0)
    assert store.delete("deleted")
    before = {j: store.state(j) for j in ("held", "done")}
    for job in ("held", "done", "deleted", "missing"):
        assert store.requeue(job, now=20.0) is False
    assert {j: store.state(j) for j in ("held", "done")} == before
    assert bases(store) == {}
    # the holder's lease is untouched; once it runs out (until == now) the job can be requeued
    assert isinstance(store.renew(held, ttl=TTL, now=20.0), Lease)
    assert store.requeue("held", now=50.0) is True
    assert not store.complete(held, "late", now=50.0)


def test_the_last_fence_is_never_handed_out_by_a_requeued_claim(store: JobStore) -> None:
    store.enqueue("a", ready_at=0.0)
    t = store.table
    with store.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == as_text("a")).values(fence=FENCE_MAX - 1))
    assert store.requeue("a", now=1.0)
    [lease] = store.claim_next("w", ttl=TTL, now=1.0, max_attempts=3)
    assert lease.fence == FENCE_MAX
    assert store.requeue("a", now=100.0)
    assert store.claim_next("w", ttl=TTL, now=100.0, max_attempts=3) == []
    state = store.state("a")
    assert state is not None and state.fence == FENCE_MAX


def test_the_history_records_the_requeue(store: JobStore) -> None:
    store.enqueue("a", ready_at=0.0)
    claim_until_poisoned(store, "a", 1, 10.0)
    store.requeue("a", now=100.0)
    events = [(e.event, e.owner, e.fence) for e in store.history("a")]
    assert events == [("claim", "w", 1), ("requeue", None, 1)]
    assert store.metrics.snapshot()["requeue.accepted"] == 1


def test_a_store_without_the_attempts_table_says_what_requeue_needs(engine: Engine) -> None:
    plain = JobStore(engine, jobs_table(MetaData(), "rq_plain"))
    plain.create_table()
    plain.enqueue("a", ready_at=0.0)
    before = plain.state("a")
    with pytest.raises(ConfigurationError, match=r"attempts=fencing.attempts_table\(metadata\)"):
        plain.requeue("a")
    assert plain.state("a") == before


def test_bad_input_is_refused_and_changes_nothing(store: JobStore, engine: Engine) -> None:
    store.enqueue("a", ready_at=0.0)
    claim_until_poisoned(store, "a", 1, 10.0)
    before = store.state("a")
    bad: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"job_id": 7}, InvalidArgumentType),
        ({"job_id": "a", "now": float("nan")}, InvalidArgument),
        ({"job_id": "a", "now": "soon"}, InvalidArgumentType),
    ]
    for kwargs, error in bad:
        with pytest.raises(error):
            store.requeue(**kwargs)
    assert store.state("a") == before and bases(store) == {}
    with pytest.raises(InvalidArgumentType, match="attempts must be a sqlalchemy Table"):
        JobStore(engine, attempts="rq_attempts")  # type: ignore[arg-type]
    other = Table("rq_other", MetaData(), Column("id", Integer, primary_key=True))
    with pytest.raises(InvalidArgument, match="'rq_other' is not an attempts table"):
        JobStore(engine, attempts=other)


def test_create_table_creates_the_attempts_table_and_the_jobs_table_keeps_its_columns(
    store: JobStore,
) -> None:
    names = inspect(store.engine).get_table_names()
    assert {"rq_jobs", "rq_attempts"} <= set(names)
    columns = [c["name"] for c in inspect(store.engine).get_columns("rq_jobs")]
    assert columns == ["id", "owner", "until", "fence", "result", "done"]


@pytest.mark.sync_only("threads of workers: the rules are the same on the async front")
def test_requeues_racing_claims_never_hand_out_a_fence_twice(store: JobStore) -> None:
    """Workers claim with max_attempts=1 while an operator requeues every job over and over:
    each fence of a job is handed out once, in order, and a claim never takes a held job."""
    jobs = [f"j{n}" for n in range(4)]
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
    taken: list[Lease] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(name: str) -> None:
        try:
            for _ in range(15):
                got = store.claim_next(name, ttl=0.05, max_attempts=1, limit=2)
                taken.extend(got)
        except BaseException as exc:
            errors.append(exc)

    def operator() -> None:
        try:
            while not stop.is_set():
                for job in jobs:
                    store.requeue(job)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(3)]
    requeuer = threading.Thread(target=operator)
    requeuer.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    requeuer.join()
    assert errors == []
    assert taken, "no claim succeeded"
    for job in jobs:
        fences = [lease.fence for lease in taken if lease.job_id == job]
        assert fences == sorted(set(fences)), f"{job}: a fence handed out twice or out of order: {fences}"


def test_ids_are_keys_not_text(store: JobStore) -> None:
    """An id that differs only in case or trailing space is another job (bytes on MariaDB)."""
    for job in ("A", "a", "a "):
        store.enqueue(job, ready_at=0.0)
    assert len(store.claim_next("w", ttl=TTL, now=1.0, limit=3, max_attempts=1)) == 3
    assert store.requeue("a", now=100.0)
    assert bases(store) == {"a": 1}
    assert [lease.job_id for lease in store.claim_next("w", ttl=TTL, now=100.0, limit=3, max_attempts=1)] == [
        "a"
    ]


@pytest.mark.sync_only("the overview reads through a sync engine")
def test_the_overview_counts_a_requeued_job_ready_as_the_claim_does(store: JobStore) -> None:
    from fencing.overview import Overview

    ov = Overview(store.engine, store.table, attempts=store.attempts)
    for job in ("a", "b"):
        store.enqueue(job, ready_at=0.0)
        claim_until_poisoned(store, job, 1, 10.0)
    assert [j.job_id for j in ov.jobs("poisoned", max_attempts=1)] == ["a", "b"]
    assert store.requeue("b")
    assert [j.job_id for j in ov.jobs("poisoned", max_attempts=1)] == ["a"]
    assert [j.job_id for j in ov.jobs("ready", max_attempts=1)] == ["b"]
    summary = ov.summary(max_attempts=1)
    assert (summary.ready, summary.poisoned) == (1, 1)
    # the same store's overview without the attempts table counts fences only
    plain = Overview(store.engine, store.table)
    assert [j.job_id for j in plain.jobs("poisoned", max_attempts=1)] == ["a", "b"]


# -- against a small model -------------------------------------------------------------------

MAX_ATTEMPTS = 2
#: (operation, job, seconds): claim_next by one of two workers, requeue, revoke, complete
#: the latest lease of the job, or let time pass
OPERATIONS = st.tuples(
    st.sampled_from(["claim_next", "requeue", "revoke", "complete", "tick"]),
    st.sampled_from(["a", "b"]),
    st.sampled_from([0.0, 5.0, 30.0]),
)


class AttemptsModel:
    """The rules of requeue and max_attempts in plain Python: a job's attempts are its fence
    less its base (the fence at its last requeue)."""

    def __init__(self) -> None:
        self.rows = {job: {"owner": None, "until": 0.0, "fence": 0, "done": False} for job in "ab"}
        self.base: dict[str, int] = {}

    def ready(self, job: str, now: float) -> bool:
        r = self.rows[job]
        attempts = r["fence"] - self.base.get(job, 0)
        return not r["done"] and r["until"] <= now and attempts < MAX_ATTEMPTS

    def claim_next(self, owner: str, now: float) -> tuple[str, int] | None:
        ready = sorted((r["until"], job) for job, r in self.rows.items() if self.ready(job, now))
        if not ready:
            return None
        job = ready[0][1]
        r = self.rows[job]
        r.update(owner=owner, until=now + TTL, fence=r["fence"] + 1)
        return job, r["fence"]

    def requeue(self, job: str, now: float) -> bool:
        r = self.rows[job]
        if r["done"] or (r["owner"] is not None and r["until"] > now):
            return False
        r.update(owner=None, until=min(r["until"], now))
        self.base[job] = r["fence"]
        return True

    def revoke(self, job: str) -> bool:
        r = self.rows[job]
        if r["done"]:
            return False
        r.update(owner=None, until=0.0, fence=r["fence"] + 1)
        return True

    def complete(self, job: str, owner: str, fence: int, now: float) -> bool:
        r = self.rows[job]
        if r["done"] or r["owner"] != owner or r["fence"] != fence or r["until"] <= now:
            return False
        r.update(done=True)
        return True


@pytest.mark.sync_only("the rules are the sync store's; the async front carries them (tested above)")
def test_requeue_and_max_attempts_follow_the_model(store: JobStore) -> None:
    t, a = store.table, store.attempts
    assert a is not None
    examples = 60 if store.engine.dialect.name == "sqlite" else 25

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(OPERATIONS, max_size=25))
    def run(operations: list[tuple[str, str, float]]) -> None:
        with store.engine.begin() as conn:
            conn.execute(a.delete())
            conn.execute(t.delete())
        for job in "ab":
            store.enqueue(job, ready_at=0.0)
        model, now, leases, turn = AttemptsModel(), 100.0, {}, 0
        for op, job, seconds in operations:
            if op == "tick":
                now += seconds
            elif op == "claim_next":
                turn += 1
                owner = f"w{turn % 2}"
                got = store.claim_next(owner, ttl=TTL, now=now, max_attempts=MAX_ATTEMPTS)
                expected = model.claim_next(owner, now)
                assert [(lease.job_id, lease.fence) for lease in got] == ([expected] if expected else [])
                leases.update({lease.job_id: lease for lease in got})
            elif op == "requeue":
                assert store.requeue(job, now=now) == model.requeue(job, now)
            elif op == "revoke":
                assert store.revoke(job) == model.revoke(job)
            elif job in leases:
                lease = leases[job]
                assert bool(store.complete(lease, "r", now=now)) == model.complete(
                    job, lease.owner, lease.fence, now
                )
            for name, row in model.rows.items():
                state = store.state(name)
                assert state is not None
                assert (state.owner, state.until, state.fence, state.done) == (
                    row["owner"],
                    row["until"],
                    row["fence"],
                    row["done"],
                ), (name, operations)
            assert bases(store) == model.base
            poisoned = {j.job_id for j in store.poisoned(MAX_ATTEMPTS, now=now)}
            assert poisoned == {
                j
                for j, r in model.rows.items()
                if not r["done"] and r["until"] <= now and not model.ready(j, now)
            }

    run()


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def unrecorded(request: pytest.FixtureRequest, engine: Engine, target: str) -> Iterator[Any]:
    """A requeueing store without a history: nothing else to write at the end, so the store may
    choose its shortest way to run a write (on PostgreSQL, one statement in autocommit)."""
    chosen = {k: v for k, v in tables().items() if k != "history"}
    yield from asyncfront.store_on_front(request, engine, target, chosen)


#: a trigger that makes every insert into the attempts table fail, per dialect
_FAILING_INSERT = {
    "sqlite": [
        "CREATE TRIGGER rq_boom BEFORE INSERT ON rq_attempts BEGIN SELECT RAISE(ABORT, 'injected'); END"
    ],
    "postgresql": [
        "CREATE OR REPLACE FUNCTION rq_boom() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'injected'; END $$ "
        "LANGUAGE plpgsql",
        "CREATE TRIGGER rq_boom BEFORE INSERT ON rq_attempts FOR EACH ROW EXECUTE FUNCTION rq_boom()",
    ],
    "mysql": [
        "CREATE TRIGGER rq_boom BEFORE INSERT ON rq_attempts FOR EACH ROW "
        "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected'"
    ],
}


def test_a_requeue_that_fails_part_way_changes_nothing(unrecorded: JobStore, engine: Engine) -> None:
    """requeue writes the job, then its base out and in: one transaction. Its last statement
    failing (here a trigger) leaves the job and its base as they were: a poisoned job stays
    poisoned and is not half requeued (on PostgreSQL it once ran its writes in autocommit)."""
    store = unrecorded
    store.enqueue("j", ready_at=0.0)
    claim_until_poisoned(store, "j", 3, 100.0)
    assert store.requeue("j", now=1000.0)
    for n in range(2):
        lease = store.claim("j", "w", ttl=TTL, now=2000.0 + n * 100)
        assert lease is not None
        assert store.release(lease)
    before_job, before_bases = store.state("j"), bases(store)
    assert before_bases == {"j": 3}
    with engine.begin() as conn:
        for sql in _FAILING_INSERT[engine.dialect.name]:
            conn.exec_driver_sql(sql)
    with pytest.raises(Exception, match="injected"):
        store.requeue("j", now=4000.0)
    assert store.state("j") == before_job
    assert bases(store) == before_bases
    assert [j.job_id for j in store.poisoned(3, now=4000.0)] == []  # still 2 of its 3 attempts used


def test_concurrent_requeues_of_one_job_each_answer_and_none_fails(engine: Engine) -> None:
    """Operators requeueing one job at once: each answers True or False; none fails half-way
    (on PostgreSQL they once raised unique violations after committing part of their writes).
    Threads of the sync store, without a history: the rules are the same on the async front."""
    store = JobStore(engine, **{k: v for k, v in tables().items() if k != "history"})
    store.create_table()
    store.enqueue("j", ready_at=0.0)
    answers: list[bool] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def operator() -> None:
        try:
            start.wait()
            for _ in range(15):
                answers.append(store.requeue("j"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=operator) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(answers) == 60 and all(answers)  # a ready job is requeued every time
    assert bases(store) == {"j": 0}
