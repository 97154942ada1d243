"""The reads an operator's views run (:mod:`fencing.overview`, the dashboard's feed and the
lease API in :mod:`fencing.web`): jobs by state, one job, a summary, the fence marks and
idempotency keys, the history's refusals by reason and a job's last change of lease.

Each is one ``SELECT`` that reads the database's clock in the same statement, built when
first used. A job's state is decided in SQL exactly as the store's guards decide it
(:mod:`fencing.overview` says how); how a database starts a range or matches a prefix comes
from :mod:`fencing._dialects`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Double,
    Integer,
    Table,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    or_,
    select,
    tuple_,
)
from sqlalchemy.sql import Executable, Select

from .._dialects import Database
from .attempts import exhausted, within_attempts
from .clock import database_now
from .schema import KEY_TYPE, as_text
from .statements import TOMBSTONE

__all__ = ["HistoryViews", "JobViews"]


def _constant(value: int | str) -> ColumnElement[Any]:
    """A constant written into the SQL: the guards' own style, and no untyped parameter
    for PostgreSQL to guess the type of."""
    return literal_column(repr(value) if isinstance(value, str) else str(value))


class JobViews:
    """The reads of one jobs ``table`` (with its ``attempts`` table, if any) and of the
    ``marks`` and ``keys`` tables, on ``database``.

    Bind parameters: ``limit``, ``max_fence`` (the fence a ready job stays below),
    ``job_id``, ``within`` (seconds, the summary's expiring leases), a listing's cursor
    (``after_done``, ``after_until``, ``after_id``) and prefix (``prefix``: the database's
    pattern of it, ``prefix_low``: the prefix itself).
    """

    def __init__(
        self, table: Table, marks: Table, keys: Table, attempts: Table | None, database: Database
    ) -> None:
        self.table, self.marks, self.keys, self.attempts = table, marks, keys, attempts
        self.database = database
        t = table
        self._clock = now = database_now()
        self._done = _constant(1)
        # equality on the index's first column, so until bounds the range that is walked
        live = t.c.done == _constant(0)
        self._max_fence = max_fence = bindparam("max_fence", type_=BigInteger())
        self._ready = and_(live, t.c.until <= now, within_attempts(t, attempts, max_fence))
        self._held = and_(live, t.c.until > now, t.c.owner.is_not(None))
        self._deferred = and_(live, t.c.until > now, t.c.owner.is_(None))
        self._poisoned = and_(live, t.c.until <= now, exhausted(t, attempts, max_fence))
        state = case(
            (t.c.done == self._done, _constant("done")),
            (self._held, _constant("held")),
            (self._deferred, _constant("deferred")),
            (self._ready, _constant("ready")),
            else_=_constant("poisoned"),
        )
        self._view = select(as_text(t.c.id), state, as_text(t.c.owner), t.c.fence, t.c.until, t.c.result, now)
        self._limit = bindparam("limit", type_=Integer())
        self._pages: dict[tuple[str | None, bool, bool, bool], Select[Any]] = {}

    # -- jobs by state -----------------------------------------------------------------------

    def _by_age(self, state: str | None, backward: bool = False) -> Select[Any]:
        """``state``'s listing from its start: a walk of the ready index (done, until, id);
        ``backward``: the same walk from its end (the index read in reverse)."""
        t = self.table
        # the ready index's order: no backend sorts
        by_age: tuple[ColumnElement[Any], ...] = (t.c.until, t.c.id)
        if backward:
            by_age = (t.c.until.desc(), t.c.id.desc())
        if state is None:
            # every state: a range on the index's first column keeps its order, no sort
            done = t.c.done.desc() if backward else t.c.done
            return self._view.where(t.c.done <= self._done).order_by(done, *by_age).limit(self._limit)
        condition = {
            "ready": self._ready,
            "held": self._held,
            "deferred": self._deferred,
            "poisoned": self._poisoned,
            "done": t.c.done == self._done,
        }[state]
        return self._view.where(condition).order_by(*by_age).limit(self._limit)

    def _by_id(self, state: str | None, backward: bool = False) -> Select[Any]:
        """The same states listed by id: how a prefix is walked, as a range of the primary
        key. ``done + 0`` and ``until + 0`` are the same values in a form no index serves,
        so no planner prefers the ready index's range and a sort to the key's walk."""
        t, now, done, attempts = self.table, self._clock, self._done, self.attempts
        done_, until_ = t.c.done + _constant(0), t.c.until + _constant(0)
        live_ = done_ == _constant(0)
        max_fence = self._max_fence
        condition = {
            "ready": and_(live_, until_ <= now, within_attempts(t, attempts, max_fence)),
            "held": and_(live_, until_ > now, t.c.owner.is_not(None)),
            "deferred": and_(live_, until_ > now, t.c.owner.is_(None)),
            "poisoned": and_(live_, until_ <= now, exhausted(t, attempts, max_fence)),
            "done": done_ == done,
            None: done_ <= done,
        }[state]
        return self._view.where(condition).order_by(t.c.id.desc() if backward else t.c.id).limit(self._limit)

    def _after(self, every_state: bool, backward: bool = False) -> ColumnElement[bool]:
        """After the cursor's place in the walk (``(done,)`` ``until, id`` in the ready index);
        ``backward``: before it (the cursor binds are the same ``after_*``)."""
        t = self.table
        u: ColumnElement[float] = bindparam("after_until", type_=Double())
        i = bindparam("after_id", type_=KEY_TYPE)
        d = bindparam("after_done", type_=Integer())

        def beyond(column: ColumnElement[Any], bound: ColumnElement[Any]) -> ColumnElement[bool]:
            return column < bound if backward else column > bound

        if not self.database.ranges_at_row_values:
            # the same order spelled out: its leading bound (until >= u, within done = d) is
            # the range the walk starts at
            start = t.c.until <= u if backward else t.c.until >= u
            later = and_(start, or_(beyond(t.c.until, u), beyond(t.c.id, i)))
            return or_(beyond(t.c.done, d), and_(t.c.done == d, later)) if every_state else later
        if every_state:
            return beyond(tuple_(t.c.done, t.c.until, t.c.id), tuple_(d, u, i))
        return beyond(tuple_(t.c.until, t.c.id), tuple_(u, i))

    def listing(
        self, state: str | None, *, paged: bool, prefixed: bool, backward: bool = False
    ) -> Select[Any]:
        """The listing of ``state`` (``None``: every state), from its start or after a
        cursor (``paged``), of every id or of a prefix's (``prefixed``, by id); ``backward``
        (paged): the rows before the cursor, nearest first (the page before it, reversed):
        each of the 36 shapes built once, when first asked for."""
        key = (state, paged, prefixed, backward)
        stmt = self._pages.get(key)
        if stmt is None:
            t = self.table
            where: list[ColumnElement[bool]] = []
            if prefixed:
                # by id: the prefix is a range of the primary key, walked in its order
                pattern = bindparam("prefix", type_=KEY_TYPE)
                where.append(self.database.prefix_match(t.c.id, pattern))
                if self.database.prefix_needs_low_bound:
                    # a key range from LIKE only in the C collation: the bound says it in any
                    # (the pattern still decides what matches)
                    where.append(t.c.id >= bindparam("prefix_low", type_=KEY_TYPE))
                if paged:
                    bound = bindparam("after_id", type_=KEY_TYPE)
                    where.append(t.c.id < bound if backward else t.c.id > bound)
                stmt = self._by_id(state, backward).where(*where)
            else:
                if paged:
                    where.append(self._after(state is None, backward))
                stmt = self._by_age(state, backward)
                stmt = stmt.where(*where) if where else stmt
                hint = self.database.backward_walk_hint
                if backward and hint is not None:
                    ready = next(
                        i for i in t.indexes if [c.name for c in i.columns] == ["done", "until", "id"]
                    )
                    for name in self.database.names:
                        stmt = stmt.with_hint(t, hint.format(index=ready.name), dialect_name=name)
            self._pages[key] = stmt
        return stmt

    # -- one job, the clock, the summary -----------------------------------------------------

    @cached_property
    def _of_job(self) -> ColumnElement[bool]:
        t = self.table
        return and_(t.c.id == bindparam("job_id", type_=KEY_TYPE), t.c.done != _constant(TOMBSTONE))

    @cached_property
    def job(self) -> Executable:
        """One job (bind ``job_id``), not a deleted one."""
        return self._view.where(self._of_job)

    @cached_property
    def job_locked(self) -> Executable:
        """The same, its row locked until the transaction ends."""
        return self._view.where(self._of_job).with_for_update()

    @cached_property
    def now(self) -> Executable:
        """The database's clock."""
        return select(self._clock)

    @cached_property
    def summary(self) -> Executable:
        """Every state counted, the earliest ``until`` of a ready job, the leases ending
        within ``within`` seconds, the highest fence and the fences' sum: one pass."""
        t, now, done = self.table, self._clock, self._done
        ready, held = self._ready, self._held

        def count(condition: ColumnElement[bool]) -> ColumnElement[Any]:
            return func.coalesce(func.sum(case((condition, _constant(1)), else_=_constant(0))), 0)

        horizon: ColumnElement[float] = bindparam("within", type_=Double())
        return select(
            now,
            count(ready),
            count(held),
            count(self._deferred),
            count(t.c.done == done),
            count(t.c.done == _constant(TOMBSTONE)),
            count(self._poisoned),
            func.min(case((and_(ready, t.c.until > _constant(0)), t.c.until))),
            count(and_(held, t.c.until <= now + horizon)),
            func.max(t.c.fence),
            self.database.fence_sum(t.c.fence),
        )

    @cached_property
    def attempts_base(self) -> Executable:
        """A requeued job's attempts base (bind ``job_id``): its row of the attempts table."""
        a = self.attempts
        assert a is not None
        return select(a.c.base).where(a.c.id == bindparam("job_id", type_=KEY_TYPE))

    @cached_property
    def holders(self) -> Executable:
        """Who holds live leases: each owner with how many jobs it holds and the earliest and
        latest ends of its leases, the most jobs first, up to ``limit`` owners. The held
        leases are a range of the ready index (``done = 0, until > now``): the grouping
        sorts what that range holds, never the table."""
        t, now = self.table, self._clock
        owner = as_text(t.c.owner)
        held = func.count()
        return (
            select(owner, held, func.min(t.c.until), func.max(t.c.until), now)
            .where(self._held)
            .group_by(t.c.owner)
            .order_by(held.desc(), t.c.owner)
            .limit(self._limit)
        )

    # -- fence marks and idempotency keys ----------------------------------------------------

    @cached_property
    def fence_marks(self) -> Executable:
        """Up to ``limit`` fence marks, by resource."""
        m = self.marks
        return select(as_text(m.c.resource), m.c.fence).order_by(m.c.resource).limit(self._limit)

    @cached_property
    def idempotency_keys(self) -> Executable:
        """Up to ``limit`` idempotency keys, by key."""
        k = self.keys
        return select(as_text(k.c["key"]), k.c.fence, k.c.recorded_at).order_by(k.c["key"]).limit(self._limit)


class HistoryViews:
    """The reads of one history table ``history`` (:func:`fencing.history_table`) that the
    dashboard and the lease API make."""

    def __init__(self, history: Table) -> None:
        self.history = history

    @cached_property
    def refusals_by_reason(self) -> Executable:
        """The refused writes after ``since`` (bind; an instant), counted by reason."""
        h = self.history
        since = bindparam("since", type_=h.c.at.type)
        refused = and_(h.c.event == "refused", h.c.at > since)
        return select(h.c.reason, func.count()).where(refused).group_by(h.c.reason)

    @cached_property
    def last_change(self) -> Executable:
        """A job's (bind ``job_id``) last change of lease (refusals change nothing): its
        event, owner and fence, through the table's (job_id, seq) index."""
        h = self.history
        return (
            select(h.c.event, as_text(h.c.owner), h.c.fence)
            .where(h.c.job_id == bindparam("job_id", type_=KEY_TYPE), h.c.event != "refused")
            .order_by(h.c.seq.desc())
            .limit(1)
        )
