"""fencing: leases with fencing tokens, so a late worker can never overwrite a newer result.

Every write checks, in the ``WHERE`` clause of the statement that stores it, that the writer
is the current owner with the current fence and that its lease is still live.
"""

from __future__ import annotations

import logging

from .core.errors import (
    ConfigurationError,
    DatabaseBusy,
    DatabaseCorrupt,
    DatabaseError,
    DatabaseFull,
    DatabaseMissing,
    DatabaseReadOnly,
    DatabaseUnavailable,
    FencesExhausted,
    FencingError,
    InvalidArgument,
    InvalidArgumentType,
    LeaseLost,
    LockTimeout,
    OutcomeUnknown,
    PoolTimeout,
    SchemaMismatch,
    TableMissing,
)
from .core.values import JobState, Lease
from .engine.sqlite import configure as configure_sqlite
from .engine.sqlite import create_engine as create_sqlite_engine
from .lease.thread import Heartbeat
from .locks.election import Election
from .locks.named import HeldLock, Locks, locks_table
from .sql.attempts import attempts_table
from .sql.schema import jobs, jobs_table, metadata
from .store.history import History, HistoryEntry, history_table, holder_at
from .store.jobstore import JobStore
from .store.marks import FenceMarks, fence_marks_table, idempotency_keys_table

__all__ = [
    "ConfigurationError",
    "DatabaseBusy",
    "DatabaseCorrupt",
    "DatabaseError",
    "DatabaseFull",
    "DatabaseMissing",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "Election",
    "FenceMarks",
    "FencesExhausted",
    "FencingError",
    "Heartbeat",
    "HeldLock",
    "History",
    "HistoryEntry",
    "InvalidArgument",
    "InvalidArgumentType",
    "JobState",
    "JobStore",
    "Lease",
    "LeaseLost",
    "LockTimeout",
    "Locks",
    "OutcomeUnknown",
    "PoolTimeout",
    "SchemaMismatch",
    "TableMissing",
    "attempts_table",
    "configure_sqlite",
    "create_sqlite_engine",
    "fence_marks_table",
    "history_table",
    "holder_at",
    "idempotency_keys_table",
    "jobs",
    "jobs_table",
    "locks_table",
    "metadata",
]

__version__ = "0.1.0"

# a library logs, the application decides where it goes: nothing reaches stderr unless the
# application configures logging (urllib3's habit); refused writes are on fencing.refused
logging.getLogger(__name__).addHandler(logging.NullHandler())
