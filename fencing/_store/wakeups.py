"""Waking a lock's waiters the moment it is freed, and a claim's the moment a job is enqueued
(PostgreSQL's ``LISTEN``/``NOTIFY``; the jobs' side: :mod:`.bell`).

A waiter paces its looks at a held lock with backoff (:mod:`.waiting`): cheap, but a lock
released just after a look sits free until the next one, up to ``poll`` seconds. On
PostgreSQL the waiter also listens: whoever frees a lock that has waiters (a release, a
revoke, a delete: :class:`Notifier`) sends ``NOTIFY`` on the locks table's channel with the
lock's name, in the freeing transaction (so a release in the caller's own transaction
notifies at its commit, and one rolled back never does); a waiter that hears its lock's name
looks at once. The backoff stays the bound: an expired holder frees the lock without anyone
notifying, a notification can be missed (a connection lost, a waiter that began listening
just after it was sent), and the other databases have no notifications; none of that costs
more than the ``poll`` it costs without them.

What it costs: nothing more for the freeing operation (its ``UPDATE`` returns the
notification, :class:`Notifier`: the same one statement and round trip), and **one**
listening connection per engine and process, whatever the number of waiters: each waiter
subscribes to it (:class:`Listener`) for its lock's name. That connection is not taken from
the engine's pool, so waiters never take the connection a holder's heartbeat needs to renew,
nor wait for one: it comes from a pool of its own, ``engine.pool.recreate()`` (the engine's
own creator, connect arguments and pool events), and it is named
:data:`fencing._sql.channels.LISTENING` (``application_name``), which is how an enqueue in any
process knows that someone listens (:mod:`.announcer`). With the sync driver, psycopg 3.2 or later
(``notifies(timeout=)``), a daemon thread listens, and closes the connection once no one has
waited for :data:`LINGER` seconds; on the async front (asyncpg, psycopg's async mode) the
connection belongs to the event loop, and the last waiting task to leave closes it. Another
driver (psycopg2, pg8000) waits by backoff alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
import weakref
from typing import Any

from sqlalchemy import ColumnElement, Engine, Table

from .._dialects import of
from .._dialects.base import LOOP, WATCHED
from .._runtime import bridge, forks
from .._sql.channels import LISTENING, channel_of
from .._sql.waiters import freed_notice

__all__ = ["LINGER", "Listener", "Notifier", "channel_of", "listen"]

logger = logging.getLogger("fencing.locks")

#: how long the sync listener keeps its connection after its last waiter left (seconds): a
#: run of waits, one after the other, shares one connection
LINGER = 1.0
#: how long a listener waits for notifications before it looks for new channels to listen
#: on and for waiters gone (seconds); a notification is handed on the moment it arrives
_TICK = 0.1
#: the pause before a failed listening connection is opened again (seconds)
_RETRY = 1.0
#: how often a SQLite file's watcher reads ``PRAGMA data_version`` while someone waits
#: (seconds): what a job another process enqueues may wait to be seen; a read costs 8 µs
WATCH_EVERY = 0.002


class Notifier:
    """What a statement that frees a lock RETURNs on PostgreSQL to wake its waiters
    (:attr:`notice`): ``pg_notify`` on the table's channel with the lock's name, from the
    lock's rows in the waiters' queue (no row, no notification), evaluated only for a row
    the statement changed, and delivered when its transaction commits."""

    def __init__(self, locks: Table, waiters: Table) -> None:
        self.channel = channel_of(locks)
        self.notice: ColumnElement[Any] = freed_notice(locks, waiters, self.channel)


def listen(engine: Engine, channel: str, name: str) -> Listener | None:
    """A subscription to this process's listening connection of ``engine`` (opened if
    needed) for ``name``'s release on ``channel``, or ``None`` where notifications cannot be
    had (a driver without them, MariaDB, an in-memory SQLite database): the waiter then paces
    itself by backoff alone. On SQLite the subscription is to the database file's watcher
    instead (:class:`_FileWatch`), which wakes every waiter of the file at any other
    connection's commit. On the async front it is called inside asyncio's bridge, on the loop
    the waiting task runs on. It never takes a connection of the engine's pool."""
    dialect = engine.dialect
    where = of(dialect).wakeups(dialect.driver, is_async=bool(getattr(dialect, "is_async", False)))
    if where is None:
        return None
    engine = forks.root(engine)  # an engine.execution_options() copy shares its parent's pool
    try:
        if where == WATCHED:
            path = engine.url.database
            if not path or path == ":memory:" or path.startswith("file:"):
                return None  # one connection of one process, or a URI of its own making
            return _file_watch(os.path.realpath(path)).subscribe(channel, name)
        if where == LOOP:
            return _loop_hub(engine).subscribe(channel, name)
        return _thread_hub(engine).subscribe(channel, name)
    except Exception:
        logger.debug("could not listen for a lock's release; waiting by backoff", exc_info=True)
        return None


#: names the listening connection, so an enqueue of any process sees that someone listens
_NAMED = f"SET application_name = '{LISTENING}'"


def _quoted(channel: str) -> str:
    return '"' + channel.replace('"', '""') + '"'


class Listener:
    """One waiter's subscription to its process's listening connection: :meth:`wait` (a
    thread) or :meth:`wait_async` (a task) until its lock is said to be freed or the time is
    up; :meth:`close` ends the subscription (idempotent). A notification that arrives while
    the waiter is not waiting ends its next wait at once."""

    def __init__(self, hub: Any, channel: str, name: str) -> None:
        self._hub = hub
        self.channel = channel
        self.name = name
        self._closed = False

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` on this thread: whether the lock was said to be freed."""
        raise NotImplementedError(f"{type(self).__name__} waits in a task (wait_async)")

    async def wait_async(self, seconds: float) -> bool:
        """Wait up to ``seconds`` in this task: whether the lock was said to be freed."""
        raise NotImplementedError(f"{type(self).__name__} waits on a thread (wait)")

    def close(self) -> None:
        """Stop listening for this lock (the connection stays for the other waiters)."""
        if not self._closed:
            self._closed = True
            self._hub.unsubscribe(self)

    def _freed(self) -> None:
        raise NotImplementedError


class _ThreadListener(Listener):
    def __init__(self, hub: Any, channel: str, name: str) -> None:
        super().__init__(hub, channel, name)
        self._event = threading.Event()

    def wait(self, seconds: float) -> bool:
        if not self._event.wait(max(seconds, 0.0)):
            return False
        self._event.clear()
        return True

    def _freed(self) -> None:
        self._event.set()


class _TaskListener(Listener):
    """A waiting task's subscription, woken from any thread (a listener's, the bell's, the
    loop's own): its event is set on its loop."""

    def __init__(self, hub: Any, channel: str, name: str) -> None:
        super().__init__(hub, channel, name)
        self._event = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    async def wait_async(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._event.wait(), max(seconds, 0.0))
        except (asyncio.TimeoutError, TimeoutError):
            return False
        self._event.clear()
        return True

    def _freed(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits there any more
            self._loop.call_soon_threadsafe(self._event.set)


def listener_here(hub: Any, channel: str, name: str) -> Listener:
    """A subscription for the waiter calling: a thread's, or on the async front (inside
    asyncio's bridge) a task's on the running loop."""
    kind = _TaskListener if bridge.in_bridge() else _ThreadListener
    return kind(hub, channel, name)


class _Waiters:
    """The subscriptions of one listening connection, by channel and lock name. Held
    weakly: a listener dropped without :meth:`Listener.close` is no waiter any more."""

    def __init__(self) -> None:
        self._by_channel: dict[str, dict[str, weakref.WeakSet[Listener]]] = {}

    def add(self, listener: Listener) -> None:
        names = self._by_channel.setdefault(listener.channel, {})
        names.setdefault(listener.name, weakref.WeakSet()).add(listener)

    def remove(self, listener: Listener) -> None:
        names = self._by_channel.get(listener.channel, {})
        names.get(listener.name, weakref.WeakSet()).discard(listener)

    def channels(self) -> set[str]:
        """The channels someone listens on now (the empty ones are dropped)."""
        for channel, names in list(self._by_channel.items()):
            for name, listeners in list(names.items()):
                if not listeners:
                    del names[name]
            if not names:
                del self._by_channel[channel]
        return set(self._by_channel)

    def of(self, channel: str, name: str) -> list[Listener]:
        return list(self._by_channel.get(channel, {}).get(name, ()))

    def all(self) -> list[Listener]:
        return [
            listener for names in self._by_channel.values() for group in names.values() for listener in group
        ]


class _Daemon:
    """What a daemon thread that wakes waiters keeps: its waiters, and its thread, started
    by the first to subscribe and ended :data:`LINGER` seconds after the last one left."""

    _name = "fencing-listener"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters = _Waiters()
        self._thread: threading.Thread | None = None

    def _listener(self, channel: str, name: str) -> Listener:
        return _ThreadListener(self, channel, name)

    def subscribe(self, channel: str, name: str) -> Listener:
        listener = self._listener(channel, name)
        with self._lock:
            self._waiters.add(listener)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            self._waiters.remove(listener)

    def _wanted(self, idle_since: float | None) -> tuple[set[str], float | None] | None:
        """The channels someone listens on now, and since when no one has (``None`` if
        someone does); ``None`` instead once the thread is to end (it forgets itself, so a
        waiter subscribing from now on starts another)."""
        with self._lock:
            wanted = self._waiters.channels()
            if wanted:
                return wanted, None
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= LINGER:
                self._thread = None
                return None
            return wanted, idle_since

    def _run(self) -> None:
        raise NotImplementedError


class _ThreadHub(_Daemon):
    """The sync driver's listening connection of one engine in this process: a daemon
    thread opens it when the first waiter subscribes, hands each notification to the
    waiters of its lock, and closes it :data:`LINGER` seconds after the last one left."""

    _name = "fencing-lock-listener"

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self._engine = weakref.ref(engine)  # the hub lives in a registry keyed by the engine
        #: the open connections (one, but for a moment when a new thread starts as the old
        #: one closes its own): here, not only in a thread, so a forked child keeps them
        self._open: set[Any] = set()

    def _heard(self, channel: str, name: str) -> None:
        with self._lock:
            found = self._waiters.of(channel, name)
        for listener in found:
            listener._freed()

    def _run(self) -> None:
        pool: Any = None
        conn: Any = None
        listening: set[str] = set()
        idle_since: float | None = None
        try:
            while True:
                found = self._wanted(idle_since)
                if found is None:
                    return
                wanted, idle_since = found
                try:
                    if conn is None:
                        engine = self._engine()
                        if engine is None:  # the engine is gone, and its waiters with it
                            with self._lock:
                                self._thread = None
                            return
                        pool = engine.pool.recreate()  # its creator and events, not its connections
                        del engine
                        conn = pool.connect()
                        with self._lock:
                            self._open.add(conn)
                        listening = set()
                        driver = conn.driver_connection
                        if not driver.autocommit:
                            driver.rollback()
                            driver.autocommit = True
                        driver.execute(_NAMED)  # what an enqueue looks for before it notifies
                    for channel in sorted(wanted - listening):
                        driver.execute(f"LISTEN {_quoted(channel)}")
                        listening.add(channel)
                    for note in driver.notifies(timeout=_TICK):
                        self._heard(note.channel, note.payload)
                except Exception:
                    logger.debug("a lock listener's connection failed; waiting by backoff", exc_info=True)
                    self._drop(conn, pool, broken=True)
                    conn = pool = None
                    time.sleep(_RETRY)
        finally:
            self._drop(conn, pool, broken=False)

    def _drop(self, conn: Any, pool: Any, *, broken: bool) -> None:
        if conn is not None:
            with self._lock:
                self._open.discard(conn)
        _let_go(conn, pool, broken)


def _let_go(conn: Any, pool: Any, broken: bool) -> None:
    """Close a listening connection (invalidate it if ``broken``) and its own pool."""
    if conn is not None:
        with contextlib.suppress(Exception):
            if broken:
                conn.invalidate()
            else:
                conn.close()
    if pool is not None:
        with contextlib.suppress(Exception):
            pool.dispose()


class _LoopHub:
    """The async driver's listening connection of one engine on one event loop, shared by
    its waiting tasks: opened (inside asyncio's bridge) by the first to subscribe, closed
    :data:`LINGER` seconds after the last one left (by a task of the hub; at once if the
    loop ends meanwhile, as ``asyncio.run`` cancels what is left). A worker that is busy
    between two waits so keeps its connection: no connection opened and closed per job,
    and no close on the way of the claim that returns. asyncpg hands notifications to a
    callback on the loop; psycopg's async connection is read by a task of the hub."""

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self._waiters = _Waiters()
        self._guard = asyncio.Lock()  # one task opens, listens or closes at a time
        self._pool: Any = None
        self._conn: Any = None
        self._listening: set[str] = set()
        self._reader: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None
        self._broken = False

    def subscribe(self, channel: str, name: str) -> Listener:
        from .._runtime.private_sqlalchemy import await_only

        listener = _TaskListener(self, channel, name)
        self._waiters.add(listener)
        await_only(self._guard.acquire())
        try:
            if self._broken:
                self._close()
            if self._conn is None:
                self._open()
            if channel not in self._listening:
                self._listen(channel)
        except Exception:
            logger.debug("could not listen for a lock's release; waiting by backoff", exc_info=True)
            self._close()
        finally:
            self._guard.release()
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        from .._runtime.private_sqlalchemy import await_only

        self._waiters.remove(listener)
        if self._waiters.channels() or self._conn is None:
            return
        if self._closer is not None and not self._closer.done():
            return  # a closer looks at its time whether anyone listens then
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs (a listener collected late): close now
            loop = None
        if loop is not None:
            self._closer = loop.create_task(self._close_when_idle(), name="fencing-listener-linger")
            return
        await_only(self._guard.acquire())
        try:
            if not self._waiters.channels():
                self._close()
        finally:
            self._guard.release()

    async def _close_when_idle(self) -> None:
        """Close the connection :data:`LINGER` seconds on if no one listens then; at once if
        cancelled (the loop ends)."""
        from .._runtime.private_sqlalchemy import greenlet_spawn

        try:
            await asyncio.sleep(LINGER)
        finally:
            async with self._guard:
                if not self._waiters.channels() and self._conn is not None:
                    await greenlet_spawn(self._close)

    def _open(self) -> None:
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine is gone")
        self._pool = engine.pool.recreate()  # its creator and events, not its connections
        self._conn = self._pool.connect()  # inside the bridge: the async driver is awaited
        self._listening = set()
        self._broken = False
        from .._runtime.private_sqlalchemy import await_only

        driver = self._conn.driver_connection
        if hasattr(driver, "add_termination_listener"):  # asyncpg
            driver.add_termination_listener(self._ended)
        elif not driver.autocommit:
            await_only(driver.rollback())
            await_only(driver.set_autocommit(True))
        await_only(driver.execute(_NAMED))  # what an enqueue looks for before it notifies

    def _listen(self, channel: str) -> None:
        from .._runtime.private_sqlalchemy import await_only

        driver = self._conn.driver_connection
        if hasattr(driver, "add_listener"):  # asyncpg: its callback runs on the loop
            await_only(driver.add_listener(channel, self._callback))
        else:  # psycopg: waits for the reader's turn on the connection (at most a tick)
            await_only(driver.execute(f"LISTEN {_quoted(channel)}"))
            if self._reader is None:
                self._reader = asyncio.get_running_loop().create_task(
                    self._read(driver), name="fencing-lock-listener"
                )
        self._listening.add(channel)

    def _callback(self, connection: Any, pid: int, channel: str, payload: str) -> None:
        for listener in self._waiters.of(channel, payload):
            listener._freed()

    def _ended(self, connection: Any) -> None:
        self._broken = True  # the next waiter to subscribe opens another

    async def _read(self, driver: Any) -> None:
        try:
            while True:
                async for note in driver.notifies(timeout=_TICK):
                    self._callback(driver, 0, note.channel, note.payload)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.debug("a lock listener's connection failed; waiting by backoff", exc_info=True)
            self._broken = True

    def _close(self) -> None:
        from .._runtime.private_sqlalchemy import await_only

        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await_only(asyncio.wait({reader}))
        conn, self._conn = self._conn, None
        pool, self._pool = self._pool, None
        _let_go(conn, pool, self._broken)
        self._listening = set()
        self._broken = False


class _FileWatch(_Daemon):
    """SQLite: a daemon thread that reads ``PRAGMA data_version`` on a connection of its own
    every :data:`WATCH_EVERY` seconds while someone of this process waits on the database
    file, and wakes them all when it changes (another connection, of this process or another,
    committed a change). The waiters look for themselves what changed (a claim reads before
    it takes the write lock, :mod:`.batches`). The thread and its connection end
    :data:`LINGER` seconds after the last waiter left; a failing read is retried after
    :data:`_RETRY`, the waiters pacing themselves by backoff meanwhile."""

    _name = "fencing-sqlite-watch"

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def _listener(self, channel: str, name: str) -> Listener:
        return listener_here(self, channel, name)

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        seen: object = None
        idle_since: float | None = None
        try:
            while (found := self._wanted(idle_since)) is not None:
                idle_since = found[1]
                try:
                    if conn is None:
                        uri = f"file:{urllib.parse.quote(self._path)}?mode=rw"
                        conn = sqlite3.connect(uri, uri=True, timeout=_RETRY, check_same_thread=False)
                        seen = conn.execute("PRAGMA data_version").fetchone()[0]
                    version = conn.execute("PRAGMA data_version").fetchone()[0]
                    if version != seen:
                        seen = version
                        with self._lock:
                            waiting = self._waiters.all()
                        for listener in waiting:
                            listener._freed()
                except Exception:
                    logger.debug("could not watch a SQLite file; waiting by backoff", exc_info=True)
                    if conn is not None:
                        conn.close()
                    conn = None
                    time.sleep(_RETRY)
                time.sleep(WATCH_EVERY)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()


_registry = threading.Lock()
_THREAD_HUBS: weakref.WeakKeyDictionary[Engine, _ThreadHub] = weakref.WeakKeyDictionary()
_LOOP_HUBS: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Engine, _LoopHub]] = (
    weakref.WeakKeyDictionary()
)
#: a forked child's copies of its parent's hubs: kept, never closed (their sockets are the
#: parent's sessions) and never used
_INHERITED: list[object] = []


#: SQLite files' watches, by path
_WATCHES: dict[str, _FileWatch] = {}


def _file_watch(path: str) -> _FileWatch:
    with _registry:
        return _WATCHES.get(path) or _WATCHES.setdefault(path, _FileWatch(path))


def _thread_hub(engine: Engine) -> _ThreadHub:
    with _registry:
        return _THREAD_HUBS.get(engine) or _THREAD_HUBS.setdefault(engine, _ThreadHub(engine))


def _loop_hub(engine: Engine) -> _LoopHub:
    loop = asyncio.get_running_loop()
    with _registry:
        hubs = _LOOP_HUBS.setdefault(loop, weakref.WeakKeyDictionary())
        hub = hubs.get(engine)
        if hub is None:
            hub = hubs[engine] = _LoopHub(engine)
        return hub


def _after_fork_in_child() -> None:
    """A forked child starts with no listener: the parent's threads do not exist here and
    their connections are the parent's sessions (kept referenced, never closed)."""
    global _registry
    _registry = threading.Lock()
    _INHERITED.extend(_THREAD_HUBS.values())
    _INHERITED.extend(hub for hubs in _LOOP_HUBS.values() for hub in hubs.values())
    _THREAD_HUBS.clear()
    _LOOP_HUBS.clear()
    _INHERITED.extend(_WATCHES.values())
    _WATCHES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
