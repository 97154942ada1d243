"""A pure-Python model of CONTRACT.md: what a correct store holds after any sequence of calls.

One dict of rows and the contract's rules, written as plainly as possible so that a reader
can check them against the table in CONTRACT.md line by line:

* claimable iff the row exists, ``done == 0`` and ``until <= now``;
* renew and complete need owner and fence to match, ``done == 0`` and ``until > now``;
* release needs owner and fence to match and ``done == 0``;
* the fence goes up by one per claim and is never reset.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Model", "Row"]


@dataclass
class Row:
    """One row of the jobs table, in the contract's default state when enqueued."""

    id: str
    owner: str | None = None
    until: float = 0.0
    fence: int = 0
    result: str | None = None
    done: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_ttl(ttl: float) -> None:
    if ttl <= 0:
        raise ValueError(f"ttl must be > 0, got {ttl!r}")


class Model:
    """The rows a correct implementation stores, and the answers it gives."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def copy(self) -> Model:
        return copy.deepcopy(self)

    def enqueue(self, job_id: str) -> bool:
        if job_id in self.rows:
            return False
        self.rows[job_id] = Row(job_id)
        return True

    def state(self, job_id: str) -> dict[str, Any] | None:
        row = self.rows.get(job_id)
        return None if row is None else row.as_dict()

    def claimable(self, job_id: str, now: float) -> bool:
        row = self.rows.get(job_id)
        # until == now is expired: the boundary may be claimed
        return row is not None and row.done == 0 and row.until <= now

    def claim(self, job_id: str, owner: str, now: float, ttl: float) -> int | None:
        _check_ttl(ttl)
        if not self.claimable(job_id, now):
            return None
        row = self.rows[job_id]
        row.owner = owner
        row.until = float(now) + float(ttl)
        row.fence += 1
        return row.fence

    def _held_by(self, job_id: str, owner: str, fence: int) -> Row | None:
        row = self.rows.get(job_id)
        if row is None or row.owner != owner or row.fence != fence or row.done != 0:
            return None
        return row

    def renew(self, job_id: str, owner: str, fence: int, now: float, ttl: float) -> bool:
        _check_ttl(ttl)
        row = self._held_by(job_id, owner, fence)
        # an expired lease is never revived
        if row is None or not row.until > now:
            return False
        row.until = float(now) + float(ttl)
        return True

    def complete(self, job_id: str, owner: str, fence: int, now: float, result: str | None) -> bool:
        row = self._held_by(job_id, owner, fence)
        if row is None or not row.until > now:
            return False
        row.result = result
        row.done = 1
        return True

    def release(self, job_id: str, owner: str, fence: int) -> bool:
        row = self._held_by(job_id, owner, fence)
        if row is None:
            return False
        # the fence is kept: resetting it would make an old token valid again
        row.owner = None
        row.until = 0.0
        return True
