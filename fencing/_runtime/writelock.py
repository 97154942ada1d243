"""Waiting for SQLite's write lock, with a bound on how long any one waiter waits.

SQLite lets one connection write at a time, and its busy handler decides who is next: it
sleeps 1, 2, 5, 10 ... 100 ms between tries, and nobody wakes it. A process that has just
committed begins again within microseconds, so a waiter wins only if it happens to wake in
that gap; measured with four worker processes, one waited 5-8 s (past the default
``busy_timeout``) and another got no job in a whole run. Its few wakeups are also what
keeps it fast: on a two-core machine, waiters that wake every few hundred µs to try again
take the CPU from the process that holds the lock (measured: half the throughput).

So write transactions keep SQLite's handler for short waits and bound the long ones. Every
``BEGIN IMMEDIATE`` on a configured engine (the store's own transactions, ``fenced()``, and
the application's transactions that ask for IMMEDIATE) goes through the engine's
:class:`WriteLock`, which lowers the connection's ``busy_timeout`` to :data:`STARVING` (or
the engine's, if shorter) for the ``BEGIN`` only:

* A waiter that is still waiting after :data:`STARVING` takes **priority**: an exclusive
  ``flock`` on a sidecar file, ``<database>-fencing-priority``; it then tries with its
  handler off, sleeping :data:`POLL_WITH_PRIORITY` after the first try and twice as long
  after each next one up to :data:`POLL_WITH_PRIORITY_MAX` (so a wait of seconds costs it
  ~1.5% of a CPU, where a fixed 50 µs poll took a fifth), and drops priority once it has
  the lock.
* Before every ``BEGIN`` the other stores, in every process, look for it (a non-blocking
  shared ``flock``, under a µs) and hold back while it is taken, for at most
  :data:`COURTESY` in all per call, so a priority holder that stalls cannot stop them. The
  lock therefore goes to the waiter that has waited longest within
  :data:`POLL_WITH_PRIORITY_MAX` of its release (well inside the others' ``COURTESY``);
  between such turns, whoever asks first gets it (usually the process that has just
  committed, whose page cache is still warm).
* All of this within the engine's ``busy_timeout``, the budget; once it is spent the caller
  gets :class:`~fencing._errors.DatabaseBusy`, and nothing was changed.

The kernel releases a ``flock`` when its holder exits or dies. The sidecar is made the first
time a waiter starves and stays, like SQLite's ``-shm`` (it is empty). Where it cannot be
made (a read-only directory, a URI or in-memory database, no ``fcntl`` on this platform)
waiters just keep waiting in SQLite's handler, :data:`STARVING` at a time. Writers that are
not fencing stores ignore it.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import ConfigurationError, DatabaseBusy
from .._sql.dberrors import is_transient
from . import bridge, forks

try:
    import fcntl
except ImportError:  # not a POSIX system: no priority
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "COURTESY",
    "POLL_WITH_PRIORITY",
    "POLL_WITH_PRIORITY_MAX",
    "STARVING",
    "Wait",
    "WriteLock",
    "busy_error",
    "poll_pause",
    "sidecar_path",
]

#: how long a waiter waits in SQLite's busy handler before it takes priority: the longer,
#: the fewer handoffs between processes (each costs the new writer a cold page cache:
#: measured 4p/1p jobs/s on tmpfs 0.85 at 20 ms, 0.89 at 50 ms, 0.92 at 100 ms)
STARVING = 0.1
#: how long one call holds back for others' priority, at most, in all; and in steps of
COURTESY = 0.05
_HOLD_BACK_STEP = 0.001
#: how long the priority holder sleeps after its first try; doubled after each next one, up to
POLL_WITH_PRIORITY = 50e-6
#: the longest it sleeps between tries. A wakeup costs ~0.2 ms of CPU (measured on a 2-core
#: VM; a fixed 50 µs poll took 0.6 s of CPU in a 3 s wait, a fifth of a core the lock holder
#: needs); at this cap about 1.5%, as many wakeups as SQLite's handler makes in its first
#: STARVING. A release is seen within it, long before the others stop holding back (COURTESY).
POLL_WITH_PRIORITY_MAX = COURTESY / 4
#: while the sidecar does not exist, look for it at most this often
_LOOK_EVERY = 0.01
#: a failed BEGIN that took less than this did not wait in SQLite's handler
_HANDLER_WAITED = 0.0005

# priority descriptors open in this process: a forked child closes its copies (a flock holds
# while any copy is open, so the parent's priority would otherwise last as long as the child)
_PRIORITY_FDS: set[int] = set()
#: what a failed statement can raise (SQLAlchemy's errors and the driver's own)
_Errors = tuple[type[BaseException], ...]
#: a first try that got the lock
_BEGUN = object()


def _after_fork_in_child() -> None:
    for fd in _PRIORITY_FDS:
        _close(fd)
    _PRIORITY_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def poll_pause(attempt: int, left: float) -> float:
    """Sleep before trying again after a lost race that SQLite's handler did not wait for
    (a ``DEFERRED`` transaction's stale snapshot, a busy timeout under 1 ms): 0.5-1 ms,
    longer each attempt up to 10 ms, jittered, never past the time ``left`` of the budget;
    the time slept."""
    pause = max(0.0, min(left, random.uniform(0.5, 1.0) * min(0.01, 0.001 * attempt)))
    bridge.sleep(pause, time.sleep)
    return pause


def busy_error(budget: float, exc: BaseException | None) -> DatabaseBusy:
    """The error for a call that waited its whole budget for the lock (raise it ``from exc``)."""
    return DatabaseBusy(
        f"the database stayed locked by other writers for {budget:g} s (busy_timeout); "
        f"nothing was changed ({exc or 'database is locked'})"
    )


def _changes(driver_connection: Any) -> int | None:
    """The rows a SQLite driver connection (the sqlite3 module's, or aiosqlite's) has changed
    since it opened (``None`` if unknown)."""
    changes = getattr(driver_connection, "total_changes", None)
    return changes if isinstance(changes, int) else None


def _open(driver_connection: Any) -> bool:
    """Whether a SQLite driver connection is in a transaction (not if it was closed)."""
    try:
        return bool(driver_connection.in_transaction)
    except Exception:
        return False


#: how many callers' transactions a write lock remembers before it forgets ended ones
_CALLERS_KEPT = 64


def sidecar_path(database: str | None) -> str | None:
    """The priority file of a database file, or ``None`` (in memory, a URI, no ``fcntl``)."""
    if fcntl is None or not database or database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.abspath(database) + "-fencing-priority"


def _priority_taken(fd: int) -> bool:
    """Whether a waiter (of any process) holds priority: one or two syscalls."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class Wait:
    """One call's wait for the lock, from its first ``BEGIN`` that did not get it at once."""

    __slots__ = ("attempts", "budget", "changed", "held_back", "poll", "priority", "started")

    def __init__(self, budget: float, started: float) -> None:
        self.budget = budget
        self.started = started
        self.attempts = 0
        self.changed = False  # the connection's busy_timeout is not the engine's
        self.held_back = 0.0  # time spent letting a priority holder go first
        self.priority: int | None = None  # our own descriptor of the sidecar, flocked exclusively
        self.poll = POLL_WITH_PRIORITY  # the priority holder's next sleep between tries

    def left(self) -> float:
        return self.started + self.budget - time.monotonic()

    def busy(self, exc: BaseException | None) -> DatabaseBusy:
        return busy_error(self.budget, exc)


class WriteLock:
    """Begins write transactions on one SQLite database for the connections of one store.

    ``budget``: the engine's ``busy_timeout`` (seconds); ``path``: the priority file
    (:func:`sidecar_path`), or ``None``: no priority.
    """

    __slots__ = (
        "_callers",
        "_fd",
        "_filed",
        "_filing",
        "_full_sql",
        "_generation",
        "_lock",
        "_next_look",
        "_short_sql",
        "budget",
        "handler_sql",
        "path",
    )

    def __init__(self, budget: float, path: str | None) -> None:
        self.budget = budget
        self.path = path
        full_ms = int(budget * 1000)
        short_ms = int(min(budget, STARVING) * 1000)
        self._full_sql = f"PRAGMA busy_timeout = {full_ms}"
        # None: the engine's budget is already no longer than STARVING
        self._short_sql = None if short_ms == full_ms else f"PRAGMA busy_timeout = {short_ms}"
        #: the busy_timeout a BEGIN waits in: STARVING, or the whole budget if that is shorter
        self.handler_sql = self._short_sql or self._full_sql
        self._fd: int | None = None  # the sidecar, opened to look for a priority holder
        self._next_look = 0.0
        self._generation = forks.GENERATION[0]
        self._lock = threading.Lock()  # opening the sidecar
        #: the application's own transactions on this engine's connections, by who runs them
        #: (a thread, or an asyncio task: :func:`fencing._runtime.bridge.holder`): each driver
        #: connection with the count of its changes when its transaction began
        self._callers: dict[Any, list[tuple[Any, int]]] = {}
        #: who each of those driver connections is filed under (a connection's transaction is
        #: one caller's at a time: the next one to begin on it takes it out of the last one's)
        self._filed: dict[Any, Any] = {}
        self._filing = threading.Lock()  # both, changed by the threads that begin transactions

    def note_callers_transaction(self, driver_connection: Any) -> None:
        """An application's transaction began on ``driver_connection`` (the engine's ``begin``
        listener): if it writes, it holds the write lock until it ends, and a store write of
        the same caller would wait for it (:meth:`caller_holds_the_lock`)."""
        changes = _changes(driver_connection)
        if changes is None:
            return
        key = bridge.holder()
        with self._filing:
            self._unfile(driver_connection)
            if len(self._callers) > _CALLERS_KEPT:  # callers gone (threads, tasks): their transactions ended
                for other in [k for k, held in self._callers.items() if not any(_open(c) for c, _ in held)]:
                    self._forget(other, lambda c: False)
            self._forget(key, _open)
            self._callers.setdefault(key, []).append((driver_connection, changes))
            self._filed[driver_connection] = key

    def _unfile(self, driver_connection: Any) -> None:
        """A transaction begins on ``driver_connection``: whoever it was filed under before
        (its last transaction, ended: a pooled connection goes from caller to caller) no longer
        holds anything on it. The store's own ``BEGIN`` does it too (:meth:`begin`)."""
        last = self._filed.pop(driver_connection, None)
        if last is not None:
            self._forget(last, lambda c: c is not driver_connection)

    def _forget(self, key: Any, keep: Callable[[Any], bool]) -> None:
        """Keep only the connections filed under ``key`` that ``keep`` says to."""
        held = self._callers.get(key, [])
        for c, _ in held:
            if not keep(c):
                self._filed.pop(c, None)
        held[:] = [(c, n) for c, n in held if keep(c)]
        if not held:
            self._callers.pop(key, None)

    def caller_holds_the_lock(self) -> bool:
        """Whether a transaction of this caller's own, on another connection of the engine,
        has written and not ended: it holds the write lock, which it cannot release while
        the caller waits for it."""
        key = bridge.holder()
        if key not in self._callers:
            return False
        with self._filing:
            self._forget(key, _open)
            return any((_changes(c) or 0) > n for c, n in self._callers.get(key, ()))

    def begin(
        self,
        execute: Callable[[str], object],
        begin_sql: str,
        errors: _Errors,
        *,
        lowered: bool = False,
        connection: Any = None,
    ) -> None:
        """Send ``begin_sql`` (through ``execute``) once the write lock can be had; raise
        ``DatabaseBusy`` when the budget is spent first (no transaction is open then).

        ``connection``: the driver connection of the store's own transaction, taken out of
        the application's callers it may be filed under (:meth:`_unfile`).

        ``lowered``: the connection's busy_timeout is :attr:`handler_sql`'s already (the
        store's fast path keeps it so). Otherwise it is the engine's, the application's
        connections' too: it is lowered for this call only and restored before it returns.
        """
        if self._filed and connection is not None:
            with self._filing:
                self._unfile(connection)
        started = time.monotonic()
        if lowered:  # the store's usual case: one look, one BEGIN
            outcome = self._first_try(execute, begin_sql, errors)
            if outcome is not _BEGUN:
                self._begin_waiting(execute, begin_sql, errors, Wait(self.budget, started), outcome, lowered)
            return
        self._begin_waiting(execute, begin_sql, errors, Wait(self.budget, started), None, lowered)

    def _first_try(
        self, execute: Callable[[str], object], begin_sql: str, errors: _Errors
    ) -> BaseException | object | None:
        """One ``BEGIN`` unless another waiter has priority: :data:`_BEGUN`, the lost race's
        error, or ``None`` (held back, not tried)."""
        if self._priority_taken():
            return None
        try:
            execute(begin_sql)  # waits in SQLite's handler, STARVING at most
        except errors as exc:
            if not is_transient(exc):
                raise
            return exc
        return _BEGUN

    def _begin_waiting(
        self,
        execute: Callable[[str], object],
        begin_sql: str,
        errors: _Errors,
        wait: Wait,
        lost: BaseException | object | None,
        lowered: bool,
    ) -> None:
        """Wait for the lock (:meth:`_wait`), with the connection's busy handler lowered for
        the wait unless it is already (``lowered``), and restored afterwards."""
        restore = self.handler_sql if lowered else self._full_sql
        if lowered and lost is not _BEGUN and self.caller_holds_the_lock():
            raise ConfigurationError(
                "this thread (or task) holds SQLite's write lock itself, in a transaction of its own "
                "on another connection of this engine (an ORM Session or a Connection that has "
                "written and not yet committed): the store's write would wait for it until "
                "busy_timeout. Run the operation in that transaction with conn= (your Session or "
                "Connection), or commit it first; nothing was changed"
            )
        if not lowered and self._short_sql is not None:
            execute(self._short_sql)
            wait.changed = True
        try:
            if not lowered:
                lost = self._first_try(execute, begin_sql, errors)
            if lost is not _BEGUN:
                error = lost if isinstance(lost, BaseException) else None
                self._wait(execute, begin_sql, errors, wait, error)
        except BaseException:
            if wait.changed:
                with contextlib.suppress(Exception):  # a broken connection is dropped by the caller
                    execute(restore)
            raise
        if wait.changed:
            execute(restore)

    def _wait(
        self,
        execute: Callable[[str], object],
        begin_sql: str,
        errors: _Errors,
        wait: Wait,
        lost: BaseException | None,
    ) -> None:
        try:
            while True:
                left = wait.left()
                if left <= 0:
                    raise wait.busy(lost) from lost
                if wait.priority is None and time.monotonic() - wait.started >= STARVING:
                    self._take_priority(wait, execute)
                if wait.priority is not None:
                    # backs off: a lock held for seconds must not cost the waiter a busy CPU
                    bridge.sleep(min(left, wait.poll), time.sleep)
                    wait.poll = min(2 * wait.poll, POLL_WITH_PRIORITY_MAX)
                elif wait.held_back < COURTESY and self._priority_taken():
                    pause = min(left, _HOLD_BACK_STEP)
                    bridge.sleep(pause, time.sleep)
                    wait.held_back += pause
                    continue  # someone has waited longer: let them have it
                tried = time.monotonic()
                try:
                    execute(begin_sql)
                    return
                except errors as exc:
                    if not is_transient(exc):
                        raise
                    lost = exc
                if wait.priority is None and time.monotonic() - tried < _HANDLER_WAITED:
                    wait.attempts += 1  # the handler did not wait: do not spin
                    poll_pause(wait.attempts, wait.left())
        finally:
            if wait.priority is not None:
                self._drop_priority(wait)

    # -- the priority file -------------------------------------------------------------------

    def _priority_taken(self) -> bool:
        fd = self._look()
        if fd is None:
            return False
        # under the lock: close() from another thread (a cache eviction) must not close the
        # descriptor, or let its number be reused by another file, between our flock calls
        with self._lock:
            return self._fd == fd and _priority_taken(fd)

    def _look(self) -> int | None:
        """The sidecar, opened once it exists (looked for at most every ``_LOOK_EVERY``)."""
        if self._generation != forks.GENERATION[0]:
            self._forget_parent()
        if self._fd is not None or self.path is None:
            return self._fd
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + _LOOK_EVERY
        with self._lock:
            if self._fd is None:
                with contextlib.suppress(OSError):  # not made yet: nobody has starved
                    self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        return self._fd

    def _take_priority(self, wait: Wait, execute: Callable[[str], object]) -> None:
        # a descriptor of our own: another thread's shared flock on self._fd (a look) would
        # otherwise convert our exclusive one
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:  # e.g. a read-only directory: no priority for this store
            self.path = None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another waiter has it; back to SQLite's handler, then again
            _close(fd)
            return
        _PRIORITY_FDS.add(fd)
        wait.priority = fd
        execute("PRAGMA busy_timeout = 0")  # our own short tries instead; begin() restores it
        wait.changed = True

    def _drop_priority(self, wait: Wait) -> None:
        fd, wait.priority = wait.priority, None
        if fd is not None and fd in _PRIORITY_FDS:  # else a fork closed it already
            _PRIORITY_FDS.discard(fd)
            _close(fd)  # releases the flock

    def _forget_parent(self) -> None:
        fd, self._fd = self._fd, None
        self._generation = forks.GENERATION[0]
        if fd is not None:
            _close(fd)  # our copy: the parent's stays open

    def close(self) -> None:
        """Close the sidecar; a later call opens it again."""
        if self._generation != forks.GENERATION[0]:
            self._forget_parent()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            _close(fd)
