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

#: bumped in every forked child; cheaper to compare per operation than os.getpid()
FORK_GENERATION = [0]


def _after_fork_in_child() -> None:
    FORK_GENERATION[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

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
    """One statement compiled for the driver: SQL text and how to build its positional args."""

    __slots__ = ("names", "processors", "sql")

    def __init__(self, sql: str, names: tuple[str, ...], processors: tuple[Any, ...]) -> None:
        self.sql = sql
        self.names = names
        # e.g. float() for a REAL column on SQLite; None where the value goes as it is
        self.processors = processors if any(p is not None for p in processors) else None

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        if self.processors is None:
            return [params[name] for name in self.names]
        return [
            params[name] if p is None else p(params[name])
            for name, p in zip(self.names, self.processors, strict=True)
        ]


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
        self._generation = FORK_GENERATION[0]
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
        names, processors = [], []
        for name in compiled.positiontup:
            bind = compiled.binds[name]
            if not bind.required:
                # constants belong in the SQL (statements.py writes them as literals)
                raise AssertionError(f"unexpected constant bind parameter {name!r} in {compiled.string}")
            names.append(bind.key)
            processors.append(bind.type.dialect_impl(dialect).bind_processor(dialect))
        return _Compiled(compiled.string, tuple(names), tuple(processors))

    def run(self, unit: Callable[[Any], T], *, write: bool = True) -> T:
        """Run ``unit`` in one ``BEGIN IMMEDIATE`` transaction, retrying while busy.

        ``write=False`` is for a unit that runs one read statement: it runs without an
        explicit transaction (one statement is its own snapshot) and takes no write lock.
        """
        attempt = 0
        while True:
            conn = self._checkout()
            reusable = False
            try:
                cursor = conn.cursor()
                try:
                    if not write:
                        result = unit(_DriverExecutor(cursor, self._compiled_for))
                    else:
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

    def read(self, stmt: Executable, params: Mapping[str, Any]) -> list[Any]:
        """The rows of one read statement, run outside any explicit transaction.

        The hot path of ``state()``: one SELECT is its own snapshot and takes no write lock.
        """
        compiled = self._compiled_for(stmt)
        conn = self._checkout()
        reusable = False
        try:
            rows: list[Any] = conn.execute(compiled.sql, compiled.args(params)).fetchall()
            reusable = True
            return rows
        except sqlite3.OperationalError as exc:
            if not is_transient(exc):
                raise
            reusable = True
        finally:
            self._checkin(conn, reusable)
        # busy while reading (rare in WAL: a checkpoint or recovery): the retrying path
        return self.run(lambda x: list(x.rows(stmt, params)), write=False)

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
        return conn

    def _checkin(self, conn: Any, reusable: bool) -> None:
        if self._generation != FORK_GENERATION[0]:
            _INHERITED.append(conn)  # opened by the parent: its operation ended in the child
        elif reusable and not self._closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def _forget_parent(self) -> None:
        _INHERITED.extend(self._idle)
        self._idle = []
        self._generation = FORK_GENERATION[0]

    def close(self) -> None:
        """Close the idle connections; ones in use close when their operation ends."""
        self._closed = True
        if self._generation != FORK_GENERATION[0]:
            self._forget_parent()
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
