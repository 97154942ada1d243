"""Fence marks and idempotency keys: fencing for writes outside the jobs table.

A :class:`fencing.Lease` protects writes to the jobs table. Another system (a second
service, another database) protects its own writes with the same token through
:class:`FenceMarks`:

* :meth:`FenceMarks.accept` keeps, per resource, the highest fence seen and refuses a lower
  one. Call it in the same transaction (``conn=``) as the write it guards, so a stale
  worker's write is rolled back together with its refused token::

      with engine.begin() as conn:
          if not marks.accept("invoice-42", lease.fence, conn=conn):
              raise StaleLease("a newer lease already wrote invoice-42")
          conn.execute(invoices.update().values(total=99).where(invoices.c.id == 42))

  For a read -> modify -> write, accept the token in the read's transaction too: the write
  alone being fenced, an old holder that wakes between a newer holder's read and its write
  lands its write, which the newer one then overwrites.

* :meth:`FenceMarks.record_once` records an idempotency key: ``True`` the first time,
  ``False`` ever after, so a side effect that is retried (a re-delivered message, a worker
  that took over a job) happens once.

Both are compare-and-set: on SQLite and PostgreSQL one ``INSERT ... ON CONFLICT`` statement
whose ``WHERE`` is the guard; on MariaDB/MySQL the row is created if missing and locked, read
with ``SELECT ... FOR UPDATE`` and written under that lock in the same transaction, never read
and released first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import BigInteger, Column, Connection, Double, Engine, MetaData, Table
from sqlalchemy.schema import CreateTable

from .._dialects import KNOWN_NAMES, of
from .._errors import (
    ConfigurationError,
    InvalidArgument,
    InvalidArgumentType,
)
from .._runtime.execution import CallerConnection, Executor
from .._runtime.metrics import StoreMetrics
from .._runtime.refusals import logger as refused_logger
from .._sql.checks import FENCE_MAX, check_fence, check_new_table, check_sync_engine, show_value
from .._sql.dberrors import is_duplicate_key
from .._sql.marks import MarkStatements
from .._sql.schema import KEY_COLUMN
from .context import Context
from .dialects import COUNTED, RETURNED

__all__ = [
    "FenceMarks",
    "fence_marks",
    "fence_marks_table",
    "idempotency_keys",
    "idempotency_keys_table",
    "marks_metadata",
]

T = TypeVar("T")

#: the dialects FenceMarks has statements for
SUPPORTED_DIALECTS = KNOWN_NAMES


def fence_marks_table(metadata: MetaData, name: str = "fence_marks", *, schema: str | None = None) -> Table:
    """The highest fence accepted per ``resource``, in ``metadata``."""
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("resource", KEY_COLUMN, primary_key=True, nullable=False),
        Column("fence", BigInteger, nullable=False),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


def idempotency_keys_table(
    metadata: MetaData, name: str = "idempotency_keys", *, schema: str | None = None
) -> Table:
    """Recorded idempotency keys, in ``metadata``; ``fence`` and ``recorded_at`` are informational."""
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("key", KEY_COLUMN, primary_key=True, nullable=False),
        Column("fence", BigInteger, nullable=True),
        # seconds since the epoch on the database server's clock
        Column("recorded_at", Double, nullable=True),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


#: the default tables, apart from ``fencing.jobs.metadata`` so ``create_all`` there is unchanged
marks_metadata = MetaData()
fence_marks = fence_marks_table(marks_metadata)
idempotency_keys = idempotency_keys_table(marks_metadata)


class FenceMarks:
    """Fence marks and idempotency keys on two tables, through ``engine``.

    A SQLite engine must come from :func:`fencing.create_sqlite_engine` or have been passed
    through :func:`fencing.configure_sqlite`, as for :class:`fencing.JobStore`. Every
    method takes ``conn=``, a ``Connection`` of this engine that you hold: the statement
    then runs inside your transaction and commits (or rolls back) with your own writes.
    Without it, each call is its own transaction, retried when it loses a lock race.
    """

    def __init__(
        self,
        engine: Engine,
        marks: Table = fence_marks,
        keys: Table = idempotency_keys,
        *,
        _bridged: bool = False,
    ) -> None:
        # _bridged: the sync rules behind fencing.asyncio.AsyncFenceMarks (JobStore's _bridged)
        check_sync_engine(engine, instead="fencing.asyncio.AsyncFenceMarks")
        for name, table in (("marks", marks), ("keys", keys)):
            if not isinstance(table, Table):
                raise InvalidArgumentType(f"{name} must be a sqlalchemy Table, got {type(table).__name__}")
        if not of(engine.dialect).known:
            raise ConfigurationError(f"FenceMarks supports {SUPPORTED_DIALECTS}, got {engine.dialect.name!r}")
        #: the runner, the dialect's plan, the key checks and the metrics a store has
        self._ctx = Context(engine, bridged=_bridged, create_hint="FenceMarks.create_tables()")
        self.engine = engine
        self.marks = marks
        self.keys = keys
        self._s = MarkStatements(marks, keys)
        self._accept = self._accept_unit(self._ctx.plan.upsert)
        self._record = self._record_unit(self._ctx.plan.upsert)

    @property
    def metrics(self) -> StoreMetrics:
        """What these marks did, by outcome (:mod:`fencing._runtime.metrics`):
        ``accept.accepted``, ``accept.refused.older fence``, ``record_once.recorded``,
        ``record_once.duplicate``, and the lock races of their transactions."""
        return self._ctx.metrics

    @metrics.setter
    def metrics(self, metrics: StoreMetrics) -> None:
        self._ctx.metrics = self._ctx.runner.metrics = metrics

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<FenceMarks marks={self.marks.name!r} keys={self.keys.name!r} engine={url!r}>"

    # -- running statements ----------------------------------------------------------------

    def _run(self, unit: Callable[[Executor], T], conn: CallerConnection | None, table: Table) -> T:
        return self._ctx.run(unit, conn, table)

    def _key(self, name: str, value: object) -> str:
        """A resource or key this backend can store exactly (else an error, never truncation)."""
        return self._ctx.key(name, value)

    @staticmethod
    def _fence(value: object) -> int:
        fence = check_fence(value)
        if not 0 <= fence <= FENCE_MAX:
            raise InvalidArgument(f"fence must be between 0 and 2**63-1, got {show_value(fence)}")
        return fence

    # -- the tables ------------------------------------------------------------------------

    def create_tables(self, *, conn: CallerConnection | None = None) -> None:
        """Create both tables if missing (idempotent; an existing table is left as it is).

        On MariaDB/MySQL, DDL commits the caller's open transaction (the server does that).
        """

        def create(c: Connection) -> None:
            for table in (self.marks, self.keys):
                c.execute(CreateTable(table, if_not_exists=True))

        self._ctx.create(create, conn, self.marks)

    # -- fence marks -----------------------------------------------------------------------

    def accept(self, resource: str, fence: int, *, conn: CallerConnection | None = None) -> bool:
        """Store ``fence`` for ``resource`` unless a higher one was stored before.

        ``True``: ``fence`` is now the mark (equal to the mark is accepted, so the same lease
        may write twice). ``False``: a newer lease has been seen; nothing changed. The
        check and the write are one atomic step, also against concurrent callers.
        """
        params = {"res": self._key("resource", resource), "token": self._fence(fence)}
        accept, highest = self._accept, self._s.highest
        mark: list[int] = []

        def unit(x: Executor) -> bool:
            if accept(x, params):
                return True
            mark[:] = [int(x.rows(highest, params)[0][0])]  # refused: the newer mark, read now
            return False

        if self._run(unit, conn, self.marks):
            self._ctx.metrics.add("accept.accepted")
            return True
        res, token = params["res"], params["token"]
        self._ctx.metrics.add("accept.refused.older fence")
        refused_logger.warning(
            "refused accept of resource %r with fence %d: older than its mark %d",
            res,
            token,
            mark[0],
            extra={
                "path": "accept",
                "resource": res,
                "fence": token,
                "reason": "older fence",
                "mark": mark[0],
            },
        )
        return False

    def highest(self, resource: str, *, conn: CallerConnection | None = None) -> int | None:
        """The highest fence accepted for ``resource``, read now, or ``None`` if none was."""
        params = {"res": self._key("resource", resource)}
        stmt = self._s.highest

        def read(x: Executor) -> int | None:
            rows = x.rows(stmt, params)
            return None if not rows or rows[0][0] is None else int(rows[0][0])

        return self._run(read, conn, self.marks)

    # -- idempotency keys ------------------------------------------------------------------

    def record_once(
        self, key: str, *, fence: int | None = None, conn: CallerConnection | None = None
    ) -> bool:
        """Record ``key``: ``True`` the first time, ``False`` ever after (nothing changed).

        Of concurrent callers with the same key, exactly one gets ``True``. The pattern:
        record the key in the same transaction as the side effect's own write, so both
        commit together or neither does (a crash in between leaves no key behind):

            with engine.begin() as conn:
                if marks.record_once(f"charge:{order_id}", fence=lease.fence, conn=conn):
                    conn.execute(payments.insert().values(order_id=order_id, amount=99))

        ``fence`` (who recorded it) is stored for inspection only. For an effect that cannot
        join the transaction (an HTTP call), recording first gives at most once, recording
        after the effect at least once.
        """
        params: dict[str, Any] = {
            "idem": self._key("key", key),
            "token": None if fence is None else self._fence(fence),
        }
        record = self._record
        recorded = self._run(lambda x: record(x, params), conn, self.keys)
        self._ctx.metrics.add("record_once.recorded" if recorded else "record_once.duplicate")
        return recorded

    # -- the compare-and-set units, as the dialect's plan upserts -------------------------
    # (each statement is built at its first run: only this database's are ever built)

    def _accept_unit(self, upsert: str) -> Callable[[Executor, dict[str, Any]], bool]:
        s = self._s
        if upsert == COUNTED:
            return lambda x, p: x.count(s.accept_sqlite, p) == 1
        if upsert == RETURNED:
            return lambda x, p: len(x.rows(s.accept_postgresql, p)) == 1

        def locked(x: Executor, p: dict[str, Any]) -> bool:
            x.count(s.ensure_mark, p)  # a new resource is inserted with this token
            # a locking read: the current row, not the transaction's snapshot
            stored = x.rows(s.mark_for_update, p)[0][0]
            if stored > p["token"]:
                return False
            if stored == p["token"]:
                return True  # already the mark (or just inserted), and locked: nothing to write
            # the row is locked since the INSERT; the guard is repeated in the WHERE anyway
            return x.count(s.raise_mark, p) == 1

        return locked

    def _record_unit(self, upsert: str) -> Callable[[Executor, dict[str, Any]], bool]:
        s = self._s
        if upsert == COUNTED:
            return lambda x, p: x.count(s.record_sqlite, p) == 1
        if upsert == RETURNED:
            return lambda x, p: len(x.rows(s.record_postgresql, p)) == 1
        errors = self._ctx.errors

        def plain(x: Executor, p: dict[str, Any]) -> bool:
            try:
                x.count(s.record_plain, p)
            except errors as exc:
                # only the statement is undone: the caller's transaction goes on
                if is_duplicate_key(exc):
                    return False
                raise
            return True

        return plain
