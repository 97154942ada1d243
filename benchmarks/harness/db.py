"""Where the benchmarks' jobs live: the local servers, the async store's engine, raw
``sqlite3`` connections with the store's PRAGMAs, scratch directories and database files,
tables filled with ready jobs."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import sqlalchemy
from sqlalchemy import Connection, Engine, Table, bindparam

from fencing._sql.schema import KEY_TYPE

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: the local test servers, by backend name
URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
#: the asyncio driver of each server backend, for the async store
ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "mysql": "mysql+asyncmy"}


def async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """The async store's engine on the server at ``url`` (a URL of any of its drivers): its
    asyncio driver (asyncpg, asyncmy), SQLAlchemy's settings otherwise. async_cycle.py and
    peers.py both build their async store's engine here, so both measure the same engine."""
    from sqlalchemy.ext.asyncio import create_async_engine

    server = sqlalchemy.make_url(url)
    return create_async_engine(server.set(drivername=ASYNC_DRIVERS[server.get_backend_name()]), **kwargs)


def sqlite_connect(path: str, durability: str) -> sqlite3.Connection:
    """A plain ``sqlite3`` connection (``isolation_level=None``) with the store's PRAGMAs:
    ``busy_timeout = 5000``, ``journal_mode = WAL``, ``synchronous = FULL|NORMAL``."""
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in (
        "PRAGMA busy_timeout = 5000",
        "PRAGMA journal_mode = WAL",
        f"PRAGMA synchronous = {durability.upper()}",
    ):
        conn.execute(pragma).fetchall()
    return conn


def remove_sqlite(path: str) -> None:
    """The database file at ``path`` and its ``-wal``, ``-shm`` and ``-journal`` files."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


@contextlib.contextmanager
def workdir(prefix: str | None, where: str | None) -> Iterator[str]:
    """A new directory in ``where`` (``None``: the system's temporary directory) for the
    run's files, removed with everything in it afterwards."""
    path = tempfile.mkdtemp(prefix=prefix, dir=where)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def insert_ids(conn: Connection, table: Table, ids: Iterable[str]) -> None:
    """``ids`` as ready jobs, in one statement: bare ids, the row ``enqueue(id)`` makes
    (``until = 0``, ``fence = 0``, ``done = 0``, no owner). The id is bound with the key
    column's own type, as the store binds it (MariaDB: UTF-8 bytes)."""
    conn.execute(table.insert().values(id=bindparam("id", type_=KEY_TYPE)), [{"id": i} for i in ids])


def refill(engine: Engine, table: Table, ids: Iterable[str]) -> None:
    """Empty a server's ``table`` (``TRUNCATE``: no dead rows pile up between runs), then
    :func:`insert_ids`, then ``ANALYZE`` it on PostgreSQL; each in its own transaction."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE TABLE {table.name}")
    with engine.begin() as conn:
        insert_ids(conn, table, ids)
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.exec_driver_sql(f"ANALYZE {table.name}")
