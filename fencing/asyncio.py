"""asyncio: the same leases, fences and guarantees on SQLAlchemy's ``AsyncEngine``.

:class:`AsyncJobStore` and :class:`AsyncFenceMarks` are the async fronts of
:class:`fencing.JobStore` and :class:`fencing.FenceMarks`, not copies of them: each coroutine
runs the sync store's own unit of work (the same argument checks, statements, retries and
error mapping) through SQLAlchemy's own asyncio bridge, the way ``AsyncSession`` runs
``Session``: ``greenlet_spawn`` runs the sync code on the loop's thread, and every driver
call inside it is awaited on the loop. Lock waits inside a unit yield to the loop
(:mod:`fencing._runtime.bridge`), so a task waiting for SQLite's write lock never stops the task that
holds it.

Drivers: aiosqlite (``fencing.asyncio.create_sqlite_engine``, the same ``BEGIN IMMEDIATE``
glue and durability settings as the sync engine), asyncpg and psycopg's async mode
(``postgresql+asyncpg://``, ``postgresql+psycopg://`` with ``create_async_engine``), and
aiomysql or asyncmy for MariaDB/MySQL. Install one with its extra, e.g.
``pip install fencing[asyncpg]``.

Cancellation (``task.cancel()``, ``asyncio.timeout``) of an operation's caller: the
operation runs to its end, committed or rolled back, and the ``CancelledError`` goes on at
that boundary (a cancellation inside a driver call would drop the connection mid-transaction);
a claim whose caller was cancelled meanwhile is given back (released, its fence kept). A
fenced block cancelled before its end keeps none of its writes; one cancelled while its end
(the final check and ``COMMIT``) is on its way says what happened: it exits normally when it
committed (its writes are kept: do not run it again), raises :class:`~fencing.OutcomeUnknown`
when the answer was lost, and ``CancelledError`` when nothing was kept.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal, TypeAlias

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_scoped_session

from ._errors import ConfigurationError, InvalidArgumentType, LeaseLost, OutcomeUnknown
from ._runtime import bridge, holds
from ._runtime.metrics import StoreMetrics
from ._runtime.sqlite import create_async_engine as create_sqlite_engine
from ._sql.failures import Failure
from ._sql.schema import jobs
from ._sql.values import JobState, Lease, Refusal
from ._store.election import ElectionRules
from ._store.heartbeat_task import AsyncHeartbeat
from ._store.history import History, HistoryEntry
from ._store.jobstore import JobStore
from ._store.locks import DEFAULT_POLL, HeldBase, Locks, locks, lost_reporter, report_lost, timed_out
from ._store.marks import FenceMarks, fence_marks, idempotency_keys
from ._store.steps import adrive, run, to_its_end
from ._store.worker_task import AsyncJob, AsyncWorker

__all__ = [
    "AsyncCallerConnection",
    "AsyncElection",
    "AsyncFenceMarks",
    "AsyncHeartbeat",
    "AsyncHeldLock",
    "AsyncJob",
    "AsyncJobStore",
    "AsyncLocks",
    "AsyncWorker",
    "create_sqlite_engine",
]

#: what ``conn=`` takes: an AsyncConnection, or an AsyncSession (or ``async_scoped_session``)
#: in whose transaction the operation runs
AsyncCallerConnection: TypeAlias = "AsyncConnection | AsyncSession | async_scoped_session[Any]"


def sync_engine(engine: object, what: str) -> Any:
    """The ``sync_engine`` of an ``AsyncEngine`` (the sync front's, refused by name)."""
    if isinstance(engine, AsyncEngine):
        return engine.sync_engine
    hint = f" (a sync Engine: use fencing.{what[5:]})" if type(engine).__name__ == "Engine" else ""
    raise InvalidArgumentType(f"engine must be a sqlalchemy AsyncEngine, got {type(engine).__name__}{hint}")


def caller_sync(conn: object) -> Any:
    """The sync ``Connection`` or ``Session`` behind what a caller passed as ``conn=``:
    the object the sync rules run on, in the caller's transaction."""
    if conn is None:
        return None
    if isinstance(conn, AsyncConnection):
        if conn.sync_connection is None:
            raise ConfigurationError(
                "the AsyncConnection has not been started: use it inside "
                "`async with engine.connect() as conn` (or await conn.start())"
            )
        return conn.sync_connection
    if isinstance(conn, async_scoped_session):
        conn = conn()
    if isinstance(conn, AsyncSession):
        return conn.sync_session
    kind = type(conn).__name__
    hint = " (a sync one: use fencing.JobStore)" if kind in ("Connection", "Session") else ""
    raise InvalidArgumentType(
        f"conn must be a sqlalchemy AsyncConnection, an AsyncSession or None, got {kind}{hint}"
    )


class AsyncJobStore:
    """:class:`fencing.JobStore` for an ``AsyncEngine``: every operation a coroutine.

    The rules, arguments, errors and guarantees are :class:`~fencing.JobStore`'s (see its
    methods): this class only carries them onto the loop. ``conn=`` takes your
    ``AsyncConnection`` or ``AsyncSession``; the operation then runs in your transaction.
    A SQLite engine must come from :func:`fencing.asyncio.create_sqlite_engine` (or
    :func:`fencing.configure_sqlite`); refused engines are refused as the sync store
    refuses them (:class:`~fencing.ConfigurationError`).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        table: Table = jobs,
        *,
        history: History | None = None,
        attempts: Table | None = None,
        payloads: Table | None = None,
        failures: Table | None = None,
        _sync: JobStore | None = None,
    ) -> None:
        if _sync is None:  # else the sync store it fronts is given (AsyncLocks' LockStore)
            _sync = JobStore(
                sync_engine(engine, "AsyncJobStore"),
                table,
                history=history,
                attempts=attempts,
                payloads=payloads,
                failures=failures,
                _bridged=True,
            )
        #: the sync store it bridges to: its rules, run on the asyncio driver
        self.sync_store = _sync
        self.engine = engine
        self.table = table
        #: where :meth:`requeue` keeps a job's attempts base (see :attr:`JobStore.attempts`)
        self.attempts = attempts
        #: where each job's payload is kept (see :attr:`JobStore.payloads`)
        self.payloads = _sync.payloads
        #: where each job's last failure is kept (see :attr:`JobStore.failures`)
        self.failures = _sync.failures

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<AsyncJobStore table={self.table.name!r} engine={url!r}>"

    @property
    def clock_resolution(self) -> float:
        """How finely the database's clock counts (see :attr:`JobStore.clock_resolution`)."""
        return self.sync_store.clock_resolution

    @property
    def holds_key(self) -> Any:
        return self.sync_store.holds_key

    @property
    def metrics(self) -> StoreMetrics:
        """What this store did, by outcome (:class:`fencing._runtime.metrics.StoreMetrics`)."""
        return self.sync_store.metrics

    async def _give_back(self, leases: Iterable[Lease | None]) -> None:
        """Release what a claim took for a caller that was cancelled meanwhile: the jobs
        are claimable again at once (their fences stay)."""
        for lease in leases:
            if lease is not None:
                await run(self.sync_store.release, lease)

    async def _give_one(self, lease: Lease | None) -> None:
        await self._give_back([lease])

    async def claim(
        self,
        job_id: str,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        conn: AsyncCallerConnection | None = None,
    ) -> Lease | None:
        back = self._give_back if conn is None else None
        return await run(
            self.sync_store.claim,
            job_id,
            owner,
            ttl=ttl,
            now=now,
            conn=caller_sync(conn),
            give_back=None if back is None else lambda lease: back([lease]),
        )

    async def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        limit: int = 1,
        max_attempts: int | None = None,
        wait: float = 0.0,
        conn: AsyncCallerConnection | None = None,
    ) -> list[Lease]:
        if wait != 0.0:  # the waiting claim's rules, carried out in this task (the loop never blocks)
            rules = self.sync_store._claim_next_rules(
                owner, ttl=ttl, now=now, limit=limit, max_attempts=max_attempts, wait=wait, conn=conn
            )
            return await adrive(rules)
        return await run(
            self.sync_store.claim_next,
            owner,
            give_back=self._give_back if conn is None else None,
            ttl=ttl,
            now=now,
            limit=limit,
            max_attempts=max_attempts,
            conn=caller_sync(conn),
        )

    async def complete_and_claim_next(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        limit: int = 1,
        max_attempts: int | None = None,
        conn: AsyncCallerConnection | None = None,
    ) -> tuple[list[Literal[True] | Refusal], list[Lease]]:
        back = self._give_back if conn is None else None
        return await run(
            self.sync_store.complete_and_claim_next,
            completions,
            owner,
            give_back=None if back is None else lambda step: back(step[1]),
            ttl=ttl,
            now=now,
            limit=limit,
            max_attempts=max_attempts,
            conn=caller_sync(conn),
        )

    async def claim_many(
        self, job_id: str, owners: Iterable[str], *, ttl: float, now: float | None = None
    ) -> list[Lease | None]:
        """Race :meth:`claim` for every owner as tasks of this loop, each on a connection of
        its own; results in input order. Every argument is checked before the first claim."""
        units = self.sync_store._claim_units(job_id, owners, ttl, now)
        # every claim ends before this returns or raises (the first error, as the sync store)
        claims = (run(self.sync_store._run_own, u, give_back=self._give_one) for u in units)
        outcomes = await asyncio.gather(*claims, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [o for o in outcomes if not isinstance(o, BaseException)]

    @contextlib.asynccontextmanager
    async def fenced(
        self,
        lease: Lease,
        *,
        now: float | None = None,
        complete: bool = False,
        result: str | None = None,
        conn: AsyncCallerConnection | None = None,
    ) -> AsyncIterator[Any]:
        """:meth:`JobStore.fenced` as ``async with``: yields an ``AsyncConnection`` in the
        store's own transaction, or, with ``conn=``, what you passed (the block joins your
        transaction in a SAVEPOINT). The same all-or-nothing rule: if the lease is not current
        at either check, :class:`~fencing.LeaseLost` and nothing of the block stays; a block
        that raises, or is cancelled, keeps nothing either:

            async with store.fenced(lease, complete=True, result="paid") as conn:
                await conn.execute(invoices.insert().values(job=lease.job_id, total=99))

        **Cancelled at its end.** Once the block's body is done, its end (the final check,
        then ``COMMIT``) runs to its answer, which no cancellation can take back. A
        cancellation (``task.cancel()``, ``asyncio.timeout``) that arrives meanwhile gets
        the truth: the block exits normally if it committed (the writes are kept, so a
        retry would apply them twice; ``asyncio.current_task().cancelling()`` still tells
        a task that it was asked to stop), :class:`~fencing.OutcomeUnknown` if the
        connection died with the answer, and ``CancelledError`` if nothing was kept.
        """
        sync_conn = caller_sync(conn)
        block = self.sync_store.fenced(lease, now=now, complete=complete, result=result, conn=sync_conn)

        async def abandon(_: object) -> None:  # cancelled while the block began: roll it back
            cancelled = asyncio.CancelledError()
            await run(block.__exit__, type(cancelled), cancelled, None)

        entered = await run(block.__enter__, give_back=abandon)
        # the block's tasks are its own: a task created inside it (asyncio.wait_for on 3.11,
        # gather, create_task) copies this context, so its operations are the block's task's,
        # refused at once where they would wait for the block's lock
        owner = bridge.CALLER.set(bridge.CALLER.get() or asyncio.current_task())
        try:
            try:
                yield conn if conn is not None else AsyncConnection(self.engine, entered)
            finally:
                bridge.CALLER.reset(owner)  # the block's end is the caller's own again
        except BaseException as exc:
            await run(block.__exit__, type(exc), exc, exc.__traceback__)
            raise
        ended, cancelled = await to_its_end(block.__exit__, None, None, None)
        failed = ended.exception()
        if not cancelled or isinstance(failed, OutcomeUnknown):
            ended.result()  # committed, or the end's own error
        elif failed is not None:  # cancelled, and nothing of the block was kept
            raise asyncio.CancelledError from failed
        # cancelled while its COMMIT was on its way, and committed: it says so by ending normally

    # START GENERATED AsyncJobStore
    # written by tools/generate_async.py from the signatures of fencing.JobStore:
    # edit the script or the sync methods, never this block, then run the script again

    async def create_table(self, *, conn: AsyncCallerConnection | None = None) -> None:
        """:meth:`fencing.JobStore.create_table` as a coroutine."""
        await run(self.sync_store.create_table, conn=caller_sync(conn))

    async def payload(self, job_id: str, *, conn: AsyncCallerConnection | None = None) -> Any:
        """:meth:`fencing.JobStore.payload` as a coroutine."""
        return await run(self.sync_store.payload, job_id, conn=caller_sync(conn))

    async def failure(self, job_id: str, *, conn: AsyncCallerConnection | None = None) -> Failure | None:
        """:meth:`fencing.JobStore.failure` as a coroutine."""
        return await run(self.sync_store.failure, job_id, conn=caller_sync(conn))

    async def history(self, job_id: str, *, conn: AsyncCallerConnection | None = None) -> list[HistoryEntry]:
        """:meth:`fencing.JobStore.history` as a coroutine."""
        return await run(self.sync_store.history, job_id, conn=caller_sync(conn))

    async def prune_history(self, *, conn: AsyncCallerConnection | None = None) -> int:
        """:meth:`fencing.JobStore.prune_history` as a coroutine."""
        return await run(self.sync_store.prune_history, conn=caller_sync(conn))

    async def enqueue(
        self,
        job_id: str,
        *,
        ready_at: float | None = None,
        payload: Any = None,
        revive: bool = True,
        conn: AsyncCallerConnection | None = None,
    ) -> bool:
        """:meth:`fencing.JobStore.enqueue` as a coroutine."""
        return await run(
            self.sync_store.enqueue,
            job_id,
            ready_at=ready_at,
            payload=payload,
            revive=revive,
            conn=caller_sync(conn),
        )

    async def state(self, job_id: str, *, conn: AsyncCallerConnection | None = None) -> JobState | None:
        """:meth:`fencing.JobStore.state` as a coroutine."""
        return await run(self.sync_store.state, job_id, conn=caller_sync(conn))

    async def holder(
        self, job_id: str, *, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> Lease | None:
        """:meth:`fencing.JobStore.holder` as a coroutine."""
        return await run(self.sync_store.holder, job_id, now=now, conn=caller_sync(conn))

    async def renew(
        self, lease: Lease, *, ttl: float, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> Lease | Refusal:
        """:meth:`fencing.JobStore.renew` as a coroutine."""
        return await run(self.sync_store.renew, lease, ttl=ttl, now=now, conn=caller_sync(conn))

    async def complete(
        self,
        lease: Lease,
        result: str | None,
        *,
        now: float | None = None,
        conn: AsyncCallerConnection | None = None,
    ) -> Literal[True] | Refusal:
        """:meth:`fencing.JobStore.complete` as a coroutine."""
        return await run(self.sync_store.complete, lease, result, now=now, conn=caller_sync(conn))

    async def release(
        self,
        lease: Lease,
        *,
        delay: float | None = None,
        failure: str | None = None,
        now: float | None = None,
        conn: AsyncCallerConnection | None = None,
    ) -> Literal[True] | Refusal:
        """:meth:`fencing.JobStore.release` as a coroutine."""
        return await run(
            self.sync_store.release, lease, delay=delay, failure=failure, now=now, conn=caller_sync(conn)
        )

    async def revoke(self, job_id: str, *, conn: AsyncCallerConnection | None = None) -> bool:
        """:meth:`fencing.JobStore.revoke` as a coroutine."""
        return await run(self.sync_store.revoke, job_id, conn=caller_sync(conn))

    async def delete(self, job_id: str, *, conn: AsyncCallerConnection | None = None) -> bool:
        """:meth:`fencing.JobStore.delete` as a coroutine."""
        return await run(self.sync_store.delete, job_id, conn=caller_sync(conn))

    async def requeue(
        self, job_id: str, *, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> bool:
        """:meth:`fencing.JobStore.requeue` as a coroutine."""
        return await run(self.sync_store.requeue, job_id, now=now, conn=caller_sync(conn))

    async def complete_many(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        *,
        now: float | None = None,
        conn: AsyncCallerConnection | None = None,
    ) -> list[Literal[True] | Refusal]:
        """:meth:`fencing.JobStore.complete_many` as a coroutine."""
        return await run(self.sync_store.complete_many, completions, now=now, conn=caller_sync(conn))

    async def poisoned(
        self, max_attempts: int, *, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> list[JobState]:
        """:meth:`fencing.JobStore.poisoned` as a coroutine."""
        return await run(self.sync_store.poisoned, max_attempts, now=now, conn=caller_sync(conn))

    async def check(
        self, lease: Lease, *, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> None:
        """:meth:`fencing.JobStore.check` as a coroutine."""
        await run(self.sync_store.check, lease, now=now, conn=caller_sync(conn))

    # END GENERATED AsyncJobStore


class AsyncFenceMarks:
    """:class:`fencing.FenceMarks` for an ``AsyncEngine``: the same rules, as coroutines;
    ``conn=`` takes your ``AsyncConnection`` or ``AsyncSession``."""

    def __init__(
        self, engine: AsyncEngine, marks: Table = fence_marks, keys: Table = idempotency_keys
    ) -> None:
        sync = sync_engine(engine, "AsyncFenceMarks")
        self.sync_marks = FenceMarks(sync, marks, keys, _bridged=True)
        self.engine = engine
        self.marks = marks
        self.keys = keys

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<AsyncFenceMarks marks={self.marks.name!r} keys={self.keys.name!r} engine={url!r}>"

    @property
    def metrics(self) -> StoreMetrics:
        """What these marks did, by outcome (:class:`fencing._runtime.metrics.StoreMetrics`)."""
        return self.sync_marks.metrics

    # START GENERATED AsyncFenceMarks
    # written by tools/generate_async.py from the signatures of fencing.FenceMarks:
    # edit the script or the sync methods, never this block, then run the script again

    async def create_tables(self, *, conn: AsyncCallerConnection | None = None) -> None:
        """:meth:`fencing.FenceMarks.create_tables` as a coroutine."""
        await run(self.sync_marks.create_tables, conn=caller_sync(conn))

    async def accept(self, resource: str, fence: int, *, conn: AsyncCallerConnection | None = None) -> bool:
        """:meth:`fencing.FenceMarks.accept` as a coroutine."""
        return await run(self.sync_marks.accept, resource, fence, conn=caller_sync(conn))

    async def highest(self, resource: str, *, conn: AsyncCallerConnection | None = None) -> int | None:
        """:meth:`fencing.FenceMarks.highest` as a coroutine."""
        return await run(self.sync_marks.highest, resource, conn=caller_sync(conn))

    async def record_once(
        self, key: str, *, fence: int | None = None, conn: AsyncCallerConnection | None = None
    ) -> bool:
        """:meth:`fencing.FenceMarks.record_once` as a coroutine."""
        return await run(self.sync_marks.record_once, key, fence=fence, conn=caller_sync(conn))

    # END GENERATED AsyncFenceMarks


class AsyncLocks:
    """:class:`fencing.Locks` for an ``AsyncEngine``: the same named locks, every operation
    a coroutine, run by the sync rules through the bridge (as :class:`AsyncJobStore`).
    A waiter pauses with ``asyncio.sleep``; :meth:`hold` keeps the lock with an
    :class:`AsyncHeartbeat` task."""

    def __init__(
        self,
        engine: AsyncEngine,
        table: Table = locks,
        *,
        history: History | None = None,
        poll: float = DEFAULT_POLL,
    ) -> None:
        sync = sync_engine(engine, "AsyncLocks")
        #: the sync locks whose rules run on the asyncio driver
        self.sync_locks = Locks(sync, table, history=history, poll=poll, _bridged=True)
        #: the async store the locks are rows of: the async front of ``sync_locks.store``
        self.store = AsyncJobStore(engine, table, history=history, _sync=self.sync_locks.store)
        self.engine = engine
        self.table = table

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<AsyncLocks table={self.table.name!r} engine={url!r}>"

    @property
    def poll(self) -> float:
        return self.sync_locks.poll

    @property
    def metrics(self) -> StoreMetrics:
        """The store's metrics, with the locks' and elections' own counters (as
        :attr:`fencing.Locks.metrics`)."""
        return self.store.metrics

    async def try_acquire(
        self,
        name: str,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        conn: AsyncCallerConnection | None = None,
    ) -> Lease | None:
        back = self.store._give_one if conn is None else None
        return await run(
            self.sync_locks.try_acquire, name, owner, ttl=ttl, now=now, conn=caller_sync(conn), give_back=back
        )

    async def acquire(
        self,
        name: str,
        owner: str,
        *,
        ttl: float,
        timeout: float | None = 0.0,
        now: Callable[[], float] | None = None,
    ) -> Lease | None:
        """:meth:`fencing.Locks.acquire` (its queue, its rules), pausing with ``asyncio.sleep``."""
        rules = self.sync_locks._acquire_rules(name, owner, ttl=ttl, timeout=timeout, now=now)
        return await adrive(rules)

    @contextlib.asynccontextmanager
    async def hold(
        self,
        name: str,
        owner: str,
        *,
        ttl: float,
        timeout: float | None = 0.0,
        interval: float | None = None,
        on_lost: Callable[[AsyncHeldLock], object] | None = None,
    ) -> AsyncIterator[AsyncHeldLock]:
        """:meth:`fencing.Locks.hold` on the loop: the lock kept by an :class:`AsyncHeartbeat`."""
        lease = await self.acquire(name, owner, ttl=ttl, timeout=timeout)
        if lease is None:
            raise timed_out(name, timeout, await self.holder(name))
        held = AsyncHeldLock(self, lease)
        heartbeat = AsyncHeartbeat(
            self.store,
            lease,
            ttl,
            interval=interval,
            on_lost=lost_reporter(self.metrics, held, on_lost),
            release_on_exit=True,
        )
        held._heartbeat = heartbeat
        try:
            await heartbeat.start()
        except BaseException as exc:
            if isinstance(exc, LeaseLost):
                report_lost(self.metrics, lease, heartbeat.reason)
            with contextlib.suppress(Exception):
                await self.store.release(lease)
            raise
        try:
            yield held
        except BaseException as exc:
            await heartbeat.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        await heartbeat.__aexit__(None, None, None)

    def fenced(
        self, lease: Lease, *, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.store.fenced(lease, now=now, conn=conn)

    # START GENERATED AsyncLocks
    # written by tools/generate_async.py from the signatures of fencing.Locks:
    # edit the script or the sync methods, never this block, then run the script again

    async def create_table(self, *, conn: AsyncCallerConnection | None = None) -> None:
        """:meth:`fencing.Locks.create_table` as a coroutine."""
        await run(self.sync_locks.create_table, conn=caller_sync(conn))

    async def renew(
        self, lease: Lease, *, ttl: float, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> Lease | Refusal:
        """:meth:`fencing.Locks.renew` as a coroutine."""
        return await run(self.sync_locks.renew, lease, ttl=ttl, now=now, conn=caller_sync(conn))

    async def release(
        self, lease: Lease, *, conn: AsyncCallerConnection | None = None
    ) -> Literal[True] | Refusal:
        """:meth:`fencing.Locks.release` as a coroutine."""
        return await run(self.sync_locks.release, lease, conn=caller_sync(conn))

    async def check(
        self, lease: Lease, *, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> None:
        """:meth:`fencing.Locks.check` as a coroutine."""
        await run(self.sync_locks.check, lease, now=now, conn=caller_sync(conn))

    async def holder(
        self, name: str, *, now: float | None = None, conn: AsyncCallerConnection | None = None
    ) -> Lease | None:
        """:meth:`fencing.Locks.holder` as a coroutine."""
        return await run(self.sync_locks.holder, name, now=now, conn=caller_sync(conn))

    async def revoke(self, name: str, *, conn: AsyncCallerConnection | None = None) -> bool:
        """:meth:`fencing.Locks.revoke` as a coroutine."""
        return await run(self.sync_locks.revoke, name, conn=caller_sync(conn))

    async def delete(self, name: str, *, conn: AsyncCallerConnection | None = None) -> bool:
        """:meth:`fencing.Locks.delete` as a coroutine."""
        return await run(self.sync_locks.delete, name, conn=caller_sync(conn))

    # END GENERATED AsyncLocks


class AsyncHeldLock(HeldBase[asyncio.Event]):
    """A lock held by :meth:`AsyncLocks.hold` for its block (as :class:`fencing.HeldLock`)."""

    def __init__(self, locks: AsyncLocks, lease: Lease) -> None:
        super().__init__(lease)
        self._locks = locks

    def fenced(
        self, *, conn: AsyncCallerConnection | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        """:meth:`AsyncLocks.fenced` with this lock's lease."""
        return self._locks.fenced(self.lease, conn=conn)


class AsyncElection(ElectionRules):
    """:class:`fencing.Election` for :class:`AsyncLocks`: the same campaign (its rules are
    :class:`~fencing._store.election.ElectionRules`), carried out in an asyncio task, its term
    kept by an :class:`AsyncHeartbeat`. Callbacks may be plain functions or coroutine
    functions (awaited in the task). ``await start()`` / ``await stop()`` or ``async with``."""

    _locks_kind = "a fencing.asyncio.AsyncLocks"

    locks: AsyncLocks

    def _make_events(self) -> None:
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: set while this candidate leads
        self.elected = asyncio.Event()

    def _sync_store(self, locks: Any) -> JobStore:
        if not isinstance(locks, AsyncLocks):
            raise InvalidArgumentType(
                f"locks must be a fencing.asyncio.AsyncLocks, got {type(locks).__name__}"
            )
        return locks.sync_locks.store

    def _new_heartbeat(self, lease: Lease) -> AsyncHeartbeat:
        return AsyncHeartbeat(
            self.locks.store, lease, self._ttl, interval=self._interval, on_lost=lambda _: self._wake.set()
        )

    def _set_elected(self, elected: bool) -> None:
        if elected:
            self.elected.set()
        else:
            self.elected.clear()

    def fenced(
        self, *, conn: AsyncCallerConnection | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        """:meth:`AsyncLocks.fenced` under this candidate's term (``LeaseLost`` at once if it
        does not lead)."""
        return self.locks.fenced(self._leading(), conn=conn)

    async def start(self) -> AsyncElection:
        """Campaign in a task of the running loop; a second start is an error."""
        if self._task is not None:
            raise RuntimeError("this election was started already")
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"fencing-election-{self.name:.40}"
        )
        return self

    async def stop(self, *, resign: bool = True) -> None:
        """Stop campaigning and wait for the task; if leading, step down now (``resign``).
        Inside a fenced block on the term it returns at once, and the candidate steps down
        when the block ends (:meth:`fencing.Election.stop`)."""
        self._resign = resign
        self._stopping = True
        self._wake.set()
        task = self._task
        if task is not None and task is not asyncio.current_task():
            if holds.HELD[0] and await run(self._caller_holds_the_name):
                return  # the release would wait for the caller's own block: it follows the block
            await asyncio.wait({task})

    async def resign(self) -> None:
        await self.stop(resign=True)

    async def __aenter__(self) -> AsyncElection:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        await adrive(self._campaign_rules(), wake=self._wake)
