"""PostgreSQL: ``RETURNING``, ``ON CONFLICT``, arrays for batches, no U+0000 in text, a
server that says who it is, ``LISTEN``/``NOTIFY`` to wake a lock's waiters."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from .base import ARRAYS, LOOP, RETURNED, THREAD, Database

__all__ = ["PostgreSQL"]

# SQLSTATEs: serialization_failure, deadlock_detected, lock_not_available
_TRANSIENT = {"40001", "40P01", "55P03"}
# the server is shutting down or starting (admin_shutdown, crash_shutdown, cannot_connect_now);
# class 08 (connection_exception) besides
_UNAVAILABLE = {"57P01", "57P02", "57P03"}
# disk_full
_FULL = {"53100"}
# read_only_sql_transaction (a hot standby, default_transaction_read_only)
_READ_ONLY = {"25006"}
_UNIQUE_VIOLATION = "23505"
#: libpq's PQTRANS_IDLE: no transaction open on the server
_IDLE = 0
#: drivers whose one statement in autocommit is its own transaction
_STATEMENT_COMMITS = frozenset({"psycopg", "psycopg_async", "asyncpg"})


@functools.cache
def _psycopg_pipelines() -> bool:
    try:  # (by name: psycopg is an extra, and the type checker may run without it)
        psycopg = importlib.import_module("psycopg")
    except ImportError:  # pragma: no cover - the engine's driver is psycopg
        return False
    return bool(psycopg.Pipeline.is_supported())


@functools.cache
def _psycopg_notifies_take_a_timeout() -> bool:
    """psycopg's ``Connection.notifies(timeout=...)`` (3.2), which a thread's listening
    connection waits with."""
    try:
        psycopg: Any = importlib.import_module("psycopg")
        return "timeout" in inspect.signature(psycopg.Connection.notifies).parameters
    except (ImportError, TypeError, ValueError):
        return False


class PostgreSQL(Database):
    names = ("postgresql",)
    family = "postgresql"
    known = True
    clock_sql = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"
    clock_resolution = 1e-6
    id_max_bytes = 2000  # a btree entry's limit, with room to spare
    text_holds_nul = False
    upsert = RETURNED
    batch_completion = ARRAYS
    walks_claim_order = True
    ranges_at_row_values = True
    # LIKE gives a key range only in the C collation: the bound says it in any
    prefix_needs_low_bound = True

    def identity(self, cursor: Any) -> str | None:
        cursor.execute("SELECT current_database(), has_function_privilege('pg_control_system()', 'EXECUTE')")
        database, can_read_control = cursor.fetchone()
        if can_read_control:
            cursor.execute("SELECT system_identifier FROM pg_control_system()")
            (system,) = cursor.fetchone()
            return f"postgresql {system} {database}"
        cursor.execute("SELECT host(inet_server_addr()), inet_server_port()")
        host, port = cursor.fetchone()
        if host is None:  # a Unix socket: no address to tell two servers apart by
            return None
        return f"postgresql {host}:{port} {database}"

    def autocommit_probe(self, driver: str) -> Callable[[Any], bool] | None:
        if driver == "psycopg":  # (sync, or SQLAlchemy's async adapter, which has info too)
            # in autocommit with a transaction open on the server (an explicit BEGIN: a
            # fenced block's), every statement joins it
            return lambda dbapi: bool(dbapi.autocommit) and dbapi.info.transaction_status == _IDLE
        if driver == "asyncpg":  # SQLAlchemy's adapter says it
            return lambda dbapi: bool(dbapi.autocommit)
        return None

    def wait_for_locks(self, execute: Callable[[str], Any], seconds: float) -> Callable[[], None] | None:
        # LOCAL: it ends with the transaction
        execute(f"SET LOCAL lock_timeout = '{max(1, round(seconds * 1000))}ms'")
        return None

    notifies = True

    def driven_directly(self, driver: str) -> bool:
        return driver in ("psycopg", "asyncpg")

    def pipelines(self, driver: str) -> bool:
        return driver == "psycopg" and _psycopg_pipelines()

    def statement_commits(self, driver: str) -> bool:
        return driver in _STATEMENT_COMMITS

    def wakeups(self, driver: str, *, is_async: bool) -> str | None:
        if is_async:
            return LOOP if driver in ("asyncpg", "psycopg") else None
        return THREAD if driver == "psycopg" and _psycopg_notifies_take_a_timeout() else None

    def transient(self, error: Any) -> bool:
        return getattr(error, "sqlstate", None) in _TRANSIENT

    def unavailable(self, error: Any) -> bool:
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate.startswith("08") or sqlstate in _UNAVAILABLE
        name = type(error).__name__
        if name == "OperationalError" and type(error).__module__.startswith("psycopg"):
            return True  # psycopg's connection failures carry no SQLSTATE
        closed = name in ("ConnectionDoesNotExistError", "InterfaceError")
        return closed and "connection" in str(error).lower()  # asyncpg's closed connection

    def full(self, error: Any) -> bool:
        return getattr(error, "sqlstate", None) in _FULL

    def read_only(self, error: Any) -> bool:
        return getattr(error, "sqlstate", None) in _READ_ONLY

    def duplicate_key(self, error: Any) -> bool:
        return getattr(error, "sqlstate", None) == _UNIQUE_VIOLATION
