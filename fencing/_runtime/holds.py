"""Fenced blocks and heartbeats of one process, kept from waiting for each other.

A fenced block locks its job's row until its transaction ends (SQLite: the database's write
lock, so every row). A renewal of the same lease sent on another connection of this process
would wait for that lock, while the block's thread may be waiting for the renewal
(``Heartbeat.stop()`` joins the heartbeat's thread): the process would hang on itself, or
on SQLite spend its busy timeout and retry. So every open block, and every caller's
transaction in which ``fenced(conn=)`` or ``check(conn=)`` locked a row, is a :class:`Hold`
here, and:

* a heartbeat never sends a renewal for a row its own process holds (:func:`renewing` says
  which hold to wait for instead);
* a block waits for renewals already on their way before it takes the row (:func:`hold`);
* the holding thread is refused, at once, an operation that would wait for its own lock
  (:func:`held_here`);
* a block can see the heartbeats keeping its lease (:func:`beats`) and extend the lease by
  their ``ttl`` in its own transaction.

Keys are ``(database, table)``: the database as it says who it is (:mod:`fencing._runtime.identity`:
a SQLite file's device and inode, a server's system identifier and database), not a URL
string, so two stores or engines on the same table meet here however they reach it. A hold on
SQLite's write lock covers the whole database: it is kept under ``(database, "")`` and found by
every table's key there (``FenceMarks`` too).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Table

from . import bridge, identity

__all__ = [
    "ANY_JOB",
    "HELD",
    "Hold",
    "SelfWait",
    "beats",
    "forget",
    "held_here",
    "hold",
    "keep",
    "renewing",
    "store_key",
]

#: the job of a hold on SQLite, whose write lock holds every row of the database
ANY_JOB = "\x00every job"

Key = tuple[str, str]

#: the longest a block waits for a renewal of its lease already on its way (seconds)
IN_FLIGHT_WAIT = 5.0


def store_key(engine: Engine, table: Table | None) -> Key:
    """Where a store's blocks and heartbeats meet: its database and table (``None``: the
    whole database, where SQLite's write lock is held). As this process knows the database
    now (no I/O): call :func:`fencing._runtime.identity.resolve` first where I/O is allowed."""
    return identity.of(engine), "" if table is None else table.fullname


def _whole(key: Key) -> Key:
    return key[0], ""


class Hold:
    """A row (or, on SQLite, the database) a transaction of this process has locked.

    A store's own block ends its hold when its transaction ends; a hold in the caller's
    transaction lasts as long as that transaction (read from its ``Connection``).
    """

    __slots__ = ("_ended", "_pending", "_root", "conn", "job_id", "key", "thread", "via")

    def __init__(self, key: Key, job_id: str, conn: Connection | None) -> None:
        self.key = key
        self.job_id = job_id
        self.conn = conn  # None: the store's own block, on a connection of its own
        #: the connection whose transaction holds the rows: the caller's, or the store's own
        #: block's once its transaction has begun (:meth:`runs_on`); a block nested on it
        #: with ``conn=`` joins that transaction and waits for nothing
        self.via = conn
        self.thread = bridge.holder()  # a thread, or inside asyncio's bridge the task
        self._ended = False
        # the caller's transaction; on a Connection that has not begun one yet (SQLAlchemy
        # 2.0's autobegin: ``with engine.connect() as c``), the one the block's first
        # statement begins, adopted by :meth:`began`
        self._root: Any = None if conn is None else conn.get_transaction()
        self._pending = conn is not None and self._root is None

    def runs_on(self, conn: Connection) -> None:
        """The store's own block began its transaction on ``conn``."""
        self.via = conn

    def began(self) -> None:
        """The block's (or check's) first statement ran on the caller's connection: the
        transaction it is in (autobegun, if it was not begun) is the one that holds."""
        if self._pending and self.conn is not None:
            self._root = self.conn.get_transaction()
            self._pending = False

    def live(self) -> bool:
        if self._ended:
            return False
        if self.conn is None:
            return True
        try:  # the caller's transaction: over once committed, rolled back or replaced
            if self._pending:  # its first statement has not run yet: held from now on
                return not self.conn.closed
            root = self._root
            if root is None or self.conn.closed or self.conn.get_transaction() is not root:
                return False
            return bool(getattr(root, "is_active", False))
        except Exception:
            return False

    def end(self) -> None:
        with _changed:
            self._ended = True
            _changed.notify_all()


_changed = threading.Condition()
_holds: dict[tuple[Key, str], list[Hold]] = {}
_sending: dict[tuple[Key, str], int] = {}
_beats: dict[tuple[Key, str], list[Any]] = {}
#: how many holds are registered: 0 is the usual case, and costs one read to know
HELD = [0]


def _prune_locked() -> None:
    for where, holds in list(_holds.items()):
        alive = [h for h in holds if h.live()]
        HELD[0] -= len(holds) - len(alive)
        if alive:
            _holds[where] = alive
        else:
            del _holds[where]


def _live_locked(key: Key, job_id: str) -> list[Hold]:
    found = [h for h in _holds.get((key, job_id), ()) if h.live()]
    if job_id != ANY_JOB or key[1]:
        found += [h for h in _holds.get((_whole(key), ANY_JOB), ()) if h.live()]
    return found


def _in_database_locked(key: Key) -> list[Hold]:
    """The live holds on any table (or the whole) of ``key``'s database."""
    return [h for (k, _), holds in _holds.items() if k[0] == key[0] for h in holds if h.live()]


def hold(key: Key, job_id: str, conn: Connection | None, *, whole: bool) -> Hold:
    """Register the hold a block is about to take on ``job_id`` (``whole``: every row) on
    ``conn`` (the caller's) or a connection of its own (``None``), once no renewal of this
    process is on its way to the rows it covers.

    Raises :class:`SelfWait` if this thread already holds them on another connection: the
    block would wait for itself. On the very connection that holds them (``conn=`` the
    outer block's), the block joins that transaction: nothing to wait for."""
    job = ANY_JOB if whole else job_id
    where = _whole(key) if whole else key
    with _changed:
        _prune_locked()
        mine = bridge.holder()
        # the write lock (``whole``): whatever this thread holds anywhere in the database
        others = _in_database_locked(key) if whole else _live_locked(key, job_id)
        for other in others:
            if other.thread == mine and (conn is None or other.via is not conn):
                raise SelfWait(other)
        new = Hold(where, job, conn)
        _holds.setdefault((where, job), []).append(new)
        HELD[0] += 1
        # a renewal on its way is not behind this hold: it ends by itself (unless a lock
        # outside this registry stops it, hence the bound)
        give_up = time.monotonic() + IN_FLIGHT_WAIT
        while _in_flight_locked(where, job) and (left := give_up - time.monotonic()) > 0:
            _wait_locked(left)
        return new


def _in_flight_locked(key: Key, job: str) -> bool:
    if job != ANY_JOB:
        return _sending.get((key, job), 0) > 0
    return any(n > 0 for (k, _), n in _sending.items() if k[0] == key[0])  # any table of it


class SelfWait(RuntimeError):
    """This thread already holds the rows on another connection."""

    def __init__(self, other: Hold) -> None:
        super().__init__(other.job_id)
        self.other = other


def held_here(key: Key, job_id: str | None) -> Hold | None:
    """A live hold of the current thread that an operation on ``job_id`` on another
    connection would wait for (``None``: a write to any row), or ``None``."""
    if not HELD[0]:
        return None
    mine = bridge.holder()
    with _changed:
        _prune_locked()
        # job_id None: a write anywhere in the database (SQLite)
        candidates = _in_database_locked(key) if job_id is None else _live_locked(key, job_id)
        for other in candidates:  # (live ones only)
            if other.thread == mine:
                return other
    return None


@contextmanager
def renewing(key: Key, job_id: str) -> Iterator[Hold | None]:
    """Around a heartbeat's renewal: yields a hold to wait for (and send nothing), or
    ``None`` with the renewal counted as on its way until the block ends."""
    with _changed:
        live = _live_locked(key, job_id) if HELD[0] else []
        if live:
            blocking: Hold | None = live[0]
        else:
            blocking = None
            _sending[(key, job_id)] = _sending.get((key, job_id), 0) + 1
    if blocking is not None:
        yield blocking
        return
    try:
        yield None
    finally:
        with _changed:
            left = _sending[(key, job_id)] - 1
            if left:
                _sending[(key, job_id)] = left
            else:
                del _sending[(key, job_id)]
            _changed.notify_all()


def keep(key: Key, job_id: str, heartbeat: Any) -> None:
    """A heartbeat keeps a lease on ``job_id`` from now on: blocks on it can find it."""
    with _changed:
        _beats.setdefault((key, job_id), []).append(heartbeat)


def forget(key: Key, job_id: str, heartbeat: Any) -> None:
    """The heartbeat stopped keeping it (idempotent)."""
    with _changed:
        kept = _beats.get((key, job_id), [])
        if heartbeat in kept:
            kept.remove(heartbeat)
        if not kept:
            _beats.pop((key, job_id), None)


def beats(key: Key, job_id: str) -> list[Any]:
    """The heartbeats keeping a lease on ``job_id`` now."""
    if not _beats:
        return []
    with _changed:
        return list(_beats.get((key, job_id), ()))


def wait_for_change(timeout: float) -> None:
    """Sleep until a hold ends or a renewal arrives, at most ``timeout`` seconds."""
    with _changed:
        _wait_locked(timeout)


#: inside asyncio's bridge a change is looked for this often (the loop must keep running:
#: the hold or renewal waited for may be another task's)
_BRIDGE_POLL = 0.002


def _wait_locked(timeout: float) -> None:
    """``_changed.wait(timeout)``; inside asyncio's bridge a short sleep that yields to the
    loop instead (the caller looks again)."""
    if not bridge.in_bridge():
        _changed.wait(timeout)
        return
    _changed.release()
    try:
        bridge.sleep(min(timeout, _BRIDGE_POLL))
    finally:
        _changed.acquire()


def _after_fork_in_child() -> None:
    """A forked child starts with no holds and no heartbeats: the parent's blocks hold
    their locks in the parent (the child's copies of their connections are cut loose, see
    :mod:`fencing._runtime.forks`) and its heartbeat threads do not exist here. The condition is new
    too: another thread may have held its lock at the fork."""
    global _changed
    _changed = threading.Condition()
    _holds.clear()
    _sending.clear()
    _beats.clear()
    HELD[0] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
