"""SQLite glue: the two transaction listeners, the pragmas, and an engine factory.

SQLite's Python driver opens transactions lazily and as ``DEFERRED``; a deferred
transaction that reads and then writes can lose a race. SQLAlchemy's documented recipe
hands transaction control to us: ``connect`` sets ``isolation_level = None`` and
``begin`` emits ``BEGIN IMMEDIATE``, which takes the write lock before the first read.

Durability (``PRAGMA journal_mode=WAL`` always; ``synchronous`` by choice):

* ``"full"`` (default): the WAL is fsynced at every commit. A fence that was handed
  out survives power loss, so it is never handed out a second time.
* ``"normal"``: no fsync per commit. Survives a crash of the process, but power loss can
  roll back the last commits, and a rolled-back claim can hand the same fence to a second
  worker. About 5-10x faster on a real disk; opt in only where that trade is acceptable.
"""

from __future__ import annotations

import os
from typing import Any, Literal, get_args

import sqlalchemy
from sqlalchemy import Engine, event
from sqlalchemy.pool import ConnectionPoolEntry

from .errors import ConfigurationError, InvalidArgument, InvalidArgumentType

__all__ = ["BEGIN_MODES", "DEFAULT_BUSY_TIMEOUT", "Durability", "configure", "create_engine", "is_configured"]

Durability = Literal["full", "normal"]
DURABILITIES: tuple[str, ...] = get_args(Durability)
BEGIN_MODES = ("DEFERRED", "IMMEDIATE", "EXCLUSIVE")
DEFAULT_BUSY_TIMEOUT = 5.0

_MARK = "fencing_sqlite_settings"


class _Settings:
    """What :func:`configure` installed on one engine; the store reads it back."""

    def __init__(self, durability: Durability, busy_timeout: float, begin: str) -> None:
        self.durability = durability
        self.busy_timeout = busy_timeout
        self.begin_sql = f"BEGIN {begin}"
        self.pragmas = (
            f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}",
            "PRAGMA journal_mode = WAL",
            f"PRAGMA synchronous = {durability.upper()}",
        )

    def on_connect(self, dbapi_connection: Any, connection_record: ConnectionPoolEntry) -> None:
        # hand transaction control to the begin listener (and to the store's driver path)
        dbapi_connection.isolation_level = None
        try:
            cursor = dbapi_connection.cursor()
            try:
                for pragma in self.pragmas:
                    cursor.execute(pragma)
            finally:
                cursor.close()
        except BaseException:
            # e.g. "file is not a database": the pool drops the connection without closing it
            dbapi_connection.close()
            raise

    def on_begin(self, conn: sqlalchemy.Connection) -> None:
        conn.exec_driver_sql(self.begin_sql)


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


def configure(
    engine: Engine,
    *,
    durability: Durability = "full",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    begin: str = "IMMEDIATE",
) -> Engine:
    """Equip an engine the application made itself; returns it.

    Installs the ``connect`` and ``begin`` listeners and disposes the engine's pool so
    that every connection from now on carries them. Calling it twice is an error
    (the first settings would silently win otherwise).
    """
    if not isinstance(engine, Engine):
        raise InvalidArgumentType(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
    if engine.dialect.name != "sqlite":
        raise ConfigurationError(f"configure() is for SQLite engines, got {engine.dialect.name!r}")
    if engine.dialect.driver != "pysqlite":
        raise ConfigurationError(
            f"the store supports the sqlite3 (pysqlite) driver, got {engine.dialect.driver!r}"
        )
    if settings_of(engine) is not None:
        raise ConfigurationError(f"{engine!r} is already configured by fencing.sqlite.configure()")
    settings = _Settings(*_check_options(durability, busy_timeout, begin))
    event.listen(engine, "connect", settings.on_connect)
    event.listen(engine, "begin", settings.on_begin)
    setattr(engine, _MARK, settings)
    engine.dispose()
    return engine


def settings_of(engine: Engine) -> _Settings | None:
    """The settings :func:`configure` installed, or ``None``."""
    settings = getattr(engine, _MARK, None)
    return settings if isinstance(settings, _Settings) else None


def is_configured(engine: Engine) -> bool:
    """Whether ``engine`` carries the listeners that make compare-and-set atomic."""
    return settings_of(engine) is not None


def create_engine(
    path: str | os.PathLike[str],
    *,
    durability: Durability = "full",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    **engine_kwargs: Any,
) -> Engine:
    """An engine on the SQLite file at ``path``, configured for fencing.

    ``:memory:`` is refused: every connection would see its own empty database.
    """
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
    _check_options(durability, busy_timeout, "IMMEDIATE")
    # URL.create, not a URL string: a "?" or "#" in a file name is part of the name
    url = sqlalchemy.URL.create("sqlite", database=os.path.abspath(raw))
    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    return configure(engine, durability=durability, busy_timeout=busy_timeout)
