"""The hot statements' plans at a realistic backlog: 100,000 ready jobs, on every backend.

A queue that has fallen behind must not slow down: ``claim_next`` picks the longest-ready
jobs by walking the ready index ``(done, until, id)`` from its start and stops at ``LIMIT``
(no scan, no sort of the ready set), then claims them through the primary key; the batch
completion finds each job by its primary key. Checked twice:

* the plan (SQLite ``EXPLAIN QUERY PLAN``, PostgreSQL ``EXPLAIN (FORMAT JSON)``, MariaDB
  ``EXPLAIN``) of every statement ``claim_next``, ``poisoned`` and ``complete_many`` run,
  on fresh tables (no statistics: SQLite users do not run ``ANALYZE``) and analyzed ones,
  with the ready jobs all tied (the contract's rows, ready at 0) or spread over time;
* what the engine visits, where it says: SQLite's virtual-machine steps for a claim at
  1,000 and at 100,000 ready jobs, PostgreSQL's ``EXPLAIN (ANALYZE, BUFFERS)`` rows and
  pages, MariaDB's ``ANALYZE`` rows read. Nothing is timed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, MetaData, Table, bindparam, create_engine, event, insert, text
from sqlalchemy.sql import Executable

from fencing import JobStore, attempts_table
from fencing._sql.schema import KEY_TYPE
from fencing._sql.statements import Statements

pytestmark = pytest.mark.dialect

BACKLOG = 100_000
SMALL = 1_000
FENCE_MAX = 2**63 - 1
LIMIT = 10


def load(engine: Engine, store: JobStore, start: int, stop: int, *, tied: bool) -> None:
    """Ready jobs ``start``..``stop``: all at ``until = 0`` (``tied``) or one ms apart."""
    t = store.table
    stmt = insert(t).values(id=bindparam("k", type_=KEY_TYPE), until=bindparam("u"))
    rows = [{"k": f"job-{n:07d}", "u": 0.0 if tied else 1000.0 + n / 1000} for n in range(start, stop)]
    with engine.begin() as conn:
        for at in range(0, len(rows), 10_000):
            conn.execute(stmt, rows[at : at + 10_000])


def analyze(engine: Engine, store: JobStore) -> None:
    name = store.table.name
    with engine.begin() as conn:
        conn.exec_driver_sql(
            {"sqlite": "ANALYZE", "postgresql": f"ANALYZE {name}"}.get(
                engine.dialect.name, f"ANALYZE TABLE {name}"
            )
        )


def compiled(engine: Engine, stmt: Executable, params: dict[str, Any]) -> tuple[str, Any]:
    """The SQL the dialect sends for ``stmt`` and its DBAPI parameters (unprocessed: ids go
    as strings, which every driver compares with the key column as the store's do)."""
    comp = stmt.compile(dialect=engine.dialect)
    values = {**comp.params, **{k: v for k, v in params.items() if k in comp.params}}
    if comp.positiontup:
        return str(comp), tuple(values[k] for k in comp.positiontup)
    return str(comp), values


def explain(conn: Connection, prefix: str, stmt: Executable, params: dict[str, Any]) -> list[Any]:
    sql, args = compiled(conn.engine, stmt, params)
    return conn.exec_driver_sql(prefix + sql, args).fetchall()


def hot_statements(
    store: JobStore,
    clock: str,
    limit: int = LIMIT,
    *,
    attempts: Table | None = None,
    max_fence: int = FENCE_MAX,
) -> dict[str, tuple[Executable, dict[str, Any]]]:
    """Every statement claim_next, poisoned and complete_many send on this backend, with
    bind values for a claim of ``limit`` jobs and a batch of ``limit`` completions (the
    statements of a store that requeues, with ``attempts``)."""
    s = Statements(store.table, clock, attempts=attempts)  # type: ignore[arg-type]
    params: dict[str, Any] = {"holder": "w", "limit": limit, "max_fence": max_fence}
    params.update({"now": 5e9, "new_until": 5e9 + 30} if clock == "caller" else {"ttl": 30.0})
    ids = {f"id_{i}": f"job-{i:07d}" for i in range(limit)}
    batch = {
        **ids,
        **{f"n_{i}": i for i in range(limit)},
        **{f"holder_{i}": "w" for i in range(limit)},
        **{f"token_{i}": 1 for i in range(limit)},
        **{f"result_{i}": "r" for i in range(limit)},
    }
    dialect = store.engine.dialect.name
    found: dict[str, tuple[Executable, dict[str, Any]]] = {"poisoned": (s.poisoned, params)}
    if dialect in ("mysql", "mariadb"):
        claim, read = s.claim_ids(limit)
        found |= {
            "pick": (s.pick_ready, params),
            "claim picked": (claim, {**params, **ids}),
            "read claimed": (read, {**params, **ids}),
            "lock batch": (s.lock_live(limit), {**params, **ids}),
            "complete batch": (s.complete_batch_joined(limit), {**params, **batch, "judged_at": 5e9}),
        }
    else:
        found["claim_next"] = (s.claim_next_returning, params)
        if dialect == "postgresql":
            arrays = {
                "ns": list(range(limit)),
                "ids": list(ids.values()),
                "holders": ["w"] * limit,
                "tokens": [1] * limit,
                "results": ["r"] * limit,
            }
            found["complete batch"] = (s.complete_batch_arrays(), {**params, **arrays})
        else:  # SQLite completes each lease by its key, in one transaction
            found["complete"] = (
                s.complete,
                {**params, "job_id": "job-0000001", "token": 1, "new_result": "r"},
            )
    return found


@pytest.fixture(params=["tied", "spread"])
def backlog(request: pytest.FixtureRequest, store: JobStore, engine: Engine) -> JobStore:
    load(engine, store, 0, BACKLOG, tied=request.param == "tied")
    return store


# -- the plans ------------------------------------------------------------------------------


def sqlite_problems(name: str, table: str, rows: list[Any]) -> list[str]:
    details = [str(row[-1]) for row in rows]
    problems = [f"{name}: {d}" for d in details if "TEMP B-TREE" in d]
    problems += [f"{name}: full scan: {d}" for d in details if d.startswith(f"SCAN {table}")]
    if name == "claim_next":
        if not details[0].startswith(f"SEARCH {table} USING") or "(id=?)" not in details[0]:
            problems.append(f"claim_next's UPDATE does not find the picked rows by id: {details[0]}")
        if not any(f"ix_{table}_ready" in d for d in details):
            problems.append(f"claim_next's pick does not use the ready index: {details}")
    return problems


def postgresql_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from postgresql_nodes(child)


def postgresql_problems(name: str, table: str, plan: dict[str, Any]) -> list[str]:
    nodes = list(postgresql_nodes(plan))
    scans = [n for n in nodes if n.get("Relation Name") == table]
    if name == "poisoned":
        # it lists every poisoned job (no LIMIT), so it reads the whole ready set, by the
        # ready index or (analyzed, when nearly every row is ready) a sequential scan; what
        # it sorts is only what passed the attempts filter in that scan, never the ready set
        return [
            f"poisoned: {n['Node Type']} without the attempts filter" for n in scans if "fence" not in str(n)
        ]
    problems = [f"{name}: sequential scan of {table}" for n in scans if n["Node Type"] == "Seq Scan"]
    problems += [f"{name}: {n['Node Type']} ({n.get('Sort Key')})" for n in nodes if "Sort" in n["Node Type"]]
    if name == "claim_next" and not any(n.get("Index Name") == f"ix_{table}_ready" for n in scans):
        problems.append(f"{name} does not use the ready index: {[n['Node Type'] for n in nodes]}")
    return problems


def mariadb_problems(name: str, table: str, rows: list[dict[str, Any]]) -> list[str]:
    problems = []
    for row in rows:
        if row["table"] not in (table, None) and not str(row["table"]).startswith(table):
            continue
        extra = str(row.get("Extra") or "")
        if row["type"] == "ALL" and row["table"] == table:
            problems.append(f"{name}: full scan of {table}")
        if "filesort" in extra:
            problems.append(f"{name}: filesort ({extra})")
    wanted = f"ix_{table}_ready" if name in ("pick", "poisoned") else "PRIMARY"
    if not any(row["key"] == wanted for row in rows if row["table"] == table):
        problems.append(f"{name} does not use {wanted}: {[(r['table'], r['key']) for r in rows]}")
    return problems


@pytest.mark.sync_only("the plans of the statements both fronts send")
@pytest.mark.parametrize("statistics", ["fresh", "analyzed"])
@pytest.mark.parametrize("clock", ["caller", "database"])
@pytest.mark.parametrize("limit", [LIMIT, 100])
def test_every_hot_statement_walks_an_index_in_claim_order(
    backlog: JobStore, engine: Engine, clock: str, statistics: str, limit: int
) -> None:
    if statistics == "analyzed":
        analyze(engine, backlog)
    table = backlog.table.name
    dialect = engine.dialect.name
    problems: list[str] = []
    for name, (stmt, params) in hot_statements(backlog, clock, limit).items():
        # each in a transaction of its own, as the store runs them
        with engine.connect() as conn:
            if name == "claim_next" and dialect == "postgresql" and limit > 1:
                conn.execute(Statements.walk_in_claim_order)  # what the store sends first
            if dialect == "sqlite":
                problems += sqlite_problems(name, table, explain(conn, "EXPLAIN QUERY PLAN ", stmt, params))
            elif dialect == "postgresql":
                [[plan]] = explain(conn, "EXPLAIN (FORMAT JSON) ", stmt, params)
                problems += postgresql_problems(name, table, plan[0]["Plan"])
            else:
                result = explain(conn, "EXPLAIN ", stmt, params)
                problems += mariadb_problems(name, table, [dict(row._mapping) for row in result])
            conn.rollback()
    assert problems == []


@pytest.mark.sync_only("the plans of the statements both fronts send")
@pytest.mark.parametrize("statistics", ["fresh", "analyzed"])
def test_a_store_that_requeues_claims_by_the_same_walk(
    backlog: JobStore, engine: Engine, statistics: str
) -> None:
    """With an attempts table (1,000 requeued jobs in it), claim_next(max_attempts=5) and
    poisoned still walk the ready index in claim order: the base is looked up by its key,
    only for a job at max_attempts or above, and nothing is sorted."""
    attempts = attempts_table(MetaData(), f"{backlog.table.name}_attempts")
    attempts.create(engine)
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(attempts).values(id=bindparam("k", type_=KEY_TYPE), base=bindparam("b")),
                [{"k": f"job-{n:07d}", "b": 0} for n in range(0, BACKLOG, BACKLOG // 1000)],
            )
        if statistics == "analyzed":
            analyze(engine, backlog)
        table = backlog.table.name
        dialect = engine.dialect.name
        problems: list[str] = []
        for name, (stmt, params) in hot_statements(
            backlog, "database", attempts=attempts, max_fence=5
        ).items():
            with engine.connect() as conn:
                if dialect == "sqlite":
                    problems += sqlite_problems(
                        name, table, explain(conn, "EXPLAIN QUERY PLAN ", stmt, params)
                    )
                elif dialect == "postgresql":
                    [[plan]] = explain(conn, "EXPLAIN (FORMAT JSON) ", stmt, params)
                    problems += postgresql_problems(name, table, plan[0]["Plan"])
                else:
                    result = explain(conn, "EXPLAIN ", stmt, params)
                    problems += mariadb_problems(name, table, [dict(row._mapping) for row in result])
                conn.rollback()
        assert problems == []
    finally:
        attempts.drop(engine)


# -- what the engine visits -----------------------------------------------------------------


def sqlite_steps(engine: Engine, store: JobStore) -> int:
    """SQLite virtual-machine instructions for one claim_next of LIMIT jobs (rolled back)."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        with conn.begin() as tx:
            raw.set_progress_handler(count, 1)
            try:
                leases = store.claim_next("w", ttl=30.0, limit=LIMIT, conn=conn)
            finally:
                raw.set_progress_handler(None, 1)
            tx.rollback()
    assert len(leases) == LIMIT
    return steps


def test_a_claim_visits_as_much_at_100000_ready_jobs_as_at_1000(store: JobStore, engine: Engine) -> None:
    dialect = engine.dialect.name
    load(engine, store, 0, SMALL, tied=True)
    if dialect == "sqlite":
        small = sqlite_steps(engine, store)
        load(engine, store, SMALL, BACKLOG, tied=True)
        large = sqlite_steps(engine, store)
        assert large <= 1.5 * small, f"{large} VM steps at {BACKLOG:,} ready jobs, {small} at {SMALL:,}"
        return
    load(engine, store, SMALL, BACKLOG, tied=True)
    s = Statements(store.table, "database")
    params = {"holder": "w", "limit": LIMIT, "max_fence": FENCE_MAX, "ttl": 30.0}
    table = store.table.name
    with engine.connect() as conn:
        if dialect == "postgresql":
            [[plan]] = explain(
                conn, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ", s.claim_next_returning, params
            )
            nodes = list(postgresql_nodes(plan[0]["Plan"]))
            ready = [n for n in nodes if n.get("Index Name") == f"ix_{table}_ready"]
            assert ready and all(n["Actual Rows"] <= LIMIT for n in ready), ready
            pages = plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"]
            assert pages <= 20 * LIMIT, f"a claim of {LIMIT} jobs touched {pages} pages"
        else:
            rows = explain(conn, "ANALYZE ", s.pick_ready, params)
            [row] = [dict(r._mapping) for r in rows]
            assert row["key"] == f"ix_{table}_ready"
            assert float(row["r_rows"]) <= LIMIT, f"the pick read {row['r_rows']} rows for {LIMIT} jobs"
        conn.rollback()


def index_entries_read(engine: Engine, index: str) -> int:
    """``idx_tup_read`` of ``index`` once the single pooled connection's counts are flushed."""
    with engine.connect() as conn:  # the connection the store used: flush its counts now
        conn.exec_driver_sql("SELECT pg_stat_force_next_flush()")
        conn.commit()
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
        read = conn.exec_driver_sql(
            "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = %(n)s", {"n": index}
        ).scalar_one()
        conn.rollback()
    return int(read)


@pytest.mark.backend("postgresql")
@pytest.mark.parametrize("observed", [False, True], ids=["driver", "observed"])
def test_a_batched_claim_on_a_never_analyzed_table_reads_the_ready_index_only_to_its_limit(
    target: str, engine: Engine, observed: bool
) -> None:
    """PostgreSQL: the store's own claim of 100 jobs on a fresh table of 100,000 ready ones
    walks the ready index to its limit (a bitmap scan would read all 100,000 entries to sort
    them), and so does a worker's step that claims 100, whether the setting that makes it so
    is pipelined with the claim (psycopg) or sent first (through Core); in a caller's
    transaction the store leaves the planner's settings alone."""
    single = create_engine(target, pool_size=1, max_overflow=0)
    if observed:
        event.listen(single, "before_cursor_execute", lambda *args: None)
    try:
        store = JobStore(single)
        store.create_table()
        load(engine, store, 0, BACKLOG, tied=True)
        index = f"ix_{store.table.name}_ready"
        before = index_entries_read(single, index)
        leases = store.claim_next("w", ttl=30.0, limit=100)
        assert len(leases) == 100
        read = index_entries_read(single, index) - before
        assert 100 <= read <= 200, f"the claim of 100 jobs read {read} entries of the ready index"
        before = index_entries_read(single, index)
        accepted, leases = store.complete_and_claim_next([(leases[0], "r")], "w", ttl=30.0, limit=100)
        assert accepted == [True] and len(leases) == 100
        read = index_entries_read(single, index) - before
        assert 100 <= read <= 200, f"the step's claim of 100 jobs read {read} entries of the ready index"
        with single.begin() as conn:
            assert len(store.claim_next("w", ttl=30.0, limit=100, conn=conn)) == 100
            assert conn.exec_driver_sql("SHOW enable_sort").scalar_one() == "on"
        with single.connect() as conn:  # and the store's own setting ended with its transaction
            assert conn.exec_driver_sql("SHOW enable_sort").scalar_one() == "on"
    finally:
        single.dispose()


def test_the_ready_index_is_in_claim_order(store: JobStore, engine: Engine) -> None:
    [ready] = [ix for ix in store.table.indexes if ix.name == f"ix_{store.table.name}_ready"]
    assert [c.name for c in ready.columns] == ["done", "until", "id"]


def test_create_table_replaces_the_ready_index_of_an_older_version(store: JobStore, engine: Engine) -> None:
    table = store.table.name
    store.enqueue("kept", ready_at=0.0)
    with engine.begin() as conn:
        on = "" if engine.dialect.name in ("sqlite", "postgresql") else f" ON {table}"
        conn.execute(text(f"DROP INDEX ix_{table}_ready{on}"))
        conn.execute(text(f"CREATE INDEX ix_{table}_ready ON {table} (done, until)"))
    store.create_table()
    from sqlalchemy import inspect

    [ready] = [ix for ix in inspect(engine).get_indexes(table) if ix["name"] == f"ix_{table}_ready"]
    assert ready["column_names"] == ["done", "until", "id"]
    state = store.state("kept")
    assert state is not None and state.fence == 0  # the rows are untouched
    store.create_table()  # and it is idempotent
