"""Refused writes: the reasons a write can be refused, and their log line.

The public import path; the code lives in :mod:`fencing.observe.refusals`.
"""

from __future__ import annotations

from .observe.refusals import (
    REASONS,
    Refusal,
    judge,
    never_current,
    report,
)

__all__ = [
    "REASONS",
    "Refusal",
    "judge",
    "never_current",
    "report",
]
