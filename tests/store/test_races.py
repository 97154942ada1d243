"""Races: claimers at the same instant in threads and in processes, and late writers.

A claimable job has exactly one winner however many claim it at once, a fence is handed
out once, and a writer whose lease was taken over never stores anything.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sqlite3
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

import service
from fencing import JobState, JobStore, Lease
from fencing.asyncio import AsyncJobStore
from tests import asyncfront
from tests.backends import async_engine_for, engine_for
from tests.processes import reap

THREADS = 8
ROUNDS = 50
PROCESSES = 4
PROCESS_ROUNDS = 30
LATE_ROUNDS = 30
TIMEOUT = 60.0


def _in_lockstep(threads: int, rounds: int, body: Callable[[int, int], Any]) -> list[list[Any]]:
    """``body(thread, round)`` on ``threads`` threads, all released together every round.

    Returns ``results[round][thread]``; an exception in any thread is raised here.
    """
    barrier = threading.Barrier(threads)
    results: list[list[Any]] = [[None] * threads for _ in range(rounds)]
    errors: list[BaseException] = []

    def run(thread: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(timeout=TIMEOUT)
                results[r][thread] = body(thread, r)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    workers = [threading.Thread(target=run, args=(i,), name=f"racer-{i}") for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(TIMEOUT)
    assert not any(worker.is_alive() for worker in workers), "a racer is stuck"
    if errors:
        raise errors[0]
    return results


# -- threads ------------------------------------------------------------------------------


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
def test_threads_claiming_at_the_same_now_have_exactly_one_winner(store: JobStore) -> None:
    store.enqueue("contended", ready_at=0.0)

    def claim(thread: int, r: int) -> Lease | None:
        # every round starts exactly when the previous lease ends: now == until is claimable
        return store.claim("contended", f"w{thread}", now=r * 10.0, ttl=10.0)

    rounds = _in_lockstep(THREADS, ROUNDS, claim)

    for r, leases in enumerate(rounds):
        winners = [lease for lease in leases if lease is not None]
        assert len(winners) == 1, f"round {r}: {leases}"
        assert winners[0].fence == r + 1, f"round {r}: the fence must go up by exactly one"
        assert winners[0].until == r * 10.0 + 10.0
    last = next(lease for lease in rounds[-1] if lease is not None)
    # ROUNDS claims, each +1 and none skipped or repeated
    assert store.state("contended") == JobState("contended", last.owner, ROUNDS * 10.0, ROUNDS, None, False)


@pytest.mark.backend("sqlite")
def test_claim_many_has_exactly_one_winner_every_round(target: str) -> None:
    service.init_db(target)
    service.enqueue(target, "job")
    owners = [f"w{i}" for i in range(THREADS)]

    for r in range(ROUNDS):
        fences = service.claim_many(target, "job", owners, r * 10.0, 10.0)
        winners = [i for i, fence in enumerate(fences) if fence is not None]
        assert len(winners) == 1, f"round {r}: {fences}"
        assert fences[winners[0]] == r + 1
        row = service.state(target, "job")
        assert row is not None
        assert (row["owner"], row["fence"], row["until"]) == (owners[winners[0]], r + 1, r * 10.0 + 10.0)

    # the last lease is live until ROUNDS * 10: nobody wins it
    assert service.claim_many(target, "job", owners, ROUNDS * 10.0 - 0.5, 1.0) == [None] * THREADS
    assert service.state(target, "job")["fence"] == ROUNDS  # type: ignore[index]


def _descriptors_on(path: str) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == path:
                count += 1
        except OSError:  # closed between listdir and readlink
            pass
    return count


def _claim_threads() -> int:
    return sum(t.name.startswith("fencing-claim") for t in threading.enumerate())


@pytest.mark.backend("sqlite")
def test_claim_many_runs_the_claims_at_the_same_time(target: str) -> None:
    service.init_db(target)
    service.enqueue(target, "job")
    owners = [f"w{i}" for i in range(THREADS)]
    db_file = os.path.realpath(target)
    outcome: list[Any] = []

    def race() -> None:
        try:
            outcome.append(service.claim_many(target, "job", owners, 0.0, 5.0))
        except BaseException as exc:
            outcome.append(exc)

    # while another connection holds the write lock every claim waits inside the database,
    # each on its own connection: claims that run at once show up as connections open at once
    blocker = sqlite3.connect(target, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        connections_before = _descriptors_on(db_file)
        caller = threading.Thread(target=race, name="claim-many-caller")
        caller.start()
        in_flight, threads = 0, 0
        deadline = time.monotonic() + 3.0  # well inside the library's 5 s busy timeout
        while time.monotonic() < deadline:
            threads = max(threads, _claim_threads())
            in_flight = max(in_flight, _descriptors_on(db_file) - connections_before)
            if threads >= THREADS and in_flight >= THREADS - 1:
                break
            time.sleep(0.01)
        still_waiting = caller.is_alive() and not outcome
    finally:
        blocker.rollback()
        blocker.close()
    caller.join(TIMEOUT)

    assert not caller.is_alive()
    assert still_waiting, "claim_many returned while the write lock was held by someone else"
    assert threads == THREADS, f"expected {THREADS} 'fencing-claim' threads at once, saw {threads}"
    assert in_flight >= 2, f"claims ran one after another: {in_flight} connection(s) in flight at once"
    fences = outcome[0]
    assert not isinstance(fences, BaseException), fences
    assert sorted(fences, key=lambda f: f is not None) == [None] * (THREADS - 1) + [1]


# -- processes ----------------------------------------------------------------------------


def _claim_rounds_in_a_process(
    target: str, front: str, name: str, rounds: int, barrier: Any, out: Any
) -> None:
    """A worker process with its own engine: every round, claim two jobs the moment all are ready.

    ``front`` is the store the test's fixture runs: ``sync`` (``JobStore``) or ``async``
    (``AsyncJobStore`` on the asyncio driver, awaited on a loop of the process's own)."""
    won: list[tuple[str, int, int]] = []
    problem = None
    loop = asyncio.new_event_loop()
    claim: Callable[..., Lease | None]
    if front == asyncfront.ASYNC:
        async_engine = async_engine_for(target)
        async_store = AsyncJobStore(async_engine)

        def claim(*args: Any, **kwargs: Any) -> Lease | None:
            return loop.run_until_complete(async_store.claim(*args, **kwargs))

        def dispose() -> None:
            loop.run_until_complete(async_engine.dispose())
    else:
        engine = engine_for(target)
        store = JobStore(engine)
        claim = store.claim

        def dispose() -> None:
            store.engine.dispose()
            engine.dispose()

    try:
        for r in range(rounds):
            barrier.wait(timeout=TIMEOUT)
            # a job of its own per round, claimed once by everybody
            lease = claim(f"job-{r}", name, now=0.0, ttl=1000.0)
            if lease is not None:
                won.append(("job", r, lease.fence))
            # one job claimed again every round, at the instant its previous lease ends
            lease = claim("shared", name, now=r * 10.0, ttl=10.0)
            if lease is not None:
                won.append(("shared", r, lease.fence))
    except BaseException:
        problem = traceback.format_exc()
        barrier.abort()
    finally:
        dispose()
        loop.close()
    out.put((name, won, problem))


@pytest.mark.slow
def test_processes_claiming_together_each_job_has_one_winner(store: JobStore, target: str) -> None:
    for r in range(PROCESS_ROUNDS):
        store.enqueue(f"job-{r}", ready_at=0.0)
    store.enqueue("shared", ready_at=0.0)
    # the processes race through the store the fixture runs: JobStore, or AsyncJobStore
    front = asyncfront.ASYNC if isinstance(store, asyncfront.BlockingAsyncStore) else "sync"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    out = ctx.Queue()
    names = [f"p{i}" for i in range(PROCESSES)]
    procs = [
        ctx.Process(
            target=_claim_rounds_in_a_process, args=(target, front, name, PROCESS_ROUNDS, barrier, out)
        )
        for name in names
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [out.get(timeout=TIMEOUT) for _ in procs]
    finally:
        reap(procs, TIMEOUT)
    problems = [problem for _, _, problem in reports if problem]
    assert not problems, "\n".join(problems)
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES

    winners: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for name, won, _ in reports:
        for kind, r, fence in won:
            winners.setdefault((kind, r), []).append((name, fence))
    for r in range(PROCESS_ROUNDS):
        [(name, fence)] = winners.get(("job", r), [])
        assert fence == 1
        state = store.state(f"job-{r}")
        assert state is not None
        assert (state.owner, state.fence) == (name, 1)
        [(name, fence)] = winners.get(("shared", r), [])
        assert fence == r + 1
    shared_fences = sorted(
        fence for (kind, _), won in winners.items() if kind == "shared" for _, fence in won
    )
    assert shared_fences == list(range(1, PROCESS_ROUNDS + 1)), "a fence was handed out twice or skipped"
    shared = store.state("shared")
    assert shared is not None
    assert shared.fence == PROCESS_ROUNDS


# -- late writers -------------------------------------------------------------------------


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
def test_late_writers_racing_the_new_owner_never_store_anything(store: JobStore) -> None:
    jobs = [f"job-{r}" for r in range(LATE_ROUNDS)]
    tokens: list[tuple[Lease, Lease]] = []
    for job in jobs:
        store.enqueue(job, ready_at=0.0)
        stale = store.claim(job, "A", now=0.0, ttl=10.0)  # A takes the job and stalls
        current = store.claim(job, "B", now=10.0, ttl=10.0)  # A's lease ended at 10: B takes over
        assert stale is not None
        assert current is not None
        assert current.fence == stale.fence + 1
        tokens.append((stale, current))

    writers: dict[str, Callable[[str, Lease, Lease], Any]] = {
        "B completes": lambda job, stale, current: store.complete(current, "B's result", now=12.0),
        "A completes late": lambda job, stale, current: store.complete(stale, "A's result", now=12.0),
        # A's own clock says its lease is still live; the owner and fence still say no
        "A completes on its old clock": lambda job, stale, current: store.complete(
            stale, "A's result", now=9.0
        ),
        "A presents B's fence": lambda job, stale, current: store.complete(
            Lease(job, "A", current.fence), "A's result", now=12.0
        ),
        "B presents A's fence": lambda job, stale, current: store.complete(
            Lease(job, "B", stale.fence), "stale B's result", now=12.0
        ),
        "A renews late": lambda job, stale, current: store.renew(stale, now=12.0, ttl=100.0),
        "A releases late": lambda job, stale, current: store.release(stale),
        "C claims the held job": lambda job, stale, current: store.claim(job, "C", now=12.0, ttl=10.0),
    }
    calls = list(writers.values())

    def write(thread: int, r: int) -> Any:
        return calls[thread](jobs[r], *tokens[r])

    rounds = _in_lockstep(len(calls), LATE_ROUNDS, write)

    expected = dict.fromkeys(writers, False)
    expected.update({"B completes": True, "C claims the held job": None})
    for r, answers in enumerate(rounds):
        said = [a if a is None or isinstance(a, bool) else bool(a) for a in answers]  # a Refusal is falsy
        assert dict(zip(writers, said, strict=True)) == expected, f"round {r}"
        # B's lease, untouched by A's renewal, and B's result
        assert store.state(jobs[r]) == JobState(jobs[r], "B", 20.0, 2, "B's result", True)
