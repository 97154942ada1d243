"""What the parts of a store share: the engine's runner, the dialect's plan, the checks of
keys and leases, the clock, and the one way a unit of work runs.

:class:`Context` is what :class:`~fencing.FenceMarks` and :class:`~fencing.JobStore` both
stand on: a unit runs in a transaction of the store's own (retried when it loses a lock
race) or in the caller's (``conn=``), and a database error comes out as the library's own.
:class:`JobsContext` adds what the jobs table's parts (:mod:`.leases`, :mod:`.batches`,
:mod:`.fenced`) need: its statements on both clocks, the holds of this process's fenced
blocks, the refusals' reasons, and the ownership history, recorded by one hook at the end
of each unit, in the unit's transaction (:meth:`JobsContext.run`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, TypeVar

from sqlalchemy import ColumnElement, Connection, Engine, Table
from sqlalchemy.sql import Executable

from .._errors import (
    ConfigurationError,
    DatabaseBusy,
    FencingError,
    InvalidArgument,
    InvalidArgumentType,
    TableMissing,
)
from .._runtime import events, holds, identity
from .._runtime.execution import CallerConnection, CoreExecutor, Executor, Runner
from .._runtime.metrics import StoreMetrics
from .._runtime.refusals import judge, report
from .._sql.channels import channel_of
from .._sql.checks import (
    check_database_ttl,
    check_fence,
    check_now,
    check_result,
    check_text,
    check_ttl,
    check_until,
)
from .._sql.dberrors import DB_ERRORS, is_duplicate_key, is_transient, sqlalchemy_error, wrap_database_error
from .._sql.statements import ClaimGuard, Statements
from .._sql.values import Lease, Refusal
from . import bell
from .announcer import Announcer
from .background import Background
from .dialects import DialectPlan, plan_for
from .history import NO_OUTCOME, PRUNE_BATCH, History, Outcome, Recorder
from .ops import DATABASE, Clock, Guard

__all__ = ["Context", "JobsContext"]

T = TypeVar("T")

logger = logging.getLogger("fencing.store")  # the name operators filter on

#: how many busy timeouts a late refusal's write waits through before it is given up (logged)
LATE_ATTEMPTS = 3


class Context:
    """One store's way to the database: ``engine``'s runner, its dialect's plan and the
    store's metrics. ``create_hint``: how to create a missing table, said in its error."""

    def __init__(self, engine: Engine, *, bridged: bool, create_hint: str | None = None) -> None:
        self.runner = Runner.admit(engine, bridged=bridged)
        self.engine = engine
        #: what a database call can raise here
        self.errors = self.runner.errors
        self.plan: DialectPlan = plan_for(engine.dialect)
        self.create_hint = create_hint
        #: what the store did, by outcome (:mod:`fencing._runtime.metrics`)
        self.metrics = self.runner.metrics = StoreMetrics()

    # -- arguments -------------------------------------------------------------------------

    def key(self, name: str, value: object, *, limited: bool = True) -> str:
        """A key (job id, owner, resource) this backend stores exactly (else an error, never
        a truncation). ``limited``: the key column's byte limit applies to it."""
        text = self.storable(name, check_text(name, value))
        limit = self.plan.max_key_bytes if limited else None
        if limit is not None and len(text) * 4 > limit and len(text.encode("utf-8")) > limit:
            raise InvalidArgument(
                f"{name} is {len(text.encode('utf-8'))} bytes in UTF-8; "
                f"{self.engine.dialect.name} keys hold at most {limit}"
            )
        return text

    def result(self, result: object) -> str | None:
        checked = check_result(result)
        return None if checked is None else self.storable("result", checked)

    def storable(self, name: str, text: str) -> str:
        """``text`` (called ``name``), if this database's text column can hold it as it is."""
        if not self.plan.text_holds_nul and "\x00" in text:
            raise InvalidArgument(f"{name} contains NUL (U+0000), which PostgreSQL text cannot store")
        return text

    # -- running units of work -------------------------------------------------------------

    def run(
        self,
        unit: Callable[[Executor], T],
        conn: CallerConnection | None,
        table: Table,
        *,
        write: bool = True,
        job: str | None = None,
        single: bool = False,
        prelude: Sequence[Executable] = (),
    ) -> T:
        """Run ``unit`` in a transaction of the store's own (``conn=None``) or in the
        caller's; a database error comes out as the library's (``table`` named in it).
        ``single``: the unit writes with its first statement alone; ``prelude``: what sets up
        a transaction of the store's own, never the caller's (:meth:`Runner.run`)."""
        try:
            try:
                if conn is None:
                    self.before_own(write, job)
                    answer = self.runner.run(unit, write=write, job=job, single=single, prelude=prelude)
                    if write:
                        self.after_own()
                else:
                    answer = unit(CoreExecutor(self.runner.caller(conn, table)))
            except self.errors as exc:
                self.fail(exc, table)
        except DatabaseBusy as exc:
            events.busy(exc, job, table.name, self.metrics)
            raise
        return answer

    def create(
        self, create: Callable[[Connection], None], conn: CallerConnection | None, table: Table
    ) -> None:
        """Run ``create`` (DDL with IF NOT EXISTS) in the caller's transaction or in one of
        the store's own, once more if a concurrent creator raced past IF NOT EXISTS
        (PostgreSQL's catalog says so); errors name ``table``."""
        try:
            if conn is not None:
                create(self.runner.caller(conn, table))
                return
            for attempt in range(2):
                try:
                    with self.runner.transaction() as own:
                        create(own)
                    return
                except DB_ERRORS as exc:
                    if attempt or not (is_duplicate_key(exc) or is_transient(exc)):
                        raise
        except self.errors as exc:
            self.fail(exc, table)

    @property
    def holds_key(self) -> holds.Key:
        """Where this process's fenced blocks and heartbeats on the store's rows meet
        (:mod:`fencing._runtime.holds`): the database, as known now (the whole of it here)."""
        return holds.store_key(self.engine, None)

    def known_key(self) -> holds.Key:
        """:attr:`holds_key`, once the server said who it is (one query, once per pool)."""
        identity.resolve(self.engine)
        return self.holds_key

    def before_own(self, write: bool, job: str | None) -> None:
        """Before a transaction of the store's own: refuse one that could never run (a write
        waiting for a fenced block of this thread that holds SQLite's write lock)."""
        if holds.HELD[0] and write and self.plan.locks_whole_database:
            self.refuse_self_wait(None)

    def refuse_self_wait(self, job: str | None) -> None:
        """Refuse, at once, an operation on a connection of its own that would wait for a
        lock this thread holds in a fenced block (SQLite: any write; servers: that job)."""
        whole = self.plan.locks_whole_database
        if job is None and not whole:
            return
        blocking = holds.held_here(self.known_key(), None if whole else job)
        if blocking is None:
            return
        what = "the database's write lock" if whole else f"job {job!r}'s row"
        raise ConfigurationError(
            f"a fenced block (or a check(conn=)) of this thread holds {what} until its transaction "
            "ends: this operation would wait for it forever; pass conn= (the block's connection) "
            "or run it after the block"
        )

    def after_own(self) -> None:
        """After a write of the store's own committed."""

    def fail(self, exc: BaseException, table: Table) -> NoReturn:
        """Raise the library's error for a database error, as SQLAlchemy would wrap it."""
        wrapped = wrap_database_error(exc, table.name, database=self.engine.url.database)
        if self.create_hint is not None and isinstance(wrapped, TableMissing):
            wrapped = TableMissing(
                f"table {table.name!r} does not exist; create it first ({self.create_hint})"
            )
        raise wrapped from sqlalchemy_error(exc, self.engine.dialect)


class JobsContext(Context):
    """The context of one jobs ``table``: its statements on both clocks, this process's
    holds on it, and its ownership history (``history``), if it records one."""

    def __init__(
        self,
        engine: Engine,
        table: Table,
        *,
        bridged: bool,
        history: History | None,
        claim_guard: ClaimGuard | None = None,
        freed_notice: ColumnElement[Any] | None = None,
        attempts: Table | None = None,
        payloads: Table | None = None,
        failures: Table | None = None,
    ) -> None:
        super().__init__(engine, bridged=bridged)
        self.table = table
        #: where a requeue keeps a job's attempts base (:mod:`fencing._sql.attempts`), if anywhere
        self.attempts = attempts
        #: where each job's payload is kept (:mod:`fencing._sql.payloads`), if anywhere
        self.payloads = payloads
        #: where each job's last failure is kept (:mod:`fencing._sql.failures`), if anywhere
        self.failures = failures
        rules: dict[str, Any] = {
            "claim_guard": claim_guard,
            "freed_notice": freed_notice,
            "attempts": attempts,
            "payloads": payloads,
            "failures": failures,
        }
        self.by_caller = Statements(table, "caller", **rules)
        self.by_database = Statements(table, "database", **rules)
        #: the shortest ttl seen (SQLite: a fenced block holding the write lock longer than a
        #: fraction of it is logged)
        self.shortest_ttl = float("inf")
        self.history = history
        #: how the store records its ownership history (:mod:`fencing._store.history`), if it does
        self.recorder = None if history is None else Recorder(history, table)
        #: the automatic prune, off the callers' path (:mod:`fencing._store.background`)
        self.pruner = Background(self.prune_quietly, "history prune")
        #: refusals of blocks that joined a caller's transaction, written off its path in
        #: transactions of the store's own (:meth:`record_late`)
        self.late = Background(self.write_late, "history write")
        self._late: collections.deque[tuple[Refusal, Clock]] = collections.deque()
        #: whether an enqueue tells other processes' waiting claims (PostgreSQL), and on which
        #: channel they listen
        self.announcer = Announcer()
        self.channel = channel_of(table)
        #: the dialect's insert of a new job (the plan's upsert)
        self.enqueue = self.plan.enqueue(self.errors, self.announcer)
        #: the same with the job's payload, and whether that is one statement
        self.enqueue_with_payload = self.plan.enqueue_with_payload(self.errors, self.announcer)
        #: both, leaving a deleted job's tombstone as it is (``enqueue(revive=False)``)
        self.enqueue_new = self.plan.enqueue(self.errors, self.announcer, revive=False)
        self.enqueue_new_with_payload = self.plan.enqueue_with_payload(
            self.errors, self.announcer, revive=False
        )

    # -- arguments -------------------------------------------------------------------------

    def require(self, what: str, side: Literal["payloads", "failures"]) -> None:
        """:class:`ConfigurationError` unless the store has its ``side`` table, which ``what``
        needs (the message names the argument and the function that declares it)."""
        if getattr(self, side) is None:
            raise ConfigurationError(
                f"{what} needs a table for the {side}: JobStore(engine, table, "
                f"{side}=fencing.{side}_table(metadata)), created by store.create_table()"
            )

    def ring(self) -> None:
        """Wake this process's claims waiting for a job of this table (:mod:`.bell`): one of
        this store's own transactions has just made one ready. Nothing to look up in a
        process where no claim has ever waited."""
        if bell.ever_waited():
            bell.ring(holds.store_key(self.engine, self.table))

    def bell_key(self) -> holds.Key:
        """Where this table's waiting claims meet, once the database said who it is."""
        identity.resolve(self.engine)
        return holds.store_key(self.engine, self.table)

    def job_key(self, name: str, value: object) -> str:
        """A job id or owner: only a job id is bounded by the key column's bytes."""
        return self.key(name, value, limited=name == "job_id")

    def lease(self, lease: object) -> Guard:
        """The guard ``lease`` presents, its fields checked."""
        if not isinstance(lease, Lease):
            raise InvalidArgumentType(f"lease must be a fencing.Lease, got {type(lease).__name__} {lease!r}")
        return Guard(
            self.job_key("job_id", lease.job_id),
            self.job_key("owner", lease.owner),
            check_fence(lease.fence),
        )

    def clock(
        self, now: object, ttl: object | None = None, *, name: str = "ttl", records: bool = True
    ) -> tuple[Statements, Clock]:
        """The statements for whose clock ``now`` names, and that clock. ``ttl`` (a duration
        called ``name``) is at least DATABASE_CLOCK_MIN_TTL on the database's clock.
        ``records``: the operation writes history (a write with the caller's ``now`` is refused
        when the history prunes on the database's clock)."""
        if records:
            self.recorded_on(now)
        if ttl is None:
            return (self.by_database, DATABASE) if now is None else (self.by_caller, Clock(check_now(now)))
        ttl_s = check_ttl(ttl, name=name) if now is not None else check_database_ttl(ttl, name=name)
        if name == "ttl" and ttl_s < self.shortest_ttl:
            self.shortest_ttl = ttl_s  # a lease's length: what a long SQLite block is measured against
        if now is None:
            return self.by_database, Clock(ttl=ttl_s)
        now_s = check_now(now)
        return self.by_caller, Clock(now_s, new_until=check_until(now_s, ttl_s))

    def recorded_on(self, now: object) -> None:
        """A write whose history row is on the caller's clock (``now`` given) is refused when
        the history prunes on the database's: the row would be compared with another clock."""
        if now is None or self.recorder is None:
            return
        retention = self.recorder.history.retention
        if retention is not None:
            raise ConfigurationError(
                f"this store's history prunes rows older than {retention:g} s on the database's "
                "clock: a write with now= would be recorded on your clock and compared with the "
                "database's (rows on a clock of your own would be deleted at once); pass now=None, "
                "or keep every row with History(..., retention=None) and prune them yourself"
            )

    # -- running units of work -------------------------------------------------------------

    def outcome(self) -> Outcome:
        """Where a unit notes what the history records: a fresh one, or (no history) one
        that keeps nothing."""
        return NO_OUTCOME if self.recorder is None else Outcome()

    def recorded(self, unit: Callable[[Executor], T], outcome: Outcome) -> Callable[[Executor], T]:
        """``unit``, whose notes in ``outcome`` are recorded in the history at its end, in its
        transaction (each retry notes afresh): the one hook every unit's history goes through."""
        recorder = self.recorder
        if recorder is None or outcome is NO_OUTCOME:
            return unit

        def recorded(x: Executor) -> T:
            outcome.clear()
            answer = unit(x)
            recorder.record(x, outcome)
            return answer

        return recorded

    def record(self, x: Executor, outcome: Outcome) -> None:
        """Record what a unit that runs outside :meth:`run_jobs` (a fenced block) noted."""
        if self.recorder is not None:
            self.recorder.record(x, outcome)

    def run_jobs(
        self,
        unit: Callable[[Executor], T],
        conn: CallerConnection | None,
        *,
        write: bool = True,
        job: str | None = None,
        outcome: Outcome = NO_OUTCOME,
        single: bool = False,
        prelude: Sequence[Executable] = (),
    ) -> T:
        """Run ``unit`` on the jobs table, what it notes in ``outcome`` recorded at its end.
        ``single``: the unit writes with its first statement alone, so without a history to
        write in the same transaction it may be that statement's own (one round trip);
        ``prelude``: what sets up a transaction of the store's own (:meth:`run`)."""
        single = single and outcome is NO_OUTCOME
        return self.run(
            self.recorded(unit, outcome),
            conn,
            self.table,
            write=write,
            job=job,
            single=single,
            prelude=prelude,
        )

    @property
    def holds_key(self) -> holds.Key:
        """Where this process's fenced blocks and heartbeats on this table meet."""
        return holds.store_key(self.engine, self.table)

    def before_own(self, write: bool, job: str | None) -> None:
        if holds.HELD[0] and (write or not self.plan.locks_whole_database):
            self.refuse_self_wait(job)

    def after_own(self) -> None:
        if self.recorder is not None and self.recorder.due():
            self.pruner.start()  # off this caller's path: a thread, or a task on the async store

    # -- the history -----------------------------------------------------------------------

    def require_recorder(self) -> Recorder:
        if self.recorder is None:
            raise ConfigurationError(
                "this store records no history: JobStore(engine, table, history=fencing.History(...))"
            )
        return self.recorder

    def prune(self, conn: CallerConnection | None) -> int:
        """Delete every history row past the retention, :data:`PRUNE_BATCH` rows a statement,
        each in a transaction of the store's own (or all in the caller's): how many."""
        recorder = self.require_recorder()
        retention = recorder.history.retention
        if retention is None:
            return 0
        stmt, params = recorder.prune, {"retention": retention}
        pruned = 0
        while True:
            batch = self.run(lambda x: x.count(stmt, params), conn, recorder.history.table)
            pruned += batch
            if batch < PRUNE_BATCH:
                return pruned

    def prune_quietly(self) -> None:
        """The automatic prune: a failure is logged (the next one tries again), never raised."""
        try:
            pruned = self.prune(None)
        except FencingError:
            logger.warning("pruning the ownership history failed; it is tried again later", exc_info=True)
            return
        if pruned:
            logger.debug("pruned %d history rows", pruned, extra={"path": "prune", "rows": pruned})

    def write_refusal(self, why: Refusal, clock: Clock) -> None:
        """Record a refused fenced block in the history, in a transaction of the store's own."""
        recorder = self.require_recorder()
        self.run_jobs(lambda x: recorder.refusals(x, [why], clock), None)

    def record_late(self, why: Refusal, clock: Clock) -> None:
        """Record the refusal of a block that joined the caller's transaction, in a
        transaction of the store's own once it can (the caller's may hold the lock it needs,
        and may roll back): off the caller's path (:mod:`fencing._store.background`)."""
        self._late.append((why, clock))
        self.late.start()

    def write_late(self) -> None:
        """Write the refusals :meth:`record_late` was given, each in a transaction of its own;
        one the database stays too busy for (a caller's transaction held its lock through
        :data:`LATE_ATTEMPTS` busy timeouts) or that fails is logged, never raised."""
        while self._late:
            why, clock = self._late.popleft()
            for attempt in range(LATE_ATTEMPTS):
                try:
                    self.write_refusal(why, clock)
                    break
                except DatabaseBusy:
                    if attempt + 1 < LATE_ATTEMPTS:
                        continue
                    failed = "the database stayed busy"
                except FencingError as exc:
                    failed = type(exc).__name__
                logger.warning(
                    "could not record the refused fenced block on job %r in the history (%s)",
                    why.job_id,
                    failed,
                    exc_info=True,
                    extra=why.fields(),
                )
                break

    # -- accepted and refused writes -------------------------------------------------------

    def why(self, x: Executor, s: Statements, path: str, guard: Guard, clock: Clock) -> Refusal:
        """The reason the guard refused ``guard`` on ``clock`` (its row, read now)."""
        rows = x.rows(s.row_now, {**guard.binds(), **clock.binds()})
        return judge(path, *guard, rows[0] if rows else None)

    def accepted(self, path: str, answer: T, lease: tuple[str, int] | None = None) -> T:
        """Count an accepted write on ``path``; ``lease``: the (job, fence) it ended, if any."""
        self.metrics.accepted(path, lease)
        return answer

    def refused(self, refusals: list[Refusal], answer: T) -> T:
        """Log and count ``refusals`` (after their transaction), and answer ``answer``."""
        report(refusals, self.metrics)
        return answer

    def refused_one(self, refusal: Refusal) -> Refusal:
        """Log and count ``refusal`` (after its transaction), and answer it."""
        return self.refused([refusal], refusal)
