"""complete_and_claim_next: a worker's step, one completion and the next claim in one
transaction, with every guarantee of the two calls it replaces. On every backend."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import Engine, event

from fencing import InvalidArgument, JobState, JobStore, Lease

pytestmark = pytest.mark.dialect

TTL = 60.0
NOW = 100.0


def enqueue(store: JobStore, *job_ids: str) -> None:
    for job_id in job_ids:
        assert store.enqueue(job_id, ready_at=0.0)


def commits(engine: Engine) -> list[int]:
    """A counter of the engine's commits (a listener: the store then runs through Core)."""
    seen = [0]

    @event.listens_for(engine, "commit")
    def count(conn: Any) -> None:
        seen[0] += 1

    return seen


def test_a_step_completes_the_lease_and_claims_the_next_job_in_one_commit(store: JobStore) -> None:
    enqueue(store, "a", "b")
    [lease] = store.claim_next("w", ttl=TTL, now=NOW)
    seen = commits(store.engine)
    accepted, leases = store.complete_and_claim_next([(lease, "done-a")], "w", ttl=TTL, now=NOW)
    assert (accepted, leases) == ([True], [Lease("b", "w", 1, NOW + TTL)])
    assert seen[0] == 1
    assert store.state("a") == JobState("a", "w", NOW + TTL, 1, "done-a", True)


def test_a_stale_completion_is_refused_and_the_claim_still_happens(store: JobStore) -> None:
    enqueue(store, "a", "b")
    stale = store.claim("a", "old", ttl=1.0, now=NOW)
    assert stale is not None
    current = store.claim("a", "new", ttl=TTL, now=NOW + 5)  # the old lease expired: taken over
    assert current is not None
    accepted, leases = store.complete_and_claim_next([(stale, "late")], "old", ttl=TTL, now=NOW + 6)
    assert [bool(v) for v in accepted] == [False]
    assert [lease.job_id for lease in leases] == ["b"]
    state = store.state("a")
    assert state is not None and (state.owner, state.fence, state.result, state.done) == (
        "new",
        2,
        None,
        False,
    )
    assert store.complete(current, "on time", now=NOW + 7)


def test_a_step_with_nothing_to_complete_is_a_claim_and_with_nothing_ready_a_completion(
    store: JobStore,
) -> None:
    enqueue(store, "a")
    accepted, leases = store.complete_and_claim_next([], "w", ttl=TTL, now=NOW)
    assert accepted == [] and [lease.job_id for lease in leases] == ["a"]
    accepted, more = store.complete_and_claim_next([(leases[0], "r")], "w", ttl=TTL, now=NOW)
    assert (accepted, more) == ([True], [])


def test_a_bad_argument_changes_nothing(store: JobStore) -> None:
    enqueue(store, "a", "b")
    [lease] = store.claim_next("w", ttl=TTL, now=NOW)
    with pytest.raises(InvalidArgument, match="limit"):
        store.complete_and_claim_next([(lease, "r")], "w", ttl=TTL, now=NOW, limit=0)
    assert store.state("a") == JobState("a", "w", NOW + TTL, 1, None, False)
    assert store.state("b") == JobState("b", None, 0.0, 0, None, False)


def test_a_step_in_the_callers_transaction_rolls_back_with_it(store: JobStore, engine: Engine) -> None:
    enqueue(store, "a", "b")
    [lease] = store.claim_next("w", ttl=TTL, now=NOW)
    with engine.connect() as conn, conn.begin() as tx:
        accepted, leases = store.complete_and_claim_next([(lease, "r")], "w", ttl=TTL, now=NOW, conn=conn)
        assert accepted == [True] and [x.job_id for x in leases] == ["b"]
        tx.rollback()
    assert store.state("a") == JobState("a", "w", NOW + TTL, 1, None, False)
    assert store.state("b") == JobState("b", None, 0.0, 0, None, False)


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
def test_workers_stepping_at_once_finish_every_job_exactly_once(store: JobStore) -> None:
    jobs = [f"j{n:03d}" for n in range(120)]
    enqueue(store, *jobs)
    handed: list[tuple[str, int]] = []
    accepted: Counter[str] = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        try:
            leases = store.claim_next(name, ttl=TTL)
            while leases:
                with lock:
                    handed.extend((lease.job_id, lease.fence) for lease in leases)
                done, leases_next = store.complete_and_claim_next(
                    [(lease, name) for lease in leases], name, ttl=TTL, limit=2
                )
                with lock:
                    accepted.update(lease.job_id for lease, ok in zip(leases, done, strict=True) if ok)
                leases = leases_next
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(handed) == len(set(handed)) == len(jobs)  # no (job, fence) twice, none lost
    assert accepted == Counter(jobs)
    for job in jobs:
        state = store.state(job)
        assert state is not None and state.done and state.fence == 1
