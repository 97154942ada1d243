"""The plain, immutable values the store hands back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["JobState", "Lease"]


@dataclass(frozen=True, slots=True)
class Lease:
    """The token a worker carries: every later write must present it.

    ``until`` is when the lease expired as of the claim or the last renewal made through
    this value, or ``None`` when it is not known (a token rebuilt from its parts).
    Only ``job_id``, ``owner`` and ``fence`` take part in the database's guard.
    """

    job_id: str
    owner: str
    fence: int
    until: float | None = None


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

    def as_dict(self) -> dict[str, Any]:
        """The row in the contract's shape: keys ``id, owner, until, fence, result, done``."""
        return {
            "id": self.job_id,
            "owner": self.owner,
            "until": self.until,
            "fence": self.fence,
            "result": self.result,
            "done": int(self.done),
        }
