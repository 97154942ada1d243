"""The dashboard's queries at 100,000 jobs, on every backend: each walks an index, none sorts.

Every listing a page shows (each state, every state, from the start, after or before a cursor, with
an id prefix or without) walks the ready index ``(done, until, id)`` in its order and stops at
the page's limit; one job is found by its primary key; the refused writes by reason come from
the history's ``at`` index. The summary is the exception, by nature: its counts read every
row, once per interval for every viewer (the feed), and its cost is measured in
``benchmarks/web.py``, not here. Fresh tables (no statistics) and analyzed ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData
from sqlalchemy.sql import Executable

from fencing import JobStore, history_table
from fencing.overview import STATES, Cursor, Overview
from tests.databases.test_plans import BACKLOG, analyze, explain, load, postgresql_nodes

# 100,000 rows loaded per test: once per database (the newest python and SQLAlchemy)
pytestmark = [pytest.mark.sync_only("the plans of the statements the dashboard sends"), pytest.mark.slow]

pytest.importorskip("starlette", reason="the web extra is not installed: pip install 'fencing[web]'")

from fencing.web.feed import Feed  # noqa: E402


def listings(ov: Overview) -> dict[str, tuple[Executable, dict[str, Any]]]:
    """Every listing statement the pages send, with bind values of a real page."""
    found: dict[str, tuple[Executable, dict[str, Any]]] = {}
    after = Cursor(0, 1050.0, "job-0050000")
    for state in (*STATES, None):
        for paged, backward in ((False, False), (True, False), (True, True)):
            for prefixed in (False, True):
                params: dict[str, Any] = {"limit": 51, "max_fence": 5 if state == "poisoned" else 2**63 - 1}
                if paged:
                    # inside the prefix's ids for a prefix's listing (a cursor past them: no plan)
                    at = Cursor(0, 1012.35, "job-0012350") if prefixed else after
                    params.update(after_done=at.done, after_until=at.until, after_id=at.job_id)
                if prefixed:
                    params["prefix"] = ov._database.prefix_pattern("job-00123")
                    params["prefix_low"] = "job-00123"
                way = " before a cursor" if backward else " after a cursor" if paged else ""
                name = f"{state or 'every state'}{way}{' by prefix' if prefixed else ''}"
                stmt = ov._sql.listing(state, paged=paged, prefixed=prefixed, backward=backward)
                found[name] = (stmt, params)
    found["one job"] = (ov._sql.job, {"job_id": "job-0012345", "max_fence": 2**63 - 1})
    return found


def mariadb_tables(node: Any) -> Iterator[dict[str, Any]]:
    """Every table access of a MariaDB ``EXPLAIN FORMAT=JSON`` document."""
    if isinstance(node, dict):
        if "table_name" in node:
            yield node
        for value in node.values():
            yield from mariadb_tables(value)
    elif isinstance(node, list):
        for value in node:
            yield from mariadb_tables(value)


def problems_of(engine: Engine, table: str, name: str, stmt: Executable, params: dict[str, Any]) -> list[str]:
    dialect = engine.dialect.name
    with engine.connect() as conn:
        if dialect == "sqlite":
            details = [str(r[-1]) for r in explain(conn, "EXPLAIN QUERY PLAN ", stmt, params)]
            found = [f"{name}: {d}" for d in details if "TEMP B-TREE" in d]
            found += [f"{name}: full scan ({d})" for d in details if d == f"SCAN {table}"]
        elif dialect == "postgresql":
            conn.exec_driver_sql("SET LOCAL enable_sort = off")  # what Overview.reading sends
            [[plan]] = explain(conn, "EXPLAIN (FORMAT JSON) ", stmt, params)
            nodes = list(postgresql_nodes(plan[0]["Plan"]))
            found = [f"{name}: sequential scan" for n in nodes if n["Node Type"] == "Seq Scan"]
            found += [f"{name}: {n['Node Type']}" for n in nodes if "Sort" in n["Node Type"]]
        else:
            rows = [dict(r._mapping) for r in explain(conn, "EXPLAIN ", stmt, params)]
            found = [f"{name}: full scan" for r in rows if r["type"] == "ALL"]
            found += [f"{name}: {r['Extra']}" for r in rows if "filesort" in str(r.get("Extra") or "")]
            if " a cursor" in name:
                # the cursor is judged on the index's entries (a range from it, or index
                # condition pushdown), not on each row read before it: a row value is not
                # pushed down by MariaDB, and a page at the middle read 50,000 rows
                [[doc]] = explain(conn, "EXPLAIN FORMAT=JSON ", stmt, params)
                tables = list(mariadb_tables(json.loads(doc)))
                pushed = " ".join(t.get("index_condition", "") for t in tables)
                # a prefix's listing walks the primary key: its range starts at the cursor's id
                by_id = any(t["access_type"] == "range" and t.get("key") == "PRIMARY" for t in tables)
                # a page before the cursor: the range of the ready index the walk takes ends at
                # the cursor's until (MariaDB pushes no condition down in a backward scan)
                by_until = "before a cursor" in name and any(
                    t["access_type"] == "range" and "until" in t.get("used_key_parts", []) for t in tables
                )
                # (no table read at all: the planner saw no row can match, as a held job's page
                # before a cursor in the past)
                if tables and "`id` >" not in pushed and not by_id and not by_until:
                    found += [f"{name}: the cursor is not in the index condition ({pushed!r})"]
        conn.rollback()
    return found


@pytest.mark.parametrize("statistics", ["fresh", "analyzed"])
def test_every_listing_walks_an_index_at_100000_jobs(engine: Engine, statistics: str) -> None:
    store = JobStore(engine)
    store.create_table()
    load(engine, store, 0, BACKLOG, tied=False)
    if statistics == "analyzed":
        analyze(engine, store)
    ov = Overview(engine)
    problems: list[str] = []
    for name, (stmt, params) in listings(ov).items():
        problems += problems_of(engine, store.table.name, name, stmt, params)
    assert problems == []


@pytest.mark.parametrize("statistics", ["fresh", "analyzed"])
def test_who_holds_leases_reads_the_held_range_of_the_ready_index(engine: Engine, statistics: str) -> None:
    store = JobStore(engine)
    store.create_table()
    load(engine, store, 0, BACKLOG, tied=False)
    for n in range(10):  # a few workers hold a few hundred leases among 100,000 ready jobs
        store.claim_next(f"worker-{n}", ttl=600, limit=30)
    if statistics == "analyzed":
        analyze(engine, store)
    ov = Overview(engine)
    assert len(ov.holders()) == 10
    problems = problems_of(engine, store.table.name, "holders", ov._sql.holders, {"limit": 20})
    # the grouping may sort what the range found (the held leases), never the table
    assert [p for p in problems if "Sort" not in p and "TEMP B-TREE" not in p and "filesort" not in p] == []


def test_the_refusals_by_reason_use_the_histories_at_index(engine: Engine) -> None:
    history = history_table(MetaData())
    history.create(engine)
    store = JobStore(engine)
    store.create_table()
    from sqlalchemy import bindparam, insert

    from fencing._sql.schema import KEY_TYPE

    stmt = insert(history).values(
        job_id=bindparam("k", type_=KEY_TYPE), event=bindparam("e"), at=bindparam("a")
    )
    rows = [{"k": f"j{n}", "e": "refused" if n % 10 == 0 else "claim", "a": float(n)} for n in range(BACKLOG)]
    with engine.begin() as conn:
        for at in range(0, BACKLOG, 10_000):
            conn.execute(stmt, rows[at : at + 10_000])
    analyze(engine, store)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            {"sqlite": "ANALYZE", "postgresql": f"ANALYZE {history.name}"}.get(
                engine.dialect.name, f"ANALYZE TABLE {history.name}"
            )
        )
    feed = Feed(Overview(engine), history=history)
    problems = problems_of(
        engine,
        history.name,
        "refusals by reason",
        feed._history.refusals_by_reason,
        {"since": BACKLOG - 3600.0},
    )
    # a GROUP BY may sort what the range found (an hour of refusals), never the table
    assert [p for p in problems if "Sort" not in p and "TEMP B-TREE" not in p and "filesort" not in p] == []
