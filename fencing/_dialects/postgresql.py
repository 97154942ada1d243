"""PostgreSQL: ``RETURNING``, ``ON CONFLICT``, arrays for batches, no U+0000 in text, a
server that says who it is, ``LISTEN``/``NOTIFY`` to wake a lock's waiters."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

from .base import ARRAYS, FENCE_AGAIN, LOOP, RETURNED, THREAD, Database, Rule, Values

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
_UNDEFINED_COLUMN = "42703"
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


_CONF = "in postgresql.conf (or ALTER SYSTEM), then reload"


def _pg_sync_standby_named(s: Values) -> bool:
    return s.get("synchronous_standby_names", "").strip() != ""


_SETTINGS_QUERY = (
    "SELECT name, setting FROM pg_settings WHERE name IN "
    "('fsync', 'full_page_writes', 'synchronous_commit', 'synchronous_standby_names') "
    "UNION ALL SELECT 'standbys', count(*)::text FROM pg_stat_replication r WHERE NOT EXISTS ("
    "SELECT 1 FROM pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical')"
)

_RULES = (
    Rule(
        "fsync",
        lambda s: s["fsync"] == "off",
        "power loss or an OS crash can lose commits the server acknowledged, or corrupt the "
        f"cluster: {FENCE_AGAIN}",
        f"fsync = on {_CONF}",
    ),
    Rule(
        "full_page_writes",
        lambda s: s["full_page_writes"] == "off",
        "a page torn by power loss or an OS crash cannot be repaired from the WAL: the jobs "
        "table (its fences) can come back corrupt",
        f"full_page_writes = on {_CONF}",
    ),
    Rule(
        "synchronous_commit",
        lambda s: s["synchronous_commit"] == "off",
        "a crash of the server loses the last commits it acknowledged (up to 3 x "
        f"wal_writer_delay): {FENCE_AGAIN}",
        "synchronous_commit = on (and no off for the store's role or database: ALTER ROLE/"
        "DATABASE ... RESET synchronous_commit; no -c synchronous_commit=off in the URL)",
    ),
    Rule(
        "synchronous_commit",
        lambda s: s["synchronous_commit"] == "local" and _pg_sync_standby_named(s),
        "commits are acknowledged before the synchronous standby has them: a failover to it "
        f"loses them, and {FENCE_AGAIN}",
        "synchronous_commit = on (or remote_apply) for the store's sessions",
    ),
    Rule(
        "synchronous_standby_names",
        lambda s: not _pg_sync_standby_named(s) and int(s.get("standbys", "0")) > 0,
        "the standbys are asynchronous: a failover to one loses the commits it had not "
        f"received yet, and {FENCE_AGAIN}",
        "name them in synchronous_standby_names (e.g. 'ANY 1 (standby1, standby2)'), with "
        "synchronous_commit = on or remote_apply",
    ),
)


class PostgreSQL(Database):
    names = ("postgresql",)
    family = "postgresql"
    known = True
    async_drivers = ("psycopg", "asyncpg")
    extras: ClassVar[dict[str, str]] = {"psycopg": "postgresql", "asyncpg": "asyncpg"}
    misspellings = ("postgres", "pgsql")
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

    def undefined_column(self, error: Any) -> bool:
        return getattr(error, "sqlstate", None) == _UNDEFINED_COLUMN

    durability_settings = ("fsync", "full_page_writes", "synchronous_commit", "synchronous_standby_names")
    durability_rules = _RULES

    def read_durability(self, cursor: Any) -> dict[str, str]:
        cursor.execute(_SETTINGS_QUERY)
        return {str(name).lower(): str(value).lower() for name, value in cursor.fetchall()}

    def shown(self, setting: str, values: Values) -> str:
        value = values[setting]
        if setting == "synchronous_commit":
            return f"{value} (synchronous_standby_names {values.get('synchronous_standby_names', '')!r})"
        if setting == "synchronous_standby_names":
            return f"{value!r} ({values.get('standbys', '0')} standbys streaming)"
        return value
