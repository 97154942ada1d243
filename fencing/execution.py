"""How a unit of work reaches the database: the two executors and the retry policy.

A *unit* is a function of an executor that runs one or more statements and returns a
plain value. The store builds units; this module decides where they run:

* :class:`CoreExecutor` runs Core statements on a SQLAlchemy ``Connection`` — the
  caller's own (inside the caller's transaction) or one the store opened.
* :class:`SQLiteDriverPath` runs the same statements, compiled once for the engine's
  dialect, on sqlite3 connections the store holds, each unit in its own
  ``BEGIN IMMEDIATE`` transaction. SQLAlchemy's per-``execute`` cost (~50-80 µs) is most of
  an operation at SQLite speeds; compiling once and executing on the driver removes it.
  Busy errors are retried here, so callers never see "database is locked".
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.sql import Executable

from .dberrors import is_transient
from .errors import DatabaseBusy

__all__ = [
    "CoreExecutor",
    "Executor",
    "SQLiteDriverPath",
]

T = TypeVar("T")

# Connections a forked child inherited: never closed (closing could checkpoint or delete
# the parent's WAL), never reused.
_INHERITED: list[Any] = []

#: retries of a busy SQLite transaction after the busy_timeout already waited once
BUSY_RETRIES = 20
_BACKOFF_CAP = 0.05


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
    """One statement compiled for the driver: SQL text and how to build each positional arg."""

    __slots__ = ("plain", "sources", "sql")

    def __init__(self, sql: str, sources: tuple[tuple[bool, Any, Any], ...]) -> None:
        self.sql = sql
        # (True, name, processor): from the call's params; (False, value, None): a constant
        self.sources = sources
        self.plain = tuple((named, v) for named, v, _ in sources)
        if any(p is not None for _, _, p in sources):
            self.plain = ()

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        if self.plain:
            return [params[v] if named else v for named, v in self.plain]
        return [(params[v] if p is None else p(params[v])) if named else v for named, v, p in self.sources]


class _DriverExecutor:
    __slots__ = ("compiled", "cursor")

    def __init__(self, cursor: Any, compiled: Callable[[Executable], _Compiled]) -> None:
        self.cursor = cursor
        self.compiled = compiled

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        c = self.compiled(stmt)
        self.cursor.execute(c.sql, c.args(params))
        return self.cursor.fetchall()  # type: ignore[no-any-return]

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        c = self.compiled(stmt)
        self.cursor.execute(c.sql, c.args(params))
        return self.cursor.rowcount  # type: ignore[no-any-return]


class SQLiteDriverPath:
    """Units of work on sqlite3 connections held by the store, one ``BEGIN`` each.

    Connections come from the engine (so its ``connect`` listeners set the pragmas and
    hand transaction control over) and are then detached from its pool. Up to
    ``max_idle`` stay open between operations; a forked child never touches its parent's.
    """

    def __init__(self, engine: Engine, begin_sql: str, *, max_idle: int = 8) -> None:
        self.engine = engine
        self.begin_sql = begin_sql
        self.max_idle = max_idle
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._closed = False
        self._compiled: dict[int, tuple[Executable, _Compiled]] = {}

    def _compiled_for(self, stmt: Executable) -> _Compiled:
        try:
            return self._compiled[id(stmt)][1]
        except KeyError:
            # keep the statement referenced so its id() is never reused by another
            self._compiled[id(stmt)] = (stmt, self._compile(stmt))
            return self._compiled[id(stmt)][1]

    def _compile(self, stmt: Executable) -> _Compiled:
        dialect = self.engine.dialect
        compiled: Any = stmt.compile(dialect=dialect)  # type: ignore[attr-defined]
        if not compiled.positional:
            raise AssertionError(f"driver path expects a positional paramstyle, got {dialect.paramstyle}")
        sources: list[tuple[bool, Any, Any]] = []
        for name in compiled.positiontup:
            bind = compiled.binds[name]
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:  # bindparam("job_id") without a value: from the call
                sources.append((True, bind.key, process))
            else:  # a constant such as the 0 of "done = 0"
                value = bind.effective_value
                sources.append((False, value if process is None else process(value), None))
        return _Compiled(compiled.string, tuple(sources))

    def run(self, unit: Callable[[Any], T]) -> T:
        """Run ``unit`` in one ``BEGIN IMMEDIATE`` transaction, retrying while busy."""
        attempt = 0
        while True:
            conn = self._checkout()
            reusable = False
            try:
                cursor = conn.cursor()
                try:
                    cursor.execute(self.begin_sql)
                    result = unit(_DriverExecutor(cursor, self._compiled_for))
                    cursor.execute("COMMIT")
                finally:
                    if conn.in_transaction:
                        conn.rollback()
                    cursor.close()
                reusable = True
                return result
            except sqlite3.OperationalError as exc:
                if not is_transient(exc):
                    raise
                reusable = True  # a busy connection is healthy; it just waited its turn
                attempt += 1
                if attempt > BUSY_RETRIES:
                    raise DatabaseBusy(
                        f"database stayed locked through {BUSY_RETRIES} retries; nothing was changed"
                    ) from exc
                time.sleep(random.uniform(0, min(_BACKOFF_CAP, 0.001 * 2**attempt)))
            finally:
                self._checkin(conn, reusable)

    def _checkout(self) -> Any:
        if self._pid != os.getpid():
            _INHERITED.extend(self._idle)
            self._idle = []
            self._pid = os.getpid()
        try:
            return self._idle.pop()
        except IndexError:
            pass
        proxied = self.engine.raw_connection()
        conn = proxied.driver_connection
        proxied.detach()
        return conn

    def _checkin(self, conn: Any, reusable: bool) -> None:
        if self._pid != os.getpid():
            _INHERITED.append(conn)
        elif reusable and not self._closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close the idle connections; ones in use close when their operation ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        if self._pid == os.getpid():
            for conn in idle:
                conn.close()
        else:
            _INHERITED.extend(idle)
