"""The async front's own promises: what it refuses, tasks racing on one loop, a task waiting
for another task's lock without stopping the loop, and cancellation at every await.

The rest of the behavioural suite runs through the async store too (the ``store`` fixture's
``async`` parameter, :mod:`tests.asyncfront`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

import fencing
import fencing.asyncio
from fencing import ConfigurationError, InvalidArgumentType, JobStore, LeaseLost
from fencing.asyncio import AsyncFenceMarks, AsyncJobStore
from tests import backends

TTL = 30.0
#: a test's whole run on its loop may take this long before it counts as a hang
HANG = 60.0

receipts = Table(
    "async_receipts", MetaData(), Column("job", String(64), primary_key=True), Column("n", Integer)
)


def run(
    target: str,
    scenario: Callable[[AsyncEngine, AsyncJobStore], Awaitable[None]],
    driver: str | None = None,
    **kw: Any,
) -> None:
    """``scenario(engine, store)`` on a loop of its own, with a fresh jobs table; the engine
    is disposed inside the loop, and every connection must have gone back to the pool.
    ``driver``: a server's asyncio driver other than the suite's (``postgresql+psycopg``)."""

    async def main() -> None:
        if driver is None:
            engine = backends.async_engine_for(target, **kw)
        else:
            engine = create_async_engine(sqlalchemy.make_url(target).set(drivername=driver), **kw)
        try:
            store = AsyncJobStore(engine)
            await store.create_table()
            await asyncio.wait_for(scenario(engine, store), HANG)
            assert engine.sync_engine.pool.checkedout() == 0, "a connection was not given back"  # type: ignore[attr-defined]
        finally:
            await engine.dispose()

    asyncio.run(main())


# -- what is refused, by name -------------------------------------------------------------------


def test_a_sync_store_on_an_asyncio_driver_is_refused_by_name(target: str) -> None:
    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        with pytest.raises(ConfigurationError, match=r"asyncio driver.*AsyncJobStore"):
            JobStore(engine.sync_engine)
        with pytest.raises(ConfigurationError, match=r"asyncio driver.*AsyncFenceMarks"):
            fencing.FenceMarks(engine.sync_engine)
        # the AsyncEngine itself: told which class takes it
        with pytest.raises(
            InvalidArgumentType,
            match=r"got AsyncEngine: an AsyncEngine takes fencing\.asyncio\.AsyncJobStore$",
        ):
            JobStore(engine)  # type: ignore[arg-type]
        with pytest.raises(
            InvalidArgumentType,
            match=r"got AsyncEngine: an AsyncEngine takes fencing\.asyncio\.AsyncFenceMarks$",
        ):
            fencing.FenceMarks(engine)  # type: ignore[arg-type]

    run(target, scenario)


def test_the_async_store_takes_only_an_async_engine(engine: Engine) -> None:
    with pytest.raises(
        InvalidArgumentType, match=r"AsyncEngine, got Engine \(a sync Engine: use fencing.JobStore\)"
    ):
        AsyncJobStore(engine)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidArgumentType, match=r"AsyncEngine, got Engine \(a sync Engine: use fencing.FenceMarks"
    ):
        AsyncFenceMarks(engine)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentType, match="AsyncEngine, got str"):
        AsyncJobStore("sqlite:///x.db")  # type: ignore[arg-type]


@pytest.mark.backend("sqlite")
def test_an_aiosqlite_engine_without_the_glue_is_refused(target: str) -> None:
    async def main() -> None:
        # a pool that keeps connections (SQLAlchemy 2.0's default for aiosqlite is NullPool)
        plain = create_async_engine(f"sqlite+aiosqlite:///{target}", poolclass=AsyncAdaptedQueuePool)
        try:
            with pytest.raises(ConfigurationError, match="BEGIN IMMEDIATE"):
                AsyncJobStore(plain)
            async with plain.connect() as conn:
                await conn.exec_driver_sql("SELECT 1")
            with pytest.raises(ConfigurationError, match="configure it before its first use"):
                fencing.configure_sqlite(plain)
        finally:
            await plain.dispose()
        fresh = fencing.configure_sqlite(
            create_async_engine(f"sqlite+aiosqlite:///{target}", poolclass=AsyncAdaptedQueuePool)
        )
        try:
            store = AsyncJobStore(fresh)  # configured before its first use: taken
            await store.create_table()
            assert await store.enqueue("j")
        finally:
            await fresh.dispose()

    asyncio.run(main())


def test_conn_must_be_an_async_connection_or_session(target: str, engine: Engine) -> None:
    async def scenario(async_engine: AsyncEngine, store: AsyncJobStore) -> None:
        assert await store.enqueue("j", ready_at=0.0)
        refused = pytest.raises(
            InvalidArgumentType, match=r"got Connection \(a sync one: use fencing.JobStore\)"
        )
        with engine.connect() as sync_conn, refused:
            await store.enqueue("k", conn=sync_conn)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentType, match="AsyncSession or None, got int"):
            await store.state("j", conn=3)  # type: ignore[arg-type]
        unstarted = async_engine.connect()
        with pytest.raises(ConfigurationError, match="has not been started"):
            await store.state("j", conn=unstarted)
        assert await store.state("k") is None  # nothing was written by a refused call

    run(target, scenario)


# -- the caller's transaction ------------------------------------------------------------------


def test_an_async_session_commits_or_rolls_back_our_writes_with_its_own(target: str) -> None:
    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        async with engine.begin() as conn:
            await conn.run_sync(receipts.create)
        assert await store.enqueue("j", ready_at=0.0)
        lease = await store.claim("j", "w", ttl=TTL)
        assert lease is not None
        async with AsyncSession(engine) as session, session.begin():
            async with store.fenced(lease, complete=True, result="r", conn=session):
                await session.execute(receipts.insert().values(job="j", n=1))
            await session.rollback()  # the caller decides: nothing stays
        state = await store.state("j")
        assert state is not None and not state.done
        session = AsyncSession(engine)
        async with (
            session,
            session.begin(),
            store.fenced(lease, complete=True, result="r", conn=session) as yours,
        ):
            assert yours is session
            await session.execute(receipts.insert().values(job="j", n=2))
        state = await store.state("j")
        assert state is not None and state.done and state.result == "r"
        async with engine.connect() as conn:
            assert (await conn.execute(select(receipts.c.n))).scalars().all() == [2]

    run(target, scenario)


# -- tasks of one loop racing ------------------------------------------------------------------


def test_tasks_claiming_next_get_each_job_exactly_once(target: str) -> None:
    jobs, tasks = 60, 12

    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        for i in range(jobs):
            assert await store.enqueue(f"j{i:03}", ready_at=0.0)
        taken: list[fencing.Lease] = []

        async def worker(name: str) -> None:
            while leases := await store.claim_next(name, ttl=TTL, limit=2):
                taken.extend(leases)
                for lease in leases:
                    assert await store.complete(lease, name)

        await asyncio.gather(*(worker(f"w{i}") for i in range(tasks)))
        assert sorted(lease.job_id for lease in taken) == [f"j{i:03}" for i in range(jobs)]
        for lease in taken:
            state = await store.state(lease.job_id)
            assert state is not None and state.done and state.result == lease.owner

    run(target, scenario)


def test_tasks_racing_for_one_job_have_one_winner_and_the_loser_cannot_write(target: str) -> None:
    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        assert await store.enqueue("j", ready_at=0.0)
        won = await store.claim_many("j", [f"w{i}" for i in range(8)], ttl=TTL)
        winners = [lease for lease in won if lease is not None]
        assert len(winners) == 1
        [winner] = winners
        assert await store.revoke("j")  # the winner stalls; its lease is taken away
        [fresh] = await store.claim_next("new", ttl=TTL)
        assert fresh.fence > winner.fence  # the revoke moved the fence on, the claim once more
        assert await store.complete(fresh, "new result")
        # the stalled task wakes up: every write of its old token is refused
        assert not await store.complete(winner, "stale")
        assert not await store.renew(winner, ttl=TTL)
        with pytest.raises(LeaseLost):
            async with store.fenced(winner):
                pass
        state = await store.state("j")
        assert state is not None and state.result == "new result" and state.owner == "new"

    run(target, scenario)


def test_a_task_waits_for_another_tasks_block_without_stopping_the_loop(target: str) -> None:
    """On SQLite the block holds the write lock; another task's claim waits for it, and the
    block's task keeps running meanwhile (the wait yields to the loop)."""

    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        for job in ("a", "b"):
            assert await store.enqueue(job, ready_at=0.0)
        [lease] = await store.claim_next("w", ttl=TTL)
        other = "b" if lease.job_id == "a" else "a"
        order: list[str] = []
        inside = asyncio.Event()

        async def block() -> None:
            async with store.fenced(lease, complete=True, result="r"):
                inside.set()
                for _ in range(20):  # the loop must keep running this task while the other waits
                    await asyncio.sleep(0.01)
                order.append("block ends")

        async def claimer() -> None:
            await inside.wait()
            assert await store.claim(other, "x", ttl=TTL) is not None
            order.append("claimed")

        await asyncio.gather(block(), claimer())
        if engine.dialect.name == "sqlite":  # the write lock serialized them
            assert order == ["block ends", "claimed"]
        else:  # another row: nobody waits
            assert sorted(order) == ["block ends", "claimed"]
        state = await store.state(lease.job_id)
        assert state is not None and state.done

    run(target, scenario)


def test_a_task_inside_its_block_is_refused_what_would_wait_for_itself(target: str) -> None:
    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        assert await store.enqueue("j", ready_at=0.0)
        lease = await store.claim("j", "w", ttl=TTL)
        assert lease is not None
        async with store.fenced(lease) as conn:
            with pytest.raises(ConfigurationError, match="would wait for it"):
                await store.complete(lease, "x")
            assert await store.state("j", conn=conn) is not None  # its own connection is fine
        assert await store.complete(lease, "x")

    run(target, scenario)


# -- cancellation at every await ---------------------------------------------------------------


def open_transactions(engine: Engine) -> int:
    """Transactions open on the test's database other than this query's own."""
    with engine.connect() as conn:
        name = engine.dialect.name
        if name == "postgresql":
            sql = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND xact_start IS NOT NULL"
            )
        elif name in ("mysql", "mariadb"):
            sql = (
                "SELECT count(*) FROM information_schema.innodb_trx t JOIN information_schema.processlist p "
                "ON p.id = t.trx_mysql_thread_id WHERE p.db = DATABASE() AND p.id <> CONNECTION_ID()"
            )
        else:
            return _sqlite_write_locked(str(engine.url.database))
        return int(conn.exec_driver_sql(sql).scalar_one())


def still_open(engine: Engine, within: float = 2.0) -> int:
    """:func:`open_transactions` once it is 0, or after ``within`` seconds (a server may list
    a transaction for a moment after its COMMIT; one left open stays listed)."""
    deadline = time.monotonic() + within
    while (count := open_transactions(engine)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def _sqlite_write_locked(path: str) -> int:
    """1 if anyone holds SQLite's write lock (a BEGIN IMMEDIATE that must not wait fails)."""
    raw = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        raw.execute("BEGIN IMMEDIATE")
        raw.execute("ROLLBACK")
        return 0
    except sqlite3.OperationalError:
        return 1
    finally:
        raw.close()


def _rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        jobs = fencing.jobs
        return [tuple(r) for r in conn.execute(select(jobs).order_by(jobs.c.id))]


def cancelled_at_every_step(
    target: str,
    engine: Engine,
    prepare: Callable[[AsyncJobStore], Awaitable[Any]],
    operation: Callable[[AsyncJobStore, Any], Awaitable[Any]],
    whole: Callable[[list[tuple[Any, ...]], bool], bool],
) -> int:
    """Cancel ``operation`` after 0, 1, 2, ... loop steps until it finishes first; after
    each: no connection lost, no transaction open, and the rows as the whole operation
    leaves them or as a cancelled one does (``whole(rows, finished)``). Returns the steps."""
    done_at: list[int] = []

    async def scenario(async_engine: AsyncEngine, store: AsyncJobStore) -> None:
        steps = 0
        while not done_at:
            async with async_engine.begin() as conn:
                await conn.execute(fencing.jobs.delete())
            prepared = await prepare(store)
            task = asyncio.ensure_future(operation(store, prepared))
            for _ in range(steps):
                await asyncio.sleep(0)
            finished = task.done()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, LeaseLost):
                await task
            assert async_engine.sync_engine.pool.checkedout() == 0, f"a connection lost at step {steps}"  # type: ignore[attr-defined]
            assert still_open(engine) == 0, f"a transaction stayed open after a cancel at step {steps}"
            after = [tuple(v.decode() if isinstance(v, bytes) else v for v in r) for r in _rows(engine)]
            assert whole(after, finished), f"a partial outcome after a cancel at step {steps}: {after}"
            if finished:
                done_at.append(steps)
            steps += 1

    run(target, scenario)
    return done_at[0]


@pytest.fixture
def sync_engine(engine: Engine) -> Engine:
    JobStore(engine).create_table()
    return engine


def _job(rows: list[tuple[Any, ...]], job_id: str) -> tuple[Any, ...]:
    return next(r for r in rows if r[0] == job_id)


@pytest.mark.slow
def test_claim_next_cancelled_anywhere_claims_all_or_nothing(target: str, sync_engine: Engine) -> None:
    async def prepare(store: AsyncJobStore) -> None:
        for job in ("a", "b", "c"):
            await store.enqueue(job, ready_at=0.0)

    def whole(after: list[tuple[Any, ...]], finished: bool) -> bool:
        # (id, owner, until, fence, result, done): the two picked held by "w" once it finished;
        # cancelled, nothing held (a claim that had committed was given back, its fence kept)
        held = [r for r in after if r[1] is not None and r[2] > 0]
        if finished:
            return len(held) == 2 and all(r[3] == 1 and r[1] == "w" for r in held)
        return held == [] and sum(r[3] for r in after) in (0, 2)

    steps = cancelled_at_every_step(
        target, sync_engine, prepare, lambda s, _: s.claim_next("w", ttl=TTL, limit=2), whole
    )
    assert steps >= 2  # it was cancelled at more than one point before it could finish


@pytest.mark.slow
def test_complete_and_complete_many_cancelled_anywhere_store_all_or_nothing(
    target: str, sync_engine: Engine
) -> None:
    async def prepare(store: AsyncJobStore) -> list[fencing.Lease]:
        for job in ("a", "b"):
            await store.enqueue(job, ready_at=0.0)
        return await store.claim_next("w", ttl=TTL, limit=2)

    def whole(after: list[tuple[Any, ...]], finished: bool) -> bool:
        done = [r for r in after if r[5]]
        return len(done) in ((2,) if finished else (0, 2)) and all(r[4] == "r" for r in done)

    cancelled_at_every_step(
        target,
        sync_engine,
        prepare,
        lambda s, leases: s.complete_many([(lease, "r") for lease in leases]),
        whole,
    )

    def one(after: list[tuple[Any, ...]], finished: bool) -> bool:
        done = [r for r in after if r[5]]
        return len(done) in ((1,) if finished else (0, 1)) and all(r[4] == "r" for r in done)

    cancelled_at_every_step(target, sync_engine, prepare, lambda s, leases: s.complete(leases[0], "r"), one)


@pytest.mark.slow
def test_a_fenced_block_cancelled_anywhere_keeps_all_or_nothing(target: str, sync_engine: Engine) -> None:
    receipts.create(sync_engine, checkfirst=True)

    async def prepare(store: AsyncJobStore) -> fencing.Lease:
        async with store.engine.begin() as conn:
            await conn.execute(receipts.delete())
        await store.enqueue("a", ready_at=0.0)
        [lease] = await store.claim_next("w", ttl=TTL)
        return lease

    async def block(store: AsyncJobStore, lease: fencing.Lease) -> None:
        async with store.fenced(lease, complete=True, result="r") as conn:
            await conn.execute(receipts.insert().values(job="a", n=1))
            await asyncio.sleep(0)

    def whole(after: list[tuple[Any, ...]], finished: bool) -> bool:
        with sync_engine.connect() as conn:
            written = conn.execute(select(func.count()).select_from(receipts)).scalar_one()
        done = _job(after, "a")[5]
        return (written, bool(done)) in (((1, True),) if finished else ((0, False), (1, True)))

    cancelled_at_every_step(target, sync_engine, prepare, block, whole)


def _cancelled_at_its_commit(
    target: str, lose_the_lease: bool, driver: str | None = None
) -> tuple[BaseException | None, int, bool]:
    """A fenced block whose caller is cancelled while its end commits (a listener on the
    engine's COMMIT cancels it, so the store runs through Core): what the caller got, the
    receipts kept, and whether the job is done."""
    outcome: list[Any] = []

    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        async with engine.begin() as conn:
            await conn.run_sync(lambda c: receipts.create(c, checkfirst=True))
            await conn.execute(receipts.delete())
            await conn.execute(fencing.jobs.delete())
        await store.enqueue("a", ready_at=0.0)
        # the caller's clock: a lease that runs out while the block sleeps, when it must
        lease = await store.claim("a", "w", ttl=0.05 if lose_the_lease else TTL, now=0.0)
        assert lease is not None
        armed: list[asyncio.Task[Any]] = []

        def cancel_the_caller(*_: Any) -> None:
            if armed:
                armed.pop().cancel()  # while the COMMIT (or the end's ROLLBACK) is on its way

        sqlalchemy.event.listen(engine.sync_engine, "commit", cancel_the_caller)
        sqlalchemy.event.listen(engine.sync_engine, "rollback", cancel_the_caller)

        told: list[BaseException | None] = []

        async def block() -> None:
            try:
                async with store.fenced(lease, now=0.0, complete=True, result="r") as conn:
                    await conn.execute(receipts.insert().values(job="a", n=1))
                    if lose_the_lease:  # past its until by the end check: LeaseLost, rolled back
                        await asyncio.sleep(0.1)
                    armed.append(task)
            except BaseException as exc:  # what the caller was told (Python 3.10's task drops the cause)
                told.append(exc)
                raise
            told.append(None)

        task = asyncio.ensure_future(block())
        with contextlib.suppress(asyncio.CancelledError):
            await task
        outcome.append(told[0])
        sqlalchemy.event.remove(engine.sync_engine, "commit", cancel_the_caller)
        sqlalchemy.event.remove(engine.sync_engine, "rollback", cancel_the_caller)
        async with engine.connect() as conn:
            outcome.append(len((await conn.execute(select(receipts))).all()))
        state = await store.state("a")
        outcome.append(state is not None and state.done)

    run(target, scenario, driver)
    return outcome[0], outcome[1], outcome[2]


def test_a_fenced_block_cancelled_while_it_commits_says_it_committed(target: str) -> None:
    """Cancelled while its COMMIT is on its way, the block that committed exits normally: its
    caller learns the writes are kept (it once got CancelledError, and a retry paid twice)."""
    told, kept, done = _cancelled_at_its_commit(target, lose_the_lease=False)
    assert told is None
    assert (kept, done) == (1, True)


def test_a_fenced_block_cancelled_while_its_end_fails_is_cancelled_and_kept_nothing(target: str) -> None:
    """Cancelled while its end rolls it back (the lease ran out): CancelledError, nothing kept."""
    told, kept, done = _cancelled_at_its_commit(target, lose_the_lease=True)
    assert isinstance(told, asyncio.CancelledError)
    assert isinstance(told.__cause__, LeaseLost)
    assert (kept, done) == (0, False)


@pytest.mark.backend("postgresql")
def test_a_fenced_block_cancelled_at_its_end_on_asyncpg_says_what_happened(target: str) -> None:
    """The suite's PostgreSQL driver is psycopg's async mode: asyncpg too."""
    assert _cancelled_at_its_commit(target, False, "postgresql+asyncpg") == (None, 1, True)
    told, kept, done = _cancelled_at_its_commit(target, True, "postgresql+asyncpg")
    assert isinstance(told, asyncio.CancelledError) and (kept, done) == (0, False)


# -- every driver ------------------------------------------------------------------------------


@pytest.mark.backend("postgresql")
@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg"])
def test_both_postgresql_async_drivers_fence_a_late_writer(target: str, driver: str) -> None:
    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        assert await store.enqueue("j", ready_at=0.0)
        old = await store.claim("j", "a", ttl=TTL)
        assert old is not None and await store.revoke("j")
        [new] = await store.claim_next("b", ttl=TTL)
        assert [bool(v) for v in await store.complete_many([(new, "new"), (old, "old")])] == [True, False]
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT result FROM jobs"))).scalar_one() == "new"

    run(target, scenario, driver=driver)


@pytest.mark.backend("postgresql")
@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg"])
def test_connections_a_listener_puts_in_autocommit_are_refused_on_both_drivers(
    target: str, driver: str
) -> None:
    """As the sync store refuses them (tests/store/test_host_app.py): nothing is written."""

    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        assert await store.enqueue("j", ready_at=0.0)
        await engine.dispose()

        def autocommit(dbapi_connection: Any, record: Any) -> None:
            dbapi_connection.autocommit = True

        sqlalchemy.event.listen(engine.sync_engine, "connect", autocommit)
        with pytest.raises(ConfigurationError, match="autocommit"):
            await store.claim("j", "w", ttl=TTL)
        sqlalchemy.event.remove(engine.sync_engine, "connect", autocommit)
        await engine.dispose()
        state = await store.state("j")
        assert state is not None and (state.owner, state.fence) == (None, 0)

    run(target, scenario, driver=driver)


def test_fence_marks_refuse_an_older_fence_as_coroutines(target: str) -> None:
    async def scenario(engine: AsyncEngine, store: AsyncJobStore) -> None:
        marks = AsyncFenceMarks(engine)
        await marks.create_tables()
        assert await marks.accept("r", 5)
        assert not await marks.accept("r", 4)
        assert await marks.highest("r") == 5
        assert await marks.record_once("k", fence=5)
        assert not await marks.record_once("k", fence=6)

    run(target, scenario)
