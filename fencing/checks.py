"""Argument checks shared by the store and ``service.py``, and their limits.

The public import path; the code lives in :mod:`fencing.core.checks`.
"""

from __future__ import annotations

from .core.checks import (
    DATABASE_CLOCK_MIN_TTL,
    FENCE_MAX,
    check_count,
    check_database_ttl,
    check_fence,
    check_interval,
    check_lock_name,
    check_new_table,
    check_now,
    check_result,
    check_text,
    check_time,
    check_timeout,
    check_ttl,
    check_until,
    fence_can_match,
    show_value,
)

__all__ = [
    "DATABASE_CLOCK_MIN_TTL",
    "FENCE_MAX",
    "check_count",
    "check_database_ttl",
    "check_fence",
    "check_interval",
    "check_lock_name",
    "check_new_table",
    "check_now",
    "check_result",
    "check_text",
    "check_time",
    "check_timeout",
    "check_ttl",
    "check_until",
    "fence_can_match",
    "show_value",
]
