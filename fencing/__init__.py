"""fencing: leases with fencing tokens, so a late worker can never overwrite a newer result.

Every write checks, in the ``WHERE`` clause of the statement that stores it, that the writer
is the current owner with the current fence and that its lease is still live.
"""

from __future__ import annotations

import logging

from ._errors import (
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
from ._runtime.refusals import REASONS, Refusal
from ._runtime.sqlite import configure as configure_sqlite
from ._runtime.sqlite import create_engine as create_sqlite_engine
from ._sql.attempts import attempts_table
from ._sql.checks import DATABASE_CLOCK_MIN_TTL
from ._sql.failures import Failure, failures_table
from ._sql.payloads import payloads_table
from ._sql.schedules import schedules_table
from ._sql.schema import as_text, jobs, jobs_table
from ._sql.values import JobState, Lease
from ._store.election import Election
from ._store.heartbeat import Heartbeat
from ._store.history import History, HistoryEntry, history_table, holder_at
from ._store.jobstore import JobStore
from ._store.locks import HeldLock, Locks, locks_table
from ._store.marks import FenceMarks, fence_marks_table, idempotency_keys_table
from ._store.schedule import Schedule
from ._store.scheduler import Scheduler
from ._store.worker import Job, Worker

__all__ = [
    "DATABASE_CLOCK_MIN_TTL",
    "REASONS",
    "ConfigurationError",
    "DatabaseBusy",
    "DatabaseCorrupt",
    "DatabaseError",
    "DatabaseFull",
    "DatabaseMissing",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "Election",
    "Failure",
    "FenceMarks",
    "FencesExhausted",
    "FencingError",
    "Heartbeat",
    "HeldLock",
    "History",
    "HistoryEntry",
    "InvalidArgument",
    "InvalidArgumentType",
    "Job",
    "JobState",
    "JobStore",
    "Lease",
    "LeaseLost",
    "LockTimeout",
    "Locks",
    "OutcomeUnknown",
    "PoolTimeout",
    "Refusal",
    "Schedule",
    "Scheduler",
    "SchemaMismatch",
    "TableMissing",
    "Worker",
    "as_text",
    "attempts_table",
    "configure_sqlite",
    "create_sqlite_engine",
    "failures_table",
    "fence_marks_table",
    "history_table",
    "holder_at",
    "idempotency_keys_table",
    "jobs",
    "jobs_table",
    "locks_table",
    "payloads_table",
    "schedules_table",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # a name kept for the code that used it, out of the documented surface (one public name
    # per object: the default table's MetaData is ``fencing.jobs.metadata``)
    if name == "metadata":
        import warnings

        warnings.warn(
            "fencing.metadata is deprecated: use fencing.jobs.metadata (the same MetaData)",
            DeprecationWarning,
            stacklevel=2,
        )
        return jobs.metadata
    raise AttributeError(f"module 'fencing' has no attribute {name!r}")


# a library logs, the application decides where it goes: nothing reaches stderr unless the
# application configures logging (urllib3's habit); refused writes are on fencing.refused
logging.getLogger(__name__).addHandler(logging.NullHandler())
