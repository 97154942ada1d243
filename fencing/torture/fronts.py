"""The two fronts a worker's rules run on: the sync store, or the async one.

The rules (:mod:`.worker`: what to claim, when to look at the heartbeat, how to finish, what
to journal) are written once, as sync code, against :class:`Front`. :class:`SyncFront` is
:class:`fencing.JobStore`, :class:`fencing.FenceMarks` and :class:`fencing.Heartbeat` threads
on the sync drivers. :class:`AsyncFront` is :class:`fencing.asyncio.AsyncJobStore`,
:class:`~fencing.asyncio.AsyncFenceMarks` and :class:`fencing._store.heartbeat_task.AsyncHeartbeat`
on the asyncio drivers (aiosqlite, asyncpg, asyncmy): the rules run inside SQLAlchemy's
asyncio bridge on an event loop of the worker's own (``greenlet_spawn``, the way
``AsyncSession.run_sync`` runs sync code), every call awaits the async front's coroutine
(``await_only``), the heartbeats are tasks of that loop that renew while the rules wait, and
the rules' pauses yield to the loop (:func:`fencing._runtime.bridge.sleep`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from sqlalchemy.sql import Executable

from .._runtime import holds
from .._runtime.metrics import StoreMetrics
from .._runtime.private_sqlalchemy import await_only, greenlet_spawn
from .._sql.values import Lease, Refusal
from .._store.heartbeat import Heartbeat
from .._store.jobstore import JobStore
from .._store.marks import FenceMarks
from .config import FRONTS, TortureConfig
from .connect import open_async_engine, open_engine, open_store
from .tables import TortureTables

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from .._store.heartbeat_task import AsyncHeartbeat
    from ..asyncio import AsyncFenceMarks, AsyncJobStore

__all__ = ["Front", "Keeper", "ShowsHeartbeat", "WorkerStore", "with_front"]

T = TypeVar("T")
Completions = list[tuple[Lease, "str | None"]]


class Keeper(Protocol):
    """What a heartbeat renews through (the worker's journaled store)."""

    @property
    def holds_key(self) -> holds.Key: ...

    @property
    def clock_resolution(self) -> float: ...

    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | Refusal: ...

    def release(self, lease: Lease, *, delay: float | None = None) -> Literal[True] | Refusal: ...


class WorkerStore(Keeper, Protocol):
    """The store's calls a worker makes, as its rules make them."""

    def claim_next(self, owner: str, *, ttl: float, limit: int) -> list[Lease]: ...

    def complete(self, lease: Lease, result: str | None) -> Literal[True] | Refusal: ...

    def complete_many(self, completions: Completions) -> list[Literal[True] | Refusal]: ...

    def complete_and_claim_next(
        self, completions: Completions, owner: str, *, ttl: float, limit: int
    ) -> tuple[list[Literal[True] | Refusal], list[Lease]]: ...

    def fenced(self, lease: Lease, *, complete: bool, result: str | None) -> AbstractContextManager[Any]:
        """Yields the block's connection: something with ``execute(statement)``."""
        ...


class WorkerMarks(Protocol):
    def accept(self, resource: str, fence: int, *, conn: Any) -> bool: ...


class ShowsHeartbeat(Protocol):
    """What the rules read from a running heartbeat, on either front (no I/O)."""

    @property
    def held(self) -> bool: ...

    @property
    def lease(self) -> Lease: ...


H = TypeVar("H", bound=ShowsHeartbeat)


class Front(abc.ABC, Generic[H]):
    """The store, the marks and the heartbeats (``H``) of one worker process, on one database."""

    store: WorkerStore
    marks: WorkerMarks
    #: the counters of the store and of the marks on trial (what a worker that stops cleanly
    #: journals, for the verdict to set against what it journaled call by call)
    store_metrics: StoreMetrics
    marks_metrics: StoreMetrics

    @abc.abstractmethod
    def begin(self) -> AbstractContextManager[Any]:
        """A transaction of the application's own: yields its connection (``execute``)."""

    @abc.abstractmethod
    def heartbeat(self, keeper: Keeper, lease: Lease, ttl: float) -> AbstractContextManager[H]:
        """A heartbeat keeping ``lease`` through ``keeper``, running inside ``with``."""

    @abc.abstractmethod
    def stop(self, heartbeat: H) -> None:
        """Stop renewing; a renewal in flight ends first (the thread joined, the task awaited)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class SyncFront(Front[Heartbeat]):
    def __init__(self, config: TortureConfig, tables: TortureTables) -> None:
        self.engine = open_engine(config.url)
        store = open_store(config.store, self.engine, tables.jobs, JobStore, history=tables.recorded)
        marks = FenceMarks(self.engine, tables.marks, tables.keys)
        self.store, self.marks = store, marks
        self.store_metrics, self.marks_metrics = store.metrics, marks.metrics

    def begin(self) -> AbstractContextManager[Any]:
        return self.engine.begin()

    def heartbeat(self, keeper: Keeper, lease: Lease, ttl: float) -> Heartbeat:
        return Heartbeat(keeper, lease, ttl)

    def stop(self, heartbeat: Heartbeat) -> None:
        heartbeat.stop()

    def close(self) -> None:
        self.engine.dispose()


class AsyncFront(Front["AsyncHeartbeat"]):
    """Only ever used inside the bridge (:func:`with_front`)."""

    def __init__(self, config: TortureConfig, tables: TortureTables) -> None:
        from ..asyncio import AsyncFenceMarks, AsyncJobStore

        self.engine = open_async_engine(config.url)
        store = open_store(config.store, self.engine, tables.jobs, AsyncJobStore, history=tables.recorded)
        marks = AsyncFenceMarks(self.engine, tables.marks, tables.keys)
        self.store, self.marks = _AwaitedStore(store), _AwaitedMarks(marks)
        self.store_metrics, self.marks_metrics = store.metrics, marks.metrics

    @contextlib.contextmanager
    def begin(self) -> Iterator[_AwaitedConnection]:
        with _awaited(self.engine.begin()) as conn:
            yield _AwaitedConnection(conn)

    def heartbeat(self, keeper: Keeper, lease: Lease, ttl: float) -> AbstractContextManager[AsyncHeartbeat]:
        from .._store.heartbeat_task import AsyncHeartbeat

        return _awaited(AsyncHeartbeat(_AwaitedKeeper(keeper), lease, ttl))

    def stop(self, heartbeat: AsyncHeartbeat) -> None:
        await_only(heartbeat.stop())

    def close(self) -> None:
        await_only(self.engine.dispose())


Opener = Callable[[TortureConfig, TortureTables], "Front[Any]"]
Work = Callable[["Front[Any]"], None]


def with_front(config: TortureConfig, tables: TortureTables, work: Work) -> None:
    """Open ``config.front``'s front, ``work(front)``, close it. The async front's whole life
    runs inside the bridge, on an event loop of its own."""
    if config.front not in FRONTS:  # mixed: each worker's own front, config.for_worker(index)
        raise ValueError(f"one front to open, not {config.front!r}: config.for_worker(index) first")
    if config.front == "async":
        asyncio.run(greenlet_spawn(_with, AsyncFront, config, tables, work))
    else:
        _with(SyncFront, config, tables, work)


def _with(opener: Opener, config: TortureConfig, tables: TortureTables, work: Work) -> None:
    front = opener(config, tables)
    try:
        work(front)
    finally:
        front.close()


# -- the async front as the rules call it ---------------------------------------------------------


@contextlib.contextmanager
def _awaited(manager: AbstractAsyncContextManager[T]) -> Iterator[T]:
    """``async with manager`` for sync code inside the bridge."""
    value = await_only(manager.__aenter__())
    try:
        yield value
    except BaseException as exc:
        if not await_only(manager.__aexit__(type(exc), exc, exc.__traceback__)):
            raise
    else:
        await_only(manager.__aexit__(None, None, None))


class _AwaitedConnection:
    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    def execute(self, statement: Executable) -> object:
        return await_only(self.conn.execute(statement))


class _AwaitedStore:
    """An :class:`~fencing.asyncio.AsyncJobStore` whose every call the rules await."""

    def __init__(self, store: AsyncJobStore) -> None:
        self.store = store
        self.holds_key: holds.Key = store.holds_key
        self.clock_resolution = store.clock_resolution

    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | Refusal:
        return await_only(self.store.renew(lease, ttl=ttl, now=now))

    def release(self, lease: Lease, *, delay: float | None = None) -> Literal[True] | Refusal:
        return await_only(self.store.release(lease, delay=delay))

    def claim_next(self, owner: str, *, ttl: float, limit: int) -> list[Lease]:
        return await_only(self.store.claim_next(owner, ttl=ttl, limit=limit))

    def complete(self, lease: Lease, result: str | None) -> Literal[True] | Refusal:
        return await_only(self.store.complete(lease, result))

    def complete_many(self, completions: Completions) -> list[Literal[True] | Refusal]:
        return await_only(self.store.complete_many(completions))

    def complete_and_claim_next(
        self, completions: Completions, owner: str, *, ttl: float, limit: int
    ) -> tuple[list[Literal[True] | Refusal], list[Lease]]:
        return await_only(self.store.complete_and_claim_next(completions, owner, ttl=ttl, limit=limit))

    @contextlib.contextmanager
    def fenced(self, lease: Lease, *, complete: bool, result: str | None) -> Iterator[_AwaitedConnection]:
        with _awaited(self.store.fenced(lease, complete=complete, result=result)) as conn:
            yield _AwaitedConnection(conn)


class _AwaitedMarks:
    def __init__(self, marks: AsyncFenceMarks) -> None:
        self.marks = marks

    def accept(self, resource: str, fence: int, *, conn: _AwaitedConnection) -> bool:
        return await_only(self.marks.accept(resource, fence, conn=conn.conn))


class _AwaitedKeeper:
    """The worker's keeper as :class:`~fencing._store.heartbeat_task.AsyncHeartbeat` awaits it:
    each renewal and release runs the keeper (its journalling) in the bridge, in the
    heartbeat's task, awaiting the async store."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self.holds_key = keeper.holds_key
        self.clock_resolution = keeper.clock_resolution

    async def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | Refusal:
        return await greenlet_spawn(self.keeper.renew, lease, ttl=ttl, now=now)

    async def release(self, lease: Lease) -> Literal[True] | Refusal:
        return await greenlet_spawn(self.keeper.release, lease)
