"""The store: runs the compare-and-set statements and returns plain values.

It is the only place that opens transactions. Every operation can instead run on a
``Connection`` the caller holds (``conn=``), inside the caller's transaction, so the
application can commit its own writes together with ours.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Table
from sqlalchemy import exc as sa_exc

from . import sqlite as sqlite_glue
from .checks import (
    check_fence,
    check_now,
    check_result,
    check_text,
    check_ttl,
    check_until,
    fence_can_match,
)
from .errors import (
    ConfigurationError,
    DatabaseError,
    FencingError,
    InvalidArgumentType,
    TableMissing,
)
from .execution import CoreExecutor, Executor, SQLiteDriverPath
from .schema import ensure_jobs_table, jobs
from .statements import Statements
from .values import JobState, Lease

__all__ = ["JobStore", "database_errors", "wrap_database_error"]

T = TypeVar("T")

#: more threads than this only queue for the same row lock
CLAIM_MANY_MAX_THREADS = 32


class JobStore:
    """Leases and fenced writes on one jobs ``table``, through ``engine``.

    A SQLite engine must come from :func:`fencing.sqlite.create_engine` or have been
    passed through :func:`fencing.sqlite.configure` (``BEGIN IMMEDIATE``, WAL, busy timeout).
    """

    def __init__(self, engine: Engine, table: Table = jobs) -> None:
        if not isinstance(engine, Engine):
            raise InvalidArgumentType(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
        self.engine = engine
        self.table = table
        self.statements = s = Statements(table)
        self._driver: SQLiteDriverPath | None = None
        dialect = engine.dialect
        if dialect.name == "sqlite":
            settings = sqlite_glue.settings_of(engine)
            if settings is None:
                raise ConfigurationError(
                    "this SQLite engine does not begin transactions with BEGIN IMMEDIATE, so "
                    "compare-and-set would not be atomic: create it with "
                    "fencing.sqlite.create_engine() or pass it to fencing.sqlite.configure()"
                )
            self._driver = SQLiteDriverPath(engine, settings.begin_sql)
            self._enqueue = s.enqueue_sqlite
        elif dialect.name == "postgresql":
            self._enqueue = s.enqueue_postgresql
        else:
            self._enqueue = s.enqueue_portable
        self._claim_returning = bool(getattr(dialect, "update_returning", False))

    def __repr__(self) -> str:
        return f"<JobStore table={self.table.name!r} engine={self.engine.url.render_as_string()!r}>"

    # -- running units of work -------------------------------------------------------------

    def _run(self, unit: Callable[[Executor], T], conn: Connection | None) -> T:
        try:
            if conn is None:
                if self._driver is not None:
                    return self._driver.run(unit)
                with self.engine.begin() as own:
                    return unit(CoreExecutor(own))
            if not isinstance(conn, Connection):
                raise InvalidArgumentType(
                    f"conn must be a sqlalchemy Connection or None, got {type(conn).__name__}"
                )
            return unit(CoreExecutor(conn))
        except (sa_exc.SQLAlchemyError, sqlite3.Error) as exc:
            raise wrap_database_error(exc, self.table) from exc

    def dispose(self) -> None:
        """Close the connections the store holds (the engine's pool is the caller's)."""
        if self._driver is not None:
            self._driver.close()

    # -- the table -------------------------------------------------------------------------

    def create_table(self, *, conn: Connection | None = None) -> None:
        """Create the jobs table if missing (idempotent); raise if an existing one differs."""
        with database_errors(self.table):
            if conn is not None:
                ensure_jobs_table(conn, self.table)
                return
            with self.engine.begin() as own:
                ensure_jobs_table(own, self.table)

    # -- the contract's operations --------------------------------------------------------

    def enqueue(self, job_id: str, *, conn: Connection | None = None) -> bool:
        """Register ``job_id`` unclaimed; ``False`` (and nothing changed) if it exists."""
        params = {"job_id": check_text("job_id", job_id)}
        stmt = self._enqueue

        def unit(x: Executor) -> bool:
            return x.count(stmt, params) == 1

        if stmt is self.statements.enqueue_portable:
            return self._enqueue_portable(unit, conn)
        return self._run(unit, conn)

    def _enqueue_portable(self, unit: Callable[[Executor], bool], conn: Connection | None) -> bool:
        # a concurrent enqueue of the same id can pass NOT EXISTS and then hit the key
        try:
            if conn is not None:
                with conn.begin_nested():
                    return self._run(unit, conn)
            return self._run(unit, None)
        except DatabaseError as exc:
            if isinstance(exc.__cause__, sa_exc.IntegrityError):
                return False
            raise

    def state(self, job_id: str, *, conn: Connection | None = None) -> JobState | None:
        """The stored row, read from the database now, or ``None``."""
        params = {"job_id": check_text("job_id", job_id)}
        stmt = self.statements.state

        def unit(x: Executor) -> JobState | None:
            rows = x.rows(stmt, params)
            return JobState.from_row(rows[0]) if rows else None

        return self._run(unit, conn)

    def claim(
        self, job_id: str, owner: str, *, now: float, ttl: float, conn: Connection | None = None
    ) -> Lease | None:
        """Take the lease on ``job_id`` if it is not done and not held (``until <= now``).

        The fence goes up by one and is part of the returned :class:`Lease`; ``None`` for a
        missing, done or held job.
        """
        job_id = check_text("job_id", job_id)
        owner = check_text("owner", owner)
        return self._claim_checked(job_id, owner, check_now(now), check_ttl(ttl), conn)

    def _claim_checked(
        self, job_id: str, owner: str, now: float, ttl: float, conn: Connection | None
    ) -> Lease | None:
        until = check_until(now, ttl)
        params = {"job_id": job_id, "owner": owner, "now": now, "until": until}
        s = self.statements

        def returning(x: Executor) -> Lease | None:
            rows = x.rows(s.claim_returning, params)
            return Lease(job_id, owner, int(rows[0][0]), float(rows[0][1])) if rows else None

        def counting(x: Executor) -> Lease | None:
            if x.count(s.claim_counting, params) != 1:
                return None
            fence, stored_until = x.rows(s.claimed_by, params)[0]
            return Lease(job_id, owner, int(fence), float(stored_until))

        return self._run(returning if self._claim_returning else counting, conn)

    def renew(self, lease: Lease, *, now: float, ttl: float, conn: Connection | None = None) -> Lease | None:
        """Extend a live lease to ``now + ttl``: the new :class:`Lease`, or ``None``.

        ``None`` when the token is stale (another fence, another owner, done) or the lease
        has already expired (``until <= now``): an expired lease is never revived.
        """
        job_id, owner, fence = _token(lease)
        until = check_until(check_now(now), check_ttl(ttl))
        if not fence_can_match(fence):
            return None
        params = {"job_id": job_id, "owner": owner, "fence": fence, "now": now, "until": until}
        stmt = self.statements.renew

        def unit(x: Executor) -> Lease | None:
            return Lease(job_id, owner, fence, until) if x.count(stmt, params) == 1 else None

        return self._run(unit, conn)

    def complete(
        self, lease: Lease, result: str | None, *, now: float, conn: Connection | None = None
    ) -> bool:
        """Store ``result`` and mark the job done, only under the current, live lease.

        ``False`` (and the stored result untouched) for a late or stale writer.
        """
        job_id, owner, fence = _token(lease)
        params = {
            "job_id": job_id,
            "owner": owner,
            "fence": fence,
            "now": check_now(now),
            "result": check_result(result),
        }
        if not fence_can_match(fence):
            return False
        stmt = self.statements.complete
        return self._run(lambda x: x.count(stmt, params) == 1, conn)

    def release(self, lease: Lease, *, conn: Connection | None = None) -> bool:
        """Give the lease back early (``owner = NULL``, ``until = 0``); the fence is kept."""
        job_id, owner, fence = _token(lease)
        if not fence_can_match(fence):
            return False
        params = {"job_id": job_id, "owner": owner, "fence": fence}
        stmt = self.statements.release
        return self._run(lambda x: x.count(stmt, params) == 1, conn)

    def claim_many(self, job_id: str, owners: Iterable[str], *, now: float, ttl: float) -> list[Lease | None]:
        """Race :meth:`claim` for every owner on a thread pool; results in input order.

        On a claimable job exactly one owner gets a lease. Every argument is checked
        before the first claim runs.
        """
        job_id = check_text("job_id", job_id)
        if isinstance(owners, (str, bytes)):
            raise InvalidArgumentType(
                f"owners must be an iterable of str, not a single {type(owners).__name__}"
            )
        owner_list = [check_text("owners[]", o) for o in owners]
        now_f, ttl_f = check_now(now), check_ttl(ttl)
        check_until(now_f, ttl_f)
        if not owner_list:
            return []
        workers = min(len(owner_list), CLAIM_MANY_MAX_THREADS)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fencing-claim") as pool:
            futures = [pool.submit(self._claim_checked, job_id, o, now_f, ttl_f, None) for o in owner_list]
            return [f.result() for f in futures]


def _token(lease: object) -> tuple[str, str, int]:
    if not isinstance(lease, Lease):
        raise InvalidArgumentType(f"lease must be a fencing.Lease, got {type(lease).__name__} {lease!r}")
    return (
        check_text("job_id", lease.job_id),
        check_text("owner", lease.owner),
        check_fence(lease.fence),
    )


def wrap_database_error(exc: BaseException, table: Table = jobs) -> FencingError:
    """The library's error for a driver or SQLAlchemy error (which stays the ``__cause__``)."""
    orig: Any = getattr(exc, "orig", None) or exc
    message = str(orig)
    if "no such table" in message or ("does not exist" in message and table.name in message):
        return TableMissing(
            f"table {table.name!r} does not exist; create it first "
            "(JobStore.create_table() or service.init_db())"
        )
    return DatabaseError(f"{type(orig).__name__}: {message}")


@contextmanager
def database_errors(table: Table = jobs) -> Iterator[None]:
    """Driver and SQLAlchemy errors cross into the library as :class:`FencingError`."""
    try:
        yield
    except (sa_exc.SQLAlchemyError, sqlite3.Error) as exc:
        raise wrap_database_error(exc, table) from exc
