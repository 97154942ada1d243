"""The statements of a named lock's waiters' queue (:mod:`fencing._store.lock_queue` runs
them): the claim's guard that keeps a newcomer behind the queue, a waiter's ticket taken,
refreshed, looked from and given back, and what a freed lock sends its waiters where the
database notifies (:mod:`fencing._store.wakeups`).

Each statement is on one clock: the caller's (the bind parameter ``now``) or the
database's, and is built when first used on it.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Double,
    Integer,
    Table,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal,
    literal_column,
    select,
    update,
)
from sqlalchemy.sql import Executable

from .clock import database_now
from .schema import KEY_TYPE
from .statements import ClaimGuard

__all__ = ["TICKET", "QueueStatements", "WaiterStatements", "freed_notice", "queue_guard"]


#: tickets: a 64-bit counter on the servers, SQLite's rowid there (AUTOINCREMENT is not needed:
#: a ticket is compared only with live ones, and the highest is never reused while it lives)
TICKET = BigInteger().with_variant(Integer(), "sqlite")
_NO_TICKET: ColumnElement[int] = literal_column(str(2**63 - 1))
#: the waiter's own ticket (a bind parameter may not bear a column's name in an UPDATE's WHERE)
_MY_TICKET: ColumnElement[int] = bindparam("my_ticket", type_=TICKET)


def _key(name: str) -> ColumnElement[str]:
    return bindparam(name, type_=KEY_TYPE)


def queue_guard(waiters: Table) -> ClaimGuard:
    """A claim's extra condition: no live waiter of another owner is ahead of the
    claimer (whose place is its lowest live ticket; a claimer with none is behind all)."""
    w = waiters

    def no_one_ahead(now: ColumnElement[float]) -> ColumnElement[bool]:
        mine = (
            select(func.min(w.c.ticket))
            .where(w.c.name == _key("job_id"), w.c.owner == _key("holder"), w.c.until > now)
            .scalar_subquery()
        )
        ahead = exists().where(
            w.c.name == _key("job_id"),
            w.c.until > now,
            w.c.owner != _key("holder"),
            w.c.ticket < func.coalesce(mine, _NO_TICKET),
        )
        return ~ahead

    return no_one_ahead


def freed_notice(locks: Table, waiters: Table, channel: str) -> ColumnElement[Any]:
    """What a statement that frees a lock RETURNs on a database that notifies (PostgreSQL's
    ``pg_notify``): a notification on ``channel`` with the lock's name, from the lock's rows in
    the waiters' queue (no row, no notification), evaluated only for a row the statement
    changed."""
    w = waiters
    return (
        select(func.pg_notify(literal(channel), w.c.name))
        .where(w.c.name == locks.c.id)
        .limit(1)
        .correlate(locks)
        .scalar_subquery()
        .label("woken")
    )


class QueueStatements:
    """The queue's statements on one clock (``now``: a bind parameter or the database's).

    Bind parameters: ``name`` (the lock), ``owner``, ``keep`` (seconds a ticket lives),
    ``my_ticket``.
    """

    def __init__(self, locks: Table, w: Table, now: ColumnElement[float]) -> None:
        keep: ColumnElement[float] = bindparam("keep", type_=Double())
        name = w.c.name == _key("name")
        #: the name's lapsed tickets (waiters that died)
        self.sweep: Executable = delete(w).where(name, w.c.until <= now)
        self.enter: Executable = insert(w).values(name=_key("name"), owner=_key("owner"), until=now + keep)
        #: the ticket just taken: the newest of this owner for the name, in its transaction
        self.ticket_of: Executable = select(func.max(w.c.ticket)).where(name, w.c.owner == _key("owner"))
        self.refresh: Executable = (
            update(w).where(w.c.ticket == _MY_TICKET, w.c.until > now).values(until=now + keep)
        )
        held = (
            select(func.count())
            .select_from(locks)
            .where(locks.c.id == _key("name"), locks.c.until > now, locks.c.done == 0)
            .scalar_subquery()
        )
        ahead = (
            select(func.count())
            .select_from(w)
            .where(
                name,
                w.c.until > now,
                w.c.owner != _key("owner"),
                w.c.ticket < _MY_TICKET,
            )
            .scalar_subquery()
        )
        #: whether the lock is held and how many live waiters of others are ahead
        self.look: Executable = select(held.label("held"), ahead.label("ahead"))
        #: a ticket taken out of the queue
        self.leave: Executable = delete(w).where(w.c.ticket == _MY_TICKET)


class WaiterStatements:
    """The statements of the waiters' table ``waiters`` of the locks table ``locks``."""

    def __init__(self, locks: Table, waiters: Table) -> None:
        self.locks = locks
        self.waiters = waiters

    @cached_property
    def _by_caller(self) -> QueueStatements:
        return QueueStatements(self.locks, self.waiters, bindparam("now", type_=Double()))

    @cached_property
    def _by_database(self) -> QueueStatements:
        return QueueStatements(self.locks, self.waiters, database_now())

    def on(self, caller: bool) -> QueueStatements:
        """The statements on the caller's clock (``caller``) or the database's."""
        return self._by_caller if caller else self._by_database
