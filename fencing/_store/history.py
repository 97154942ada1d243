"""Ownership history (opt-in): who held which job, with which fence, and whose write was refused.

A store given a :class:`History` writes one row per change of a lease, **in the same
transaction as the change**: a claim (also each lease of ``claim_next``), a renewal (only with
``renewals=True``: heartbeats renew often), a release, a completion (``complete``,
``complete_many``, a fenced block with ``complete=True``), a fenced block that committed
without completing (``fenced``), a revoke and a delete. A refused write (``complete``,
``renew``, ``release``, ``complete_many`` items) is recorded in the transaction of the
statement the guard refused, with the holder and fence of the job at that moment; a fenced
block that lost its lease is rolled back, so its refusal is written after the rollback, in a
transaction of the store's own (when the block joined the caller's transaction, off the
caller's path once that transaction lets it: :mod:`fencing._store.background`).
What is never recorded: a token whose fence no claim ever hands out (below 1 or above
2**63-1, refused before any statement), and ``check`` (a read, not a write).

So the history answers "who held job X at 10:42, with which fence, and whose write was
refused": :meth:`fencing.JobStore.history` reads one job's rows in order, :func:`holder_at`
finds the lease live at an instant, and ``fencing show ID`` prints them. The jobs table is
untouched: the history is a table of its own in the application's ``MetaData``::

    history = fencing.history_table(metadata)            # "fencing_history"
    store = JobStore(engine, jobs, history=History(history, retention=7 * 86400))

``at`` is the instant of the change on the clock that judged it: the database's
(``now=None``) or the caller's ``now``. **Retention**: the store deletes rows whose ``at``
is more than ``retention`` seconds before the database's clock, at most once per
:attr:`History.prune_every` seconds, off the callers' path (a thread, or a task on the async
store, :mod:`fencing._store.background`), in batches of short transactions of its own
(``retention=None`` keeps every row; :meth:`fencing.JobStore.prune_history` prunes on
demand). Retention is on the database's clock, so a store whose history has one refuses a
write with the caller's ``now`` (:class:`~fencing.ConfigurationError`, before any statement):
that row's ``at`` would be compared with the database's clock and, on a clock of your own,
deleted at once, silently. Caller-clock histories keep every row (``retention=None``), which
their owner prunes. Every store writing to one history table should agree on this.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Column, Double, Index, Integer, MetaData, String, Table
from sqlalchemy.sql import Executable

from .._errors import InvalidArgument, InvalidArgumentType
from .._runtime.execution import Executor
from .._runtime.refusals import Refusal
from .._sql.checks import check_new_table, check_time
from .._sql.history import FIELDS, PRUNE_BATCH, HistoryStatements
from .._sql.schema import _FENCE, _OWNER, KEY_COLUMN, SECONDS
from .._sql.values import Lease
from .ops import Clock

__all__ = ["EVENTS", "PRUNE_BATCH", "History", "HistoryEntry", "history_table", "holder_at"]

#: what a history row records
EVENTS = ("claim", "renew", "release", "complete", "fenced", "revoke", "delete", "requeue", "refused")

#: rows per INSERT: a batch is written as power-of-two chunks up to this, so a store builds
#: at most 8 statement shapes per clock
_CHUNK = 128


def history_table(metadata: MetaData, name: str = "fencing_history", *, schema: str | None = None) -> Table:
    """The ownership history table in ``metadata`` (``fencing_history`` by default).

    ``seq`` orders the rows as they were written (an autoincrementing key); ``at`` is the
    instant on the clock that judged the change. A refused write keeps the token presented
    (``owner``, ``fence``), the path it came by (``path``: ``complete``, ``renew``,
    ``release``, ``complete_many``, ``fenced``), why (``reason``,
    :data:`fencing.REASONS`) and the job's ``holder`` and ``current_fence`` then.
    """
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        # SQLite: INTEGER PRIMARY KEY is the rowid, so it autoincrements
        Column("seq", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
        Column("job_id", KEY_COLUMN, nullable=False),
        Column("event", String(16), nullable=False),
        Column("owner", _OWNER, nullable=True),
        Column("fence", _FENCE, nullable=True),
        Column("until", SECONDS, nullable=True),
        Column("at", Double, nullable=False),
        Column("path", String(16), nullable=True),
        Column("reason", String(16), nullable=True),
        Column("holder", _OWNER, nullable=True),
        Column("current_fence", _FENCE, nullable=True),
        Index(f"ix_{name}_job", "job_id", "seq"),
        Index(f"ix_{name}_at", "at"),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


@dataclass(frozen=True)
class History:
    """How a store records ownership history: into ``table`` (:func:`history_table`),
    keeping rows for ``retention`` seconds (``None``: forever), renewals too if ``renewals``."""

    table: Table
    retention: float | None = 7 * 86400.0
    renewals: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.table, Table):
            raise InvalidArgumentType(
                "History table must be a sqlalchemy Table (fencing.history_table), "
                f"got {type(self.table).__name__}"
            )
        missing = {"seq", "job_id", "event", "at"} - set(self.table.c.keys())
        if missing:
            raise InvalidArgument(
                f"table {self.table.name!r} is not a history table (no {', '.join(sorted(missing))}): "
                "use fencing.history_table(metadata)"
            )
        if self.retention is not None:
            bad = isinstance(self.retention, bool) or not isinstance(self.retention, (int, float))
            if bad or not (math.isfinite(self.retention) and self.retention > 0):
                raise InvalidArgument(
                    f"retention must be a positive number of seconds or None, got {self.retention!r}"
                )
        if not isinstance(self.renewals, bool):
            raise InvalidArgumentType(f"renewals must be a bool, got {type(self.renewals).__name__}")

    @property
    def prune_every(self) -> float:
        """Seconds between a store's automatic prunes: a tenth of ``retention``, 1 s to 5 min."""
        return math.inf if self.retention is None else min(max(self.retention / 10, 1.0), 300.0)


@dataclass(frozen=True)
class HistoryEntry:
    """One history row. ``owner``/``fence``/``until``: the lease the event was about (a
    claim's new lease; a refused write's token; a revoke's new fence, no owner)."""

    seq: int
    job_id: str
    event: str
    owner: str | None
    fence: int | None
    until: float | None
    at: float
    path: str | None = None
    reason: str | None = None
    holder: str | None = None
    current_fence: int | None = None


def holder_at(entries: Sequence[HistoryEntry], at: float) -> HistoryEntry | None:
    """Whose lease on the job was the current one at instant ``at``, from the job's entries in
    ``seq`` order: its latest claim (or recorded renewal) up to ``at``, or ``None`` if there was
    none or it had ended by then (released, completed, revoked, deleted). The entry's ``until``
    says whether that lease had already run out at ``at``: without recorded renewals it is
    the claim's, and a heartbeat may have kept the lease longer."""
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise InvalidArgumentType(
            f"entries must be a list of HistoryEntry (JobStore.history), got {type(entries).__name__}"
        )
    for e in entries:
        if not isinstance(e, HistoryEntry):
            raise InvalidArgumentType(
                f"entries must hold HistoryEntry values, got {type(e).__name__} {e!r:.80}"
            )
    at = check_time("at", at)
    current: HistoryEntry | None = None
    for e in entries:
        if e.at > at:
            break
        if e.event in ("claim", "renew"):
            current = e
        elif e.event in ("release", "complete", "revoke", "delete", "requeue"):
            current = None
    return current


class Outcome:
    """What one unit of work did that the history records: the unit notes it here, and its
    store records it once, at the unit's end, in the unit's transaction
    (:meth:`Recorder.record`). The notes are :class:`Recorder`'s own calls, in order."""

    __slots__ = ("notes",)

    def __init__(self) -> None:
        self.notes: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def clear(self) -> None:
        """A new attempt of the unit (the last one's transaction was rolled back)."""
        self.notes.clear()

    def leases(self, event: str, leases: Sequence[Lease], clock: Clock) -> None:
        """A claim or renewal of each lease (:meth:`Recorder.leases`)."""
        self.notes.append(("leases", (event, leases, clock), {}))

    def tokens(self, event: str, tokens: Sequence[tuple[str, str, int]], clock: Clock, **more: Any) -> None:
        """An event of each ``(job_id, owner, fence)`` (:meth:`Recorder.tokens`)."""
        self.notes.append(("tokens", (event, tokens, clock), more))

    def refusals(self, refusals: Sequence[Refusal], clock: Clock) -> None:
        """Refused writes (:meth:`Recorder.refusals`)."""
        self.notes.append(("refusals", (refusals, clock), {}))

    def copy(self, event: str, job_id: str, clock: Clock) -> None:
        """An event whose lease is the job's row as it is then (:meth:`Recorder.copy`)."""
        self.notes.append(("copy", (event, job_id, clock), {}))


class _NoOutcome(Outcome):
    """The outcome of a store that records no history: it keeps nothing."""

    __slots__ = ()

    def leases(self, event: str, leases: Sequence[Lease], clock: Clock) -> None:
        pass

    def tokens(self, event: str, tokens: Sequence[tuple[str, str, int]], clock: Clock, **more: Any) -> None:
        pass

    def refusals(self, refusals: Sequence[Refusal], clock: Clock) -> None:
        pass

    def copy(self, event: str, job_id: str, clock: Clock) -> None:
        pass


#: what a unit notes in when nothing is recorded
NO_OUTCOME: Outcome = _NoOutcome()


class Recorder:
    """What writes one store's history (with the statements of
    :class:`~fencing._sql.history.HistoryStatements`), and its prune schedule. A note's
    :class:`~fencing._store.ops.Clock` says whose instant ``at`` is: the caller's ``now``
    when it has one, else the database's clock inside the INSERT."""

    def __init__(self, history: History, jobs: Table) -> None:
        self.history = history
        self._sql = HistoryStatements(history.table, jobs)
        self._next_prune = 0.0

    @property
    def read(self) -> Executable:
        """One job's rows (bind ``job_id``), in ``seq`` order."""
        return self._sql.read

    @property
    def prune(self) -> Executable:
        """One batch of a prune (bind ``retention``)."""
        return self._sql.prune

    def _write(self, x: Executor, rows: list[dict[str, Any]], clock: Clock) -> None:
        caller = clock.caller
        at: dict[str, Any] = {"now": clock.now} if caller else {}
        done = 0
        while done < len(rows):
            size = min(_CHUNK, 1 << ((len(rows) - done).bit_length() - 1))
            params = dict(at)
            for i, row in enumerate(rows[done : done + size]):
                params.update({f"{f}_{i}": row.get(f) for f in FIELDS})
            x.count(self._sql.insert(caller, size), params)
            done += size

    def leases(self, x: Executor, event: str, leases: Sequence[Lease], clock: Clock) -> None:
        """A claim, renewal, release or completion of each lease."""
        if leases:
            rows = [
                {"job_id": le.job_id, "event": event, "owner": le.owner, "fence": le.fence, "until": le.until}
                for le in leases
            ]
            self._write(x, rows, clock)

    def tokens(
        self,
        x: Executor,
        event: str,
        tokens: Sequence[tuple[str, str, int]],
        clock: Clock,
        **more: Any,
    ) -> None:
        """An event of each ``(job_id, owner, fence)`` whose ``until`` the write did not say."""
        if tokens:
            rows = [{"job_id": j, "event": event, "owner": o, "fence": f, **more} for j, o, f in tokens]
            self._write(x, rows, clock)

    def refusals(self, x: Executor, refusals: Sequence[Refusal], clock: Clock) -> None:
        """Refused writes, each with the holder and fence the guard saw."""
        rows = [
            {
                "job_id": r.job_id,
                "event": "refused",
                "owner": r.owner,
                "fence": r.fence,
                "path": r.path,
                "reason": r.reason,
                "holder": r.holder,
                "current_fence": r.current_fence,
            }
            for r in refusals
        ]
        if rows:
            self._write(x, rows, clock)

    def copy(self, x: Executor, event: str, job_id: str, clock: Clock) -> None:
        """An event whose lease is the job's row as it is now (a revoke's new fence)."""
        stmt = self._sql.copy(clock.caller, event)
        x.count(stmt, {"job_id": job_id} if clock.now is None else {"job_id": job_id, "now": clock.now})

    def record(self, x: Executor, outcome: Outcome) -> None:
        """Write what a unit noted, in its transaction: the one hook every unit's history
        goes through. Renewals only if the history asks for them."""
        renewals = self.history.renewals
        for name, args, more in outcome.notes:
            if name == "leases" and args[0] == "renew" and not renewals:
                continue
            getattr(self, name)(x, *args, **more)

    def due(self) -> bool:
        """Whether an automatic prune is due (and, if so, the next one scheduled)."""
        if self.history.retention is None:
            return False
        now = time.monotonic()
        if now < self._next_prune:
            return False
        self._next_prune = now + self.history.prune_every
        return True

    def entries(self, rows: Sequence[Sequence[Any]]) -> list[HistoryEntry]:
        return [
            HistoryEntry(
                seq=int(r[0]),
                job_id=r[1],
                event=r[2],
                owner=r[3],
                fence=None if r[4] is None else int(r[4]),
                until=None if r[5] is None else float(r[5]),
                at=float(r[6]),
                path=r[7],
                reason=r[8],
                holder=r[9],
                current_fence=None if r[10] is None else int(r[10]),
            )
            for r in rows
        ]
