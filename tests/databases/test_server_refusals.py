"""What a caller gets when the server itself says no: a named error, nothing changed.

A server that cannot be reached (nothing listens on the port: down, restarting, failing
over) raises :class:`fencing.DatabaseUnavailable`; a server that takes no writes (a
PostgreSQL hot standby, ``default_transaction_read_only``; MariaDB's ``read_only`` or a
read-only session) raises :class:`fencing.DatabaseReadOnly`; both on the sync front (psycopg,
pymysql) and the async one (asyncpg, asyncmy), with the driver's error as ``__cause__``.
A read-only session is the server's own refusal, set per connection here (the shared
servers are never reconfigured). The SQLite cases (a full disk, a read-only file) are in
``test_sqlite_full.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Engine, event, make_url
from sqlalchemy.pool import NullPool

import fencing
from fencing.asyncio import AsyncJobStore
from tests import backends
from tests.private_servers import free_port

pytestmark = pytest.mark.backend("postgresql", "mysql", "mariadb")

FRONTS = ["sync", "async"]

#: per dialect: the statement that makes a session refuse writes, and what the server says
READ_ONLY_SESSION = {
    "postgresql": "SET default_transaction_read_only = on",
    "mysql": "SET SESSION TRANSACTION READ ONLY",
}


def _dialect(target: str) -> str:
    name = make_url(target).get_backend_name()
    return "mysql" if name in ("mysql", "mariadb") else name


def _unreachable(target: str) -> str:
    """The target's URL on a port nothing listens on."""
    return make_url(target).set(port=free_port()).render_as_string(hide_password=False)


def _run(front: str, url: str, call: Callable[[Any], Any], **engine_options: Any) -> Any:
    """``call(store)`` on a store of the front over ``url``: its result (awaited on the
    async front)."""
    if front == "sync":
        engine = sqlalchemy.create_engine(url, poolclass=NullPool, **engine_options)
        try:
            return call(fencing.JobStore(engine))
        finally:
            engine.dispose()

    async def main() -> Any:
        async_engine = backends.async_engine_for(url, poolclass=NullPool, **engine_options)
        try:
            return await call(AsyncJobStore(async_engine))
        finally:
            await async_engine.dispose()

    return asyncio.run(main())


@pytest.fixture
def ready(target: str) -> str:
    """``target`` with its jobs table and one job, ``j``, ready."""
    engine = backends.engine_for(target)
    try:
        store = fencing.JobStore(engine)
        store.create_table()
        store.enqueue("j")
    finally:
        engine.dispose()
    return target


def _rows(target: str) -> list[tuple[Any, ...]]:
    engine = backends.engine_for(target)
    try:
        with engine.connect() as conn:
            query = sqlalchemy.select(fencing.jobs).order_by(fencing.jobs.c.id)
            return [tuple(r) for r in conn.execute(query)]
    finally:
        engine.dispose()


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize(
    "operation",
    [
        pytest.param(lambda s: s.enqueue("k"), id="enqueue"),
        pytest.param(lambda s: s.claim_next("w", ttl=5), id="claim_next"),
        pytest.param(lambda s: s.state("j"), id="state"),
    ],
)
def test_a_server_nobody_answers_at_is_named_unavailable(
    ready: str, front: str, operation: Callable[[Any], Any]
) -> None:
    before = _rows(ready)
    with pytest.raises(fencing.DatabaseUnavailable, match="could not be reached") as raised:
        _run(front, _unreachable(ready), operation)
    assert raised.value.__cause__ is not None
    assert "nothing was changed" in str(raised.value)
    assert _rows(ready) == before


def _read_only(dialect: str, front: str) -> dict[str, Any]:
    """Engine options that make every session of the engine refuse writes."""
    statement = READ_ONLY_SESSION[dialect]

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        if front == "async" and dialect == "postgresql":
            # asyncpg's adapter: the statement runs in autocommit, outside any transaction
            dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        cursor.execute(statement)
        cursor.close()
        if front == "async" and dialect == "postgresql":
            dbapi_connection.autocommit = False
        elif dialect == "postgresql":
            dbapi_connection.commit()

    return {"_on_connect": on_connect}


def _run_read_only(front: str, target: str, call: Callable[[Any], Any]) -> Any:
    options = _read_only(_dialect(target), front)
    on_connect = options.pop("_on_connect")
    if front == "sync":
        engine = sqlalchemy.create_engine(target, poolclass=NullPool)
        event.listen(engine, "connect", on_connect)
        try:
            return call(fencing.JobStore(engine))
        finally:
            engine.dispose()

    async def main() -> Any:
        async_engine = backends.async_engine_for(target, poolclass=NullPool)
        event.listen(async_engine.sync_engine, "connect", on_connect)
        try:
            return await call(AsyncJobStore(async_engine))
        finally:
            await async_engine.dispose()

    return asyncio.run(main())


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize(
    "operation",
    [
        pytest.param(lambda s: s.enqueue("k"), id="enqueue"),
        pytest.param(lambda s: s.claim_next("w", ttl=5), id="claim_next"),
        pytest.param(lambda s: s.claim("j", "w", ttl=5), id="claim"),
    ],
)
def test_a_server_that_takes_no_writes_is_named_read_only(
    ready: str, front: str, operation: Callable[[Any], Any]
) -> None:
    before = _rows(ready)
    with pytest.raises(fencing.DatabaseReadOnly, match="accepts no writes") as raised:
        _run_read_only(front, ready, operation)
    assert raised.value.__cause__ is not None
    assert _rows(ready) == before


@pytest.mark.parametrize("front", FRONTS)
def test_a_read_only_session_still_reads(ready: str, front: str) -> None:
    """The refusal is for writes only: a read on the same session answers (so the error
    above is the server's read-only refusal, not a session that failed to open)."""
    state = _run_read_only(front, ready, lambda s: s.state("j"))
    assert state is not None and state.job_id == "j"


def test_the_error_names_are_exported_where_callers_catch_them() -> None:
    for name in ("DatabaseUnavailable", "OutcomeUnknown", "DatabaseFull", "DatabaseReadOnly"):
        error = getattr(fencing, name)
        assert issubclass(error, fencing.DatabaseError), name
        assert error.__doc__, name


def test_an_engine_fixture_is_unchanged_by_the_refusals(engine: Engine) -> None:
    """The shared server still takes writes after the read-only sessions: the setting was
    the sessions' own."""
    store = fencing.JobStore(engine)
    store.create_table()
    store.enqueue("after")
    assert store.state("after") is not None
