"""Every statement the store runs, built once per table and clock with Core.

The guards live in the ``WHERE`` clause: a compare-and-set either matches the row
(and changes it in the same statement) or matches nothing. Nothing is read first
and decided in Python.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import ColumnElement, Double, Table, and_, bindparam, literal_column, null, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import Executable

from .clock import database_now

__all__ = ["Clock", "Statements"]

# constants are written into the SQL, not bound: fewer parameters per call, and a
# partial index on "done = 0" can match them
_ZERO: ColumnElement[int] = literal_column("0")
_ONE: ColumnElement[int] = literal_column("1")

#: whose clock decides whether a lease is live: the caller's ``now`` or the database's
Clock = Literal["caller", "database"]


class Statements:
    """The compare-and-set statements for one jobs ``table``.

    Bind parameters are named apart from the columns (UPDATE reserves those for SET):
    ``job_id``, ``holder``, ``token`` (the fence presented), ``new_result``, and for the
    caller's clock ``now`` and ``new_until`` (``now + ttl``, computed once in Python so every
    backend stores the same double), for the database's clock ``ttl``.
    """

    def __init__(self, table: Table, clock: Clock = "caller") -> None:
        t = table
        self.table = table
        self.clock = clock
        now: ColumnElement[float]
        new_until: ColumnElement[float]
        if clock == "caller":
            now = bindparam("now", type_=Double())
            new_until = bindparam("new_until", type_=Double())
        else:
            now = database_now()
            new_until = database_now() + bindparam("ttl", type_=Double())

        job = t.c.id == bindparam("job_id")
        current_holder = and_(
            job,
            t.c.owner == bindparam("holder"),
            t.c.fence == bindparam("token"),
            t.c.done == _ZERO,
        )
        # until == now is expired: a reclaim may happen exactly at the boundary
        lease_live = t.c.until > now

        #: insert-or-ignore: registering a job twice must never wipe a lease in progress.
        #: RETURNING on PostgreSQL: psycopg reports no row count for ON CONFLICT DO NOTHING
        self.enqueue_sqlite: Executable = (
            sqlite.insert(t).values(id=bindparam("job_id")).on_conflict_do_nothing()
        )
        self.enqueue_postgresql: Executable = (
            postgresql.insert(t).values(id=bindparam("job_id")).on_conflict_do_nothing().returning(t.c.id)
        )
        #: MariaDB/MySQL: a plain insert; the duplicate-key error means "exists". (INSERT
        #: IGNORE would also turn real errors into warnings; ON DUPLICATE KEY UPDATE cannot
        #: tell "inserted" from "found" through the row count the driver reports.)
        self.enqueue_plain: Executable = t.insert().values(id=bindparam("job_id"))

        self.state: Executable = select(t.c.id, t.c.owner, t.c.until, t.c.fence, t.c.result, t.c.done).where(
            job
        )

        #: claimable: not done and the lease (if any) has expired; the fence only goes up
        claimable = and_(job, t.c.done == _ZERO, t.c.until <= now)
        claim_values = {"owner": bindparam("holder"), "until": new_until, "fence": t.c.fence + _ONE}
        self.claim_returning: Executable = (
            update(t).where(claimable).values(claim_values).returning(t.c.fence, t.c.until)
        )
        self.claim_counting: Executable = update(t).where(claimable).values(claim_values)
        #: read back a claim or renewal under the row lock its UPDATE took, same transaction
        self.lease_of: Executable = select(t.c.fence, t.c.until).where(job)

        #: renew never revives: the lease must still be live, not merely ours
        renewal = update(t).where(current_holder, lease_live).values(until=new_until)
        self.renew_returning: Executable = renewal.returning(t.c.until)
        self.renew_counting: Executable = renewal
        #: the late writer stops here: the lease is checked at the moment of writing
        self.complete: Executable = (
            update(t).where(current_holder, lease_live).values(result=bindparam("new_result"), done=_ONE)
        )
        #: the fence is kept: resetting it would make an old token valid again
        self.release: Executable = update(t).where(current_holder).values(owner=null(), until=_ZERO)
