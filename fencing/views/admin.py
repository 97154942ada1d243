"""What an operator changes in one job (revoke, release, delete, requeue), in one transaction.

The CLI's ``revoke``/``release``/``delete``/``requeue`` and the dashboard's actions share
these: the job's row is read locked (``SELECT ... FOR UPDATE``; on SQLite the write lock is
taken first), judged, and changed by the store in the same transaction, so what is judged is
what is changed. A worker's open fenced block holds the row: the change waits for it at most
``wait`` seconds, then fails with :class:`~fencing.DatabaseBusy` and changes nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlalchemy import Connection, Engine

from ..core.errors import DatabaseBusy
from ..core.values import Lease
from ..engine.sqlite import BEGIN_OPTION
from ..sql.dberrors import database_errors
from ..store.jobstore import JobStore
from .overview import JobView, Overview

__all__ = ["CHANGES", "Changed", "change_job", "transaction"]


@contextlib.contextmanager
def transaction(engine: Engine, table_name: str, *, wait: float | None = None) -> Iterator[Connection]:
    """One transaction for the store's operations (``conn=``) and locked reads that must go
    together; on SQLite it takes the write lock first. ``wait``: the longest a lock is waited
    for, in seconds, on the servers too (SQLite's is the engine's busy timeout); past it the
    transaction fails with :class:`~fencing.DatabaseBusy`."""
    with database_errors(table_name), engine.connect() as conn:
        dialect = conn.dialect.name
        if dialect == "sqlite":
            conn.execution_options(**{BEGIN_OPTION: "IMMEDIATE"})
        with conn.begin():
            if wait is not None and dialect == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, round(wait * 1000))}ms'")
            elif wait is not None and dialect in ("mysql", "mariadb"):
                # whole seconds, at least 1, the server's unit; the session is this change's own
                conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {max(1, math.ceil(wait))}")
            yield conn


@dataclass(frozen=True)
class Changed:
    """What a change found: the job as it was before (``None``: no such job) and whether it
    was changed (``False``: nothing was, e.g. a release of a job nobody holds)."""

    before: JobView | None
    changed: bool


def _revoke(store: JobStore, conn: Connection, job: JobView, delay: float | None) -> bool:
    return store.revoke(job.job_id, conn=conn)


def _release(store: JobStore, conn: Connection, job: JobView, delay: float | None) -> bool:
    if job.state != "held" or job.owner is None:
        return False
    return store.release(Lease(job.job_id, job.owner, job.fence), delay=delay, conn=conn)


def _delete(store: JobStore, conn: Connection, job: JobView, delay: float | None) -> bool:
    return store.delete(job.job_id, conn=conn)


def _requeue(store: JobStore, conn: Connection, job: JobView, delay: float | None) -> bool:
    return store.requeue(job.job_id, conn=conn)


Change = Callable[[JobStore, Connection, JobView, "float | None"], bool]

#: the changes an operator makes to one job; ``release`` only of a held job; ``requeue`` with
#: the store's attempts table, of a job nobody holds
CHANGES: dict[str, Change] = {"revoke": _revoke, "release": _release, "delete": _delete, "requeue": _requeue}


def change_job(
    name: str,
    store: JobStore,
    overview: Overview,
    job_id: str,
    *,
    wait: float | None = None,
    delay: float | None = None,
) -> Changed:
    """Run the change ``name`` (:data:`CHANGES`) on ``job_id``: read locked, judged, changed,
    in one transaction of ``store``'s engine (the store records it in its history, if any)."""
    change = CHANGES[name]
    try:
        with transaction(store.engine, store.table.name, wait=wait) as conn:
            job = overview.job(job_id, conn=conn, lock=True)
            if job is None:
                return Changed(None, False)
            return Changed(job, change(store, conn, job, delay))
    except DatabaseBusy as exc:
        waited = "" if wait is None else f" for more than {wait:g} s"
        raise DatabaseBusy(
            f"job {job_id!r} stayed locked by another transaction{waited}: a worker's fenced "
            "block or check(conn=) holds its row until it commits, or another writer does; "
            "nothing changed"
        ) from exc
