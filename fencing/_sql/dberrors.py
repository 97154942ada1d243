"""How database errors cross into the library: wrapped, and classified for retry.

Callers catch one family (:class:`fencing._errors.FencingError`); the SQLAlchemy or
driver error stays attached as ``__cause__``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Dialect, Engine
from sqlalchemy import exc as sa_exc

from .._dialects import MySQL, PostgreSQL, SQLite
from .._dialects.sqlite import result_code
from .._errors import (
    DatabaseBusy,
    DatabaseError,
    DatabaseFull,
    DatabaseReadOnly,
    DatabaseUnavailable,
    FencingError,
    PoolTimeout,
    SchemaMismatch,
    TableMissing,
)

__all__ = [
    "DB_ERRORS",
    "database_errors",
    "driver_errors",
    "is_corrupt",
    "is_duplicate_key",
    "is_full",
    "is_read_only",
    "is_transient",
    "is_unavailable",
    "sqlalchemy_error",
    "wrap_database_error",
]

#: what a database call can raise that the library translates: asyncpg's connect raises the
#: socket's own ``ConnectionRefusedError`` (an ``OSError``, not a DBAPI error) for a server
#: nobody answers at, which SQLAlchemy passes up as it is
DB_ERRORS = (sa_exc.SQLAlchemyError, sqlite3.Error, ConnectionError)

#: the databases whose drivers' errors the library reads (each knows its own codes)
_KNOWN = (SQLite(), PostgreSQL(), MySQL())


def _driver_error(exc: BaseException) -> Any:
    return getattr(exc, "orig", None) or exc


def is_transient(exc: BaseException) -> bool:
    """The transaction lost a lock race and was rolled back whole: running it again is safe."""
    orig = _driver_error(exc)
    return any(db.transient(orig) for db in _KNOWN)


def is_unavailable(exc: BaseException) -> bool:
    """The server could not be reached or the connection was lost (down, restarting,
    failing over, cut by the network)."""
    if isinstance(exc, sa_exc.DisconnectionError) or getattr(exc, "connection_invalidated", False):
        return True
    orig = _driver_error(exc)
    if isinstance(orig, (ConnectionError, TimeoutError)):
        return True
    return any(db.unavailable(orig) for db in _KNOWN)


def is_full(exc: BaseException) -> bool:
    """No room for the write: SQLITE_FULL, PostgreSQL disk_full, MariaDB/MySQL table or disk
    full."""
    orig = _driver_error(exc)
    return any(db.full(orig) for db in _KNOWN)


def is_read_only(exc: BaseException) -> bool:
    """The database takes no writes here: SQLITE_READONLY (a read-only file or directory),
    PostgreSQL read_only_sql_transaction (a hot standby), MariaDB/MySQL read_only."""
    orig = _driver_error(exc)
    return any(db.read_only(orig) for db in _KNOWN)


def is_corrupt(exc: BaseException) -> bool:
    """SQLite found the file damaged: SQLITE_CORRUPT or SQLITE_NOTADB (any extended code)."""
    orig = _driver_error(exc)
    return any(db.corrupt(orig) for db in _KNOWN)


def is_undefined_column(exc: BaseException) -> bool:
    """A statement named a column its table lacks (SQLite "no such column", PostgreSQL 42703,
    MariaDB/MySQL 1054): a table of that name that is not the library's, or an older one."""
    orig = _driver_error(exc)
    return any(db.undefined_column(orig) for db in _KNOWN)


def is_duplicate_key(exc: BaseException) -> bool:
    """A unique/primary key violation (SQLite, PostgreSQL 23505, MariaDB/MySQL 1062)."""
    orig = _driver_error(exc)
    return any(db.duplicate_key(orig) for db in _KNOWN)


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


def wrap_database_error(
    exc: BaseException, table_name: str = "jobs", *, database: str | None = None
) -> FencingError:
    """The library's error for a driver or SQLAlchemy error (raise it ``from exc``).

    ``database``: the engine's ``url.database``; for a SQLite file, a full or read-only
    database is then named in the message, with what to do."""
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
    if is_undefined_column(exc):
        return SchemaMismatch(
            f"table {table_name!r} (or a table of the library's beside it) lacks a column the "
            "statement names: it is not the library's table, or was made by an older version "
            "(create_table() names each difference); the statement changed nothing "
            f"({type(orig).__name__}: {message})"
        )
    if is_transient(exc):
        # a lock race the caller's own transaction (conn=, fenced) lost past the busy timeout
        return DatabaseBusy(
            f"the database stayed locked by other writers; the transaction was rolled back "
            f"({type(orig).__name__}: {message})"
        )
    described = f"{type(orig).__name__}: {message}"
    sqlite_file = database if isinstance(orig, sqlite3.Error) and database else None
    if is_full(exc):
        where = "the database is full" if sqlite_file is None else _sqlite_full(sqlite_file)
        return DatabaseFull(
            f"{where}; the transaction was rolled back whole, nothing was "
            f"written; it works again once space is freed ({described})"
        )
    if is_read_only(exc) or (sqlite_file is not None and _directory_read_only(orig, sqlite_file)):
        where = (
            "the database accepts no writes here"
            if sqlite_file is None
            else _sqlite_read_only(orig, sqlite_file)
        )
        return DatabaseReadOnly(f"{where}; nothing was changed ({described})")
    if is_unavailable(exc):
        return DatabaseUnavailable(
            f"the database could not be reached or the connection was lost before anything "
            f"committed; nothing was changed; try again once it answers ({described})"
        )
    return DatabaseError(described)


# SQLite's extended codes: SQLITE_READONLY_DIRECTORY, SQLITE_CANTOPEN
_SQLITE_READONLY_DIRECTORY = 8 | 6 << 8
_SQLITE_CANTOPEN = 14


def _sqlite_full(database: str) -> str:
    return (
        f"the SQLite database {database!r} is full (its filesystem has no space left, or the "
        "connection's PRAGMA max_page_count was reached)"
    )


def _directory_read_only(orig: Any, database: str) -> bool:
    """SQLite could not open (or create) a file of the database, and its directory is not
    writable by this process: SQLite says only "unable to open database file"."""
    directory = os.path.dirname(os.path.abspath(database))
    return (
        (result_code(orig) == _SQLITE_CANTOPEN or "unable to open database file" in str(orig))
        and os.path.isdir(directory)
        and not os.access(directory, os.W_OK)
    )


def _sqlite_read_only(orig: Any, database: str) -> str:
    """Which file or directory is read-only, and what to do."""
    directory = os.path.dirname(os.path.abspath(database))
    code = getattr(orig, "sqlite_errorcode", None)
    unwritable = os.path.isdir(directory) and not os.access(directory, os.W_OK)
    # (before Python 3.11 the error has no extended code: the directory itself is asked)
    if code == _SQLITE_READONLY_DIRECTORY or _directory_read_only(orig, database) or unwritable:
        return (
            f"the SQLite database {database!r} cannot be written: its directory {directory!r} "
            "is not writable by this process, and SQLite creates the database's -wal and -shm "
            "files (or a new database file) there; make the directory writable for this user"
        )
    return (
        f"the SQLite database {database!r} is read-only here: the file (or its -wal, -shm) is "
        "not writable by this process, it was opened read-only (mode=ro), or its filesystem "
        "is mounted read-only; make it writable for this user, or open it read-write"
    )


@contextmanager
def database_errors(table_name: str = "jobs", *, database: str | None = None) -> Iterator[None]:
    """Translate database errors raised inside the block (``database``: the engine's
    ``url.database``, see :func:`wrap_database_error`)."""
    try:
        yield
    except DB_ERRORS as exc:
        raise wrap_database_error(exc, table_name, database=database) from exc
