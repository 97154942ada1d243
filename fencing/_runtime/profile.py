"""What the runner must know of an engine's database, answered by the engine layer.

The runtime (:mod:`fencing._runtime.execution`) knows no dialect: it asks :func:`profile_of`
once per store how this engine's transactions begin, whether a lock is taken at ``BEGIN``
(SQLite's write lock, waited for in :mod:`.writelock`), what happens at checkout, and whether
the engine must be refused. The dialects' glue answers: a server's profile is the default;
SQLite's comes from the settings :func:`fencing.configure_sqlite` installed.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Engine

from .._dialects import of
from . import sqlite
from .writelock import WriteLock

__all__ = ["AsyncPipe", "EngineProfile", "Pipe", "PostgreSQLProfile", "profile_of"]


class EngineProfile:
    """A server's engine (PostgreSQL, MariaDB/MySQL): transactions begin as the driver begins
    them, row locks are waited for by the server, nothing to do at checkout."""

    #: a lock every writer takes at BEGIN (SQLite's), which the runner's BEGIN waits for
    write_lock: WriteLock | None = None
    #: how long a lock may be waited for (seconds; None: as the server decides)
    busy_timeout: float | None = None
    #: the library's own listeners on the engine (not the application's observers)
    own_listeners = 0
    #: one read statement outside a transaction is its own snapshot, with no lock to take
    reads_without_transaction = False
    #: why the store must not use this engine (compare-and-set would not be atomic), if so
    refusal: str | None = None
    #: what runs on a connection just checked out for the store (dbapi connection, its info)
    after_checkout: Callable[[Any, dict[Any, Any]], None] | None = None

    #: one statement can run as its own transaction, without the driver's separate BEGIN
    #: and COMMIT round trips (the driver's autocommit, set and unset on the client alone)
    statement_commits = False
    #: the driver can send several statements and await their answers once (:meth:`pipeline`)
    pipelines = False

    def begin_options(self, *, write: bool) -> dict[str, Any]:
        """The execution options of a transaction of the store's own (how it begins)."""
        return {}

    def autocommit(self, dbapi_connection: Any, on: bool) -> None:
        """Put the driver's connection in (or out of) autocommit (``statement_commits``)."""
        raise NotImplementedError

    def closed_by_server(self, driver_connection: Any) -> bool:
        """Whether an idle pooled connection (the driver's own, ``driver_connection``) was
        closed by the server, seen on the client alone (no round trip): a statement sent on it
        would fail without having run."""
        return False

    def pipe(self, driver_connection: Any) -> Pipe:
        """The driver's pipeline on its own connection (``pipelines``): ``driver_connection``,
        SQLAlchemy's public name for it under any adapter."""
        raise TypeError("this engine's driver has no pipeline")

    def ended_its_transaction(self, driver_connection: Any) -> bool:
        """Whether the driver's own connection (``driver_connection``: SQLAlchemy's public
        name for it, under any adapter), in a transaction begun with a ``BEGIN`` of the
        library's, has none open any more (a raw ``COMMIT``), so its next statement would
        commit on its own. ``False`` where the driver begins a transaction itself before a
        statement sent outside one (psycopg and pymysql out of autocommit)."""
        return False

    def begin_again(
        self, dbapi_connection: Any, driver_connection: Any, errors: tuple[type[BaseException], ...]
    ) -> None:
        """Begin a transaction as the store's ``BEGIN`` would (after
        :meth:`ended_its_transaction`)."""
        raise NotImplementedError

    def isolated(self, dbapi_connection: Any, driver_connection: Any) -> bool:
        """Whether the engine set an isolation level on ``dbapi_connection``, which its
        transactions begin with and a statement run in autocommit (``statement_commits``)
        would not have."""
        return False


class PostgreSQLProfile(EngineProfile):
    """PostgreSQL through psycopg (sync or async) or asyncpg: a store operation that is one
    statement runs in autocommit, its own implicit transaction, in one round trip instead of
    three (BEGIN, the statement, COMMIT). The atomicity is the same: a single statement is
    always its own transaction in PostgreSQL."""

    statement_commits = True

    def __init__(self, dialect: Any) -> None:
        #: psycopg's pipeline mode (sync, or async inside the bridge), where its libpq has
        #: one (14 and later)
        self.pipelines = of(dialect).pipelines(dialect.driver)
        self._awaits = bool(getattr(dialect, "is_async", False))

    def autocommit(self, dbapi_connection: Any, on: bool) -> None:
        dbapi_connection.autocommit = on

    def pipe(self, driver_connection: Any) -> Pipe:
        if not self.pipelines:
            raise TypeError("this engine's driver has no pipeline")
        return AsyncPipe(driver_connection) if self._awaits else Pipe(driver_connection)

    def ended_its_transaction(self, driver_connection: Any) -> bool:
        # asyncpg, whose transaction SQLAlchemy's adapter began and which does not see a raw
        # COMMIT end it (psycopg out of autocommit begins again by itself)
        is_in_transaction = getattr(driver_connection, "is_in_transaction", None)
        return callable(is_in_transaction) and not is_in_transaction()

    def begin_again(
        self, dbapi_connection: Any, driver_connection: Any, errors: tuple[type[BaseException], ...]
    ) -> None:
        from .private_sqlalchemy import await_only

        level = _level(getattr(dbapi_connection, "isolation_level", None))  # the adapter's, as it begins
        sql = "BEGIN"
        if level is not None and level != "AUTOCOMMIT":
            sql += f" ISOLATION LEVEL {level}"
        await_only(driver_connection.execute(sql))

    def isolated(self, dbapi_connection: Any, driver_connection: Any) -> bool:
        # create_engine(isolation_level=...) sets a level on each driver connection (psycopg's
        # isolation_level, the asyncpg adapter's): its transactions begin with it, as the
        # store's must; a statement in autocommit would run at the server's default instead
        # (SQLAlchemy also sets READ COMMITTED back on a connection given back after a
        # transaction of another level, the store's own autocommit included: PostgreSQL's
        # default, which a statement in autocommit has anyway)
        for level in (
            _level(getattr(driver_connection, "isolation_level", None)),
            _level(getattr(dbapi_connection, "isolation_level", None)),
        ):
            if level is not None:
                return level not in ("READ COMMITTED", "AUTOCOMMIT")
        return False

    def closed_by_server(self, driver_connection: Any) -> bool:
        inner = driver_connection
        is_closed = getattr(inner, "is_closed", None)
        if callable(is_closed):  # asyncpg: its protocol saw the socket close
            return bool(is_closed())
        pgconn = getattr(inner, "pgconn", None)
        if pgconn is None:
            return False
        try:  # psycopg: an idle connection the server speaks on unasked was ended (a FATAL,
            # then the socket's end) or has news nobody here waits for: a fresh one either way
            ready, _, _ = select.select([pgconn.socket], [], [], 0)
        except Exception:
            return True
        return bool(ready)


class SQLiteProfile(EngineProfile):
    """A SQLite engine passed through :func:`fencing.configure_sqlite`: ``BEGIN IMMEDIATE``
    for the store's writes (waiting for the write lock the library's way), ``DEFERRED`` for
    its reads, the short busy handler set at checkout."""

    own_listeners = 1
    reads_without_transaction = True

    def __init__(self, settings: sqlite.Settings) -> None:
        self.write_lock = settings.write_lock
        self.busy_timeout = settings.busy_timeout
        self.after_checkout = settings.lower_busy_handler

    def begin_options(self, *, write: bool) -> dict[str, Any]:
        return {sqlite.BEGIN_OPTION: "IMMEDIATE" if write else "DEFERRED", sqlite.STORE_OPTION: True}

    def ended_its_transaction(self, driver_connection: Any) -> bool:
        # the sqlite3 module in autocommit (the library's connect listener): SQLite's own
        # answer; aiosqlite's connection says the same
        return not driver_connection.in_transaction

    def begin_again(
        self, dbapi_connection: Any, driver_connection: Any, errors: tuple[type[BaseException], ...]
    ) -> None:
        # the store's transactions keep the short busy handler: wait for the lock its way
        assert self.write_lock is not None
        cursor = dbapi_connection.cursor()
        try:
            self.write_lock.begin(
                cursor.execute, "BEGIN IMMEDIATE", errors, lowered=True, connection=driver_connection
            )
        finally:
            cursor.close()


class _UnconfiguredSQLite(EngineProfile):
    refusal = (
        "this SQLite engine does not begin transactions with BEGIN IMMEDIATE, so "
        "compare-and-set would not be atomic: create it with "
        "fencing.create_sqlite_engine() or pass it to fencing.configure_sqlite()"
    )


def profile_of(engine: Engine) -> EngineProfile:
    """The profile of ``engine``'s database, as its dialect's glue describes it."""
    database = of(engine.dialect)
    if database.statement_commits(engine.dialect.driver):
        return PostgreSQLProfile(engine.dialect)
    if not database.is_file:
        return EngineProfile()
    settings = sqlite.settings_of(engine)
    return _UnconfiguredSQLite() if settings is None else SQLiteProfile(settings)


def _level(level: object) -> str | None:
    """An isolation level as SQL names it (``REPEATABLE READ``), from psycopg's enum
    (``IsolationLevel.REPEATABLE_READ``) or a driver adapter's string (``repeatable_read``)."""
    if level is None:
        return None
    return str(getattr(level, "name", level)).replace("_", " ").upper()


class Pipe:
    """psycopg's pipeline mode on one driver connection: statements sent together, their
    answers awaited once, when :meth:`pipeline` ends (or a result is fetched). The calls
    the runner makes on it, the same for the sync driver and (:class:`AsyncPipe`) the
    async one."""

    def __init__(self, driver_connection: Any) -> None:
        #: the psycopg connection itself (which SQLAlchemy's async adapter wraps)
        self.raw: Any = driver_connection

    def pipeline(self) -> contextlib.AbstractContextManager[Any]:
        return self.raw.pipeline()  # type: ignore[no-any-return]

    def cursor(self) -> Any:
        return self.raw.cursor()

    def send(self, cursor: Any, sql: str, args: Any = None) -> None:
        cursor.execute(sql, args)

    def command(self, sql: str) -> None:
        self.raw.execute(sql)

    def begin(self) -> str:
        """``BEGIN`` as psycopg itself would send it on this connection: with the isolation
        level, read-only and deferrable modes the engine set on it (``create_engine(
        isolation_level=...)`` sets them on every connection it makes)."""
        raw = self.raw
        sql = "BEGIN"
        level = _level(raw.isolation_level)
        if level is not None:
            sql += f" ISOLATION LEVEL {level}"
        if raw.read_only is not None:
            sql += " READ ONLY" if raw.read_only else " READ WRITE"
        if raw.deferrable is not None:
            sql += " DEFERRABLE" if raw.deferrable else " NOT DEFERRABLE"
        return sql

    def fetchall(self, cursor: Any) -> list[Any]:
        return cursor.fetchall()  # type: ignore[no-any-return]

    def idle(self) -> bool:
        """No transaction open on the server (libpq's PQTRANS_IDLE)."""
        return bool(self.raw.info.transaction_status == 0)


class AsyncPipe(Pipe):
    """:class:`Pipe` on psycopg's async connection under SQLAlchemy's adapter, run inside
    the bridge (each call awaited with ``await_only``): the adapter's own cursor fetches a
    statement's rows as it runs it, which a pipeline defers, so the pipe works on the
    psycopg connection the adapter wraps."""

    @contextlib.contextmanager
    def pipeline(self) -> Iterator[Any]:
        from .private_sqlalchemy import await_only

        manager = self.raw.pipeline()
        entered = await_only(manager.__aenter__())
        try:
            yield entered
        except BaseException as exc:
            if not await_only(manager.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            await_only(manager.__aexit__(None, None, None))

    def send(self, cursor: Any, sql: str, args: Any = None) -> None:
        from .private_sqlalchemy import await_only

        await_only(cursor.execute(sql, args))

    def command(self, sql: str) -> None:
        from .private_sqlalchemy import await_only

        await_only(self.raw.execute(sql))

    def fetchall(self, cursor: Any) -> list[Any]:
        from .private_sqlalchemy import await_only

        return await_only(cursor.fetchall())
