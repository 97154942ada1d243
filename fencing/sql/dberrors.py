"""How database errors cross into the library: wrapped, and classified for retry.

Callers catch one family (:class:`fencing.core.errors.FencingError`); the SQLAlchemy or
driver error stays attached as ``__cause__``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Dialect, Engine
from sqlalchemy import exc as sa_exc

from ..core.errors import DatabaseBusy, DatabaseError, FencingError, PoolTimeout, TableMissing

__all__ = [
    "DB_ERRORS",
    "database_errors",
    "driver_errors",
    "is_corrupt",
    "is_duplicate_key",
    "is_transient",
    "sqlalchemy_error",
    "wrap_database_error",
]

#: what a database call can raise that the library translates
DB_ERRORS = (sa_exc.SQLAlchemyError, sqlite3.Error)

# PostgreSQL SQLSTATEs: serialization_failure, deadlock_detected, lock_not_available
_PG_TRANSIENT = {"40001", "40P01", "55P03"}
# MariaDB/MySQL error numbers: deadlock, lock wait timeout
_MYSQL_TRANSIENT = {1213, 1205}


def _driver_error(exc: BaseException) -> Any:
    return getattr(exc, "orig", None) or exc


def is_transient(exc: BaseException) -> bool:
    """The transaction lost a lock race and was rolled back whole: running it again is safe."""
    orig = _driver_error(exc)
    if isinstance(orig, sqlite3.OperationalError):
        code = getattr(orig, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (any extended code)
        return "database is locked" in str(orig) or "database table is locked" in str(orig)
    if getattr(orig, "sqlstate", None) in _PG_TRANSIENT:
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and isinstance(args[0], int) and args[0] in _MYSQL_TRANSIENT


def is_corrupt(exc: BaseException) -> bool:
    """SQLite found the file damaged: SQLITE_CORRUPT or SQLITE_NOTADB (any extended code)."""
    orig = _driver_error(exc)
    if not isinstance(orig, sqlite3.DatabaseError):
        return False
    code = getattr(orig, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (11, 26)
    return "malformed" in str(orig) or "not a database" in str(orig)


def is_duplicate_key(exc: BaseException) -> bool:
    """A unique/primary key violation (SQLite, PostgreSQL 23505, MariaDB/MySQL 1062)."""
    orig = _driver_error(exc)
    if isinstance(orig, sqlite3.IntegrityError):
        return "UNIQUE constraint failed" in str(orig)
    if getattr(orig, "sqlstate", None) == "23505":
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and args[0] == 1062


def driver_errors(engine: Engine) -> tuple[type[BaseException], ...]:
    """The DBAPI module's ``Error`` base class (PEP 249), if the dialect loaded one: what
    the library's fast path, which calls the driver directly, can raise."""
    dbapi = getattr(engine.dialect, "loaded_dbapi", None) or getattr(engine.dialect, "dbapi", None)
    error = getattr(dbapi, "Error", None)
    return (error,) if isinstance(error, type) and issubclass(error, BaseException) else ()


def sqlalchemy_error(exc: BaseException, dialect: Dialect) -> BaseException:
    """The SQLAlchemy error for ``exc``: a driver error raised on the store's driver path is
    wrapped the way SQLAlchemy wraps it on its own path (``IntegrityError`` etc., with the
    driver's error as ``.orig``), so callers see the same ``__cause__`` either way."""
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return exc
    dbapi = getattr(dialect, "loaded_dbapi", None)
    base = getattr(dbapi, "Error", None)
    if not (isinstance(base, type) and isinstance(exc, base) and isinstance(exc, Exception)):
        return exc
    return sa_exc.DBAPIError.instance(None, None, exc, base, dialect=dialect)


def wrap_database_error(exc: BaseException, table_name: str = "jobs") -> FencingError:
    """The library's error for a driver or SQLAlchemy error (raise it ``from exc``)."""
    if isinstance(exc, sa_exc.TimeoutError):  # the pool's, not the database's
        return PoolTimeout(
            "no connection came free in the engine's pool within its pool_timeout; "
            f"nothing was changed ({exc})"
        )
    orig = _driver_error(exc)
    message = str(orig).strip()
    missing = (
        "no such table" in message  # SQLite
        or getattr(orig, "sqlstate", None) == "42P01"  # PostgreSQL undefined_table
        or getattr(orig, "args", (None,))[:1] == (1146,)  # MariaDB/MySQL
    )
    if missing and table_name in message:
        return TableMissing(
            f"table {table_name!r} does not exist; create it first "
            "(JobStore.create_table() or service.init_db())"
        )
    if is_transient(exc):
        # a lock race the caller's own transaction (conn=, fenced) lost past the busy timeout
        return DatabaseBusy(
            f"the database stayed locked by other writers; the transaction was rolled back "
            f"({type(orig).__name__}: {message})"
        )
    return DatabaseError(f"{type(orig).__name__}: {message}")


@contextmanager
def database_errors(table_name: str = "jobs") -> Iterator[None]:
    """Translate database errors raised inside the block."""
    try:
        yield
    except DB_ERRORS as exc:
        raise wrap_database_error(exc, table_name) from exc
