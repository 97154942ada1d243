"""Pickup latency side by side: from an enqueue to the moment each system's own worker starts the job.

What is measured
----------------
One idle worker process of each system (its own runtime, one job at a time) waits for work;
this process enqueues ``--jobs`` jobs one at a time through the system's own API, each
``--gap`` seconds (default 0.1) after the worker started the one before (Graphile Worker's
``perfTest/latencyTest.js`` shape). A job's latency runs from just before its enqueue is called
(its commit included) to the first line of the job's function, which appends its id and
``CLOCK_MONOTONIC`` (``time.monotonic_ns()``; Node's ``process.hrtime.bigint()`` reads the same
clock on Linux) to a file: one clock for every process of the machine. p50, p99 and max.

How each worker hears of a new job, at its defaults: fencing on PostgreSQL ``LISTEN``/``NOTIFY``
from the enqueue's own statement, on SQLite the file's ``PRAGMA data_version`` watched every
2 ms, on MariaDB its looks (backoff 10 ms to 0.5 s); procrastinate, pgqueuer and Graphile Worker
``LISTEN``/``NOTIFY``; Celery Redis ``BRPOP``. Two more of fencing's: ``postgresql-poll``, the
fallback where ``LISTEN`` cannot work (PgBouncer in transaction mode; here the pg8000 driver,
which hears no notifications): looks backing off to 0.5 s; and ``sqlite-here``, the worker
on a thread of the enqueuing process, woken by the enqueue itself (the table's bell).

Peers as in ``benchmarks/worker_peers.py`` (their own venv; ``--graphile DIR`` with
``node_modules/graphile-worker``)::

    python benchmarks/worker_latency.py --jobs 300 --graphile /tmp/graphile
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_peers import (
    MARIADB,
    PG,
    REDIS,
    fencing_engine,
    fresh_database,
    procrastinate_app,
    spawned,
    stop,
)

import fencing

TABLE = "bench_latency_jobs"


def started(log: str, job_id: str) -> None:
    """The first line of every Python system's job function."""
    with open(log, "a") as out:
        out.write(f"{job_id} {time.monotonic_ns()}\n")


# -- the workers (each a process of its own) ------------------------------------------------------


def engine_of(backend: str, directory: str) -> sa.Engine:
    """fencing's engine; ``postgresql-poll`` on pg8000 (no notifications: it polls), and
    ``sqlite-here`` on the one SQLite file."""
    if backend == "postgresql-poll":
        return sa.create_engine(PG.replace("postgresql://", "postgresql+pg8000://"))
    return fencing_engine("sqlite" if backend == "sqlite-here" else backend, directory)


def fencing_worker(backend: str, directory: str, log: str, front: str) -> None:
    table = fencing.jobs_table(sa.MetaData(), TABLE)
    if front == "thread":
        store = fencing.JobStore(engine_of(backend, directory), table)
        fencing.Worker(store, lambda job: started(log, job.job_id), ttl=30.0).run()
        return
    from sqlalchemy.ext.asyncio import create_async_engine

    from fencing.asyncio import AsyncJobStore, AsyncWorker

    async def record(job: Any) -> None:
        started(log, job.job_id)

    async def main() -> None:
        if backend == "sqlite":
            engine = fencing.asyncio.create_sqlite_engine(
                os.path.join(directory, "fencing.db"), durability="normal"
            )
        elif backend == "postgresql":
            engine = create_async_engine(PG.replace("postgresql://", "postgresql+asyncpg://"))
        else:
            engine = create_async_engine(MARIADB.replace("+pymysql", "+asyncmy"))
        store = AsyncJobStore(engine, table)
        await AsyncWorker(store, record, ttl=30.0).run()

    asyncio.run(main())


def procrastinate_worker(log: str) -> None:
    app = procrastinate_app()

    @app.task(name="record")
    def record(job_id: str) -> None:
        started(log, job_id)

    async def go() -> None:
        async with app.open_async():
            await app.run_worker_async(concurrency=1, install_signal_handlers=False)

    asyncio.run(go())


def pgqueuer_worker(log: str) -> None:
    async def go() -> None:
        import psycopg
        from pgqueuer import QueueManager
        from pgqueuer.queries import Queries

        conn = await psycopg.AsyncConnection.connect(PG, autocommit=True)
        manager = QueueManager(Queries.from_psycopg_connection(conn))

        @manager.entrypoint("record")
        async def record(job: Any) -> None:
            started(log, job.payload.decode())

        await manager.run()  # its defaults

    asyncio.run(go())


def celery_app(log: str) -> Any:
    from celery import Celery

    app = Celery("latency", broker=REDIS)
    app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)

    @app.task(name="record", ignore_result=True)
    def record(job_id: str) -> None:
        started(log, job_id)

    return app


def celery_worker(log: str) -> None:
    celery_app(log).worker_main(
        [
            "worker",
            "-P",
            "solo",
            "-l",
            "WARNING",
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
        ]
    )


GRAPHILE_RUN = """
const fs = require("fs");
const { run } = require("graphile-worker");
run({
  connectionString: process.env.PG,
  concurrency: 1,
  taskList: {
    record: async (payload) => {
      fs.appendFileSync(process.env.LOG, `${payload.id} ${process.hrtime.bigint()}\\n`);
    },
  },
}).catch((e) => { console.error(e); process.exit(1); });
"""

GRAPHILE_MIGRATE = """
const { runMigrations } = require("graphile-worker");
runMigrations({ connectionString: process.env.PG }).catch((e) => { console.error(e); process.exit(1); });
"""


# -- the systems: how to prepare, start a worker and enqueue one job -------------------------------


class System:
    def __init__(
        self, name: str, prepare: Callable[[], Any], start: Callable[[], Any], enqueuer: Callable[[], Any]
    ):
        self.name, self.prepare, self.start, self.enqueuer = name, prepare, start, enqueuer
        #: set by a worker in this process once its job started: waited for without polling
        #: the log, whose reads would take the GIL the worker's thread needs
        self.arrived: threading.Event | None = None


def systems(args: argparse.Namespace, directory: str, log: str) -> list[System]:
    found: list[System] = []
    for name in args.systems:
        if name.startswith("fencing"):
            front = "async" if name.endswith("async") else "thread"
            for backend in args.backends:
                if backend == "sqlite-here":
                    if front == "thread":
                        found.append(same_process_system(directory, log))
                    continue
                if backend == "postgresql-poll" and front == "async":
                    continue  # pg8000 has no async mode
                found.append(System(
                    f"fencing {'AsyncWorker' if front == 'async' else 'Worker'} {backend}",
                    lambda b=backend: fencing_prepare(b, directory),
                    lambda b=backend, f=front: spawned(fencing_worker, b, directory, log, f),
                    lambda b=backend: fencing_enqueuer(b, directory),
                ))  # fmt: skip
        elif name == "procrastinate":
            found.append(System(
                "procrastinate postgresql", procrastinate_prepare, lambda: spawned(procrastinate_worker, log),
                procrastinate_enqueuer,
            ))  # fmt: skip
        elif name == "pgqueuer":
            found.append(System(
                "pgqueuer postgresql", pgqueuer_prepare, lambda: spawned(pgqueuer_worker, log),
                pgqueuer_enqueuer,
            ))  # fmt: skip
        elif name == "celery":
            found.append(System(
                "Celery redis", celery_prepare, lambda: spawned(celery_worker, log),
                lambda: celery_enqueuer(log),
            ))  # fmt: skip
        elif name == "graphile" and args.graphile:
            found.append(graphile_system(Path(args.graphile), log))
    return found


def fencing_prepare(backend: str, directory: str) -> None:
    if backend.startswith("postgresql"):
        fresh_database()
    engine = engine_of(backend, directory)
    table = fencing.jobs_table(sa.MetaData(), TABLE)
    table.drop(engine, checkfirst=True)
    fencing.JobStore(engine, table).create_table()
    engine.dispose()


def fencing_enqueuer(backend: str, directory: str) -> Callable[[str], Any]:
    store = fencing.JobStore(engine_of(backend, directory), fencing.jobs_table(sa.MetaData(), TABLE))
    return lambda job_id: store.enqueue(job_id)


def same_process_system(directory: str, log: str) -> System:
    """fencing's Worker on a thread of this process, which enqueues on the same store."""
    store: list[fencing.JobStore] = []
    arrived = threading.Event()

    def run(job: fencing.Job) -> None:
        started(log, job.job_id)
        arrived.set()

    def start() -> Any:
        engine = engine_of("sqlite-here", directory)
        store.append(fencing.JobStore(engine, fencing.jobs_table(sa.MetaData(), TABLE)))
        worker = fencing.Worker(store[0], run, ttl=30.0)
        thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False}, daemon=True)
        thread.start()
        return _Stoppable(worker, thread)

    system = System(
        "fencing Worker sqlite (same process)", lambda: fencing_prepare("sqlite", directory), start,
        lambda: (lambda job_id: store[0].enqueue(job_id)),
    )  # fmt: skip
    system.arrived = arrived
    return system


class _Stoppable:
    """A worker on a thread, stopped as ``stop`` stops a process."""

    def __init__(self, worker: fencing.Worker, thread: threading.Thread) -> None:
        self.worker, self.thread = worker, thread

    def terminate(self) -> None:
        self.worker.stop()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def procrastinate_prepare() -> None:
    fresh_database()
    app = procrastinate_app()

    async def go() -> None:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    asyncio.run(go())


def procrastinate_enqueuer() -> Callable[[str], Any]:
    app = procrastinate_app()

    @app.task(name="record")
    def record(job_id: str) -> None:
        return None

    app.open()
    return lambda job_id: record.defer(job_id=job_id)


def pgqueuer_prepare() -> None:
    fresh_database()

    async def go() -> None:
        import psycopg
        from pgqueuer.queries import Queries

        conn = await psycopg.AsyncConnection.connect(PG, autocommit=True)
        await Queries.from_psycopg_connection(conn).install()
        await conn.close()

    asyncio.run(go())


def pgqueuer_enqueuer() -> Callable[[str], Any]:
    import psycopg
    from pgqueuer.db import SyncPsycopgDriver
    from pgqueuer.queries import SyncQueries

    conn = psycopg.connect(PG, autocommit=True)
    queries = SyncQueries(SyncPsycopgDriver(conn))
    return lambda job_id: queries.enqueue("record", job_id.encode())


def celery_prepare() -> None:
    import redis

    redis.Redis.from_url(REDIS).flushdb()


def celery_enqueuer(log: str) -> Callable[[str], Any]:
    app = celery_app(log)
    record = app.tasks["record"]
    return lambda job_id: record.apply_async((job_id,))


def graphile_system(scripts: Path, log: str) -> System:
    env = {**os.environ, "PG": PG, "LOG": log}
    (scripts / "latency_run.js").write_text(textwrap.dedent(GRAPHILE_RUN))
    (scripts / "latency_migrate.js").write_text(textwrap.dedent(GRAPHILE_MIGRATE))
    node = shutil.which("node") or "node"

    def prepare() -> None:
        fresh_database()
        subprocess.run([node, "latency_migrate.js"], cwd=scripts, env=env, check=True)

    def enqueuer() -> Callable[[str], Any]:
        import psycopg

        conn = psycopg.connect(PG, autocommit=True)
        add = "SELECT graphile_worker.add_job('record', json_build_object('id', %s::text))"
        return lambda job_id: conn.execute(add, (job_id,))

    return System(
        "Graphile Worker postgresql", prepare,
        lambda: subprocess.Popen([node, "latency_run.js"], cwd=scripts, env=env, stdout=subprocess.DEVNULL),
        enqueuer,
    )  # fmt: skip


# -- the run ------------------------------------------------------------------------------------


def measure(system: System, log: str, jobs: int, gap: float) -> list[float]:
    Path(log).write_text("")
    system.prepare()
    worker = system.start()
    enqueue = system.enqueuer()
    try:
        enqueue("warm-up")  # the worker is up and has run a job: it is idle and waiting now
        offset = _wait_for(log, 0, "warm-up", 120.0)[0]
        time.sleep(1.0)
        latencies = []
        for i in range(jobs):
            time.sleep(gap)
            job_id = f"job-{i}"
            if system.arrived is not None:
                system.arrived.clear()
            before = time.monotonic_ns()
            enqueue(job_id)
            if system.arrived is not None:
                system.arrived.wait(30.0)
            offset, at = _wait_for(log, offset, job_id, 30.0)
            latencies.append((at - before) / 1e6)
        return latencies
    finally:
        stop([worker])


def _wait_for(log: str, offset: int, job_id: str, timeout: float) -> tuple[int, int]:
    """Read the log from ``offset`` until ``job_id``'s line: the new offset and its instant."""
    ends = time.monotonic() + timeout
    with open(log, "rb") as lines:
        while True:
            lines.seek(offset)
            chunk = lines.read()
            end = chunk.rfind(b"\n") + 1
            for line in chunk[:end].decode().splitlines():
                name, at = line.split()
                if name == job_id:
                    return offset + end, int(at)
            offset += end
            if time.monotonic() > ends:
                raise TimeoutError(f"{job_id} never started")
            time.sleep(0.0002)


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {statistics.median(ordered):7.2f} ms   p99 {p99:7.2f} ms   max {ordered[-1]:7.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--gap", type=float, default=0.1)
    parser.add_argument("--graphile", help="a directory with node_modules/graphile-worker")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["fencing", "fencing-async", "procrastinate", "pgqueuer", "graphile", "celery"],
    )
    parser.add_argument(
        "--backends", nargs="+", default=["postgresql", "postgresql-poll", "sqlite", "sqlite-here", "mariadb"]
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        log = os.path.join(directory, "starts.log")
        for system in systems(args, directory, log):
            latencies = measure(system, log, args.jobs, args.gap)
            print(f"{system.name:32} {args.jobs} jobs   {summary(latencies)}", flush=True)


if __name__ == "__main__":
    main()
