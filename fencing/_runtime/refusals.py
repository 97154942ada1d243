"""Refused writes: why each one was refused, one log line, and a count.

A write the guard refuses is the guarantee at work (a worker that stalled past its lease, a
lease taken over or revoked), and the first thing an operator wants to see. The guard is one
``UPDATE ... WHERE``: its row count says *that* the write was refused, not *why*. The reason
costs one read of the job's row, in the same transaction as the refused statement (so it is
what the guard saw, on the same clock), made only on the refused path: an accepted write
costs nothing more.

Each refusal is logged once, after its transaction, at WARNING on ``fencing.refused``, with
structured fields (``extra=``): ``path`` (``complete``, ``renew``, ``release``,
``complete_many``, ``fenced``, ``check``, ``accept``), ``job_id``, ``owner``, ``fence`` (the
token presented), ``reason`` (:data:`REASONS`), and where the row was found ``holder`` and
``current_fence`` (the job's owner and fence at that moment).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .._sql.statements import TOMBSTONE
from .._sql.values import REASONS, Refusal
from .metrics import StoreMetrics

__all__ = ["REASONS", "Refusal", "judge", "never_current", "report"]

logger = logging.getLogger("fencing.refused")


def judge(path: str, job_id: str, owner: str, fence: int, row: Sequence[Any] | None) -> Refusal:
    """Why the guard refused ``(job_id, owner, fence)``, given the job's row read right after
    in the same transaction: ``(owner, fence, done, expired)`` or ``None`` (no such job)."""
    if row is None:
        return Refusal(path, job_id, owner, fence, "missing")
    holder, current, done, expired = row[0], int(row[1]), int(row[2]), bool(row[3])
    if done == TOMBSTONE:
        reason = "deleted"
    elif done:
        reason = "done"
    elif current != fence:
        reason = "stale fence"
    elif holder is None:
        reason = "released"
    elif holder != owner:
        reason = "other owner"
    elif expired:
        reason = "expired"
    else:
        reason = "not current"
    return Refusal(path, job_id, owner, fence, reason, holder, current)


def never_current(path: str, job_id: str, owner: str, fence: int) -> Refusal:
    """A token whose fence no claim ever hands out (below 1, above 2**63-1): refused unread."""
    return Refusal(path, job_id, owner, fence, "stale fence")


def report(refusals: Sequence[Refusal], metrics: StoreMetrics) -> None:
    """Log and count each refusal (after its transaction: never inside a lock)."""
    for r in refusals:
        metrics.refusal(r)
        logger.warning(
            "refused %s of job %r by %r with fence %d: %s (holder now %r, fence %s)",
            r.path,
            r.job_id,
            r.owner,
            r.fence,
            r.reason,
            r.holder,
            r.current_fence,
            extra=r.fields(),
        )
