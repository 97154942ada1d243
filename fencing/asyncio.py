"""asyncio: the same leases, fences and guarantees on SQLAlchemy's ``AsyncEngine``.

The public import path; the code lives in :mod:`fencing.fronts.asyncio`.
"""

from __future__ import annotations

from .fronts.asyncio import (
    AsyncCallerConnection,
    AsyncElection,
    AsyncFenceMarks,
    AsyncHeartbeat,
    AsyncHeldLock,
    AsyncJobStore,
    AsyncLocks,
)

__all__ = [
    "AsyncCallerConnection",
    "AsyncElection",
    "AsyncFenceMarks",
    "AsyncHeartbeat",
    "AsyncHeldLock",
    "AsyncJobStore",
    "AsyncLocks",
]
