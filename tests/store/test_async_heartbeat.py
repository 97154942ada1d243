"""An async heartbeat keeps a lease alive, reports its loss promptly, never revives it, and
leaves no task behind.

Each test runs its own event loop (``asyncio.run``) with a fresh ``AsyncJobStore`` on the
test's database, disposed inside that loop. Real, short TTLs; timings have generous slack so
a loaded machine slows the suite down rather than failing it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import fencing.asyncio
from fencing import (
    ConfigurationError,
    DatabaseError,
    Heartbeat,
    InvalidArgumentType,
    JobStore,
    Lease,
    LeaseLost,
)
from fencing._sql.values import JobState
from fencing._store.heartbeat_task import AsyncHeartbeat
from fencing.asyncio import AsyncJobStore
from tests import backends

T = TypeVar("T")

#: scheduling slack on a busy 2-core machine (xdist, a server on the same host)
SLACK = 0.5
#: the longest any scenario may take before the test fails instead of hanging
WATCHDOG = 20.0
#: the async driver of each server the suite runs on
ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "mysql": "mysql+asyncmy", "mariadb": "mysql+asyncmy"}


def async_engine(target: str) -> AsyncEngine:
    """An async engine on the test's own database (a SQLite path or a server URL)."""
    if "://" not in target:
        return fencing.asyncio.create_sqlite_engine(target)
    url = make_url(target)
    return create_async_engine(url.set(drivername=ASYNC_DRIVERS[url.get_backend_name()]))


def run(target: str, scenario: Callable[[AsyncJobStore], Awaitable[T]]) -> T:
    """``scenario(store)`` on a loop of its own, with a fresh store whose table exists; no
    task may be left pending when it returns."""

    async def main() -> T:
        ROOTS.add(asyncio.current_task())  # type: ignore[arg-type]
        engine = async_engine(target)
        try:
            store = AsyncJobStore(engine)
            await store.create_table()
            result = await asyncio.wait_for(scenario(store), WATCHDOG)
            assert leftover_tasks() == set()
            return result
        finally:
            await engine.dispose()

    return asyncio.run(main())


async def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``condition()`` turns true within ``timeout`` (for what a test waits for, not
    what it measures)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.01)
    return True


#: the tasks a test's own harness runs its scenario from (they wait for it)
ROOTS: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


def leftover_tasks() -> set[asyncio.Task[Any]]:
    """Unfinished tasks other than this one and the harness's: before Python 3.12
    ``wait_for`` runs its coroutine in a task of its own, and the task that called it (a
    root, or ``asyncio.run(wait_for(...))``'s own) waits for this one."""
    return {
        t
        for t in asyncio.all_tasks()
        if t is not asyncio.current_task()
        and not t.done()
        and t not in ROOTS
        and getattr(t.get_coro(), "__name__", None) != "wait_for"
    }


async def claimed(store: AsyncJobStore, ttl: float, job_id: str = "j") -> Lease:
    await store.enqueue(job_id, ready_at=0.0)
    lease = await store.claim(job_id, "a", ttl=ttl)
    assert lease is not None
    return lease


class Spy:
    """The async store, with every renewal counted (and the task that sent it); it says
    what the store says (``holds_key``, ``clock_resolution``), so fenced blocks on the real
    store see the heartbeat that runs over the spy."""

    def __init__(self, store: AsyncJobStore) -> None:
        self.store = store
        self.clock_resolution = store.clock_resolution
        self.renewals = 0
        self.tasks: set[str] = set()

    @property
    def holds_key(self) -> Any:
        return self.store.holds_key

    async def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | None:
        self.renewals += 1
        task = asyncio.current_task()
        self.tasks.add(task.get_name() if task is not None else "?")
        return await self.store.renew(lease, ttl=ttl, now=now)

    async def release(self, lease: Lease) -> bool:
        return await self.store.release(lease)

    async def state(self, job_id: str) -> JobState | None:
        return await self.store.state(job_id)


async def spied(store: AsyncJobStore, ttl: float) -> tuple[Spy, Lease]:
    """A spy on the store, and a lease on job "j" for it to keep."""
    return Spy(store), await claimed(store, ttl)


class Scripted:
    """A store with no database: renewal ``n`` runs ``script(n, lease)``, which may raise,
    hang, or answer. The first (``start()``'s) should succeed."""

    def __init__(
        self, script: Callable[[int, Lease], Awaitable[Lease | None]], clock_resolution: float | None = None
    ) -> None:
        self.script = script
        self.clock_resolution = clock_resolution
        self.renewals = 0
        self.calls: list[float] = []  # time.monotonic() as each renewal arrived
        self.released: list[Lease] = []

    async def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | None:
        n, self.renewals = self.renewals, self.renewals + 1
        self.calls.append(time.monotonic())
        return await self.script(n, lease)

    async def release(self, lease: Lease) -> bool:
        self.released.append(lease)
        return True


def extended(lease: Lease, ttl: float) -> Lease:
    return dataclasses.replace(lease, until=time.time() + ttl)


# -- keeping it ----------------------------------------------------------------------------------


def test_renewals_keep_the_lease_past_several_ttls(target: str) -> None:
    # long enough that a loaded CI machine's stall (seen: over 2 s between two renewals, with
    # a 2 s lease in CI) does not outlast it; the block still runs past two ttls
    ttl = 2.5

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        untils: list[float] = []
        async with AsyncHeartbeat(store, lease, ttl) as hb:
            end = time.monotonic() + 2.2 * ttl
            while time.monotonic() < end:
                assert hb.held, hb.reason
                hb.check()
                until = hb.lease.until
                assert until is not None
                untils.append(until)
                assert await store.claim("j", "b", ttl=ttl) is None
                await asyncio.sleep(0.05)
            assert hb.held and not hb.lost.is_set()
            task = hb.task
        assert task is not None and task.done()
        state = await store.state("j")
        assert state is not None and state.owner == "a" and state.fence == lease.fence
        assert untils == sorted(untils)
        assert len(set(untils)) >= 5  # renewed about every ttl / 3: 6 or 7 times
        assert lease.until is not None and untils[-1] > lease.until + ttl  # renewed past the first ttl

    run(target, scenario)


def test_the_deadline_is_counted_from_before_each_send(target: str) -> None:
    ttl = 1.0

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        before = time.monotonic()
        async with AsyncHeartbeat(store, lease, ttl, interval=0.1) as hb:
            after = time.monotonic()
            assert hb.margin == 2 * store.clock_resolution
            assert before + ttl - hb.margin <= hb.deadline <= after + ttl - hb.margin
            assert await eventually(lambda: hb.deadline > after + ttl - hb.margin)
            # the deadline advanced with the renewals, and is never later than one ttl from now
            assert after + ttl - hb.margin < hb.deadline <= time.monotonic() + ttl - hb.margin

    run(target, scenario)


def test_twice_the_database_clocks_resolution_is_taken_off_each_deadline() -> None:
    ttl, interval = 1.0, 0.1

    async def renewed(n: int, lease: Lease) -> Lease | None:
        return extended(lease, ttl)

    async def scenario() -> None:
        store = Scripted(renewed, clock_resolution=0.05)
        async with AsyncHeartbeat(store, Lease("j", "a", 1, 0.0), ttl, interval=interval) as hb:
            assert hb.margin == 0.1
            assert await eventually(lambda: store.renewals >= 3)
            # counted from the moment before the last renewal was sent (after the one before)
            assert store.calls[-2] + ttl - hb.margin < hb.deadline <= store.calls[-1] + ttl - hb.margin

    asyncio.run(asyncio.wait_for(scenario(), WATCHDOG))


# -- losing it -----------------------------------------------------------------------------------


def test_a_revoked_lease_is_noticed_at_once_and_never_revived(target: str) -> None:
    ttl, interval = 1.0, 0.1
    calls: list[tuple[AsyncHeartbeat, asyncio.Task[Any] | None]] = []

    async def on_lost(hb: AsyncHeartbeat) -> None:  # an awaitable is awaited
        await asyncio.sleep(0)
        calls.append((hb, asyncio.current_task()))

    async def scenario(store: AsyncJobStore) -> None:
        spy, lease = await spied(store, ttl)
        async with AsyncHeartbeat(spy, lease, ttl, interval=interval, on_lost=on_lost) as hb:
            await asyncio.sleep(2.5 * interval)
            assert await store.revoke("j")
            revoked_at = time.monotonic()
            await asyncio.wait_for(hb.lost.wait(), interval + SLACK)
            assert time.monotonic() - revoked_at <= interval + SLACK
            assert not hb.held
            with pytest.raises(LeaseLost, match="refused"):
                hb.check()
            assert hb.reason is not None and "refused" in hb.reason
            assert hb.error is None
            renewals = spy.renewals
            # the job is claimable again; another worker takes it, and the lost lease stays lost
            assert await store.claim("j", "b", ttl=ttl) is not None
            await asyncio.sleep(4 * interval)
            assert spy.renewals == renewals
            assert not hb.held and hb.lost.is_set()
            assert hb.task is not None and hb.task.done()
        assert calls == [(hb, hb.task)]
        # the first renewal in the task that started it, the others in the heartbeat's task
        assert len(spy.tasks) == 2 and f"fencing-heartbeat-{lease.job_id}" in spy.tasks
        state = await store.state("j")
        assert state is not None and state.owner == "b"  # the lost heartbeat sent nothing more

    run(target, scenario)


def test_failing_renewals_lose_the_lease_at_the_local_deadline() -> None:
    ttl, interval = 1.2, 0.2

    async def script(n: int, lease: Lease) -> Lease | None:
        if n:
            raise DatabaseError("server down")
        return extended(lease, ttl)

    async def scenario() -> None:
        store = Scripted(script)
        async with AsyncHeartbeat(store, Lease("j", "a", 1, 0.0), ttl, interval=interval) as hb:
            deadline = hb.deadline
            assert hb.margin == 0.002  # the store does not say its clock's resolution
            await asyncio.wait_for(hb.lost.wait(), ttl + SLACK)
            assert time.monotonic() >= deadline
            assert not hb.held
            assert isinstance(hb.error, DatabaseError)
            assert hb.reason is not None and "server down" in hb.reason and "deadline" in hb.reason
            assert store.renewals - 1 >= 3  # retried at a short interval, not once per interval
        assert store.released == []  # a lost lease is not released
        assert leftover_tasks() == set()

    asyncio.run(asyncio.wait_for(scenario(), WATCHDOG))


def test_held_turns_false_at_the_deadline_while_a_renewal_hangs_even_read_from_a_thread() -> None:
    ttl, interval = 0.6, 0.1

    async def scenario() -> None:
        hanging = asyncio.Event()
        let_go = asyncio.Event()

        async def script(n: int, lease: Lease) -> Lease | None:
            if n == 0:
                return extended(lease, ttl)
            hanging.set()
            await let_go.wait()
            return dataclasses.replace(lease, until=math.inf)  # a late success must not revive it

        hb = await AsyncHeartbeat(Scripted(script), Lease("j", "a", 1, 0.0), ttl, interval=interval).start()
        try:
            await asyncio.wait_for(hanging.wait(), 5.0)
            deadline = hb.deadline
            await asyncio.sleep(max(0.0, deadline - time.monotonic()) + 0.02)
            assert not hb.lost.is_set()  # nobody has looked yet: the task is stuck in the renewal
            waiter = asyncio.ensure_future(hb.lost.wait())
            await asyncio.sleep(0)
            seen: list[bool] = []

            def read() -> None:
                time.sleep(0.2)  # the loop is asleep by then: it must be woken to set lost
                seen.append(hb.held)

            reader = threading.Thread(target=read)
            reader.start()
            await asyncio.wait_for(waiter, 2.0)
            reader.join()
            assert seen == [False]
            with pytest.raises(LeaseLost, match="deadline"):
                hb.check()
            let_go.set()
            await hb.stop()
            assert not hb.held
            assert hb.lease.until != math.inf
            assert hb.deadline == deadline
        finally:
            let_go.set()
            await hb.stop()

    asyncio.run(asyncio.wait_for(scenario(), WATCHDOG))


def test_starting_on_a_lost_lease_raises_and_starts_no_task(target: str) -> None:
    ttl = 1.0

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        assert await store.revoke("j")
        hb = AsyncHeartbeat(store, lease, ttl)
        with pytest.raises(LeaseLost, match="first renewal was refused"):
            async with hb:
                pytest.fail("the block must not run")
        assert hb.lost.is_set() and not hb.held and hb.task is None
        with pytest.raises(RuntimeError, match="once"):
            await hb.start()

    run(target, scenario)


# -- cancellation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("release_on_error", [True, False])
def test_cancelling_the_task_using_it_stops_the_heartbeat(target: str, release_on_error: bool) -> None:
    ttl, interval = 1.0, 0.05

    async def scenario(store: AsyncJobStore) -> None:
        spy, lease = await spied(store, ttl)
        made: list[AsyncHeartbeat] = []

        async def worker() -> None:
            async with AsyncHeartbeat(
                spy, lease, ttl, interval=interval, release_on_error=release_on_error
            ) as hb:
                made.append(hb)
                await asyncio.sleep(WATCHDOG)

        task = asyncio.ensure_future(worker())
        assert await eventually(lambda: spy.renewals >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        [hb] = made
        assert hb.task is not None and hb.task.done() and not hb.task.cancelled()
        assert leftover_tasks() == set()
        renewals = spy.renewals
        await asyncio.sleep(3 * interval)
        assert spy.renewals == renewals
        assert not hb.lost.is_set()  # stopped, not lost
        state = await store.state("j")
        assert state is not None
        assert (state.owner is None) is release_on_error  # a cancellation is the block's error
        assert hb.held is not release_on_error

    run(target, scenario)


def test_cancelling_the_heartbeat_task_itself_loses_the_lease_at_once(target: str) -> None:
    ttl, interval = 2.0, 0.05
    calls: list[AsyncHeartbeat] = []

    async def scenario(store: AsyncJobStore) -> None:
        spy, lease = await spied(store, ttl)
        async with AsyncHeartbeat(spy, lease, ttl, interval=interval, on_lost=calls.append) as hb:
            await asyncio.sleep(0.15)
            assert hb.task is not None
            hb.task.cancel()
            await asyncio.wait_for(hb.lost.wait(), 2.0)
            assert hb.task.cancelled()
            assert not hb.held  # nothing renews it any more: not vouched for
            assert hb.reason is not None and "cancelled" in hb.reason
            renewals = spy.renewals
            await asyncio.sleep(3 * interval)
            assert spy.renewals == renewals
        assert calls == [hb]

    run(target, scenario)


def test_cancelling_stop_cancels_the_heartbeat_task(target: str) -> None:
    ttl = 1.0

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        entered = asyncio.Event()
        let_go = asyncio.Event()

        class Slow(Spy):
            async def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | None:
                if self.renewals:
                    entered.set()
                    await let_go.wait()  # a renewal in flight: stop() waits for it
                return await super().renew(lease, ttl=ttl, now=now)

        hb = await AsyncHeartbeat(Slow(store), lease, ttl, interval=0.05).start()
        await asyncio.wait_for(entered.wait(), 5.0)
        stopper = asyncio.ensure_future(hb.stop())
        await asyncio.sleep(0.05)
        assert not stopper.done()
        stopper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopper
        await asyncio.sleep(0)
        assert hb.task is not None and hb.task.done()
        assert not hb.lost.is_set()  # asked to stop: a cancellation then is no loss

    run(target, scenario)


# -- with fenced blocks ----------------------------------------------------------------------------


def test_a_fenced_block_extends_the_lease_and_the_heartbeat_counts_from_there(target: str) -> None:
    ttl, interval = 2.0, 1.8

    async def scenario(store: AsyncJobStore) -> None:
        spy, lease = await spied(store, ttl)
        lost: list[AsyncHeartbeat] = []
        async with AsyncHeartbeat(spy, lease, ttl, interval=interval, on_lost=lost.append) as hb:
            first, until = hb.deadline, hb.lease.until
            assert until is not None
            await asyncio.sleep(0.6)  # the next renewal is not due yet
            async with store.fenced(hb.lease):
                renewals = spy.renewals
                await asyncio.sleep(0.5)
                assert spy.renewals == renewals == 1  # only start() has renewed
            # no renewal yet: the heartbeat counts its deadline from the block's own extension
            assert spy.renewals == renewals
            assert hb.deadline > first + 0.5
            extended = hb.lease.until
            assert extended is not None and extended > until + 0.5
            state = await store.state("j")
            assert state is not None and state.until == extended
            assert hb.held, hb.reason
            # renewing again one interval after the block began
            assert await eventually(lambda: (hb.lease.until or 0.0) > extended)
            assert spy.renewals > renewals
        assert not lost

    run(target, scenario)


def test_stop_inside_a_fenced_block_returns_at_once(target: str) -> None:
    ttl, interval = 3.0, 0.05

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        hb = await AsyncHeartbeat(store, lease, ttl, interval=interval).start()
        async with store.fenced(lease, complete=True, result="ok"):
            await asyncio.sleep(0.3)  # several intervals: renewals are due while the block holds the row
            started = time.monotonic()
            await asyncio.wait_for(hb.stop(), 5.0)  # stuck, it waits for the block: forever
            stopped_in = time.monotonic() - started
            assert hb.task is not None and hb.task.done()
        assert stopped_in < 3.0  # ms when it works; 3 s leaves room for a stalled machine
        state = await store.state("j")
        assert state is not None and state.done and state.result == "ok"
        assert not hb.lost.is_set()

    run(target, scenario)


@pytest.mark.parametrize("begun", [True, False], ids=["begun", "autobegin"])
def test_stop_inside_a_block_joined_to_an_unbegun_connection_returns_at_once(
    target: str, begun: bool
) -> None:
    # the documented pattern joined to the caller's AsyncConnection in commit-as-you-go style:
    # the block's first check is what begins its transaction
    ttl, interval = 3.0, 0.05

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        async with AsyncHeartbeat(store, lease, ttl, interval=interval) as hb, store.engine.connect() as conn:
            if begun:
                await conn.begin()
            async with store.fenced(hb.lease, conn=conn, complete=True, result="ok"):
                await asyncio.sleep(0.3)  # renewals fall due while the block holds the row
                started = time.monotonic()
                await asyncio.wait_for(hb.stop(), 5.0)  # stuck, it waits for the block: forever
                stopped_in = time.monotonic() - started
            await conn.commit()
        assert stopped_in < 3.0  # ms when it works; 3 s leaves room for a stalled machine
        state = await store.state("j")
        assert state is not None and state.done and state.result == "ok"
        assert not hb.lost.is_set()

    run(target, scenario)


@pytest.mark.parametrize("spawn", ["gather", "create_task"])
def test_a_task_created_inside_a_block_is_refused_at_once_where_it_would_wait_for_the_block(
    target: str, spawn: str
) -> None:
    # the child copies the block's context: its operation is the block's task's, so it is
    # refused at once instead of waiting for the block's lock (on asyncpg: forever)
    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, 30.0)
        async with store.fenced(lease):
            renewal = store.renew(lease, ttl=30.0)
            child = asyncio.gather(renewal) if spawn == "gather" else asyncio.create_task(renewal)
            started = time.monotonic()
            with pytest.raises(ConfigurationError, match="would wait for it forever"):
                await child
            assert time.monotonic() - started < 3.0  # not busy_timeout's 5 s, nor forever
        state = await store.state("j")
        assert state is not None and (state.owner, state.fence, state.done) == ("a", lease.fence, False)

    in_a_thread(lambda: run(target, scenario))


def in_a_thread(scenario: Callable[[], None]) -> None:
    """``scenario()`` on a thread of its own: a hang fails the test, not the run."""
    outcome: list[BaseException | None] = []

    def body() -> None:
        try:
            scenario()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(WATCHDOG + 10.0)
    assert outcome, "the scenario hung"
    if outcome[0] is not None:
        raise outcome[0]


def test_another_engine_on_the_blocks_database_is_refused_at_once(target: str, tmp_path: Any) -> None:
    # issue 22, item 2: the same database by another path or host name is the same database;
    # keyed by the URL string, the operation waited out busy_timeout (SQLite) or forever (asyncpg)
    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, 30.0)
        elsewhere = backends.async_engine_for(backends.another_way_to(target, tmp_path))
        try:
            there = AsyncJobStore(elsewhere)
            await there.state("j")  # connected once: the server said who it is
            assert there.holds_key == store.holds_key
            async with store.fenced(lease):
                started = time.monotonic()
                with pytest.raises(ConfigurationError, match="would wait for it forever"):
                    await there.complete(lease, "late")
                assert time.monotonic() - started < 3.0  # not busy_timeout's 5 s, nor forever
        finally:
            await elsewhere.dispose()
        state = await store.state("j")
        assert state is not None and (state.owner, state.done) == ("a", False)

    in_a_thread(lambda: run(target, scenario))


def test_a_block_that_completes_the_job_ends_the_heartbeat_quietly(target: str) -> None:
    ttl, interval = 2.0, 1.5

    async def scenario(store: AsyncJobStore) -> None:
        spy, lease = await spied(store, ttl)
        lost: list[AsyncHeartbeat] = []
        async with AsyncHeartbeat(spy, lease, ttl, interval=interval, on_lost=lost.append) as hb:
            async with store.fenced(hb.lease, complete=True, result="done"):
                renewals = spy.renewals
                await asyncio.sleep(0.15)
            assert hb.task is not None
            await asyncio.wait_for(asyncio.shield(hb.task), SLACK)  # it ends by itself, at once
            await asyncio.sleep(0.2)  # renewals would be due: none is sent, none reports a loss
            assert spy.renewals == renewals
            assert not hb.held
            assert not hb.lost.is_set()
            assert "completed" in repr(hb)
            with pytest.raises(LeaseLost, match="completed"):
                hb.check()
        assert not lost
        state = await store.state("j")
        assert state is not None and state.done and state.result == "done"

    run(target, scenario)


def test_a_heartbeat_started_inside_a_block_on_its_lease_is_refused(target: str) -> None:
    ttl = 2.0

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        async with store.fenced(lease):
            with pytest.raises(ConfigurationError, match=r"this task .* start the AsyncHeartbeat before"):
                await AsyncHeartbeat(store, lease, ttl).start()
        state = await store.state("j")
        assert state is not None and state.owner == "a" and state.fence == lease.fence

    run(target, scenario)


def test_a_block_in_another_task_holds_renewals_until_it_commits(target: str) -> None:
    ttl, interval = 2.0, 0.05

    async def scenario(store: AsyncJobStore) -> None:
        spy, lease = await spied(store, ttl)
        async with AsyncHeartbeat(spy, lease, ttl, interval=interval) as hb:
            in_block = asyncio.Event()

            async def block() -> None:
                async with store.fenced(lease):
                    in_block.set()
                    await asyncio.sleep(0.4)

            other = asyncio.ensure_future(block())
            await in_block.wait()
            renewals = spy.renewals
            await other
            assert spy.renewals == renewals
            assert await eventually(lambda: spy.renewals > renewals)  # renewing again
            assert hb.held

    run(target, scenario)


# -- releasing -------------------------------------------------------------------------------------


def test_release_on_exit_gives_the_lease_back(target: str) -> None:
    ttl = 1.0

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        async with AsyncHeartbeat(store, lease, ttl, release_on_exit=True) as hb:
            assert hb.held
        assert not hb.held and not hb.lost.is_set()
        with pytest.raises(LeaseLost, match="released"):
            hb.check()
        taken = await store.claim("j", "b", ttl=ttl)
        assert taken is not None and taken.fence == lease.fence + 1

    run(target, scenario)


@pytest.mark.parametrize("release_on_error", [True, False])
def test_exit_keeps_the_lease_unless_the_block_raised(target: str, release_on_error: bool) -> None:
    ttl = 1.0

    async def scenario(store: AsyncJobStore) -> None:
        lease = await claimed(store, ttl)
        async with AsyncHeartbeat(store, lease, ttl, release_on_error=release_on_error) as hb:
            pass
        assert hb.held  # stopping is not releasing
        assert await store.claim("j", "b", ttl=ttl) is None
        with pytest.raises(KeyError, match="boom"):
            async with AsyncHeartbeat(store, hb.lease, ttl, release_on_error=release_on_error):
                raise KeyError("boom")
        assert (await store.claim("j", "b", ttl=ttl) is not None) is release_on_error

    run(target, scenario)


# -- arguments -------------------------------------------------------------------------------------


def test_a_store_of_the_other_kind_is_refused(tmp_path: Path) -> None:
    """No database work: a SQLite file that is never written on every backend."""
    lease = Lease("j", "a", 1, 10.0)
    target = str(tmp_path / "unused.db")

    async def scenario() -> None:
        store = AsyncJobStore(async_engine(target))
        with pytest.raises(InvalidArgumentType, match=r"AsyncJobStore, whose renew\(\) is a coroutine"):
            Heartbeat(store, lease, 1.0)  # type: ignore[arg-type]
        sync = JobStore(backends.engine_for(target))
        try:
            with pytest.raises(InvalidArgumentType, match=r"JobStore, whose renew\(\) is not a coroutine"):
                AsyncHeartbeat(sync, lease, 1.0)  # type: ignore[arg-type]
        finally:
            sync.engine.dispose()
        with pytest.raises(InvalidArgumentType, match="store must have renew"):
            AsyncHeartbeat(object(), lease, 1.0)  # type: ignore[arg-type]
        hb = AsyncHeartbeat(store, lease, 0.9)
        assert hb.interval == pytest.approx(0.3)
        assert not hb.held
        with pytest.raises(LeaseLost, match="no renewal"):
            hb.check()
        await hb.stop()  # harmless before start
        await store.engine.dispose()

    asyncio.run(scenario())
