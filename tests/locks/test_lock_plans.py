"""The plans of the locks' hot statements at a realistic size, on every backend.

100,000 locks, and 100,000 waiters' tickets spread over 10,000 of them (10 each, live). A
claim of a lock (its guard reads the lock's queue: is a live ticket of another owner ahead of
the claimer's?), the waiter's look (is the lock held, is anyone ahead), its queue entry (with
the sweep of the name's lapsed tickets), refresh and leave, and the release, revoke and
delete of a lock (on PostgreSQL they return the notification that wakes the lock's waiters,
read from its queue) must each find their rows through an index: the lock by its primary
key, the queue by ``(name, ticket)`` or a ticket by its key. A full scan of either table, at
any size, is a failure. Checked on fresh tables (no statistics) and analyzed ones, on both
clocks.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, bindparam, insert
from sqlalchemy.sql import Executable

from fencing import Locks
from fencing._sql.schema import KEY_TYPE
from tests.databases.test_plans import explain, postgresql_nodes

LOCKS = 100_000
NAMES_WAITED_FOR = 10_000
WAITERS_EACH = 10
NOW = 5e9

pytestmark = pytest.mark.sync_only("the plans of the statements both fronts send")


@pytest.fixture
def locks(engine: Engine) -> Locks:
    made = Locks(engine)
    made.create_table()
    table, waiters = made.table, made.queue.waiters
    lock_rows = [{"k": f"lock-{n:07d}", "u": 0.0 if n % 2 else NOW + 30} for n in range(LOCKS)]
    ticket_rows = [
        {"k": f"lock-{n * (LOCKS // NAMES_WAITED_FOR):07d}", "o": f"w{i}", "u": NOW + 60}
        for n in range(NAMES_WAITED_FOR)
        for i in range(WAITERS_EACH)
    ]
    key = bindparam("k", type_=KEY_TYPE)
    with engine.begin() as conn:
        for at in range(0, LOCKS, 10_000):
            conn.execute(insert(table).values(id=key, until=bindparam("u")), lock_rows[at : at + 10_000])
        for at in range(0, len(ticket_rows), 10_000):
            conn.execute(
                insert(waiters).values(name=key, owner=bindparam("o", type_=KEY_TYPE), until=bindparam("u")),
                ticket_rows[at : at + 10_000],
            )
    return made


def hot_statements(locks: Locks, clock: str) -> dict[str, tuple[Executable, dict[str, Any]]]:
    ctx = locks.store._ctx
    claims = ctx.by_caller if clock == "caller" else ctx.by_database
    queue = locks.queue._sql.on(clock == "caller")
    name = "lock-0005000"  # held, with 10 waiters
    params: dict[str, Any] = {
        "job_id": name,
        "name": name,
        "holder": "w9",
        "owner": "w9",
        "now": NOW,
        "new_until": NOW + 30,
        "ttl": 30.0,
        "keep": 10.0,
        "my_ticket": 50_000,
    }
    found: dict[str, tuple[Executable, dict[str, Any]]] = {
        "claim": (claims.claim_returning if ctx.plan.returning else claims.claim_counting, params),
        "look": (queue.look, params),
        "sweep": (queue.sweep, params),
        "ticket of": (queue.ticket_of, params),
        "refresh": (queue.refresh, params),
        "leave": (queue.leave, params),
    }
    # the statements that free a lock (on PostgreSQL they return the waiters' notification)
    lease = {"token": 1}
    found |= {
        "release": (ctx.by_caller.release, {**params, **lease}),
        "revoke": (ctx.by_caller.revoke, params),
        "delete": (ctx.by_caller.delete, params),
    }
    return found


def analyze(engine: Engine, locks: Locks) -> None:
    with engine.begin() as conn:
        for table in (locks.table.name, locks.queue.waiters.name):
            conn.exec_driver_sql(
                {"sqlite": f"ANALYZE {table}", "postgresql": f"ANALYZE {table}"}.get(
                    engine.dialect.name, f"ANALYZE TABLE {table}"
                )
            )


def scans(engine: Engine, conn: Any, stmt: Executable, params: dict[str, Any], tables: set[str]) -> list[str]:
    """The full scans of ``tables`` in ``stmt``'s plan."""
    dialect = engine.dialect.name
    if dialect == "sqlite":
        rows = explain(conn, "EXPLAIN QUERY PLAN ", stmt, params)
        return [str(r[-1]) for r in rows if any(str(r[-1]).startswith(f"SCAN {t}") for t in tables)]
    if dialect == "postgresql":
        [[plan]] = explain(conn, "EXPLAIN (FORMAT JSON) ", stmt, params)
        return [
            f"{n['Node Type']} on {n['Relation Name']}"
            for n in postgresql_nodes(plan[0]["Plan"])
            if n.get("Relation Name") in tables and n["Node Type"] == "Seq Scan"
        ]
    rows = [dict(r._mapping) for r in explain(conn, "EXPLAIN ", stmt, params)]
    return [
        f"{r['type']} on {r['table']}" for r in rows if r["table"] in tables and r["type"] in ("ALL", "index")
    ]


@pytest.mark.parametrize("statistics", ["fresh", "analyzed"])
@pytest.mark.parametrize("clock", ["caller", "database"])
def test_every_hot_statement_of_the_locks_finds_its_rows_by_an_index(
    locks: Locks, engine: Engine, clock: str, statistics: str
) -> None:
    if statistics == "analyzed":
        analyze(engine, locks)
    tables = {locks.table.name, locks.queue.waiters.name}
    problems: list[str] = []
    for name, (stmt, params) in hot_statements(locks, clock).items():
        with engine.connect() as conn:
            problems += [f"{name}: {scan}" for scan in scans(engine, conn, stmt, params, tables)]
            conn.rollback()
    assert problems == []
