"""The waiters' queue of a named lock: no waiter starves.

Without a queue, a lock freed while several owners wait goes to whichever tries first, and
an owner that releases and at once takes the lock again (a loop of short critical sections)
can keep a waiter out for ever: the waiter pauses between tries, the loop does not. So a
waiter that finds the lock held takes a **ticket**: a row of the lock's waiters table,
numbered by the database in the order waiters arrived. From then on:

* a claim of the lock is refused, in its own ``WHERE``, while a live waiter of another owner
  holds a lower ticket than the claimer's (than any, for a claimer with no ticket): the
  queue's head takes the lock when it comes free, and a newcomer cannot cut in
  (:func:`fencing._sql.waiters.queue_guard`, put in the store's claim by :class:`LockStore`);
* a waiter keeps its ticket alive by refreshing it (``until``, every third of ``keep``), so
  the ticket of a waiter that died lapses within ``keep`` seconds and the queue moves on;
* between tries a waiter reads, in one statement, whether the lock is held and whether
  anyone is ahead of it (:meth:`WaitQueue.look`): waiting costs one read per pause, and a
  claim is tried only when it can succeed.

The queue is a matter of liveness, not of safety: one holder at a time is the claim's own
rule (``until <= now``), whatever the queue says. Elections do not queue (a candidate tries
only when no one leads), but their claims respect the queue of a name that also has waiters.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, ColumnElement, Connection, Index, MetaData, Table

from .._dialects import of
from .._runtime.execution import Executor
from .._sql.checks import check_new_table
from .._sql.schema import _OWNER, KEY_COLUMN, SECONDS
from .._sql.statements import ClaimGuard
from .._sql.waiters import TICKET, QueueStatements, WaiterStatements, queue_guard
from .context import Context
from .history import History
from .jobstore import JobStore
from .wakeups import Notifier

__all__ = ["LockStore", "WaitQueue", "lock_waiters_table", "waiters_of"]


def lock_waiters_table(metadata: MetaData, name: str, *, schema: str | None = None) -> Table:
    """The waiters' queue of a locks table, in ``metadata``: one row per waiting owner."""
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("ticket", TICKET, primary_key=True, autoincrement=True),
        Column("name", KEY_COLUMN, nullable=False),
        Column("owner", _OWNER, nullable=False),
        Column("until", SECONDS, nullable=False),
        Index(f"ix_{name}_queue", "name", "ticket"),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


def waiters_of(table: Table) -> Table:
    """The waiters' table of the locks ``table``: ``<name>_waiters`` in its ``MetaData``,
    added there if :func:`fencing.locks_table` did not put it there already."""
    key = f"{table.name}_waiters" if table.schema is None else f"{table.schema}.{table.name}_waiters"
    found = table.metadata.tables.get(key)
    if found is not None:
        return found
    return lock_waiters_table(table.metadata, f"{table.name}_waiters", schema=table.schema)


class WaitQueue:
    """The statements of one waiters' table (:mod:`fencing._sql.waiters`), run through
    ``store``'s engine as its own transactions (the store's runner: retried lock races,
    SQLite's ``BEGIN IMMEDIATE``; ``bridged``: the store's, behind an async front)."""

    def __init__(self, store: JobStore, waiters: Table, *, bridged: bool = False) -> None:
        self.waiters = waiters
        self.locks = store.table
        self._ctx = Context(store.engine, bridged=bridged, create_hint="Locks.create_table()")
        self._sql = WaiterStatements(store.table, waiters)

    def _s(self, now: float | None) -> tuple[QueueStatements, dict[str, Any]]:
        return self._sql.on(now is not None), ({} if now is None else {"now": now})

    def _run(self, unit: Any, *, write: bool = True) -> Any:
        return self._ctx.run(unit, None, self.waiters, write=write)

    def enter(self, name: str, owner: str, *, keep: float, now: float | None) -> int:
        """Queue ``owner`` for ``name`` for ``keep`` seconds: its ticket. The lapsed tickets
        of the name (waiters that died) are swept in the same transaction."""
        s, params = self._s(now)
        params = {**params, "name": name, "owner": owner, "keep": keep}

        def unit(x: Executor) -> int:
            x.count(s.sweep, params)
            x.count(s.enter, params)
            return int(x.rows(s.ticket_of, params)[0][0])

        return int(self._run(unit))

    def refresh(self, ticket: int, *, keep: float, now: float | None) -> bool:
        """Keep ``ticket`` alive ``keep`` more seconds; ``False``: it had lapsed (its waiter
        stalled past ``keep``), and its place is lost."""
        s, params = self._s(now)
        params = {**params, "my_ticket": ticket, "keep": keep}
        return bool(self._run(lambda x: x.count(s.refresh, params) == 1))

    def look(self, name: str, owner: str, ticket: int, *, now: float | None) -> bool:
        """Whether a try of ``ticket``'s holder could take ``name`` now: the lock is not held
        and no live waiter of another owner is ahead (one read, no lock taken)."""
        s, params = self._s(now)
        params = {**params, "name": name, "owner": owner, "my_ticket": ticket}
        row = self._run(lambda x: x.rows(s.look, params)[0], write=False)
        return not row[0] and not row[1]

    def leave(self, ticket: int) -> None:
        """Take ``ticket`` out of the queue (the lock was taken, or the wait ended)."""
        stmt = self._sql.on(True).leave  # the same on either clock
        self._run(lambda x: x.count(stmt, {"my_ticket": ticket}))


class LockStore(JobStore):
    """The store of a locks table: a :class:`~fencing.JobStore` whose claims respect the
    waiters' queue (:func:`~fencing._sql.waiters.queue_guard`), and whose ``create_table``
    creates the queue."""

    def __init__(
        self,
        engine: Any,
        table: Table,
        *,
        history: History | None = None,
        attempts: Table | None = None,
        _bridged: bool = False,
    ) -> None:
        self.waiters = waiters_of(table) if isinstance(table, Table) else None
        dialect = getattr(engine, "dialect", None)
        notifies = dialect is not None and of(dialect).notifies
        #: where the database can notify, what wakes a freed lock's waiters
        #: (:mod:`fencing._store.wakeups`)
        self.notifier = Notifier(table, self.waiters) if self.waiters is not None and notifies else None
        super().__init__(engine, table, history=history, attempts=attempts, _bridged=_bridged)

    def _freed_notice(self) -> ColumnElement[Any] | None:
        return None if self.notifier is None else self.notifier.notice

    def _claim_guard(self) -> ClaimGuard | None:
        return None if self.waiters is None else queue_guard(self.waiters)

    def _ensure_tables(self, conn: Connection) -> None:
        super()._ensure_tables(conn)
        if self.waiters is not None:
            self.waiters.create(conn, checkfirst=True)

    def __repr__(self) -> str:
        return super().__repr__().replace("<JobStore", "<LockStore", 1)


#: a waiter's ticket lapses this many polls after its last refresh (at least MIN_KEEP s)
KEEP_POLLS = 4
MIN_KEEP = 1.0


def keep_for(poll: float) -> float:
    """How long a waiter's ticket lives without a refresh, for waiters pausing at most
    ``poll`` seconds: a dead waiter holds the queue up at most this long."""
    return max(KEEP_POLLS * poll, MIN_KEEP)
