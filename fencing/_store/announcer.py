"""Whether an enqueue on PostgreSQL tells other processes' waiting claims (``NOTIFY``).

A ``NOTIFY`` is not free: every transaction that notifies takes one lock of the whole
cluster at its commit, so eight threads enqueueing at once lost 30% of their throughput to it
(``benchmarks/workers.py --notify-cost``). It helps only while some process waits for work,
which its listening connection shows (:data:`fencing._sql.channels.LISTENING`). So the
enqueue that asks (:meth:`Announcer.asks`) uses the statement that looks for a listener and
notifies only if one exists (that look alone cost 13%); and when it found none, the next
enqueues of this store within :data:`FRESH` seconds take the plain statement, asking nothing.
A worker that begins to listen in that time claims once more after it listens, and looks
again by backoff (10 ms, then 20 ms, ...): a job whose enqueue did not notify is found that way,
never lost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

__all__ = ["FRESH", "Announcer"]

#: how long an enqueue that found no listener spares the next ones the look (seconds)
FRESH = 0.1


class Announcer:
    """One store's knowledge of whether some process listens for its enqueues."""

    __slots__ = ("_listening", "_seen_at")

    def __init__(self) -> None:
        self._seen_at = -FRESH  # never looked
        self._listening = True

    def asks(self) -> bool:
        """Whether the next enqueue looks for a listener (and notifies the one it finds)."""
        return self._listening or time.monotonic() - self._seen_at >= FRESH

    def heard(self, rows: Sequence[Sequence[object]]) -> bool:
        """Note what an asking enqueue returned (its id and whether it notified, or no row:
        the job existed, nothing learned); whether the job was enqueued."""
        if not rows:
            return False
        self._listening = rows[0][-1] is not None
        self._seen_at = time.monotonic()
        return True
