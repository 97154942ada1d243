"""The path-based contract (CONTRACT.md): eight functions over ``fencing.JobStore``.

Every function takes the SQLite database file path first, or a database URL
(``postgresql+psycopg://...``, ``mysql+pymysql://...``); a plain path is a SQLite file.
``now`` is the caller's clock; ``now=None`` reads the database server's clock instead.

Stores (engine + connections) are cached per database by :class:`fencing._engines.StoreCache`:
bounded, fork-safe, thread-safe, and never running a statement on a connection to a file
that was deleted or replaced since it was opened. Replacing a SQLite file while any process
has it open is not supported by SQLite itself (its ``-wal`` goes by the path); the cases the
cache can see are refused (see its docstring). Rows are never cached: ``state`` reads the
database every time. ``init_db`` checks an existing jobs table's pages (``PRAGMA
quick_check``) and refuses a damaged file with ``fencing.DatabaseCorrupt``, writing nothing.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable
from typing import TypeAlias

from fencing._engines import StoreCache
from fencing._sql.checks import check_ttl
from fencing._sql.values import JobRow, Lease

# the contract's eight functions; ``Target`` and ``JobRow`` are importable for annotations
__all__ = ["claim", "claim_many", "complete", "enqueue", "init_db", "release", "renew", "state"]

#: the first argument of every function: a SQLite file path (``str`` or ``os.PathLike[str]``;
#: ``bytes`` paths are refused) or a database URL (``str``). Anything else raises
#: ``fencing.InvalidArgumentType``: the annotations describe valid input, the checks stay.
Target: TypeAlias = str | os.PathLike[str]


_stores = StoreCache(maxsize=32)
# close pooled connections at exit instead of leaving them to the garbage collector
atexit.register(_stores.clear)


def init_db(path: Target) -> None:
    """Create the jobs table if missing. Idempotent; never empties a file or its rows."""
    _stores.get(path, create=True).create_table()


def enqueue(path: Target, job_id: str) -> bool:
    """Insert ``job_id`` unclaimed: ``True``; ``False`` (nothing changed) if it exists."""
    return _stores.get(path).enqueue(job_id, ready_at=0.0)  # the contract's row: until = 0


def state(path: Target, job_id: str) -> JobRow | None:
    """The stored row as a dict (``id, owner, until, fence, result, done``), or ``None``."""
    row = _stores.get(path).state(job_id)
    return None if row is None else row.as_dict()


def claim(path: Target, job_id: str, owner: str, now: float | None, ttl: float) -> int | None:
    """The new fence, or ``None`` for a missing, done or held job. ``ValueError`` if ``ttl <= 0``.

    ``fencing.FencesExhausted`` if the job's fence is already 2**63-1: it cannot go up by one,
    and ``None`` would say "held, try later" of a job that can never be claimed again.
    """
    check_ttl(ttl)
    lease = _stores.get(path).claim(job_id, owner, now=now, ttl=ttl)
    return None if lease is None else lease.fence


def renew(path: Target, job_id: str, owner: str, fence: int, now: float | None, ttl: float) -> bool:
    """Extend a live lease held with ``owner`` and ``fence``. ``ValueError`` if ``ttl <= 0``."""
    check_ttl(ttl)
    return bool(_stores.get(path).renew(Lease(job_id, owner, fence), now=now, ttl=ttl))


def complete(
    path: Target, job_id: str, owner: str, fence: int, now: float | None, result: str | None
) -> bool:
    """Store ``result`` only under the current, live lease; otherwise ``False``."""
    return bool(_stores.get(path).complete(Lease(job_id, owner, fence), result, now=now))


def release(path: Target, job_id: str, owner: str, fence: int) -> bool:
    """Give the lease back (owner NULL, until 0, fence kept) if ``owner`` and ``fence`` match."""
    return bool(_stores.get(path).release(Lease(job_id, owner, fence)))


def claim_many(
    path: Target, job_id: str, owners: Iterable[str], now: float | None, ttl: float
) -> list[int | None]:
    """``claim`` for every owner concurrently on a thread pool; results in input order."""
    check_ttl(ttl)
    leases = _stores.get(path).claim_many(job_id, owners, now=now, ttl=ttl)
    return [None if lease is None else lease.fence for lease in leases]
