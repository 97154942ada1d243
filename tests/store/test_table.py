"""The jobs table: its exact shape, its safe creation, and the SQLite engine settings."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Column, Engine, Integer, MetaData, Table, Text, inspect, select, text

import fencing
import service
from fencing import ConfigurationError, InvalidArgument, JobStore, Lease, SchemaMismatch, jobs_table
from fencing import configure_sqlite as configure
from fencing import create_sqlite_engine as create_engine
from fencing._runtime import sqlite as sqlite_glue
from fencing._sql.schema import as_text

pytestmark = pytest.mark.dialect

EXPECTED_TABLE_INFO = [
    (0, "id", "TEXT", 0, None, 1),
    (1, "owner", "TEXT", 0, None, 0),
    (2, "until", "REAL", 1, "0", 0),
    (3, "fence", "INTEGER", 1, "0", 0),
    (4, "result", "TEXT", 0, None, 0),
    (5, "done", "INTEGER", 1, "0", 0),
]

CONTRACT_DDL = (
    "CREATE TABLE jobs(id TEXT PRIMARY KEY, owner TEXT, until REAL NOT NULL DEFAULT 0, "
    "fence INTEGER NOT NULL DEFAULT 0, result TEXT, done INTEGER NOT NULL DEFAULT 0)"
)


@pytest.fixture(autouse=True)
def _fresh_service_cache() -> Iterator[None]:
    yield
    service._stores.clear()


@contextlib.contextmanager
def raw(path: str | Path) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection, as another program would open the file."""
    conn = sqlite3.connect(str(path), isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def table_info(path: str | Path, table: str = "jobs") -> list[tuple[Any, ...]]:
    with raw(path) as conn:
        return conn.execute(f"PRAGMA table_info({table})").fetchall()


def sqlite_schema(path: str | Path) -> list[tuple[Any, ...]]:
    with raw(path) as conn:
        return conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()


def pragma(engine: Engine, name: str) -> Any:
    with engine.connect() as conn:
        return conn.exec_driver_sql(f"PRAGMA {name}").scalar()


def plain_sqlite_engine(path: Path) -> Engine:
    """An engine the application made itself, without the library's settings."""
    return sqlalchemy.create_engine(sqlalchemy.URL.create("sqlite", database=str(path)))


def schema_of(engine: Engine, name: str) -> tuple[Any, ...]:
    """Everything about a table that a creation step could change."""
    insp = inspect(engine)
    columns = [
        (c["name"], str(c["type"]), c["nullable"], str(c.get("default"))) for c in insp.get_columns(name)
    ]
    return (columns, insp.get_pk_constraint(name)["constrained_columns"])


def rows_of(engine: Engine, name: str) -> list[tuple[Any, ...]]:
    table = Table(name, MetaData(), autoload_with=engine)
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(table).order_by(*table.c))]


# -- the shape ----------------------------------------------------------------------------


@pytest.mark.backend("sqlite")
def test_sqlite_declared_types_are_exactly_the_contracts(store: JobStore, target: str) -> None:
    assert table_info(target) == EXPECTED_TABLE_INFO


@pytest.mark.backend("sqlite")
def test_init_db_table_has_the_contracts_declared_types(target: str) -> None:
    service.init_db(target)
    assert table_info(target) == EXPECTED_TABLE_INFO


def test_columns_keep_their_meaning_on_every_backend(store: JobStore, engine: Engine) -> None:
    insp = inspect(engine)
    columns = {c["name"]: c for c in insp.get_columns("jobs")}
    assert list(columns) == ["id", "owner", "until", "fence", "result", "done"]
    assert insp.get_pk_constraint("jobs")["constrained_columns"] == ["id"]
    # text, or on MariaDB/MySQL exact-comparing UTF-8 bytes
    textual = (sqlalchemy.String, sqlalchemy.types._Binary)
    assert isinstance(columns["id"]["type"], textual)
    assert isinstance(columns["owner"]["type"], textual)
    assert isinstance(columns["until"]["type"], sqlalchemy.Float)
    assert isinstance(columns["fence"]["type"], sqlalchemy.Integer)
    if engine.dialect.name != "sqlite":  # SQLite declares REAL and INTEGER, both 8 bytes
        assert isinstance(columns["until"]["type"], sqlalchemy.Double)
        assert isinstance(columns["fence"]["type"], sqlalchemy.BigInteger)
    assert isinstance(columns["result"]["type"], sqlalchemy.String)
    assert isinstance(columns["done"]["type"], sqlalchemy.Integer)
    assert [columns[n]["nullable"] for n in ("until", "fence", "done")] == [False, False, False]


@pytest.mark.backend("mysql", "mariadb")
def test_keys_and_owners_are_bytes_and_results_binary_collated_on_mariadb(
    store: JobStore, engine: Engine
) -> None:
    # text collations fold case and ignore trailing spaces: ids, owners and keys are bytes
    fencing.FenceMarks(engine).create_tables()
    declared = {
        (table, c["name"]): str(c["type"].compile(dialect=engine.dialect))
        for table in ("jobs", "fence_marks", "idempotency_keys")
        for c in inspect(engine).get_columns(table)
    }
    assert declared["jobs", "id"] == "VARBINARY(1024)"
    assert declared["jobs", "owner"] == "LONGBLOB"
    assert declared["jobs", "result"] == "LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
    assert declared["fence_marks", "resource"] == "VARBINARY(1024)"
    assert declared["idempotency_keys", "key"] == "VARBINARY(1024)"


def test_until_keeps_double_precision(store: JobStore) -> None:
    # a single-precision column would round this to ~1.23456794e9
    now = 1234567890.123456
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", now=now, ttl=0.000001)
    assert lease is not None
    state = store.state("j")
    assert state is not None
    assert state.until == now + 0.000001
    assert state.until > now


def test_fence_is_64_bit(store: JobStore, engine: Engine) -> None:
    store.enqueue("j", ready_at=0.0)
    big = 2**62
    with engine.begin() as conn:
        conn.execute(fencing.jobs.update().values(fence=big))
    lease = store.claim("j", "w", now=1.0, ttl=1.0)
    assert lease is not None
    assert lease.fence == big + 1
    state = store.state("j")
    assert state is not None
    assert state.fence == big + 1


def test_enqueue_stores_the_column_defaults(store: JobStore, engine: Engine) -> None:
    assert store.enqueue("j", ready_at=0.0)
    t = fencing.jobs
    with engine.connect() as conn:
        row = conn.execute(select(as_text(t.c.id), as_text(t.c.owner), *list(t.c)[2:])).one()
    assert tuple(row) == ("j", None, 0.0, 0, None, 0)


def test_ids_and_owners_are_bytes_on_mariadb_and_str_through_as_text(store: JobStore, engine: Engine) -> None:
    t = fencing.jobs
    store.enqueue("Job", ready_at=0.0)
    store.enqueue("job ", ready_at=0.0)  # bytes compare exactly: no case folding, no padding
    assert store.claim("job ", "w", now=1.0, ttl=10.0) is not None
    with engine.begin() as conn:
        plain = conn.execute(select(t.c.id, t.c.owner).where(t.c.owner.is_not(None))).one()
        as_bytes = engine.dialect.name in ("mysql", "mariadb")
        assert tuple(plain) == ((b"job ", b"w") if as_bytes else ("job ", "w"))
        # as_text reads, compares and writes str on every backend
        conn.execute(t.update().where(as_text(t.c.id) == "Job").values(owner=as_text("é")))
        read = select(as_text(t.c.id), as_text(t.c.owner)).order_by(t.c.id)
        assert [tuple(r) for r in conn.execute(read)] == [("Job", "é"), ("job ", "w")]
    state = store.state("Job")
    assert state is not None
    assert state.owner == "é"


# -- a caller's MetaData ------------------------------------------------------------------


def test_jobs_table_in_callers_metadata_under_another_name_is_independent(engine: Engine) -> None:
    md = MetaData()
    leases = jobs_table(md, "leases")
    assert leases.name == "leases"
    assert leases.metadata is md
    assert list(md.tables) == ["leases"]
    assert list(fencing.jobs.metadata.tables) == ["jobs"]
    assert [c.name for c in leases.columns] == [c.name for c in fencing.jobs.columns]

    mine = JobStore(engine, leases)
    default = JobStore(engine)
    try:
        mine.create_table()
        assert "jobs" not in inspect(engine).get_table_names()
        assert mine.enqueue("a", ready_at=0.0)
        lease = mine.claim("a", "w", now=1.0, ttl=10.0)
        assert lease is not None
        assert lease.fence == 1
        assert mine.complete(lease, "done", now=2.0)

        default.create_table()
        assert default.state("a") is None
        assert default.enqueue("b", ready_at=0.0)
        assert mine.state("b") is None
        # the same id lives separately in each table
        assert default.enqueue("a", ready_at=0.0)
        assert default.claim("a", "x", now=1.0, ttl=10.0) == fencing.Lease("a", "x", 1, 11.0)
        mine_a = mine.state("a")
        assert mine_a is not None
        assert (mine_a.owner, mine_a.result, mine_a.done) == ("w", "done", True)
    finally:
        mine.engine.dispose()
        default.engine.dispose()


def test_jobs_table_declares_id_not_null_and_the_default_table_keeps_the_contracts_ddl() -> None:
    # an application's table for Alembic: every database reflects a primary key as NOT NULL
    assert jobs_table(MetaData()).c.id.nullable is False
    # the contract's `id TEXT PRIMARY KEY`: PRAGMA table_info shows notnull = 0
    assert fencing.jobs.c.id.nullable is True
    assert [(c.name, c.nullable) for c in jobs_table(MetaData()).c][1:] == [
        (c.name, c.nullable) for c in fencing.jobs.c
    ][1:]


@pytest.mark.parametrize("first", ["jobs_table", "fencing.jobs"])
def test_an_existing_table_of_either_id_nullability_is_accepted(engine: Engine, first: str) -> None:
    mine = jobs_table(MetaData())
    creator, other = (mine, fencing.jobs) if first == "jobs_table" else (fencing.jobs, mine)
    stores = [JobStore(engine, creator), JobStore(engine, other)]
    try:
        stores[0].create_table()
        assert stores[0].enqueue("j", ready_at=0.0)
        schema_before = schema_of(engine, "jobs")
        stores[1].create_table()  # no SchemaMismatch
        assert schema_of(engine, "jobs") == schema_before
        lease = stores[1].claim("j", "w", now=1.0, ttl=10.0)
        assert lease is not None
        assert stores[0].complete(lease, "r", now=2.0)
    finally:
        for s in stores:
            s.engine.dispose()


@pytest.mark.backend("sqlite")
def test_jobs_table_on_sqlite_declares_id_not_null(engine: Engine, target: str) -> None:
    store = JobStore(engine, jobs_table(MetaData()))
    try:
        store.create_table()
    finally:
        store.engine.dispose()
    assert table_info(target)[0] == (0, "id", "TEXT", 1, None, 1)
    assert table_info(target)[1:] == EXPECTED_TABLE_INFO[1:]


def test_jobs_table_twice_in_separate_metadata_gives_separate_tables() -> None:
    first = jobs_table(MetaData())
    second = jobs_table(MetaData())
    assert first is not second
    assert first is not fencing.jobs
    assert first.metadata is not second.metadata


# -- creating the table is safe -----------------------------------------------------------


def test_create_table_is_idempotent_and_keeps_rows(store: JobStore, engine: Engine) -> None:
    store.enqueue("j", ready_at=0.0)
    store.enqueue("k", ready_at=0.0)
    lease = store.claim("j", "w", now=5.0, ttl=10.0)
    assert lease is not None
    before = rows_of(engine, "jobs")
    schema_before = schema_of(engine, "jobs")

    store.create_table()
    store.create_table()
    other = JobStore(engine)
    try:
        other.create_table()
    finally:
        other.engine.dispose()

    assert rows_of(engine, "jobs") == before
    assert schema_of(engine, "jobs") == schema_before
    assert isinstance(store.renew(lease, now=6.0, ttl=10.0), Lease)


def test_create_table_never_touches_other_tables(engine: Engine) -> None:
    md = MetaData()
    audit = Table("audit", md, Column("n", Integer, primary_key=True), Column("note", Text))
    md.create_all(engine)
    with engine.begin() as conn:
        conn.execute(audit.insert(), [{"n": 1, "note": "one"}, {"n": 2, "note": "two"}])
    before = rows_of(engine, "audit")
    schema_before = schema_of(engine, "audit")

    store = JobStore(engine)
    try:
        store.create_table()
        store.create_table()
    finally:
        store.engine.dispose()

    assert sorted(inspect(engine).get_table_names()) == ["audit", "jobs"]
    assert rows_of(engine, "audit") == before == [(1, "one"), (2, "two")]
    assert schema_of(engine, "audit") == schema_before


@pytest.mark.backend("sqlite")
def test_init_db_is_idempotent_and_never_touches_other_tables_or_rows(target: str) -> None:
    with raw(target) as conn:
        conn.execute("CREATE TABLE audit(n INTEGER PRIMARY KEY, note TEXT)")
        conn.executemany("INSERT INTO audit VALUES (?, ?)", [(1, "one"), (2, "two")])
    service.init_db(target)
    service.enqueue(target, "j")
    assert service.claim(target, "j", "w", 1.0, 10.0) == 1
    with raw(target) as conn:
        audit_before = conn.execute("SELECT * FROM audit ORDER BY n").fetchall()
        jobs_before = conn.execute("SELECT * FROM jobs").fetchall()
    schema_before = sqlite_schema(target)

    service.init_db(target)
    service._stores.clear()  # a restarted process
    service.init_db(target)

    with raw(target) as conn:
        assert conn.execute("SELECT * FROM audit ORDER BY n").fetchall() == audit_before
        assert conn.execute("SELECT * FROM jobs").fetchall() == jobs_before
    assert audit_before == [(1, "one"), (2, "two")]
    assert jobs_before == [("j", "w", 11.0, 1, None, 0)]
    assert sqlite_schema(target) == schema_before


# -- an existing table that does not match ------------------------------------------------

# each variant differs from the jobs table in exactly one way: (changes, what the message names)
MISMATCHES = {
    "missing_column": ({"drop": "done"}, ["'done'", "missing"]),
    "extra_column": ({"add": lambda: Column("extra", Text)}, ["'extra'", "unexpected"]),
    "fence_is_text": ({"replace": lambda: Column("fence", Text, nullable=False)}, ["'fence'"]),
    "until_is_integer": (
        {"replace": lambda: Column("until", Integer, nullable=False, server_default=text("0"))},
        ["'until'"],
    ),
    "until_allows_null": (
        {
            "replace": lambda: Column(
                "until", fencing.jobs.c.until.type, nullable=True, server_default=text("0")
            )
        },
        ["'until'", "null"],
    ),
    # without the key, insert-or-ignore cannot see a duplicate: enqueue twice inserts twice
    "id_not_primary_key": (
        {"replace": lambda: Column("id", fencing.jobs.c.id.type, nullable=True)},
        ["'id'", "primary key"],
    ),
    # without the default, enqueue (which inserts only the id) cannot insert at all
    "until_without_default": (
        {"replace": lambda: Column("until", fencing.jobs.c.until.type, nullable=False)},
        ["'until'", "default"],
    ),
    # every enqueued job would be born done and could never be claimed
    "done_defaults_to_1": (
        {"replace": lambda: Column("done", Integer, nullable=False, server_default=text("1"))},
        ["'done'", "default"],
    ),
}


def _variant_table(md: MetaData, change: dict[str, Any]) -> Table:
    columns: list[Column[Any]] = []
    for col in fencing.jobs.columns:
        if col.name == change.get("drop"):
            continue
        replacement = change["replace"]() if "replace" in change else None
        if replacement is not None and replacement.name == col.name:
            columns.append(replacement)
            continue
        default = text("0") if col.server_default is not None else None
        columns.append(
            Column(
                col.name, col.type, primary_key=col.primary_key, nullable=col.nullable, server_default=default
            )
        )
    if "add" in change:
        columns.append(change["add"]())
    return Table("jobs", md, *columns)


def _variant_row(table: Table) -> dict[str, Any]:
    # ids and owners through the codec: the columns are bytes on MariaDB/MySQL
    full = {
        "id": as_text("keep"),
        "owner": as_text("w"),
        "until": 12.5,
        "fence": 7,
        "result": "r",
        "done": 0,
        "extra": "x",
    }
    row = {col.name: full[col.name] for col in table.c}
    if isinstance(table.c.fence.type, sqlalchemy.Text):
        row["fence"] = "7"
    return row


@pytest.mark.parametrize(("change", "named"), list(MISMATCHES.values()), ids=list(MISMATCHES))
def test_mismatched_jobs_table_raises_schema_mismatch_and_is_left_unchanged(
    engine: Engine, change: dict[str, Any], named: list[str]
) -> None:
    table = _variant_table(MetaData(), change)
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(table.insert().values(_variant_row(table)))
    schema_before = schema_of(engine, "jobs")
    rows_before = rows_of(engine, "jobs")

    store = JobStore(engine)
    try:
        with pytest.raises(SchemaMismatch) as excinfo:
            store.create_table()
    finally:
        store.engine.dispose()

    message = str(excinfo.value).lower()
    for fragment in named:
        assert fragment in message
    assert schema_of(engine, "jobs") == schema_before
    assert rows_of(engine, "jobs") == rows_before
    assert len(rows_before) == 1


SQLITE_MISMATCHES = {
    "until_declared_double": (
        "CREATE TABLE jobs(id TEXT PRIMARY KEY, owner TEXT, until DOUBLE NOT NULL DEFAULT 0, "
        "fence INTEGER NOT NULL DEFAULT 0, result TEXT, done INTEGER NOT NULL DEFAULT 0)",
        ["'until'", "real"],
    ),
    "fence_declared_bigint": (
        "CREATE TABLE jobs(id TEXT PRIMARY KEY, owner TEXT, until REAL NOT NULL DEFAULT 0, "
        "fence BIGINT NOT NULL DEFAULT 0, result TEXT, done INTEGER NOT NULL DEFAULT 0)",
        ["'fence'", "integer"],
    ),
    "id_declared_varchar": (
        "CREATE TABLE jobs(id VARCHAR(40) PRIMARY KEY, owner TEXT, until REAL NOT NULL DEFAULT 0, "
        "fence INTEGER NOT NULL DEFAULT 0, result TEXT, done INTEGER NOT NULL DEFAULT 0)",
        ["'id'", "text"],
    ),
    "no_done_column": (
        "CREATE TABLE jobs(id TEXT PRIMARY KEY, owner TEXT, until REAL NOT NULL DEFAULT 0, "
        "fence INTEGER NOT NULL DEFAULT 0, result TEXT)",
        ["'done'", "missing"],
    ),
    "id_not_primary_key": (
        "CREATE TABLE jobs(id TEXT, owner TEXT, until REAL NOT NULL DEFAULT 0, "
        "fence INTEGER NOT NULL DEFAULT 0, result TEXT, done INTEGER NOT NULL DEFAULT 0)",
        ["'id'", "primary key"],
    ),
}


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize(("ddl", "named"), list(SQLITE_MISMATCHES.values()), ids=list(SQLITE_MISMATCHES))
def test_init_db_on_mismatched_sqlite_table_raises_and_leaves_file_unchanged(
    target: str, ddl: str, named: list[str]
) -> None:
    with raw(target) as conn:
        conn.execute(ddl)
        conn.execute("INSERT INTO jobs(id, owner, until, fence, result) VALUES ('keep', 'w', 12.5, 7, 'r')")
        rows_before = conn.execute("SELECT * FROM jobs").fetchall()
    schema_before = sqlite_schema(target)

    with pytest.raises(SchemaMismatch) as excinfo:
        service.init_db(target)

    message = str(excinfo.value).lower()
    for fragment in named:
        assert fragment in message
    assert sqlite_schema(target) == schema_before
    with raw(target) as conn:
        assert conn.execute("SELECT * FROM jobs").fetchall() == rows_before


# -- the contract's literal DDL -----------------------------------------------------------


@pytest.mark.backend("sqlite")
def test_table_from_contracts_literal_ddl_is_accepted_and_usable_by_service(target: str) -> None:
    with raw(target) as conn:
        conn.execute(CONTRACT_DDL)
        conn.execute("INSERT INTO jobs(id) VALUES ('old')")
    schema_before = sqlite_schema(target)
    assert table_info(target) == EXPECTED_TABLE_INFO

    service.init_db(target)
    # the table is untouched; the only addition is claim_next's index (an index, not a column)
    ready_index = ("index", "ix_jobs_ready", "CREATE INDEX ix_jobs_ready ON jobs (done, until, id)")
    assert sorted(sqlite_schema(target), key=repr) == sorted([*schema_before, ready_index], key=repr)
    assert table_info(target) == EXPECTED_TABLE_INFO
    assert service.state(target, "old") == {
        "id": "old",
        "owner": None,
        "until": 0.0,
        "fence": 0,
        "result": None,
        "done": 0,
    }
    assert service.enqueue(target, "new") is True
    fence = service.claim(target, "new", "w", 10.0, 5.0)
    assert fence == 1
    assert service.renew(target, "new", "w", 1, 12.0, 5.0) is True
    assert service.complete(target, "new", "w", 1, 13.0, "ok") is True
    assert service.claim(target, "old", "v", 10.0, 5.0) == 1
    assert service.release(target, "old", "v", 1) is True
    with raw(target) as conn:
        assert conn.execute("SELECT * FROM jobs ORDER BY id").fetchall() == [
            ("new", "w", 17.0, 1, "ok", 1),
            ("old", None, 0.0, 1, None, 0),
        ]


# -- SQLite engine settings ---------------------------------------------------------------


@pytest.mark.backend("sqlite")
def test_wal_and_synchronous_full_by_default(engine: Engine) -> None:
    assert pragma(engine, "journal_mode") == "wal"
    assert pragma(engine, "synchronous") == 2  # FULL
    assert pragma(engine, "busy_timeout") == 5000


@pytest.mark.backend("sqlite")
def test_service_database_is_wal_with_synchronous_full(target: str) -> None:
    service.init_db(target)
    # journal_mode=WAL is stored in the file: any other program sees it
    with raw(target) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert pragma(service._stores.get(target).engine, "synchronous") == 2


@pytest.mark.backend("sqlite")
def test_synchronous_normal_with_durability_normal(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / "normal.db", durability="normal")
    try:
        assert pragma(engine, "journal_mode") == "wal"
        assert pragma(engine, "synchronous") == 1  # NORMAL
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize("durability", ["off", "FULL", "", None])
def test_unknown_durability_is_refused_and_creates_nothing(tmp_path: Path, durability: Any) -> None:
    path = tmp_path / "x.db"
    with pytest.raises(InvalidArgument, match="durability"):
        create_engine(path, durability=durability)
    assert not path.exists()


@pytest.mark.backend("sqlite")
def test_configure_equips_a_user_made_engine(tmp_path: Path) -> None:
    path = tmp_path / "mine.db"
    engine = plain_sqlite_engine(path)
    try:
        assert configure(engine) is engine
        assert sqlite_glue.is_configured(engine)
        assert pragma(engine, "journal_mode") == "wal"
        assert pragma(engine, "synchronous") == 2
        # the application's transactions begin DEFERRED: a reader takes no write lock
        with engine.connect() as conn, conn.begin(), raw(path) as other:
            conn.exec_driver_sql("SELECT 1").all()
            other.execute("PRAGMA busy_timeout = 0")
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
        # asked for IMMEDIATE, the write lock is held from the start of the transaction
        immediate = {sqlite_glue.BEGIN_OPTION: "IMMEDIATE"}
        with engine.connect().execution_options(**immediate) as conn, conn.begin(), raw(path) as other:
            other.execute("PRAGMA busy_timeout = 0")
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        store = JobStore(engine)
        try:
            store.create_table()
            assert store.enqueue("j", ready_at=0.0)
            assert store.claim("j", "w", now=1.0, ttl=1.0) == fencing.Lease("j", "w", 1, 2.0)
        finally:
            store.engine.dispose()
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
def test_configure_with_durability_normal_on_a_user_made_engine(tmp_path: Path) -> None:
    engine = plain_sqlite_engine(tmp_path / "mine.db")
    try:
        configure(engine, durability="normal")
        assert pragma(engine, "synchronous") == 1
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
def test_double_configure_raises_configuration_error(tmp_path: Path) -> None:
    engine = plain_sqlite_engine(tmp_path / "mine.db")
    made = create_engine(tmp_path / "made.db")
    try:
        configure(engine)
        with pytest.raises(ConfigurationError, match="already configured"):
            configure(engine, durability="normal")
        # the first settings stay
        assert pragma(engine, "synchronous") == 2
        with pytest.raises(ConfigurationError, match="already configured"):
            configure(made)
    finally:
        engine.dispose()
        made.dispose()


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize(
    "options", [{"begin": "NONSENSE"}, {"begin": "IMMEDIATE; DROP TABLE jobs"}, {"busy_timeout": -1}]
)
def test_configure_with_bad_options_leaves_engine_unconfigured(tmp_path: Path, options: Any) -> None:
    engine = plain_sqlite_engine(tmp_path / "mine.db")
    try:
        with pytest.raises(InvalidArgument):
            configure(engine, **options)
        assert not sqlite_glue.is_configured(engine)
        with pytest.raises(ConfigurationError):
            JobStore(engine)
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
def test_store_on_unconfigured_sqlite_engine_raises_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "plain.db"
    engine = plain_sqlite_engine(path)
    try:
        with pytest.raises(ConfigurationError) as excinfo:
            JobStore(engine)
        assert "BEGIN IMMEDIATE" in str(excinfo.value)
        assert "configure" in str(excinfo.value)
        assert not path.exists()
    finally:
        engine.dispose()


def test_configure_refuses_a_non_sqlite_engine() -> None:
    # no connection is made: the refusal comes from the dialect alone
    engine = sqlalchemy.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    try:
        with pytest.raises(ConfigurationError, match="SQLite"):
            configure(engine)
    finally:
        engine.dispose()
