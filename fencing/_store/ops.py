"""The typed arguments of the store's operations: whose lease (:class:`Guard`) and whose
clock (:class:`Clock`), each checked once, at the top of an operation.

An operation's statement binds ``{**guard.binds(), **clock.binds()}`` and what it adds of its
own; the history is told the :class:`Clock` itself (whose instant a row is at); nothing
below the top reads an argument back out of a dict of bind parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._sql.checks import check_until

__all__ = ["Clock", "Guard"]


class Guard(NamedTuple):
    """The token a guarded write presents, checked: the guard in its ``WHERE`` matches this
    job, this owner and this fence."""

    job_id: str
    owner: str
    fence: int

    def binds(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "holder": self.owner, "token": self.fence}


class Clock(NamedTuple):
    """The clock an operation is judged on, checked: the caller's ``now``, or (``now`` is
    ``None``) the database's, read by the statement itself. Where the operation sets a
    lease: its ``ttl`` on the database's clock, or its end ``new_until`` on the caller's."""

    now: float | None = None
    ttl: float | None = None
    new_until: float | None = None

    @property
    def caller(self) -> bool:
        """Whether the caller's clock judges (``now`` given)."""
        return self.now is not None

    def binds(self) -> dict[str, float]:
        """The bind parameters of this clock's statements (:class:`~fencing._sql.statements.Statements`)."""
        if self.now is None:
            return {} if self.ttl is None else {"ttl": self.ttl}
        if self.new_until is None:
            return {"now": self.now}
        return {"now": self.now, "new_until": self.new_until}

    def lasting(self, ttl: float) -> Clock:
        """This clock, setting a lease of ``ttl`` (a fenced block's extension by its heartbeats)."""
        if self.now is None:
            return Clock(ttl=ttl)
        return Clock(self.now, new_until=check_until(self.now, ttl))

    def later(self, seconds: float) -> Clock:
        """The caller's clock ``seconds`` on (the database's reads itself when it is asked)."""
        return self if self.now is None else self._replace(now=self.now + seconds)


#: the database's clock, setting no lease
DATABASE = Clock()
