"""How a unit of work reaches the database: always on a connection from the engine's pool.

A *unit* is a function of an :class:`Executor` that runs one or more statements and returns a
plain value. The store and ``FenceMarks`` build units; a :class:`Runner` decides where they run:

* **In the caller's transaction** (``conn=``): a ``Connection`` or an ORM ``Session`` the
  caller holds (:func:`caller_connection`); the unit's statements go through Core and commit
  or roll back with the caller's own writes.
* **In a transaction of the store's own**, in one of two ways that run the same statements in
  the same transaction:

  - *through Core* (``engine.connect()``, ``begin()``, ``execute()``) whenever anything
    observes the engine: a connection event listener (``before_cursor_execute``,
    OpenTelemetry, sqlcommenter...), logging at INFO (``echo=True``, ``sqlalchemy.engine``),
    or execution options on the engine (``isolation_level``, ``schema_translate_map``): each
    applies to the store's statements as to the application's own;
  - *on the pooled DBAPI connection* otherwise: ``engine.raw_connection()`` checks a
    connection out of the pool (its size, overflow, timeout, pre-ping and pool events all
    apply), the statements, compiled once for the dialect, run on its cursor, and it goes back
    to the pool with its transaction already ended, so the pool has nothing to reset.
    SQLAlchemy's per-``execute`` bookkeeping (50-110 µs) is most of an operation's client
    time; nobody is there to see it skipped.

Every store transaction begins ``IMMEDIATE`` on SQLite (through the engine's
:class:`~fencing._runtime.writelock.WriteLock`: SQLite's busy handler for short waits, then priority
for the longest waiter, within ``busy_timeout``); PostgreSQL and MariaDB wait for row locks
in the server. A unit the database rolled back whole for a lock race (busy, deadlock, lock
timeout, serialization failure), at any statement or at ``COMMIT`` (PostgreSQL reports a
serialization failure there under ``SERIALIZABLE``; the transaction is gone, so nothing of
it was kept), is run again, bounded (:class:`LockWait`): a unit is the store's own
statements and returns nothing before it commits.

**A lost connection** (the server went away, the network cut it: :meth:`Runner._lost`, one
rule for both ways, both fronts and every driver) is one of two things, by where it was lost:

* *before the commit was sent* (connecting, at ``BEGIN``, at any statement of a transaction,
  or half-way through sending one): the server rolls the transaction back, so nothing was
  kept. A connection that was already dead when the unit began (closed by the server while
  idle in the pool) is replaced and the unit run once more; anything else comes out as
  :class:`~fencing.DatabaseUnavailable`, and the caller may try again.
* *once the commit was sent* (its ``COMMIT``, the end of a pipeline that carries it, or, in
  autocommit, the one statement that is its own transaction; a fenced block's ``COMMIT``
  too): the server may have committed it with the answer lost on the way. That unit is
  never run again as if nothing had happened (a claim would hand out a second fence);
  :class:`~fencing.OutcomeUnknown` says so, and the caller reads the state to learn which.

A fenced block's own statement that lost the connection is
:class:`~fencing.DatabaseUnavailable` as well (:mod:`fencing._store.fenced`): the ``COMMIT``
is the store's, sent only after the block. ``tests/faults/test_connection_cuts.py`` cuts every
writing operation at each of these points.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from sqlalchemy import Connection, Engine, Table, TypeDecorator, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import Executable

from .. import durability
from .._dialects import of, same
from .._errors import ConfigurationError, DatabaseBusy, InvalidArgumentType, OutcomeUnknown
from .._sql.dberrors import DB_ERRORS, driver_errors, is_transient, is_unavailable
from . import bridge, events, forks, identity
from .admission import (
    Observers,
    autocommit_probe,
    refuse_autocommit_connection,
    refuse_autocommit_engine,
    refuse_sharing_pool,
)
from .metrics import LOCK_WAIT_MIN
from .private_sqlalchemy import FLOAT_BINDING, Checkout, give_back, retire_older
from .profile import EngineProfile, profile_of
from .writelock import busy_error, poll_pause

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, scoped_session

    from .metrics import StoreMetrics

__all__ = [
    "DRIVER_PATH",
    "BlockExecutor",
    "CallerConnection",
    "CoreExecutor",
    "Executor",
    "LockWait",
    "Runner",
    "caller_connection",
]

T = TypeVar("T")

#: what ``conn=`` takes: a Connection, or an ORM Session (or ``scoped_session``) in whose
#: transaction the operation runs
CallerConnection: TypeAlias = "Connection | Session | scoped_session[Any]"

#: whether a store drives the pooled connections of a driver its database allows
#: (``driven_directly``: statements compiled once; asyncpg only ever inside the async front's
#: bridge, its adapter awaiting each call there); ``False`` sends every statement through Core
#: (``benchmarks/one_road.py`` sets it to compare), read when a store's runner is made
DRIVER_PATH = True
#: retries of a unit a server rolled back for a lock race (deadlock, serialization failure)
TRANSIENT_RETRIES = 20
#: the longest pause between two attempts: 21 attempts then span ~1.5 s (at 50 ms, ~0.4 s:
#: 16 threads claiming under SERIALIZABLE saw a claim lose 21 races in a row; at 200 ms, 32 did not)
_BACKOFF_CAP = 0.2


def backoff(attempt: int) -> None:
    """Sleep a little, jittered, longer each attempt (at most :data:`_BACKOFF_CAP`)."""
    # inside asyncio's bridge only this task waits: the loop runs on
    bridge.sleep(random.uniform(0, min(_BACKOFF_CAP, 0.001 * 2**attempt)), time.sleep)


class LockWait:
    """How long a unit that lost a lock race is tried again.

    ``budget`` (SQLite): seconds from the first lost race, the engine's ``busy_timeout``,
    tried again after every :func:`~fencing._runtime.writelock.poll_pause`; this covers what
    :class:`~fencing._runtime.writelock.WriteLock` does not: a race lost after ``BEGIN`` or by a
    read. ``None`` (servers, which wait for row locks themselves): up to
    :data:`TRANSIENT_RETRIES` more attempts after :func:`backoff`.
    """

    __slots__ = ("budget",)

    def __init__(self, budget: float | None) -> None:
        self.budget = budget

    def again(self, attempt: int, started: float) -> bool:
        """After the ``attempt``-th lost race of a call that began at ``started``
        (``time.monotonic()``): sleep and return True, or False when the budget is spent."""
        if self.budget is None:
            if attempt > TRANSIENT_RETRIES:
                return False
            backoff(attempt)
            return True
        left = started + self.budget - time.monotonic()
        if left <= 0:
            return False
        poll_pause(attempt, left)
        return True

    def busy(self, exc: BaseException) -> DatabaseBusy:
        """The error for a call that spent its budget (raise it ``from exc``)."""
        if self.budget is None:
            return DatabaseBusy(f"lost {TRANSIENT_RETRIES + 1} lock races in a row; nothing was changed")
        return busy_error(self.budget, exc)


def _unknown_outcome() -> OutcomeUnknown:
    return OutcomeUnknown(
        "the connection died while the write was committing (its COMMIT, or the one statement "
        "that is its own transaction): the outcome is unknown; read the job's state before acting on it"
    )


class Executor(Protocol):
    """What a unit of work may do: run a statement and get rows or a row count."""

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]: ...

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int: ...


class CoreExecutor:
    """Runs statements with ``Connection.execute`` (inside whatever transaction it has)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        return self.conn.execute(stmt, params).all()

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        return self.conn.execute(stmt, params).rowcount


def caller_connection(conn: object, table: Table) -> Connection:
    """The ``Connection`` of what a caller passed as ``conn=``: a Connection, or the one an
    ORM ``Session`` (or ``scoped_session``) uses for ``table``, in the session's transaction."""
    if isinstance(conn, Connection):
        return conn
    orm = sys.modules.get("sqlalchemy.orm")  # a Session exists only once the ORM was imported
    if orm is not None and isinstance(conn, (orm.Session, orm.scoped_session)):
        try:
            connection: Connection = conn.connection(bind_arguments={"clause": table})
        except sa_exc.UnboundExecutionError as exc:
            raise ConfigurationError(f"the Session has no bind for table {table.name!r}: {exc}") from None
        return connection
    raise InvalidArgumentType(
        f"conn must be a sqlalchemy Connection, an ORM Session or None, got {type(conn).__name__}"
    )


class _Compiled:
    """One statement compiled for the driver: its SQL, argument builder and row converter."""

    __slots__ = ("args", "convert", "sql")

    def __init__(self, stmt: Executable, dialect: Any) -> None:
        compiled: Any = stmt.compile(dialect=dialect)  # type: ignore[attr-defined]
        self.sql: str = compiled.string
        names = compiled.positiontup if compiled.positional else list(compiled.binds)
        binds: list[tuple[str | None, str, Any]] = []
        for name in names:
            bind = compiled.binds[name]
            if bind.expanding or bind.callable is not None:
                raise AssertionError(f"driver path cannot bind {name!r} of {self.sql}")
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is FLOAT_BINDING:  # the store's numbers are floats already (fencing.checks)
                process = None
            if bind.required:  # bindparam("job_id"): from the call's parameters
                binds.append((bind.key, name, process))
            else:  # a constant SQLAlchemy bound itself, e.g. SQLite's OFFSET after a LIMIT
                value = bind.effective_value
                binds.append((None, name, value if process is None else process(value)))
        self.args = _positional(binds) if compiled.positional else _named(binds)
        # the driver's own values are what SQLAlchemy returns too, except for our own
        # TypeDecorators (MariaDB's UTF-8 byte keys), which must be decoded
        impls = [c.type.dialect_impl(dialect) for c in getattr(stmt, "exported_columns", ())]
        self.convert = _converter(
            [i.result_processor(dialect, None) if isinstance(i, TypeDecorator) else None for i in impls]
        )


def _positional(binds: list[tuple[str | None, str, Any]]) -> Callable[[Mapping[str, Any]], Any]:
    keys = tuple(key for key, _, p in binds if key is not None and p is None)
    if len(keys) == len(binds):  # the common case: every value as it is, from the call
        return lambda params: [params[k] for k in keys]
    items = tuple((key, p) for key, _, p in binds)
    return lambda params: [_value(params, key, p) for key, p in items]


def _named(binds: list[tuple[str | None, str, Any]]) -> Callable[[Mapping[str, Any]], Any]:
    items = tuple(binds)
    return lambda params: {name: _value(params, key, p) for key, name, p in items}


def _value(params: Mapping[str, Any], key: str | None, p: Any) -> Any:
    """A parameter (processed if its type says so), or, without a key, the constant ``p``."""
    if key is None:
        return p
    return params[key] if p is None else p(params[key])


def _converter(processors: list[Any]) -> Callable[[list[Any]], list[Any]] | None:
    if all(p is None for p in processors):
        return None
    procs = tuple(processors)
    return lambda rows: [
        tuple(v if p is None else p(v) for v, p in zip(row, procs, strict=True)) for row in rows
    ]


class _DriverExecutor:
    __slots__ = ("compiled", "cursor")

    def __init__(self, cursor: Any, compiled: Callable[[Executable], _Compiled]) -> None:
        self.cursor = cursor
        self.compiled = compiled

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        c = self.compiled(stmt)
        self.cursor.execute(c.sql, c.args(params))
        rows = self.cursor.fetchall()
        return rows if c.convert is None else c.convert(rows)

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        c = self.compiled(stmt)
        self.cursor.execute(c.sql, c.args(params))
        return self.cursor.rowcount  # type: ignore[no-any-return]


class _PipelinedExecutor(_DriverExecutor):
    """A driver executor in autocommit whose first statement is sent in the driver's
    pipeline with ``BEGIN``, the ``prelude`` and ``COMMIT``: one transaction, one round trip.
    The statements after it (reads) run as a driver executor's, each its own."""

    __slots__ = ("pipe", "prelude", "sent")

    def __init__(
        self,
        cursor: Any,
        compiled: Callable[[Executable], _Compiled],
        driver_connection: Any,
        prelude: Sequence[Executable],
        profile: EngineProfile,
    ) -> None:
        super().__init__(cursor, compiled)
        self.pipe = profile.pipe(driver_connection)
        self.prelude: Sequence[Executable] | None = prelude
        #: the cursor the first statement's answer is read from
        self.sent: Any = None

    def _first(self, stmt: Executable, params: Mapping[str, Any]) -> _Compiled | None:
        prelude = self.prelude
        if prelude is None:
            return None
        self.prelude = None
        c = self.compiled(stmt)
        pipe = self.pipe
        self.sent = cursor = pipe.cursor()
        with pipe.pipeline():
            pipe.command(pipe.begin())
            for setup in prelude:
                pipe.send(pipe.cursor(), self.compiled(setup).sql)
            pipe.send(cursor, c.sql, c.args(params))
            pipe.command("COMMIT")
        return c

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        c = self._first(stmt, params)
        if c is None:
            return super().rows(stmt, params)
        rows = self.pipe.fetchall(self.sent)
        return rows if c.convert is None else c.convert(rows)

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        if self._first(stmt, params) is None:
            return super().count(stmt, params)
        return self.sent.rowcount  # type: ignore[no-any-return]


class BlockExecutor:
    """The store's own statements in a block of the caller's (a fenced block), on the driver
    connection under the block's Core ``Connection``, each sent in the driver's pipeline: the
    first goes with ``BEGIN`` (one round trip), and :meth:`commit_unless_lost` sends the
    block's end with its ``COMMIT`` (one more). From :meth:`Runner.block`.

    psycopg waits for the answer to the ``BEGIN`` it sends itself, even in a pipeline; so the
    first statement is sent in autocommit after a ``BEGIN`` of the executor's own (with the
    isolation level the engine set: :meth:`Pipe.begin`), and the connection stays in
    autocommit (inside that transaction, which every statement of the block joins) until it
    ends: :meth:`restore` puts it back as the pool gave it.

    In autocommit, a statement sent with no transaction open would commit on its own: so
    whenever none is (the block committed or rolled back inside itself, by Core or by raw
    SQL), the next statement, the block's (:meth:`before_statement`, a listener on the
    block's ``Connection``) or the store's, begins one first, as psycopg does out of
    autocommit; the block's end then checks the lease in that transaction."""

    __slots__ = ("compiled", "conn", "core", "pipe", "profile", "runner")

    def __init__(self, core: Connection, runner: Runner) -> None:
        self.conn: Any = core.connection.dbapi_connection
        self.compiled = runner._compiled_for
        self.core = core
        self.runner = runner
        self.profile = runner._profile
        self.pipe = self.profile.pipe(core.connection.driver_connection)

    def _send(self, stmt: Executable, params: Mapping[str, Any]) -> tuple[_Compiled, Any]:
        c = self.compiled(stmt)
        pipe = self.pipe
        begin = self._must_begin()
        cursor = pipe.cursor()
        with pipe.pipeline():
            if begin is not None:
                pipe.command(begin)
            pipe.send(cursor, c.sql, c.args(params))
        return c, cursor

    def _must_begin(self) -> str | None:
        """The ``BEGIN`` to send with the next statement if no transaction is open, the
        driver put in autocommit for it (see the class), before its pipeline: psycopg waits
        for the server to set autocommit in one)."""
        if not self.pipe.idle():
            return None
        if not self.conn.autocommit:
            self.profile.autocommit(self.conn, True)
        return self.pipe.begin()

    def before_statement(self, *_: Any) -> None:
        """A ``before_cursor_execute`` listener on the block's ``Connection``: the block's own
        statement runs in a transaction even after the block ended one inside itself."""
        begin = self._must_begin()
        if begin is not None:
            self.pipe.command(begin)

    def restore(self) -> None:
        """Once the block's transaction has ended: the connection out of autocommit again,
        or, if it cannot be (its transaction not ended: a dead connection), not kept."""
        if not self.conn.autocommit:
            return
        try:
            if not self.pipe.idle():
                self.conn.rollback()
            self.profile.autocommit(self.conn, False)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.core.invalidate(exc)

    def rows(self, stmt: Executable, params: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
        c, cursor = self._send(stmt, params)
        rows = self.pipe.fetchall(cursor)
        return rows if c.convert is None else c.convert(rows)

    def count(self, stmt: Executable, params: Mapping[str, Any]) -> int:
        _, cursor = self._send(stmt, params)
        return cursor.rowcount  # type: ignore[no-any-return]

    def commit_unless_lost(self, stmt: Executable, params: Mapping[str, Any], lost: str) -> bool:
        """Send ``stmt``, which fails with an error naming ``lost`` when the block must not
        commit, and ``COMMIT`` after it, together: True once committed. False when ``stmt``
        failed so: the transaction is then as it was before ``stmt`` (its row locks held,
        for the reason to be read in it) and must be rolled back. A connection lost on the
        way leaves the outcome unknown (:class:`OutcomeUnknown` says so)."""
        c = self.compiled(stmt)
        pipe = self.pipe
        begin = self._must_begin()  # the block ended its transaction and sent nothing since
        try:
            with pipe.pipeline():
                if begin is not None:
                    pipe.command(begin)
                pipe.command("SAVEPOINT fencing_end")
                pipe.send(pipe.cursor(), c.sql, c.args(params))
                pipe.command("RELEASE SAVEPOINT fencing_end")
                pipe.command("COMMIT")
            self.restore()
            return True
        except self.runner.errors as exc:
            if lost in str(exc):
                pipe.command("ROLLBACK TO SAVEPOINT fencing_end")
                return False
            if self.runner._lost(exc, self.conn):
                with contextlib.suppress(Exception):
                    self.core.invalidate(exc)
                raise _unknown_outcome() from exc
            raise


def _after(prelude: Sequence[Executable], unit: Callable[[Executor], T]) -> Callable[[Executor], T]:
    """``unit``, run after the ``prelude`` statements in the same transaction."""

    def after(x: Executor) -> T:
        for setup in prelude:
            x.count(setup, {})
        return unit(x)

    return after


class Runner:
    """Runs units of work on ``engine``'s pooled connections (see the module's docstring).

    ``errors``: what a database call can raise here (SQLAlchemy's errors and the driver's
    own); they are retried, or passed up for the caller to wrap.
    """

    @classmethod
    def admit(cls, engine: Engine, *, bridged: bool = False) -> Runner:
        """The runner for a store (or ``FenceMarks``) on ``engine``, after refusing an engine
        under which lock + check + write cannot be one transaction (:class:`ConfigurationError`):
        a SQLite engine without the library's ``BEGIN IMMEDIATE`` listener, ``AUTOCOMMIT`` on
        a server, a pool that shares one connection between transactions. An asyncio
        driver's engine only for the async fronts (``bridged``: :mod:`fencing.asyncio`)."""
        if getattr(engine.dialect, "is_async", False) and not bridged:
            raise ConfigurationError(
                f"the engine's driver ({engine.dialect.driver}) is an asyncio driver: its "
                "statements must be awaited; use fencing.asyncio.AsyncJobStore (or "
                "AsyncFenceMarks) with the AsyncEngine"
            )
        profile = profile_of(engine)
        if profile.refusal is not None:
            raise ConfigurationError(profile.refusal)
        refuse_sharing_pool(engine)
        refuse_autocommit_engine(engine)
        # SQLAlchemy's errors, and the driver's own on the fast path, which calls it directly
        return cls(engine, DB_ERRORS + driver_errors(engine), profile)

    def __init__(
        self, engine: Engine, errors: tuple[type[BaseException], ...], profile: EngineProfile | None = None
    ) -> None:
        self.engine = engine
        self.errors = errors
        dialect = engine.dialect
        #: what this database's transactions need (the engine layer's answer: the runner knows
        #: no dialect)
        self._profile = profile = profile_of(engine) if profile is None else profile
        #: a lock every writer takes at BEGIN (SQLite's): the runner's BEGIN waits for it the
        #: library's way (the longest waiter next)
        self._write_lock = profile.write_lock
        #: whether anything observes the engine (its own begin listener, SQLite's, does not)
        self._observers = Observers(engine, profile.own_listeners)
        self._fast = DRIVER_PATH and of(dialect).driven_directly(dialect.driver)
        self._root = forks.root(engine)
        self._checkout_from = Checkout(engine)
        self._autocommit = autocommit_probe(engine)
        #: the pool whose database says who it is (:meth:`_know_database`)
        self._known_pool: Any = None
        #: the pool whose database keeps what it acknowledges (:meth:`_know_durability`)
        self._durable_pool: Any = None
        #: the blocks' guards where a connection takes no listener (:meth:`_keep_in_a_transaction`)
        self._guards: weakref.WeakKeyDictionary[Connection, Callable[..., None]] | None = None
        self.lock_wait = LockWait(profile.busy_timeout)
        self._compiled: dict[int, tuple[Executable, _Compiled]] = {}
        #: the owner of the engine has disposed of it for good (:meth:`retire`)
        self.retired = False
        #: where lost lock races and lock waits are counted (the store's metrics), if anywhere
        self.metrics: StoreMetrics | None = None
        forks.register(engine)

    def retire(self) -> None:
        """The engine's owner is done with it (a cache evicted the store) while threads may
        still use it: from now on every connection handed back is closed, not kept. Call it
        before ``engine.dispose()``: a connection returned meanwhile is closed by one or
        the other."""
        self.retired = True

    # -- the caller's transaction -----------------------------------------------------------

    def caller(self, conn: object, table: Table) -> Connection:
        """The caller's ``Connection`` (or its Session's), checked: same kind of database,
        a real transaction, usable in this process."""
        self._usable_here()
        connection = caller_connection(conn, table)
        if not same(connection.dialect, self.engine.dialect):
            raise ConfigurationError(
                f"conn is a {connection.dialect.name} connection; this store's engine is "
                f"{self.engine.dialect.name}"
            )
        refuse_autocommit_connection(connection, self._autocommit)
        return connection

    # -- the store's own transactions ---------------------------------------------------------

    def run(
        self,
        unit: Callable[[Executor], T],
        *,
        write: bool = True,
        job: str | None = None,
        single: bool = False,
        prelude: Sequence[Executable] = (),
    ) -> T:
        """Run ``unit`` in a transaction of its own, retrying lock races and a dead idle
        connection. ``write=False`` is for units that only read: on SQLite they take no
        write lock (one statement on the fast path runs as its own snapshot). ``job``: the
        one job the unit is about, if it is (for the log line of a retry).

        ``single``: the unit's first statement is all it writes, and whatever it runs after
        that only reads (a refusal's reason), so where the database allows it
        (``statement_commits``: PostgreSQL) that statement is its own transaction, in
        autocommit: one round trip instead of BEGIN, the statement and COMMIT.

        ``prelude``: statements without parameters that set up the transaction (``SET
        LOCAL``), run first in it. With ``single``, where the driver pipelines (psycopg),
        BEGIN, the prelude, the unit's first statement and COMMIT are sent together: one
        round trip still; elsewhere the unit runs in a transaction as without ``single``."""
        self._usable_here()
        verdict = _Verdict()
        single = single and self._profile.statement_commits
        fast = self._fast and not self._observers
        if prelude and not (single and fast and self._profile.pipelines):
            single = False
            unit = _after(prelude, unit)
            prelude = ()
        if fast:
            try:  # the usual case: once, without the retry loop's own cost
                return self._on_driver(unit, write, verdict, single, prelude)
            except self.errors as exc:
                if verdict.again is None:
                    raise
                return self._retrying(
                    lambda v: self._on_driver(unit, write, v, single, prelude), verdict, exc, job
                )
        try:
            return self._on_core(unit, write, verdict, single)
        except self.errors as exc:
            if verdict.again is None:
                raise
            return self._retrying(lambda v: self._on_core(unit, write, v, single), verdict, exc, job)

    def read_row(self, stmt: Executable, params: Mapping[str, Any]) -> Any:
        """The first row (or ``None``) of one read statement: the hot path of ``state()``.

        On SQLite's fast path it runs outside any explicit transaction: one SELECT is its own
        snapshot and takes no write lock. Anything unusual goes to :meth:`run`.
        """
        self._usable_here()
        if not (self._profile.reads_without_transaction and self._fast) or self._observers:
            rows = self.run(lambda x: x.rows(stmt, params), write=False, single=True)
            return rows[0] if rows else None
        compiled = self._compiled_for(stmt)
        held, lean, pool = self._checkout()
        try:
            row = held.dbapi_connection.execute(compiled.sql, compiled.args(params)).fetchone()
        except self.errors:
            self._checkin(held, lean, pool, ended=False)
            rows = self.run(lambda x: x.rows(stmt, params), write=False)
            return rows[0] if rows else None
        self._checkin(held, lean, pool, ended=True)
        if row is None or compiled.convert is None:
            return row
        return compiled.convert([row])[0]

    @contextlib.contextmanager
    def transaction(self, *, write: bool = True, single: bool = False) -> Iterator[Connection]:
        """A Core ``Connection`` from the pool in a transaction of the store's own
        (``IMMEDIATE`` on SQLite when ``write``): committed when the block ends, rolled back
        if it raises. Not retried: the block is the caller's.

        A block that ``fork()``-ed: the child never ends, returns or closes the parent's
        transaction (it raises :class:`ConfigurationError` instead); the parent's is untouched.
        """
        with self._transaction(write, single, pipelined=False, block=False) as (conn, _):
            yield conn

    def _keep_in_a_transaction(self, conn: Connection, executor: BlockExecutor | None) -> None:
        """A ``before_cursor_execute`` listener on a block's ``Connection``: a statement of
        the block that finds no transaction open (the block ended one itself, by Core or by
        raw SQL) begins one first, as the store's own ``BEGIN`` would, instead of committing
        on its own; the block's end check then runs in that transaction. Drivers out of
        autocommit (psycopg's Core path, pymysql) begin one by themselves; SQLite's and
        asyncpg's are begun by the library (:meth:`EngineProfile.begin_again`), the
        pipelined block's by its executor."""
        guard: Callable[..., None]
        if executor is not None:
            guard = executor.before_statement
        else:
            dbapi, driver = conn.connection.dbapi_connection, conn.connection.driver_connection
            profile = self._profile
            #: the transaction SQLAlchemy had at the block's last statement
            seen: list[Any] = [None]

            def guard(c: Connection, _cursor: Any, statement: str, *_: Any) -> None:
                current = c.get_transaction()
                if current is not seen[0]:
                    # one SQLAlchemy began: the driver (or the engine's listener) begins it now
                    seen[0] = current
                    return
                if not statement.startswith("BEGIN") and profile.ended_its_transaction(driver):
                    profile.begin_again(dbapi, driver, self.errors)

        try:
            event.listen(conn, "before_cursor_execute", guard)
        except sa_exc.InvalidRequestError:
            # SQLAlchemy 2.0 takes no listener on a connection of an engine made by
            # execution_options() (which runs through Core anyway): one on that engine, once,
            # hands each block's statements to its guard
            if self._guards is None:
                self._guards = weakref.WeakKeyDictionary()
                event.listen(conn.engine, "before_cursor_execute", self._guard_of_block)
            self._guards[conn] = guard

    def _guard_of_block(self, conn: Connection, *args: Any) -> None:
        guard = None if self._guards is None else self._guards.get(conn)
        if guard is not None:
            guard(conn, *args)

    def _isolated(self, pooled: Any) -> bool:
        """Whether the engine chose an isolation level for its transactions (on the engine,
        or on each connection: ``create_engine(isolation_level=...)``): then the store's
        transactions have it too, and none runs in autocommit. ``pooled``: the pool's entry
        (or its proxy) of the connection."""
        options = self.engine.get_execution_options()
        return "isolation_level" in options or self._profile.isolated(
            pooled.dbapi_connection, pooled.driver_connection
        )

    @contextlib.contextmanager
    def block(self) -> Iterator[tuple[Connection, BlockExecutor | None]]:
        """:meth:`transaction` for a block of the caller's statements between the store's
        own, and the :class:`BlockExecutor` for the store's: where the driver pipelines
        (psycopg) and nothing observes the engine (else the store's statements go through
        Core, for them to be seen), else None."""
        pipelined = self._profile.pipelines and self._fast and not self._observers
        with self._transaction(True, False, pipelined=pipelined, block=True) as both:
            yield both

    @contextlib.contextmanager
    def _transaction(
        self, write: bool, single: bool, *, pipelined: bool, block: bool
    ) -> Iterator[tuple[Connection, BlockExecutor | None]]:
        self._usable_here()
        generation = forks.GENERATION[0]
        pool = self.engine.pool
        conn = self.engine.connect()
        fairy = conn.connection
        forks.in_use(fairy, self._root)
        executor = None
        try:
            self._know_database(fairy)
            self._know_durability(fairy)
            refuse_autocommit_connection(conn, self._autocommit)
            options = self._profile.begin_options(write=write)
            if single and not self._isolated(fairy):
                # one statement, its own transaction (see run); reset at checkin
                if self._profile.closed_by_server(fairy.driver_connection):
                    retire_older(pool, fairy, None)
                    conn.invalidate()  # nothing was sent: the next statement reconnects
                options = {**options, "isolation_level": "AUTOCOMMIT"}
            if options:
                conn.execution_options(**options)
            conn.begin()
            if pipelined:
                executor = BlockExecutor(conn, self)
            if block:  # the caller's statements: never one outside the block's transaction
                self._keep_in_a_transaction(conn, executor)
            # the transaction the connection has when the block ends is the one to end: a
            # block may have committed (or rolled back) its first one and begun another
            try:
                yield conn, executor
            except BaseException:
                if forks.GENERATION[0] == generation:
                    with contextlib.suppress(Exception):  # a dead connection: the block's error matters
                        conn.rollback()
                raise
            if forks.GENERATION[0] != generation:
                raise forked_away()
            try:
                conn.commit()
            except self.errors as exc:
                if self._lost(exc, fairy.dbapi_connection):
                    # the COMMIT was sent, or may have been: the block's writes may be kept
                    raise _unknown_outcome() from exc
                raise
        finally:
            if self._guards is not None:
                self._guards.pop(conn, None)
            if forks.GENERATION[0] == generation:
                forks.released(fairy)
                if executor is not None:
                    executor.restore()  # the driver's connection as the pool gave it
                if self.engine.pool is not pool:  # disposed meanwhile: close, do not return
                    with contextlib.suppress(Exception):
                        conn.invalidate()
                conn.close()
                if self.retired or self.engine.pool is not pool:  # disposed while it was returned
                    with contextlib.suppress(Exception):
                        pool.dispose()

    def forked_since(self, generation: int) -> bool:
        return forks.GENERATION[0] != generation

    # -- the two ways ---------------------------------------------------------------------

    def _retrying(
        self, attempt: Callable[[_Verdict], T], verdict: _Verdict, exc: BaseException, job: str | None
    ) -> T:
        """Try again after an attempt failed with ``exc``, judged ``verdict``, as long as
        the verdicts allow: a lost lock race within the wait budget, or once a dead idle
        connection. Each retry of a lost race is logged (DEBUG, ``fencing.retry``) and
        counted; the time from the first lost race to the end is a lock wait."""
        races = 0  # lost lock races so far
        started = 0.0  # when the first was lost: the wait for the lock begins there
        reconnected = False
        metrics = self.metrics
        try:
            while True:
                if verdict.again == _LOCK_RACE:
                    if races == 0:
                        started = time.monotonic()
                    races += 1
                    if not self.lock_wait.again(races, started):
                        raise self.lock_wait.busy(exc) from exc
                    events.retried(exc, job, races, time.monotonic() - started)
                    if metrics is not None:
                        metrics.retried()
                elif verdict.again == _DEAD_IDLE and not reconnected and races == 0:
                    reconnected = True  # an idle connection the server closed: once, afresh
                else:
                    raise exc
                verdict = _Verdict()
                try:
                    return attempt(verdict)
                except self.errors as again:
                    exc = again
        finally:
            if races and metrics is not None:
                metrics.waited(time.monotonic() - started)

    def _on_driver(
        self,
        unit: Callable[[Executor], T],
        write: bool,
        verdict: _Verdict,
        single: bool,
        prelude: Sequence[Executable] = (),
    ) -> T:
        held, lean, pool = self._checkout()
        # closed while idle (a server restart closes them all): nothing was sent on it yet, so
        # the next one, until a live one (a new connection is); bounded all the same
        for _ in range(_DEAD_IDLE_CHECKS):
            if not (single and self._profile.closed_by_server(held.driver_connection)):
                break
            _invalidate(pool, held, None)
            self._checkin(held, lean, pool, ended=False)
            held, lean, pool = self._checkout()
        conn = held.dbapi_connection  # these drivers' own connection objects
        info = held.info  # kept with the DBAPI connection from checkout to checkout
        ended = False  # the transaction was committed or rolled back: nothing for the pool to reset
        # in autocommit (``single``) the unit's one write is its own transaction: sending it
        # is committing, and a write's connection lost then leaves the outcome unknown
        committing = single
        try:
            cursor = info.get(_CURSOR)
            if cursor is None:  # one cursor per connection, made once
                cursor = info[_CURSOR] = conn.cursor()
            isolated = single and self._isolated(held)
            if isolated:
                # the engine's isolation level: BEGIN with it, pipelined with the statement and
                # COMMIT where the driver can (one round trip still), else a transaction as usual
                single = committing = self._profile.pipelines
            if single:
                driver = held.driver_connection
                result, ended = self._autocommitted(unit, cursor, conn, driver, prelude, isolated)
                return result
            # (a read on SQLite: its one statement runs as its own snapshot)
            if self._write_lock is not None and write:
                began = time.perf_counter()
                self._write_lock.begin(
                    cursor.execute,
                    "BEGIN IMMEDIATE",
                    self.errors,
                    lowered=True,
                    connection=held.driver_connection,
                )
                waited = time.perf_counter() - began
                if waited > LOCK_WAIT_MIN and self.metrics is not None:
                    self.metrics.waited(waited)
            result = unit(_DriverExecutor(cursor, self._compiled_for))
            committing = True
            if self._write_lock is None:
                conn.commit()
            elif write:
                cursor.execute("COMMIT")
            ended = True
            return result
        except DatabaseBusy:  # the write lock was never had: no transaction is open
            ended = True
            raise
        except self.errors as exc:
            _drop_cursor(info)
            ended = self._rollback(conn)  # (in autocommit: none open, nothing sent)
            if is_transient(exc):  # rolled back whole, at COMMIT too: nothing was kept
                verdict.again = _LOCK_RACE
            elif self._lost(exc, conn):
                ended = False
                _invalidate(pool, held, exc)
                if committing and write:  # a read's COMMIT kept nothing: read again
                    raise _unknown_outcome() from exc
                verdict.again = _DEAD_IDLE
            raise
        finally:
            self._checkin(held, lean, pool, ended)

    def _autocommitted(
        self,
        unit: Callable[[Executor], T],
        cursor: Any,
        conn: Any,
        driver: Any,
        prelude: Sequence[Executable],
        pipelined: bool = False,
    ) -> tuple[T, bool]:
        """Run ``unit`` with the driver in autocommit, then out of it again: its answer, and
        whether the connection is back out of autocommit (else the pool must not keep it as
        it is; a unit's own error is the one raised). With a ``prelude`` (or ``pipelined``),
        its first statement is pipelined in a transaction of its own
        (:class:`_PipelinedExecutor`), which begins as the driver would begin it."""
        profile = self._profile
        profile.autocommit(conn, True)
        restored = False
        executor: _DriverExecutor
        pipelined = pipelined or bool(prelude)
        if pipelined:
            executor = _PipelinedExecutor(cursor, self._compiled_for, driver, prelude, profile)
        else:
            executor = _DriverExecutor(cursor, self._compiled_for)
        try:
            result = unit(executor)
        except BaseException:
            if pipelined:  # the pipeline's transaction, if it failed open: autocommit needs it ended
                with contextlib.suppress(Exception):
                    conn.rollback()
            raise
        finally:
            with contextlib.suppress(Exception):
                profile.autocommit(conn, False)
                restored = True
        return result, restored

    def _on_core(self, unit: Callable[[Executor], T], write: bool, verdict: _Verdict, single: bool) -> T:
        committing = False
        try:
            with self.transaction(write=write, single=single) as conn:
                # in autocommit, the statement is the COMMIT
                committing = write and conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
                result = unit(CoreExecutor(conn))
                committing = True  # the block's end sends COMMIT
            return result
        except self.errors as exc:
            if is_transient(exc):  # rolled back whole, at COMMIT too: nothing was kept
                verdict.again = _LOCK_RACE
            elif self._lost(exc, None):
                if committing and write:  # a read's COMMIT kept nothing: read again
                    raise _unknown_outcome() from exc
                verdict.again = _DEAD_IDLE
            raise

    # -- pooled connections ---------------------------------------------------------------

    def _usable_here(self) -> None:
        why = forks.refusal(self.engine)
        if why is not None:
            raise ConfigurationError(why)

    def _checkout(self) -> tuple[Any, bool, Any]:
        """A connection from the pool (:mod:`fencing._runtime.private_sqlalchemy`), whether it is a bare pool
        record, and the pool; on SQLite with the short busy handler its BEGIN waits in."""
        held, lean, pool = self._checkout_from()
        forks.in_use(held, self._root)
        try:
            self._know_database(held)
            self._know_durability(held)
            after_checkout = self._profile.after_checkout
            if after_checkout is not None:
                after_checkout(held.dbapi_connection, held.info)
            elif self._autocommit is not None and self._autocommit(held.dbapi_connection):
                raise ConfigurationError(
                    "the engine's connections are in autocommit mode (isolation_level='AUTOCOMMIT', "
                    "or a connect listener that sets it): lock + check + write must be one transaction"
                )
        except BaseException:
            self._checkin(held, lean, pool, ended=False)
            raise
        return held, lean, pool

    def _know_database(self, held: Any) -> None:
        """Learn which database the pool reaches (:mod:`fencing._runtime.identity`) on a
        connection just checked out, once per pool: the holds of this process meet there."""
        pool = self.engine.pool
        if self._known_pool is pool:
            return
        try:
            settled = identity.note(self.engine, held.dbapi_connection)
        except Exception as exc:  # it could not even roll back: not a connection to use
            held.invalidate(exc)
            raise
        if settled:
            self._known_pool = pool

    def _know_durability(self, held: Any) -> None:
        """Read the database's durability settings on a connection just checked out, once
        per pool (:mod:`fencing.durability`): a WARNING per risk on
        ``fencing.durability``, or, for an engine passed to ``require_durable``,
        :class:`ConfigurationError` at every checkout while a risk stands."""
        pool = self.engine.pool
        if self._durable_pool is pool:
            return
        if durability.note(self.engine, held.dbapi_connection):
            self._durable_pool = pool

    def _checkin(self, held: Any, lean: bool, pool: Any, ended: bool) -> None:
        forks.released(held)
        give_back(held, lean, pool, self.engine, ended=ended)
        if self.retired:
            with contextlib.suppress(Exception):
                pool.dispose()

    def _compiled_for(self, stmt: Executable) -> _Compiled:
        try:
            return self._compiled[id(stmt)][1]
        except KeyError:
            # keep the statement referenced so its id() is never reused by another
            self._compiled[id(stmt)] = (stmt, _Compiled(stmt, self.engine.dialect))
            return self._compiled[id(stmt)][1]

    def _rollback(self, conn: Any) -> bool:
        """Roll back whatever the failed unit left open; False if the connection is unusable."""
        try:
            conn.rollback()
            return True
        except Exception:  # a dead connection cannot even roll back: drop it
            return False

    def _lost(self, exc: BaseException, conn: Any) -> bool:
        """``exc`` says the connection was lost (or the server ended the session): the
        dialect's own judgement (what SQLAlchemy invalidates a connection for), or the
        library's (:func:`~fencing._sql.dberrors.is_unavailable`), whichever knows it. The one
        rule for both ways and both fronts: lost while committing is an unknown outcome."""
        if is_unavailable(exc):
            return True
        orig = getattr(exc, "orig", None) or exc
        try:
            return bool(self.engine.dialect.is_disconnect(orig, conn, None))  # type: ignore[arg-type]
        except Exception:
            return False


#: in a pooled connection's ``info``: the cursor the fast path runs its statements on
_CURSOR = "fencing_cursor"


def _invalidate(pool: Any, held: Any, exc: BaseException | None) -> None:
    """Drop a connection the server closed, and retire the pool's older ones with it."""
    retire_older(pool, held, exc)
    held.invalidate(exc)


def _drop_cursor(info: dict[str, Any]) -> None:
    """Forget (and close) a connection's cursor after a failed statement: a fresh one next."""
    cursor = info.pop(_CURSOR, None)
    if cursor is not None:
        with contextlib.suppress(Exception):
            cursor.close()


def forked_away() -> ConfigurationError:
    return ConfigurationError(
        "this transaction was begun in the parent process and the process forked inside it: "
        "the child never commits, rolls back or closes the parent's connection (nothing was done here)"
    )


#: how many pooled connections found closed by the server a checkout skips (each seen on the
#: client, before anything is sent on it)
_DEAD_IDLE_CHECKS = 64

#: why a failed attempt may run again
_LOCK_RACE = "lock race"  # the database rolled it back whole
_DEAD_IDLE = "dead idle connection"  # the server had closed the pooled connection


class _Verdict:
    """Set by an attempt that failed in a way that may be tried again."""

    __slots__ = ("again",)

    def __init__(self) -> None:
        self.again: str | None = None
