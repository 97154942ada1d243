"""The worker runtime for asyncio (:class:`fencing.asyncio.AsyncWorker`), on the database under
test: the thread worker's promises (tests/store/test_worker_runtime.py), kept by tasks.

A worker runs the coroutine once per job with its payload, stores what it returned fenced,
retries a failure with backoff and keeps its reason, leaves a job poisoned at
``max_attempts``, **cancels a coroutine whose lease is lost** and never stores its result,
lets a coroutine complete the job in its own transaction, runs ``concurrency`` jobs at once,
costs one transaction per job, and on stop (or when the task awaiting ``run`` is cancelled)
lets running jobs finish within ``drain`` then cancels and hands back the rest.

Each test runs its own event loop with a fresh store (payloads and failures tables included).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, event, select

from fencing import (
    InvalidArgument,
    InvalidArgumentType,
    LeaseLost,
    Worker,
    failures_table,
    jobs_table,
    payloads_table,
)
from fencing._store import worker_rules
from fencing.asyncio import AsyncJob, AsyncJobStore, AsyncWorker
from tests.store.test_async_heartbeat import async_engine

TTL = 3.0
WATCHDOG = 60.0


@pytest.fixture(autouse=True)
def quick_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_rules, "IDLE_WAIT", 0.2)  # a stopped worker's idle slots end soon


def run(target: str, scenario: Callable[[AsyncJobStore], Awaitable[None]]) -> None:
    """``scenario(store)`` on a loop of its own, with a fresh store whose tables exist."""

    async def main() -> None:
        engine = async_engine(target)
        metadata = MetaData()
        try:
            store = AsyncJobStore(
                engine,
                jobs_table(metadata, "aw_jobs"),
                payloads=payloads_table(metadata, "aw_payloads"),
                failures=failures_table(metadata, "aw_failures"),
            )
            await store.create_table()
            await asyncio.wait_for(scenario(store), WATCHDOG)
        finally:
            await engine.dispose()

    asyncio.run(main())


async def until(condition: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    ends = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < ends, "timed out"
        await asyncio.sleep(0.01)


async def done(store: AsyncJobStore, *job_ids: str) -> bool:
    for job_id in job_ids:
        state = await store.state(job_id)
        if state is None or not state.done:
            return False
    return True


async def run_until(worker: AsyncWorker, condition: Callable[[], Awaitable[bool]]) -> None:
    task = asyncio.create_task(worker.run(handle_signals=False))
    try:
        await until(condition)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30.0)


class WaitsForLoss:
    """A job coroutine that says it started, then sleeps until it is cancelled (30 s at most),
    noting whether ``job.lost`` was set when the cancellation arrived."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled_with_loss = asyncio.Event()
        self.returned = False

    async def __call__(self, job: AsyncJob) -> str:
        self.started.set()
        try:
            await asyncio.sleep(30.0)
        except asyncio.CancelledError:
            if job.lost.is_set():
                self.cancelled_with_loss.set()
            raise
        self.returned = True
        return "stale"


def test_each_job_runs_once_with_its_payload_and_its_result_is_stored(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        seen: list[tuple[str, Any, int]] = []

        async def function(job: AsyncJob) -> Any:
            seen.append((job.job_id, job.payload, job.attempt))
            await asyncio.sleep(0)
            return {"total": job.payload["n"] * 2} if job.job_id != "text" else "as it is"

        for i in range(5):
            await store.enqueue(f"order-{i}", payload={"n": i})
        await store.enqueue("text", payload={"n": 0})
        worker = AsyncWorker(store, function, concurrency=2, ttl=TTL)
        await run_until(worker, lambda: done(store, "text", *(f"order-{i}" for i in range(5))))
        expected = [(f"order-{i}", {"n": i}, 1) for i in range(5)] + [("text", {"n": 0}, 1)]
        assert sorted(seen) == sorted(expected)
        assert json.loads((await store.state("order-3")).result) == {"total": 6}  # type: ignore[union-attr]
        assert (await store.state("text")).result == "as it is"  # type: ignore[union-attr]
        assert _worker_counts(store) == {"worker.started": 6, "worker.completed": 6}

    run(target, scenario)


def test_a_failure_is_retried_with_backoff_and_its_reason_kept_then_poisoned(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        attempts: list[float] = []

        async def function(job: AsyncJob) -> None:
            attempts.append(time.monotonic())
            raise ValueError(f"card declined (attempt {job.attempt})")

        await store.enqueue("pay")
        worker = AsyncWorker(store, function, ttl=TTL, max_attempts=3, retry_delay=0.2, max_retry_delay=0.3)

        async def third_released() -> bool:
            return len(attempts) == 3 and not worker.running and await store.holder("pay") is None

        await run_until(worker, third_released)
        await asyncio.sleep(0.8)  # poisoned: no fourth attempt however long it waits
        assert len(attempts) == 3
        gaps = [b - a for a, b in itertools.pairwise(attempts)]
        assert gaps[0] >= 0.1 and gaps[1] >= 0.15  # 0.1-0.2 s, then 0.15-0.3 s (equal jitter)
        failure = await store.failure("pay")
        assert failure is not None and failure.fence == 3
        assert "ValueError: card declined (attempt 3)" in failure.text
        assert "Traceback (most recent call last)" in failure.text and "in function" in failure.text
        assert [s.job_id for s in await store.poisoned(max_attempts=3)] == ["pay"]
        counts = {"worker.started": 3, "worker.retried": 2, "worker.poisoned": 1}
        assert _worker_counts(store) == counts

    run(target, scenario)


async def stuck_in_an_await(seconds: float) -> None:
    """Where the timed-out coroutine is (its failure names this frame)."""
    await asyncio.sleep(seconds)


def test_a_coroutine_past_its_timeout_is_cancelled_and_its_job_retried_with_its_stack(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        cancelled: list[int] = []

        async def function(job: AsyncJob) -> str:
            if job.attempt == 1:
                try:
                    await stuck_in_an_await(30.0)
                except asyncio.CancelledError:
                    cancelled.append(job.attempt)
                    raise
                return "late"
            return "second"

        await store.enqueue("slow")
        worker = AsyncWorker(store, function, ttl=TTL, timeout=0.5, retry_delay=0.05, max_retry_delay=0.05)
        began = time.monotonic()
        await run_until(worker, lambda: done(store, "slow"))
        assert cancelled == [1] and time.monotonic() - began < 10.0
        assert (await store.state("slow")).result == "second"  # type: ignore[union-attr]
        failure = await store.failure("slow")
        assert failure is not None and failure.fence == 1
        assert "TimeoutError: job 'slow' ran past the worker's timeout of 0.5 s" in failure.text
        assert "where it was when it timed out:" in failure.text
        assert "in stuck_in_an_await" in failure.text and "in function" in failure.text
        assert _worker_counts(store) == {
            "worker.started": 2,
            "worker.timed_out": 1,
            "worker.retried": 1,
            "worker.completed": 1,
        }

    run(target, scenario)


def test_a_coroutine_that_ignores_its_timeout_writes_nothing_after_it(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        refused: list[BaseException] = []
        others: list[str] = []

        async def function(job: AsyncJob) -> str:
            if job.job_id != "stubborn":
                others.append(job.job_id)
                return "ok"
            with contextlib.suppress(asyncio.CancelledError):  # swallowed: it goes on,
                await stuck_in_an_await(30.0)  # and tries to complete the job itself
            try:
                async with job.completing("late"):
                    pass
            except LeaseLost as exc:
                refused.append(exc)
            return "late"

        await store.enqueue("stubborn")
        worker = AsyncWorker(store, function, ttl=TTL, timeout=0.3, max_attempts=1)

        async def refused_and_others_done() -> bool:
            if refused and not others:
                for n in range(2):
                    await store.enqueue(f"next-{n}")
            return bool(refused) and len(others) == 2

        await run_until(worker, refused_and_others_done)
        state = await store.state("stubborn")
        assert state is not None and not state.done and state.result is None
        assert [s.job_id for s in await store.poisoned(max_attempts=1)] == ["stubborn"]
        assert (await store.state("next-1")).done  # type: ignore[union-attr]

    run(target, scenario)


def test_a_coroutine_that_times_out_inside_its_own_block_keeps_none_of_its_writes(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        orders = Table("aw_inside", MetaData(), Column("id", String(40), primary_key=True))
        async with store.engine.begin() as conn:
            await conn.run_sync(orders.create, checkfirst=True)
        try:

            async def function(job: AsyncJob) -> str:
                if job.attempt > 1:
                    return "second"
                async with job.completing("first") as conn:
                    await conn.execute(orders.insert().values(id=job.job_id))
                    await stuck_in_an_await(30.0)  # cancelled inside the block: it rolls back
                return "first, late"

            await store.enqueue("inside")
            worker = AsyncWorker(
                store, function, ttl=TTL, timeout=0.5, retry_delay=0.05, max_retry_delay=0.05
            )
            await run_until(worker, lambda: done(store, "inside"))
            assert (await store.state("inside")).result == "second"  # type: ignore[union-attr]
            failure = await store.failure("inside")
            assert failure is not None and failure.fence == 1 and "in stuck_in_an_await" in failure.text
            async with store.engine.connect() as conn:
                assert (await conn.execute(select(orders.c.id))).all() == []
        finally:
            async with store.engine.begin() as conn:
                await conn.run_sync(orders.drop)

    run(target, scenario)


def test_a_coroutine_that_exits_fails_its_job_and_the_slot_goes_on(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        async def function(job: AsyncJob) -> str:
            if job.job_id == "exits":
                raise SystemExit(3)
            return "ok"

        await store.enqueue("exits")
        await store.enqueue("after", ready_at=time.time() + 0.5)
        worker = AsyncWorker(store, function, ttl=TTL, max_attempts=1)
        await run_until(worker, lambda: done(store, "after"))
        failure = await store.failure("exits")
        assert failure is not None and "SystemExit: 3" in failure.text

    run(target, scenario)


def test_a_result_that_is_not_json_fails_the_job_and_says_why(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        async def function(job: AsyncJob) -> Any:
            return {"x": float("nan")}

        await store.enqueue("odd")
        worker = AsyncWorker(store, function, ttl=TTL, max_attempts=1)

        async def failed() -> bool:
            return await store.failure("odd") is not None

        await run_until(worker, failed)
        failure = await store.failure("odd")
        assert failure is not None and "NaN" in failure.text
        assert not (await store.state("odd")).done  # type: ignore[union-attr]

    run(target, scenario)


def test_a_coroutine_whose_lease_is_lost_is_cancelled_and_its_result_not_stored(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        function = WaitsForLoss()
        await store.enqueue("slow")
        worker = AsyncWorker(store, function, ttl=TTL)
        task = asyncio.create_task(worker.run(handle_signals=False))
        try:
            await asyncio.wait_for(function.started.wait(), 20.0)
            assert await store.revoke("slow")  # an operator takes the job away: the next renewal is refused
            lease = await store.claim("slow", "someone-else", ttl=30.0)
            assert lease is not None
            # cancelled at its await, within about one renewal interval (ttl / 3)
            await asyncio.wait_for(function.cancelled_with_loss.wait(), TTL)
            await until(lambda: _false_when(worker.running))
            assert await store.complete(lease, "fresh")
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30.0)
        assert not function.returned
        assert (await store.state("slow")).result == "fresh"  # type: ignore[union-attr]
        assert _worker_counts(store) == {"worker.started": 1, "worker.lost": 1}
        assert store.metrics.timings()["worker.run"].count == 1

    run(target, scenario)


async def _false_when(items: list[str]) -> bool:
    return not items


def _worker_counts(store: AsyncJobStore) -> dict[str, int]:
    return {name: n for name, n in store.metrics.snapshot().items() if name.startswith("worker.")}


def test_a_coroutine_may_complete_its_job_in_its_own_transaction(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        orders = Table(
            "aw_orders", MetaData(), Column("id", String(40), primary_key=True), Column("n", Integer)
        )
        async with store.engine.begin() as conn:
            await conn.run_sync(orders.create)

        async def function(job: AsyncJob) -> None:
            async with job.completing({"stored": True}) as conn:
                await conn.execute(orders.insert().values(id=job.job_id, n=job.payload))

        await store.enqueue("o-1", payload=7)
        worker = AsyncWorker(store, function, ttl=TTL)
        await run_until(worker, lambda: done(store, "o-1"))
        assert json.loads((await store.state("o-1")).result) == {"stored": True}  # type: ignore[union-attr]
        async with store.engine.connect() as conn:
            assert (await conn.execute(select(orders.c.n))).all() == [(7,)]

    run(target, scenario)


def test_concurrency_runs_that_many_jobs_at_once(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        inside, most = 0, 0
        three_in = asyncio.Event()

        async def function(job: AsyncJob) -> str:
            nonlocal inside, most
            inside += 1
            most = max(most, inside)
            if inside == 3:
                three_in.set()
            await asyncio.wait_for(three_in.wait(), 20.0)  # only three running at once get past this
            inside -= 1
            return "ok"

        for i in range(6):
            await store.enqueue(f"j{i}")
        worker = AsyncWorker(store, function, concurrency=3, ttl=TTL)
        await run_until(worker, lambda: done(store, *(f"j{i}" for i in range(6))))
        assert most == 3

    run(target, scenario)


def test_stop_lets_a_running_job_finish_within_drain(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        started, go_on = asyncio.Event(), asyncio.Event()

        async def function(job: AsyncJob) -> str:
            started.set()
            await asyncio.wait_for(go_on.wait(), 20.0)
            return "finished"

        await store.enqueue("long")
        await store.enqueue("later", ready_at=time.time() + 3600)
        worker = AsyncWorker(store, function, ttl=TTL, drain=20.0)
        task = asyncio.create_task(worker.run(handle_signals=False))
        await asyncio.wait_for(started.wait(), 20.0)
        worker.stop()
        await asyncio.sleep(TTL)  # past one ttl: the heartbeat keeps the lease while it drains
        assert await store.holder("long") is not None
        go_on.set()
        await asyncio.wait_for(task, 30.0)
        assert (await store.state("long")).result == "finished"  # type: ignore[union-attr]
        assert await store.holder("later") is None

    run(target, scenario)


def test_a_job_still_running_at_the_drain_deadline_is_cancelled_and_handed_back(target: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        function = WaitsForLoss()
        await store.enqueue("stuck")
        worker = AsyncWorker(store, function, ttl=TTL, drain=0.5)
        task = asyncio.create_task(worker.run(handle_signals=False))
        await asyncio.wait_for(function.started.wait(), 20.0)
        stopped = time.monotonic()
        worker.stop()
        await asyncio.wait_for(task, 30.0)
        assert time.monotonic() - stopped < 0.5 + TTL / 3 + 2.0  # the deadline plus one heartbeat
        assert function.cancelled_with_loss.is_set() and not function.returned
        lease = await store.claim("stuck", "next-worker", ttl=30.0)  # at once: handed back, not expired
        assert lease is not None and lease.fence == 2
        assert await store.complete(lease, "done by the next")
        assert _worker_counts(store) == {"worker.started": 1, "worker.handed_back": 1, "worker.lost": 1}

    run(target, scenario)


@pytest.mark.parametrize("how", ["stop now", "cancel run", "stop from another thread"])
def test_stopping_at_once_hands_back_at_once(target: str, how: str) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        function = WaitsForLoss()
        await store.enqueue("now")
        worker = AsyncWorker(store, function, ttl=TTL, drain=60.0)
        task = asyncio.create_task(worker.run(handle_signals=False))
        await asyncio.wait_for(function.started.wait(), 20.0)
        if how == "stop now":
            worker.stop(now=True)
        elif how == "cancel run":
            task.cancel()
        else:
            stopper = threading.Thread(target=worker.stop, kwargs={"now": True})
            stopper.start()
            stopper.join()
        ended = time.monotonic()
        with pytest.raises(asyncio.CancelledError) if how == "cancel run" else _nothing():
            await asyncio.wait_for(task, 10.0)
        assert time.monotonic() - ended < 5.0
        assert function.cancelled_with_loss.is_set()
        assert await store.holder("now") is None

    run(target, scenario)


class _nothing:  # reads as a context manager that expects nothing
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(
    ("arguments", "error", "says"),
    [
        ({"concurrency": 0}, InvalidArgument, "concurrency"),
        ({"ttl": "30"}, InvalidArgumentType, "ttl must be a number of seconds, got str '30'"),
        ({"max_attempts": 0}, InvalidArgument, "max_attempts"),
        ({"drain": float("inf")}, InvalidArgument, "drain must be a finite number of seconds >= 0"),
        ({"owner": 5}, InvalidArgumentType, "owner"),
        ({"timeout": -1}, InvalidArgument, "timeout must be a finite number of seconds > 0, got -1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    target: str, arguments: dict[str, Any], error: type[Exception], says: str
) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        async def function(job: AsyncJob) -> None:
            return None

        await store.enqueue("untouched")
        with pytest.raises(error, match=says):
            AsyncWorker(store, function, **arguments)
        with pytest.raises(InvalidArgumentType, match=r"async def function.*use fencing\.Worker"):
            AsyncWorker(store, lambda job: None)  # type: ignore[arg-type,return-value]
        with pytest.raises(InvalidArgumentType, match=r"AsyncJobStore, got JobStore \(a sync store"):
            AsyncWorker(store.sync_store, function)
        with pytest.raises(InvalidArgumentType, match=r"JobStore, got AsyncJobStore \(an async store"):
            Worker(store, lambda job: None)  # type: ignore[arg-type]
        assert await store.holder("untouched") is None
        assert (await store.state("untouched")).fence == 0  # type: ignore[union-attr]

    run(target, scenario)


def test_each_job_costs_one_transaction_and_no_renewal(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        commits: list[object] = []
        renewals: list[object] = []
        renew = store.renew

        async def counted_renew(*a: Any, **k: Any) -> Any:
            renewals.append(a)
            return await renew(*a, **k)

        monkeypatch.setattr(store, "renew", counted_renew)
        for i in range(20):
            await store.enqueue(f"r{i}")
        ran: list[int] = []  # the commits so far, as each job runs

        async def function(job: AsyncJob) -> None:
            ran.append(len(commits))

        worker = AsyncWorker(store, function, ttl=30.0)
        sync_engine, counted = store.engine.sync_engine, commits.append
        event.listen(sync_engine, "commit", counted)
        try:

            async def twenty() -> bool:
                return len(ran) == 20

            await run_until(worker, twenty)
        finally:
            event.remove(sync_engine, "commit", counted)
        assert await done(store, *(f"r{i}" for i in range(20)))
        # the first claim, then one step per job (its completion and the next claim)
        assert ran[-1] == 20, ran
        assert renewals == []

    run(target, scenario)


def test_slots_that_finish_together_share_one_transaction(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario(store: AsyncJobStore) -> None:
        batches: list[list[str]] = []
        step = store.complete_and_claim_next

        async def slow_step(completions: Any, *args: Any, **kwargs: Any) -> Any:
            completions = list(completions)
            batches.append([lease.job_id for lease, _ in completions])
            if len(batches) == 1:
                await asyncio.sleep(1.0)  # the first batch on its way: the others finish meanwhile
            return await step(completions, *args, **kwargs)

        monkeypatch.setattr(store, "complete_and_claim_next", slow_step)
        for i in range(4):
            await store.enqueue(f"b{i}")
        arrived, all_in = 0, asyncio.Event()

        async def function(job: AsyncJob) -> str:
            nonlocal arrived
            arrived += 1
            if arrived == 4:
                all_in.set()
            await asyncio.wait_for(all_in.wait(), 20.0)  # the four finish at once
            return job.job_id

        worker = AsyncWorker(store, function, concurrency=4, ttl=TTL)
        await run_until(worker, lambda: done(store, *(f"b{i}" for i in range(4))))
        # the four finish in one turn of the loop: one batch, or two if the first began sooner
        assert len(batches) <= 2 and sorted(itertools.chain(*batches)) == [f"b{i}" for i in range(4)], batches
        for i in range(4):
            assert (await store.state(f"b{i}")).result == f"b{i}"  # type: ignore[union-attr]

    run(target, scenario)
