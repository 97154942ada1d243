"""The library API: ``JobStore`` values, the caller's transaction, and error wrapping."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import CheckConstraint, Column, Engine, Integer, MetaData, Table, Text, select

import fencing
from fencing import (
    DatabaseBusy,
    DatabaseError,
    FencingError,
    InvalidArgumentType,
    JobState,
    JobStore,
    Lease,
    SchemaMismatch,
    TableMissing,
    jobs_table,
)

pytestmark = pytest.mark.dialect

NOW = 100.0
TTL = 10.0


@pytest.fixture
def audit(engine: Engine) -> Table:
    """A table of the caller's own, next to ours."""
    table = Table("audit", MetaData(), Column("n", Integer, primary_key=True), Column("note", Text))
    table.create(engine)
    return table


def audit_rows(engine: Engine, table: Table) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(table).order_by(table.c.n))]


def held(store: JobStore, job_id: str = "j", owner: str = "w") -> Lease:
    store.enqueue(job_id, ready_at=0.0)
    lease = store.claim(job_id, owner, now=NOW, ttl=TTL)
    assert lease is not None
    return lease


# -- values -------------------------------------------------------------------------------


def test_lease_is_frozen() -> None:
    lease = Lease("j", "w", 1, 2.0)
    for name, value in [("job_id", "k"), ("owner", "x"), ("fence", 2), ("until", 9.0)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(lease, name, value)
    with pytest.raises((AttributeError, TypeError)):
        lease.extra = 1  # type: ignore[attr-defined]
    assert lease == Lease("j", "w", 1, 2.0)
    assert hash(lease) == hash(Lease("j", "w", 1, 2.0))


def test_job_state_is_frozen(store: JobStore) -> None:
    held(store)
    state = store.state("j")
    assert state is not None
    for name in ("job_id", "owner", "until", "fence", "result", "done"):
        with pytest.raises(AttributeError):
            setattr(state, name, None)
    assert state == JobState("j", "w", NOW + TTL, 1, None, False)


def test_claim_returns_lease_with_job_owner_fence_and_until(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", now=NOW, ttl=TTL)
    assert lease == Lease("j", "w", 1, NOW + TTL)
    assert type(lease.fence) is int
    assert type(lease.until) is float


def test_claim_with_integer_clock_returns_float_until(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", now=7, ttl=3)
    assert lease == Lease("j", "w", 1, 10.0)
    assert type(lease.until) is float


def test_claim_refused_returns_none(store: JobStore) -> None:
    lease = held(store)
    assert store.claim("j", "x", now=NOW + 1, ttl=TTL) is None
    assert store.claim("missing", "x", now=NOW, ttl=TTL) is None
    assert store.state("j") == JobState("j", "w", lease.until, 1, None, False)


def test_renew_returns_a_new_lease_with_new_until(store: JobStore) -> None:
    lease = held(store)
    renewed = store.renew(lease, now=NOW + 5, ttl=20.0)
    assert renewed == Lease("j", "w", lease.fence, NOW + 25)
    assert renewed is not lease
    assert lease.until == NOW + TTL  # the old value is untouched
    state = store.state("j")
    assert state is not None
    assert state.until == NOW + 25
    # the old value is the same token: it still completes the same lease
    assert store.complete(lease, "r", now=NOW + 15) is True


def test_renew_of_a_stale_or_expired_lease_returns_none(store: JobStore) -> None:
    lease = held(store)
    assert not store.renew(lease, now=NOW + TTL, ttl=TTL)
    assert not store.renew(dataclasses.replace(lease, fence=2), now=NOW + 1, ttl=TTL)
    assert not store.renew(dataclasses.replace(lease, owner="x"), now=NOW + 1, ttl=TTL)
    assert store.state("j") == JobState("j", "w", NOW + TTL, 1, None, False)


def test_token_rebuilt_from_its_parts_works(store: JobStore) -> None:
    held(store)
    token = Lease("j", "w", 1)
    assert token.until is None
    assert store.renew(token, now=NOW + 1, ttl=TTL) == Lease("j", "w", 1, NOW + 1 + TTL)
    assert store.complete(token, "r", now=NOW + 2) is True


def test_state_returns_job_state_with_typed_fields(store: JobStore) -> None:
    lease = held(store)
    assert store.complete(lease, "r", now=NOW + 1)
    state = store.state("j")
    assert state == JobState("j", "w", NOW + TTL, 1, "r", True)
    assert type(state.until) is float
    assert type(state.fence) is int
    assert state.done is True
    assert state.as_dict() == {
        "id": "j",
        "owner": "w",
        "until": NOW + TTL,
        "fence": 1,
        "result": "r",
        "done": 1,
    }


def test_complete_and_release_return_bool(store: JobStore) -> None:
    lease = held(store)
    assert store.release(lease) is True
    assert not store.release(lease)
    lease = store.claim("j", "w", now=NOW, ttl=TTL)
    assert lease is not None
    assert store.complete(lease, "r", now=NOW + 1) is True
    assert not store.complete(lease, "r", now=NOW + 1)


def test_claim_many_returns_leases_in_input_order(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    owners = [f"o{i}" for i in range(6)]
    leases = store.claim_many("j", owners, now=NOW, ttl=TTL)
    winners = [(i, lease) for i, lease in enumerate(leases) if lease is not None]
    assert len(winners) == 1
    index, lease = winners[0]
    assert lease == Lease("j", owners[index], 1, NOW + TTL)
    state = store.state("j")
    assert state is not None
    assert state.owner == owners[index]


def test_claim_many_accepts_any_iterable_of_owners(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    leases = store.claim_many("j", (f"o{i}" for i in range(3)), now=NOW, ttl=TTL)
    assert len(leases) == 3
    assert sum(lease is not None for lease in leases) == 1


# -- the caller's transaction -------------------------------------------------------------


def test_conn_writes_commit_together_with_callers_own(store: JobStore, engine: Engine, audit: Table) -> None:
    lease = held(store)
    with engine.begin() as conn:
        conn.execute(audit.insert().values(n=1, note="finished j"))
        assert store.complete(lease, "r", now=NOW + 1, conn=conn) is True
        assert store.enqueue("next", ready_at=0.0, conn=conn) is True
    assert audit_rows(engine, audit) == [(1, "finished j")]
    assert store.state("j") == JobState("j", "w", NOW + TTL, 1, "r", True)
    assert store.state("next") == JobState("next", None, 0.0, 0, None, False)


def test_caller_rollback_undoes_both_and_commits_nothing_of_ours(
    store: JobStore, engine: Engine, audit: Table
) -> None:
    lease = held(store)
    store.enqueue("free", ready_at=0.0)
    with engine.connect() as conn:
        trans = conn.begin()
        conn.execute(audit.insert().values(n=1, note="finished j"))
        assert store.complete(lease, "r", now=NOW + 1, conn=conn) is True
        assert store.enqueue("new", ready_at=0.0, conn=conn) is True
        other = store.claim("free", "x", now=NOW, ttl=TTL, conn=conn)
        assert other == Lease("free", "x", 1, NOW + TTL)
        # inside the transaction the caller sees our writes
        assert store.state("j", conn=conn) == JobState("j", "w", NOW + TTL, 1, "r", True)
        trans.rollback()
    assert audit_rows(engine, audit) == []
    assert store.state("j") == JobState("j", "w", NOW + TTL, 1, None, False)
    assert store.state("new") is None
    assert store.state("free") == JobState("free", None, 0.0, 0, None, False)
    # the lease is still live and can still complete for real
    assert store.complete(lease, "again", now=NOW + 2) is True


def test_exception_in_callers_block_rolls_back_our_write(
    store: JobStore, engine: Engine, audit: Table
) -> None:
    lease = held(store)

    class Boom(Exception):
        pass

    def unit_of_work() -> None:
        with engine.begin() as conn:
            conn.execute(audit.insert().values(n=1, note="x"))
            assert isinstance(store.renew(lease, now=NOW + 1, ttl=1000.0, conn=conn), Lease)
            assert store.release(lease, conn=conn) is True
            raise Boom

    with pytest.raises(Boom):
        unit_of_work()
    assert audit_rows(engine, audit) == []
    assert store.state("j") == JobState("j", "w", NOW + TTL, 1, None, False)


CONN_OPERATIONS: dict[str, Callable[[JobStore, Any], Any]] = {
    "enqueue": lambda s, c: s.enqueue("j", ready_at=0.0, conn=c),
    "state": lambda s, c: s.state("j", conn=c),
    "claim": lambda s, c: s.claim("j", "w", now=NOW, ttl=TTL, conn=c),
    "renew": lambda s, c: s.renew(Lease("j", "w", 1), now=NOW, ttl=TTL, conn=c),
    "complete": lambda s, c: s.complete(Lease("j", "w", 1), "r", now=NOW, conn=c),
    "release": lambda s, c: s.release(Lease("j", "w", 1), conn=c),
}


@pytest.mark.parametrize("operation", list(CONN_OPERATIONS.values()), ids=list(CONN_OPERATIONS))
@pytest.mark.parametrize("bad", ["conn", object(), 1], ids=["str", "object", "int"])
def test_conn_must_be_a_connection(store: JobStore, operation: Callable[..., Any], bad: Any) -> None:
    store.enqueue("j", ready_at=0.0)
    before = store.state("j")
    with pytest.raises(InvalidArgumentType, match="conn") as excinfo:
        operation(store, bad)
    assert isinstance(excinfo.value, TypeError)
    assert store.state("j") == before


@pytest.mark.parametrize("operation", list(CONN_OPERATIONS.values()), ids=list(CONN_OPERATIONS))
def test_an_engine_is_not_a_connection(
    store: JobStore, engine: Engine, operation: Callable[..., Any]
) -> None:
    with pytest.raises(InvalidArgumentType, match="conn"):
        operation(store, engine)


@pytest.mark.parametrize(
    "url",
    ["postgresql+psycopg://nobody@127.0.0.1:1/none", "mysql+pymysql://nobody@127.0.0.1:1/none"],
    ids=["postgresql", "mysql"],
)
@pytest.mark.parametrize("operation", list(CONN_OPERATIONS.values()), ids=list(CONN_OPERATIONS))
def test_conn_type_is_checked_before_any_database_work_on_every_dialect(
    url: str, operation: Callable[..., Any]
) -> None:
    # the engine points nowhere: a TypeError must come before any attempt to use it
    engine = sqlalchemy.create_engine(url)
    store = JobStore(engine)
    try:
        with pytest.raises(InvalidArgumentType, match="conn"):
            operation(store, "not a connection")
    finally:
        store.engine.dispose()
        engine.dispose()


@pytest.mark.parametrize("bad", ["conn", object()], ids=["str", "object"])
def test_create_table_conn_must_be_a_connection(engine: Engine, bad: Any) -> None:
    store = JobStore(engine)
    try:
        with pytest.raises(InvalidArgumentType, match="conn"):
            store.create_table(conn=bad)
    finally:
        store.engine.dispose()
    assert "jobs" not in sqlalchemy.inspect(engine).get_table_names()


def test_store_requires_an_engine() -> None:
    with pytest.raises(InvalidArgumentType, match="engine"):
        JobStore("sqlite:///jobs.db")  # type: ignore[arg-type]


@pytest.mark.parametrize("lease", [("j", "w", 1), {"job_id": "j"}, None], ids=["tuple", "dict", "none"])
def test_lease_must_be_a_lease(store: JobStore, lease: Any) -> None:
    store.enqueue("j", ready_at=0.0)
    for call in (
        lambda: store.renew(lease, now=NOW, ttl=TTL),
        lambda: store.complete(lease, "r", now=NOW),
        lambda: store.release(lease),
    ):
        with pytest.raises(InvalidArgumentType, match="lease"):
            call()


# -- database errors ----------------------------------------------------------------------

MISSING_TABLE_OPERATIONS: dict[str, Callable[[JobStore], Any]] = {
    "enqueue": lambda s: s.enqueue("j", ready_at=0.0),
    "state": lambda s: s.state("j"),
    "claim": lambda s: s.claim("j", "w", now=NOW, ttl=TTL),
    "renew": lambda s: s.renew(Lease("j", "w", 1), now=NOW, ttl=TTL),
    "complete": lambda s: s.complete(Lease("j", "w", 1), "r", now=NOW),
    "release": lambda s: s.release(Lease("j", "w", 1)),
    "claim_many": lambda s: s.claim_many("j", ["a", "b"], now=NOW, ttl=TTL),
}


@pytest.mark.parametrize(
    "operation", list(MISSING_TABLE_OPERATIONS.values()), ids=list(MISSING_TABLE_OPERATIONS)
)
def test_store_without_table_raises_table_missing_with_clear_message(
    engine: Engine, operation: Callable[[JobStore], Any]
) -> None:
    store = JobStore(engine)
    try:
        with pytest.raises(TableMissing) as excinfo:
            operation(store)
    finally:
        store.engine.dispose()
    message = str(excinfo.value)
    assert "'jobs'" in message
    assert "does not exist" in message
    assert "create" in message
    assert excinfo.value.__cause__ is not None
    assert isinstance(excinfo.value, FencingError)
    assert "jobs" not in sqlalchemy.inspect(engine).get_table_names()


def test_table_missing_names_a_custom_table_and_works_with_conn(engine: Engine) -> None:
    store = JobStore(engine, jobs_table(MetaData(), "leases"))
    try:
        with engine.connect() as conn, pytest.raises(TableMissing, match="'leases'"):
            store.state("j", conn=conn)
        with pytest.raises(TableMissing, match="'leases'"):
            store.enqueue("j", ready_at=0.0)
    finally:
        store.engine.dispose()


@pytest.mark.parametrize(
    "operation", list(MISSING_TABLE_OPERATIONS.values()), ids=list(MISSING_TABLE_OPERATIONS)
)
def test_a_table_of_that_name_that_is_not_a_jobs_table_is_a_schema_mismatch(
    engine: Engine, operation: Callable[[JobStore], Any]
) -> None:
    # someone else's "jobs" (the shared database a tutorial is run in): said, and left alone
    other = Table("jobs", MetaData(), Column("order_id", Integer, primary_key=True), Column("total", Text))
    other.create(engine)
    store = JobStore(engine)
    try:
        with pytest.raises(SchemaMismatch) as excinfo:
            operation(store)
        message = str(excinfo.value)
        assert message.startswith("table 'jobs' (or a table of the library's beside it) lacks a column")
        assert "create_table() names each difference" in message
        assert isinstance(excinfo.value.__cause__, sqlalchemy.exc.DBAPIError)
        with engine.connect() as conn:
            assert conn.execute(select(other)).all() == []
    finally:
        store.engine.dispose()
        other.drop(engine)


def test_database_refusal_is_wrapped_as_database_error(engine: Engine) -> None:
    # the caller's table carries a rule of its own that the database enforces
    table = jobs_table(MetaData())
    table.append_constraint(CheckConstraint("owner <> 'forbidden'", name="no_forbidden_owner"))
    store = JobStore(engine, table)
    try:
        store.create_table()
        store.enqueue("j", ready_at=0.0)
        with pytest.raises(DatabaseError) as excinfo:
            store.claim("j", "forbidden", now=NOW, ttl=TTL)
        assert type(excinfo.value) is DatabaseError
        # the cause is the error SQLAlchemy raises for it, whichever path ran the statement
        assert isinstance(excinfo.value.__cause__, sqlalchemy.exc.DBAPIError)
        assert store.state("j") == JobState("j", None, 0.0, 0, None, False)
        # the store is still usable afterwards
        assert store.claim("j", "allowed", now=NOW, ttl=TTL) == Lease("j", "allowed", 1, NOW + TTL)
    finally:
        store.engine.dispose()


@pytest.mark.backend("sqlite")
def test_file_that_is_not_a_database_raises_database_error(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    content = b"this is not a database file\n" * 100
    path.write_bytes(content)
    engine = fencing.create_sqlite_engine(path)
    store = JobStore(engine)
    try:
        for call in (store.create_table, lambda: store.state("j"), lambda: store.enqueue("j", ready_at=0.0)):
            with pytest.raises(DatabaseError) as excinfo:
                call()
            assert type(excinfo.value) is DatabaseError
            assert "not a database" in str(excinfo.value)
            assert excinfo.value.__cause__ is not None
    finally:
        store.engine.dispose()
        engine.dispose()
    assert path.read_bytes() == content


@contextlib.contextmanager
def write_locked(path: str) -> Iterator[None]:
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
        other.execute("ROLLBACK")
    finally:
        other.close()


@pytest.mark.backend("sqlite")
def test_locked_database_raises_database_busy_and_changes_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "busy.db")
    engine = fencing.create_sqlite_engine(path, busy_timeout=0)
    store = JobStore(engine)
    try:
        store.create_table()
        store.enqueue("j", ready_at=0.0)
        with write_locked(path):
            with pytest.raises(DatabaseBusy) as excinfo:
                store.claim("j", "w", now=NOW, ttl=TTL)
            assert isinstance(excinfo.value, DatabaseError)
            assert excinfo.value.__cause__ is not None
        assert store.state("j") == JobState("j", None, 0.0, 0, None, False)
        assert store.claim("j", "w", now=NOW, ttl=TTL) == Lease("j", "w", 1, NOW + TTL)
    finally:
        store.engine.dispose()
        engine.dispose()
