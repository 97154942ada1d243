"""Every statement the store runs on the jobs table, built with Core when first used (once
per table and clock).

The guards live in the ``WHERE`` clause: a compare-and-set either matches the row
(and changes it in the same statement) or matches nothing. Nothing is read first
and decided in Python.

Ids and owners are ``str`` here on every backend: each bind parameter of one is typed
:data:`~fencing.schema.KEY_TYPE` and each read of one is coerced to it (on MariaDB/MySQL
the columns are bytes and this is their UTF-8 codec).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any, Literal

from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    Double,
    Integer,
    Table,
    Text,
    all_,
    and_,
    bindparam,
    case,
    cast,
    column,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import Executable
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FromClause, Insert, Select, Update
from sqlalchemy.sql.functions import FunctionElement

from .._dialects import of
from .attempts import exhausted, within_attempts
from .channels import channel_of, listening_notice
from .checks import FENCE_MAX
from .clock import database_now
from .schema import KEY_TYPE, as_text

#: a condition a claim of one job must also meet, given the clock's ``now`` (bind parameters
#: ``job_id`` and ``holder`` are the claim's)
ClaimGuard = Callable[[ColumnElement[float]], ColumnElement[bool]]

__all__ = ["COMPLETE_CHUNK", "LOST_AT_THE_END", "TOMBSTONE", "Clock", "Statements", "batch_size"]

# constants are written into the SQL, not bound: fewer parameters per call, and a
# partial index on "done = 0" can match them
_ZERO: ColumnElement[int] = literal_column("0")
_ONE: ColumnElement[int] = literal_column("1")
#: ``done = 2`` marks a deleted job: the row stays as a tombstone that keeps its fence, so
#: an id enqueued again continues above every fence it ever handed out
TOMBSTONE = 2
_TOMBSTONE: ColumnElement[int] = literal_column(str(TOMBSTONE))
_FENCE_MAX: ColumnElement[int] = literal_column(str(FENCE_MAX))

#: whose clock decides whether a lease is live: the caller's ``now`` or the database's
Clock = Literal["caller", "database"]

#: the most completions one batch statement carries: 5 bind parameters each, far below
#: psycopg's 65535; bigger batches run as several statements in the same transaction
COMPLETE_CHUNK = 1024


def _key(name: str) -> ColumnElement[str]:
    """A bind parameter for an id or owner: a ``str``, UTF-8 bytes where the column is bytes."""
    return bindparam(name, type_=KEY_TYPE)


def batch_size(count: int) -> int:
    """The statement size a batch of ``count`` (<= COMPLETE_CHUNK) is padded to: a power of
    two, so a store holds at most 11 shapes (and psycopg prepares each one once)."""
    return 1 << (count - 1).bit_length()


class unindexed(FunctionElement[Any]):
    """A column read as a value, never as a way into an index: SQLite's unary ``+``,
    MariaDB's ``col + 0`` (PostgreSQL: the column as is). For a re-check next to a search by
    primary key, which SQLite's planner (a claim) or MariaDB's (a batch completion joined to
    its derived table) would otherwise drive through the ready index, testing ready rows."""

    inherit_cache = True
    name = "unindexed"


@compiles(unindexed)
def _unindexed(element: unindexed, compiler: SQLCompiler, **kw: Any) -> str:
    return of(compiler.dialect).unindexed(compiler.process(element.clauses, **kw))


class qualified(FunctionElement[Any]):
    """A column named with its table wherever it is rendered: SQLite's compiler renders a
    ``RETURNING`` clause's columns bare, subqueries included, where a correlated subquery's
    ``id = id`` would then compare the inner table's column with itself."""

    inherit_cache = True
    name = "qualified"


@compiles(qualified)
def _qualified(element: qualified, compiler: SQLCompiler, **kw: Any) -> str:
    [column] = element.clauses
    preparer = compiler.preparer  # (SQLAlchemy's public quoting: no compiler keyword relied on)
    return f"{preparer.format_table(column.table)}.{preparer.quote(column.name)}"


#: the text of the error a fenced block's end statement raises when the lease is not current
#: and live (:attr:`Statements.still_held`): PostgreSQL says ``invalid input syntax for type
#: integer: "<this> 0"``, and the transaction is aborted before its COMMIT
LOST_AT_THE_END = "fencing: the lease is not current and live at the end of the fenced block, rows:"


def _fails_unless_one(rows: Any) -> Select[Any]:
    """A SELECT of 1 over ``rows`` (a statement returning rows, or a CTE) that fails with an
    error naming :data:`LOST_AT_THE_END` unless ``rows`` holds exactly one row. The failing
    branch depends on the count, so the planner cannot fold it into a constant and fail early."""
    found = rows.subquery() if isinstance(rows, Select) else rows
    n = func.count()
    verdict = case((n == 1, literal("1")), else_=literal(LOST_AT_THE_END + " ") + cast(n, Text()))
    return select(cast(verdict, Integer())).select_from(found)


class Statements:
    """The compare-and-set statements for one jobs ``table``.

    Bind parameters are named apart from the columns (UPDATE reserves those for SET):
    ``job_id``, ``holder``, ``token`` (the fence presented), ``new_result``, and for the
    caller's clock ``now`` and ``new_until`` (``now + ttl``, computed once in Python so every
    backend stores the same double), for the database's clock ``ttl``.
    """

    #: PostgreSQL, before a pick of more than one job in a transaction of the store's own:
    #: on a table never analyzed (a fresh queue loaded in bulk; autovacuum analyzes it
    #: only later) the planner guesses a handful of ready rows and, for a LIMIT of ~100,
    #: prefers a bitmap scan and a sort of the whole ready set to the ready index walked
    #: in claim order. Sorts off for the rest of this transaction only (LOCAL: undone at
    #: its commit or rollback, never in a caller's transaction), the walk is chosen at
    #: any backlog with or without statistics; nothing the store runs after it sorts
    walk_in_claim_order: Executable = text("SET LOCAL enable_sort = off")

    def __init__(
        self,
        table: Table,
        clock: Clock = "caller",
        *,
        claim_guard: ClaimGuard | None = None,
        freed_notice: ColumnElement[Any] | None = None,
        attempts: Table | None = None,
        payloads: Table | None = None,
        failures: Table | None = None,
    ) -> None:
        t = self.table = table
        #: where a requeue keeps a job's attempts base (:mod:`fencing._sql.attempts`), if anywhere
        self.attempts = attempts
        #: where each job's payload is kept (:mod:`fencing._sql.payloads`), if anywhere
        self.payloads = payloads
        #: where each job's last failure is kept (:mod:`fencing._sql.failures`), if anywhere
        self.failures = failures
        self.clock = clock
        self._claim_guard = claim_guard
        #: what a freed row sends on (a lock's waiters are woken), if anything
        self._freed_notice = freed_notice
        # the parts the statements share; each statement is built when first used
        if clock == "caller":
            self._now: ColumnElement[float] = bindparam("now", type_=Double())
            self._new_until: ColumnElement[float] = bindparam("new_until", type_=Double())
            #: when an enqueued job becomes claimable: the caller's time
            self._ready_at: ColumnElement[float] = bindparam("ready_at", type_=Double())
        else:
            self._now = database_now()
            self._new_until = database_now() + bindparam("ttl", type_=Double())
            self._ready_at = database_now()
        self._job = t.c.id == _key("job_id")
        self._current_holder = and_(
            self._job, t.c.owner == _key("holder"), t.c.fence == bindparam("token"), t.c.done == _ZERO
        )
        # until == now is expired: a reclaim may happen exactly at the boundary
        self._lease_live = t.c.until > self._now
        #: the same, for a row found by its primary key: never a way into the ready index
        self._lease_live_by_key = unindexed(t.c.until) > self._now
        #: a fence can still go up: at 2**63-1, fence + 1 overflows (SQLite to a float that
        #: every later claimer gets again, the servers to an error), so such a row never matches
        self._fence_left = t.c.fence < _FENCE_MAX
        self._claim_values = {"owner": _key("holder"), "until": self._new_until, "fence": t.c.fence + _ONE}
        self._row = (as_text(t.c.id), as_text(t.c.owner), t.c.until, t.c.fence, t.c.result, t.c.done)
        #: ready: not done, not held, not deferred, and claimed fewer than max_fence times
        #: (max_fence <= 2**63-1, so a job at the last fence is never ready)
        self._max_fence: ColumnElement[int] = bindparam("max_fence")
        self._ready = and_(
            t.c.done == _ZERO, t.c.until <= self._now, within_attempts(t, attempts, self._max_fence)
        )
        #: the picked rows, found by primary key; still ready (a re-check that costs nothing)
        self._ready_again = and_(
            unindexed(t.c.done) == _ZERO,
            unindexed(t.c.until) <= self._now,
            within_attempts(t, attempts, self._max_fence, fence=unindexed(t.c.fence)),
        )
        self._by_count: dict[int, tuple[Executable, Executable]] = {}
        self._batches: dict[tuple[str, int], Executable] = {}

    # -- registering a job --------------------------------------------------------------------

    @cached_property
    def _revive(self) -> dict[str, Any]:
        """Registering a job twice must never wipe a lease in progress: insert, or revive a
        tombstone (its fence kept), or change nothing."""
        return {"done": _ZERO, "owner": null(), "until": self._ready_at, "result": null()}

    def _enqueue_on_conflict(
        self, dialect: Any, *returning: ColumnElement[Any], revive: bool = True
    ) -> Executable:
        """The upsert as SQLite and PostgreSQL both spell it (``dialect``: the module whose
        ``insert`` has ``on_conflict_do_update``), returning ``returning`` if given;
        ``revive=False``: a tombstone stays one (``ON CONFLICT DO NOTHING``)."""
        t = self.table
        new = dialect.insert(t).values(id=_key("job_id"), until=self._ready_at)
        if revive:
            upsert = new.on_conflict_do_update(
                index_elements=[t.c.id], set_=self._revive, where=t.c.done == _TOMBSTONE
            )
        else:
            upsert = new.on_conflict_do_nothing(index_elements=[t.c.id])
        stmt: Executable = upsert.returning(*returning) if returning else upsert
        return stmt

    @cached_property
    def enqueue_sqlite(self) -> Executable:
        return self._enqueue_on_conflict(sqlite)

    @cached_property
    def enqueue_new_sqlite(self) -> Executable:
        """:attr:`enqueue_sqlite` that leaves a deleted job's tombstone as it is."""
        return self._enqueue_on_conflict(sqlite, revive=False)

    @cached_property
    def enqueue_postgresql(self) -> Executable:
        """RETURNING on PostgreSQL, whose driver's row count for upserts is not documented."""
        return self._enqueue_on_conflict(postgresql, as_text(self.table.c.id))

    @cached_property
    def enqueue_new_postgresql(self) -> Executable:
        return self._enqueue_on_conflict(postgresql, as_text(self.table.c.id), revive=False)

    @cached_property
    def enqueue_announcing_postgresql(self) -> Executable:
        """:attr:`enqueue_postgresql` that also wakes the claims of other processes waiting
        for work, if any listens (:func:`fencing._sql.channels.listening_notice`), and
        returns whether one did."""
        return self._enqueue_on_conflict(postgresql, as_text(self.table.c.id), self._announcement)

    @cached_property
    def enqueue_new_announcing_postgresql(self) -> Executable:
        return self._enqueue_on_conflict(
            postgresql, as_text(self.table.c.id), self._announcement, revive=False
        )

    @cached_property
    def _announcement(self) -> ColumnElement[Any]:
        return listening_notice(channel_of(self.table))

    def _enqueue_with_payload(self, *returning: ColumnElement[Any], revive: bool = True) -> Executable:
        p = self._payloads_table()
        upsert_job = self._enqueue_on_conflict(postgresql, as_text(self.table.c.id), revive=revive)
        assert isinstance(upsert_job, Insert)
        job = upsert_job.cte("job")
        new = postgresql.insert(p).from_select(
            ["id", "payload"], select(job.c.id, bindparam("payload", type_=Text()))
        )
        upsert = new.on_conflict_do_update(index_elements=[p.c.id], set_={"payload": new.excluded.payload})
        stmt: Executable = upsert.returning(as_text(p.c.id), *returning)
        return stmt

    @cached_property
    def enqueue_with_payload_postgresql(self) -> Executable:
        """PostgreSQL: the job's upsert as a data-modifying CTE, and its payload written only
        for a row it inserted or revived (replacing any payload left under the id), in one
        statement that returns the id if the job was enqueued."""
        return self._enqueue_with_payload()

    @cached_property
    def enqueue_with_payload_announcing_postgresql(self) -> Executable:
        """:attr:`enqueue_with_payload_postgresql` that also wakes other processes' waiting
        claims, as :attr:`enqueue_announcing_postgresql` does."""
        return self._enqueue_with_payload(self._announcement)

    @cached_property
    def enqueue_new_with_payload_postgresql(self) -> Executable:
        return self._enqueue_with_payload(revive=False)

    @cached_property
    def enqueue_new_with_payload_announcing_postgresql(self) -> Executable:
        return self._enqueue_with_payload(self._announcement, revive=False)

    @cached_property
    def enqueue_plain(self) -> Executable:
        """MariaDB/MySQL: a plain insert; the duplicate-key error means "exists" and
        :attr:`revive` then brings a tombstone back. (INSERT IGNORE would also turn real
        errors into warnings; ON DUPLICATE KEY UPDATE cannot tell "inserted" from "found"
        through the row count the driver reports.)"""
        return self.table.insert().values(id=_key("job_id"), until=self._ready_at)

    @cached_property
    def revive(self) -> Executable:
        return update(self.table).where(self._job, self.table.c.done == _TOMBSTONE).values(self._revive)

    @cached_property
    def state(self) -> Executable:
        """A job's row; a tombstone is a deleted job: it has no state."""
        return select(*self._row).where(self._job, self.table.c.done != _TOMBSTONE)

    # -- one lease -----------------------------------------------------------------------------

    @cached_property
    def _claim_one(self) -> ColumnElement[bool]:
        """Claimable: not done and the lease (if any) has expired; the fence only goes up;
        and what a caller adds (named locks: no waiter queued ahead of the claimer,
        :mod:`fencing._store.lock_queue`)."""
        t = self.table
        claimable = and_(self._job, t.c.done == _ZERO, t.c.until <= self._now, self._fence_left)
        return claimable if self._claim_guard is None else and_(claimable, self._claim_guard(self._now))

    @cached_property
    def claim_returning(self) -> Executable:
        t = self.table
        return (
            update(t)
            .where(self._claim_one)
            .values(self._claim_values)
            .returning(t.c.fence, t.c.until, *self._payload_of_row)
        )

    @cached_property
    def claim_counting(self) -> Executable:
        return update(self.table).where(self._claim_one).values(self._claim_values)

    @cached_property
    def exhausted(self) -> Executable:
        """Why a claim or revoke matched nothing, asked only then: the job's fences are used up."""
        t = self.table
        return select(t.c.fence).where(self._job, t.c.done == _ZERO, t.c.fence >= _FENCE_MAX)

    @cached_property
    def lease_of(self) -> Executable:
        """Read back a claim or renewal under the row lock its UPDATE took, same transaction."""
        return select(self.table.c.fence, self.table.c.until).where(self._job)

    @cached_property
    def claimed_lease(self) -> Executable:
        """Read back a claim (without RETURNING): :attr:`lease_of`, and the job's payload
        when the store keeps payloads, read as of now (:meth:`_payload_of`)."""
        return select(self.table.c.fence, self.table.c.until, *self._payload_of(latest=True)).where(self._job)

    @cached_property
    def renew_counting(self) -> Executable:
        """Renew never revives: the lease must still be live, not merely ours."""
        return update(self.table).where(self._current_holder, self._lease_live).values(until=self._new_until)

    @cached_property
    def renew_returning(self) -> Executable:
        renewal = self.renew_counting
        assert isinstance(renewal, Update)
        return renewal.returning(self.table.c.until)

    @cached_property
    def _completion(self) -> Update:
        return (
            update(self.table)
            .where(self._current_holder, self._lease_live)
            .values(result=bindparam("new_result"), done=_ONE)
        )

    @cached_property
    def complete(self) -> Executable:
        """The late writer stops here: the lease is checked at the moment of writing."""
        return self._completion

    @cached_property
    def lock_lease(self) -> Executable:
        """A fenced transaction: the lease is current and live, and its row stays locked until
        commit, so no one can claim the job while the caller's writes are pending."""
        t = self.table
        return select(t.c.fence).where(self._current_holder, self._lease_live).with_for_update()

    @cached_property
    def live_lease(self) -> Executable:
        """Who holds a job now: its live lease's owner, fence and until (none when free)."""
        t = self.table
        return select(as_text(t.c.owner), t.c.fence, t.c.until).where(
            self._job, t.c.done == _ZERO, t.c.owner.is_not(None), self._lease_live
        )

    @cached_property
    def still_held(self) -> Executable:
        """The end of a fenced block sent with its COMMIT (PostgreSQL, psycopg's pipeline): the
        same check as a statement that fails when it matches no row, so the COMMIT after it in
        the pipeline is never run (:data:`LOST_AT_THE_END`)."""
        return _fails_unless_one(select(self.table.c.id).where(self._current_holder, self._lease_live))

    @cached_property
    def complete_or_fail(self) -> Executable:
        """The completion at the end of a fenced block, as :attr:`still_held`."""
        return _fails_unless_one(self._completion.returning(self.table.c.id).cte("completed"))

    @cached_property
    def hold_lease(self) -> Executable:
        """The same check as a write, for SQLite inside a transaction that did not begin
        IMMEDIATE (the caller's): it takes the database's write lock with the check, so the
        caller's writes that follow cannot lose a lock race."""
        t = self.table
        return (
            update(t)
            .where(self._current_holder, self._lease_live)
            .values(fence=t.c.fence)
            .returning(t.c.fence)
        )

    @cached_property
    def release_later(self) -> Executable:
        """Released with a delay: not claimable before now + delay (new_until / ttl)."""
        return update(self.table).where(self._current_holder).values(owner=null(), until=self._new_until)

    @cached_property
    def row_now(self) -> Executable:
        """Why a write was refused (:mod:`fencing._runtime.refusals`), read only then, in its
        transaction: the job as the guard saw it, and whether its lease had run out on the
        guard's clock."""
        t = self.table
        expired = (t.c.until <= self._now).label("expired")
        return select(as_text(t.c.owner), t.c.fence, t.c.done, expired).where(self._job)

    def _frees(self, stmt: Update) -> Executable:
        """``stmt``, a statement that frees a row at once (a rowcount of 1: freed), returning
        what a freed row sends on if the table's rows send anything."""
        return stmt if self._freed_notice is None else stmt.returning(self._freed_notice)

    @cached_property
    def release(self) -> Executable:
        """The fence is kept: resetting it would make an old token valid again."""
        return self._frees(update(self.table).where(self._current_holder).values(owner=null(), until=_ZERO))

    @cached_property
    def revoke(self) -> Executable:
        """The fence moves on, so the holder's token is stale at once."""
        t = self.table
        return self._frees(
            update(t)
            .where(self._job, t.c.done == _ZERO, self._fence_left)
            .values(fence=t.c.fence + _ONE, owner=null(), until=_ZERO)
        )

    @cached_property
    def delete(self) -> Executable:
        t = self.table
        return self._frees(
            update(t)
            .where(self._job, t.c.done != _TOMBSTONE)
            .values(done=_TOMBSTONE, owner=null(), until=_ZERO, result=null())
        )

    # -- the next ready jobs ---------------------------------------------------------------------

    @cached_property
    def _pick(self) -> Select[Any]:
        """Longest ready first: by enqueue time, lease expiry or retry time, then (a tie) by
        id: the order of the ready index (done, until, id), so no backend sorts. SKIP LOCKED: a
        worker never waits for rows another worker is claiming (ignored on SQLite, where BEGIN
        IMMEDIATE serializes claims)."""
        t = self.table
        return (
            select(as_text(t.c.id))
            .where(self._ready)
            .order_by(t.c.until, t.c.id)
            .limit(bindparam("limit"))
            .with_for_update(skip_locked=True)
        )

    @cached_property
    def pick_ready(self) -> Executable:
        """For databases without RETURNING: the pick reads each fence too, and the clock's
        reading it judged them ready at (the database's: the claim is stored at that instant,
        so the client knows each lease without reading it back); it locks the rows, so the ones
        :meth:`claim_ids`' UPDATE claimed are exactly those at the picked fence + 1."""
        return self._pick.add_columns(self.table.c.fence, self._now)

    @cached_property
    def claim_next_returning(self) -> Executable:
        return self._claim_picked(self._pick)

    @cached_property
    def due_in(self) -> Executable:
        """How long until the next job not done comes due: its ``until`` (a deferred job's
        time, a lease's end, a retry's) less now, read from the ready index's first entry; at
        most 0 when one is due now (ready, or skipped by a claim: poisoned, or being claimed)."""
        t = self.table
        return select(t.c.until - self._now).where(t.c.done == _ZERO).order_by(t.c.until).limit(1)

    @cached_property
    def poisoned(self) -> Executable:
        """Jobs claimed max_fence times or more and not held: retries exhausted."""
        t = self.table
        return (
            select(*self._row)
            .where(t.c.done == _ZERO, exhausted(t, self.attempts, self._max_fence), t.c.until <= self._now)
            .order_by(t.c.until, t.c.id)
        )

    # -- a requeue (with an attempts table) ----------------------------------------------------

    @cached_property
    def requeue(self) -> Executable:
        """A job not done and not held (a deferred one ready now, an expired lease's owner
        cleared); its fence kept, so every token handed out stays stale."""
        t, now = self.table, self._now
        return (
            update(t)
            .where(self._job, t.c.done == _ZERO, or_(t.c.owner.is_(None), t.c.until <= now))
            .values(owner=null(), until=case((t.c.until > now, now), else_=t.c.until))
        )

    @cached_property
    def forget_base(self) -> Executable:
        """Then its attempts count from its fence now: the base replaced, under the row lock
        the requeue took (so two requeues of a job are one after the other)."""
        a = self._attempts_table()
        return a.delete().where(a.c.id == _key("job_id"))

    @cached_property
    def set_base(self) -> Executable:
        t = self.table
        return (
            self._attempts_table()
            .insert()
            .from_select(["id", "base"], select(t.c.id, t.c.fence).where(self._job))
        )

    def _attempts_table(self) -> Table:
        if self.attempts is None:
            raise AttributeError("a requeue's statements need the store's attempts table")
        return self.attempts

    def claim_ids(self, count: int) -> tuple[Executable, Executable]:
        """For databases without ``UPDATE ... RETURNING``: claim ``count`` picked ids
        (binds ``id_0`` ...) and read them back, statements built once per count. On the
        caller's clock only: a claim on the database's is stored at the instant its pick
        read (:attr:`pick_ready`), passed as ``now``."""
        try:
            return self._by_count[count]
        except KeyError:
            t = self.table
            ids = t.c.id.in_([_key(f"id_{i}") for i in range(count)])
            claim = update(t).where(ids, self._ready).values(self._claim_values)
            read = select(as_text(t.c.id), t.c.fence, t.c.until).where(ids, t.c.owner == _key("holder"))
            self._by_count[count] = (claim, read)
            return claim, read

    # -- payloads (with a payloads table) ------------------------------------------------------

    @cached_property
    def _payload_of_row(self) -> tuple[ColumnElement[Any], ...]:
        """What a claim returns after each row's id, fence and until: the row's payload, read
        by primary key in the claim's own statement; nothing without a payloads table."""
        return self._payload_of(latest=False)

    def _payload_of(self, *, latest: bool) -> tuple[ColumnElement[Any], ...]:
        """The claimed row's payload as a subquery of the claim's statement. ``latest``: a
        locking read (``LOCK IN SHARE MODE``), for a statement after the claim's ``UPDATE``
        on MariaDB/MySQL, where a plain read in a caller's transaction sees the snapshot of its
        first read: a job enqueued since, which the claim's locking read does take, would
        come without its payload."""
        p = self.payloads
        if p is None:
            return ()
        payload = (
            select(p.c.payload).where(qualified(p.c.id) == qualified(self.table.c.id)).correlate(self.table)
        )
        if latest:
            payload = payload.with_for_update(read=True)
        return (payload.scalar_subquery().label("payload"),)

    def _payloads_table(self) -> Table:
        if self.payloads is None:
            raise AttributeError("a payload's statements need the store's payloads table")
        return self.payloads

    @cached_property
    def payload_of(self) -> Executable:
        p = self._payloads_table()
        return select(p.c.payload).where(p.c.id == _key("job_id"))

    @cached_property
    def forget_payload(self) -> Executable:
        """A job's payload out (before a new one goes in, and when the job is deleted)."""
        p = self._payloads_table()
        return p.delete().where(p.c.id == _key("job_id"))

    @cached_property
    def put_payload(self) -> Executable:
        p = self._payloads_table()
        return p.insert().values(id=_key("job_id"), payload=bindparam("payload", type_=Text()))

    def payloads_of(self, count: int) -> Executable:
        """For databases without ``UPDATE ... RETURNING``: the payloads of ``count`` claimed
        ids (binds ``id_0`` ...), read in the claim's transaction; built once per count."""

        def build() -> Executable:
            p = self._payloads_table()
            ids = p.c.id.in_([_key(f"id_{i}") for i in range(count)])
            # a locking read: the payloads as of now, not a caller's snapshot (_payload_of)
            return select(as_text(p.c.id), p.c.payload).where(ids).with_for_update(read=True)

        return self._batch("payloads_of", count, build)

    # -- failures (with a failures table) ------------------------------------------------------

    def _failures_table(self) -> Table:
        if self.failures is None:
            raise AttributeError("a failure's statements need the store's failures table")
        return self.failures

    @cached_property
    def forget_failure(self) -> Executable:
        """A job's last failure out (before the next goes in, and when the job is deleted)."""
        f = self._failures_table()
        return f.delete().where(f.c.id == _key("job_id"))

    @cached_property
    def put_failure(self) -> Executable:
        """The failure of the attempt at fence ``token``, at this clock's now."""
        f = self._failures_table()
        return f.insert().values(
            id=_key("job_id"),
            fence=bindparam("token"),
            at=self._now,
            failure=bindparam("failure", type_=Text()),
        )

    @cached_property
    def failure_of(self) -> Executable:
        f = self._failures_table()
        return select(f.c.fence, f.c.at, f.c.failure).where(f.c.id == _key("job_id"))

    # -- a batch of completions in one statement (servers: one round trip, not one each) ---

    def _batch(self, kind: str, size: int, build: Callable[[], Executable]) -> Executable:
        key = (kind, size)
        stmt = self._batches.get(key)
        if stmt is None:
            stmt = self._batches[key] = build()
        return stmt

    def _completions(self, size: int) -> list[tuple[ColumnElement[Any], ...]]:
        """Bind parameters for ``size`` completions: ``n_i`` (the position in the batch),
        ``id_i``, ``holder_i``, ``token_i``, ``result_i``, typed like the values they carry."""
        t = self.table
        return [
            (
                bindparam(f"n_{i}", type_=Integer()),
                _key(f"id_{i}"),
                _key(f"holder_{i}"),
                bindparam(f"token_{i}", type_=t.c.fence.type),
                bindparam(f"result_{i}", type_=t.c.result.type),
            )
            for i in range(size)
        ]

    def _complete_joined(self, v: FromClause) -> Update:
        """complete's guard, per completion: the job of ``v.id`` held by ``v.holder`` under
        ``v.token``, not done, lease live; then its result and done = 1."""
        t = self.table
        current = and_(
            t.c.id == v.c.id, t.c.owner == v.c.holder, t.c.fence == v.c.token, unindexed(t.c.done) == _ZERO
        )
        return update(t).where(current, self._lease_live_by_key).values(result=v.c.result, done=_ONE)

    def complete_batch_arrays(self) -> Executable:
        """Any number of completions in one ``UPDATE ... FROM unnest(arrays)``, returning the
        positions (``n``) of the accepted ones (PostgreSQL). Binds five arrays, ``ns``,
        ``ids``, ``holders``, ``tokens``, ``results``, so the statement's text is the same
        for every batch size: psycopg prepares it once, and nothing is re-parsed per call.
        Each row of the arrays meets the guard on its own."""

        def build() -> Executable:
            t = self.table
            arrays = func.unnest(
                bindparam("ns", type_=ARRAY(Integer())),
                bindparam("ids", type_=ARRAY(Text())),
                bindparam("holders", type_=ARRAY(Text())),
                bindparam("tokens", type_=ARRAY(BigInteger())),
                bindparam("results", type_=ARRAY(Text())),
            )
            v = arrays.table_valued(
                column("n", Integer()),
                column("id", t.c.id.type),
                column("holder", t.c.owner.type),
                column("token", t.c.fence.type),
                column("result", t.c.result.type),
            ).render_derived(name="v")
            return self._complete_joined(v).returning(v.c.n)

        return self._batch("complete_arrays", 0, build)

    def _claim_picked(self, pick: Select[Any]) -> Update:
        """Claim the rows ``pick`` selects (and locks), returning their id, fence and until."""
        t = self.table
        # MATERIALIZED: PostgreSQL may otherwise re-run the pick per outer row, each time
        # skipping the rows this very statement just locked, and claim past the LIMIT
        picked = pick.cte("picked").prefix_with("MATERIALIZED", dialect="postgresql")
        return (
            update(t)
            .where(t.c.id.in_(select(picked.c.id)), self._ready_again)
            .values(self._claim_values)
            .returning(as_text(t.c.id), t.c.fence, t.c.until, *self._payload_of_row)
        )

    def step_arrays(self) -> Executable:
        """A worker's step in one statement (PostgreSQL): :meth:`complete_batch_arrays` and
        ``claim_next_returning`` as two data-modifying CTEs of one ``SELECT``, so a step is
        one round trip. Its rows: ``(n, NULL, NULL, NULL)`` per accepted completion,
        ``(NULL, id, fence, until)`` per claimed job (and, with payloads, each row's payload
        last).

        Both CTEs see one snapshot, and PostgreSQL does not say which of two updates of one
        row in a statement wins: so the claim never picks a job this step completes (``id <>
        ALL(ids)``). A completion that is accepted leaves a live lease anyway, which the claim
        could not take; one that is refused (expired) leaves its job to the claim."""

        def build() -> Executable:
            t = self.table
            complete = self.complete_batch_arrays()
            assert isinstance(complete, Update)
            done = complete.cte("done")
            ids = bindparam("ids", type_=ARRAY(Text()))
            claimed = self._claim_picked(self._pick.where(t.c.id != all_(ids))).cte("claimed")
            no = null()
            no_payload = [cast(no, Text()).label("payload")] if self.payloads is not None else []
            return union_all(
                select(
                    done.c.n,
                    cast(no, Text()).label("id"),
                    cast(no, BigInteger()).label("fence"),
                    cast(no, t.c.until.type).label("until"),
                    *no_payload,
                ),
                select(cast(no, Integer()).label("n"), *claimed.c),
            )

        return self._batch("step_arrays", 0, build)

    def lock_live(self, size: int) -> Executable:
        """For databases without ``UPDATE ... RETURNING``: lock the rows of ``size`` job ids
        (binds ``id_i``) and read each one's holder, fence, whether it is current (not done,
        lease live) and the ``now`` that was judged at (the store binds it into
        :meth:`complete_batch_joined`, so both statements judge by one instant). The WHERE
        names only ids, so the lock is taken through the primary key on these rows alone:
        a range on the ready index would lock every live lease in it."""

        def build() -> Executable:
            t = self.table
            ids = t.c.id.in_([_key(f"id_{i}") for i in range(size)])
            current = and_(t.c.done == _ZERO, self._lease_live).label("is_current")
            return (
                select(as_text(t.c.id), as_text(t.c.owner), t.c.fence, current, self._now.label("judged_at"))
                .where(ids)
                .with_for_update()
            )

        return self._batch("lock_live", size, build)

    def complete_batch_joined(self, size: int) -> Executable:
        """``size`` completions in one ``UPDATE`` joined to a derived table of ``SELECT ...
        UNION ALL SELECT ...`` (MariaDB/MySQL, which have no ``VALUES`` with column names)."""

        def build() -> Executable:
            names = ("id", "holder", "token", "result")
            rows = [
                select(*(b.label(n) for b, n in zip(row[1:], names, strict=True)))
                for row in self._completions(size)
            ]
            v = (union_all(*rows) if size > 1 else rows[0]).subquery("v")
            return self._complete_joined(v)

        return self._batch("complete_joined", size, build)
