"""Waking a lock's waiters the moment it is freed (PostgreSQL's ``LISTEN``/``NOTIFY``).

A waiter paces its looks at a held lock with backoff (:mod:`.waiting`): cheap, but a lock
released just after a look sits free until the next one, up to ``poll`` seconds. On
PostgreSQL the waiter also listens: whoever frees a lock that has waiters (a release, a
revoke, a delete: :class:`Notifier`) sends ``NOTIFY`` on the locks table's channel with the
lock's name, in the freeing transaction (so a release in the caller's own transaction
notifies at its commit, and one rolled back never does); a waiter that hears its lock's name
looks at once. The backoff stays the bound: an expired holder frees the lock without anyone
notifying, a notification can be missed (a connection lost), and the other databases have no
notifications; none of that costs more than the ``poll`` it costs without them.

What it costs: nothing more for the freeing operation (its ``UPDATE`` returns the
notification, :class:`Notifier`: the same one statement and round trip), and a waiter keeps
one connection of the engine's pool for the time it waits, listening. Drivers:
psycopg (3.2 or later: ``notifies(timeout=)``) in its sync and async modes, and asyncpg;
another driver (psycopg2, pg8000) waits by backoff alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import Any

from sqlalchemy import ColumnElement, Engine, Table, func, literal, select

__all__ = ["Listener", "Notifier", "channel_of", "listen"]

logger = logging.getLogger("fencing.locks")

#: PostgreSQL's longest identifier (NAMEDATALEN - 1 bytes): a channel name's limit
_CHANNEL_MAX = 63


def channel_of(locks: Table) -> str:
    """The notification channel of a locks table: ``fencing:<schema.table>``, or the name's
    digest where that is longer than PostgreSQL allows a channel name."""
    channel = f"fencing:{locks.fullname}"
    if len(channel.encode()) <= _CHANNEL_MAX:
        return channel
    return "fencing:" + hashlib.sha256(locks.fullname.encode()).hexdigest()[:40]


class Notifier:
    """What a statement that frees a lock RETURNs on PostgreSQL to wake its waiters
    (:attr:`notice`): ``pg_notify`` on the table's channel with the lock's name, from the
    lock's rows in the waiters' queue (no row, no notification), evaluated only for a row
    the statement changed, and delivered when its transaction commits."""

    def __init__(self, locks: Table, waiters: Table) -> None:
        self.channel = channel_of(locks)
        w = waiters
        self.notice: ColumnElement[Any] = (
            select(func.pg_notify(literal(self.channel), w.c.name))
            .where(w.c.name == locks.c.id)
            .limit(1)
            .correlate(locks)
            .scalar_subquery()
            .label("woken")
        )


def listen(engine: Engine, channel: str, name: str) -> Listener | None:
    """A connection of ``engine``'s pool listening on ``channel`` for ``name``, or ``None``
    where notifications cannot be had (not PostgreSQL, a driver without them): the waiter
    then paces itself by backoff alone. Inside asyncio's bridge the async drivers' calls
    are awaited through SQLAlchemy's greenlet (``await_only``)."""
    if engine.dialect.name != "postgresql":
        return None
    raw = engine.raw_connection()
    try:
        driver: Any = raw.driver_connection
        if hasattr(driver, "add_listener"):  # asyncpg
            listener: Listener = _Asyncpg(raw, driver, channel, name)
        elif hasattr(driver, "notifies") and asyncio.iscoroutinefunction(driver.execute):
            listener = _PsycopgAsync(raw, driver, channel, name)
        elif hasattr(driver, "notifies") and _notifies_take_a_timeout(driver):
            listener = _Psycopg(raw, driver, channel, name)
        else:
            raw.close()
            return None
        listener.start()
    except Exception:
        logger.debug("could not listen for a lock's release; waiting by backoff", exc_info=True)
        with contextlib.suppress(Exception):
            raw.invalidate()
        return None
    return listener


def _notifies_take_a_timeout(driver: Any) -> bool:
    import inspect

    try:
        return "timeout" in inspect.signature(driver.notifies).parameters
    except (TypeError, ValueError):
        return False


def _quoted(channel: str) -> str:
    return '"' + channel.replace('"', '""') + '"'


class Listener:
    """One waiter's listening connection: :meth:`wait` (a thread) or :meth:`wait_async` (a
    task) until its lock is freed or the time is up; :meth:`close` gives the connection back
    to the pool as it found it (not listening, its autocommit as it was)."""

    def __init__(self, raw: Any, driver: Any, channel: str, name: str) -> None:
        self._raw = raw
        self._driver = driver
        self.channel = channel
        self.name = name
        self._broken = False

    def start(self) -> None:
        raise NotImplementedError

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` on this thread: whether the lock was said to be freed."""
        raise NotImplementedError(f"{type(self).__name__} waits in a task (wait_async)")

    async def wait_async(self, seconds: float) -> bool:
        """Wait up to ``seconds`` in this task: whether the lock was said to be freed."""
        raise NotImplementedError(f"{type(self).__name__} waits on a thread (wait)")

    def _stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop listening and give the connection back (thrown away if that failed)."""
        try:
            if not self._broken:
                self._stop()
        except Exception:
            self._broken = True
        if self._broken:
            with contextlib.suppress(Exception):
                self._raw.invalidate()
        with contextlib.suppress(Exception):
            self._raw.close()

    def _heard(self, payload: str) -> bool:
        return payload == self.name


class _Psycopg(Listener):
    """psycopg's sync connection: ``LISTEN`` in autocommit, ``notifies(timeout=)``."""

    def start(self) -> None:
        self._autocommit = self._driver.autocommit
        if not self._autocommit:
            self._driver.rollback()  # nothing of ours is open; a checked-out connection is idle
            self._driver.autocommit = True
        self._driver.execute(f"LISTEN {_quoted(self.channel)}")

    def wait(self, seconds: float) -> bool:
        try:
            for note in self._driver.notifies(timeout=max(seconds, 0.0)):
                if self._heard(note.payload):
                    return True
        except Exception:
            self._broken = True
            raise
        return False

    def _stop(self) -> None:
        self._driver.execute(f"UNLISTEN {_quoted(self.channel)}")
        self._driver.autocommit = self._autocommit


class _PsycopgAsync(Listener):
    """psycopg's AsyncConnection under SQLAlchemy's adapter: set up and torn down inside
    the bridge (``await_only``), waited on in the task."""

    def start(self) -> None:
        from sqlalchemy.util import await_only

        self._autocommit = self._driver.autocommit
        if not self._autocommit:
            await_only(self._driver.rollback())
            await_only(self._driver.set_autocommit(True))
        await_only(self._driver.execute(f"LISTEN {_quoted(self.channel)}"))

    async def wait_async(self, seconds: float) -> bool:
        try:
            async for note in self._driver.notifies(timeout=max(seconds, 0.0)):
                if self._heard(note.payload):
                    return True
        except Exception:
            self._broken = True
            raise
        return False

    def _stop(self) -> None:
        from sqlalchemy.util import await_only

        await_only(self._driver.execute(f"UNLISTEN {_quoted(self.channel)}"))
        await_only(self._driver.set_autocommit(self._autocommit))


class _Asyncpg(Listener):
    """asyncpg: ``add_listener`` (its callback runs on the loop) and an ``asyncio.Event``."""

    def start(self) -> None:
        from sqlalchemy.util import await_only

        self._freed = asyncio.Event()
        await_only(self._driver.add_listener(self.channel, self._callback))

    def _callback(self, connection: Any, pid: int, channel: str, payload: str) -> None:
        if self._heard(payload):
            self._freed.set()

    async def wait_async(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._freed.wait(), max(seconds, 0.0))
        except (asyncio.TimeoutError, TimeoutError):
            return False
        self._freed.clear()
        return True

    def _stop(self) -> None:
        from sqlalchemy.util import await_only

        await_only(self._driver.remove_listener(self.channel, self._callback))
