"""What a store did, counted in process: ``store.metrics``.

Counter names are dotted: ``<operation>.accepted`` for a write the guard let through,
``<operation>.refused.<reason>`` for one it refused (reasons: :data:`fencing.refusals.REASONS`),
``claim_next.calls`` and ``claim_next.jobs`` for the claims of workers, ``claim.accepted`` /
``claim.empty`` for claims of a named job (empty: not claimable), ``revoke.accepted``,
``delete.accepted``. A
counter appears once it is first counted. Counting takes a lock (threads share a store) and
costs well under a microsecond; reading (:meth:`StoreMetrics.snapshot`) copies the counts.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["StoreMetrics"]


class StoreMetrics:
    """Counts of one store's operations, by outcome; safe to share between threads."""

    __slots__ = ("_counts", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"<StoreMetrics {dict(sorted(self.snapshot().items()))}>"

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        """Every counter counted so far, by name."""
        with self._lock:
            return dict(self._counts)

    def refused(self, path: str | None = None) -> int:
        """Writes refused, in all or on one ``path`` (``complete``, ``renew``...)."""
        prefix = "" if path is None else f"{path}."
        with self._lock:
            return sum(
                n for name, n in self._counts.items() if name.startswith(prefix) and ".refused." in name
            )
