"""Alembic: the library's tables in an application's ``MetaData`` migrate as generated.

A stock ``alembic init`` project (env.py untouched but for ``target_metadata``) autogenerates
a first migration that applies, then a second one that is empty, on every backend; the
library then works on the migrated tables. A table the library created itself compares
clean too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import Engine, MetaData, Table, inspect

import fencing
from fencing import (
    FenceMarks,
    History,
    JobStore,
    fence_marks_table,
    history_table,
    idempotency_keys_table,
    jobs_table,
)
from fencing._store.marks import marks_metadata

pytestmark = pytest.mark.dialect

#: the application's models module, as a user would write it
MODELS_MODULE = "app_models"
MODELS = '''\
"""The application's tables: the library's four, in the application's own MetaData."""

from sqlalchemy import MetaData

import fencing

metadata = MetaData()
jobs = fencing.jobs_table(metadata)
fence_marks = fencing.fence_marks_table(metadata)
idempotency_keys = fencing.idempotency_keys_table(metadata)
history = fencing.history_table(metadata)
'''

TABLES = {
    "jobs": ["id", "owner", "until", "fence", "result", "done"],
    "fence_marks": ["resource", "fence"],
    "idempotency_keys": ["key", "fence", "recorded_at"],
    "fencing_history": [
        "seq",
        "job_id",
        "event",
        "owner",
        "fence",
        "until",
        "at",
        "path",
        "reason",
        "holder",
        "current_fence",
    ],
}


@dataclass(frozen=True)
class App:
    """The application's tables, built the way the models module builds them."""

    metadata: MetaData
    jobs: Table
    marks: Table
    keys: Table
    history: Table

    @classmethod
    def tables(cls, prefix: str = "") -> App:
        md = MetaData()
        return cls(
            md,
            jobs_table(md, f"{prefix}jobs"),
            fence_marks_table(md, f"{prefix}fence_marks"),
            idempotency_keys_table(md, f"{prefix}idempotency_keys"),
            history_table(md, f"{prefix}fencing_history"),
        )


@dataclass(frozen=True)
class Project:
    """An ``alembic init`` project in a temporary directory, on the test's database."""

    config: Config

    def autogenerate(self, message: str) -> Path:
        script = command.revision(self.config, message=message, autogenerate=True)
        assert script is not None and not isinstance(script, list)
        return Path(script.path)

    def upgrade(self) -> None:
        command.upgrade(self.config, "head")


def database_url(target: str) -> str:
    return target if "://" in target else f"sqlite:///{target}"


def upgrade_statements(script: Path) -> list[str]:
    """The statements of a generated script's ``upgrade()``, its docstring left out."""
    module = ast.parse(script.read_text())
    upgrade = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "upgrade")
    return [
        ast.unparse(stmt)
        for stmt in upgrade.body
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
    ]


def differences(engine: Engine, metadata: MetaData) -> list[Any]:
    """What autogenerate would change to make the database's tables match ``metadata``'s
    (tables of other metadata in the same database are left out)."""

    def ours(name: str | None, type_: str, parent: Any) -> bool:
        return type_ != "table" or name in metadata.tables

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_name": ours})
        return list(compare_metadata(context, metadata))


def reflected(engine: Engine, name: str) -> tuple[Any, ...]:
    """A table's columns (name, type, nullable, default), key and indexed columns; a default
    naming the table (PostgreSQL's sequence of a serial key) names it ``<table>``."""
    insp = inspect(engine)
    columns = [
        (c["name"], str(c["type"]), c["nullable"], str(c.get("default")).replace(name, "<table>"))
        for c in insp.get_columns(name)
    ]
    indexes = sorted(tuple(ix["column_names"]) for ix in insp.get_indexes(name))
    return columns, insp.get_pk_constraint(name)["constrained_columns"], indexes


@pytest.fixture
def project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, logging_kept: None
) -> Iterator[Project]:
    monkeypatch.chdir(tmp_path)
    # alembic.ini's prepend_sys_path = . puts the project directory on sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))
    # and its finder for "." is cached with the directory it first met: another test's
    monkeypatch.setattr(
        sys, "path_importer_cache", {k: v for k, v in sys.path_importer_cache.items() if k != "."}
    )
    (tmp_path / f"{MODELS_MODULE}.py").write_text(MODELS)
    ini = tmp_path / "alembic.ini"
    command.init(Config(str(ini)), "migrations")

    # the user's two edits: the database's URL, and target_metadata
    stock_ini = ini.read_text()
    placeholder = "sqlalchemy.url = driver://user:pass@localhost/dbname\n"
    assert stock_ini.count(placeholder) == 1
    url = database_url(target).replace("%", "%%")  # configparser interpolates %
    ini.write_text(stock_ini.replace(placeholder, f"sqlalchemy.url = {url}\n"))
    env = tmp_path / "migrations" / "env.py"
    stock_env = env.read_text()
    assert stock_env.count("target_metadata = None\n") == 1
    env.write_text(
        stock_env.replace(
            "target_metadata = None\n", f"from {MODELS_MODULE} import metadata\ntarget_metadata = metadata\n"
        )
    )

    sys.modules.pop(MODELS_MODULE, None)
    try:
        yield Project(Config(str(ini)))
    finally:
        sys.modules.pop(MODELS_MODULE, None)


# -- autogenerate, upgrade, autogenerate again ----------------------------------------------


def test_first_migration_applies_as_generated_and_the_second_is_empty(
    project: Project, engine: Engine
) -> None:
    first = project.autogenerate("initial tables")
    source = first.read_text()
    # the library's own types would be rendered without an import: NameError at upgrade
    assert "fencing." not in source
    created = " ".join(upgrade_statements(first))
    for name in TABLES:
        assert f"op.create_table('{name}'" in created
    assert "op.create_index('ix_jobs_ready', 'jobs', ['done', 'until', 'id']" in created
    project.upgrade()

    app = App.tables()
    assert differences(engine, app.metadata) == []
    second = project.autogenerate("nothing to change")
    assert upgrade_statements(second) == ["pass"]
    project.upgrade()  # the empty migration applies too

    names = set(inspect(engine).get_table_names())
    assert {*TABLES, "alembic_version"} <= names
    for name, columns in TABLES.items():
        assert [c["name"] for c in inspect(engine).get_columns(name)] == columns
        assert inspect(engine).get_pk_constraint(name)["constrained_columns"] == columns[:1]


def test_a_table_migrated_by_an_older_version_gets_the_claim_order_index_from_autogenerate(
    project: Project, engine: Engine
) -> None:
    project.autogenerate("initial tables")
    project.upgrade()
    on = " ON jobs" if engine.dialect.name in ("mysql", "mariadb") else ""
    with engine.begin() as conn:  # the index as fencing before 0.2 declared it
        conn.exec_driver_sql(f"DROP INDEX ix_jobs_ready{on}")
        conn.exec_driver_sql("CREATE INDEX ix_jobs_ready ON jobs (done, until)")
    second = project.autogenerate("the ready index in claim order")
    changes = " ".join(upgrade_statements(second))
    assert "op.drop_index(op.f('ix_jobs_ready'), table_name='jobs')" in changes
    assert "op.create_index('ix_jobs_ready', 'jobs', ['done', 'until', 'id']" in changes
    project.upgrade()
    assert differences(engine, App.tables().metadata) == []
    [ready] = [ix for ix in inspect(engine).get_indexes("jobs") if ix["name"] == "ix_jobs_ready"]
    assert ready["column_names"] == ["done", "until", "id"]


def test_migrated_tables_are_the_ones_the_library_creates(project: Project, engine: Engine) -> None:
    project.autogenerate("initial tables")
    project.upgrade()
    made = App.tables(prefix="made_")
    store = JobStore(engine, made.jobs, history=History(made.history))
    try:
        store.create_table()
        FenceMarks(engine, made.marks, made.keys).create_tables()
    finally:
        store.engine.dispose()
    for name in TABLES:
        assert reflected(engine, name) == reflected(engine, f"made_{name}")


def test_the_library_works_on_the_migrated_tables(project: Project, engine: Engine) -> None:
    project.autogenerate("initial tables")
    project.upgrade()
    app = App.tables()
    store = JobStore(engine, app.jobs, history=History(app.history, retention=None))
    try:
        store.create_table()  # the migrated table passes the library's own check
        assert store.enqueue("invoice-42", ready_at=0.0)
        lease = store.claim("invoice-42", "worker-a", now=1.0, ttl=30.0)
        assert lease == fencing.Lease("invoice-42", "worker-a", 1, 31.0)
        assert store.complete(lease, "paid", now=2.0)
        state = store.state("invoice-42")
        assert state is not None
        assert (state.job_id, state.owner, state.fence, state.result, state.done) == (
            "invoice-42",
            "worker-a",
            1,
            "paid",
            True,
        )
        assert store.claim_next("worker-b", now=3.0, ttl=30.0) == []
        assert [(e.event, e.owner, e.fence, e.at) for e in store.history("invoice-42")] == [
            ("claim", "worker-a", 1, 1.0),
            ("complete", "worker-a", 1, 2.0),
        ]

        marks = FenceMarks(engine, app.marks, app.keys)
        marks.create_tables()
        assert marks.accept("invoice-42", lease.fence)
        assert not marks.accept("invoice-42", lease.fence - 1)
        assert marks.highest("invoice-42") == lease.fence
        assert marks.record_once("charge:42", fence=lease.fence)
        assert not marks.record_once("charge:42")
    finally:
        store.engine.dispose()
    # and the schema is still what the migration made
    assert differences(engine, app.metadata) == []


# -- tables the library created compare clean ----------------------------------------------


def test_tables_created_by_the_library_compare_clean(engine: Engine) -> None:
    app = App.tables()
    store = JobStore(engine, app.jobs, history=History(app.history))
    try:
        store.create_table()
    finally:
        store.engine.dispose()
    FenceMarks(engine, app.marks, app.keys).create_tables()
    assert differences(engine, app.metadata) == []


def test_default_tables_compare_clean_but_for_the_contracts_nullable_id_on_servers(engine: Engine) -> None:
    store = JobStore(engine)
    try:
        store.create_table()
    finally:
        store.engine.dispose()
    FenceMarks(engine).create_tables()
    assert differences(engine, marks_metadata) == []
    found = differences(engine, fencing.jobs.metadata)
    if engine.dialect.name == "sqlite":
        assert found == []  # SQLite reflects `id TEXT PRIMARY KEY` as nullable, as declared
    else:
        # the servers make a primary key NOT NULL; fencing.jobs keeps the contract's DDL
        # (nullable id), which is why an application's MetaData uses jobs_table()
        [[change]] = found
        assert change[0] == "modify_nullable"
        assert change[2:4] == ("jobs", "id")
        assert change[5:] == (False, True)


def test_the_locks_tables_migrate_as_generated_and_the_locks_work_on_them(
    project: Project, engine: Engine
) -> None:
    """``locks_table(metadata)`` puts the locks table and its waiters' queue in the
    application's MetaData: autogenerate creates both, the next autogenerate is empty, and
    the locks (their queue too) work on the migrated tables."""
    models = Path.cwd() / f"{MODELS_MODULE}.py"
    models.write_text(MODELS + "locks = fencing.locks_table(metadata)\n")
    first = project.autogenerate("initial tables, and the locks")
    created = " ".join(upgrade_statements(first))
    assert "op.create_table('fencing_locks'" in created
    assert "op.create_table('fencing_locks_waiters'" in created
    assert (
        "op.create_index('ix_fencing_locks_waiters_queue', 'fencing_locks_waiters', ['name', 'ticket']"
        in created
    )
    project.upgrade()
    second = project.autogenerate("nothing to change")
    assert upgrade_statements(second) == ["pass"]

    app = App.tables()
    locks_t = fencing.locks_table(app.metadata)
    assert differences(engine, app.metadata) == []
    locks = fencing.Locks(engine, locks_t, poll=0.05)
    locks.create_table()  # the migrated tables pass the library's own check
    held = locks.try_acquire("nightly", "host-a", ttl=30.0)
    assert held is not None and held.fence == 1
    ticket = locks.queue.enter("nightly", "host-b", keep=5.0, now=None)
    assert locks.try_acquire("nightly", "host-c", ttl=30.0) is None
    assert locks.release(held)
    assert locks.try_acquire("nightly", "host-c", ttl=30.0) is None  # host-b is ahead in the queue
    locks.queue.leave(ticket)
    after = locks.try_acquire("nightly", "host-c", ttl=30.0)
    assert after is not None and after.fence == 2
    assert differences(engine, app.metadata) == []


def test_the_payloads_and_failures_tables_migrate_as_generated_and_work(
    project: Project, engine: Engine
) -> None:
    """``payloads_table(metadata)`` in the application's MetaData: autogenerate creates it
    with stock types (a 4 GiB text on MariaDB), the next autogenerate is empty, and a job's
    payload travels from its enqueue to its claim on the migrated table."""
    models = Path.cwd() / f"{MODELS_MODULE}.py"
    models.write_text(
        MODELS + "payloads = fencing.payloads_table(metadata)\nfailures = fencing.failures_table(metadata)\n"
    )
    first = project.autogenerate("initial tables, the payloads and the failures")
    created = " ".join(upgrade_statements(first))
    assert "op.create_table('fencing_payloads'" in created
    assert "op.create_table('fencing_failures'" in created
    assert "fencing." not in created  # stock SQLAlchemy types only
    project.upgrade()
    second = project.autogenerate("nothing to change")
    assert upgrade_statements(second) == ["pass"]

    app = App.tables()
    payloads_t = fencing.payloads_table(app.metadata)
    failures_t = fencing.failures_table(app.metadata)
    assert differences(engine, app.metadata) == []
    store = fencing.JobStore(engine, app.jobs, payloads=payloads_t, failures=failures_t)
    store.create_table()  # the migrated tables pass the library's own check
    store.enqueue("invoice-7", payload={"amount": "12.50", "lines": [1, 2]})
    [lease] = store.claim_next("worker-a", ttl=30.0)
    assert lease.payload == {"amount": "12.50", "lines": [1, 2]}
    assert store.release(lease, failure="Traceback ...\nValueError: no")
    assert store.failure("invoice-7") is not None
    assert differences(engine, app.metadata) == []
