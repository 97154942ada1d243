"""What differs between databases, in one plan per dialect, chosen once per store.

A store (and :class:`~fencing.FenceMarks`) asks its plan, never the dialect's name: how a
job is enqueued, whether a claim is one ``UPDATE ... RETURNING`` or an ``UPDATE`` and a
read, how a batch of completions reaches the database, what a writer locks, which keys and
text the columns hold, and how finely the clock counts. A new dialect is a new subclass
here, not new flags across the store (alembic's ``DefaultImpl`` per dialect, the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from sqlalchemy.engine import Dialect
from sqlalchemy.sql import Executable

from .._runtime.execution import Executor
from .._sql.clock import RESOLUTION
from .._sql.dberrors import is_duplicate_key
from .._sql.schema import ID_MAX_BYTES
from .._sql.statements import Statements

__all__ = ["DialectPlan", "MySQLPlan", "PostgreSQLPlan", "SQLitePlan", "plan_for"]

#: how a batch of completions reaches the database (:attr:`DialectPlan.batch_completion`)
EACH, ARRAYS, LOCKING = "each", "returning", "locking"
#: how "insert unless it exists" answers (:attr:`DialectPlan.upsert`): the statement's row
#: count (SQLite's ``ON CONFLICT DO NOTHING``), its ``RETURNING`` rows (PostgreSQL's), or a
#: duplicate-key error that undoes only the statement (MariaDB/MySQL)
COUNTED, RETURNED, DUPLICATE_KEY = "counted", "returned", "duplicate key"


class DialectPlan:
    """The plan of a database the library does not know by name: the portable statements.

    ``returning``: the dialect's ``UPDATE ... RETURNING`` (SQLAlchemy says whether this
    server has it), so a claim or a renewal is one statement instead of an update and a read.
    """

    name: ClassVar[str] = "default"
    #: how an insert that may exist already tells which happened (enqueue, fence marks,
    #: idempotency keys)
    upsert: ClassVar[str] = DUPLICATE_KEY
    #: a writer locks the whole database (SQLite), not the rows it writes
    locks_whole_database: ClassVar[bool] = False
    #: its text columns can store U+0000
    text_holds_nul: ClassVar[bool] = True
    #: how a batch of completions is stored: one UPDATE each (no round trips to save), one
    #: UPDATE ... FROM unnest(arrays) RETURNING per chunk, or a locking read and one joined UPDATE
    batch_completion: ClassVar[str] = EACH
    #: a batched claim of the store's own first makes the planner walk the ready index in
    #: claim order (PostgreSQL on a never-analyzed table)
    walks_claim_order: ClassVar[bool] = False

    def __init__(self, dialect: Dialect) -> None:
        self.dialect_name = dialect.name
        self.returning = bool(getattr(dialect, "update_returning", False))
        #: UTF-8 bytes a key column (job id, resource, idempotency key) holds; None: no limit
        self.max_key_bytes: int | None = ID_MAX_BYTES.get(dialect.name)
        #: how finely the database's clock counts (seconds)
        self.clock_resolution = RESOLUTION.get(dialect.name, 1e-3)

    def enqueue(
        self, errors: tuple[type[BaseException], ...]
    ) -> Callable[[Executor, Statements, dict[str, Any]], bool]:
        """The insert of a new job, as this database upserts: ``True`` if inserted, ``False``
        if it exists (a deleted job's tombstone comes back). ``errors``: what a database call
        raises here."""
        if self.upsert == COUNTED:
            return lambda x, s, p: x.count(s.enqueue_sqlite, p) == 1
        if self.upsert == RETURNED:
            return lambda x, s, p: len(x.rows(s.enqueue_postgresql, p)) == 1

        def plain(x: Executor, s: Statements, p: dict[str, Any]) -> bool:
            try:
                return x.count(s.enqueue_plain, p) == 1
            except errors as exc:
                # the duplicate key means "exists"; only this statement is undone and the
                # transaction goes on: bring back a tombstone, if it is one
                if is_duplicate_key(exc):
                    return x.count(s.revive, p) == 1
                raise

        return plain

    def hold_statement(self, s: Statements, *, joined: bool) -> Executable:
        """The first check of a fenced block (or ``check(conn=)``): a locking read of the
        lease's row. ``joined``: in a transaction the store did not begin."""
        return s.lock_lease


class SQLitePlan(DialectPlan):
    """SQLite: one writer at a time (``BEGIN IMMEDIATE``), statements without round trips."""

    name = "sqlite"
    upsert = COUNTED
    locks_whole_database = True

    def hold_statement(self, s: Statements, *, joined: bool) -> Executable:
        # a transaction the store did not begin IMMEDIATE: an UPDATE takes the write lock now,
        # so the block's own writes never lose a lock race
        return s.hold_lease if joined else s.lock_lease


class PostgreSQLPlan(DialectPlan):
    """PostgreSQL: ``RETURNING``, ``ON CONFLICT``, arrays for batches, no U+0000 in text."""

    name = "postgresql"
    upsert = RETURNED
    text_holds_nul = False
    batch_completion = ARRAYS
    walks_claim_order = True


class MySQLPlan(DialectPlan):
    """MariaDB/MySQL: no ``UPDATE ... RETURNING``; a batch is a locking read and one UPDATE."""

    name = "mysql"
    batch_completion = LOCKING


_PLANS: dict[str, type[DialectPlan]] = {
    "sqlite": SQLitePlan,
    "postgresql": PostgreSQLPlan,
    "mysql": MySQLPlan,
    "mariadb": MySQLPlan,
}


def plan_for(dialect: Dialect) -> DialectPlan:
    """The plan for ``dialect`` (the portable one for a dialect not named here)."""
    return _PLANS.get(dialect.name, DialectPlan)(dialect)
