"""The behavioural suite, run a second time through the async store.

A test written against ``JobStore`` is sync code. For the ``async`` parameter of the
``store`` fixture, its body runs inside SQLAlchemy's asyncio bridge on an event loop of its
own (``greenlet_spawn``, as ``AsyncSession.run_sync`` runs sync code), and ``store`` is a
:class:`BlockingAsyncStore`: each call awaits the :class:`~fencing.asyncio.AsyncJobStore`
coroutine (``await_only``). What the test passes as ``conn=`` (a ``Connection`` of
``store.engine``, a ``Session``) reaches the async store as the ``AsyncConnection`` or
``AsyncSession`` in front of it, and ``fenced()`` yields what an async caller would get,
seen from the sync side. So every assertion of the suite is checked against the async
front: its argument checks, statements, error mapping and transactions.

Only the test body runs on the loop: a thread the test starts is not in the bridge and is
refused (those tests race threads; the async races are in ``test_asyncio.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.util.concurrency import await_only, greenlet_spawn

from fencing import JobStore
from fencing._runtime import bridge
from fencing.asyncio import AsyncJobStore
from tests import backends

#: the fixture parameter that runs a test through the async store
ASYNC = "async"


def wait(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    """The coroutine's result: awaited inside the bridge, else run on the test's loop."""
    if bridge.in_bridge():
        return await_only(coro)
    if loop.is_running():
        coro.close()
        raise RuntimeError(
            "the async store is driven by the test body's event loop; a thread of the test "
            "cannot use it (the async races are in tests/store/test_asyncio.py)"
        )
    return loop.run_until_complete(coro)


class Blocking:
    """Any object of the async front (``AsyncFenceMarks``, ``AsyncHeartbeat``) seen from
    sync code: each coroutine method's result awaited, everything else as it is."""

    def __init__(self, target: object, loop: asyncio.AbstractEventLoop) -> None:
        self.target = target
        self.loop = loop

    def __repr__(self) -> str:
        return f"<Blocking {self.target!r}>"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return wait(self.loop, attr(*args, **kwargs))

        return call


class BlockingAsyncStore:
    """``JobStore``'s interface over an :class:`AsyncJobStore`, for sync test bodies."""

    def __init__(self, store: AsyncJobStore, loop: asyncio.AbstractEventLoop) -> None:
        self.async_store = store
        self.loop = loop
        self.engine = store.engine.sync_engine  # usable inside the bridge, as a test body is
        self.table = store.table

    def __repr__(self) -> str:
        return f"<BlockingAsyncStore {self.async_store!r}>"

    def wait(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return wait(self.loop, coro)

    def front(self, conn: object) -> object:
        """What an async caller would pass for the sync ``conn`` a test holds."""
        if isinstance(conn, Connection):
            return AsyncConnection(self.async_store.engine, conn)
        if isinstance(conn, Session):
            front = AsyncSession(self.async_store.engine)
            front.sync_session = front._proxied = conn  # type: ignore[misc]
            return front
        return conn  # None, or a wrong type the async store must refuse itself

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # the statements a plan test reads: the sync rules' own
            return getattr(self.async_store.sync_store, name)
        attr = getattr(self.async_store, name)
        if not inspect.iscoroutinefunction(attr):
            sync_attr = getattr(self.async_store.sync_store, name, attr)
            if callable(sync_attr) and not name.startswith("_"):
                raise AttributeError(f"AsyncJobStore has no coroutine {name!r}")
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if "conn" in kwargs:
                kwargs["conn"] = self.front(kwargs["conn"])
            return self.wait(attr(*args, **kwargs))

        return call

    @contextlib.contextmanager
    def fenced(self, lease: Any, **kwargs: Any) -> Iterator[Any]:
        conn = kwargs.get("conn")
        if "conn" in kwargs:
            kwargs["conn"] = self.front(conn)
        block = self.async_store.fenced(lease, **kwargs)
        entered = self.wait(block.__aenter__())
        try:
            yield conn if conn is not None else entered.sync_connection
        except BaseException as exc:
            if not self.wait(block.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self.wait(block.__aexit__(None, None, None))


def run_in_bridge(loop: asyncio.AbstractEventLoop, fn: Any, kwargs: dict[str, Any]) -> Any:
    """Run a sync test body inside the bridge on ``loop``."""
    return loop.run_until_complete(greenlet_spawn(fn, **kwargs))


def dispose(engine: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(engine.dispose())


class BlockingAsyncLocks(Blocking):
    """``Locks``'s interface over an :class:`~fencing.asyncio.AsyncLocks`, for sync test
    bodies: each coroutine awaited, ``fenced`` a sync context manager, ``store`` the
    blocking store."""

    def __init__(self, locks: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(locks, loop)
        self.store = BlockingAsyncStore(locks.store, loop)
        self.table = locks.table

    def fenced(self, lease: Any, **kwargs: Any) -> Any:
        return self.store.fenced(lease, **kwargs)

    @contextlib.contextmanager
    def hold(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        block = self.target.hold(*args, **kwargs)
        entered = wait(self.loop, block.__aenter__())
        try:
            yield entered
        except BaseException as exc:
            if not wait(self.loop, block.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            wait(self.loop, block.__aexit__(None, None, None))


def store_on_front(
    request: pytest.FixtureRequest, engine: Engine, target: str, chosen: dict[str, Any]
) -> Iterator[Any]:
    """A store on ``chosen`` tables, sync or async as ``request.param`` says."""
    if request.param != ASYNC:
        s = JobStore(engine, **chosen)
        s.create_table()
        yield s
        return
    loop = asyncio.new_event_loop()
    async_engine = backends.async_engine_for(target)
    try:
        blocking = BlockingAsyncStore(AsyncJobStore(async_engine, **chosen), loop)
        blocking.create_table()
        request.node._fencing_loop = loop  # type: ignore[attr-defined]  # the body runs on it
        yield blocking
    finally:
        dispose(async_engine, loop)
        loop.close()
