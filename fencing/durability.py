"""Whether the database keeps the commits it acknowledges: the settings a fence's survival
rests on, judged (``check_durability``), and an engine made to refuse them
(``require_durable``).

The public import path; the code lives in :mod:`fencing.engine.durability`.
"""

from __future__ import annotations

from .engine.durability import (
    ATTEMPTS,
    RULES,
    Finding,
    Rule,
    check_durability,
    dialect_family,
    findings,
    is_strict,
    judge,
    note,
    read_settings,
    require_durable,
)

__all__ = [
    "ATTEMPTS",
    "RULES",
    "Finding",
    "Rule",
    "check_durability",
    "dialect_family",
    "findings",
    "is_strict",
    "judge",
    "note",
    "read_settings",
    "require_durable",
]
