"""What an operator reads: jobs by state, one job, a summary, the fence marks.

The public import path; the code lives in :mod:`fencing.views.overview`.
"""

from __future__ import annotations

from .views.overview import (
    STATES,
    Cursor,
    FenceMark,
    IdempotencyKey,
    JobView,
    Overview,
    Summary,
)

__all__ = [
    "STATES",
    "Cursor",
    "FenceMark",
    "IdempotencyKey",
    "JobView",
    "Overview",
    "Summary",
]
