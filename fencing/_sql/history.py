"""The ownership history's statements (:mod:`fencing._store.history` writes and reads with
them): one job's rows, a batch of a prune, the inserts of a batch of rows and the copies of
a job's row, each built when first used and kept for the store's life.

An insert or copy is on one of two clocks: ``caller`` (``at`` is the bind parameter ``now``)
or the database's (``at`` is its clock inside the statement).
"""

from __future__ import annotations

from functools import cached_property

from sqlalchemy import ColumnElement, Double, String, Table, bindparam, delete, insert, literal, select
from sqlalchemy.sql import Executable

from .clock import database_now
from .schema import KEY_TYPE, as_text

__all__ = ["FIELDS", "PRUNE_BATCH", "HistoryStatements"]

#: history rows deleted per transaction by a prune (:meth:`fencing.JobStore.prune_history`)
PRUNE_BATCH = 1000

#: the columns an insert binds, per row ``i``: ``<field>_<i>``
FIELDS = ("job_id", "event", "owner", "fence", "until", "path", "reason", "holder", "current_fence")


def _at(caller: bool) -> ColumnElement[float]:
    return bindparam("now", type_=Double()) if caller else database_now()


class HistoryStatements:
    """The statements on one history table ``history`` (and, for a copy, the jobs table
    ``jobs``): each built once, when first used."""

    def __init__(self, history: Table, jobs: Table) -> None:
        self.history = history
        self.jobs = jobs
        self._inserts: dict[tuple[bool, int], Executable] = {}
        self._copies: dict[tuple[bool, str], Executable] = {}

    @cached_property
    def read(self) -> Executable:
        """One job's rows (bind ``job_id``), in ``seq`` order."""
        h = self.history
        return (
            select(
                h.c.seq,
                as_text(h.c.job_id),
                h.c.event,
                as_text(h.c.owner),
                h.c.fence,
                h.c.until,
                h.c.at,
                h.c.path,
                h.c.reason,
                as_text(h.c.holder),
                h.c.current_fence,
            )
            .where(h.c.job_id == bindparam("job_id", type_=KEY_TYPE))
            .order_by(h.c.seq)
        )

    @cached_property
    def prune(self) -> Executable:
        """One batch of a prune (bind ``retention``): the oldest :data:`PRUNE_BATCH` rows
        before the database's clock less ``retention``."""
        h = self.history
        # the oldest rows' keys found through the ``at`` index, in a derived table
        # (MariaDB/MySQL refuse LIMIT in an IN subquery, and a subquery on the table the
        # DELETE writes, but take both from a derived table; PostgreSQL and SQLite take it as is)
        old = (
            select(h.c.seq)
            .where(h.c.at < database_now() - bindparam("retention", type_=Double()))
            .limit(PRUNE_BATCH)
            .subquery("old")
        )
        return delete(h).where(h.c.seq.in_(select(old.c.seq)))

    def insert(self, caller: bool, size: int) -> Executable:
        """An insert of ``size`` rows (binds ``<field>_<i>`` of :data:`FIELDS`, and ``now``
        on the caller's clock)."""
        stmt = self._inserts.get((caller, size))
        if stmt is None:
            h = self.history
            types = {"job_id": KEY_TYPE, "owner": KEY_TYPE, "holder": KEY_TYPE}
            rows = [
                {
                    **{f: bindparam(f"{f}_{i}", type_=types.get(f, h.c[f].type)) for f in FIELDS},
                    "at": _at(caller),
                }
                for i in range(size)
            ]
            stmt = self._inserts[(caller, size)] = insert(h).values(rows)
        return stmt

    def copy(self, caller: bool, event: str) -> Executable:
        """A row of ``event`` whose lease is the job's row as it is then (bind ``job_id``,
        and ``now`` on the caller's clock)."""
        stmt = self._copies.get((caller, event))
        if stmt is None:
            j, h = self.jobs, self.history
            row = select(
                j.c.id, literal(event, String(16)), j.c.owner, j.c.fence, j.c.until, _at(caller)
            ).where(j.c.id == bindparam("job_id", type_=KEY_TYPE))
            columns = [h.c.job_id, h.c.event, h.c.owner, h.c.fence, h.c.until, h.c.at]
            stmt = self._copies[(caller, event)] = insert(h).from_select(columns, row)
        return stmt
