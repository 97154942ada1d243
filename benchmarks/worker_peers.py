"""Workers side by side: each system's own worker runtime draining the same backlog of no-op jobs.

What is measured
----------------
``--jobs`` no-op jobs are enqueued beforehand with each system's own API (not timed); then
``--processes`` worker processes of that system, each ``--concurrency`` at once, are started
together, and the figure is jobs/s from their start to the moment the last job is done, as
the system itself records it (polled every 50 ms). Graphile Worker's ``perfTest`` shape
(4 x 8, run.js and its job count); its own published figures are not this machine's.

Systems and what "done" is (each at its defaults, durability named):

``fencing Worker`` / ``fencing AsyncWorker`` (PostgreSQL, SQLite, MariaDB)
    ``fencing worker``'s runtime: slots claim (woken by enqueues), run, and store each job's
    result fenced, the slots that finish together in one transaction. Done: ``done = 1``.
    PostgreSQL ``synchronous_commit`` on; SQLite ``durability="normal"`` (WAL, NORMAL).
``procrastinate`` 3.10 (PostgreSQL): ``app.run_worker_async(concurrency=C)``; done: the job's
    row ``status = 'succeeded'`` (kept).
``pgqueuer`` 1.6 (PostgreSQL): ``QueueManager.run(batch_size=C/2, max_concurrent_tasks=C)``
    (its per-process cap; an entrypoint's ``concurrency_limit`` is global); done: the job's row
    deleted (its log row written, completions flushed in batches).
``Graphile Worker`` 0.18 (npm, PostgreSQL): ``run({concurrency: C})`` in a Node process; done:
    the job's row deleted.
``Celery`` 5.7 with the local Redis as broker: ``-P threads -c C``, acks on receipt (its
    default), no result backend; done: a Redis counter the task increments (``INCR``).
``huey`` 3.5 (SQLite, ``SqliteHuey``, ``fsync=False``: WAL, NORMAL): its consumer with ``C``
    thread workers; done: the task's result stored (huey's default).

Install the peers in a venv of their own (``benchmarks/requirements-peers.txt`` plus
``celery[redis]``) and Graphile Worker with npm (``--graphile DIR``: a directory holding
``node_modules/graphile-worker``)::

    python benchmarks/worker_peers.py --jobs 20000 --processes 4 --concurrency 8 --graphile /tmp/graphile
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fencing

PG_ADMIN = os.environ.get("FENCING_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
DATABASE = "bench_worker_peers"
PG = PG_ADMIN.rsplit("/", 1)[0] + "/" + DATABASE
MARIADB = os.environ.get("FENCING_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS = os.environ.get("FENCING_REDIS_URL", "redis://127.0.0.1:6379/13")


def fresh_database() -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DATABASE}")


def pg_count(sql: str) -> int:
    import psycopg

    with psycopg.connect(PG, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0


# -- fencing --------------------------------------------------------------------------------------


def fencing_engine(backend: str, directory: str) -> sa.Engine:
    if backend == "sqlite":
        return fencing.create_sqlite_engine(os.path.join(directory, "fencing.db"), durability="normal")
    return sa.create_engine(
        PG.replace("postgresql://", "postgresql+psycopg://") if backend == "postgresql" else MARIADB
    )


def fencing_prepare(backend: str, directory: str, jobs: int) -> None:
    engine = fencing_engine(backend, directory)
    table = fencing.jobs_table(sa.MetaData(), "bench_worker_jobs")
    table.drop(engine, checkfirst=True)
    store = fencing.JobStore(engine, table)
    store.create_table()
    with engine.begin() as conn:
        for i in range(jobs):
            store.enqueue(f"job-{i:07d}", ready_at=0, conn=conn)
    engine.dispose()


def fencing_done(backend: str, directory: str) -> int:
    engine = fencing_engine(backend, directory)
    table = fencing.jobs_table(sa.MetaData(), "bench_worker_jobs")
    with engine.connect() as conn:
        done = conn.execute(
            sa.select(sa.func.count()).select_from(table).where(table.c.done == 1)
        ).scalar_one()
    engine.dispose()
    return int(done)


def fencing_worker(backend: str, directory: str, concurrency: int) -> None:
    store = fencing.JobStore(
        fencing_engine(backend, directory), fencing.jobs_table(sa.MetaData(), "bench_worker_jobs")
    )
    fencing.Worker(store, lambda job: None, concurrency=concurrency, ttl=30.0).run()


def fencing_async_worker(backend: str, directory: str, concurrency: int) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    import fencing.asyncio

    async def nothing(job: Any) -> None:
        return None

    async def main() -> None:
        if backend == "sqlite":
            path = os.path.join(directory, "fencing.db")
            engine = fencing.asyncio.create_sqlite_engine(path, durability="normal")
        elif backend == "postgresql":
            engine = create_async_engine(PG.replace("postgresql://", "postgresql+asyncpg://"))
        else:
            engine = create_async_engine(MARIADB.replace("+pymysql", "+asyncmy"))
        table = fencing.jobs_table(sa.MetaData(), "bench_worker_jobs")
        store = fencing.asyncio.AsyncJobStore(engine, table)
        await fencing.asyncio.AsyncWorker(store, nothing, concurrency=concurrency, ttl=30.0).run()

    asyncio.run(main())


# -- procrastinate ------------------------------------------------------------------------------


def procrastinate_app() -> Any:
    import logging

    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.ERROR)
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=PG))

    @app.task(name="noop")
    def noop(i: int) -> None:
        return None

    return app


def procrastinate_prepare(jobs: int) -> None:
    app = procrastinate_app()

    async def go() -> None:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            task = app.tasks["noop"]
            for start in range(0, jobs, 1000):
                await task.batch_defer_async(*({"i": i} for i in range(start, min(jobs, start + 1000))))

    asyncio.run(go())


def procrastinate_worker(concurrency: int) -> None:
    app = procrastinate_app()

    async def go() -> None:
        async with app.open_async():
            await app.run_worker_async(concurrency=concurrency, install_signal_handlers=False)

    asyncio.run(go())


# -- pgqueuer -----------------------------------------------------------------------------------


def pgqueuer_prepare(jobs: int) -> None:
    async def go() -> None:
        import psycopg
        from pgqueuer.queries import Queries

        conn = await psycopg.AsyncConnection.connect(PG, autocommit=True)
        queries = Queries.from_psycopg_connection(conn)
        await queries.install()
        for start in range(0, jobs, 1000):
            count = min(jobs, start + 1000) - start
            await queries.enqueue(["noop"] * count, [None] * count, [0] * count)
        await conn.close()

    asyncio.run(go())


def pgqueuer_worker(concurrency: int) -> None:
    async def go() -> None:
        import psycopg
        from pgqueuer import QueueManager
        from pgqueuer.queries import Queries

        conn = await psycopg.AsyncConnection.connect(PG, autocommit=True)
        manager = QueueManager(Queries.from_psycopg_connection(conn))

        @manager.entrypoint("noop")  # (its concurrency_limit is global, counted in the database)
        async def noop(job: Any) -> None:
            return None

        # at most ``concurrency`` jobs of this process at once (pgqueuer asks for twice the batch)
        await manager.run(batch_size=max(1, concurrency // 2), max_concurrent_tasks=max(2, concurrency))

    asyncio.run(go())


# -- Graphile Worker ----------------------------------------------------------------------------

GRAPHILE_RUN = """
const { run } = require("graphile-worker");
run({
  connectionString: process.env.PG,
  concurrency: Number(process.env.CONCURRENCY),
  noHandleSignals: false,
  pollInterval: 2000,
  taskList: { noop: async () => {} },
}).catch((e) => { console.error(e); process.exit(1); });
"""

GRAPHILE_PREPARE = """
const { runMigrations, makeWorkerUtils } = require("graphile-worker");
(async () => {
  await runMigrations({ connectionString: process.env.PG });
  const utils = await makeWorkerUtils({ connectionString: process.env.PG });
  const jobs = Number(process.env.JOBS);
  await utils.withPgClient((c) =>
    c.query(
      "select graphile_worker.add_jobs(array_agg(row('noop', json_build_object('i', i), " +
        "null, null, null, null, null, null)::graphile_worker.job_spec)) from generate_series(1, $1) i",
      [jobs]));
  await utils.release();
})().catch((e) => { console.error(e); process.exit(1); });
"""


# -- Celery ---------------------------------------------------------------------------------------


def celery_app() -> Any:
    import redis
    from celery import Celery

    app = Celery("bench", broker=REDIS)
    app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)
    counter = redis.Redis.from_url(REDIS)

    @app.task(name="noop", ignore_result=True)
    def noop(i: int) -> None:
        counter.incr("bench:done")

    return app


def celery_prepare(jobs: int) -> None:
    import redis

    redis.Redis.from_url(REDIS).flushdb()
    app = celery_app()
    noop = app.tasks["noop"]
    with app.producer_or_acquire() as producer:
        for i in range(jobs):
            noop.apply_async((i,), producer=producer)


def celery_worker(concurrency: int) -> None:
    app = celery_app()
    app.worker_main(
        ["worker", "-P", "threads", "-c", str(concurrency), "-l", "WARNING",
         "--without-heartbeat", "--without-mingle", "--without-gossip"]
    )  # fmt: skip


def celery_done() -> int:
    import redis

    return int(redis.Redis.from_url(REDIS).get("bench:done") or 0)


# -- huey ---------------------------------------------------------------------------------------


def huey_app(directory: str) -> Any:
    from huey import SqliteHuey

    huey = SqliteHuey("bench", filename=os.path.join(directory, "huey.db"), fsync=False)

    def noop(i: int) -> int:
        return i

    noop.__module__ = "bench"
    huey.bench_noop = huey.task(name="noop")(noop)
    return huey


def huey_prepare(directory: str, jobs: int) -> None:
    huey = huey_app(directory)
    for i in range(jobs):
        huey.bench_noop(i)


def huey_worker(directory: str, concurrency: int) -> None:
    import logging

    from huey.consumer import Consumer

    logging.getLogger("huey").setLevel(logging.ERROR)
    Consumer(huey_app(directory), workers=concurrency, worker_type="thread", periodic=False).run()


def huey_done(directory: str) -> int:
    return int(huey_app(directory).storage.result_store_size())


# -- the run ------------------------------------------------------------------------------------


def drain(
    name: str, jobs: int, processes: int, start: Any, done: Any, timeout: float = 600.0
) -> float | None:
    """Start ``processes`` workers (``start()`` -> a process or a Popen), wait until ``done()``
    reaches ``jobs``: jobs/s from the start, or None if it timed out."""
    began = time.monotonic()
    workers = [start() for _ in range(processes)]
    try:
        while done() < jobs:
            if time.monotonic() - began > timeout:
                print(f"{name}: timed out at {done()} of {jobs}", flush=True)
                return None
            time.sleep(0.05)
        return jobs / (time.monotonic() - began)
    finally:
        stop(workers)


def spawned(target: Any, *args: Any) -> Any:
    """A worker process running ``target(*args)``, started (``spawn``: a fresh interpreter)."""
    worker = multiprocessing.get_context("spawn").Process(target=target, args=args)
    worker.start()
    return worker


def stop(workers: list[Any]) -> None:
    """Terminate worker processes (``multiprocessing`` or ``subprocess``) and wait for them."""
    for worker in workers:
        worker.terminate()
    for worker in workers:
        if isinstance(worker, subprocess.Popen):
            worker.wait(30)
        else:
            worker.join(30)


class System:
    """One system's run: its name, where its jobs live, how to enqueue them (``prepare``), how
    to start one worker (``start``, returning a process) and how many jobs are done (``done``)."""

    def __init__(self, name: str, where: str, prepare: Any, start: Any, done: Any) -> None:
        self.name, self.where, self.prepare, self.start, self.done = name, where, prepare, start, done


def systems(args: argparse.Namespace, directory: str) -> list[System]:
    n, c = args.jobs, args.concurrency
    process = spawned

    def on_pg(prepare: Any) -> Any:
        return lambda: (fresh_database(), prepare())

    found: list[System] = []
    for system in args.systems:
        if system in ("fencing", "fencing-async"):
            runner = fencing_worker if system == "fencing" else fencing_async_worker
            name = "fencing Worker" if system == "fencing" else "fencing AsyncWorker"
            for backend in args.backends:
                prepare = lambda b=backend: fencing_prepare(b, directory, n)  # noqa: E731
                found.append(System(
                    name, backend, on_pg(prepare) if backend == "postgresql" else prepare,
                    lambda b=backend, r=runner: process(r, b, directory, c),
                    lambda b=backend: fencing_done(b, directory),
                ))  # fmt: skip
        elif system == "procrastinate":
            succeeded = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
            found.append(System(
                "procrastinate", "postgresql", on_pg(lambda: procrastinate_prepare(n)),
                lambda: process(procrastinate_worker, c), lambda q=succeeded: pg_count(q),
            ))  # fmt: skip
        elif system == "pgqueuer":
            found.append(System(
                "pgqueuer", "postgresql", on_pg(lambda: pgqueuer_prepare(n)),
                lambda: process(pgqueuer_worker, c), lambda: n - pg_count("SELECT count(*) FROM pgqueuer"),
            ))  # fmt: skip
        elif system == "graphile":
            if not args.graphile:
                print("graphile: --graphile DIR not given, skipped", flush=True)
                continue
            found.append(graphile_system(Path(args.graphile), n, c, on_pg))
        elif system == "celery":
            found.append(System(
                "Celery (Redis broker)", "redis", lambda: celery_prepare(n),
                lambda: process(celery_worker, c), celery_done,
            ))  # fmt: skip
        elif system == "huey":
            found.append(System(
                "huey", "sqlite", lambda: huey_prepare(directory, n),
                lambda: process(huey_worker, directory, c), lambda: huey_done(directory),
            ))  # fmt: skip
    return found


def graphile_system(scripts: Path, n: int, c: int, on_pg: Any) -> System:
    env = {**os.environ, "PG": PG, "JOBS": str(n), "CONCURRENCY": str(c)}
    (scripts / "prepare.js").write_text(textwrap.dedent(GRAPHILE_PREPARE))
    (scripts / "run.js").write_text(textwrap.dedent(GRAPHILE_RUN))
    node = shutil.which("node") or "node"
    left = "SELECT count(*) FROM graphile_worker._private_jobs"
    return System(
        "Graphile Worker", "postgresql",
        on_pg(lambda: subprocess.run([node, "prepare.js"], cwd=scripts, env=env, check=True)),
        lambda: subprocess.Popen([node, "run.js"], cwd=scripts, env=env, stdout=subprocess.DEVNULL),
        lambda: n - pg_count(left),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--graphile", help="a directory with node_modules/graphile-worker")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["fencing", "fencing-async", "procrastinate", "pgqueuer", "graphile", "celery", "huey"],
    )
    parser.add_argument("--backends", nargs="+", default=["postgresql", "sqlite", "mariadb"])
    args = parser.parse_args()
    n, p, c = args.jobs, args.processes, args.concurrency
    with tempfile.TemporaryDirectory() as directory:
        for system in systems(args, directory):
            system.prepare()
            rate = drain(system.name, n, p, system.start, system.done)
            shown = "-" if rate is None else f"{rate:8.0f}"
            print(f"{system.name:22} {system.where:11} {p} x {c}, {n} no-op jobs: {shown} jobs/s", flush=True)


if __name__ == "__main__":
    main()
