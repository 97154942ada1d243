"""Round trips per operation, counted, so a later change cannot add one unseen.

Where the database is across a network, a worker's speed is round trips times latency. Each
operation here runs through :class:`tests.turns_proxy.TurnsProxy`, which counts client
*turns* (how many times the client waited for the server; messages sent together count
once), after a warm-up, over :data:`CALLS` calls. The counts are exact: they do not depend on
the machine's speed. Servers only: SQLite has no network.

PostgreSQL (psycopg, and the async front on asyncpg and psycopg's async mode): every
single-statement operation is its own implicit transaction (autocommit), one round trip,
and so is the worker's step (its completions and next claim in one statement).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, MetaData, create_engine, event, make_url
from sqlalchemy.pool import NullPool

from fencing import JobStore, Lease, jobs_table
from fencing.asyncio import AsyncJobStore
from tests import backends
from tests.turns_proxy import TurnsProxy

pytestmark = pytest.mark.sync_only("counts the turns of each front itself")

#: calls per operation measured, after a warm-up
CALLS = 20
#: calls before counting: the pool holds its connection, and psycopg has prepared the
#: statement (it prepares one on its 5th execution, which costs one more turn, once)
WARM = 6

#: turns per call, by operation, on each database (and the async front's driver)
POSTGRESQL = {
    "enqueue": 1,
    "state": 1,
    "claim": 1,
    "claim_next": 1,
    "claim_next(5)": 4,  # BEGIN, SET LOCAL (walk the ready index in claim order), UPDATE, COMMIT
    "renew": 1,
    "complete": 1,
    "complete (refused)": 2,  # the refused statement, then its reason read
    "release": 1,
    "complete_many(10)": 1,
    "step": 1,
    "revoke": 1,
    "delete": 1,
    "fenced": 4,  # BEGIN, the start check, the end check, COMMIT
}
MARIADB = {
    "enqueue": 2,
    "state": 2,
    "claim": 3,
    "claim_next": 4,
    "claim_next(5)": 4,
    "renew": 3,
    "complete": 2,
    "complete (refused)": 3,
    "release": 2,
    "complete_many(10)": 3,
    "step": 6,
    "revoke": 2,
    "delete": 2,
    "fenced": 4,
}


#: through Core (the async front on asyncmy; the sync store when something observes the
#: engine), whose pool rolls back every connection it is given back, committed or not: one
#: turn more than the sync store on the driver (a fenced block is on Core everywhere)
MARIADB_ASYNCMY = {name: n + (name != "fenced") for name, n in MARIADB.items()}


def through(target: str, proxy: TurnsProxy, driver: str | None = None) -> str:
    url = make_url(target)
    if driver is not None:
        url = url.set(drivername=driver)
    return url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


@pytest.fixture
def proxy(backend: backends.Backend, target: str) -> Iterator[TurnsProxy]:
    if "://" not in target:
        pytest.skip("SQLite has no network: no round trips to count")
    url = make_url(target)
    with TurnsProxy((url.host or "127.0.0.1", url.port or 5432)) as p:
        yield p


class Ops:
    """Each operation of a store, as a callable that runs it once (sync or async)."""

    def __init__(self, store: Any, call: Callable[[Any], Any]) -> None:
        self.store = store
        self.call = call
        self.n = 0

    def fresh(self, count: int) -> list[str]:
        ids = [f"j{self.n + i:06d}" for i in range(count)]
        self.n += count
        for job in ids:
            assert self.call(self.store.enqueue(job, ready_at=0.0))
        return ids

    def claimed(self, count: int) -> list[Lease]:
        leases: list[Lease] = []
        for job in self.fresh(count):
            lease = self.call(self.store.claim(job, "w", ttl=60.0))
            assert lease is not None
            leases.append(lease)
        return leases

    def each(self, name: str, calls: int) -> Iterator[Callable[[], Any]]:
        """``calls`` zero-argument operations named ``name``, set up before any is counted."""
        s, call = self.store, self.call
        if name == "enqueue":
            for job in [f"e{self.n + i:06d}" for i in range(calls)]:
                yield lambda job=job: call(s.enqueue(job))
            self.n += calls
        elif name == "state":
            for _ in range(calls):
                yield lambda: call(s.state("nope"))
        elif name == "claim":
            for job in self.fresh(calls):
                yield lambda job=job: call(s.claim(job, "w", ttl=60.0))
        elif name in ("claim_next", "claim_next(5)"):
            limit = 1 if name == "claim_next" else 5
            self.fresh(calls * limit)
            for _ in range(calls):
                yield lambda: call(s.claim_next("w", ttl=60.0, limit=limit))
        elif name in ("renew", "complete", "release", "revoke", "delete", "fenced"):
            for lease in self.claimed(calls):
                yield {
                    "renew": lambda lease=lease: call(s.renew(lease, ttl=60.0)),
                    "complete": lambda lease=lease: call(s.complete(lease, "r")),
                    "release": lambda lease=lease: call(s.release(lease)),
                    "revoke": lambda lease=lease: call(s.revoke(lease.job_id)),
                    "delete": lambda lease=lease: call(s.delete(lease.job_id)),
                    "fenced": lambda lease=lease: self.block(lease),
                }[name]
        elif name == "complete (refused)":
            for lease in self.claimed(calls):
                assert call(s.revoke(lease.job_id))
                yield lambda lease=lease: call(s.complete(lease, "late"))
        elif name == "complete_many(10)":
            for _ in range(calls):
                batch = [(lease, "r") for lease in self.claimed(10)]
                yield lambda batch=batch: call(s.complete_many(batch))
        elif name == "step":
            self.fresh(calls + 1)
            first = call(s.claim_next("w", ttl=60.0))
            current = [first[0]]

            def step() -> None:
                _, leases = call(s.complete_and_claim_next([(current[0], "r")], "w", ttl=60.0))
                current[0] = leases[0]

            for _ in range(calls):
                yield step
        else:
            raise AssertionError(name)

    def block(self, lease: Lease) -> None:
        if isinstance(self.store, AsyncJobStore):

            async def block() -> None:
                async with self.store.fenced(lease):
                    pass

            self.call(block())
        else:
            with self.store.fenced(lease):
                pass


def turns_of(proxy: TurnsProxy, ops: Ops, names: list[str]) -> dict[str, float]:
    found = {}
    for name in names:
        todo = list(ops.each(name, WARM + CALLS))
        for op in todo[:WARM]:
            op()
        proxy.reset()
        for op in todo[WARM:]:
            op()
        found[name] = proxy.reset() / CALLS
    return found


def expected(engine_or_name: str) -> dict[str, int]:
    return POSTGRESQL if engine_or_name == "postgresql" else MARIADB


@pytest.mark.parametrize("observed", [False, True], ids=["driver", "observed"])
def test_turns_per_operation_on_the_sync_store(target: str, proxy: TurnsProxy, observed: bool) -> None:
    engine: Engine = create_engine(through(target, proxy))
    if observed:  # a listener on the engine: the store runs through Core, for it to see
        event.listen(engine, "before_cursor_execute", lambda *args: None)
    try:
        store = JobStore(engine, jobs_table(MetaData(), "turn_jobs"))
        store.create_table()
        want = expected(engine.dialect.name)
        if observed and engine.dialect.name != "postgresql":
            want = MARIADB_ASYNCMY  # Core's pool rolls back each connection it gets back
        found = turns_of(proxy, Ops(store, lambda answer: answer), list(want))
    finally:
        engine.dispose()
    assert found == {name: float(n) for name, n in want.items()}, found


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async", "asyncmy"])
def test_turns_per_operation_on_the_async_store(target: str, proxy: TurnsProxy, driver: str) -> None:
    dialect = make_url(target).get_backend_name()
    if (dialect == "postgresql") != (driver != "asyncmy"):
        pytest.skip(f"{driver} is not a {dialect} driver")
    want = MARIADB_ASYNCMY if driver == "asyncmy" else expected(dialect)

    async def main() -> dict[str, float]:
        from sqlalchemy.ext.asyncio import create_async_engine

        url = through(target, proxy, f"{make_url(target).drivername.split('+')[0]}+{driver}")
        engine = create_async_engine(url)
        try:
            store = AsyncJobStore(engine, jobs_table(MetaData(), "turn_jobs"))
            await store.create_table()
            loop = asyncio.get_running_loop()
            ops = Ops(store, lambda awaitable: asyncio.run_coroutine_threadsafe(awaitable, loop).result())
            return await loop.run_in_executor(None, turns_of, proxy, ops, list(want))
        finally:
            await engine.dispose()

    found = asyncio.run(main())
    assert found == {name: float(n) for name, n in want.items()}, found


# -- one round trip that commits: a connection lost during it is an unknown outcome ---------


T = TypeVar("T")


def answer_or_unknown(call: Callable[[], T]) -> T | None:
    """``call()``'s answer, or ``None`` when it said its outcome is unknown."""
    from fencing import DatabaseError

    try:
        return call()
    except DatabaseError as exc:
        if "the outcome is unknown" not in str(exc):
            raise
        return None


@pytest.mark.parametrize("reply", [1, 2, 3])
def test_a_connection_lost_during_the_trip_that_commits_is_an_unknown_outcome(
    target: str, proxy: TurnsProxy, reply: int
) -> None:
    # the connection is cut as the server answers its ``reply``-th request of the call: the
    # request ran (on PostgreSQL, in autocommit, one statement commits there), its answer is
    # lost. Before the COMMIT is sent, nothing was kept and the call may run again; once it
    # may have committed, the outcome is unknown and said so: tried again as if nothing had
    # happened, complete() would say False (the job is done: by this very call) and
    # claim_next() would hand out a second lease while the first is held
    engine = create_engine(through(target, proxy))
    try:
        store = JobStore(engine, jobs_table(MetaData(), "cut_jobs"))
        store.create_table()
        for job in ("a", "b", "c"):
            assert store.enqueue(job, ready_at=0.0)
        lease = store.claim("a", "w", ttl=60.0)
        assert lease is not None

        proxy.cut(reply)
        accepted = answer_or_unknown(lambda: store.complete(lease, "r"))
        state = store.state("a")  # a fresh connection
        assert state is not None
        if accepted is not None:  # an answer is the truth: never False for its own write
            assert accepted and state.done and state.result == "r"
        elif engine.dialect.name == "postgresql":
            assert state.done  # one statement: it had committed, or nothing was sent
        proxy.cut(0)

        proxy.cut(reply)
        leases = answer_or_unknown(lambda: store.claim_next("w", ttl=60.0))
        proxy.cut(0)
        held = [s for s in (store.state("b"), store.state("c")) if s is not None and s.owner == "w"]
        assert all(s.fence == 1 for s in held)  # no lease handed out twice
        if leases is not None:
            assert [(lease.job_id, lease.fence) for lease in leases] == [(s.job_id, s.fence) for s in held]
        else:
            assert len(held) <= 1

        proxy.cut(reply)  # a read's answer lost: read again, nothing to be unsure of
        assert store.state("a") == state
        proxy.cut(0)
    finally:
        engine.dispose()


def _end_sessions_of_this_database(target: str) -> int:
    """End, from a connection of its own, every other session on the test's own database
    (as a server restart or an idle-connection cull would): how many."""
    admin = create_engine(target, poolclass=NullPool)
    try:
        with admin.connect() as conn:
            if admin.dialect.name == "postgresql":
                ended = conn.exec_driver_sql(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).all()
                return len(ended)
            ids = conn.exec_driver_sql(
                "SELECT id FROM information_schema.processlist "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            ).all()
            for (session,) in ids:
                conn.exec_driver_sql(f"KILL CONNECTION {int(session)}")
            return len(ids)
    finally:
        admin.dispose()


@pytest.mark.parametrize("observed", [False, True], ids=["driver", "observed"])
def test_pooled_connections_the_server_closed_are_replaced_before_a_write_is_sent(
    target: str, proxy: TurnsProxy, observed: bool
) -> None:
    # a server restart (or an idle-connection cull) closes every pooled connection: the
    # next write must go through on a fresh one, not fail, and not be said unknown
    engine = create_engine(through(target, proxy), pool_size=3)
    if observed:  # through Core
        event.listen(engine, "before_cursor_execute", lambda *args: None)
    try:
        store = JobStore(engine, jobs_table(MetaData(), "restart_jobs"))
        store.create_table()
        for job in ("a", "b"):
            assert store.enqueue(job, ready_at=0.0)
        lease = store.claim("a", "w", ttl=60.0)
        assert lease is not None
        with engine.connect(), engine.connect(), engine.connect():
            pass  # three connections in the pool, all idle now
        assert _end_sessions_of_this_database(target) >= 3
        time.sleep(0.2)  # the server's goodbye reaches the clients
        assert store.complete(lease, "r")
        assert [lease.job_id for lease in store.claim_next("w", ttl=60.0)] == ["b"]
        state = store.state("a")
        assert state is not None and state.done and state.result == "r"
    finally:
        engine.dispose()
