"""What an operator changes in one job (revoke, release, delete, requeue), in one transaction.

The CLI's ``revoke``/``release``/``delete``/``requeue`` and the dashboard's actions share
these: the job's row is read locked (``SELECT ... FOR UPDATE``; on SQLite the write lock is
taken first), judged, and changed by the store in the same transaction, so what is judged is
what is changed. A worker's open fenced block holds the row: the change waits for it at most
``wait`` seconds, then fails with :class:`~fencing.DatabaseBusy` and changes nothing.

The transaction is one of the store's own (its runner's, as every store operation's): a
connection lost before the ``COMMIT`` was sent is :class:`~fencing.DatabaseUnavailable`,
nothing changed; lost once it was sent, :class:`~fencing.OutcomeUnknown`, the change made or
not, never "nothing changed" for a change the server kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlalchemy import Connection

from ._dialects import of
from ._errors import DatabaseBusy, OutcomeUnknown
from ._sql.dberrors import database_errors
from ._sql.values import Lease
from ._store.jobstore import JobStore
from .overview import JobView, Overview

__all__ = ["CHANGES", "Changed", "change_job", "how_to_tell", "locked_change", "transaction"]


@contextlib.contextmanager
def transaction(store: JobStore, *, wait: float | None = None) -> Iterator[Connection]:
    """One transaction of ``store``'s own for its operations (``conn=``) and locked reads
    that must go together: begun, committed and judged by the store's runner, as its own
    operations' (``IMMEDIATE`` on SQLite; a connection lost at ``COMMIT`` is
    :class:`~fencing.OutcomeUnknown`). ``wait``: the longest a lock is waited for, in
    seconds, on the servers too (SQLite's is the engine's busy timeout); past it the
    transaction fails with :class:`~fencing.DatabaseBusy`. The connection goes back to the
    pool with its session settings as it came."""
    runner = store._ctx.runner  # the store's own way to a transaction, one for every write
    with (
        database_errors(store.table.name, database=store.engine.url.database),
        runner.transaction() as conn,
    ):
        restore = _lock_wait(conn, wait)
        if restore is None:
            yield conn
            return
        try:
            yield conn
        except BaseException:
            try:
                restore()
            except Exception as exc:  # a session left with our wait must not go back to the pool
                conn.invalidate(exc)
            raise
        restore()  # before COMMIT: lost here, nothing was committed


def _lock_wait(conn: Connection, wait: float | None) -> Callable[[], None] | None:
    """Make the transaction on ``conn`` wait at most ``wait`` seconds for a lock; what puts
    the session back as it was, where the setting outlives the transaction."""
    if wait is None:
        return None
    return of(conn.dialect).wait_for_locks(conn.exec_driver_sql, wait)


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
    return bool(store.release(Lease(job.job_id, job.owner, job.fence), delay=delay, conn=conn))


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
    in one transaction of ``store``'s engine (the store records it in its history, if any).
    :func:`locked_change` says what it raises."""
    change = CHANGES[name]
    return locked_change(
        name, store, overview, job_id, lambda conn, job: change(store, conn, job, delay), wait=wait
    )


def locked_change(
    name: str,
    store: JobStore,
    overview: Overview,
    job_id: str,
    change: Callable[[Connection, JobView], bool],
    *,
    wait: float | None = None,
) -> Changed:
    """Read ``job_id`` with its row locked and ``change`` it (whether it did), in one
    :func:`transaction` of ``store``'s; ``name`` (one of :data:`CHANGES`) says what it is in
    messages.

    :class:`~fencing.DatabaseBusy`: the row stayed locked past ``wait``; nothing changed.
    :class:`~fencing.OutcomeUnknown`: the connection was lost while the change was committing,
    so it may or may not have been made; the message says how to tell by reading the job. A
    lost ``COMMIT`` of a transaction that changed nothing (no such job, or ``change``
    answered False) is no mystery: that answer is returned."""
    job: JobView | None = None
    changed = judged = False
    try:
        with transaction(store, wait=wait) as conn:
            job = overview.job(job_id, conn=conn, lock=True)
            changed = job is not None and change(conn, job)
            judged = True
    except OutcomeUnknown as exc:
        if judged and not changed:  # the transaction wrote nothing: committed or not, the same
            return Changed(job, False)
        tell = "" if job is None else f": {how_to_tell(name, job)}"
        raise OutcomeUnknown(
            f"the {name} of job {job_id!r}: the connection was lost while it was committing, "
            "so the outcome is unknown (it may or may not have been made); read the job before "
            f"acting on it again{tell}"
        ) from exc
    except DatabaseBusy as exc:
        waited = "" if wait is None else f" for more than {wait:g} s"
        raise DatabaseBusy(
            f"job {job_id!r} stayed locked by another transaction{waited}: a worker's fenced "
            "block or check(conn=) holds its row until it commits, or another writer does; "
            "nothing changed"
        ) from exc
    return Changed(job, changed)


def how_to_tell(name: str, job: JobView) -> str:
    """How a reader of the job tells whether the change ``name`` of ``job`` (as it was read
    before it) was made, when its outcome is unknown."""
    if name == "revoke":
        return f"it was revoked if its fence is now above {job.fence}"
    if name == "release":
        return f"it was released if {job.owner!r} no longer holds it with fence {job.fence}"
    if name == "delete":
        return "it was deleted if there is no such job now"
    return f"it was requeued if its attempts now count from fence {job.fence}"
