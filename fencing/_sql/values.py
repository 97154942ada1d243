"""The plain, immutable values the store hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypedDict

__all__ = ["REASONS", "JobRow", "JobState", "Lease", "Refusal"]


@dataclass(frozen=True, slots=True)
class Lease:
    """The token a worker carries: every later write must present it.

    ``until`` is when the lease expired as of the claim or the last renewal made through
    this value, or ``None`` when it is not known (a token rebuilt from its parts).
    Only ``job_id``, ``owner`` and ``fence`` take part in the database's guard.

    ``payload`` is the job's arguments, as enqueued (``enqueue(payload=)``), handed out by a
    claim of a store that keeps payloads (``JobStore(..., payloads=)``), else ``None``. It is
    not part of the token: two leases with the same job, owner, fence and until are equal.
    """

    job_id: str
    owner: str
    fence: int
    until: float | None = None
    payload: Any = field(default=None, compare=False, repr=False)


class JobRow(TypedDict):
    """A job's row in the contract's shape (``service.state``, :meth:`JobState.as_dict`)."""

    id: str
    owner: str | None
    until: float
    fence: int
    result: str | None
    done: int  # 0 or 1, as stored in the INTEGER column


class JobState(NamedTuple):
    """One stored row of the jobs table, read from the database.

    A named tuple: a row is a tuple, immutable, and cheap to build on the read path.
    """

    job_id: str
    owner: str | None
    until: float
    fence: int
    result: str | None
    done: bool

    @classmethod
    def from_row(cls, row: Any) -> JobState:
        job_id, owner, until, fence, result, done = row
        # tuple.__new__ directly: the generated NamedTuple __new__ costs a call on a hot path
        return tuple.__new__(cls, (job_id, owner, float(until), int(fence), result, bool(done)))

    def as_dict(self) -> JobRow:
        """The row in the contract's shape: keys ``id, owner, until, fence, result, done``."""
        return {
            "id": self.job_id,
            "owner": self.owner,
            "until": self.until,
            "fence": self.fence,
            "result": self.result,
            "done": int(self.done),
        }


#: why a write was refused, in the order they are tested
REASONS = (
    "missing",  # no such job
    "deleted",  # the job was deleted (its tombstone keeps the fence)
    "done",  # the job is done: completed, by this lease or the one after it
    "stale fence",  # the job was claimed again (or revoked) since this lease was handed out
    "other owner",  # the fence is current but another owner presented it: a forged lease
    "released",  # this lease was given back (owner cleared, fence kept)
    "expired",  # this lease ran out before the write: until <= now
    "not current",  # none of the above when read: it changed between the guard and the read
)


@dataclass(frozen=True)
class Refusal:
    """One refused write: what was presented, and the job as the guard saw it.

    It is what a refused :meth:`~fencing.JobStore.renew`, :meth:`~fencing.JobStore.complete`
    or :meth:`~fencing.JobStore.release` returns (and each refused item of
    :meth:`~fencing.JobStore.complete_many`), and it is **falsy**, so ``if not
    store.complete(...)`` reads as it always did, with the reason at hand: ``reason`` (one of
    :data:`REASONS`), read in the refused write's own transaction, and ``holder`` and
    ``current_fence``, the job's owner and fence then (``None`` where the job was not read:
    a missing job, or a fence no claim ever hands out). The log line, the metrics, the
    history's ``refused`` row and the lease API's ``409`` all say this same value.
    """

    path: str
    job_id: str
    owner: str
    fence: int
    reason: str
    holder: str | None = None
    current_fence: int | None = None

    def __bool__(self) -> Literal[False]:
        return False

    def fields(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "job_id": self.job_id,
            "owner": self.owner,
            "fence": self.fence,
            "reason": self.reason,
            "holder": self.holder,
            "current_fence": self.current_fence,
        }
