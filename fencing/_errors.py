"""One exception family for everything the library raises on purpose.

Argument errors also subclass the builtin the contract names (``ValueError`` /
``TypeError``) so ``except ValueError`` keeps working for callers of ``service.py``.
Database errors are wrapped where they cross into the library, with the original
SQLAlchemy / driver error kept as ``__cause__``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigurationError",
    "DatabaseBusy",
    "DatabaseCorrupt",
    "DatabaseError",
    "DatabaseFull",
    "DatabaseMissing",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "FencesExhausted",
    "FencingError",
    "InvalidArgument",
    "InvalidArgumentType",
    "LeaseLost",
    "LockTimeout",
    "OutcomeUnknown",
    "PoolTimeout",
    "SchemaMismatch",
    "TableMissing",
]


class FencingError(Exception):
    """Base class of every error the library raises on purpose."""


class InvalidArgument(FencingError, ValueError):
    """An argument has the right type but a value the operation cannot accept."""


class InvalidArgumentType(FencingError, TypeError):
    """An argument has the wrong type."""


class ConfigurationError(FencingError):
    """An engine or store is set up in a way that would break a guarantee."""


class SchemaMismatch(FencingError):
    """An existing table does not have the columns the library needs; it was left alone."""


class TableMissing(FencingError):
    """The jobs table does not exist yet (create it first, e.g. ``service.init_db``)."""


class DatabaseMissing(FencingError):
    """A SQLite database file that should exist does not; nothing was created."""


class DatabaseError(FencingError):
    """The database refused an operation; the driver's error is the ``__cause__``."""


class DatabaseBusy(DatabaseError):
    """The database stayed locked by other writers past the retry budget; nothing changed."""


class DatabaseCorrupt(DatabaseError):
    """SQLite's ``PRAGMA quick_check`` found the jobs table's pages damaged (``create_table``,
    ``service.init_db``); nothing was changed. The ``__cause__`` is the driver's error when the
    damage stopped the check itself, else ``None`` (the check's findings are in the message)."""


class DatabaseUnavailable(DatabaseError):
    """The database could not be reached, or the connection was lost before the operation
    committed (the server is down, restarting, failing over, or the network cut the
    connection): the operation's transaction was not committed, so nothing changed. Trying
    again once the server answers is safe."""


class OutcomeUnknown(DatabaseError):
    """The connection was lost while a write was committing (its ``COMMIT``, or the one
    statement that is its own transaction): the server may or may not have kept it. The
    library never runs it again as if nothing happened; read the job's state (``state``,
    ``check``) before acting on it. A claim of unknown outcome may have taken a fence the
    caller never saw: on a server that keeps what it acknowledged it is never issued again
    (the job stays held until that lease expires); after a failover to a standby that never
    received it, it can be issued again, harmlessly, since nobody holds it."""


class DatabaseFull(DatabaseError):
    """The database has no room for the write (SQLite's disk or ``max_page_count`` full,
    PostgreSQL ``disk_full``, MariaDB/MySQL table or disk full): the transaction was rolled
    back whole, nothing was half-written. The store works again once space is freed."""


class DatabaseReadOnly(DatabaseError):
    """The database accepts no writes here: a read-only SQLite file or directory, a
    PostgreSQL hot standby (or ``default_transaction_read_only``), a MariaDB/MySQL server
    in ``read_only``. Nothing changed."""


class PoolTimeout(DatabaseError):
    """No connection came free in the engine's pool within its ``pool_timeout`` (its
    ``pool_size`` + ``max_overflow`` were all in use); nothing was changed."""


class FencesExhausted(FencingError):
    """A job has handed out the last fence a signed 64-bit integer holds (2**63-1): it can
    never be claimed or revoked again, since a fence is never reset or reused. Nothing changed."""


class LeaseLost(FencingError):
    """The lease is no longer current (stale fence, expired, done or revoked): stop before
    doing anything irreversible. Raised by ``JobStore.fenced`` (whose block is then rolled
    back) and by ``Heartbeat.check``.

    ``reason`` (from the store): why the lease was not current, one of
    :data:`fencing.REASONS` (for a heartbeat, the reason of the renewal the store refused),
    or ``None`` where the store said none (a heartbeat past its local deadline)."""

    reason: str | None = None
    #: the refusal and the clock it was judged on, for the store's history (internal)
    _refusal: Any = None


class LockTimeout(FencingError, TimeoutError):
    """A named lock stayed held by another owner for the whole ``timeout`` of an acquisition
    (``Locks.hold``): nothing was taken. ``holder``: the lease met at the last try, if one
    was live then (its owner, fence and ``until``)."""

    holder: Any = None
