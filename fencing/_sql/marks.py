"""The statements of fence marks and idempotency keys (:mod:`fencing._store.marks` runs
them). The guards live in ``WHERE``; each statement is built when first used, so a store
builds only the ones its database's way of upserting
(:attr:`fencing._dialects.base.Database.upsert`) runs:

* ``counted`` (SQLite): :attr:`MarkStatements.accept_sqlite`, :attr:`~MarkStatements.record_sqlite`;
* ``returned`` (PostgreSQL): :attr:`~MarkStatements.accept_postgresql`,
  :attr:`~MarkStatements.record_postgresql`;
* ``duplicate key`` (MariaDB/MySQL): :attr:`~MarkStatements.ensure_mark`,
  :attr:`~MarkStatements.mark_for_update`, :attr:`~MarkStatements.raise_mark`,
  :attr:`~MarkStatements.record_plain`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from sqlalchemy import ColumnElement, Table, bindparam, insert, select, update
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.sql import Executable

from .clock import database_now
from .schema import KEY_TYPE, as_text

__all__ = ["MarkStatements"]


class MarkStatements:
    """Every statement on the fence marks table ``marks`` and the idempotency keys table
    ``keys``.

    Bind parameters: ``res`` (a resource), ``token`` (the fence presented), ``idem`` (a key).
    Resources and keys are ``str``: typed :data:`~fencing._sql.schema.KEY_TYPE`, UTF-8 bytes
    where the columns are bytes (MariaDB/MySQL).
    """

    def __init__(self, marks: Table, keys: Table) -> None:
        self.marks = marks
        self.keys = keys

    @property
    def _mark(self) -> dict[str, Any]:
        return {"resource": bindparam("res", type_=KEY_TYPE), "fence": bindparam("token")}

    @property
    def _of_resource(self) -> ColumnElement[bool]:
        return self.marks.c.resource == bindparam("res", type_=KEY_TYPE)

    @property
    def _record(self) -> dict[str, Any]:
        return {
            "key": bindparam("idem", type_=KEY_TYPE),
            "fence": bindparam("token"),
            "recorded_at": database_now(),
        }

    @cached_property
    def highest(self) -> Executable:
        """The resource's mark."""
        return select(self.marks.c.fence).where(self._of_resource)

    # -- accept: equal is accepted (the same lease may write twice) ------------------------

    def _accept_on_conflict(self, dialect: Any, *returning: ColumnElement[Any]) -> Executable:
        """Insert the mark, or raise it unless it is higher, as SQLite and PostgreSQL both
        spell it (``dialect``: the module whose ``insert`` has ``on_conflict_do_update``),
        returning ``returning`` if given."""
        m = self.marks
        new = dialect.insert(m).values(self._mark)
        upsert = new.on_conflict_do_update(
            index_elements=[m.c.resource],
            set_={"fence": new.excluded.fence},
            where=m.c.fence <= new.excluded.fence,
        )
        stmt: Executable = upsert.returning(*returning) if returning else upsert
        return stmt

    @cached_property
    def accept_sqlite(self) -> Executable:
        """The row count says whether the mark was accepted."""
        return self._accept_on_conflict(sqlite)

    @cached_property
    def accept_postgresql(self) -> Executable:
        """``RETURNING``, not the row count: the answer does not depend on what the driver
        reports."""
        return self._accept_on_conflict(postgresql, self.marks.c.fence)

    @cached_property
    def ensure_mark(self) -> Executable:
        """MariaDB/MySQL: the affected-rows count of ON DUPLICATE KEY UPDATE cannot tell
        inserted from found (CLIENT_FOUND_ROWS), so this only makes sure the row exists and
        holds its lock; :attr:`mark_for_update` and :attr:`raise_mark` decide. (SELECT ... FOR
        UPDATE of a missing row first would take gap locks: two first accepts of one
        resource then deadlock on their INSERTs, and a caller's transaction is lost.)"""
        m = self.marks
        return mysql.insert(m).values(self._mark).on_duplicate_key_update(fence=m.c.fence)

    @cached_property
    def mark_for_update(self) -> Executable:
        """The resource's mark, read and locked (the current row, not a snapshot)."""
        return select(self.marks.c.fence).where(self._of_resource).with_for_update()

    @cached_property
    def raise_mark(self) -> Executable:
        """The mark raised to ``token`` unless it is higher."""
        m = self.marks
        return (
            update(m)
            .where(self._of_resource, m.c.fence <= bindparam("token"))
            .values(fence=bindparam("token"))
        )

    # -- record_once: insert-or-ignore, a key is recorded once and never overwritten -------

    @cached_property
    def record_sqlite(self) -> Executable:
        k = self.keys
        return sqlite.insert(k).values(self._record).on_conflict_do_nothing(index_elements=[k.c["key"]])

    @cached_property
    def record_postgresql(self) -> Executable:
        k = self.keys
        return (
            postgresql.insert(k)
            .values(self._record)
            .on_conflict_do_nothing(index_elements=[k.c["key"]])
            .returning(as_text(k.c["key"]))
        )

    @cached_property
    def record_plain(self) -> Executable:
        """MariaDB/MySQL: a plain insert; the duplicate-key error means "already recorded"
        (INSERT IGNORE would also turn real errors into warnings)."""
        return insert(self.keys).values(self._record)
