"""The store: runs the compare-and-set statements and returns plain values.

It is the only place that opens transactions. Every operation can instead run on a
``Connection`` the caller holds (``conn=``), inside the caller's transaction, so the
application can commit its own writes together with ours.

``now`` is the caller's clock (a finite number) or ``None``: the database server's clock,
read inside the same statement (see :mod:`fencing.core.clock`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.sql import Executable

from ..core.checks import (
    FENCE_MAX,
    check_count,
    check_database_ttl,
    check_fence,
    check_now,
    check_result,
    check_text,
    check_time,
    check_ttl,
    check_until,
    fence_can_match,
    show_value,
)
from ..core.clock import RESOLUTION
from ..core.errors import (
    ConfigurationError,
    DatabaseBusy,
    DatabaseError,
    FencesExhausted,
    FencingError,
    InvalidArgument,
    InvalidArgumentType,
    LeaseLost,
)
from ..core.values import JobState, Lease
from ..engine import forks
from ..observe import events
from ..observe.metrics import StoreMetrics
from ..observe.refusals import Refusal, judge, never_current, report
from ..runtime import holds
from ..runtime.execution import CallerConnection, CoreExecutor, Executor, Runner, forked_away
from ..sql.dberrors import (
    DB_ERRORS,
    is_duplicate_key,
    is_transient,
    sqlalchemy_error,
    wrap_database_error,
)
from ..sql.schema import ID_MAX_BYTES, ensure_jobs_table, jobs
from ..sql.statements import COMPLETE_CHUNK, Statements, batch_size
from .history import History, HistoryEntry, Recorder

__all__ = ["JobStore"]

T = TypeVar("T")

logger = logging.getLogger("fencing.store")  # the name operators filter on

#: SQLite: a fenced block that keeps the write lock longer than this fraction of the
#: shortest ``ttl`` the store has seen is logged (every other writer waited for it)
LONG_BLOCK_FRACTION = 0.25


#: more threads than this only queue for the same row lock
CLAIM_MANY_MAX_THREADS = 32


class JobStore:
    """Leases and fenced writes on one jobs ``table``, through ``engine``.

    The store is a guest in the engine: every transaction it runs takes a connection from
    the engine's pool and gives it back, is seen by the engine's logging and connection
    events, and never changes how the application's own transactions begin or end. A SQLite
    engine must come from :func:`fencing.sqlite.create_engine` or have been passed through
    :func:`fencing.sqlite.configure` (``BEGIN IMMEDIATE`` for the store's transactions, WAL,
    busy timeout). PostgreSQL (psycopg) and MariaDB/MySQL (pymysql) engines are used as they
    are. Refused (:class:`ConfigurationError`): ``isolation_level="AUTOCOMMIT"`` on a server,
    and pools that share one connection between transactions (``StaticPool``,
    ``SingletonThreadPool``, ``AssertionPool``).
    """

    #: whether this is the sync rules behind an async front (:mod:`fencing.asyncio`), the
    #: only way an asyncio driver's engine is taken
    async_front = False

    def __init__(self, engine: Engine, table: Table = jobs, *, history: History | None = None) -> None:
        if not isinstance(engine, Engine):
            raise InvalidArgumentType(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
        if not isinstance(table, Table):
            raise InvalidArgumentType(f"table must be a sqlalchemy Table, got {type(table).__name__}")
        if history is not None and not isinstance(history, History):
            raise InvalidArgumentType(
                f"history must be a fencing.History (around a history table), got {type(history).__name__}"
            )
        dialect = engine.dialect
        self._runner = Runner.admit(engine, bridged=self.async_front)
        self.engine = engine
        self.table = table
        #: what a database call can raise here
        self._errors = self._runner.errors
        self._by_caller = Statements(table, "caller")
        self._by_database = Statements(table, "database")
        self._returning = bool(getattr(dialect, "update_returning", False))
        self._sqlite = dialect.name == "sqlite"
        self._postgresql = dialect.name == "postgresql"
        self._max_id_bytes = ID_MAX_BYTES.get(dialect.name)
        self._nul_ok = dialect.name != "postgresql"  # PostgreSQL text cannot hold U+0000
        self._enqueue = self._enqueue_unit(dialect.name)
        #: how complete_many reaches the database: one UPDATE ... FROM unnest(arrays) RETURNING
        #: (PostgreSQL, one statement text for every batch size), a locking read and one
        #: joined UPDATE (MariaDB/MySQL, no RETURNING), or an UPDATE per completion (SQLite,
        #: where a statement costs no round trip)
        self._batch_completion = {"postgresql": "returning", "mysql": "locking", "mariadb": "locking"}.get(
            dialect.name, "each"
        )
        #: where this process's fenced blocks and heartbeats on this table meet (fencing.runtime.holds)
        self.holds_key = holds.store_key(engine, table)
        #: the shortest ttl seen (SQLite: a fenced block holding the write lock longer than a
        #: fraction of it is logged)
        self._shortest_ttl = float("inf")
        #: how this store records ownership history (fencing.store.history), if it does
        self.history_config = history
        self._history = None if history is None else Recorder(history, table)
        #: what this store did, by outcome (fencing.observe.metrics); refused writes are also logged
        self.metrics = self._runner.metrics = StoreMetrics()

    @property
    def clock_resolution(self) -> float:
        """How finely the database's clock counts (seconds): a ``now=None`` reading is up to
        this much earlier than the instant it was taken (SQLite 0.001, the servers 1e-6)."""
        return RESOLUTION.get(self.engine.dialect.name, 1e-3)

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<JobStore table={self.table.name!r} engine={url!r}>"

    # -- running units of work -------------------------------------------------------------

    def _run(
        self,
        unit: Callable[[Executor], T],
        conn: CallerConnection | None,
        *,
        write: bool = True,
        job: str | None = None,
    ) -> T:
        try:
            try:
                if conn is None:
                    if holds.HELD[0] and (write or not self._sqlite):
                        self._refuse_self_wait(job)
                    answer = self._runner.run(unit, write=write, job=job)
                    if write and self._history is not None and not holds.HELD[0] and self._history.due():
                        self._prune_quietly()
                else:
                    answer = unit(CoreExecutor(self._runner.caller(conn, self.table)))
            except self._errors as exc:
                self._fail(exc)
        except DatabaseBusy as exc:
            events.busy(exc, job, self.table.name, self.metrics)
            raise
        return answer

    def _refuse_self_wait(self, job: str | None) -> None:
        """Refuse, at once, an operation on a connection of its own that would wait for a
        lock this thread holds in a fenced block (SQLite: any write; servers: that job)."""
        if job is None and not self._sqlite:
            return
        blocking = holds.held_here(self.holds_key, None if self._sqlite else job)
        if blocking is None:
            return
        what = "the database's write lock" if self._sqlite else f"job {job!r}'s row"
        raise ConfigurationError(
            f"a fenced block (or a check(conn=)) of this thread holds {what} until its transaction "
            "ends: this operation would wait for it forever; pass conn= (the block's connection) "
            "or run it after the block"
        )

    def _fail(self, exc: BaseException) -> NoReturn:
        """Raise the library's error for a database error, as SQLAlchemy would wrap it."""
        raise wrap_database_error(exc, self.table.name) from sqlalchemy_error(exc, self.engine.dialect)

    # -- arguments -------------------------------------------------------------------------

    def _key(self, name: str, value: object) -> str:
        """A job id or owner this backend can store exactly (else an error, never truncation)."""
        text = check_text(name, value)
        if not self._nul_ok and "\x00" in text:
            raise InvalidArgument(f"{name} contains NUL (U+0000), which PostgreSQL text cannot store")
        limit = self._max_id_bytes if name == "job_id" else None
        if limit is not None and len(text) * 4 > limit and len(text.encode("utf-8")) > limit:
            raise InvalidArgument(
                f"job_id is {len(text.encode('utf-8'))} bytes in UTF-8; "
                f"{self.engine.dialect.name} keys hold at most {limit}"
            )
        return text

    def _result(self, result: object) -> str | None:
        checked = check_result(result)
        if checked is not None and not self._nul_ok and "\x00" in checked:
            raise InvalidArgument("result contains NUL (U+0000), which PostgreSQL text cannot store")
        return checked

    def _lease(self, lease: object) -> tuple[str, str, int]:
        if not isinstance(lease, Lease):
            raise InvalidArgumentType(f"lease must be a fencing.Lease, got {type(lease).__name__} {lease!r}")
        return self._key("job_id", lease.job_id), self._key("owner", lease.owner), check_fence(lease.fence)

    def _clock(
        self, now: object, ttl: object | None = None, *, name: str = "ttl"
    ) -> tuple[Statements, dict[str, Any]]:
        """The statements for whose clock ``now`` names, and its bind parameters. ``ttl`` (a
        duration called ``name``) is at least DATABASE_CLOCK_MIN_TTL on the database's clock."""
        if ttl is None:
            return (self._by_database, {}) if now is None else (self._by_caller, {"now": check_now(now)})
        ttl_s = check_ttl(ttl, name=name) if now is not None else check_database_ttl(ttl, name=name)
        if name == "ttl" and ttl_s < self._shortest_ttl:
            self._shortest_ttl = ttl_s  # a lease's length: what a long SQLite block is measured against
        if now is None:
            return self._by_database, {"ttl": ttl_s}
        now_s = check_now(now)
        return self._by_caller, {"now": now_s, "new_until": check_until(now_s, ttl_s)}

    # -- the table -------------------------------------------------------------------------

    def create_table(self, *, conn: CallerConnection | None = None) -> None:
        """Create the jobs table if missing (idempotent); raise if an existing one differs.

        On MariaDB/MySQL, DDL commits the caller's open transaction (the server does that).
        """

        try:
            if conn is not None:
                self._ensure_tables(self._runner.caller(conn, self.table))
                return
            for attempt in range(2):
                try:
                    with self._runner.transaction() as own:
                        self._ensure_tables(own)
                    return
                except DB_ERRORS as exc:
                    # two creators raced past IF NOT EXISTS (PostgreSQL's catalog says so)
                    if attempt or not (is_duplicate_key(exc) or is_transient(exc)):
                        raise
        except self._errors as exc:
            self._fail(exc)

    def _ensure_tables(self, conn: Connection) -> None:
        ensure_jobs_table(conn, self.table)
        if self.history_config is not None:
            self.history_config.table.create(conn, checkfirst=True)

    # -- the ownership history (fencing.store.history) --------------------------------------------

    def history(self, job_id: str, *, conn: CallerConnection | None = None) -> list[HistoryEntry]:
        """The ownership history of ``job_id``, oldest first (see :mod:`fencing.store.history`).

        :class:`ConfigurationError` if this store records no history."""
        recorder = self._recorder()
        params = {"job_id": self._key("job_id", job_id)}
        stmt = recorder.read
        return self._run(lambda x: recorder.entries(x.rows(stmt, params)), conn, write=False)

    def prune_history(self, *, conn: CallerConnection | None = None) -> int:
        """Delete the history rows older than the retention, on the database's clock: how
        many. The store does this by itself now and then; 0 with ``retention=None``."""
        recorder = self._recorder()
        retention = recorder.history.retention
        if retention is None:
            return 0
        stmt, params = recorder.prune, {"retention": retention}
        return self._run(lambda x: x.count(stmt, params), conn)

    def _recorder(self) -> Recorder:
        if self._history is None:
            raise ConfigurationError(
                "this store records no history: JobStore(engine, table, history=fencing.History(...))"
            )
        return self._history

    def _prune_quietly(self) -> None:
        """The automatic prune: a failure is logged (the next one tries again), never raised
        over the operation that was due to run it."""
        try:
            pruned = self.prune_history()
        except FencingError:
            logger.warning("pruning the ownership history failed; it is tried again later", exc_info=True)
            return
        if pruned:
            logger.debug("pruned %d history rows", pruned, extra={"path": "prune", "rows": pruned})

    # -- the contract's operations --------------------------------------------------------

    def _enqueue_unit(self, dialect: str) -> Callable[[Executor, Statements, dict[str, Any]], bool]:
        if dialect == "sqlite":
            return lambda x, s, p: x.count(s.enqueue_sqlite, p) == 1
        if dialect == "postgresql":
            return lambda x, s, p: len(x.rows(s.enqueue_postgresql, p)) == 1
        errors = self._errors

        def plain(x: Executor, s: Statements, p: dict[str, Any]) -> bool:
            try:
                return x.count(s.enqueue_plain, p) == 1
            except errors as exc:
                # MariaDB/MySQL: the duplicate key means "exists"; only this statement is
                # undone and the transaction goes on: bring back a tombstone, if it is one
                if is_duplicate_key(exc):
                    return x.count(s.revive, p) == 1
                raise

        return plain

    def enqueue(
        self, job_id: str, *, ready_at: float | None = None, conn: CallerConnection | None = None
    ) -> bool:
        """Register ``job_id`` unclaimed; ``False`` (and nothing changed) if it exists.

        ``ready_at``: not claimable before this time on the caller's clock. The default
        ``None`` stamps the database's now, which :meth:`claim_next` (``now=None``) can
        claim at once and which makes it first-come first-served: it takes the jobs that
        have been ready longest first, and jobs ready at the same instant in the order they
        were enqueued on SQLite (the row's ``rowid``), by id on the servers (whose clocks
        count microseconds, so separate enqueues rarely tie). ``ready_at=0`` is the
        contract's row (``service.enqueue``): ready at once on any clock. A
        :meth:`delete`-d id comes back with its fence kept, so it never hands out an old
        token again; on SQLite it keeps its old ``rowid`` too, so among jobs ready at the
        same instant it sits where it was first enqueued.
        """
        job_id = self._key("job_id", job_id)
        params: dict[str, Any]
        if ready_at is None:
            s, params = self._by_database, {"job_id": job_id}
        else:
            s, params = self._by_caller, {"job_id": job_id, "ready_at": check_time("ready_at", ready_at)}
        enqueue = self._enqueue
        return self._run(lambda x: enqueue(x, s, params), conn, job=job_id)

    def state(self, job_id: str, *, conn: CallerConnection | None = None) -> JobState | None:
        """The stored row, read from the database now, or ``None``."""
        params = {"job_id": self._key("job_id", job_id)}
        stmt = self._by_caller.state

        if conn is None:
            # one SELECT is its own snapshot: no transaction, no write lock
            try:
                row = self._runner.read_row(stmt, params)
            except self._errors as exc:
                self._fail(exc)
            return None if row is None else JobState.from_row(row)

        def unit(x: Executor) -> JobState | None:
            rows = x.rows(stmt, params)
            return JobState.from_row(rows[0]) if rows else None

        return self._run(unit, conn)

    def claim(
        self,
        job_id: str,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> Lease | None:
        """Take the lease on ``job_id`` if it is not done and not held (``until <= now``).

        The fence goes up by one and is part of the returned :class:`Lease`; ``None`` for a
        missing, done or held job. :class:`FencesExhausted` (nothing changed) for a job whose
        fence is already 2**63-1, the last one a signed 64-bit fence holds: it can never be
        claimed again, so it is said at once, even while the last lease is held.
        """
        job_id = self._key("job_id", job_id)
        owner = self._key("owner", owner)
        s, clock = self._clock(now, ttl)
        unit = self._claim_unit(s, {"job_id": job_id, "holder": owner, **clock})
        started = time.perf_counter()
        lease = self._run(unit, conn, job=job_id)
        self.metrics.claim(lease, started)
        return lease

    def _claim_unit(self, s: Statements, params: dict[str, Any]) -> Callable[[Executor], Lease | None]:
        job_id, owner = params["job_id"], params["holder"]
        history = self._history
        if self._returning:

            def returning(x: Executor) -> Lease | None:
                rows = x.rows(s.claim_returning, params)
                if rows:
                    lease = Lease(job_id, owner, int(rows[0][0]), float(rows[0][1]))
                    if history is not None:
                        history.leases(x, "claim", [lease], params)
                    return lease
                _refuse_if_exhausted(x, s, job_id)
                return None

            return returning

        def counting(x: Executor) -> Lease | None:
            if x.count(s.claim_counting, params) != 1:
                _refuse_if_exhausted(x, s, job_id)
                return None
            fence, until = x.rows(s.lease_of, params)[0]
            lease = Lease(job_id, owner, int(fence), float(until))
            if history is not None:
                history.leases(x, "claim", [lease], params)
            return lease

        return counting

    def renew(
        self,
        lease: Lease,
        *,
        ttl: float,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> Lease | None:
        """Extend a live lease to ``now + ttl``: the new :class:`Lease`, or ``None``.

        ``None`` when the token is stale (another fence, another owner, done) or the lease
        has already expired (``until <= now``): an expired lease is never revived.
        """
        job_id, owner, fence = self._lease(lease)
        s, clock = self._clock(now, ttl)
        if not fence_can_match(fence):
            return self._refused([never_current("renew", job_id, owner, fence)], None)
        params = {"job_id": job_id, "holder": owner, "token": fence, **clock}
        refused: list[Refusal] = []

        history = self._history

        def renewed(x: Executor) -> Lease | None:
            renewal = self._renewal(x, s, params)
            if renewal is None:
                refused[:] = [self._why(x, s, "renew", params)]
                if history is not None:
                    history.refusals(x, refused, params)
            elif history is not None and history.history.renewals:
                history.leases(x, "renew", [renewal], params)
            return renewal

        renewal = self._run(renewed, conn, job=job_id)
        return self._refused(refused, None) if renewal is None else self._accepted("renew", renewal)

    def _renewal(self, x: Executor, s: Statements, params: dict[str, Any]) -> Lease | None:
        """Renew the lease in ``params``: the new :class:`Lease`, or ``None`` if refused."""
        job_id, owner, fence = params["job_id"], params["holder"], params["token"]
        if "new_until" in params:
            if x.count(s.renew_counting, params) == 1:
                return Lease(job_id, owner, fence, params["new_until"])
        elif self._returning:
            rows = x.rows(s.renew_returning, params)
            if rows:
                return Lease(job_id, owner, fence, float(rows[0][0]))
        elif x.count(s.renew_counting, params) == 1:
            return Lease(job_id, owner, fence, float(x.rows(s.lease_of, params)[0][1]))
        return None

    def complete(
        self,
        lease: Lease,
        result: str | None,
        *,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> bool:
        """Store ``result`` and mark the job done, only under the current, live lease.

        ``False`` (and the stored result untouched) for a late or stale writer.
        """
        job_id, owner, fence = self._lease(lease)
        s, clock = self._clock(now)
        result = self._result(result)
        params = {"job_id": job_id, "holder": owner, "token": fence, "new_result": result, **clock}
        return self._guarded("complete", s, s.complete, params, conn)

    def release(
        self,
        lease: Lease,
        *,
        delay: float | None = None,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> bool:
        """Give the lease back early (``owner = NULL``); the fence is kept.

        Without ``delay`` the job is claimable at once (``until = 0``); with it, not before
        ``now + delay`` (a retry with backoff). ``False`` if the token is stale or done.
        """
        job_id, owner, fence = self._lease(lease)
        clock: dict[str, Any] = {}
        if delay is None:
            s = self._by_caller
            stmt = s.release
            clock = {"now": 0.0}  # release checks no clock; the reason read compares with 0
            # the history's instant: the caller's now, else the database's
            at = {} if now is None else {"now": check_now(now)}
        else:
            s, clock = self._clock(now, delay, name="delay")
            stmt = s.release_later
            at = clock
        params = {"job_id": job_id, "holder": owner, "token": fence, **clock}
        return self._guarded("release", s, stmt, params, conn, at=at)

    def _guarded(
        self,
        path: str,
        s: Statements,
        stmt: Executable,
        params: dict[str, Any],
        conn: CallerConnection | None,
        *,
        at: dict[str, Any] | None = None,
    ) -> bool:
        """Run the guarded write ``stmt`` of one lease: accepted, or refused with its reason
        (read in the same transaction, logged and counted after it). ``at``: the history's
        clock, when it is not the statement's."""
        job_id, owner, fence = params["job_id"], params["holder"], params["token"]
        if not fence_can_match(fence):
            return self._refused([never_current(path, job_id, owner, fence)], False)
        refused: list[Refusal] = []
        history = self._history
        clock = params if at is None else at

        def unit(x: Executor) -> bool:
            if x.count(stmt, params) == 1:
                if history is not None:
                    history.tokens(x, path, [(job_id, owner, fence)], clock)
                return True
            refused[:] = [self._why(x, s, path, params)]
            if history is not None:
                history.refusals(x, refused, clock)
            return False

        if self._run(unit, conn, job=job_id):
            return self._accepted(path, True, (job_id, fence))
        return self._refused(refused, False)

    def _why(self, x: Executor, s: Statements, path: str, params: dict[str, Any]) -> Refusal:
        """The reason the guard refused the lease in ``params`` (its row, read now)."""
        rows = x.rows(s.row_now, params)
        return judge(path, params["job_id"], params["holder"], params["token"], rows[0] if rows else None)

    def _accepted(self, path: str, answer: T, lease: tuple[str, int] | None = None) -> T:
        """Count an accepted write on ``path``; ``lease``: the (job, fence) it ended, if any."""
        self.metrics.accepted(path, lease)
        return answer

    def _refused(self, refusals: list[Refusal], answer: T) -> T:
        report(refusals, self.metrics)
        return answer

    def revoke(self, job_id: str, *, conn: CallerConnection | None = None) -> bool:
        """Take the lease away at once: the fence moves on, so the holder's token is stale
        for every later write; the job is claimable again. ``False`` if missing or done.

        :class:`FencesExhausted` if the job's fence is already 2**63-1: it cannot move on, so
        the holder of that last fence keeps it (nothing changed)."""
        job_id = self._key("job_id", job_id)
        params = {"job_id": job_id}
        s = self._by_caller

        history = self._history

        def unit(x: Executor) -> bool:
            if x.count(s.revoke, params) == 1:
                if history is not None:
                    history.copy(x, "revoke", job_id, {})
                return True
            _refuse_if_exhausted(x, s, job_id)
            return False

        revoked = self._run(unit, conn, job=job_id)
        if revoked:
            self.metrics.ended("revoke", job_id)
            logger.info("revoked the lease on job %r", job_id, extra={"path": "revoke", "job_id": job_id})
        return revoked

    def delete(self, job_id: str, *, conn: CallerConnection | None = None) -> bool:
        """Delete a job. Its row stays as a tombstone that keeps the fence, so an id that
        is enqueued again continues above every fence it ever had. ``False`` if missing."""
        params = {"job_id": self._key("job_id", job_id)}
        stmt = self._by_caller.delete
        history = self._history

        def unit(x: Executor) -> bool:
            if x.count(stmt, params) != 1:
                return False
            if history is not None:
                history.copy(x, "delete", params["job_id"], {})
            return True

        deleted = self._run(unit, conn, job=params["job_id"])
        if deleted:
            self.metrics.ended("delete", params["job_id"])
            logger.info(
                "deleted job %r", params["job_id"], extra={"path": "delete", "job_id": params["job_id"]}
            )
        return deleted

    @contextmanager
    def fenced(
        self,
        lease: Lease,
        *,
        now: float | None = None,
        complete: bool = False,
        result: str | None = None,
        conn: CallerConnection | None = None,
    ) -> Iterator[Any]:
        """A transaction for the application's own writes, fenced by ``lease``.

        Checks that ``lease`` is current and live and locks its row (no one can claim or
        revoke the job until the transaction ends), runs the block, then checks again (with
        ``complete=True`` it completes the job with ``result`` instead). If the lease is not
        current at either check, :class:`LeaseLost` is raised and nothing of the block stays.

        Without ``conn`` the store opens the transaction (``BEGIN IMMEDIATE`` on SQLite),
        yields its ``Connection`` and commits everything together::

            with store.fenced(lease, complete=True, result="paid") as conn:
                conn.execute(invoices.insert().values(job=lease.job_id, total=99))

        With ``conn=`` (your ``Connection`` or ORM ``Session``) the block joins your
        transaction and yields what you passed: the block runs in a SAVEPOINT, which is rolled
        back on ``LeaseLost`` (or any error of the block) and released otherwise; a Session is
        flushed before the final check. Committing is yours, and the row lock lasts until you
        do. On SQLite the first check also takes the write lock (an ``UPDATE`` of the row), so
        the block's writes never fail for a lock race::

            with Session(engine) as session, session.begin():
                with store.fenced(lease, conn=session, complete=True, result="paid"):
                    session.add(Invoice(job=lease.job_id, total=99))

        **The clock at the end.** The final check is made at the moment the block ends on
        either clock: the database's (``now=None``) is read then; the caller's ``now`` is taken
        as the instant :meth:`fenced` was called and advanced by the time the block took
        (``time.monotonic()``). A block that runs past the lease's ``until`` is rolled back
        with :class:`LeaseLost` either way.

        **With a** :class:`~fencing.Heartbeat` **on the lease**, the block's first check also
        extends the lease by the heartbeat's ``ttl`` (in the block's transaction), so the block
        has a whole ``ttl``; the heartbeat sends nothing while the block holds the row, and
        ``heartbeat.stop()`` inside the block returns at once. Inside the block, any other
        operation of this thread that would wait for the block's lock (this job on a server;
        any write on SQLite) is refused with :class:`ConfigurationError` instead of hanging.

        **On SQLite** the block holds the database's write lock from start to end: every
        other writer (claims, renewals, completions of other workers) waits for it. Do the
        slow work before the block and keep only the writes inside it; a block that holds the
        lock longer than a quarter of the shortest ``ttl`` the store has seen is logged (a
        warning on ``fencing.store``).
        """
        entered = time.monotonic()
        job_id, owner, fence = self._lease(lease)
        if not isinstance(complete, bool):
            kind = type(complete).__name__
            raise InvalidArgumentType(f"complete must be a bool, got {kind} {complete!r:.80}")
        s, clock = self._clock(now)
        checked = self._result(result)
        params = {"job_id": job_id, "holder": owner, "token": fence, "new_result": checked, **clock}
        if conn is not None:
            with self._joined(conn, s, params, complete, entered) as yours:
                yield yours
            return
        runner = self._runner
        hold = self._take_hold(job_id, None)
        generation = forks.GENERATION[0]
        ours = True  # whether an error comes from the library's statements, not the block
        ending = False
        lost: LeaseLost | None = None
        try:
            with runner.transaction() as own:
                x = CoreExecutor(own)
                block = self._begin_block(x, s, params, joined=False)
                ours = False
                yield own
                if runner.forked_since(generation):
                    raise forked_away()
                ours = ending = True  # the block ran: the end check, then COMMIT
                self._finish(x, s, params, complete, block, entered)
            block.committed(complete)
            self.metrics.add("fenced.accepted")
        except LeaseLost as exc:
            lost = exc
            raise
        except self._errors as exc:
            if not ours:
                raise  # the block's own statement failed: its error, as it was
            if ending and is_transient(exc):
                # the server rolled the block back at its end check or at COMMIT (e.g. a
                # serialization failure): its writes are the caller's, so only the caller can
                # run them again
                raise DatabaseBusy(
                    "the database rolled the fenced block back at its end (the final check or "
                    "COMMIT lost a lock race or a serialization check): nothing of the block was "
                    "kept; run the block again"
                ) from sqlalchemy_error(exc, self.engine.dialect)
            self._fail(exc)
        finally:
            hold.end()
            if lost is not None and self._history is not None:
                self._record_lost(None, lost)

    def _record_lost(self, x: Executor | None, lost: LeaseLost) -> None:
        """Write a fenced block's refusal to the history after its rollback: on ``x`` (the
        caller's transaction) or in a transaction of the store's own. A failure here is
        logged, never raised over the :class:`LeaseLost`."""
        history = self._history
        if history is None or lost._refusal is None:
            return
        why, clock = lost._refusal
        try:
            if x is not None:
                history.refusals(x, [why], clock)
            else:
                self._run(lambda own: history.refusals(own, [why], clock), None)
        except Exception:  # whatever it was, the LeaseLost is the error to see
            logger.warning(
                "could not record the refused fenced block on job %r in the history",
                why.job_id,
                exc_info=True,
                extra=why.fields(),
            )

    def _take_hold(self, job_id: str, conn: Connection | None) -> holds.Hold:
        """Register a block's hold on ``job_id`` (:mod:`fencing.runtime.holds`), or refuse one this
        thread would wait for itself."""
        try:
            return holds.hold(self.holds_key, job_id, conn, whole=self._sqlite)
        except holds.SelfWait:
            what = "the database's write lock" if self._sqlite else f"job {job_id!r}'s row"
            raise ConfigurationError(
                f"a fenced block (or a check(conn=)) of this thread already holds {what} on another "
                "connection: this block would wait for it forever; nest it with conn= (the outer "
                "block's connection) or run it after the outer block"
            ) from None

    def _begin_block(self, x: Executor, s: Statements, params: dict[str, Any], *, joined: bool) -> _Block:
        """The first check of a fenced block: lock the lease's row, or raise LeaseLost. With
        heartbeats keeping the lease, extend it by their ``ttl`` in the same statement."""
        job_id, owner, fence = params["job_id"], params["holder"], params["token"]
        beats = [
            hb
            for hb in holds.beats(self.holds_key, job_id)
            if (hb.lease.owner, hb.lease.fence) == (owner, fence)
        ]
        sent = time.monotonic()
        renewed = None
        if beats and fence_can_match(fence):
            until = self._extend(x, s, params, max(hb.ttl for hb in beats))
            if until is None:
                self._lost(x, s, "fenced", params, f"is not current{_AT_START}")
            renewed = Lease(job_id, owner, fence, until)
        else:
            self._hold(x, s, params, _AT_START, joined=joined)
        return _Block(beats, renewed, sent)

    def _extend(self, x: Executor, s: Statements, params: dict[str, Any], ttl: float) -> float | None:
        """Renew the lease in the block's transaction: its new ``until``, or ``None``."""
        p = dict(params)
        if "now" in p:
            p["new_until"] = check_until(p["now"], ttl)
        else:
            p["ttl"] = ttl
        if self._returning:
            rows = x.rows(s.renew_returning, p)
            return float(rows[0][0]) if rows else None
        if x.count(s.renew_counting, p) != 1:
            return None
        return float(x.rows(s.lease_of, p)[0][1])

    @contextmanager
    def _joined(
        self, conn: CallerConnection, s: Statements, params: dict[str, Any], complete: bool, entered: float
    ) -> Iterator[Any]:
        """:meth:`fenced` inside the caller's transaction, the block in a SAVEPOINT. The row
        stays held (:mod:`fencing.runtime.holds`) until the caller's transaction ends."""
        try:
            connection = self._runner.caller(conn, self.table)
            x = CoreExecutor(connection)
            self._take_hold(params["job_id"], connection)
            try:
                block = self._begin_block(x, s, params, joined=True)
            except LeaseLost as lost:
                self._record_lost(x, lost)
                raise
            session = None if isinstance(conn, Connection) else conn
            savepoint = (connection if session is None else session).begin_nested()
        except self._errors as exc:
            self._fail(exc)
        generation = forks.GENERATION[0]
        try:
            yield conn
        except BaseException:
            if not self._runner.forked_since(generation):
                with contextlib.suppress(Exception):  # the block's error is the one to see
                    savepoint.rollback()
            raise
        if self._runner.forked_since(generation):
            raise forked_away()
        try:
            if session is not None:
                session.flush()
            self._finish(x, s, params, complete, block, entered)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                savepoint.rollback()
            if isinstance(exc, self._errors):
                self._fail(exc)
            if isinstance(exc, LeaseLost):
                self._record_lost(x, exc)
            raise
        try:
            savepoint.commit()
        except self._errors as exc:
            self._fail(exc)
        self.metrics.add("fenced.accepted")  # the block's part is done; the commit is the caller's

    def _hold(
        self,
        x: Executor,
        s: Statements,
        params: dict[str, Any],
        when: str,
        *,
        joined: bool,
        path: str = "fenced",
    ) -> None:
        """Raise :class:`LeaseLost` unless the lease is current and live; lock its row until
        the transaction ends. On SQLite, in a transaction the store did not begin IMMEDIATE,
        the check is an ``UPDATE`` that takes the database's write lock with it."""
        stmt = s.hold_lease if (joined and self._sqlite) else s.lock_lease
        if not (fence_can_match(params["token"]) and x.rows(stmt, params)):
            self._lost(x, s, path, params, f"is not current{when}")

    def _finish(
        self,
        x: Executor,
        s: Statements,
        params: dict[str, Any],
        complete: bool,
        block: _Block,
        entered: float,
    ) -> None:
        """The end of a fenced block: complete the job, or check the lease once more, at the
        moment the block ends (the caller's ``now`` advanced by the block's duration)."""
        ended = time.monotonic()
        if "now" in params:
            params = {**params, "now": params["now"] + (ended - entered)}
        if self._sqlite:
            self._warn_if_long(params, ended - block.sent)
        if not complete:
            self._hold(x, s, params, " at the end of the fenced block; rolled back", joined=False)
        elif x.count(s.complete, params) != 1:
            self._lost(x, s, "fenced", params, "was lost before completing")
        if self._history is not None:
            token = (params["job_id"], params["holder"], params["token"])
            self._history.tokens(x, "complete" if complete else "fenced", [token], params, path="fenced")

    def _lost(self, x: Executor, s: Statements, path: str, params: dict[str, Any], what: str) -> NoReturn:
        """Raise :class:`LeaseLost` for a fenced block (or a check), its reason logged first."""
        job, owner, token = params["job_id"], params["holder"], params["token"]
        if fence_can_match(token):
            why = self._why(x, s, path, params)
        else:
            why = never_current(path, job, owner, token)
        self._refused([why], None)
        lost = LeaseLost(f"lease on {job!r} (fence {token}) {what}")
        # the block's transaction is rolled back: its history row is written after that
        lost.reason = why.reason
        lost._refusal = (why, {"now": params["now"]} if "now" in params else {})
        raise lost

    def _warn_if_long(self, params: dict[str, Any], held: float) -> None:
        """SQLite: say so when a fenced block kept every other writer waiting too long."""
        shortest = min(
            [self._shortest_ttl, *(hb.ttl for hb in holds.beats(self.holds_key, params["job_id"]))]
        )
        if held > LONG_BLOCK_FRACTION * shortest:
            logger.warning(
                "a fenced block on job %r held SQLite's write lock for %.3f s, more than %.0f%% of "
                "the shortest ttl seen (%.3f s): every other writer waited; do the slow work "
                "before the block",
                params["job_id"],
                held,
                100 * LONG_BLOCK_FRACTION,
                shortest,
                extra={
                    "job_id": params["job_id"],
                    "owner": params["holder"],
                    "fence": params["token"],
                    "held_seconds": held,
                    "shortest_ttl": shortest,
                },
            )

    def check(self, lease: Lease, *, now: float | None = None, conn: CallerConnection | None = None) -> None:
        """Raise :class:`LeaseLost` unless ``lease`` is current and live.

        With ``conn=`` (your ``Connection`` or ORM ``Session``) the check runs in your
        transaction and locks the job's row until it ends, so it stays true until you commit:
        ORM code can fail loud, and roll back its own objects, before writing anything::

            with Session(engine) as session, session.begin():
                store.check(lease, conn=session)   # LeaseLost: the with-block rolls back
                session.add(Invoice(job=lease.job_id, total=99))

        Without ``conn`` it only says whether the lease is current now.
        """
        job_id, owner, fence = self._lease(lease)
        s, clock = self._clock(now)
        params = {"job_id": job_id, "holder": owner, "token": fence, **clock}
        when = ""
        if conn is None:
            self._run(
                lambda x: self._hold(x, s, params, when, joined=False, path="check"),
                None,
                write=False,
                job=job_id,
            )
            return

        def unit(x: Executor) -> None:
            self._hold(x, s, params, when, joined=True, path="check")

        try:
            connection = self._runner.caller(conn, self.table)
        except self._errors as exc:
            self._fail(exc)
        self._take_hold(job_id, connection)  # the row stays locked until the caller's transaction ends
        self._run(unit, connection)

    # -- workers that do not know job ids ---------------------------------------------------

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        limit: int = 1,
        max_attempts: int | None = None,
        conn: CallerConnection | None = None,
    ) -> list[Lease]:
        """Claim up to ``limit`` ready jobs in one transaction; their leases (maybe none).

        Ready: not done, lease expired or never taken, not deferred, and (with
        ``max_attempts``) claimed fewer than that many times, the fence being the attempt
        count. The jobs that have been ready longest come first (by ``until``: enqueue
        time, lease expiry or retry time; with :meth:`enqueue`'s default that is first-come
        first-served), ties by id (the order of the ready index, so the pick walks it from
        its start and stops at ``limit``, at any backlog); the order of the returned list
        is the database's. On PostgreSQL and MariaDB workers
        skip rows another worker is claiming (``FOR UPDATE SKIP LOCKED``); on SQLite
        ``BEGIN IMMEDIATE`` serializes claims.
        """
        unit = self._claim_next_unit(owner, ttl, now, limit, max_attempts, own=conn is None)
        started = time.perf_counter()
        leases = self._run(unit, conn)
        self._claimed(leases, max_attempts, started)
        return leases

    def _claimed(self, leases: list[Lease], max_attempts: int | None, started: float) -> None:
        """Count and time a claim of workers that began at ``started`` (``perf_counter``)."""
        self.metrics.claimed(leases, started)
        if max_attempts is not None and leases:
            events.last_attempts(leases, max_attempts)

    def _claim_next_unit(
        self, owner: object, ttl: object, now: object, limit: object, max_attempts: object, *, own: bool
    ) -> Callable[[Executor], list[Lease]]:
        """The unit of :meth:`claim_next`, its arguments checked; ``own``: it runs in a
        transaction of the store's own."""
        owner = self._key("owner", owner)
        limit = _positive_int("limit", limit)
        max_fence = FENCE_MAX if max_attempts is None else _positive_int("max_attempts", max_attempts)
        s, clock = self._clock(now, ttl)
        params = {"holder": owner, "limit": limit, "max_fence": max_fence, **clock}
        in_claim_order = own and limit > 1 and self._postgresql
        history = self._history

        def returning(x: Executor) -> list[Lease]:
            if in_claim_order:
                x.count(s.walk_in_claim_order, {})
            rows = x.rows(s.claim_next_returning, params)
            leases = [Lease(job_id, owner, int(fence), float(until)) for job_id, fence, until in rows]
            if history is not None:
                history.leases(x, "claim", leases, params)
            return leases

        def picking(x: Executor) -> list[Lease]:
            picked = {job_id: int(fence) for job_id, fence in x.rows(s.pick_ready, params)}
            if not picked:
                return []
            claim, read = s.claim_ids(len(picked))
            both = {**params, **{f"id_{i}": job_id for i, job_id in enumerate(picked)}}
            x.count(claim, both)
            # the pick locked these rows: the UPDATE claimed those now one fence above the pick.
            # Another (no longer ready at the UPDATE's own now) may still carry this owner from
            # an earlier, expired lease: its old fence must not be handed out a second time
            leases = [
                Lease(job_id, owner, int(fence), float(until))
                for job_id, fence, until in x.rows(read, both)
                if int(fence) == picked[job_id] + 1
            ]
            if history is not None:
                history.leases(x, "claim", leases, params)
            return leases

        return returning if self._returning else picking

    def complete_many(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        *,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> list[bool]:
        """:meth:`complete` for each ``(lease, result)``, all in one transaction.

        Each completion is checked on its own (owner, fence, not done, lease live at
        ``now``): a stale one is refused, the others stored; the list says which were
        accepted, in input order. The same lease twice: only the first can be accepted
        (it makes the job done). Every item is checked before anything runs, so a bad one
        raises and changes nothing. On PostgreSQL a batch is one ``UPDATE`` (per
        :data:`~fencing.sql.statements.COMPLETE_CHUNK` completions), on MariaDB/MySQL a read
        that locks the batch's rows and one ``UPDATE``, on SQLite one ``UPDATE`` each (no
        round trips there). With ``now=None`` the servers judge a whole chunk at one
        instant of their clock, SQLite each completion at its own statement's.
        """
        if isinstance(completions, (str, bytes)) or not isinstance(completions, Iterable):
            raise InvalidArgumentType(
                "completions must be an iterable of (lease, result) pairs, "
                f"got {type(completions).__name__} {completions!r:.80}"
            )
        size, unit, refused = self._completions_unit(completions, now)
        accepted = self._run(unit, conn) if unit is not None else set()
        return self._judged(size, accepted, refused)

    def _judged(self, size: int, accepted: set[int], refused: list[Refusal]) -> list[bool]:
        """complete_many's answer, its accepted completions counted and refused ones reported."""
        if accepted:
            self.metrics.add("complete_many.accepted", len(accepted))
        return self._refused(refused, [i in accepted for i in range(size)])

    def _completions_unit(
        self, completions: Iterable[tuple[Lease, str | None]], now: object
    ) -> tuple[int, Callable[[Executor], set[int]] | None, list[Refusal]]:
        """The unit of :meth:`complete_many`, every item checked: how many items there are,
        the unit returning the positions accepted (``None``: none can be), and the list
        the unit fills with the refused ones' reasons (read in its transaction)."""
        s, clock = self._clock(now)
        batch: list[_Completion] = []
        for item in completions:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise InvalidArgumentType(f"completions must hold (lease, result) pairs, got {item!r:.80}")
            lease, result = item
            job_id, owner, fence = self._lease(lease)
            batch.append((job_id, owner, fence, self._result(result)))
        # what goes to the database: the first of identical leases, with a fence that can match
        first: dict[tuple[str, str, int], int] = {}
        todo = [
            i
            for i, (job_id, owner, fence, _) in enumerate(batch)
            if fence_can_match(fence) and first.setdefault((job_id, owner, fence), i) == i
        ]
        refused: list[Refusal] = []
        if not todo:
            refused += [never_current("complete_many", j, o, f) for j, o, f, _ in batch]
            return len(batch), None, refused
        complete = self._complete_many(s, clock, batch, todo)
        history = self._history

        def unit(x: Executor) -> set[int]:
            accepted = complete(x)
            refused[:] = [
                self._why(x, s, "complete_many", {"job_id": j, "holder": o, "token": f, **clock})
                if fence_can_match(f)
                else never_current("complete_many", j, o, f)
                for i, (j, o, f, _) in enumerate(batch)
                if i not in accepted
            ]
            if history is not None:
                tokens = [batch[i][:3] for i in sorted(accepted)]
                history.tokens(x, "complete", tokens, clock, path="complete_many")
                history.refusals(x, [r for r in refused if fence_can_match(r.fence)], clock)
            return accepted

        return len(batch), unit, refused

    def complete_and_claim_next(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        limit: int = 1,
        max_attempts: int | None = None,
        conn: CallerConnection | None = None,
    ) -> tuple[list[bool], list[Lease]]:
        """A worker's step: :meth:`complete_many` of ``completions``, then :meth:`claim_next`
        for ``owner``, in **one** transaction (one commit, so on SQLite one fsync, where the
        two calls take two).

        Returns ``(accepted, leases)``: which completions were accepted, in input order (each
        judged on its own, exactly as :meth:`complete_many` does; a refused one does not stop
        the claim), and the new leases. All arguments are checked before anything runs::

            [lease] = store.claim_next("w", ttl=30) or [None]
            while lease is not None:
                result = work(lease.job_id)
                _, leases = store.complete_and_claim_next([(lease, result)], "w", ttl=30)
                lease = leases[0] if leases else None
        """
        if isinstance(completions, (str, bytes)) or not isinstance(completions, Iterable):
            raise InvalidArgumentType(
                "completions must be an iterable of (lease, result) pairs, "
                f"got {type(completions).__name__} {completions!r:.80}"
            )
        size, complete, refused = self._completions_unit(completions, now)
        claim = self._claim_next_unit(owner, ttl, now, limit, max_attempts, own=conn is None)

        def step(x: Executor) -> tuple[set[int], list[Lease]]:
            accepted = complete(x) if complete is not None else set()
            return accepted, claim(x)

        started = time.perf_counter()
        accepted, leases = self._run(step, conn)
        self._claimed(leases, max_attempts, started)
        return self._judged(size, accepted, refused), leases

    def _complete_many(
        self, s: Statements, clock: dict[str, Any], batch: list[_Completion], todo: list[int]
    ) -> Callable[[Executor], set[int]]:
        """The unit that stores the completions at positions ``todo``: the accepted ones."""
        if self._batch_completion == "each":

            def each(x: Executor) -> set[int]:
                stmt = s.complete
                accepted = set()
                for i in todo:
                    job_id, owner, fence, result = batch[i]
                    params = {"job_id": job_id, "holder": owner, "token": fence, "new_result": result}
                    if x.count(stmt, {**params, **clock}) == 1:
                        accepted.add(i)
                return accepted

            return each

        chunks = _chunks(batch, todo)
        if self._batch_completion == "returning":
            stmt = s.complete_batch_arrays()

            def returning(x: Executor) -> set[int]:
                accepted: set[int] = set()
                for chunk in chunks:
                    rows = x.rows(stmt, {**_completion_arrays(batch, chunk), **clock})
                    accepted.update(int(row[0]) for row in rows)
                return accepted

            return returning

        by_caller = self._by_caller

        def locking(x: Executor) -> set[int]:
            accepted: set[int] = set()
            for chunk in chunks:
                job_ids = list(dict.fromkeys(batch[i][0] for i in chunk))
                size = batch_size(len(job_ids))
                ids = {f"id_{k}": job_ids[k] if k < len(job_ids) else None for k in range(size)}
                rows = x.rows(s.lock_live(size), {**ids, **clock})
                # the rows stay locked until commit: what is current now is current at the UPDATE
                live = {(job_id, owner, int(fence)) for job_id, owner, fence, ok, _ in rows if ok}
                current = [i for i in chunk if batch[i][:3] in live]
                if not current:
                    continue
                size = batch_size(len(current))
                at = clock["now"] if "now" in clock else float(rows[0][4])
                stored = x.count(
                    by_caller.complete_batch_joined(size),
                    {**_completion_params(batch, current, size), "now": at},
                )
                if stored != len(current):
                    raise DatabaseError(
                        f"complete_many: {stored} of {len(current)} locked, current leases were "
                        "stored; the transaction is rolled back"
                    )
                accepted.update(current)
            return accepted

        return locking

    def poisoned(
        self, max_attempts: int, *, now: float | None = None, conn: CallerConnection | None = None
    ) -> list[JobState]:
        """Jobs that :meth:`claim_next` with this ``max_attempts`` skips: not done, not
        held, claimed ``max_attempts`` times or more. Longest ready first."""
        s, clock = self._clock(now)
        params = {"max_fence": _positive_int("max_attempts", max_attempts), **clock}
        stmt = s.poisoned
        return self._run(lambda x: [JobState.from_row(r) for r in x.rows(stmt, params)], conn, write=False)

    def claim_many(
        self, job_id: str, owners: Iterable[str], *, ttl: float, now: float | None = None
    ) -> list[Lease | None]:
        """Race :meth:`claim` for every owner on a thread pool; results in input order.

        On a claimable job exactly one owner gets a lease. Every argument is checked
        before the first claim runs.
        """
        units = self._claim_units(job_id, owners, ttl, now)
        if not units:
            return []
        workers = min(len(units), CLAIM_MANY_MAX_THREADS)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fencing-claim") as pool:
            futures = [pool.submit(self._run_own, unit) for unit in units]
            return [f.result() for f in futures]

    def _claim_units(
        self, job_id: object, owners: object, ttl: object, now: object
    ) -> list[Callable[[Executor], Lease | None]]:
        """:meth:`claim_many`'s units, one per owner, every argument checked first (the
        async store races them as tasks)."""
        job_id = self._key("job_id", job_id)
        if isinstance(owners, (str, bytes)) or not isinstance(owners, Iterable):
            raise InvalidArgumentType(
                f"owners must be an iterable of str, got {type(owners).__name__} {owners!r:.80}"
            )
        owner_list = [self._key("owner", o) for o in owners]
        s, clock = self._clock(now, ttl)
        return [self._claim_unit(s, {"job_id": job_id, "holder": o, **clock}) for o in owner_list]

    def _run_own(self, unit: Callable[[Executor], T]) -> T:
        """Run ``unit`` in a transaction of the store's own (retried, errors mapped)."""
        return self._run(unit, None)


_AT_START = " at the start of the fenced block; rolled back"


class _Block:
    """What a fenced block knows between its checks: the heartbeats keeping its lease, the
    lease as its first check extended it (if it did), and when that check was sent."""

    __slots__ = ("beats", "renewed", "sent")

    def __init__(self, beats: list[Any], renewed: Lease | None, sent: float) -> None:
        self.beats = beats
        self.renewed = renewed
        self.sent = sent

    def committed(self, completed: bool) -> None:
        """The block's transaction committed: tell the heartbeats what it did to the lease."""
        for hb in self.beats:
            if completed:
                hb._completed_by_block()
            elif self.renewed is not None:
                hb._extended(self.renewed, self.sent)


#: job_id, owner, fence, result: one checked item of complete_many
_Completion = tuple[str, str, int, "str | None"]
#: result characters per batch statement: a statement stays far below MariaDB's packet limit
COMPLETE_CHUNK_CHARS = 1 << 20


def _chunks(batch: list[_Completion], todo: list[int]) -> list[list[int]]:
    """``todo`` cut into chunks of at most COMPLETE_CHUNK completions and (past the first
    completion) COMPLETE_CHUNK_CHARS result characters."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    chars = 0
    for i in todo:
        size = len(batch[i][3] or "")
        if chunk and (len(chunk) == COMPLETE_CHUNK or chars + size > COMPLETE_CHUNK_CHARS):
            chunks.append(chunk)
            chunk, chars = [], 0
        chunk.append(i)
        chars += size
    chunks.append(chunk)
    return chunks


def _completion_params(batch: list[_Completion], chunk: list[int], size: int) -> dict[str, Any]:
    """The bind parameters of a batch statement of ``size`` for the completions at ``chunk``;
    the rows past them are NULLs, which match no job."""
    params: dict[str, Any] = {}
    padding = (None, None, None, None, None)
    for k, names in enumerate(_completion_binds(size)):
        row = (chunk[k], *batch[chunk[k]]) if k < len(chunk) else padding
        params.update(zip(names, row, strict=True))
    return params


def _completion_arrays(batch: list[_Completion], chunk: list[int]) -> dict[str, Any]:
    """The five arrays :meth:`Statements.complete_batch_arrays` binds, for ``chunk``."""
    rows = [batch[i] for i in chunk]
    return {
        "ns": chunk,
        "ids": [r[0] for r in rows],
        "holders": [r[1] for r in rows],
        "tokens": [r[2] for r in rows],
        "results": [r[3] for r in rows],
    }


@functools.lru_cache(maxsize=16)
def _completion_binds(size: int) -> tuple[tuple[str, str, str, str, str], ...]:
    """The names :meth:`Statements.complete_batch_joined` and :meth:`Statements.lock_live`
    bind, per row."""
    return tuple((f"n_{k}", f"id_{k}", f"holder_{k}", f"token_{k}", f"result_{k}") for k in range(size))


def _positive_int(name: str, value: object) -> int:
    return check_count(name, value)


def _refuse_if_exhausted(x: Executor, s: Statements, job_id: str) -> None:
    """After a claim or revoke matched nothing: raise :class:`FencesExhausted` if that is
    because the job's fence is at 2**63-1 (its guard, ``fence < 2**63-1``, is in the WHERE)."""
    if x.rows(s.exhausted, {"job_id": job_id}):
        raise FencesExhausted(
            f"job {show_value(job_id)} has handed out its last fence ({FENCE_MAX}, 2**63-1): "
            "it can never be claimed or revoked again"
        )
