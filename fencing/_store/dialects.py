"""The store's plan on one database: the facts of :mod:`fencing._dialects` it acts on, and
the two choices built from them (how a job is enqueued, what a fenced block's first check
locks). Chosen once per store; a store asks its plan, never the dialect's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.sql import Executable

from .._dialects import of
from .._dialects.base import ARRAYS, COUNTED, DUPLICATE_KEY, EACH, LOCKING, RETURNED
from .._runtime.execution import Executor
from .._sql.dberrors import is_duplicate_key
from .._sql.statements import Statements
from .announcer import Announcer

__all__ = ["ARRAYS", "COUNTED", "DUPLICATE_KEY", "EACH", "LOCKING", "RETURNED", "DialectPlan", "plan_for"]


class DialectPlan:
    """What the store does on ``dialect``'s database (:class:`fencing._dialects.base.Database`
    says what differs; a database the library does not know gets the portable statements).

    ``returning``: the dialect's ``UPDATE ... RETURNING`` (SQLAlchemy says whether this
    server has it), so a claim or a renewal is one statement instead of an update and a read.
    """

    def __init__(self, dialect: Dialect) -> None:
        database = of(dialect)
        self.name = database.family
        #: how an insert that may exist already tells which happened (enqueue, fence marks,
        #: idempotency keys)
        self.upsert = database.upsert
        #: a writer locks the whole database (SQLite), not the rows it writes
        self.locks_whole_database = database.locks_whole_database
        #: its text columns can store U+0000
        self.text_holds_nul = database.text_holds_nul
        #: how a batch of completions is stored
        self.batch_completion = database.batch_completion
        #: a batched claim first makes the planner walk the ready index in claim order
        self.walks_claim_order = database.walks_claim_order
        self.dialect_name = dialect.name
        self.returning = bool(getattr(dialect, "update_returning", False))
        #: UTF-8 bytes a key column (job id, resource, idempotency key) holds; None: no limit
        self.max_key_bytes = database.id_max_bytes
        #: how finely the database's clock counts (seconds)
        self.clock_resolution = database.clock_resolution

    def enqueue(
        self, errors: tuple[type[BaseException], ...], announcer: Announcer, *, revive: bool = True
    ) -> Callable[[Executor, Statements, dict[str, Any]], bool]:
        """The insert of a new job, as this database upserts: ``True`` if inserted, ``False``
        if it exists (a deleted job's tombstone comes back, unless ``revive=False``).
        ``errors``: what a database call raises here; ``announcer``: whether it tells other
        processes' waiting claims (PostgreSQL's NOTIFY, :mod:`.announcer`)."""
        if self.upsert == COUNTED:
            if not revive:
                return lambda x, s, p: x.count(s.enqueue_new_sqlite, p) == 1
            return lambda x, s, p: x.count(s.enqueue_sqlite, p) == 1
        if self.upsert == RETURNED:

            def returned(x: Executor, s: Statements, p: dict[str, Any]) -> bool:
                if announcer.asks():
                    asking = (
                        s.enqueue_announcing_postgresql if revive else s.enqueue_new_announcing_postgresql
                    )
                    return announcer.heard(x.rows(asking, p))
                plain = s.enqueue_postgresql if revive else s.enqueue_new_postgresql
                return len(x.rows(plain, p)) == 1

            return returned

        def plain(x: Executor, s: Statements, p: dict[str, Any]) -> bool:
            try:
                return x.count(s.enqueue_plain, p) == 1
            except errors as exc:
                # the duplicate key means "exists"; only this statement is undone and the
                # transaction goes on: bring back a tombstone, if it is one
                if is_duplicate_key(exc):
                    return revive and x.count(s.revive, p) == 1
                raise

        return plain

    def enqueue_with_payload(
        self, errors: tuple[type[BaseException], ...], announcer: Announcer, *, revive: bool = True
    ) -> tuple[Callable[[Executor, Statements, dict[str, Any]], bool], bool]:
        """The insert of a new job with its payload (bind ``payload``: its JSON text), and
        whether that is one statement: on PostgreSQL the job's upsert and the payload's write
        are one ``INSERT`` with a data-modifying CTE (one round trip); elsewhere the job is
        inserted as :meth:`enqueue` does, then any payload left under its id goes and the new
        one goes in, in the same transaction."""
        if self.upsert == RETURNED:

            def returned(x: Executor, s: Statements, p: dict[str, Any]) -> bool:
                if announcer.asks():
                    asking = (
                        s.enqueue_with_payload_announcing_postgresql
                        if revive
                        else s.enqueue_new_with_payload_announcing_postgresql
                    )
                    return announcer.heard(x.rows(asking, p))
                plain = s.enqueue_with_payload_postgresql if revive else s.enqueue_new_with_payload_postgresql
                return len(x.rows(plain, p)) == 1

            return returned, True
        enqueue = self.enqueue(errors, announcer, revive=revive)

        def then_payload(x: Executor, s: Statements, p: dict[str, Any]) -> bool:
            if not enqueue(x, s, p):
                return False  # the job exists: its payload is left as it was
            x.count(s.forget_payload, p)
            x.count(s.put_payload, p)
            return True

        return then_payload, False

    def hold_statement(self, s: Statements, *, joined: bool) -> Executable:
        """The first check of a fenced block (or ``check(conn=)``): a locking read of the
        lease's row. ``joined``: in a transaction the store did not begin, where a database
        locked whole (SQLite) takes its write lock with an UPDATE now, so the block's own
        writes never lose a lock race."""
        return s.hold_lease if joined and self.locks_whole_database else s.lock_lease


def plan_for(dialect: Dialect) -> DialectPlan:
    """The plan for ``dialect``."""
    return DialectPlan(dialect)
