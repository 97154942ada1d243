"""The ``jobs`` table, built for a caller's ``MetaData``, and its safe creation.

The public import path; the code lives in :mod:`fencing.sql.schema`.
"""

from __future__ import annotations

from .sql.schema import (
    ID_MAX_BYTES,
    KEY_COLUMN,
    KEY_TYPE,
    Utf8Key,
    as_text,
    ensure_jobs_table,
    jobs,
    jobs_table,
    metadata,
)

__all__ = [
    "ID_MAX_BYTES",
    "KEY_COLUMN",
    "KEY_TYPE",
    "Utf8Key",
    "as_text",
    "ensure_jobs_table",
    "jobs",
    "jobs_table",
    "metadata",
]
