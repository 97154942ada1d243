"""SQLite glue: the transaction listeners, the pragmas, and the engine factories.

The public import path; the code lives in :mod:`fencing.engine.sqlite`.
"""

from __future__ import annotations

from .engine.sqlite import (
    BEGIN_MODES,
    BEGIN_OPTION,
    DEFAULT_BUSY_TIMEOUT,
    Durability,
    configure,
    create_async_engine,
    create_engine,
    is_configured,
)

__all__ = [
    "BEGIN_MODES",
    "BEGIN_OPTION",
    "DEFAULT_BUSY_TIMEOUT",
    "Durability",
    "configure",
    "create_async_engine",
    "create_engine",
    "is_configured",
]
