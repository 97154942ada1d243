"""The store: runs the compare-and-set statements and returns plain values.

It is the only place that opens transactions. Every operation can instead run on a
``Connection`` the caller holds (``conn=``), inside the caller's transaction, so the
application can commit its own writes together with ours.

``now`` is the caller's clock (a finite number) or ``None``: the database server's clock,
read inside the same statement (see :mod:`fencing._sql.clock`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, Table

from .._errors import InvalidArgumentType
from .._runtime.execution import CallerConnection, Executor
from .._runtime.metrics import StoreMetrics
from .._sql.attempts import check_attempts_table
from .._sql.checks import check_sync_engine
from .._sql.failures import Failure, check_failures_table
from .._sql.payloads import check_payloads_table, decode_payload
from .._sql.schema import ensure_jobs_table, jobs
from .._sql.statements import ClaimGuard
from .batches import WorkerBatches
from .context import JobsContext
from .fenced import FencedBlocks
from .history import History, HistoryEntry
from .leases import LeaseOperations

__all__ = ["JobStore"]


class JobStore(LeaseOperations, WorkerBatches, FencedBlocks):
    """Leases and fenced writes on one jobs ``table``, through ``engine``.

    The store is a guest in the engine: every transaction it runs takes a connection from
    the engine's pool and gives it back, is seen by the engine's logging and connection
    events, and never changes how the application's own transactions begin or end. A SQLite
    engine must come from :func:`fencing.create_sqlite_engine` or have been passed through
    :func:`fencing.configure_sqlite` (``BEGIN IMMEDIATE`` for the store's transactions, WAL,
    busy timeout). PostgreSQL (psycopg) and MariaDB/MySQL (pymysql) engines are used as they
    are. Refused (:class:`ConfigurationError`): ``isolation_level="AUTOCOMMIT"`` on a server,
    and pools that share one connection between transactions (``StaticPool``,
    ``SingletonThreadPool``, ``AssertionPool``).
    """

    def __init__(
        self,
        engine: Engine,
        table: Table = jobs,
        *,
        history: History | None = None,
        attempts: Table | None = None,
        payloads: Table | None = None,
        failures: Table | None = None,
        _bridged: bool = False,
    ) -> None:
        # _bridged: the sync rules behind an async front (fencing.asyncio), the only way an
        # asyncio driver's engine is taken
        check_sync_engine(engine, instead="fencing.asyncio.AsyncJobStore")
        if not isinstance(table, Table):
            raise InvalidArgumentType(f"table must be a sqlalchemy Table, got {type(table).__name__}")
        if history is not None and not isinstance(history, History):
            raise InvalidArgumentType(
                f"history must be a fencing.History (around a history table), got {type(history).__name__}"
            )
        attempts = check_attempts_table(attempts)
        payloads = check_payloads_table(payloads)
        failures = check_failures_table(failures)
        #: what every part of the store shares: the runner, the dialect's plan, the checks,
        #: the statements on both clocks, the holds and the history's hook
        self._ctx = JobsContext(
            engine,
            table,
            bridged=_bridged,
            history=history,
            claim_guard=self._claim_guard(),
            freed_notice=self._freed_notice(),
            attempts=attempts,
            payloads=payloads,
            failures=failures,
        )
        self.engine = engine
        self.table = table
        #: how this store records ownership history (fencing._store.history), if it does
        self.history_config = history
        #: where :meth:`requeue` keeps a job's attempts base (:func:`fencing.attempts_table`);
        #: ``None``: this store does not requeue
        self.attempts = attempts
        #: where each job's payload is kept (:func:`fencing.payloads_table`): ``enqueue(payload=)``
        #: writes it, every claim hands it out as :attr:`Lease.payload`; ``None``: no payloads
        self.payloads = payloads
        #: where each job's last failure is kept (:func:`fencing.failures_table`):
        #: ``release(failure=)`` writes it, :meth:`failure` reads it; ``None``: none kept
        self.failures = failures

    def _claim_guard(self) -> ClaimGuard | None:
        """What a claim of one job must also meet, in its WHERE (a subclass's rule: named
        locks refuse a claimer with a waiter queued ahead of it)."""
        return None

    def _freed_notice(self) -> ColumnElement[Any] | None:
        """What a release, revoke or delete RETURNs (a subclass's rule: on PostgreSQL a
        freed lock notifies its waiters)."""
        return None

    @property
    def holds_key(self) -> tuple[str, str]:
        """Where this process's fenced blocks and heartbeats on this table meet
        (:mod:`fencing._runtime.holds`): the database as it says who it is, and the table."""
        return self._ctx.holds_key

    @property
    def metrics(self) -> StoreMetrics:
        """What this store did, by outcome (:mod:`fencing._runtime.metrics`); refused writes
        are also logged."""
        return self._ctx.metrics

    @metrics.setter
    def metrics(self, metrics: StoreMetrics) -> None:
        self._ctx.metrics = self._ctx.runner.metrics = metrics

    @property
    def clock_resolution(self) -> float:
        """How finely the database's clock counts (seconds): a ``now=None`` reading is up to
        this much earlier than the instant it was taken (SQLite 0.001, the servers 1e-6)."""
        return self._ctx.plan.clock_resolution

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<JobStore table={self.table.name!r} engine={url!r}>"

    def check_key(self, value: object, *, name: str, limited: bool = False) -> str:
        """``value`` as this database stores a key exactly (an owner; with ``limited``, a
        job id, within the id column's bytes), else the error an operation raises for it,
        naming ``name`` (an election's ``candidate``, say)."""
        return self._ctx.key(name, value, limited=limited)

    # -- the table -------------------------------------------------------------------------

    def create_table(self, *, conn: CallerConnection | None = None) -> None:
        """Create the jobs table if missing (idempotent); raise if an existing one differs.
        The history, attempts, payloads and failures tables too, if the store has them.

        On MariaDB/MySQL, DDL commits the caller's open transaction (the server does that).
        """

        self._ctx.create(self._ensure_tables, conn, self.table)

    def _ensure_tables(self, conn: Connection) -> None:
        ensure_jobs_table(conn, self.table)
        if self.history_config is not None:
            self.history_config.table.create(conn, checkfirst=True)
        for side in (self.attempts, self.payloads, self.failures):
            if side is not None:
                side.create(conn, checkfirst=True)

    # -- a job's payload and its last failure (fencing._sql.payloads, .failures) ---------

    def payload(self, job_id: str, *, conn: CallerConnection | None = None) -> Any:
        """The payload ``job_id`` was enqueued with (``enqueue(payload=)``), read without
        claiming it; ``None`` for a job without one, or no such job. :class:`ConfigurationError`
        if the store keeps no payloads."""
        ctx = self._ctx
        ctx.require("payload", "payloads")
        params = {"job_id": ctx.job_key("job_id", job_id)}
        stmt = ctx.by_caller.payload_of

        def unit(x: Executor) -> Any:
            rows = x.rows(stmt, params)
            return decode_payload(rows[0][0]) if rows else None

        return ctx.run_jobs(unit, conn, write=False, single=True)

    def failure(self, job_id: str, *, conn: CallerConnection | None = None) -> Failure | None:
        """The last failure a worker handed ``job_id`` back with (``release(failure=)``), or
        ``None`` if it never failed. :class:`ConfigurationError` if the store keeps no failures."""
        ctx = self._ctx
        ctx.require("failure", "failures")
        job_id = ctx.job_key("job_id", job_id)
        stmt = ctx.by_caller.failure_of
        params = {"job_id": job_id}

        def unit(x: Executor) -> Failure | None:
            rows = x.rows(stmt, params)
            return Failure.from_row(job_id, rows[0]) if rows else None

        return ctx.run_jobs(unit, conn, write=False, single=True)

    # -- the ownership history (fencing._store.history) -----------------------------------

    def history(self, job_id: str, *, conn: CallerConnection | None = None) -> list[HistoryEntry]:
        """The ownership history of ``job_id``, oldest first (see :mod:`fencing._store.history`).

        :class:`ConfigurationError` if this store records no history."""
        recorder = self._ctx.require_recorder()
        params = {"job_id": self._ctx.job_key("job_id", job_id)}
        stmt = recorder.read
        return self._ctx.run_jobs(lambda x: recorder.entries(x.rows(stmt, params)), conn, write=False)

    def prune_history(self, *, conn: CallerConnection | None = None) -> int:
        """Delete the history rows older than the retention, on the database's clock: how
        many. The store does this by itself now and then; 0 with ``retention=None``."""
        return self._ctx.prune(conn)
