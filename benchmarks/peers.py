"""fencing against the job queues a user would pick instead: jobs/s, side by side, and stale writes.

Install the peers in a venv of their own (see ``benchmarks/requirements-peers.txt``)::

    python -m venv peers-venv && . peers-venv/bin/activate
    pip install -e .[postgresql,asyncpg] -r benchmarks/requirements-peers.txt

What is measured
----------------
A backlog of N ready jobs plus the C jobs to be measured (``--sizes``, ``--cycles``) is
enqueued first, not timed, once per system and size (a template), and every measurement
starts from a fresh copy of it: on SQLite a copy of the template's file, on PostgreSQL the
system's tables emptied (``TRUNCATE``) and refilled from a snapshot of the rows its own
enqueue API wrote, then ``ANALYZE``. P worker processes (``--processes``; ``multiprocessing``
"spawn", spawned once and kept), each with its own engine / queue object / connection opened
before the start, start together on a barrier and run C/P cycles each, so the backlog goes
from N + C to N during a measurement. jobs/s = C / (the last worker's end - the first
worker's start). Every exception a call raises is caught, counted (``errors``) and the worker
goes on; every job a worker got is recorded by id, and ``dup`` counts jobs handed to more than
one worker (a queue without an atomic claim can do that). One cycle, per system:

SQLite (a real disk: ``--dir``, default a temporary directory under the working directory)

``fencing`` ``single``
    ``[lease] = store.claim_next(owner, ttl=600, limit=1)`` then
    ``store.complete(lease, owner)``: two transactions per job, the result stored in the
    job's row. ``store = fencing.JobStore(fencing.create_sqlite_engine(path,
    durability=...))``, at ``full`` (WAL, ``synchronous=FULL``: fsync per commit, the
    library's default) and ``normal`` (WAL, ``synchronous=NORMAL``).
``fencing`` ``step`` (when ``JobStore.complete_and_claim_next`` exists)
    One ``claim_next(limit=1)``, then ``done, leases = store.complete_and_claim_next([(lease,
    owner)], owner, ttl=600, limit=1)`` per job (completes the last lease and claims the next
    one in ONE transaction), the last job with ``complete``: one transaction per job.
``fencing`` ``batched``
    ``store.claim_next(owner, ttl=600, limit=100)`` then ``store.complete_many([(lease,
    owner), ...])``: two transactions per 100 jobs; measured over ``--batched-cycles`` jobs
    (default 2000, so the backlog goes from N + 2000 to N).
``huey`` (SqliteHuey 3.5.4, ``fsync=True``: ``synchronous=FULL``, WAL; compared with fencing
at full)
    ``task = huey.dequeue()`` (``BEGIN EXCLUSIVE``; select the first task, delete it;
    commit) then ``huey.put_result(task.id, owner)`` (``INSERT OR REPLACE`` into its kv
    table): the storage API a huey consumer calls around running a task, two transactions
    per job. Jobs were enqueued with huey's own task serialization (``huey.enqueue``'s rows).
``persist-queue`` (``SQLiteAckQueue``, its defaults: WAL, and no ``synchronous`` PRAGMA, so
SQLite's default ``FULL``; the value read on the queue's connection is printed; compared with
fencing at full)
    ``item = q.get(block=False, raw=True)`` (a SELECT of the first ready row, then an
    ``UPDATE ... SET status = unack WHERE _id = ?``: two statements, not atomic across
    processes) then ``q.ack(id=item["pqid"])``. Opened with ``auto_resume=False`` so that a
    worker opening its queue does not reset the others' in-flight jobs.
``litequeue`` (``LiteQueue``: WAL, ``synchronous=NORMAL``, set by the library; compared with
fencing at normal)
    ``message = q.pop()`` (``BEGIN IMMEDIATE``; ``UPDATE ... RETURNING`` that bumps the
    message's ``claim_id``) then ``q.done(message.message_id, claim_id=message.claim_id)``.

PostgreSQL (``--postgresql-url``; a dedicated database, ``--database``, created and dropped;
durability is the server's: ``synchronous_commit`` is printed)

``fencing`` ``single`` / ``step`` / ``batched``
    As above, on ``sqlalchemy.create_engine("postgresql+psycopg://...")``.
``fencing-async`` ``single`` / ``step`` / ``batched``
    The same calls, awaited, on ``fencing.asyncio.AsyncJobStore`` over an asyncpg
    ``AsyncEngine`` (``harness.db.async_engine``, as ``benchmarks/async_cycle.py`` builds
    it; ``pool_size=1``): ``await store.claim_next(owner, ttl=600, limit=1)`` then ``await
    store.complete(lease, owner)``; ``await store.complete_and_claim_next(...)``; ``limit=100``
    then ``await store.complete_many(...)``. One task per worker process, as the other async
    peers; the same table and rows as ``fencing`` (one cycle, written once: ``fencing_cycles``).
``procrastinate`` ``single``
    Through its public ``App.job_manager`` (``JobManager``), not the worker:
    ``job = await job_manager.fetch_job(queues=None, worker_id=wid)`` (``wid`` from
    ``register_worker()``) then ``await job_manager.finish_job(job, Status.SUCCEEDED,
    delete_job=False)``. procrastinate fetches one job per call: no batched mode.
``pgqueuer`` ``single`` / ``batched``
    ``jobs = await queries.dequeue(batch_size=1|100, ...)`` (status ``picked``) then
    ``await queries.log_jobs([(job, "successful", None), ...])`` (delete from the queue,
    insert into its log), on a psycopg ``AsyncConnection`` in autocommit (as pgqueuer
    requires). Its tables' persistence (LOGGED/UNLOGGED) is printed.
``oban`` ``single`` / ``batched``
    ``jobs = await query.fetch_jobs(demand=1|100, queue="default", ...)`` then
    ``await query.ack_jobs([AckAction(job, "completed"), ...])`` (one UPDATE per job, in one
    transaction): the calls its producer makes, through ``oban._query.Query`` (internal: oban
    has no public fetch/ack API outside its worker loop).

Interleaving and ratios: a repetition runs every (system, mode) of a backend for every size
and process count, in an order rotated from repetition to repetition, so a slow spell of the
disk or of the machine hits all alike. ``jobs/s`` is the median of ``--repeat`` repetitions.
Ratios are fencing / peer at matched durability, taken within each repetition (the two
measurements of the same repetition, size and process count) and shown as median (min-max):
``single`` and ``step`` against the peer's one-at-a-time cycle, ``batched`` against the peer's
batched cycle, or its one-at-a-time cycle when it has no batch API (marked ``*``). The same
for ``fencing-async``, and ``fencing-async`` / ``fencing`` mode for mode (what the async front
costs, with the drivers' difference).

Stale check (``--stale-check``, also run by default): for each system, worker A takes a job,
the job is taken from A the system's documented way (A's lease expires; or the re-queue the
system documents for a stalled worker), worker B takes it and finishes it, then A finishes it
late. Does the system refuse A's completion and keep B's? Asked a second time with A's late
completion arriving while B still holds the job (before B finishes).

Reproduce
---------
::

    python benchmarks/peers.py                                   # sizes 1000,10000,100000; R=3
    python benchmarks/peers.py --sizes 1000,10000 --repeat 2     # a few minutes
    python benchmarks/peers.py --backends sqlite --sizes 100000 --processes 1
    python benchmarks/peers.py --backends postgresql --systems fencing,fencing-async,procrastinate,pgqueuer
    python benchmarks/peers.py --stale-check-only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import sqlite3
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from datetime import timedelta
from operator import methodcaller
from typing import Any, ClassVar

import sqlalchemy
from harness import cli, db, env, report
from harness.measure import BARRIER_TIMEOUT, Handler, Pool, rotated, timed
from sqlalchemy.engine import make_url

import fencing

TTL = 600.0
BATCH = 100
MAX_ERRORS = 50  # a worker that keeps failing stops
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
HAS_STEP = hasattr(fencing.JobStore, "complete_and_claim_next")
HUEY_NAME = "bench"
OBAN_QUEUE = "default"
PGQ_ENTRYPOINT = "noop"

FENCING_MODES = ("single", "step", "batched") if HAS_STEP else ("single", "batched")
#: fencing's own systems: each is compared with every peer, and the async store with the sync one
OURS = ("fencing", "fencing-async")
#: a system run on another's tables: enqueued, snapshotted and reset as that one
SAME_TABLES = {"fencing-async": "fencing"}

#: (backend, system, durability) -> its modes; peers are compared with fencing at ``durability``
SQLITE_SYSTEMS: list[tuple[str, str, tuple[str, ...]]] = [
    ("fencing", "full", FENCING_MODES),
    ("fencing", "normal", FENCING_MODES),
    ("huey", "full", ("single",)),
    ("persist-queue", "full", ("single",)),
    ("litequeue", "normal", ("single",)),
]
PG_SYSTEMS: list[tuple[str, str, tuple[str, ...]]] = [
    ("fencing", "server", FENCING_MODES),
    ("fencing-async", "server", FENCING_MODES),
    ("procrastinate", "server", ("single",)),
    ("pgqueuer", "server", ("single", "batched")),
    ("oban", "server", ("single", "batched")),
]
DISTRIBUTIONS = {
    "huey": "huey",
    "persist-queue": "persist-queue",
    "litequeue": "litequeue",
    "procrastinate": "procrastinate",
    "pgqueuer": "pgqueuer",
    "oban": "oban",
}
#: what the header says the run measured with
VERSIONS = (
    "python",
    "sqlite",
    "sqlalchemy",
    "fencing",
    "cpus",
    "psycopg",
    "asyncpg",
    "greenlet",
    *DISTRIBUTIONS.values(),
)


def psycopg_url(url: str) -> str:
    """The SQLAlchemy URL (``postgresql+psycopg``) of a plain ``postgresql://`` URL."""
    return make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def plain_url(url: str) -> str:
    """A libpq conninfo URL for psycopg (and the peers built on it)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def with_database(url: str, database: str) -> str:
    return make_url(url).set(database=database).render_as_string(hide_password=False)


# -- the peers' objects, opened in a worker (or in the main process for templates) -------------


def huey_app(path: str, fsync: bool = True) -> Any:
    """SqliteHuey at ``synchronous=FULL`` with the task ``bench.noop`` (the same name in every
    process: huey names a task by its function's module, which differs under spawn)."""
    from huey import SqliteHuey

    huey = SqliteHuey(HUEY_NAME, filename=path, fsync=fsync)

    def noop(i: int) -> int:  # never run: the benchmark dequeues and stores results itself
        return i

    noop.__module__ = "bench"
    huey.bench_noop = huey.task(name="noop")(noop)
    return huey


def persist_queue(path: str, auto_resume: bool = False) -> Any:
    from persistqueue import SQLiteAckQueue

    return SQLiteAckQueue(path, auto_resume=auto_resume)


def lite_queue(path: str) -> Any:
    from litequeue import LiteQueue

    return LiteQueue(path)


def procrastinate_app(url: str) -> Any:
    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.ERROR)  # "App is instantiated in the main module"
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=plain_url(url), min_size=1, max_size=2)
    )

    @app.task(name="noop")
    def noop(i: int) -> int:  # never run: the benchmark fetches and finishes jobs itself
        return i

    return app


# -- SQLite templates (main process) ------------------------------------------------------------


def sqlite_target(system: str, root: str) -> str:
    """Where a system's database lives in ``root``: a file, or persist-queue's directory."""
    return os.path.join(root, "pq") if system == "persist-queue" else os.path.join(root, "queue.db")


def build_sqlite_template(system: str, root: str, n: int) -> None:
    """``n`` ready jobs in a new database under ``root``, through the system's own enqueue."""
    os.makedirs(root, exist_ok=True)
    target = sqlite_target(system, root)
    ids = [f"job-{i:07d}" for i in range(n)]
    if system == "fencing":
        engine = fencing.create_sqlite_engine(target)
        store = fencing.JobStore(engine)
        store.create_table()
        with engine.begin() as conn:
            for job_id in ids:
                store.enqueue(job_id, conn=conn)
        engine.dispose()
    elif system == "huey":
        huey = huey_app(target)
        rows = [(HUEY_NAME, huey.serialize_task(huey.bench_noop.s(i)), 0) for i in range(n)]
        # the statement SqliteStorage.enqueue runs, for all rows in one transaction
        with huey.storage.db(commit=True) as curs:
            curs.executemany("insert into task (queue, data, priority) values (?, ?, ?)", rows)
        huey.storage.close()
    elif system == "persist-queue":
        q = persist_queue(target)
        now = time.time()
        # the statement SQLiteAckQueue.put runs, for all rows in one transaction
        with q._putter as conn:
            conn.executemany(q._sql_insert, [(q._serializer.dumps(job_id), now) for job_id in ids])
        q.close()
    elif system == "litequeue":
        q = lite_queue(target)
        with q.transaction(mode="IMMEDIATE"):
            for job_id in ids:
                q.put(job_id)
        q.close()
    else:
        raise ValueError(system)


def copy_template(template: str, dest: str) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(template, dest)


# -- PostgreSQL (main process) ------------------------------------------------------------------


class Postgres:
    """The dedicated database, the systems' schemas, snapshots and resets."""

    TABLES: ClassVar[dict[str, tuple[str, list[str]]]] = {  # system -> (job table, emptied with it)
        "fencing": ("jobs", []),
        "procrastinate": ("procrastinate_jobs", ["procrastinate_workers"]),
        "pgqueuer": ("pgqueuer", ["pgqueuer_log", "pgqueuer_statistics"]),
        "oban": ("oban_jobs", []),
    }

    def __init__(self, admin_url: str, database: str, systems: list[str]) -> None:
        import psycopg

        self.admin_url = plain_url(admin_url)
        self.database = database
        self.url = with_database(self.admin_url, database)
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}"')
            conn.execute(f'CREATE DATABASE "{database}"')
        self.conn = psycopg.connect(self.url, autocommit=True)
        self.systems = systems
        self.snapshots: set[tuple[str, int]] = set()
        for system in dict.fromkeys(SAME_TABLES.get(s, s) for s in systems):
            getattr(self, f"install_{system.replace('-', '_')}")()

    def info(self) -> dict[str, str]:
        version = self.conn.execute("SHOW server_version").fetchone()[0]
        sync = self.conn.execute("SHOW synchronous_commit").fetchone()[0]
        fsync = self.conn.execute("SHOW fsync").fetchone()[0]
        out = {"version": f"PostgreSQL {version}", "synchronous_commit": sync, "fsync": fsync}
        if "pgqueuer" in self.systems:
            rows = self.conn.execute(
                "SELECT relname, relpersistence FROM pg_class WHERE relname IN "
                "('pgqueuer', 'pgqueuer_log') ORDER BY relname"
            ).fetchall()
            out["pgqueuer tables"] = ", ".join(
                f"{name} {'LOGGED' if p == 'p' else 'UNLOGGED'}" for name, p in rows
            )
        return out

    def install_fencing(self) -> None:
        engine = sqlalchemy.create_engine(psycopg_url(self.url))
        fencing.JobStore(engine).create_table()
        engine.dispose()

    def install_procrastinate(self) -> None:
        app = procrastinate_app(self.url)

        async def go() -> None:
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(go())

    def install_pgqueuer(self) -> None:
        async def go() -> None:
            import psycopg
            from pgqueuer.queries import Queries

            conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
            await Queries.from_psycopg_connection(conn).install()
            await conn.close()

        asyncio.run(go())

    def install_oban(self) -> None:
        async def go() -> None:
            from oban._query import Query
            from psycopg_pool import AsyncConnectionPool

            pool = AsyncConnectionPool(self.url, min_size=1, max_size=1, open=False)
            await pool.open()
            await Query(pool).install()
            await pool.close()

        asyncio.run(go())

    def _empty(self, system: str) -> None:
        table, others = self.TABLES[system]
        self.conn.execute(f"TRUNCATE {', '.join([table, *others])} CASCADE")

    def enqueue(self, system: str, n: int) -> None:
        """``n`` ready jobs through the system's own enqueue API."""
        ids = [f"job-{i:07d}" for i in range(n)]
        if system == "fencing":
            engine = sqlalchemy.create_engine(psycopg_url(self.url))
            store = fencing.JobStore(engine)
            with engine.begin() as conn:
                for job_id in ids:
                    store.enqueue(job_id, conn=conn)
            engine.dispose()
        elif system == "procrastinate":
            app = procrastinate_app(self.url)

            async def go_procrastinate() -> None:
                async with app.open_async():
                    task = app.tasks["noop"]
                    for k in range(0, n, 1000):
                        await task.batch_defer_async(*({"i": i} for i in range(k, min(n, k + 1000))))

            asyncio.run(go_procrastinate())
        elif system == "pgqueuer":

            async def go_pgqueuer() -> None:
                import psycopg
                from pgqueuer.queries import Queries

                conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
                queries = Queries.from_psycopg_connection(conn)
                for k in range(0, n, 1000):
                    chunk = ids[k : k + 1000]
                    await queries.enqueue(
                        [PGQ_ENTRYPOINT] * len(chunk), [i.encode() for i in chunk], [0] * len(chunk)
                    )
                await conn.close()

            asyncio.run(go_pgqueuer())
        elif system == "oban":

            async def go_oban() -> None:
                from oban import Job
                from oban._query import Query
                from psycopg_pool import AsyncConnectionPool

                pool = AsyncConnectionPool(self.url, min_size=1, max_size=1, open=False)
                await pool.open()
                query = Query(pool)
                async with pool.connection() as conn, conn.transaction():
                    await query.insert_jobs(
                        [Job(worker="bench.Noop", queue=OBAN_QUEUE, args={"id": i}) for i in ids], conn=conn
                    )
                await pool.close()

            asyncio.run(go_oban())
        else:
            raise ValueError(system)

    def reset(self, system: str, n: int) -> None:
        """The system's tables holding exactly the ``n`` jobs of its snapshot, analyzed."""
        system = SAME_TABLES.get(system, system)
        table, _ = self.TABLES[system]
        snap = f"bench_snap_{system}_{n}"
        if (system, n) not in self.snapshots:
            self._empty(system)
            self.enqueue(system, n)
            self.conn.execute(f"DROP TABLE IF EXISTS {snap}")
            self.conn.execute(f"CREATE TABLE {snap} AS SELECT * FROM {table}")
            self.snapshots.add((system, n))
        else:
            self._empty(system)
            self.conn.execute(f"INSERT INTO {table} OVERRIDING SYSTEM VALUE SELECT * FROM {snap}")
        self.conn.execute(f"ANALYZE {table}")
        self.conn.execute("CHECKPOINT")

    def close(self) -> None:
        import psycopg

        self.conn.close()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


# -- the worker side ----------------------------------------------------------------------------


class Tally:
    """What one worker did: the ids it got (and completed), its errors."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.completed = 0
        self.errors: list[str] = []

    def error(self, where: str, exc: BaseException) -> None:
        self.errors.append(f"{where}: {type(exc).__name__}: {str(exc)[:200]}")

    @property
    def failing(self) -> bool:
        return len(self.errors) >= MAX_ERRORS


#: one store call of a fencing worker's cycle: ``call(store)`` makes it (``methodcaller``)
StoreCall = Callable[[Any], Any]


def fencing_cycles(mode: str, count: int, owner: str, tally: Tally) -> Generator[StoreCall, Any, None]:
    """A fencing worker's cycles as the store calls they make, for the sync and the async store
    alike: each ``yield`` is one call, answered with its result or raised its exception at the
    ``yield`` (:func:`on_store`, :func:`on_async_store`)."""
    if mode == "batched":
        while tally.completed < count and not tally.failing:
            try:
                leases = yield methodcaller(
                    "claim_next", owner, ttl=TTL, limit=min(BATCH, count - tally.completed)
                )
            except Exception as exc:
                tally.error("claim_next", exc)
                continue
            if not leases:
                return
            tally.got += [lease.job_id for lease in leases]
            try:
                done = yield methodcaller("complete_many", [(lease, owner) for lease in leases])
                tally.completed += sum(done)
            except Exception as exc:
                tally.error("complete_many", exc)
        return
    leases: list[Any] = []
    while tally.completed < count and not tally.failing:
        try:
            if not leases:
                leases = yield methodcaller("claim_next", owner, ttl=TTL, limit=1)
                if not leases:
                    return
                tally.got.append(leases[0].job_id)
            if mode == "single" or tally.completed + 1 >= count:
                tally.completed += yield methodcaller("complete", leases[0], owner)
                leases = []
            else:
                done, leases = yield methodcaller(
                    "complete_and_claim_next", [(leases[0], owner)], owner, ttl=TTL, limit=1
                )
                tally.completed += sum(done)
                tally.got += [lease.job_id for lease in leases]
                if not leases:
                    return
        except Exception as exc:
            tally.error(mode, exc)
            leases = []


def on_store(store: fencing.JobStore, cycles: Generator[StoreCall, Any, None]) -> None:
    """Run ``cycles`` on the sync store."""
    with contextlib.suppress(StopIteration):
        call = next(cycles)
        while True:
            try:
                result = call(store)
            except Exception as exc:
                call = cycles.throw(exc)
            else:
                call = cycles.send(result)


async def on_async_store(store: Any, cycles: Generator[StoreCall, Any, None]) -> None:
    """Run ``cycles`` on the async store (``fencing.asyncio.AsyncJobStore``): the same calls, awaited."""
    with contextlib.suppress(StopIteration):
        call = next(cycles)
        while True:
            try:
                result = await call(store)
            except Exception as exc:
                call = cycles.throw(exc)
            else:
                call = cycles.send(result)


def open_sqlite(system: str, durability: str, target: str) -> tuple[Callable[..., None], Callable[[], None]]:
    """(run(mode, count, owner, tally), close) for one worker."""
    if system == "fencing":
        engine = fencing.create_sqlite_engine(target, durability=durability)
        store = fencing.JobStore(engine)
        store.state("warm-up")
        return (
            lambda mode, count, owner, tally: on_store(store, fencing_cycles(mode, count, owner, tally))
        ), engine.dispose
    if system == "huey":
        huey = huey_app(target)
        huey.storage.queue_size()

        def run_huey(mode: str, count: int, owner: str, tally: Tally) -> None:
            while tally.completed < count and not tally.failing:
                try:
                    task = huey.dequeue()
                    if task is None:
                        return
                    tally.got.append(task.id)
                    huey.put_result(task.id, owner)
                    tally.completed += 1
                except Exception as exc:
                    tally.error("dequeue/put_result", exc)

        return run_huey, huey.storage.close
    if system == "persist-queue":
        from persistqueue.exceptions import Empty

        q = persist_queue(target)
        q.size  # noqa: B018  (a read: opens the connection's file)

        def run_pq(mode: str, count: int, owner: str, tally: Tally) -> None:
            while tally.completed < count and not tally.failing:
                try:
                    item = q.get(block=False, raw=True)
                except Empty:
                    return
                except Exception as exc:
                    tally.error("get", exc)
                    continue
                tally.got.append(str(item["pqid"]))
                try:
                    if q.ack(id=item["pqid"]) is not None:
                        tally.completed += 1
                except Exception as exc:
                    tally.error("ack", exc)

        return run_pq, q.close
    if system == "litequeue":
        lq = lite_queue(target)
        lq.ready_count()

        def run_lq(mode: str, count: int, owner: str, tally: Tally) -> None:
            while tally.completed < count and not tally.failing:
                try:
                    message = lq.pop()
                    if message is None:
                        return
                    tally.got.append(message.message_id)
                    tally.completed += lq.done(message.message_id, claim_id=message.claim_id)
                except Exception as exc:
                    tally.error("pop/done", exc)

        return run_lq, lq.close
    raise ValueError(system)


async def open_pg_async(system: str, url: str) -> tuple[Callable[..., Any], Callable[[], Any]]:
    """(async run(mode, count, owner, tally), async close) for one worker."""
    if system == "fencing-async":
        from fencing.asyncio import AsyncJobStore

        engine = db.async_engine(url, pool_size=1)
        store = AsyncJobStore(engine)
        await store.state("warm-up")

        async def run_fencing_async(mode: str, count: int, owner: str, tally: Tally) -> None:
            await on_async_store(store, fencing_cycles(mode, count, owner, tally))

        return run_fencing_async, engine.dispose
    if system == "procrastinate":
        from procrastinate.jobs import Status

        app = procrastinate_app(url)
        await app.open_async()
        manager = app.job_manager
        worker_id = await manager.register_worker()

        async def run_procrastinate(mode: str, count: int, owner: str, tally: Tally) -> None:
            while tally.completed < count and not tally.failing:
                try:
                    job = await manager.fetch_job(queues=None, worker_id=worker_id)
                    if job is None:
                        return
                    tally.got.append(str(job.id))
                    await manager.finish_job(job, Status.SUCCEEDED, delete_job=False)
                    tally.completed += 1
                except Exception as exc:
                    tally.error("fetch_job/finish_job", exc)

        return run_procrastinate, app.close_async
    if system == "pgqueuer":
        import psycopg
        from pgqueuer.queries import EntrypointExecutionParameter, Queries

        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        queries = Queries.from_psycopg_connection(conn)
        entrypoints = {PGQ_ENTRYPOINT: EntrypointExecutionParameter(concurrency_limit=0)}
        manager_id = uuid.uuid4()

        async def run_pgqueuer(mode: str, count: int, owner: str, tally: Tally) -> None:
            while tally.completed < count and not tally.failing:
                want = min(BATCH if mode == "batched" else 1, count - tally.completed)
                try:
                    jobs = await queries.dequeue(
                        batch_size=want,
                        entrypoints=entrypoints,
                        queue_manager_id=manager_id,
                        global_concurrency_limit=None,
                        heartbeat_timeout=timedelta(seconds=TTL),
                    )
                    if not jobs:
                        return
                    tally.got += [str(job.id) for job in jobs]
                    await queries.log_jobs([(job, "successful", None) for job in jobs])
                    tally.completed += len(jobs)
                except Exception as exc:
                    tally.error("dequeue/log_jobs", exc)

        return run_pgqueuer, conn.close
    if system == "oban":
        from oban._executor import AckAction
        from oban._query import Query
        from psycopg_pool import AsyncConnectionPool

        pool = AsyncConnectionPool(url, min_size=1, max_size=1, open=False)
        await pool.open()
        await pool.wait()
        query = Query(pool)
        node = f"bench-{os.getpid()}"
        producer = str(uuid.uuid4())

        async def run_oban(mode: str, count: int, owner: str, tally: Tally) -> None:
            while tally.completed < count and not tally.failing:
                want = min(BATCH if mode == "batched" else 1, count - tally.completed)
                try:
                    jobs = await query.fetch_jobs(want, OBAN_QUEUE, node, producer)
                    if not jobs:
                        return
                    tally.got += [str(job.id) for job in jobs]
                    acked = await query.ack_jobs([AckAction(job=job, state="completed") for job in jobs])
                    tally.completed += len(acked)
                except Exception as exc:
                    tally.error("fetch_jobs/ack_jobs", exc)

        return run_oban, pool.close
    raise ValueError(system)


def run_command(cmd: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """One worker's part of one measurement: open, wait on the barrier, cycle, close."""
    tally = Tally()
    system, backend = cmd["system"], cmd["backend"]
    start = end = 0.0
    cpu = 0.0

    if backend == "sqlite" or system == "fencing":
        try:
            if backend == "sqlite":
                run, close = open_sqlite(system, cmd["durability"], cmd["target"])
            else:
                engine = sqlalchemy.create_engine(psycopg_url(cmd["target"]), pool_size=1)
                store = fencing.JobStore(engine)
                store.state("warm-up")

                def run(mode: str, count: int, owner: str, t: Tally) -> None:
                    on_store(store, fencing_cycles(mode, count, owner, t))

                close = engine.dispose
        except Exception as exc:
            barrier.abort()
            raise RuntimeError(f"{system}: cannot open: {exc}") from exc
        try:
            barrier.wait(BARRIER_TIMEOUT)
            _, start, end, cpu = timed(run, cmd["mode"], cmd["count"], cmd["owner"], tally)
        finally:
            close()
    else:

        async def go() -> None:
            try:
                run_async, close_async = await open_pg_async(system, cmd["target"])
            except Exception as exc:
                barrier.abort()
                raise RuntimeError(f"{system}: cannot open: {exc}") from exc
            try:
                nonlocal start, end, cpu
                barrier.wait(BARRIER_TIMEOUT)
                cpu0 = time.process_time()
                start = time.perf_counter()
                await run_async(cmd["mode"], cmd["count"], cmd["owner"], tally)
                end = time.perf_counter()
                cpu = time.process_time() - cpu0
            finally:
                await close_async()

        asyncio.run(go())
    return {
        "start": start,
        "end": end,
        "cpu": cpu,
        "completed": tally.completed,
        "got": tally.got,
        "errors": tally.errors,
    }


@contextlib.contextmanager
def worker(index: int) -> Iterator[Handler]:
    """One process for the whole run: one measurement (:func:`run_command`) per command."""
    logging.disable(logging.WARNING)  # the peers log every job or retry at INFO/WARNING
    yield run_command


def measure(workers: Pool, base: dict[str, Any], parties: int, total: int) -> dict[str, Any]:
    """``total`` cycles of ``base`` by ``parties`` workers, each its share; the figures."""
    shares = [total * (i + 1) // parties - total * i // parties for i in range(parties)]
    return summarize(
        workers.run([{**base, "count": share, "owner": f"worker-{i}"} for i, share in enumerate(shares)])
    )


def summarize(parts: list[dict[str, Any]]) -> dict[str, Any]:
    got = [job for p in parts for job in p["got"]]
    completed = sum(p["completed"] for p in parts)
    span = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    return {
        "jobs_s": completed / span if span > 0 else 0.0,
        "completed": completed,
        "errors": sum(len(p["errors"]) for p in parts),
        "error_samples": [e for p in parts for e in p["errors"]][:3],
        "dup": len(got) - len(set(got)),
        "cpu_us": 1e6 * sum(p["cpu"] for p in parts) / max(completed, 1),
    }


# -- the benchmark ------------------------------------------------------------------------------


def configurations(systems: list[tuple[str, str, tuple[str, ...]]]) -> list[tuple[str, str, str]]:
    return [(system, durability, mode) for system, durability, modes in systems for mode in modes]


def cycles_for(args: argparse.Namespace, mode: str) -> int:
    return args.batched_cycles if mode == "batched" else args.cycles


def bench_sqlite(args: argparse.Namespace, workers: Pool, workdir: str, runs: dict[Any, list[Any]]) -> None:
    systems = [s for s in SQLITE_SYSTEMS if s[0] in args.systems]
    configs = configurations(systems)
    templates: dict[tuple[str, int], str] = {}
    started = time.perf_counter()
    for n in args.sizes:
        for system in sorted({s for s, _, _ in configs}):
            for mode_total in sorted({cycles_for(args, m) for s, _, m in configs if s == system}):
                key = (system, n + mode_total)
                if key not in templates:
                    root = os.path.join(workdir, f"template-{system}-{n + mode_total}")
                    build_sqlite_template(system, root, n + mode_total)
                    templates[key] = root
    print(f"  sqlite templates built ({time.perf_counter() - started:.0f} s)", flush=True)
    scratch = os.path.join(workdir, "run")
    for rep in range(args.repeat):
        for n in args.sizes:
            for parties in args.processes if rep % 2 == 0 else args.processes[::-1]:
                for system, durability, mode in rotated(configs, rep + n + parties):
                    total = cycles_for(args, mode)
                    copy_template(templates[system, n + total], scratch)
                    base = {
                        "backend": "sqlite",
                        "system": system,
                        "durability": durability,
                        "mode": mode,
                        "target": sqlite_target(system, scratch),
                    }
                    result = measure(workers, base, parties, total)
                    runs.setdefault(("sqlite", system, durability, mode, n, parties), []).append(result)
        print(
            f"  sqlite repetition {rep + 1}/{args.repeat} done ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    shutil.rmtree(scratch, ignore_errors=True)


def bench_postgresql(
    args: argparse.Namespace, workers: Pool, pg: Postgres, runs: dict[Any, list[Any]]
) -> None:
    systems = [s for s in PG_SYSTEMS if s[0] in args.systems]
    configs = configurations(systems)
    started = time.perf_counter()
    for rep in range(args.repeat):
        for n in args.sizes:
            for parties in args.processes if rep % 2 == 0 else args.processes[::-1]:
                for system, durability, mode in rotated(configs, rep + n + parties):
                    total = cycles_for(args, mode)
                    pg.reset(system, n + total)
                    base = {"backend": "postgresql", "system": system, "durability": durability, "mode": mode}
                    base["target"] = pg.url
                    result = measure(workers, base, parties, total)
                    runs.setdefault(("postgresql", system, durability, mode, n, parties), []).append(result)
        print(
            f"  postgresql repetition {rep + 1}/{args.repeat} done ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )


RUNS = report.Table(
    report.Column("system", 14, "<"),
    report.Column("durability", 10, "<"),
    report.Column("mode", 8, "<"),
    report.Column("N", 7),
    report.Column("P", 2),
    report.Column("jobs/s", 9, spec=",.0f"),
    report.Column("range", 17),
    report.Column("cpu us/job", 10, spec=",.0f"),
    report.Column("errors", 6),
    report.Column("dup", 4),
    indent="  ",
)
RATIOS = report.Table(
    report.Column("fencing", 14, "<"),
    report.Column("peer", 14, "<"),
    report.Column("durability", 10, "<"),
    report.Column("N", 7),
    report.Column("P", 2),
    report.Column("single", 21, "<", sep="  "),
    report.Column("step", 21, "<"),
    report.Column("batched", 21, "<"),
    indent="  ",
)


def print_tables(runs: dict[Any, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    for backend in ("sqlite", "postgresql"):
        keys = [k for k in runs if k[0] == backend]
        if not keys:
            continue
        print(f"\n{backend}: jobs/s (median of {args.repeat}); errors and dup summed over repetitions")
        print(RUNS.header())
        for key in sorted(keys, key=lambda k: (k[4], k[5], k[1] not in OURS, k[1], k[2], k[3])):
            rs = runs[key]
            speeds = [r["jobs_s"] for r in rs]
            _, system, durability, mode, n, parties = key
            print(
                RUNS.row(
                    system,
                    durability,
                    mode,
                    n,
                    parties,
                    statistics.median(speeds),
                    report.spread(speeds, ",.0f"),
                    statistics.median(r["cpu_us"] for r in rs),
                    sum(r["errors"] for r in rs),
                    sum(r["dup"] for r in rs),
                )
            )
        samples = {e for k in keys for r in runs[k] for e in r["error_samples"]}
        for sample in sorted(samples)[:6]:
            print(f"    error seen: {sample}")
        print(
            f"\n{backend}: fencing / peer, per repetition: median (min-max); * = peer has no batch API; "
            "fencing-async / fencing in the same mode"
        )
        print(RATIOS.header())
        systems = sorted({(k[1], k[2]) for k in keys})
        # each of ours against every peer, and the async store against the sync one
        pairs = [
            (ours, (peer, durability))
            for i, ours in enumerate(OURS)
            for peer, durability in systems
            if (ours, durability) in systems and peer not in OURS[i:]
        ]
        for ours, (peer, durability) in pairs:
            for n in args.sizes:
                for parties in args.processes:
                    cells = [
                        ratio_cell(runs, (backend, ours, durability, fmode, n, parties), peer)
                        for fmode in ("single", "step", "batched")
                    ]
                    print(RATIOS.row(ours, peer, durability, n, parties, *cells))


def ratio_cell(runs: dict[Any, list[dict[str, Any]]], fkey: tuple[Any, ...], peer: str) -> str:
    """fencing's ``fkey`` over ``peer``'s matching cycle, per repetition: another of fencing's
    systems in the same mode; a peer in its one-at-a-time cycle for ``single`` and ``step``,
    its batched one for ``batched`` (its one-at-a-time one, starred, if it has no batch API)."""
    backend, _, durability, fmode, n, parties = fkey
    pmode = fmode if fmode == "batched" or peer in OURS else "single"
    pkey = (backend, peer, durability, pmode, n, parties)
    star = ""
    if pkey not in runs and fmode == "batched" and peer not in OURS:
        pkey = (backend, peer, durability, "single", n, parties)
        star = "*"
    if fkey not in runs or pkey not in runs:
        return "-"
    ratios = [
        f["jobs_s"] / p["jobs_s"] for f, p in zip(runs[fkey], runs[pkey], strict=True) if p["jobs_s"] > 0
    ]
    return (report.median_spread(ratios) if ratios else "-") + star


# -- the stale check ----------------------------------------------------------------------------


def stale_fencing_sqlite(tmp: str) -> tuple[bool, bool, str]:
    engine = fencing.create_sqlite_engine(os.path.join(tmp, "fencing.db"))
    store = fencing.JobStore(engine)
    store.create_table()
    outcomes = []
    for late_after_b in (True, False):
        job = f"job-{late_after_b}"
        store.enqueue(job, ready_at=0.0)
        lease_a = store.claim(job, "A", now=100.0, ttl=10.0)
        lease_b = store.claim(job, "B", now=111.0, ttl=10.0)  # A's lease expired at 110
        if late_after_b:
            b_ok = store.complete(lease_b, "B", now=112.0)
            a_ok = store.complete(lease_a, "A", now=113.0)
        else:
            a_ok = store.complete(lease_a, "A", now=112.0)
            b_ok = store.complete(lease_b, "B", now=113.0)
        state = store.state(job)
        outcomes.append(bool(b_ok and not a_ok and state is not None and state.result == "B"))
    engine.dispose()
    return (
        outcomes[0],
        outcomes[1],
        "A's lease (ttl) expires, B claims (fence 2); complete(A's lease) returns False, result stays B's",
    )


def stale_fencing_pg(url: str) -> tuple[bool, bool, str]:
    engine = sqlalchemy.create_engine(psycopg_url(url))
    store = fencing.JobStore(engine)
    store.create_table()
    outcomes = []
    for late_after_b in (True, False):
        job = f"stale-{uuid.uuid4()}"
        store.enqueue(job, ready_at=0.0)
        lease_a = store.claim(job, "A", ttl=0.2)
        time.sleep(0.3)
        lease_b = store.claim(job, "B", ttl=60.0)
        if late_after_b:
            b_ok = store.complete(lease_b, "B")
            a_ok = store.complete(lease_a, "A")
        else:
            a_ok = store.complete(lease_a, "A")
            b_ok = store.complete(lease_b, "B")
        state = store.state(job)
        outcomes.append(bool(b_ok and not a_ok and state is not None and state.result == "B"))
    engine.dispose()
    return outcomes[0], outcomes[1], "same, on the database's clock (ttl 0.2 s)"


def stale_huey(tmp: str) -> tuple[bool, bool, str]:
    huey = huey_app(os.path.join(tmp, "huey.db"))
    outcomes = []
    for late_after_b in (True, False):
        huey.storage.flush_queue()
        huey.enqueue(huey.bench_noop.s(1))
        task_a = huey.dequeue()
        huey.enqueue(task_a)  # the re-queue huey itself does for a retry: the same task id again
        task_b = huey.dequeue()
        if late_after_b:
            huey.put_result(task_b.id, "B")
        huey.put_result(task_a.id, "A")
        a_took_effect = huey.get(task_a.id, peek=True) == "A"
        if not late_after_b:
            huey.put_result(task_b.id, "B")
        outcomes.append(task_a.id == task_b.id and not a_took_effect)
    huey.storage.close()
    return (
        outcomes[0],
        outcomes[1],
        "no lease: the task is re-enqueued (as huey's retry does, same id); put_result is INSERT OR "
        "REPLACE by task id, so the last writer wins",
    )


def stale_persist_queue(tmp: str) -> tuple[bool, bool, str]:
    path = os.path.join(tmp, "pq")
    outcomes = []
    for late_after_b in (True, False):
        shutil.rmtree(path, ignore_errors=True)
        qa = persist_queue(path)
        qa.put("job")
        item_a = qa.get(block=False, raw=True)
        qb = persist_queue(path, auto_resume=True)  # a consumer (re)started: unacked jobs are ready again
        item_b = qb.get(block=False, raw=True)
        same = item_a["pqid"] == item_b["pqid"]
        if late_after_b:
            b_ok = qb.ack(id=item_b["pqid"]) is not None
            a_ok = qa.ack(id=item_a["pqid"]) is not None
        else:
            a_ok = qa.ack(id=item_a["pqid"]) is not None
            b_ok = qb.ack(id=item_b["pqid"]) is not None
        outcomes.append(same and b_ok and not a_ok)
        qa.close()
        qb.close()
    return (
        outcomes[0],
        outcomes[1],
        "no timeout: a restarted consumer's auto_resume makes unacked jobs ready; ack(id) is an "
        "UPDATE by id alone and accepts A's ack (no result is stored)",
    )


def stale_litequeue(tmp: str) -> tuple[bool, bool, str]:
    outcomes = []
    for late_after_b in (True, False):
        q = lite_queue(os.path.join(tmp, f"lq-{late_after_b}.db"))
        q.put("job")
        a = q.pop()
        time.sleep(0.05)
        q.retry_expired(0.01)  # A's claim older than the threshold: ready again
        b = q.pop()
        if late_after_b:
            b_ok = q.done(b.message_id, claim_id=b.claim_id)
            a_ok = q.done(a.message_id, claim_id=a.claim_id)
        else:
            a_ok = q.done(a.message_id, claim_id=a.claim_id)
            b_ok = q.done(b.message_id, claim_id=b.claim_id)
        outcomes.append(a.message_id == b.message_id and b_ok and not a_ok)
        q.close()
    return (
        outcomes[0],
        outcomes[1],
        "retry_expired(threshold) re-queues A's claim, B's pop bumps claim_id; "
        "done(claim_id=A's) returns False",
    )


def stale_procrastinate(url: str) -> tuple[bool, bool, str]:
    from procrastinate.jobs import Status

    async def go() -> list[bool]:
        app = procrastinate_app(url)
        outcomes = []
        async with app.open_async():
            manager = app.job_manager
            for late_after_b in (True, False):
                await app.tasks["noop"].defer_async(i=1)
                worker_a = await manager.register_worker()
                job_a = await manager.fetch_job(queues=None, worker_id=worker_a)
                await asyncio.sleep(0.3)
                for job in await manager.get_stalled_jobs(seconds_since_heartbeat=0.2):
                    await manager.retry_job(job)  # the documented handling of stalled jobs
                worker_b = await manager.register_worker()
                job_b = await manager.fetch_job(queues=None, worker_id=worker_b)
                assert job_a is not None and job_b is not None and job_a.id == job_b.id

                async def finish(job: Any) -> bool:
                    try:
                        await manager.finish_job(job, Status.SUCCEEDED, delete_job=False)
                    except Exception:
                        return False
                    return True

                if late_after_b:
                    b_ok = await finish(job_b)
                    a_ok = await finish(job_a)
                else:
                    a_ok = await finish(job_a)
                    b_ok = await finish(job_b)
                outcomes.append(b_ok and not a_ok)
                await manager.unregister_worker(worker_a)
                await manager.unregister_worker(worker_b)
        return outcomes

    outcomes = asyncio.run(go())
    return (
        outcomes[0],
        outcomes[1],
        "get_stalled_jobs() + retry_job() re-queue A's job; finish_job checks only status "
        "(todo/doing), not the worker: refused (raises) once B finished, accepted while B runs",
    )


def stale_pgqueuer(url: str) -> tuple[bool, bool, str]:
    async def go() -> list[bool]:
        import psycopg
        from pgqueuer.queries import EntrypointExecutionParameter, Queries

        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        queries = Queries.from_psycopg_connection(conn)
        entrypoints = {PGQ_ENTRYPOINT: EntrypointExecutionParameter(concurrency_limit=0)}
        outcomes = []
        for late_after_b in (True, False):
            await queries.clear_queue()
            await queries.clear_queue_log()
            await queries.enqueue(PGQ_ENTRYPOINT, b"job")

            async def dequeue(manager: uuid.UUID) -> Any:
                jobs = await queries.dequeue(
                    batch_size=1,
                    entrypoints=entrypoints,
                    queue_manager_id=manager,
                    global_concurrency_limit=None,
                    heartbeat_timeout=timedelta(seconds=0.2),
                )
                return jobs[0] if jobs else None

            job_a = await dequeue(uuid.uuid4())
            await asyncio.sleep(0.4)  # A sends no heartbeat: its pick goes stale
            job_b = await dequeue(uuid.uuid4())
            assert job_a is not None and job_b is not None and job_a.id == job_b.id
            first, second = (job_b, job_a) if late_after_b else (job_a, job_b)
            await queries.log_jobs([(first, "successful", None)])
            logged_first = len(await queries.queue_log())
            await queries.log_jobs([(second, "successful", None)])
            logged = len(await queries.queue_log())
            # log_jobs returns nothing; the log rows show whose completion took effect
            a_took_effect = (logged_first >= 1 and first is job_a) or (
                logged > logged_first and second is job_a
            )
            outcomes.append(not a_took_effect)
        await conn.close()
        return outcomes

    outcomes = asyncio.run(go())
    return (
        outcomes[0],
        outcomes[1],
        "A's heartbeat goes stale, B's dequeue re-picks the job; log_jobs deletes by id alone: A's "
        "late ack is a silent no-op after B's, and wins (B's is dropped) while B runs; no return value",
    )


def stale_oban(url: str) -> tuple[bool, bool, str]:
    async def go() -> list[bool]:
        from oban import Job
        from oban._executor import AckAction
        from oban._query import Query
        from psycopg_pool import AsyncConnectionPool

        pool = AsyncConnectionPool(url, min_size=1, max_size=2, open=False)
        await pool.open()
        query = Query(pool)
        outcomes = []
        for late_after_b in (True, False):
            await query.insert_jobs([Job(worker="bench.Noop", queue="stale", args={"late": late_after_b})])
            [job_a] = await query.fetch_jobs(1, "stale", "node-a", str(uuid.uuid4()))
            await asyncio.sleep(0.3)
            await query.rescue_jobs(0.2)  # what its Lifeline plugin does for a stuck job
            [job_b] = await query.fetch_jobs(1, "stale", "node-b", str(uuid.uuid4()))
            assert job_a.id == job_b.id
            if late_after_b:
                b_ok = bool(await query.ack_jobs([AckAction(job=job_b, state="completed")]))
                a_ok = bool(await query.ack_jobs([AckAction(job=job_a, state="completed")]))
            else:
                a_ok = bool(await query.ack_jobs([AckAction(job=job_a, state="completed")]))
                b_ok = bool(await query.ack_jobs([AckAction(job=job_b, state="completed")]))
            outcomes.append(b_ok and not a_ok)
        await pool.close()
        return outcomes

    outcomes = asyncio.run(go())
    return (
        outcomes[0],
        outcomes[1],
        "rescue_jobs (Lifeline) re-queues, B's fetch stamps a new attempted_at; ack matches "
        "state = executing AND attempted_at = A's: A's ack updates nothing",
    )


def stale_check(args: argparse.Namespace, workdir: str, pg: Postgres | None) -> None:
    checks: list[tuple[str, Callable[[], tuple[bool, bool, str]]]] = []
    tmp = os.path.join(workdir, "stale")
    os.makedirs(tmp, exist_ok=True)
    if "sqlite" in args.backends:
        checks.append(("fencing (sqlite)", lambda: stale_fencing_sqlite(tmp)))
        for name, fn in (
            ("huey", stale_huey),
            ("persist-queue", stale_persist_queue),
            ("litequeue", stale_litequeue),
        ):
            if name in args.systems:
                checks.append((name, lambda fn=fn: fn(tmp)))
    if pg is not None:
        checks.append(("fencing (postgresql)", lambda: stale_fencing_pg(pg.url)))
        for name, fn in (
            ("procrastinate", stale_procrastinate),
            ("pgqueuer", stale_pgqueuer),
            ("oban", stale_oban),
        ):
            if name in args.systems:
                checks.append((name, lambda fn=fn: fn(pg.url)))
    table = report.Table(
        report.Column("system", 22, "<"),
        report.Column("refused after B", 16, "<"),
        report.Column("refused while B holds", 22, "<"),
        report.Column("how", align="<", pad=False),
        indent="  ",
    )
    print("\nstale check: A takes a job, loses it, B takes it and finishes; A then completes late")
    print(table.header())
    for name, check in checks:
        try:
            after, during, how = check()
            print(table.row(name, "yes" if after else "no", "yes" if during else "no", how))
        except Exception as exc:
            print(table.row(name, "error", "error", f"{type(exc).__name__}: {exc}"))
    print(
        "  'refused': A's completion had no effect and B's stands (B's completion accepted, the result "
        "B's where the system stores one)"
    )


# -- main ---------------------------------------------------------------------------------------


def available_systems() -> tuple[list[str], list[str]]:
    """The systems whose package imports here, and why the others were dropped."""
    modules = {
        "fencing-async": ("greenlet", "asyncpg", "fencing.asyncio"),
        "huey": ("huey",),
        "persist-queue": ("persistqueue",),
        "litequeue": ("litequeue",),
        "procrastinate": ("procrastinate",),
        "pgqueuer": ("pgqueuer.queries",),
        "oban": ("oban._query",),
    }
    ok, dropped = ["fencing"], []
    for name, needed in modules.items():
        try:
            for module in needed:
                __import__(module)
            ok.append(name)
        except Exception as exc:
            dropped.append(f"{name} ({type(exc).__name__}: {exc})")
    return ok, dropped


def persist_queue_synchronous(workdir: str) -> str:
    path = os.path.join(workdir, "pq-probe")
    q = persist_queue(path)
    value = q._getter.execute("PRAGMA synchronous").fetchone()[0]
    q.close()
    shutil.rmtree(path, ignore_errors=True)
    return {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(value, str(value))


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,postgresql", help="sqlite,postgresql (default both)")
    parser.add_argument(
        "--systems",
        default="fencing,fencing-async,huey,persist-queue,litequeue,procrastinate,pgqueuer,oban",
        help="which systems to run (default: all that import)",
    )
    parser.add_argument(
        "--sizes",
        default="1000,10000,100000",
        type=cli.int_set,
        help="backlogs N (default 1000,10000,100000)",
    )
    cli.add_processes(parser, help="worker process counts (default 1,4)")
    parser.add_argument("--cycles", type=int, default=500, help="jobs measured one at a time (default 500)")
    parser.add_argument(
        "--batched-cycles", type=int, default=2000, help="jobs measured in batches (default 2000)"
    )
    cli.add_repeat(parser, help="interleaved repetitions; medians reported (default {default})")
    cli.add_dir(parser)
    parser.add_argument(
        "--postgresql-url", default=DEFAULT_URL, help=f"server to use (default {DEFAULT_URL})"
    )
    parser.add_argument("--database", default="bench_peers", help="dedicated database, created and dropped")
    stale = parser.add_mutually_exclusive_group()
    stale.add_argument(
        "--stale-check", dest="stale", action="store_true", default=True, help="(default) run it"
    )
    stale.add_argument("--no-stale-check", dest="stale", action="store_false", help="skip the stale check")
    stale.add_argument("--stale-check-only", action="store_true", help="only the stale check")
    args = parser.parse_args(argv)
    args.backends = [b for b in ("sqlite", "postgresql") if b in args.backends.split(",")]
    ok, dropped = available_systems()
    args.systems = [s for s in args.systems.split(",") if s in ok]
    if not args.backends or not args.sizes or min(args.processes) < 1 or args.repeat < 1:
        parser.error("need a backend, a size, processes >= 1 and --repeat >= 1")

    versions = env.versions(*VERSIONS, missing="not installed")
    print(
        f"fencing vs job queues: sizes {','.join(map(str, args.sizes))}, processes "
        f"{','.join(map(str, args.processes))}, C={args.cycles} (batched {args.batched_cycles}), "
        f"R={args.repeat}; {versions['cpus']} CPUs"
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "cpus"))
    if dropped:
        print("  dropped (does not import): " + "; ".join(dropped))
    if not HAS_STEP:
        print("  fencing has no JobStore.complete_and_claim_next here: no 'step' mode")
    with db.workdir("bench-peers-", args.dir or os.getcwd()) as workdir:
        bench(args, workdir)
    return 0


def bench(args: argparse.Namespace, workdir: str) -> None:
    """The measurements, then the stale check, with what they need opened and closed."""
    pg: Postgres | None = None
    workers: Pool | None = None
    runs: dict[Any, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    try:
        if "sqlite" in args.backends:
            print(
                f"  sqlite {sqlite3.sqlite_version} in {workdir}: persist-queue's connection reads "
                f"synchronous={persist_queue_synchronous(workdir)}"
            )
        if "postgresql" in args.backends:
            pg = Postgres(
                args.postgresql_url, args.database, [s for s, _, _ in PG_SYSTEMS if s in args.systems]
            )
            print("  " + ", ".join(f"{k}: {v}" for k, v in pg.info().items()), flush=True)
        if not args.stale_check_only:
            workers = Pool(
                worker,
                (),
                args.processes,
                timeout=BARRIER_TIMEOUT + 600,
                ready_timeout=120,
                name="peers",
                limit=6,
            )
            if "sqlite" in args.backends:
                bench_sqlite(args, workers, workdir, runs)
            if pg is not None:
                bench_postgresql(args, workers, pg, runs)
            print_tables(runs, args)
            print(f"\n{time.perf_counter() - started:.0f} s")
        if args.stale or args.stale_check_only:
            stale_check(args, workdir, pg)
    finally:
        if workers is not None:
            workers.close()
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.close()


if __name__ == "__main__":
    sys.exit(main())
