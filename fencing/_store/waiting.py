"""How a waiter for a held lock paces its tries: shared by the sync and the async fronts.

A waiter tries, and on a held lock waits before the next try: 10 ms first, then twice as
long each time up to a cap, each wait a random point in the upper half of its span (equal
jitter, so waiters started together spread out), never past the waiter's deadline. The
rate a waiter reads at is so bounded by the cap however long it waits: no polling storm.
"""

from __future__ import annotations

import random
import time

__all__ = ["FIRST_PAUSE", "Backoff"]

#: the first wait after a try that met a held lock (seconds)
FIRST_PAUSE = 0.01


class Backoff:
    """The pauses of one waiter with ``timeout`` seconds (``None``: no bound), each at most
    ``cap`` seconds."""

    __slots__ = ("_cap", "_deadline", "_span")

    def __init__(self, timeout: float | None, cap: float) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._cap = cap
        self._span = min(FIRST_PAUSE, cap)

    def pause(self) -> float | None:
        """Seconds to wait before the next try, or ``None`` when the deadline has passed
        (no try is left). The last pause ends at the deadline, for one last try there."""
        span = self._span
        self._span = min(span * 2, self._cap)
        pause = random.uniform(span / 2, span)
        if self._deadline is None:
            return pause
        left = self._deadline - time.monotonic()
        if left <= 0:
            return None
        return min(pause, left)
