"""Deliberately broken stores, for proving that the torture harness finds what it must.

Each breaks one guarantee the way real systems do; the harness loads them in its worker
processes through ``--store tests.torture_broken:NAME`` (``AsyncNAME`` with ``--async``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sqlalchemy import Connection, Table, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from fencing import History, JobStore, Lease
from fencing._sql.schema import as_text
from fencing.asyncio import AsyncJobStore

#: the gap a GC pause or a network round trip leaves between a read and the write after it
READ_WRITE_GAP = 0.02


class AckById(JobStore):
    """Completes by job id alone (the job is merely not done yet), as job queues that do not
    fence their acknowledgements do: a late worker's result lands."""

    def complete(
        self, lease: Lease, result: str | None, *, now: float | None = None, conn: Connection | None = None
    ) -> bool:
        t = self.table
        with self.engine.begin() as c:
            done = (
                update(t).where(as_text(t.c.id) == lease.job_id, t.c.done == 0).values(result=result, done=1)
            )
            return c.execute(done).rowcount == 1

    def complete_many(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        *,
        now: float | None = None,
        conn: Connection | None = None,
    ) -> list[bool]:
        return [self.complete(lease, result) for lease, result in completions]


class ReadThenClaim(JobStore):
    """Picks ready jobs in one transaction and claims them in another, from the fence it
    read: two workers can take the same job with the same fence."""

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        limit: int = 1,
        max_attempts: int | None = None,
        conn: Connection | None = None,
    ) -> list[Lease]:
        t = self.table
        with self.engine.begin() as c:
            ready = t.c.done == 0, t.c.until <= time.time()
            picked = c.execute(
                select(as_text(t.c.id), t.c.fence).where(*ready).order_by(t.c.until).limit(limit)
            ).all()
        time.sleep(READ_WRITE_GAP)
        leases = []
        for job_id, fence in picked:
            until = time.time() + ttl
            with self.engine.begin() as c:
                claim = update(t).where(as_text(t.c.id) == job_id)
                c.execute(claim.values(owner=as_text(owner), fence=fence + 1, until=until))
            leases.append(Lease(job_id, owner, fence + 1, until))
        return leases


def _on_the_async_front(broken: type[JobStore]) -> Callable[..., AsyncJobStore]:
    """A factory of ``AsyncJobStore`` with ``broken``'s rules behind it, the way the async
    store runs the sync store's own: the same breakage, reached through the async front's
    calls on the asyncio driver (``--async --store tests.torture_broken:AsyncNAME``)."""

    def build(engine: AsyncEngine, table: Table, *, history: History | None = None) -> AsyncJobStore:
        sync = broken(engine.sync_engine, table, history=history, _bridged=True)  # on an AsyncEngine
        return AsyncJobStore(engine, table, history=history, _sync=sync)

    return build


AsyncAckById = _on_the_async_front(AckById)
AsyncReadThenClaim = _on_the_async_front(ReadThenClaim)
