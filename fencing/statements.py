"""Every statement the store runs, built once per table with Core.

The guards live in the ``WHERE`` clause: a compare-and-set either matches the row
(and changes it in the same statement) or matches nothing. Nothing is read first
and decided in Python.
"""

from __future__ import annotations

from sqlalchemy import Table, and_, bindparam, literal, null, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import Executable

__all__ = ["Statements"]


class Statements:
    """The compare-and-set statements for one jobs ``table``.

    Bind parameters: ``job_id``, ``owner``, ``fence``, ``now``, ``until``, ``result``.
    """

    def __init__(self, table: Table) -> None:
        t = table
        self.table = table
        job = t.c.id == bindparam("job_id")
        current_holder = and_(
            job,
            t.c.owner == bindparam("owner"),
            t.c.fence == bindparam("fence"),
            t.c.done == 0,
        )
        # until == now is expired: a reclaim may happen exactly at the boundary
        lease_live = t.c.until > bindparam("now")

        #: insert-or-ignore: registering a job twice must never wipe a lease in progress
        self.enqueue_sqlite: Executable = (
            sqlite.insert(t).values(id=bindparam("job_id")).on_conflict_do_nothing()
        )
        self.enqueue_postgresql: Executable = (
            postgresql.insert(t).values(id=bindparam("job_id")).on_conflict_do_nothing()
        )
        #: portable insert-if-absent; a concurrent duplicate raises and means "exists"
        self.enqueue_portable: Executable = t.insert().from_select(
            [t.c.id],
            select(bindparam("job_id", type_=t.c.id.type)).where(~select(literal(1)).where(job).exists()),
        )

        self.state: Executable = select(t.c.id, t.c.owner, t.c.until, t.c.fence, t.c.result, t.c.done).where(
            job
        )

        #: claimable: not done and the lease (if any) has expired; the fence only goes up
        self.claim_where = and_(job, t.c.done == 0, t.c.until <= bindparam("now"))
        claim_values = {
            "owner": bindparam("owner"),
            "until": bindparam("until"),
            "fence": t.c.fence + 1,
        }
        self.claim_returning: Executable = (
            update(t).where(self.claim_where).values(claim_values).returning(t.c.fence, t.c.until)
        )
        self.claim_counting: Executable = update(t).where(self.claim_where).values(claim_values)
        #: read back the claim under the row lock the UPDATE took, in the same transaction
        self.claimed_by: Executable = select(t.c.fence, t.c.until).where(job)

        #: renew never revives: the lease must still be live, not merely ours
        self.renew: Executable = update(t).where(current_holder, lease_live).values(until=bindparam("until"))
        #: the late writer stops here: the lease is checked at the moment of writing
        self.complete: Executable = (
            update(t).where(current_holder, lease_live).values(result=bindparam("result"), done=1)
        )
        #: the fence is kept: resetting it would make an old token valid again
        self.release: Executable = update(t).where(current_holder).values(owner=null(), until=0.0)
