"""``fencing schedules``: each schedule of a schedules table (:class:`fencing.Scheduler`) with
its last and next tick and how many of its ticks' jobs are in each state."""

from __future__ import annotations

import argparse

from sqlalchemy import MetaData

from .._format import instant
from .._sql.schedules import ScheduleStatements, schedules_table, tick_pattern, tick_states
from ._database import Database, Failed, add_command
from ._options import Commands
from ._output import Output, table

__all__ = ["add_schedules"]

_STATES = ("waiting", "running", "done", "deleted")


def add_schedules(commands: Commands) -> None:
    parser = add_command(
        commands,
        "schedules",
        schedules,
        help="each schedule: what it is, its last and next tick, its ticks' jobs by state",
        description="List the schedules kept in the schedules table (fencing.Scheduler): what each "
        "is (a cron expression and its time zone, or an interval), the latest tick enqueued, the "
        "next tick, the instant through which every tick is decided, and how many of its ticks' "
        "jobs (<name>@<instant>) are waiting (ready, deferred or poisoned), running (a live "
        "lease), done or deleted. Instants are UTC.",
    )
    parser.add_argument(
        "--schedules-table",
        default="fencing_schedules",
        metavar="NAME",
        help="the schedules table (fencing.schedules_table) (%(default)s)",
    )


def schedules(args: argparse.Namespace, db: Database, out: Output) -> int:
    name = args.schedules_table
    if not db.has(name):
        raise Failed(
            f"no schedules table {name!r} in {db.where()}: a fencing.Scheduler creates it "
            "(scheduler.create_table()); --schedules-table names another"
        )
    kept = schedules_table(MetaData(), name, schema=db.table.schema)
    listing = ScheduleStatements(kept).listing
    counting = tick_states(db.table)
    records = []
    with db.engine.connect() as conn:
        for row in conn.execute(listing).all():
            counts = dict.fromkeys(_STATES, 0)
            for state, count in conn.execute(counting, {"pattern": tick_pattern(row[0])}).all():
                counts[str(state)] = int(count)
            records.append(
                {
                    "name": row[0],
                    "spec": row[1],
                    "decided_through": row[2],
                    "last_tick": row[3],
                    "next_tick": row[4],
                    **counts,
                }
            )
    if out.json:
        for record in records:
            out.record(**record)
        return 0
    if not records:
        out.lines([f"no schedules in table {name!r}"])
        return 0
    rows = [
        [
            r["name"],
            r["spec"],
            instant(r["last_tick"]),
            instant(r["next_tick"]),
            *(str(r[state]) for state in _STATES),
        ]
        for r in records
    ]
    headers = ["schedule", "every", "last tick", "next tick", *_STATES]
    out.lines(table(headers, rows, numeric=range(4, 8)))
    return 0
