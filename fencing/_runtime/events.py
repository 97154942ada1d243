"""The log lines an operator watches besides refused writes (:mod:`fencing.refusals`).

Each is one line with structured fields (``extra=``), on its own logger under ``fencing``
so it can be routed or silenced by name:

* ``fencing.busy`` (WARNING): an operation raised :class:`~fencing.DatabaseBusy` (it lost
  every lock race within its budget, or the caller's transaction lost one): ``job_id`` (or
  ``None`` for a many-job operation), ``table``, ``reason`` (``"database busy"``),
  ``error``.
* ``fencing.retry`` (DEBUG): a transaction of the store's own lost a lock race (deadlock,
  serialization failure, lock wait timeout, SQLite busy after ``BEGIN``) and runs again:
  ``job_id``, ``attempt`` (1 for the first retry), ``waited`` (seconds since the first lost
  race), ``error``. Routine under contention, hence DEBUG; ``lock.retried`` counts them.
* ``fencing.poisoned`` (INFO): ``claim_next(max_attempts=N)`` handed out a job's last
  attempt (its fence is ``N``): if this lease is not completed, the job is poisoned, and
  ``claim_next`` skips it from then on (:meth:`~fencing.JobStore.poisoned` lists it):
  ``job_id``, ``owner``, ``fence``, ``max_attempts``. A skip itself is not logged: the
  skipped rows are never read.
* ``fencing.heartbeat`` (WARNING): a heartbeat found its lease lost (see
  :mod:`fencing._store.heartbeat`).

Named locks and elections (:mod:`fencing.locks`) log on their own two, each line with
``event``, ``lock`` (the name: the ``job_id`` of the lines above about the same lock),
``owner`` (the holder or candidate) and the token (``token``, for an election ``term``):

* ``fencing.locks`` (WARNING), ``event="lost"``: a lock held by ``Locks.hold`` (or
  ``AsyncLocks.hold``) was found lost by its heartbeat before the block ended: ``reason``
  (the heartbeat's: a refused renewal, renewals failing past the local deadline...). The
  refused renewal itself is on ``fencing.refused`` with its reason, holder and fence.
* ``fencing.election`` (INFO), ``event="elected"``: a candidate began a term.
* ``fencing.election`` (INFO), ``event="resigned"`` or ``"stopped"``: a leader stepped
  down when its election was stopped: releasing the term (``resign=True``, the default, and
  at interpreter exit) or letting it run out (``resign=False``); ``held``: the term's
  seconds.
* ``fencing.election`` (WARNING), ``event="deposed"``: a leader lost its term (a WARNING,
  as a lost lock: another may lead now): ``held``, ``reason`` (the heartbeat's), and the
  lock's row read right after: ``holder`` and ``current_term`` (a revoke shows as no holder
  and a term above the lost one; another candidate's term as its holder), ``None`` if that
  read failed.
* ``fencing.election`` (WARNING), ``event="not begun"``: a candidate took the lock but its
  first renewal failed (refused, or a database error): ``reason``; it campaigns on.

Besides, with a traceback and without these fields: a waiter that could not leave its
lock's queue (``fencing.locks``; its place lapses), a candidate that could not read or take
the lock, or could not resign (``fencing.election``; it campaigns on, or its term runs out).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .._sql.values import Lease
from .metrics import StoreMetrics

__all__ = ["busy", "last_attempts", "retried"]

busy_logger = logging.getLogger("fencing.busy")
retry_logger = logging.getLogger("fencing.retry")
poisoned_logger = logging.getLogger("fencing.poisoned")


def busy(exc: BaseException, job_id: str | None, table: str, metrics: StoreMetrics) -> None:
    """A :class:`~fencing.DatabaseBusy` a store (or marks) raises: counted and logged."""
    metrics.busy()
    busy_logger.warning(
        "database busy%s: %s",
        "" if job_id is None else f" on job {job_id!r}",
        exc,
        extra={"job_id": job_id, "table": table, "reason": "database busy", "error": str(exc)},
    )


def retried(exc: BaseException, job_id: str | None, attempt: int, waited: float) -> None:
    if not retry_logger.isEnabledFor(logging.DEBUG):
        return
    orig = getattr(exc, "orig", None) or exc
    error = f"{type(orig).__name__}: {str(orig).strip()[:200]}"
    retry_logger.debug(
        "lost a lock race%s, trying again (retry %d, %.3f s since the first): %s",
        "" if job_id is None else f" on job {job_id!r}",
        attempt,
        waited,
        error,
        extra={"job_id": job_id, "attempt": attempt, "waited": waited, "error": error},
    )


def last_attempts(leases: Sequence[Lease], max_attempts: int) -> None:
    """Log each of ``leases`` that is its job's last attempt under ``max_attempts``."""
    for lease in leases:
        if lease.fence == max_attempts:
            poisoned_logger.info(
                "job %r claimed by %r for its last attempt (%d of max_attempts %d): if it is not "
                "completed, claim_next skips it from then on (poisoned)",
                lease.job_id,
                lease.owner,
                lease.fence,
                max_attempts,
                extra={
                    "job_id": lease.job_id,
                    "owner": lease.owner,
                    "fence": lease.fence,
                    "max_attempts": max_attempts,
                },
            )
