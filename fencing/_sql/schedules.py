"""Where each schedule's progress is kept: one row per schedule, beside the jobs table.

A schedule's ticks become jobs (:class:`fencing.Scheduler`); what makes each tick one job,
once, ever, whatever number of processes run the schedule, is the row's ``decided_through``:
every tick at or before it has been decided (enqueued, or passed over by the schedule's
policy for missed ticks). A pass moves it forward with a compare-and-set (``WHERE
decided_through = <what the pass read>``) in the same transaction as the ticks' enqueues, so
of two processes that decide the same ticks one commits and the other's transaction is rolled
back; and since it only moves forward, a tick at or before it is never decided again, even
if its job was deleted or purged since, or a clock went back.

The other columns are for the operator (``fencing schedules``, the dashboard): what the
schedule is (``spec``), its latest enqueued tick and the next one, as seen by the pass that
last moved it.
"""

from __future__ import annotations

import datetime as dt
from functools import cached_property
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    MetaData,
    String,
    Table,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    select,
    update,
)
from sqlalchemy.sql import Executable

from .._errors import InvalidArgumentType
from .checks import check_new_table, check_side_table
from .clock import database_now
from .schema import KEY_COLUMN, KEY_TYPE, as_text

__all__ = [
    "DEFAULT_SCHEDULES",
    "ScheduleStatements",
    "ScheduleViews",
    "check_schedules_table",
    "schedules_table",
    "tick_id",
    "tick_instant",
    "tick_pattern",
    "tick_states",
]

#: the columns a schedules table has
COLUMNS = {"name", "spec", "decided_through", "last_tick", "next_tick"}

#: an instant in whole seconds since 1970 (UTC): a tick's
_INSTANT = BigInteger()


def schedules_table(
    metadata: MetaData, name: str = "fencing_schedules", *, schema: str | None = None
) -> Table:
    """The table that keeps each schedule's progress (``fencing_schedules`` by default):
    ``name``, ``spec`` (what the schedule is, in words), ``decided_through`` (every tick at or
    before this instant is decided: enqueued once, or passed over by the policy for missed
    ticks), ``last_tick`` (the latest tick enqueued) and ``next_tick``; instants in whole
    seconds since 1970, UTC. Pass it to :class:`fencing.Scheduler` (``table=``); its
    ``create_table`` creates it."""
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("name", KEY_COLUMN, primary_key=True, nullable=False),
        Column("spec", String(255), nullable=False),
        Column("decided_through", _INSTANT, nullable=False),
        Column("last_tick", _INSTANT, nullable=True),
        Column("next_tick", _INSTANT, nullable=True),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


#: the schedules table beside the library's default jobs table (:data:`fencing.jobs`), in a
#: ``MetaData`` of its own: the default one holds the jobs table alone
DEFAULT_SCHEDULES = schedules_table(MetaData())


def check_schedules_table(table: object) -> Table:
    """``table`` as a scheduler takes it: a table of :func:`schedules_table`'s shape, else the
    error that says what it is not."""
    checked = check_side_table(table, argument="schedules", kind="a schedules table", columns=COLUMNS)
    if checked is None:
        raise InvalidArgumentType("table must be a sqlalchemy Table (fencing.schedules_table), got NoneType")
    return checked


class ScheduleStatements:
    """The statements of one schedules table, built once."""

    def __init__(self, table: Table) -> None:
        self.table = table
        #: (bound as ``schedule``: SQLAlchemy keeps a column's own name for its VALUES and SET)
        self._name = as_text(table.c.name) == bindparam("schedule", type_=KEY_TYPE)

    @cached_property
    def read(self) -> Executable:
        """Every schedule's ``decided_through`` (a row per schedule: a small table, read
        whole), each with the database's clock (seconds since 1970)."""
        t = self.table
        return select(as_text(t.c.name), t.c.decided_through, database_now())

    @cached_property
    def database_now(self) -> Executable:
        return select(database_now())

    @cached_property
    def register(self) -> Executable:
        """A schedule's row, new (bind ``schedule``, ``spec``, ``decided_through``,
        ``next_tick``): its ticks are decided through ``decided_through``."""
        return self.table.insert().values(
            name=bindparam("schedule", type_=KEY_TYPE),
            spec=bindparam("new_spec"),
            decided_through=bindparam("first_through"),
            next_tick=bindparam("first_tick"),
        )

    @cached_property
    def advance(self) -> Executable:
        """The compare-and-set of schedule ``schedule``: ``decided_through`` from ``read``
        (what the pass read) to ``through``, which is later; ``last_tick`` kept when
        ``last_tick`` is ``None``."""
        t = self.table
        last = bindparam("latest", type_=BigInteger())
        return (
            update(t)
            .where(self._name, t.c.decided_through == bindparam("read"))
            .where(t.c.decided_through < bindparam("through"))
            .values(
                decided_through=bindparam("through"),
                last_tick=func.coalesce(last, t.c.last_tick),
                next_tick=bindparam("coming"),
                spec=bindparam("new_spec"),
            )
        )

    @cached_property
    def listing(self) -> Executable:
        """Every row, by name: what ``fencing schedules`` shows."""
        t = self.table
        return select(
            as_text(t.c.name), t.c.spec, t.c.decided_through, t.c.last_tick, t.c.next_tick
        ).order_by(t.c.name)


def _job_state(j: Table) -> Any:
    """A job's row as an operator reads it: ``done``, ``deleted``, ``running`` (a live lease,
    on the database's clock) or ``waiting`` (ready, deferred or poisoned)."""
    return case(
        (j.c.done == literal_column("1"), "done"),
        (j.c.done == literal_column("2"), "deleted"),
        (and_(j.c.owner.is_not(None), j.c.until > database_now()), "running"),
        else_="waiting",
    )


def tick_pattern(name: str) -> str:
    """The ``LIKE`` pattern of ``name``'s tick job ids (``\\`` escapes)."""
    escaped = name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"{escaped}@%"


def tick_states(jobs: Table) -> Executable:
    """How many of a schedule's tick jobs (bind ``pattern``: :func:`tick_pattern`) are in
    each state: ``waiting`` (not done, no live lease: ready, deferred or poisoned),
    ``running`` (a live lease), ``done``, ``deleted``; on the database's clock. A scan of the
    ids that match (an operator's read, not a hot path)."""
    j = jobs
    state = _job_state(j).label("state")
    pattern = bindparam("pattern", type_=KEY_TYPE)
    return (
        select(state, func.count())
        .where(as_text(j.c.id).like(pattern, escape="\\"))
        .group_by(literal_column("state"))  # the output column's name: no jobs column has it
    )


class ScheduleViews:
    """What the dashboard shows of a schedules ``table``: each schedule's row and the state of
    its last tick's job in the jobs table ``jobs`` (a primary-key read per schedule)."""

    def __init__(self, table: Table, jobs: Table) -> None:
        self.table = table
        self._listing = ScheduleStatements(table).listing
        j = jobs
        self._state = select(_job_state(j)).where(as_text(j.c.id) == bindparam("job_id", type_=KEY_TYPE))

    def read(self, conn: Any) -> list[dict[str, Any]]:
        """Every schedule, by name: ``name``, ``spec``, ``last_tick``, ``next_tick`` (seconds
        since 1970), ``last_job`` (its id) and ``last_state`` (``None``: no such job now)."""
        out = []
        for name, spec, _, last, coming in conn.execute(self._listing).all():
            job_id = None if last is None else tick_id(name, int(last))
            state = None if job_id is None else conn.execute(self._state, {"job_id": job_id}).scalar()
            out.append(
                {
                    "name": name,
                    "spec": spec,
                    "last_tick": last,
                    "next_tick": coming,
                    "last_job": job_id,
                    "last_state": state,
                }
            )
        return out


def tick_id(name: str, tick: int) -> str:
    """The job id of schedule ``name``'s tick at ``tick`` (seconds since 1970, UTC)."""
    return f"{name}@{tick_instant(tick)}"


def tick_instant(tick: int) -> str:
    """A tick (seconds since 1970) as its job id writes it: ISO 8601 in UTC, to the second:
    ``2026-12-07T03:00:00Z``."""
    return (_EPOCH + dt.timedelta(seconds=tick)).strftime("%Y-%m-%dT%H:%M:%SZ")


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
