"""Which database the suite runs against, and how each test gets a clean one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Engine, exc, make_url
from sqlalchemy import create_engine as create_server_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

import fencing
import fencing.asyncio

#: the local servers of the development and CI machines
ALIASES = {
    "sqlite": None,
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}

ENABLE_HINT = (
    "start the server or point the suite at one: "
    "pytest --db postgresql|mariadb, or --dburi URL (or FENCING_TEST_DB / FENCING_TEST_DBURI)"
)


@dataclass(frozen=True)
class Backend:
    """``url`` is None for SQLite (a file per test); else the server's admin database URL."""

    name: str
    url: str | None = None
    worker_url: str | None = field(default=None)

    @property
    def dialect(self) -> str:
        return "sqlite" if self.url is None else make_url(self.url).get_backend_name()

    def describe(self) -> str:
        if self.url is None:
            return "sqlite (a database file per test)"
        return f"{self.name} at {make_url(self.url).render_as_string(hide_password=True)}"

    def require(self) -> None:
        """Skip (or, under CI, fail) when the server does not answer."""
        if self.url is None:
            return
        problem = _unreachable(self.url)
        if problem is None:
            return
        message = f"{self.name} is not reachable ({problem}); {ENABLE_HINT}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI requires every backend: {message}", pytrace=False)
        pytest.skip(message)

    @contextlib.contextmanager
    def for_worker(self, worker_id: str) -> Iterator[Backend]:
        if self.url is None:
            yield self
            return
        name = f"fencing_test_{worker_id}_{os.getpid()}"
        admin = sqlalchemy.create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
                conn.exec_driver_sql(f"CREATE DATABASE {name}")
            yield replace(self, worker_url=make_url(self.url).set(database=name).render_as_string(False))
        finally:
            with admin.connect() as conn:
                if self.dialect == "postgresql":
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                else:
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
            admin.dispose()

    @contextlib.contextmanager
    def fresh_target(self, tmp_path: Path) -> Iterator[str]:
        if self.worker_url is None:
            yield str(tmp_path / "jobs.db")
            return
        _drop_all(self.worker_url)
        try:
            yield self.worker_url
        finally:
            _drop_all(self.worker_url)


def choose(db: str | None, dburi: str | None) -> Backend:
    if dburi:
        url = make_url(dburi)
        if url.get_backend_name() == "sqlite":
            raise pytest.UsageError("--dburi is for servers; SQLite is the default (--db sqlite)")
        return Backend(url.get_backend_name(), dburi)
    name = db or "sqlite"
    if name not in ALIASES:
        raise pytest.UsageError(f"unknown --db {name!r}; choose one of {sorted(ALIASES)}")
    return Backend(name, ALIASES[name])


def engine_for(target: str) -> Engine:
    """An engine the library accepts, for a file path or a server URL."""
    if "://" in target:
        return sqlalchemy.create_engine(target)
    return fencing.create_sqlite_engine(target)


def another_way_to(target: str, tmp_path: Path) -> str:
    """The database of ``target`` by a path or URL that does not say so: the SQLite file
    through a symlinked directory, a server by another host name (``localhost`` for
    ``127.0.0.1`` and back)."""
    if "://" not in target:
        link = tmp_path / "another-way"
        if not link.exists():
            os.symlink(os.path.dirname(os.path.abspath(target)), link)
        return str(link / os.path.basename(target))
    url = make_url(target)
    other = {"127.0.0.1": "localhost", "localhost": "127.0.0.1"}.get(url.host or "", url.host)
    assert other != url.host, f"no other host name for {url.host!r}"
    return url.set(host=other).render_as_string(hide_password=False)


#: the asyncio driver the async store is tested with, per server dialect
ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "mysql": "mysql+asyncmy", "mariadb": "mysql+asyncmy"}


def async_engine_for(target: str, **kwargs: Any) -> AsyncEngine:
    """An ``AsyncEngine`` the async store accepts, for a file path or a server URL."""
    if "://" not in target:
        return fencing.asyncio.create_sqlite_engine(target, **kwargs)
    url = make_url(target)
    return create_async_engine(url.set(drivername=ASYNC_DRIVERS[url.get_backend_name()]), **kwargs)


def _unreachable(url: str) -> str | None:
    engine = sqlalchemy.create_engine(url, pool_pre_ping=False)
    try:
        with engine.connect():
            return None
    except Exception as exc:  # any failure to connect means "not available here"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        engine.dispose()


def _drop_all(url: str) -> None:
    engine = sqlalchemy.create_engine(url)
    try:
        meta = sqlalchemy.MetaData()
        meta.reflect(engine)
        meta.drop_all(engine)
    finally:
        engine.dispose()


def _probe(name: str) -> int:
    """``python -m tests.backends NAME``: exit 0 if the alias's server answers, else 1 and why."""
    backend = choose(name, None)
    if backend.url is None:
        return 0
    problem = _unreachable(backend.url)
    if problem is None:
        return 0
    print(f"{backend.describe()} is not reachable ({problem}); {ENABLE_HINT}")
    return 1


def end_other_sessions(target: str) -> int:
    """End, from a connection of its own, every other session on the test's own database
    (as a server restart or an idle-connection cull would): how many."""
    admin = create_server_engine(target, poolclass=NullPool)
    try:
        with admin.connect() as conn:
            if admin.dialect.name == "postgresql":
                ended = conn.exec_driver_sql(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).all()
                return len(ended)
            ids = conn.exec_driver_sql(
                "SELECT id FROM information_schema.processlist "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            ).all()
            ended = 0
            for (session,) in ids:
                try:
                    conn.exec_driver_sql(f"KILL CONNECTION {int(session)}")
                    ended += 1
                except exc.OperationalError as error:
                    # 1094 "Unknown thread id": it closed on its own between the list and the KILL
                    if getattr(error.orig, "args", (None,))[0] != 1094:
                        raise
            return ended
    finally:
        admin.dispose()


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "--url":  # python -m tests.backends --url NAME: the alias's URL
        print(choose(sys.argv[2], None).url or "")
        raise SystemExit(0)
    raise SystemExit(_probe(sys.argv[1]))
