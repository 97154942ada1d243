"""How a unit of work reaches the database: the two executors and the retry policy.

A *unit* is a function of an executor that runs one or more statements and returns a
plain value. The store builds units; this module decides where they run:

* :class:`CoreExecutor` runs Core statements on a SQLAlchemy ``Connection``: the caller's
  own, inside the caller's transaction.
* :class:`DriverPath` runs the same statements, compiled once for the engine's dialect,
  on DBAPI connections the store holds (sqlite3, psycopg, pymysql), one transaction per
  unit: ``BEGIN IMMEDIATE`` on SQLite, the driver's implicit transaction elsewhere.
  SQLAlchemy's per-``execute`` cost (50-110 µs) and the pool's reset-on-return (a real
  ``ROLLBACK`` round trip on pymysql) are most of an operation's client time; compiling
  once and executing on the driver removes them. Lock races (SQLite busy, deadlocks,
  lock timeouts) roll a unit back whole and are retried here, bounded.

Waiting for locks. On SQLite the store's ``BEGIN IMMEDIATE`` goes through
:class:`fencing.writelock.WriteLock`: SQLite's busy handler for short waits, then priority
for the waiter that has waited longest, until the engine's ``busy_timeout`` is spent; only
then does the caller get :class:`DatabaseBusy`. PostgreSQL and MariaDB wait for row locks
in the server; their deadlocks and serialization failures roll a unit back and are retried
up to :data:`TRANSIENT_RETRIES` times with :func:`backoff`. A unit whose ``COMMIT`` was
sent is never run again.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, Engine, TypeDecorator
from sqlalchemy.sql import Executable

from . import sqlite as sqlite_glue
from .dberrors import DB_ERRORS, is_transient
from .errors import DatabaseBusy, DatabaseError
from .writelock import WriteLock, busy_error, poll_pause, sidecar_path

__all__ = ["FORK_GENERATION", "CoreExecutor", "DriverPath", "Executor", "LockWait", "in_own_transaction"]

T = TypeVar("T")

# Connections a forked child inherited: never closed (closing could checkpoint or delete
# the parent's WAL, or end the parent's server session), never reused.
_INHERITED: list[Any] = []

#: bumped in every forked child; cheaper to compare per operation than os.getpid()
FORK_GENERATION = [0]


def _after_fork_in_child() -> None:
    FORK_GENERATION[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: retries of a unit a server rolled back for a lock race (deadlock, serialization failure)
TRANSIENT_RETRIES = 20
_BACKOFF_CAP = 0.05


def backoff(attempt: int) -> None:
    """Sleep a little, jittered, longer each attempt (at most 50 ms)."""
    time.sleep(random.uniform(0, min(_BACKOFF_CAP, 0.001 * 2**attempt)))


class LockWait:
    """How long a unit that lost a lock race is tried again.

    ``budget`` (SQLite): seconds from the first lost race, the engine's ``busy_timeout``,
    tried again after every :func:`~fencing.writelock.poll_pause`; this covers what
    :class:`~fencing.writelock.WriteLock` does not: a race lost after ``BEGIN`` (a
    ``DEFERRED`` transaction's stale snapshot) or by a read. ``None`` (servers, which wait
    for row locks themselves): up to :data:`TRANSIENT_RETRIES` more attempts after
    :func:`backoff`.
    """

    __slots__ = ("budget",)

    def __init__(self, budget: float | None) -> None:
        self.budget = budget

    @classmethod
    def for_engine(cls, engine: Engine) -> LockWait:
        settings = sqlite_glue.settings_of(engine) if engine.dialect.name == "sqlite" else None
        return cls(None if settings is None else settings.busy_timeout)

    def again(self, attempt: int, started: float) -> bool:
        """After the ``attempt``-th lost race of a call that began at ``started``
        (``time.monotonic()``): sleep and return True, or False when the budget is spent."""
        if self.budget is None:
            if attempt > TRANSIENT_RETRIES:
                return False
            backoff(attempt)
            return True
        left = started + self.budget - time.monotonic()
        if left <= 0:
            return False
        poll_pause(attempt, left)
        return True

    def busy(self, exc: BaseException) -> DatabaseBusy:
        """The error for a call that spent its budget (raise it ``from exc``)."""
        if self.budget is None:
            return DatabaseBusy(f"lost {TRANSIENT_RETRIES + 1} lock races in a row; nothing was changed")
        return busy_error(self.budget, exc)


def in_own_transaction(
    engine: Engine, errors: tuple[type[BaseException], ...], work: Callable[[Connection], T]
) -> T:
    """``work`` in a transaction of its own on a Connection from ``engine``, retried while
    the database rolls it back whole for a lock race (deadlock, lock timeout, busy).

    On SQLite these are the engine's pooled connections, whose busy handler waits up to
    ``busy_timeout`` itself; the retries only cover what it does not (e.g. a ``DEFERRED``
    transaction's stale snapshot), within the same budget.
    """
    wait = LockWait.for_engine(engine)
    started = time.monotonic()
    attempt = 0
    while True:
        committing = False
        try:
            with engine.connect() as conn:
                with conn.begin():
                    result = work(conn)
                    committing = True  # the block's end sends COMMIT
                return result
        except errors as exc:
            if not is_transient(exc):
                raise
            if committing:
                raise _busy_at_commit() from exc
            attempt += 1
            if not wait.again(attempt, started):
                raise wait.busy(exc) from exc


def _busy_at_commit() -> DatabaseBusy:
    # the database refused the COMMIT for a lock race and rolled the transaction back;
    # running the unit again could repeat effects the caller already acted on, so it is not
    return DatabaseBusy("COMMIT lost a lock race; the transaction was rolled back, nothing was changed")


class Executor(Protocol):
    """What a unit of work may do: run a statement and get rows or a row count."""

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]: ...

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int: ...


class CoreExecutor:
    """Runs statements with ``Connection.execute`` (inside whatever transaction it has)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        return self.conn.execute(stmt, params).all()

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        return self.conn.execute(stmt, params).rowcount


class _Compiled:
    """One statement compiled for the driver: its SQL, argument builder and row converter."""

    __slots__ = ("args", "convert", "sql")

    def __init__(self, stmt: Executable, dialect: Any) -> None:
        compiled: Any = stmt.compile(dialect=dialect)  # type: ignore[attr-defined]
        self.sql: str = compiled.string
        names = compiled.positiontup if compiled.positional else list(compiled.binds)
        binds: list[tuple[str | None, str, Any]] = []
        for name in names:
            bind = compiled.binds[name]
            if bind.expanding or bind.callable is not None:
                raise AssertionError(f"driver path cannot bind {name!r} of {self.sql}")
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:  # bindparam("job_id"): from the call's parameters
                binds.append((bind.key, name, process))
            else:  # a constant SQLAlchemy bound itself, e.g. SQLite's OFFSET after a LIMIT
                value = bind.effective_value
                binds.append((None, name, value if process is None else process(value)))
        self.args = _positional(binds) if compiled.positional else _named(binds)
        # the driver's own values are what SQLAlchemy returns too, except for our own
        # TypeDecorators (MariaDB's UTF-8 byte keys), which must be decoded
        impls = [c.type.dialect_impl(dialect) for c in getattr(stmt, "exported_columns", ())]
        self.convert = _converter(
            [i.result_processor(dialect, None) if isinstance(i, TypeDecorator) else None for i in impls]
        )


def _positional(binds: list[tuple[str | None, str, Any]]) -> Callable[[Mapping[str, Any]], Any]:
    keys = tuple(key for key, _, p in binds if key is not None and p is None)
    if len(keys) == len(binds):  # the common case: every value as it is, from the call
        return lambda params: [params[k] for k in keys]
    items = tuple((key, p) for key, _, p in binds)
    return lambda params: [_value(params, key, p) for key, p in items]


def _named(binds: list[tuple[str | None, str, Any]]) -> Callable[[Mapping[str, Any]], Any]:
    items = tuple(binds)
    return lambda params: {name: _value(params, key, p) for key, name, p in items}


def _value(params: Mapping[str, Any], key: str | None, p: Any) -> Any:
    """A parameter (processed if its type says so), or, without a key, the constant ``p``."""
    if key is None:
        return p
    return params[key] if p is None else p(params[key])


def _converter(processors: list[Any]) -> Callable[[list[Any]], list[Any]] | None:
    if all(p is None for p in processors):
        return None
    procs = tuple(processors)
    return lambda rows: [
        tuple(v if p is None else p(v) for v, p in zip(row, procs, strict=True)) for row in rows
    ]


class _DriverExecutor:
    __slots__ = ("compiled", "cursor")

    def __init__(self, cursor: Any, compiled: Callable[[Executable], _Compiled]) -> None:
        self.cursor = cursor
        self.compiled = compiled

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        c = self.compiled(stmt)
        self.cursor.execute(c.sql, c.args(params))
        rows = self.cursor.fetchall()
        return rows if c.convert is None else c.convert(rows)

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        c = self.compiled(stmt)
        self.cursor.execute(c.sql, c.args(params))
        return self.cursor.rowcount  # type: ignore[no-any-return]


class DriverPath:
    """Units of work on DBAPI connections held by the store, one transaction each.

    Connections come from the engine (so its ``connect`` listeners run: on SQLite they
    set the pragmas and hand transaction control over) and are then detached from its
    pool. Up to ``max_idle`` stay open between operations; a forked child never touches
    its parent's. ``begin_sql`` is sent to open a transaction (SQLite's ``BEGIN
    IMMEDIATE``); ``None`` leaves it to the driver, which opens one at the first statement.
    On SQLite the detached connections wait in SQLite's busy handler only briefly; then
    :class:`~fencing.writelock.WriteLock` takes over, within the engine's ``busy_timeout``.
    The engine's pooled connections (``conn=``, ``fenced``) keep SQLite's handler and the
    whole timeout.
    """

    def __init__(
        self,
        engine: Engine,
        begin_sql: str | None,
        errors: tuple[type[BaseException], ...] = DB_ERRORS,
        *,
        max_idle: int = 8,
    ) -> None:
        self.engine = engine
        self.begin_sql = begin_sql
        self.errors = errors  # what the driver raises: retried, or passed up to be wrapped
        self.max_idle = max_idle
        self._idle: list[Any] = []
        self._generation = FORK_GENERATION[0]
        self._closed = False
        self._compiled: dict[int, tuple[Executable, _Compiled]] = {}
        settings = sqlite_glue.settings_of(engine) if engine.dialect.name == "sqlite" else None
        #: how long a unit that lost a lock race is tried again (SQLite: the busy timeout)
        self.lock_wait = LockWait(None if settings is None else settings.busy_timeout)
        #: SQLite: begins write transactions, waiting for the lock (the longest waiter next)
        self._write_lock = (
            None if settings is None else WriteLock(settings.busy_timeout, sidecar_path(engine.url.database))
        )

    def _compiled_for(self, stmt: Executable) -> _Compiled:
        try:
            return self._compiled[id(stmt)][1]
        except KeyError:
            # keep the statement referenced so its id() is never reused by another
            self._compiled[id(stmt)] = (stmt, _Compiled(stmt, self.engine.dialect))
            return self._compiled[id(stmt)][1]

    def run(self, unit: Callable[[Any], T], *, write: bool = True) -> T:
        """Run ``unit`` in one transaction, retrying lock races and a dead idle connection.

        ``write=False`` is for a unit that runs one read statement: on SQLite it runs
        without an explicit transaction (one statement is its own snapshot) and takes no
        write lock.
        """
        races = 0  # lost lock races so far
        started = 0.0  # when the first was lost: the wait for the lock begins there
        reconnected = False
        write_lock = self._write_lock if write else None
        while True:
            conn = self._checkout()
            reusable = False
            committing = False
            try:
                cursor = conn.cursor()
                try:
                    if write and self.begin_sql is not None:
                        if write_lock is not None:
                            write_lock.begin(cursor, self.begin_sql, self.errors)
                        else:
                            cursor.execute(self.begin_sql)
                    result = unit(_DriverExecutor(cursor, self._compiled_for))
                    committing = True
                    if self.begin_sql is None:
                        conn.commit()
                    elif write:
                        cursor.execute("COMMIT")
                finally:
                    cursor.close()
                reusable = True
                return result
            except DatabaseBusy:  # the write lock was never had: no transaction is open
                reusable = True
                raise
            except self.errors as exc:
                reusable = self._rollback(conn)
                if is_transient(exc):
                    if committing:
                        raise _busy_at_commit() from exc
                    if races == 0:
                        started = time.monotonic()
                    races += 1
                    if not self.lock_wait.again(races, started):
                        raise self.lock_wait.busy(exc) from exc
                    continue
                if self._disconnected(exc, conn):
                    reusable = False
                    if committing:
                        raise DatabaseError(
                            "the connection died during COMMIT: the outcome is unknown; "
                            "read the job's state before acting on it"
                        ) from exc
                    if not reconnected and races == 0:
                        reconnected = True  # an idle connection the server closed: once, afresh
                        continue
                raise
            finally:
                self._checkin(conn, reusable)

    def read_row(self, stmt: Executable, params: Mapping[str, Any]) -> Any:
        """The first row (or ``None``) of one read statement: the hot path of ``state()``.

        On SQLite it runs outside any explicit transaction: one SELECT is its own snapshot
        and takes no write lock. Anything unusual goes to :meth:`run`.
        """
        if self.begin_sql is None:
            rows = self.run(lambda x: x.rows(stmt, params))
            return rows[0] if rows else None
        compiled = self._compiled_for(stmt)
        conn = self._checkout()
        try:
            row = conn.execute(compiled.sql, compiled.args(params)).fetchone()
        except self.errors:
            self._checkin(conn, self._rollback(conn))
            rows = self.run(lambda x: x.rows(stmt, params), write=False)
            return rows[0] if rows else None
        self._checkin(conn, True)
        if row is None or compiled.convert is None:
            return row
        return compiled.convert([row])[0]

    def _rollback(self, conn: Any) -> bool:
        """Roll back whatever the failed unit left open; False if the connection is unusable."""
        try:
            conn.rollback()
            return True
        except Exception:  # a dead connection cannot even roll back: drop it
            return False

    def _disconnected(self, exc: BaseException, conn: Any) -> bool:
        orig = getattr(exc, "orig", None) or exc
        try:
            return bool(self.engine.dialect.is_disconnect(orig, conn, None))  # type: ignore[arg-type]
        except Exception:
            return False

    def _checkout(self) -> Any:
        if self._generation != FORK_GENERATION[0]:
            self._forget_parent()
        try:
            return self._idle.pop()
        except IndexError:
            pass
        proxied = self.engine.raw_connection()
        conn = proxied.driver_connection
        proxied.detach()
        if self._write_lock is not None:
            try:
                self._write_lock.adopt(conn)
            except BaseException:
                _close(conn)
                raise
        return conn

    def _checkin(self, conn: Any, reusable: bool) -> None:
        if self._generation != FORK_GENERATION[0]:
            _INHERITED.append(conn)  # opened by the parent: its operation ended in the child
        elif reusable and not self._closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            _close(conn)

    def _forget_parent(self) -> None:
        _INHERITED.extend(self._idle)
        self._idle = []
        self._generation = FORK_GENERATION[0]

    def close(self) -> None:
        """Close the idle connections; ones in use close when their operation ends."""
        self._closed = True
        if self._write_lock is not None:
            self._write_lock.close()
        if self._generation != FORK_GENERATION[0]:
            self._forget_parent()
        idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)


def _close(conn: Any) -> None:
    with contextlib.suppress(Exception):  # closing a connection the server already dropped
        conn.close()
