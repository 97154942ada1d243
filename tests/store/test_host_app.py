"""The store is a guest in the application's engine (issue 9), on every backend.

* its connections come from the engine's pool only: ``pool_size``/``max_overflow`` cap them,
  ``pool_timeout`` bounds the wait (then :class:`PoolTimeout`), ``NullPool`` keeps none,
  ``engine.dispose()`` leaves none of them open;
* every statement it sends is seen by the engine's observers: connection events
  (``before_cursor_execute``...), ``echo``/``sqlalchemy.engine`` logging, OpenTelemetry;
* settings under which lock + check + write cannot be one transaction are refused
  (``AUTOCOMMIT`` on a server, pools that share one connection between transactions);
* on SQLite the application's own transactions begin ``DEFERRED``: a read-only ``Session``
  never holds the write lock, so workers keep claiming while it is open;
* ``conn=`` and ``fenced(conn=)`` take the caller's ``Connection`` or ORM ``Session`` and run
  in its transaction, and ``check()`` raises :class:`LeaseLost` inside it.

Fork safety is in ``tests/databases/test_forks.py``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import sqlite3
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Engine, ForeignKey, Integer, String, event, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import NullPool, SingletonThreadPool, StaticPool

import fencing
from fencing import (
    ConfigurationError,
    FenceMarks,
    InvalidArgumentType,
    JobStore,
    Lease,
    LeaseLost,
    PoolTimeout,
)
from fencing._runtime.admission import _OBSERVING, _OBSERVING_DIALECT, observed
from tests import backends
from tests.processes import reap

T0 = 1_000.0
TTL = 30.0
TIMEOUT = 60.0


def make_engine(target: str, **options: Any) -> Engine:
    """An engine on the test's database with the application's own pool settings."""
    if "://" in target:
        return sqlalchemy.create_engine(target, **options)
    return fencing.create_sqlite_engine(target, **options)


@pytest.fixture
def made(target: str) -> Iterator[Callable[..., Engine]]:
    """``made(**options)``: an engine on the test's database, disposed at the end."""
    engines: list[Engine] = []

    def make(**options: Any) -> Engine:
        engine = make_engine(target, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


def server_sessions(admin: Engine) -> dict[int, str]:
    """The sessions the server has open on the test's database (not counting the one
    asking): their ids, and what the server says of each (for failure messages)."""
    with admin.connect() as conn:
        if admin.dialect.name == "postgresql":
            sql = (
                "SELECT pid, concat_ws(' | ', application_name, backend_start, state, left(query, 80)) "
                "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        else:
            sql = (
                "SELECT id, concat_ws(' | ', host, command, time, left(info, 80)) "
                "FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            )
        return {int(session): str(what) for session, what in conn.exec_driver_sql(sql)}


class ConnectionCount:
    """DBAPI connections an engine's pool made and closed, from the pool's own events."""

    def __init__(self, engine: Engine) -> None:
        self.made = 0
        self.closed = 0
        self._lock = threading.Lock()
        event.listen(engine, "connect", self._connect)
        event.listen(engine.pool, "close", self._close)
        event.listen(engine.pool, "close_detached", self._close)

    def _connect(self, *_: Any) -> None:
        with self._lock:
            self.made += 1

    def _close(self, *_: Any) -> None:
        with self._lock:
            self.closed += 1

    @property
    def open(self) -> int:
        return self.made - self.closed


def cycles(store: JobStore, prefix: str, threads: int, per_thread: int) -> list[Lease]:
    """``threads`` threads, each claiming and completing ``per_thread`` jobs of its own."""
    done: list[Lease] = []
    errors: list[str] = []

    def work(n: int) -> None:
        try:
            for k in range(per_thread):
                job = f"{prefix}-{n}-{k}"
                store.enqueue(job, ready_at=0.0)
                lease = store.claim(job, f"w{n}", now=T0, ttl=TTL)
                assert lease is not None
                assert isinstance(store.renew(lease, now=T0 + 1, ttl=TTL), Lease)
                assert store.complete(lease, "ok", now=T0 + 2)
                assert store.state(job) is not None
                done.append(lease)
        except BaseException:
            errors.append(traceback.format_exc())

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(TIMEOUT)
    assert errors == []
    assert len(done) == threads * per_thread
    return done


# -- the pool is the only source of connections ---------------------------------------------------


def test_pool_size_and_max_overflow_cap_the_stores_connections(made: Callable[..., Engine]) -> None:
    engine = made(pool_size=2, max_overflow=0, pool_timeout=TIMEOUT)
    count = ConnectionCount(engine)
    store = JobStore(engine)
    store.create_table()
    cycles(store, "capped", threads=16, per_thread=5)
    assert count.made <= 2, f"{count.made} DBAPI connections for a pool of 2"
    engine.dispose()
    assert count.open == 0


@pytest.mark.backend("postgresql", "mysql", "mariadb")
def test_the_server_sees_no_more_sessions_than_the_pool_allows(
    made: Callable[..., Engine], target: str
) -> None:
    admin = sqlalchemy.create_engine(target, poolclass=NullPool)
    engine = made(pool_size=2, max_overflow=0, pool_timeout=TIMEOUT)
    store = JobStore(engine)
    store.create_table()
    engine.dispose()
    # sessions of this worker process from earlier tests (engines that tests or caches keep,
    # closing on their own schedule) are not the store's: only sessions new since now count
    before = set(server_sessions(admin))
    most: dict[int, str] = {}
    stop = threading.Event()

    def sample() -> None:
        nonlocal most
        while not stop.is_set():
            new = {k: v for k, v in server_sessions(admin).items() if k not in before}
            if len(new) > len(most):
                most = new
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        cycles(store, "counted", threads=16, per_thread=5)
    finally:
        stop.set()
        sampler.join(TIMEOUT)
    assert 1 <= len(most) <= 2, f"the server saw {len(most)} sessions for a pool of 2: {most}"
    engine.dispose()
    assert _eventually(lambda: not set(server_sessions(admin)) - before), "sessions left open after dispose()"
    admin.dispose()


def test_null_pool_keeps_no_connection_between_operations(made: Callable[..., Engine]) -> None:
    engine = made(poolclass=NullPool)
    count = ConnectionCount(engine)
    store = JobStore(engine)
    store.create_table()
    cycles(store, "null", threads=4, per_thread=3)
    assert count.made > 0
    assert count.open == 0, f"{count.open} connections kept open under NullPool"


@pytest.mark.parametrize("way", ["operation", "fenced"])
def test_a_connection_in_use_when_the_engine_is_disposed_is_closed_when_the_store_is_done(
    made: Callable[..., Engine], way: str
) -> None:
    """engine.dispose() closes the idle connections; the store closes the one it was using
    then, rather than return it to the pool the engine let go of (where it would be left to
    the garbage collector: on Python 3.13 an unclosed sqlite3 connection warns)."""
    engine = made()
    count = ConnectionCount(engine)
    store = JobStore(engine)
    store.create_table()
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", now=T0, ttl=TTL)
    assert lease is not None
    if way == "fenced":  # a transaction through Core
        with store.fenced(lease, now=T0 + 1, complete=True, result="r"):
            engine.dispose()  # the block's connection is in use: the pool cannot close it
    else:  # an operation on the pooled DBAPI connection (the unit of complete(), disposing)
        params = {"job_id": "j", "holder": "w", "token": 1, "new_result": "r", "now": T0 + 1}
        complete = store._ctx.by_caller.complete
        assert store._ctx.runner.run(lambda x: (engine.dispose(), x.count(complete, params))[1]) == 1
    assert count.made > 0 and count.open == 0
    assert store.state("j") == fencing.JobState("j", "w", T0 + TTL, 1, "r", True)


def test_a_full_pool_is_waited_for_then_pool_timeout_and_nothing_changed(
    made: Callable[..., Engine],
) -> None:
    engine = made(pool_size=1, max_overflow=0, pool_timeout=0.3)
    store = JobStore(engine)
    store.create_table()
    store.enqueue("j", ready_at=0.0)
    with engine.connect():  # the application holds the pool's only connection
        started = time.monotonic()
        with pytest.raises(PoolTimeout, match="pool_timeout") as excinfo:
            store.claim("j", "w", now=T0, ttl=TTL)
        assert time.monotonic() - started >= 0.3
    assert isinstance(excinfo.value, fencing.DatabaseError)
    assert isinstance(excinfo.value.__cause__, sqlalchemy.exc.TimeoutError)
    assert store.state("j") == fencing.JobState("j", None, 0.0, 0, None, False)
    # and the connection, once free, serves the store
    assert store.claim("j", "w", now=T0, ttl=TTL) == Lease("j", "w", 1, T0 + TTL)


def test_pool_events_and_pre_ping_apply_to_the_stores_connections(
    made: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = made(pool_pre_ping=True)
    checkouts: list[int] = []
    event.listen(engine, "checkout", lambda *_: checkouts.append(1))
    pings: list[int] = []
    do_ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda dbapi: (pings.append(1), do_ping(dbapi))[1])
    store = JobStore(engine)
    store.create_table()
    before, pinged = len(checkouts), len(pings)
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", now=T0, ttl=TTL)
    assert lease is not None and store.complete(lease, "ok", now=T0 + 1)
    assert len(checkouts) - before == 3  # one checkout per transaction
    assert len(pings) - pinged == 3  # each checked by the pool first


def test_a_quiet_engine_is_not_driven_through_core(
    made: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody observes the engine: the store runs on the pooled DBAPI connection (the speed)."""
    engine = made()
    store = JobStore(engine)
    store.create_table()

    def no_core(*_: Any, **__: Any) -> Any:
        raise AssertionError("Engine.connect() on a quiet engine")

    monkeypatch.setattr(engine, "connect", no_core)
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", now=T0, ttl=TTL)
    assert lease is not None
    assert store.complete(lease, "ok", now=T0 + 1)
    assert store.state("j") is not None


# -- every statement is visible ------------------------------------------------------------------

#: every operation, with what it needs set up; each must show the engine its statements
OPERATIONS: dict[str, Callable[[JobStore, FenceMarks], object]] = {
    "enqueue": lambda s, m: s.enqueue("new"),
    "state": lambda s, m: s.state("held"),
    "claim": lambda s, m: s.claim("ready", "w", ttl=TTL),
    "renew": lambda s, m: s.renew(held_lease(s), ttl=TTL),
    "complete": lambda s, m: s.complete(held_lease(s), "ok"),
    "release": lambda s, m: s.release(held_lease(s)),
    "revoke": lambda s, m: s.revoke("held"),
    "delete": lambda s, m: s.delete("held"),
    "claim_next": lambda s, m: s.claim_next("w", ttl=TTL),
    "complete_many": lambda s, m: s.complete_many([(held_lease(s), "ok")]),
    "poisoned": lambda s, m: s.poisoned(5),
    "check": lambda s, m: s.check(held_lease(s)),
    "fenced": lambda s, m: _fenced(s),
    "FenceMarks.accept": lambda s, m: m.accept("resource", 3),
    "FenceMarks.record_once": lambda s, m: m.record_once("key"),
    "FenceMarks.highest": lambda s, m: m.highest("resource"),
}


def held_lease(store: JobStore) -> Lease:
    found = store.state("held")
    assert found is not None and found.owner is not None
    return Lease("held", found.owner, found.fence)


def _fenced(store: JobStore) -> None:
    with store.fenced(held_lease(store), complete=True, result="ok"):
        pass


def prepared(engine: Engine) -> tuple[JobStore, FenceMarks]:
    store = JobStore(engine)
    store.create_table()
    marks = FenceMarks(engine)
    marks.create_tables()
    store.enqueue("ready")
    store.enqueue("held")
    assert store.claim("held", "holder", ttl=TTL) is not None
    return store, marks


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_every_operation_is_seen_by_cursor_event_listeners(
    made: Callable[..., Engine], operation: str
) -> None:
    engine = made()
    store, marks = prepared(engine)
    seen: list[str] = []
    after: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda c, cur, sql, *a: seen.append(sql))
    event.listen(engine, "after_cursor_execute", lambda c, cur, sql, *a: after.append(sql))
    OPERATIONS[operation](store, marks)
    table = "fence_marks" if operation.startswith("FenceMarks.") else "jobs"
    if operation == "FenceMarks.record_once":
        table = "idempotency_keys"
    touching = [sql for sql in seen if table in sql]
    assert touching, f"{operation}: no statement on {table} reached the listener: {seen}"
    assert after == seen  # each statement completed, seen on both sides


@pytest.mark.sync_only("one check of the engine, whichever front")
@pytest.mark.parametrize("name", [*_OBSERVING, *_OBSERVING_DIALECT])
def test_a_listener_of_any_observing_event_sends_the_store_through_core(engine: Engine, name: str) -> None:
    """The check made before every transaction sees a listener of each event it lists (it is
    written out for speed: this holds it to the lists), and forgets it once removed."""
    own = len(engine.dispatch.begin)  # the library's own begin listeners (SQLite's)
    assert not observed(engine, own)

    def listener(*args: object, **kwargs: object) -> None:
        return None

    target = engine.dialect if name in _OBSERVING_DIALECT else engine
    # do_* hooks of the dialect must return None (proceed): a no-op listener does nothing else
    event.listen(target, name, listener)
    try:
        assert observed(engine, own)
    finally:
        event.remove(target, name, listener)
    assert not observed(engine, own)


@pytest.mark.sync_only("observes the engine fixture, which the sync store uses")
@pytest.mark.backend("sqlite")
def test_an_observer_sees_the_stores_transaction_and_nothing_else(engine: Engine, store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda c, cur, sql, *a: seen.append(sql.split()[0]))
    store.claim("j", "w", now=T0, ttl=TTL)
    # the busy handler the BEGIN waits in was set on this pooled connection once, before
    assert seen == ["BEGIN", "UPDATE"]  # COMMIT goes through the DBAPI's commit(), as Core's does


def test_statements_are_logged_with_echo(
    made: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = made(echo=True)
    store, _ = prepared(engine)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine"):
        lease = store.claim("ready", "w", ttl=TTL)
        assert lease is not None
        assert store.complete(lease, "done")
        store.state("ready")
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("sqlalchemy.engine"))
    assert "UPDATE jobs" in logged and "SELECT jobs" in logged
    assert "COMMIT" in logged


def test_statements_are_logged_when_the_engine_logger_is_at_info(
    made: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = made()
    store, _ = prepared(engine)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine"):
        assert store.claim_next("w", ttl=TTL)
    assert any("UPDATE jobs" in r.getMessage() for r in caplog.records)


def test_opentelemetry_spans_for_claims_and_completions(made: Callable[..., Engine]) -> None:
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = made()
    store, _ = prepared(engine)
    instrumentor = SQLAlchemyInstrumentor()
    # its declared range stops before SQLAlchemy 2.1; the listeners it installs work there too
    instrumentor.instrument(engine=engine, tracer_provider=provider, skip_dep_check=True)
    try:
        leases = store.claim_next("w", ttl=TTL)
        assert leases
        assert [bool(v) for v in store.complete_many([(lease, "ok") for lease in leases])] == [True]
    finally:
        instrumentor.uninstrument()
    spans = exporter.get_finished_spans()
    attributes = [span.attributes or {} for span in spans]
    statements = [a.get("db.statement") or a.get("db.query.text") for a in attributes]
    assert any("UPDATE jobs" in str(sql) for sql in statements), statements
    assert sum("jobs" in str(sql) for sql in statements) >= 2, statements


def test_an_engines_schema_translate_map_applies_to_the_stores_statements(
    made: Callable[..., Engine],
) -> None:
    """Execution options on the engine are honoured: here the table is renamed for this engine."""
    engine = made()
    base = JobStore(engine)
    base.create_table()
    metadata = sqlalchemy.MetaData()
    aliased = fencing.jobs_table(metadata, schema="aliased")
    store = JobStore(engine.execution_options(schema_translate_map={"aliased": None}), aliased)
    assert store.enqueue("via-map", ready_at=0.0)
    assert base.state("via-map") is not None


# -- settings under which the guarantee cannot hold ------------------------------------------------


@pytest.mark.backend("postgresql", "mysql", "mariadb")
@pytest.mark.parametrize("where", ["create_engine", "execution_options"])
def test_an_autocommit_engine_is_refused(made: Callable[..., Engine], target: str, where: str) -> None:
    if where == "create_engine":
        engine = made(isolation_level="AUTOCOMMIT")
    else:
        engine = made().execution_options(isolation_level="AUTOCOMMIT")
    for build in (JobStore, FenceMarks):
        with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            build(engine)


@pytest.mark.backend("postgresql", "mysql", "mariadb")
def test_connections_a_listener_puts_in_autocommit_are_refused_and_nothing_changes(
    made: Callable[..., Engine],
) -> None:
    engine = made()
    store = JobStore(engine)
    store.create_table()
    store.enqueue("j", ready_at=0.0)
    engine.dispose()

    @event.listens_for(engine, "connect")
    def autocommit(dbapi_connection: Any, record: Any) -> None:
        if engine.dialect.driver == "psycopg":
            dbapi_connection.autocommit = True
        else:
            dbapi_connection.autocommit(True)

    with pytest.raises(ConfigurationError, match="autocommit"):
        store.claim("j", "w", now=T0, ttl=TTL)
    event.remove(engine, "connect", autocommit)
    engine.dispose()
    assert store.state("j") == fencing.JobState("j", None, 0.0, 0, None, False)


@pytest.mark.backend("postgresql", "mysql", "mariadb")
def test_a_callers_autocommit_connection_is_refused_by_every_path(made: Callable[..., Engine]) -> None:
    engine = made()
    store = JobStore(engine)
    store.create_table()
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", now=T0, ttl=TTL)
    assert lease is not None
    marks = FenceMarks(engine)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        with pytest.raises(ConfigurationError, match="autocommit"):
            store.complete(lease, "r", now=T0 + 1, conn=conn)
        with (
            pytest.raises(ConfigurationError, match="autocommit"),
            store.fenced(lease, now=T0 + 1, conn=conn),
        ):
            pytest.fail("a fenced block ran on an autocommit connection")
        with pytest.raises(ConfigurationError, match="autocommit"):
            marks.accept("r", 1, conn=conn)
    assert store.state("j") == fencing.JobState("j", "w", T0 + TTL, 1, None, False)


def write_then_fail(conn: sqlalchemy.Connection) -> None:
    conn.exec_driver_sql("UPDATE jobs SET result = 'leaked' WHERE id = 'j'")
    raise RuntimeError("give up")


@pytest.mark.backend("sqlite")
def test_sqlite_autocommit_is_harmless_the_store_still_opens_real_transactions(tmp_path: Any) -> None:
    engine = fencing.create_sqlite_engine(tmp_path / "auto.db", isolation_level="AUTOCOMMIT")
    try:
        store = JobStore(engine)
        store.create_table()
        store.enqueue("j", ready_at=0.0)
        lease = store.claim("j", "w", now=T0, ttl=TTL)
        assert lease is not None
        with pytest.raises(RuntimeError, match="give up"), store.fenced(lease, now=T0 + 1) as conn:
            write_then_fail(conn)  # the block's own error: its write rolls back with it
        assert store.state("j") == fencing.JobState("j", "w", T0 + TTL, 1, None, False)
    finally:
        engine.dispose()


class PEP249Mode(sqlite3.Connection):
    """What ``sqlite3.connect(autocommit=False)`` gives on Python 3.12+: a connection that opens
    a transaction itself after every commit (written as a class attribute, so every Python
    version can make one)."""

    autocommit = False


@pytest.mark.backend("sqlite")
def test_sqlite_connections_that_open_their_own_transactions_are_refused(tmp_path: Any) -> None:
    engine = fencing.create_sqlite_engine(tmp_path / "pep249.db", connect_args={"factory": PEP249Mode})
    try:
        with pytest.raises(ConfigurationError, match="autocommit=False"):
            JobStore(engine).create_table()
    finally:
        engine.dispose()
    with contextlib.closing(sqlite3.connect(tmp_path / "pep249.db")) as raw:  # nothing was made
        assert raw.execute("SELECT name FROM sqlite_master").fetchall() == []


@pytest.mark.parametrize("pool", [StaticPool, SingletonThreadPool])
def test_pools_that_share_one_connection_between_transactions_are_refused(
    target: str, tmp_path: Any, pool: type[Any]
) -> None:
    engine = (
        sqlalchemy.create_engine(target, poolclass=pool)
        if "://" in target
        else sqlalchemy.create_engine(
            sqlalchemy.URL.create("sqlite", database=str(tmp_path / "p.db")), poolclass=pool
        )
    )
    try:
        if engine.dialect.name == "sqlite":
            with pytest.raises(ConfigurationError, match=pool.__name__):
                fencing.configure_sqlite(engine)
        else:
            for build in (JobStore, FenceMarks):
                with pytest.raises(ConfigurationError, match=pool.__name__):
                    build(engine)
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
def test_an_in_memory_database_is_refused_by_name() -> None:
    engine = sqlalchemy.create_engine("sqlite://")
    with pytest.raises(ConfigurationError, match=":memory:"):
        fencing.configure_sqlite(engine)


# -- SQLite: the application keeps its engine ------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    __tablename__ = "invoices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job: Mapped[str] = mapped_column(String(200))
    total: Mapped[int] = mapped_column(Integer)


class Line(Base):
    __tablename__ = "invoice_lines"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    invoice_id: Mapped[int] = mapped_column(ForeignKey("invoices.id"))


@pytest.fixture
def app(engine: Engine, store: JobStore) -> Iterator[sessionmaker[Session]]:
    Base.metadata.create_all(engine)
    yield sessionmaker(engine)
    Base.metadata.drop_all(engine)


def _claim_all(target: str, name: str, out: Any, barrier: Any) -> None:
    engine = backends.engine_for(target)
    try:
        store = JobStore(engine)
        barrier.wait(TIMEOUT)
        done = 0
        while leases := store.claim_next(name, ttl=TTL, limit=2):
            for lease in leases:
                assert store.complete(lease, name)
                done += 1
        out.put(("ok", name, done))
    except BaseException:
        out.put(("error", name, traceback.format_exc()))
    finally:
        engine.dispose()


@pytest.mark.slow
def test_workers_claim_while_an_orm_session_reads(
    app: sessionmaker[Session], store: JobStore, target: str
) -> None:
    jobs = 200
    for n in range(jobs):
        store.enqueue(f"job-{n:03d}")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(5)
    procs = [ctx.Process(target=_claim_all, args=(target, f"w{p}", out, barrier)) for p in range(4)]
    for proc in procs:
        proc.start()
    reports = []
    try:
        with app() as reader, app() as second:
            # read-only sessions, open across the whole run: they take no write lock
            reader.execute(select(Invoice)).all()
            second.execute(select(Invoice)).all()
            barrier.wait(TIMEOUT)
            while len(reports) < len(procs):
                reader.execute(select(Invoice)).all()  # and keep reading meanwhile
                second.execute(text("SELECT count(*) FROM jobs")).scalar_one()
                try:
                    reports.append(out.get(timeout=0.05))
                except queue.Empty:
                    continue
            reader.commit()
            second.commit()
    finally:
        reap(procs, TIMEOUT)
    assert [r for r in reports if r[0] != "ok"] == []
    assert sum(r[2] for r in reports) == jobs
    assert all(row.done for row in (store.state(f"job-{n:03d}") for n in range(jobs)) if row)


def test_a_claim_while_the_same_threads_read_only_session_is_open(
    app: sessionmaker[Session], store: JobStore
) -> None:
    store.enqueue("j", ready_at=0.0)
    with app() as session:
        session.execute(select(Invoice)).all()  # the session's transaction is open
        started = time.monotonic()
        lease = store.claim("j", "w", now=T0, ttl=TTL)
        assert lease is not None and store.complete(lease, "ok", now=T0 + 1)
        assert time.monotonic() - started < 3.0  # not busy_timeout's 5 s
        session.execute(select(Invoice)).all()


@pytest.mark.sync_only("observes the engine fixture, which the sync store uses")
@pytest.mark.backend("sqlite")
def test_sqlite_application_transactions_begin_deferred_unless_asked(engine: Engine, store: JobStore) -> None:
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda c, cur, sql, *a: statements.append(sql))
    with engine.connect() as conn:
        conn.execute(select(fencing.jobs)).all()
        conn.commit()
        conn.execution_options(fencing_begin="IMMEDIATE")
        conn.execute(select(fencing.jobs)).all()
        conn.commit()
    with Session(engine) as session:  # the documented way for an ORM unit of work
        session.connection(execution_options={"fencing_begin": "IMMEDIATE"})
        session.commit()
    store.enqueue("j")
    begins = [sql for sql in statements if sql.startswith("BEGIN")]
    assert begins == ["BEGIN DEFERRED", "BEGIN IMMEDIATE", "BEGIN IMMEDIATE", "BEGIN IMMEDIATE"]


# -- joining the application's unit of work -------------------------------------------------------


@pytest.fixture
def held(store: JobStore) -> Lease:
    store.enqueue("job", ready_at=0.0)
    lease = store.claim("job", "w", now=T0, ttl=TTL)
    assert lease is not None
    return lease


def invoices_of(app: sessionmaker[Session]) -> list[tuple[str, int]]:
    with app() as session:
        return [(i.job, i.total) for i in session.scalars(select(Invoice).order_by(Invoice.id))]


def test_fenced_joins_a_session_and_commits_with_it(
    app: sessionmaker[Session], store: JobStore, held: Lease
) -> None:
    with app() as session, session.begin():
        with store.fenced(held, now=T0 + 1, complete=True, result="paid", conn=session) as joined:
            assert joined is session
            session.add(Invoice(job="job", total=99))
        # nothing is committed before the session commits
        assert store.state("job") == fencing.JobState("job", "w", T0 + TTL, 1, None, False)
    assert invoices_of(app) == [("job", 99)]
    assert store.state("job") == fencing.JobState("job", "w", T0 + TTL, 1, "paid", True)


def test_a_lost_lease_rolls_the_blocks_objects_back_even_if_the_caller_commits(
    app: sessionmaker[Session], store: JobStore, held: Lease
) -> None:
    with app() as session, session.begin():
        session.add(Invoice(job="before", total=1))  # the caller's own, outside the block
        with pytest.raises(LeaseLost), store.fenced(held, now=T0 + TTL + 1, conn=session):
            pytest.fail("the block ran under an expired lease")
    with app() as session, session.begin():
        session.add(Invoice(job="outside", total=2))
        stale = Lease("job", "w", 1)
        store.revoke("job")  # in another transaction: the lease is stale from now on
        with (
            pytest.raises(LeaseLost, match="not current"),
            store.fenced(stale, now=T0 + 1, complete=True, result="stale", conn=session),
        ):
            pytest.fail("the block ran under a revoked lease")
        # the caller swallows LeaseLost and commits: its own objects stay, the block's never ran
    assert invoices_of(app) == [("before", 1), ("outside", 2)]


def add_then_lose_the_lease(session: Session) -> None:
    session.add(Invoice(job="block", total=2))
    # the job is completed meanwhile, here through the session's own connection (another
    # worker would wait for the row lock): the final check must see it done
    session.execute(text("UPDATE jobs SET done = 1 WHERE id = 'job'"))


def test_a_lease_lost_at_the_end_rolls_back_the_blocks_writes_and_only_those(
    app: sessionmaker[Session], store: JobStore, held: Lease, engine: Engine
) -> None:
    with app() as session, session.begin():
        session.add(Invoice(job="caller", total=1))
        with pytest.raises(LeaseLost), store.fenced(held, now=T0 + 1, complete=True, conn=session):
            add_then_lose_the_lease(session)
        # the caller goes on and commits what it wrote outside the block
    assert invoices_of(app) == [("caller", 1)]
    found = store.state("job")
    assert found is not None and found.result is None and not found.done


def add_and_check(session: Session, store: JobStore, lease: Lease) -> None:
    session.add(Invoice(job="stale", total=2))
    store.check(lease, now=T0 + 1, conn=session)


def test_check_raises_lease_lost_in_the_callers_session(
    app: sessionmaker[Session], store: JobStore, held: Lease
) -> None:
    with app() as session, session.begin():
        store.check(held, now=T0 + 1, conn=session)  # current: nothing raised
        session.add(Invoice(job="ok", total=1))
    store.revoke("job")
    with pytest.raises(LeaseLost), app() as session, session.begin():
        add_and_check(session, store, held)
    assert invoices_of(app) == [("ok", 1)]
    with pytest.raises(LeaseLost):
        store.check(held, now=T0 + 1)


@pytest.mark.sync_only("its threads call the store; the async races are in test_asyncio.py")
def test_check_in_a_session_holds_the_row_until_the_session_ends(
    app: sessionmaker[Session], store: JobStore, held: Lease, engine: Engine
) -> None:
    with app() as session, session.begin():
        store.check(held, now=T0 + 1, conn=session)
        revoked: list[bool] = []
        other = threading.Thread(target=lambda: revoked.append(store.revoke("job")))
        other.start()
        time.sleep(0.3)
        assert revoked == [], "a revoke went through while the session held the job's row"
    other.join(TIMEOUT)
    assert revoked == [True]


def test_every_operation_takes_a_session(app: sessionmaker[Session], store: JobStore) -> None:
    with app() as session:
        assert store.enqueue("s", ready_at=0.0, conn=session)
        lease = store.claim("s", "w", now=T0, ttl=TTL, conn=session)
        assert lease is not None
        assert store.state("s", conn=session) == fencing.JobState("s", "w", T0 + TTL, 1, None, False)
        assert isinstance(store.renew(lease, now=T0 + 1, ttl=TTL, conn=session), Lease)
        assert [bool(v) for v in store.complete_many([(lease, "r")], now=T0 + 2, conn=session)] == [True]
        session.rollback()  # and everything goes with the session's transaction
    assert store.state("s") is None


def test_conn_must_be_a_connection_or_a_session(store: JobStore, held: Lease) -> None:
    for bad in ("session", 3, object()):  # (the async store names AsyncConnection and AsyncSession)
        with pytest.raises(InvalidArgumentType, match="Session or None"):
            store.claim("job", "w", now=T0, ttl=TTL, conn=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentType, match="Session or None"), store.fenced(held, conn=bad):  # type: ignore[arg-type]
            pytest.fail("ran")


@pytest.mark.backend("postgresql", "mysql", "mariadb")
def test_a_connection_of_another_kind_of_database_is_refused(
    store: JobStore, held: Lease, tmp_path: Any
) -> None:
    other = fencing.create_sqlite_engine(tmp_path / "other.db")
    try:
        with other.connect() as conn, pytest.raises(ConfigurationError, match="sqlite connection"):
            store.complete(held, "r", now=T0 + 1, conn=conn)
    finally:
        other.dispose()
    assert store.state("job") == fencing.JobState("job", "w", T0 + TTL, 1, None, False)


def write_then_query_a_missing_table(conn: sqlalchemy.Connection) -> None:
    conn.execute(text("UPDATE jobs SET result = 'mine' WHERE id = 'job'"))
    conn.execute(text("SELECT * FROM no_such_table_here"))


def test_the_fenced_blocks_own_errors_reach_the_caller_unchanged(store: JobStore, held: Lease) -> None:
    with pytest.raises(sqlalchemy.exc.DBAPIError) as excinfo, store.fenced(held, now=T0 + 1) as conn:
        write_then_query_a_missing_table(conn)
    assert not isinstance(excinfo.value, fencing.FencingError)  # the application's, as it was
    assert store.state("job") == fencing.JobState("job", "w", T0 + TTL, 1, None, False)


def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.backend("sqlite")
def test_a_store_write_while_the_callers_own_session_holds_the_write_lock_is_refused_at_once(
    tmp_path: Any,
) -> None:
    """SQLite: a store operation without ``conn=`` while the caller's own Session has written
    (and so holds the database's write lock) would wait for it until ``busy_timeout`` and
    then blame "other writers": it is refused at once, naming ``conn=``, and changes nothing.
    A Session that only read holds no write lock and is not in the way."""
    engine = fencing.create_sqlite_engine(str(tmp_path / "self.db"), busy_timeout=30.0)
    try:
        store = JobStore(engine)
        store.create_table()
        Base.metadata.create_all(engine)
        with Session(engine) as session, session.begin():
            session.add(Invoice(job="a", total=1))
            session.flush()  # written: this Session now holds the write lock
            started = time.monotonic()
            with pytest.raises(ConfigurationError, match=r"holds SQLite's write lock itself.*conn="):
                store.enqueue("a")
            assert time.monotonic() - started < 15.0  # not the 30 s busy_timeout
            assert store.enqueue("b", conn=session)  # in the Session's transaction: fine
        assert store.state("a") is None and store.state("b") is not None
        with Session(engine) as session, session.begin():
            session.execute(select(Invoice)).all()  # a read: no write lock
            assert store.enqueue("c")
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize("next_holder", ["the application's transaction", "a fenced block"])
def test_a_pooled_connection_another_thread_writes_on_is_not_the_callers_own_lock(
    tmp_path: Any, next_holder: str
) -> None:
    """A connection the caller's transaction used goes back to the pool; another thread's
    transaction that then writes on it (its own, or a store's fenced block) holds the write
    lock for that thread, not for the caller: the caller's store write waits for it like for
    any other writer and is not refused as if it held the lock itself."""
    engine = fencing.create_sqlite_engine(str(tmp_path / "pooled.db"), busy_timeout=30.0)
    try:
        store = JobStore(engine)
        store.create_table()
        Base.metadata.create_all(engine)
        store.enqueue("fenced-job", ready_at=0.0)
        [lease] = store.claim_next("other", ttl=60.0)
        with engine.begin() as conn:  # the caller's own transaction, on the pool's one connection
            conn.execute(sqlalchemy.insert(Invoice).values(job="caller", total=1))
        holding, release = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                context = engine.begin() if next_holder.startswith("the app") else store.fenced(lease)
                with context as conn:  # the same pooled connection, now this thread's
                    conn.execute(sqlalchemy.insert(Invoice).values(job="other", total=2))
                    holding.set()
                    release.wait(10.0)
            except BaseException as exc:
                errors.append(exc)
                holding.set()

        other = threading.Thread(target=other_thread)
        other.start()
        assert holding.wait(10.0) and errors == []
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        assert store.enqueue("after")  # waits for the other thread's commit: not refused
        assert time.monotonic() - started >= 0.25
        other.join(10.0)
        assert errors == [] and store.state("after") is not None
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
def test_the_write_lock_forgets_the_transactions_of_callers_gone(tmp_path: Any) -> None:
    """Each caller's (thread's) transactions are remembered while they may hold the write
    lock; a server that runs each request on a thread of its own must not grow that memory
    with every thread it ever ran: once more than 64 callers are remembered, the ones whose
    transactions have all ended are forgotten. (NullPool: each connection is closed after its
    transaction, so no later transaction on it takes it out of its caller's memory.)"""
    from fencing._runtime.sqlite import settings_of
    from fencing._runtime.writelock import _CALLERS_KEPT

    engine = fencing.create_sqlite_engine(str(tmp_path / "threads.db"), poolclass=NullPool)
    try:
        Base.metadata.create_all(engine)
        settings = settings_of(engine)
        assert settings is not None
        callers = 3 * _CALLERS_KEPT
        ran, done = threading.Semaphore(0), threading.Event()

        def one_request(n: int) -> None:
            with engine.begin() as conn:
                conn.execute(sqlalchemy.insert(Invoice).values(job=f"r{n}", total=n))
            ran.release()
            done.wait(60.0)  # alive until all have run: each thread is a caller of its own

        threads = [threading.Thread(target=one_request, args=(n,)) for n in range(callers)]
        try:
            for thread in threads:  # one request after another, each on a live thread
                thread.start()
                assert ran.acquire(timeout=60.0)
        finally:
            done.set()
            for thread in threads:
                thread.join()
        assert 0 < len(settings.write_lock._callers) <= _CALLERS_KEPT + 1
    finally:
        engine.dispose()
