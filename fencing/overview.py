"""What an operator reads: jobs by state, one job, a summary, the fence marks.

The public import path; the code lives in :mod:`fencing.tools.overview`.
"""

from __future__ import annotations

from .tools.overview import (
    STATES,
    FenceMark,
    IdempotencyKey,
    JobView,
    Overview,
    Summary,
)

__all__ = [
    "STATES",
    "FenceMark",
    "IdempotencyKey",
    "JobView",
    "Overview",
    "Summary",
]
