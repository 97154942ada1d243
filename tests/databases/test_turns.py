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
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, MetaData, create_engine, event, make_url

from fencing import JobStore, Lease, jobs_table, payloads_table
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
    # BEGIN, SET LOCAL (walk the ready index in claim order), UPDATE, COMMIT: sent together
    # in psycopg's pipeline (sync or async); asyncpg has none, each is a round trip
    "claim_next(5)": 1,
    "step(5)": 1,
    "renew": 1,
    "complete": 1,
    "complete (refused)": 2,  # the refused statement, then its reason read
    "release": 1,
    "complete_many(10)": 1,
    "step": 1,
    "revoke": 1,
    "delete": 1,
    "fenced": 2,  # BEGIN and the start check; the end check and COMMIT (a pipeline each)
    "check": 1,
}
MARIADB = {
    "enqueue": 2,
    "state": 2,
    "claim": 3,
    "claim_next": 3,
    "claim_next(5)": 3,
    "renew": 3,
    "complete": 2,
    "complete (refused)": 3,
    "release": 2,
    "complete_many(10)": 3,
    "step": 4,
    "step(5)": 4,
    "revoke": 2,
    "delete": 2,
    "fenced": 4,
    "check": 2,
}


#: asyncpg, and the store through Core: no pipeline, so a batched claim sends its BEGIN,
#: SET LOCAL, statement and COMMIT one by one, and a fenced block its BEGIN and COMMIT apart
POSTGRESQL_UNPIPELINED = {**POSTGRESQL, "claim_next(5)": 4, "step(5)": 4, "fenced": 4}

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
        elif name in ("renew", "complete", "release", "revoke", "delete", "fenced", "check"):
            for lease in self.claimed(calls):
                yield {
                    "renew": lambda lease=lease: call(s.renew(lease, ttl=60.0)),
                    "complete": lambda lease=lease: call(s.complete(lease, "r")),
                    "release": lambda lease=lease: call(s.release(lease)),
                    "revoke": lambda lease=lease: call(s.revoke(lease.job_id)),
                    "delete": lambda lease=lease: call(s.delete(lease.job_id)),
                    "fenced": lambda lease=lease: self.block(lease),
                    "check": lambda lease=lease: call(s.check(lease)),
                }[name]
        elif name == "complete (refused)":
            for lease in self.claimed(calls):
                assert call(s.revoke(lease.job_id))
                yield lambda lease=lease: call(s.complete(lease, "late"))
        elif name == "complete_many(10)":
            for _ in range(calls):
                batch = [(lease, "r") for lease in self.claimed(10)]
                yield lambda batch=batch: call(s.complete_many(batch))
        elif name in ("step", "step(5)"):
            limit = 1 if name == "step" else 5
            self.fresh(calls * limit + 1)
            first = call(s.claim_next("w", ttl=60.0))
            current = [first[0]]

            def step() -> None:
                _, leases = call(s.complete_and_claim_next([(current[0], "r")], "w", ttl=60.0, limit=limit))
                assert len(leases) == limit
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


def turns_of(proxy: TurnsProxy, ops: Ops, names: list[str]) -> dict[str, float | list[int]]:
    """Each operation's turns per call, each of CALLS calls counted on its own: the count all
    but at most one of them took. A burst the client sends after its answer (a pipeline's
    closing message) is counted with the call it lands in; on a loaded machine it once merged
    with the next call's burst (19 turns for 20 calls), and once landed in the call before
    (3 then 1 for a call of 2): two neighbours that differ from the usual count by as much as
    each other, in opposite directions, count as usual (their sum is the usual two calls').
    Where two calls or more differ otherwise, every call's count instead, so the comparison
    with a number fails and shows them."""
    found: dict[str, float | list[int]] = {}
    for name in names:
        todo = list(ops.each(name, WARM + CALLS))
        for op in todo[:WARM]:
            op()
        proxy.reset()
        counts = []
        for op in todo[WARM:]:
            op()
            counts.append(proxy.reset())
        usual = statistics.median_low(counts)
        found[name] = float(usual) if _differing(counts, usual) <= 1 else counts
    return found


def _differing(counts: list[int], usual: int) -> int:
    """How many calls took other than ``usual`` turns, a burst that moved between two
    neighbours (one above by as much as the other is below) not counted."""
    differing, i = 0, 0
    while i < len(counts):
        if counts[i] == usual:
            i += 1
        elif i + 1 < len(counts) and counts[i] != counts[i + 1] and counts[i] + counts[i + 1] == 2 * usual:
            i += 2  # one burst counted in its neighbour's window
        else:
            differing += 1
            i += 1
    return differing


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
        if observed:
            # Core: no pipeline; its pool rolls back each connection it gets back (on
            # MariaDB, where a statement does not commit itself)
            want = POSTGRESQL_UNPIPELINED if engine.dialect.name == "postgresql" else MARIADB_ASYNCMY
        found = turns_of(proxy, Ops(store, lambda answer: answer), list(want))
    finally:
        engine.dispose()
    assert found == {name: float(n) for name, n in want.items()}, found


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async", "asyncmy"])
def test_turns_per_operation_on_the_async_store(target: str, proxy: TurnsProxy, driver: str) -> None:
    dialect = make_url(target).get_backend_name()
    if (dialect == "postgresql") != (driver != "asyncmy"):
        pytest.skip(f"{driver} is not a {dialect} driver")
    # psycopg's async mode pipelines as its sync mode does; asyncpg has no pipeline
    want = {"asyncmy": MARIADB_ASYNCMY, "asyncpg": POSTGRESQL_UNPIPELINED}.get(driver, POSTGRESQL)

    async def main() -> dict[str, float | list[int]]:
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


@pytest.mark.parametrize("limit", [1, 2], ids=["claim1", "claim2"])
@pytest.mark.parametrize("reply", [1, 2, 3])
def test_a_connection_lost_during_the_trip_that_commits_is_an_unknown_outcome(
    target: str, proxy: TurnsProxy, reply: int, limit: int
) -> None:
    # the connection is cut as the server answers its ``reply``-th request of the call: the
    # request ran (on PostgreSQL, in autocommit, one statement commits there), its answer is
    # lost. Before the COMMIT is sent, nothing was kept and the call may run again; once it
    # may have committed, the outcome is unknown and said so: tried again as if nothing had
    # happened, complete() would say False (the job is done: by this very call) and
    # claim_next() would hand out a second lease while the first is held. A batch (``limit``
    # 2; on psycopg BEGIN, SET LOCAL, the claim and COMMIT in one pipeline) is all or nothing
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
        leases = answer_or_unknown(lambda: store.claim_next("w", ttl=60.0, limit=limit))
        proxy.cut(0)
        held = [s for s in (store.state("b"), store.state("c")) if s is not None and s.owner == "w"]
        assert all(s.fence == 1 for s in held)  # no lease handed out twice
        if leases is not None:
            assert sorted((lease.job_id, lease.fence) for lease in leases) == [
                (s.job_id, s.fence) for s in held
            ]
        else:
            assert len(held) in (0, limit)

        proxy.cut(reply)  # a read's answer lost: read again, nothing to be unsure of
        assert store.state("a") == state
        proxy.cut(0)
    finally:
        engine.dispose()


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
        assert backends.end_other_sessions(target) >= 3
        time.sleep(0.2)  # the server's goodbye reaches the clients
        assert store.complete(lease, "r")
        assert [lease.job_id for lease in store.claim_next("w", ttl=60.0)] == ["b"]
        state = store.state("a")
        assert state is not None and state.done and state.result == "r"
    finally:
        engine.dispose()


def test_a_pipelined_transaction_that_fails_leaves_its_connection_as_it_found_it(target: str) -> None:
    # psycopg: BEGIN, the prelude, the statement and COMMIT go in one pipeline; when the
    # statement fails there, the transaction it opened is rolled back and the connection goes
    # back to the pool out of autocommit, with no setting of the failed transaction left on it
    if "://" not in target or make_url(target).get_backend_name() != "postgresql":
        pytest.skip("the pipeline is psycopg's")
    import psycopg
    from sqlalchemy import text

    from fencing._runtime.execution import Runner

    engine = create_engine(target, pool_size=1, max_overflow=0)
    try:
        runner = Runner.admit(engine)
        assert runner._profile.pipelines
        failing = text("SELECT 1 / (CAST(current_setting('enable_sort') = 'on' AS int))")
        with pytest.raises(engine.dialect.dbapi.Error, match="division by zero"):  # type: ignore[union-attr]
            runner.run(
                lambda x: x.rows(failing, {}), single=True, prelude=(text("SET LOCAL enable_sort = off"),)
            )
        with engine.connect() as conn:
            dbapi: Any = conn.connection.dbapi_connection
            assert dbapi.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert dbapi.autocommit is False
            assert conn.exec_driver_sql("SHOW enable_sort").scalar_one() == "on"
        # and the next pipelined run goes through on it
        answer = runner.run(
            lambda x: x.rows(text("SELECT current_setting('enable_sort')"), {}),
            single=True,
            prelude=(text("SET LOCAL enable_sort = off"),),
        )
        assert [tuple(row) for row in answer] == [("off",)]
    finally:
        engine.dispose()


@pytest.mark.parametrize("complete", [False, True], ids=["check", "complete"])
def test_a_pipelined_fenced_block_lost_at_its_end_keeps_nothing_and_says_why(
    target: str, proxy: TurnsProxy, complete: bool
) -> None:
    # psycopg: the end check (or completion) goes with COMMIT in one pipeline, as a statement
    # that fails when the lease is gone, so the COMMIT after it never runs. The block's writes
    # are rolled back, the reason is read under the row lock the block still holds, and the
    # connection goes back to the pool as it came (out of autocommit, no transaction open)
    if make_url(target).get_backend_name() != "postgresql":
        pytest.skip("the pipeline is psycopg's")
    import psycopg
    from sqlalchemy import Column, Integer, Table, insert, select

    from fencing import LeaseLost

    engine = create_engine(through(target, proxy), pool_size=1, max_overflow=0)
    metadata = MetaData()
    writes = Table("pipelined_writes", metadata, Column("n", Integer))
    try:
        store = JobStore(engine, jobs_table(metadata, "pipelined_jobs"))
        store.create_table()
        metadata.create_all(engine, tables=[writes])
        assert store.enqueue("a", ready_at=0.0)
        lease = store.claim("a", "w", ttl=0.3)
        assert lease is not None

        def late_block(lease: Lease) -> None:
            with store.fenced(lease, complete=complete, result="r") as conn:
                conn.execute(insert(writes).values(n=1))
                time.sleep(0.5)  # the lease runs out inside the block

        with pytest.raises(LeaseLost) as lost:
            late_block(lease)
        assert lost.value.reason == "expired"
        with engine.connect() as conn:
            dbapi: Any = conn.connection.dbapi_connection
            assert dbapi.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert dbapi.autocommit is False
            assert conn.execute(select(writes.c.n)).all() == []  # nothing of the block kept
        state = store.state("a")
        assert state is not None and not state.done and state.fence == lease.fence
        # the same block in time commits, in two round trips around it
        lease = store.claim("a", "w", ttl=60.0)
        assert lease is not None
        proxy.reset()
        with store.fenced(lease, complete=complete, result="r") as conn:
            conn.execute(insert(writes).values(n=2))
        assert proxy.reset() == 3  # the first check, the block's INSERT, the end with COMMIT
        with engine.connect() as conn:
            assert conn.execute(select(writes.c.n)).all() == [(2,)]
        state = store.state("a")
        assert state is not None and state.done is complete
    finally:
        metadata.drop_all(engine, tables=[writes])
        engine.dispose()


@pytest.mark.parametrize("reply", [1, 2])
def test_a_connection_lost_at_a_pipelined_fenced_blocks_end_is_an_unknown_outcome(
    target: str, proxy: TurnsProxy, reply: int
) -> None:
    # cut as the server answers the block's ``reply``-th request: the first check (nothing
    # committed: the block fails with an error and its job is untouched) or the end with its
    # COMMIT (it may have committed: said unknown, and the job is done or not, never half)
    if make_url(target).get_backend_name() != "postgresql":
        pytest.skip("the pipeline is psycopg's")
    from fencing import DatabaseError

    engine = create_engine(through(target, proxy))
    try:
        store = JobStore(engine, jobs_table(MetaData(), "pipelined_cut_jobs"))
        store.create_table()
        assert store.enqueue("a", ready_at=0.0)
        lease = store.claim("a", "w", ttl=60.0)
        assert lease is not None
        proxy.cut(reply)
        with pytest.raises(DatabaseError) as failed, store.fenced(lease, complete=True, result="r"):
            pass
        proxy.cut(0)
        state = store.state("a")
        assert state is not None
        if reply == 1:
            assert "unknown" not in str(failed.value)
            assert not state.done
        else:
            assert "the outcome is unknown" in str(failed.value)
            assert state.done == (state.result == "r")
    finally:
        engine.dispose()


def test_a_pipelined_fenced_block_on_psycopgs_async_mode_commits_in_two_trips_or_keeps_nothing(
    target: str, proxy: TurnsProxy
) -> None:
    # the same pipeline as the sync driver's, on psycopg's AsyncConnection under SQLAlchemy's
    # adapter (inside the bridge): a block in time commits in two round trips around it, a
    # block lost at its end keeps nothing, and the connection goes back as it came
    if make_url(target).get_backend_name() != "postgresql":
        pytest.skip("the pipeline is psycopg's")
    import psycopg
    from sqlalchemy import Column, Integer, Table, insert, select
    from sqlalchemy.ext.asyncio import create_async_engine

    from fencing import LeaseLost

    metadata = MetaData()
    writes = Table("pipelined_async_writes", metadata, Column("n", Integer))
    url = through(target, proxy, "postgresql+psycopg_async")

    async def main() -> None:
        engine = create_async_engine(url, pool_size=1, max_overflow=0)
        try:
            store = AsyncJobStore(engine, jobs_table(metadata, "pipelined_async_jobs"))
            await store.create_table()
            async with engine.begin() as conn:
                await conn.run_sync(lambda sync: metadata.create_all(sync, tables=[writes]))
            assert await store.enqueue("a", ready_at=0.0)
            lease = await store.claim("a", "w", ttl=0.3)
            assert lease is not None

            async def late_block(lease: Lease) -> None:
                async with store.fenced(lease, complete=True, result="r") as conn:
                    await conn.execute(insert(writes).values(n=1))
                    await asyncio.sleep(0.5)  # the lease runs out inside the block

            with pytest.raises(LeaseLost) as lost:
                await late_block(lease)
            assert lost.value.reason == "expired"
            async with engine.connect() as conn:
                raw = await conn.get_raw_connection()
                adapted: Any = raw.dbapi_connection
                assert adapted.autocommit is False
                assert adapted._connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
                assert (await conn.execute(select(writes.c.n))).all() == []
            lease = await store.claim("a", "w", ttl=60.0)
            assert lease is not None
            proxy.reset()
            async with store.fenced(lease, complete=True, result="r") as conn:
                await conn.execute(insert(writes).values(n=2))
            assert proxy.reset() == 3  # the first check, the block's INSERT, the end with COMMIT
            state = await store.state("a")
            assert state is not None and state.done and state.result == "r"
            async with engine.begin() as conn:
                await conn.run_sync(lambda sync: metadata.drop_all(sync, tables=[writes]))
        finally:
            await engine.dispose()

    asyncio.run(main())


# -- a store that keeps payloads: the claims hand them out in the same round trips ------------

#: turns per call where every job carries a payload. PostgreSQL: each claim reads its jobs'
#: payloads in its own statement (a subquery in the RETURNING), so a claim costs what it does
#: without, and so does an enqueue (the job's upsert a CTE of the payload's); a delete is two
#: statements in a transaction (BEGIN, the job, its payload, COMMIT). MariaDB: a claim
#: by id reads its payload with its lease; a claim of the next jobs reads theirs in one more
#: SELECT of its transaction
PAYLOAD_OPS = ("enqueue", "claim", "claim_next", "claim_next(5)", "step", "step(5)", "renew", "delete")
POSTGRESQL_PAYLOADS = {**{name: POSTGRESQL[name] for name in PAYLOAD_OPS}, "delete": 4}
MARIADB_PAYLOADS = {
    **{name: MARIADB[name] for name in PAYLOAD_OPS},
    "enqueue": 4,
    "claim_next": 4,
    "claim_next(5)": 4,
    "step": 5,
    "step(5)": 5,
    "delete": 3,
}


class PayloadOps(Ops):
    """:class:`Ops` on a store that keeps payloads: every job is enqueued with one."""

    def fresh(self, count: int) -> list[str]:
        ids = [f"j{self.n + i:06d}" for i in range(count)]
        self.n += count
        for job in ids:
            assert self.call(self.store.enqueue(job, ready_at=0.0, payload={"job": job, "n": [1, 2]}))
        return ids

    def each(self, name: str, calls: int) -> Iterator[Callable[[], Any]]:
        if name != "enqueue":
            yield from super().each(name, calls)
            return
        s = self.store
        for job in [f"e{self.n + i:06d}" for i in range(calls)]:
            yield lambda job=job: self.call(s.enqueue(job, payload={"job": job}))
        self.n += calls


def test_turns_of_a_store_that_keeps_payloads(target: str, proxy: TurnsProxy) -> None:
    engine: Engine = create_engine(through(target, proxy))
    try:
        metadata = MetaData()
        store = JobStore(engine, jobs_table(metadata, "turn_pl_jobs"), payloads=payloads_table(metadata))
        store.create_table()
        want = POSTGRESQL_PAYLOADS if engine.dialect.name == "postgresql" else MARIADB_PAYLOADS
        found = turns_of(proxy, PayloadOps(store, lambda answer: answer), list(want))
        # and the claims did hand out the payloads
        [job] = PayloadOps(store, lambda answer: answer).fresh(1)
        assert store.claim(job, "w", ttl=60.0).payload == {"job": job, "n": [1, 2]}
    finally:
        engine.dispose()
    assert found == {name: float(n) for name, n in want.items()}, found
