"""SQLite glue: the two transaction listeners, the pragmas, and an engine factory.

SQLite's Python driver opens transactions lazily and as ``DEFERRED``; a deferred
transaction that reads and then writes can lose a race. SQLAlchemy's documented recipe
hands transaction control to us: ``connect`` sets ``isolation_level = None`` and
``begin`` emits the ``BEGIN``, so the library decides how each transaction begins:

* the store's own transactions and ``fenced()`` begin ``IMMEDIATE``: the write lock is
  taken before the first read, so compare-and-set is atomic. They ask for it with the
  connection's execution option ``fencing_begin="IMMEDIATE"`` (:data:`BEGIN_OPTION`);
* the application's transactions begin the way :func:`configure` was told (``begin=``,
  default ``"DEFERRED"``): a read-only ``Session`` takes no write lock, so it never blocks
  the workers; a transaction that writes takes the lock at its first write. An application
  connection can ask for ``IMMEDIATE`` itself with the same execution option.

An ``IMMEDIATE`` begin waits for the lock the way :mod:`fencing._runtime.writelock` describes (the
connection's ``busy_timeout`` is lowered for the ``BEGIN`` only, then restored).

Durability (``PRAGMA journal_mode=WAL`` always; ``synchronous`` by choice):

* ``"full"`` (default): the WAL is fsynced at every commit. A fence that was handed
  out survives power loss, so it is never handed out a second time.
* ``"normal"``: no fsync per commit. Survives a crash of the process, but power loss can
  roll back the last commits, and a rolled-back claim can hand the same fence to a second
  worker. About 5-10x faster on a real disk; opt in only where that trade is acceptable.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import sqlalchemy
from sqlalchemy import Engine, event
from sqlalchemy.pool import ConnectionPoolEntry

from .._dialects import of
from .._dialects.sqlite import SQLite
from .._errors import ConfigurationError, InvalidArgument, InvalidArgumentType
from .._sql.dberrors import DB_ERRORS
from . import forks
from .admission import refuse_sharing_pool
from .writelock import WriteLock, sidecar_path

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "BEGIN_MODES",
    "BEGIN_OPTION",
    "DEFAULT_BUSY_TIMEOUT",
    "Durability",
    "configure",
    "create_async_engine",
    "create_engine",
    "is_configured",
]

Durability = Literal["full", "normal"]
DURABILITIES: tuple[str, ...] = get_args(Durability)
BEGIN_MODES = ("DEFERRED", "IMMEDIATE", "EXCLUSIVE")
#: the execution option that says how a connection's next transaction begins
BEGIN_OPTION = "fencing_begin"
DEFAULT_BUSY_TIMEOUT = 5.0

#: the execution option that marks a connection's transaction as the store's own
STORE_OPTION = "fencing_store"

_MARK = "fencing_sqlite_settings"
#: in a pooled connection's ``info``: its busy_timeout is the store's short one, not the engine's
_SHORT_HANDLER = "fencing_short_busy_handler"

#: a file's (device, inode)
FileId = tuple[int, int]


def file_id(path: str) -> FileId | None:
    """The (device, inode) of the file at ``path``, or ``None`` if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class Settings:
    """What :func:`configure` installed on one engine; the store reads it back."""

    def __init__(self, durability: Durability, busy_timeout: float, begin: str, database: str | None) -> None:
        self.durability = durability
        self.busy_timeout = busy_timeout
        self.begin = begin  # how the application's transactions begin
        self.pragmas = (
            f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}",
            "PRAGMA journal_mode = WAL",
            f"PRAGMA synchronous = {durability.upper()}",
        )
        #: begins IMMEDIATE transactions: SQLite's handler briefly, then the longest waiter first
        self.write_lock = WriteLock(busy_timeout, sidecar_path(database))
        self._short_sql = self.write_lock.handler_sql
        self._full_sql = self.pragmas[0]
        # every connection made for this engine, to tell a forked child which are still open
        self._records: weakref.WeakSet[ConnectionPoolEntry] = weakref.WeakSet()
        self._path = database if sidecar_path(database) is not None else None  # a file, by path
        #: the (database, -wal) files the latest connection opened (see :meth:`files_in_use`)
        self._files: tuple[FileId | None, FileId | None] | None = None

    def on_connect(self, dbapi_connection: Any, connection_record: ConnectionPoolEntry) -> None:
        try:
            if getattr(dbapi_connection, "autocommit", None) is False:
                # Python 3.12's PEP 249 mode opens a transaction itself after every commit
                raise ConfigurationError(
                    "sqlite3 connections made with autocommit=False open their own transactions, "
                    "so the library cannot begin them IMMEDIATE: leave autocommit at its default"
                )
            # hand transaction control to the begin listener (and to the store's fast path)
            dbapi_connection.isolation_level = None
            connection_record.info.pop(_SHORT_HANDLER, None)
            cursor = dbapi_connection.cursor()
            try:
                for pragma in self.pragmas:
                    cursor.execute(pragma)
                if self._path is not None:
                    self._files = self._opened(cursor)
            finally:
                cursor.close()
        except BaseException:
            # e.g. "file is not a database": the pool drops the connection without closing it
            dbapi_connection.close()
            raise
        self._records.add(connection_record)

    def _opened(self, cursor: Any) -> tuple[FileId | None, FileId | None]:
        """The database and -wal files a new connection opened (two stats per connection)."""
        assert self._path is not None
        wal = file_id(self._path + "-wal")
        if wal is None:  # a database just switched to WAL: its first read opens the WAL
            cursor.execute("PRAGMA schema_version")
            wal = file_id(self._path + "-wal")
        return (file_id(self._path), wal)

    def on_begin(self, conn: sqlalchemy.Connection) -> None:
        options = conn.get_execution_options()
        info = conn.connection.info
        mode = options.get(BEGIN_OPTION, self.begin)
        execute = _executor(conn)
        if options.get(STORE_OPTION):
            # the store's own transaction: the connection keeps the short busy handler its
            # BEGIN IMMEDIATE waits in, as on the fast path (set once, not per transaction)
            if mode == "DEFERRED":
                execute("BEGIN DEFERRED")
                return
            if not info.get(_SHORT_HANDLER):
                execute(self._short_sql)
                info[_SHORT_HANDLER] = True
            driver = conn.connection.driver_connection
            self.write_lock.begin(execute, "BEGIN IMMEDIATE", DB_ERRORS, lowered=True, connection=driver)
            return
        # the application's: a connection the store used last still waits STARVING at most;
        # it gets the engine's busy_timeout back before the transaction's first statement
        if info.get(_SHORT_HANDLER):
            execute(self._full_sql)
            del info[_SHORT_HANDLER]
        self.write_lock.note_callers_transaction(conn.connection.driver_connection)
        if mode == "DEFERRED":
            execute("BEGIN DEFERRED")
        elif mode in BEGIN_MODES:
            self.write_lock.begin(execute, f"BEGIN {mode}", DB_ERRORS)
        else:
            raise InvalidArgument(
                f"execution option {BEGIN_OPTION} must be one of {BEGIN_MODES}, got {mode!r}"
            )

    def lower_busy_handler(self, dbapi_connection: Any, info: dict[str, Any]) -> None:
        """Give a pooled connection the short busy handler the store's ``BEGIN IMMEDIATE``
        waits in (:mod:`fencing._runtime.writelock`). It keeps it between the store's transactions
        (no statement per transaction to lower and restore it); :meth:`on_begin` gives the
        engine's back to the next transaction of a ``Connection`` or ``Session`` on it. A raw
        DBAPI connection the application takes itself (``engine.raw_connection()``) may still
        carry the short one."""
        if not info.get(_SHORT_HANDLER):
            dbapi_connection.execute(self._short_sql)
            info[_SHORT_HANDLER] = True

    def inherited_alive(self) -> bool:
        """In a forked child, after the idle connections were closed: whether any connection
        this engine made before the fork is still open (it was in use at the fork)."""
        return self.any_open()

    def any_open(self) -> bool:
        """Whether any connection this engine made is still open."""
        return any(record.dbapi_connection is not None for record in list(self._records))

    def files_in_use(self) -> tuple[FileId | None, FileId | None] | None:
        """The (database, -wal) files the engine's latest connection opened, as (device,
        inode), while any of its connections is open, else ``None``. While one is open,
        SQLite neither deletes that WAL nor can its inode number go to another file."""
        return self._files if self.any_open() else None


def _executor(conn: sqlalchemy.Connection) -> Callable[[str], object]:
    """Runs one statement through Core (so the engine's logging and events see it)."""
    return lambda sql: conn.exec_driver_sql(sql).close()


def _check_options(durability: object, busy_timeout: object, begin: object) -> tuple[Durability, float, str]:
    if durability not in DURABILITIES:
        raise InvalidArgument(f"durability must be one of {DURABILITIES}, got {durability!r}")
    if isinstance(busy_timeout, bool) or not isinstance(busy_timeout, (int, float)):
        raise InvalidArgumentType(f"busy_timeout must be a number of seconds, got {busy_timeout!r}")
    if not 0 <= busy_timeout < 2**31 / 1000:
        raise InvalidArgument(f"busy_timeout must be between 0 and 2147483 seconds, got {busy_timeout!r}")
    if not isinstance(begin, str) or begin.upper() not in BEGIN_MODES:
        raise InvalidArgument(f"begin must be one of {BEGIN_MODES}, got {begin!r}")
    return durability, float(busy_timeout), begin.upper()  # type: ignore[return-value]


#: the SQLite drivers whose transactions the listeners can begin: the standard library's
#: sqlite3, and aiosqlite (the same module on a thread, for :mod:`fencing.asyncio`)

E = TypeVar("E")


def configure(
    engine: E,
    *,
    durability: Durability = "full",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    begin: str = "DEFERRED",
) -> E:
    """Equip an engine the application made itself; returns it.

    Installs the ``connect`` and ``begin`` listeners and disposes the engine's pool so
    that every connection from now on carries them. ``begin`` is how the application's own
    transactions begin (the store's always begin ``IMMEDIATE``). Calling it twice is an
    error (the first settings would silently win otherwise). Pools that share one
    connection between transactions (``StaticPool``, ``SingletonThreadPool``, e.g. an
    in-memory database, and ``AssertionPool``) are refused.
    """
    sync = sync_engine_of(engine)
    if not isinstance(sync, Engine):
        raise InvalidArgumentType(
            f"engine must be a sqlalchemy Engine or AsyncEngine, got {type(engine).__name__}"
        )
    if not of(sync.dialect).is_file:
        raise ConfigurationError(f"configure() is for SQLite engines, got {sync.dialect.name!r}")
    if not of(sync.dialect).glues(sync.dialect.driver):
        raise ConfigurationError(
            f"the store supports the sqlite3 (pysqlite) and aiosqlite drivers, got {sync.dialect.driver!r}"
        )
    if settings_of(sync) is not None:
        raise ConfigurationError(f"{engine!r} is already configured by fencing.configure_sqlite()")
    refuse_sharing_pool(sync)
    bridged = sync is not engine  # an AsyncEngine's sync_engine
    pool: Any = sync.pool
    if bridged and any(getattr(pool, n, lambda: 0)() for n in ("checkedin", "checkedout")):
        raise ConfigurationError(
            "this AsyncEngine has opened connections already, which lack the listeners: "
            "configure it before its first use (or use fencing.asyncio.create_sqlite_engine())"
        )
    settings = Settings(*_check_options(durability, busy_timeout, begin), sync.url.database)
    event.listen(sync, "connect", settings.on_connect)
    event.listen(sync, "begin", settings.on_begin)
    setattr(sync, _MARK, settings)
    if not bridged:  # an AsyncEngine has no connection yet (above): nothing to close
        sync.dispose()
    forks.register(sync)
    return engine


def sync_engine_of(engine: object) -> object:
    """``engine``, or the ``sync_engine`` of an ``AsyncEngine`` (without importing asyncio
    support when nobody made an AsyncEngine)."""
    ext = sys.modules.get("sqlalchemy.ext.asyncio")
    if ext is not None and isinstance(engine, ext.AsyncEngine):
        return engine.sync_engine
    return engine


def settings_of(engine: Engine) -> Settings | None:
    """The settings :func:`configure` installed, or ``None`` (also for an engine made from a
    configured one with ``engine.execution_options(...)``, which shares its pool and events)."""
    settings = getattr(forks.root(engine), _MARK, None)
    return settings if isinstance(settings, Settings) else None


def is_configured(engine: Engine) -> bool:
    """Whether ``engine`` carries the listeners that make compare-and-set atomic."""
    return settings_of(engine) is not None


def create_engine(
    path: str | os.PathLike[str],
    *,
    durability: Durability = "full",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    begin: str = "DEFERRED",
    **engine_kwargs: Any,
) -> Engine:
    """An engine on the SQLite file at ``path``, configured for fencing (:func:`configure`).

    ``:memory:`` is refused: every connection would see its own empty database.
    """
    return _configured(
        sqlalchemy.create_engine, "sqlite", path, durability, busy_timeout, begin, engine_kwargs
    )


def create_async_engine(
    path: str | os.PathLike[str],
    *,
    durability: Durability = "full",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    begin: str = "DEFERRED",
    **engine_kwargs: Any,
) -> AsyncEngine:
    """An ``AsyncEngine`` (aiosqlite) on the SQLite file at ``path``, configured exactly as
    :func:`create_engine` configures a sync one: for :class:`fencing.asyncio.AsyncJobStore`.
    Needs ``pip install fencing[aiosqlite]``."""
    from sqlalchemy.ext.asyncio import create_async_engine as create
    from sqlalchemy.pool import AsyncAdaptedQueuePool

    # pooled as the sync engine's are (SQLAlchemy 2.0 gave aiosqlite files a NullPool: a new
    # connection, thread and PRAGMAs for every operation)
    engine_kwargs.setdefault("poolclass", AsyncAdaptedQueuePool)
    return _configured(create, "sqlite+aiosqlite", path, durability, busy_timeout, begin, engine_kwargs)


def _configured(
    create: Callable[..., E],
    drivername: str,
    path: object,
    durability: Durability,
    busy_timeout: float,
    begin: str,
    engine_kwargs: dict[str, Any],
) -> E:
    """``create(url of path, **engine_kwargs)``, every argument checked first, configured."""
    url = _file_url(path, drivername)
    _check_options(durability, busy_timeout, begin)
    engine = create(url, **engine_kwargs)
    return configure(engine, durability=durability, busy_timeout=busy_timeout, begin=begin)


def _file_url(path: object, drivername: str) -> sqlalchemy.URL:
    """The URL of the database file at ``path``; ``:memory:`` is refused (every connection
    would see its own empty database)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentType(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    raw = os.fspath(path)
    if not isinstance(raw, str):
        raise InvalidArgumentType(f"path must be text, got {raw!r}")
    if raw in ("", ":memory:") or raw.startswith("file:"):
        raise InvalidArgument(f"path must name a database file, got {raw!r}")
    if "\x00" in raw:
        raise InvalidArgument(f"path must not contain NUL bytes, got {raw!r}")
    if os.path.isdir(raw):
        raise InvalidArgument(f"path is a directory, not a database file: {os.path.abspath(raw)!r}")
    # URL.create, not a URL string: a "?" or "#" in a file name is part of the name
    return sqlalchemy.URL.create(drivername, database=os.path.abspath(raw))


def _release_in_child(engine: Engine, pool: Any, kept: bool) -> None:
    """In a forked child: close the parent's idle connections here (SQLite sends nothing to
    anyone on close, and frees this child's copy of the lock table), and refuse the engine
    when a connection in use at the fork had to be kept (its locks would not hold)."""
    with contextlib.suppress(Exception):
        pool.dispose()  # closes the idle connections, here in the child
    settings = settings_of(engine)
    alive = settings is not None and settings.inherited_alive()
    if kept or alive:
        forks.refuse(
            engine,
            f"this process was forked while a connection to {engine.url.database!r} was in use "
            "(by another thread, or a transaction left open across fork()); SQLite's file locks "
            "belong to the parent process and fork() copied its lock table, so this child "
            "cannot lock the database correctly. Fork before using the database, close its "
            "connections first (engine.dispose()), or start processes with 'spawn' or 'forkserver'",
        )


forks.on_child(SQLite.family, _release_in_child)
