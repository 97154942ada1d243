"""Pickup latency: from an enqueue to the moment an idle worker has the job's lease.

What is measured
----------------
One idle worker waits for work (``claim_next(..., wait=...)``); one enqueuer enqueues
``--jobs`` jobs one at a time, each ``--gap`` seconds (default 0.1) after the worker took the
one before, so the worker is idle and waiting when it comes (the shape of Graphile Worker's
``perfTest/latencyTest.js``; with no gap the worker's own claim after its last job finds most
jobs, whatever wakes it). A job's latency runs from just before its
``enqueue()`` is called (its round trip and commit included) to the instant the worker's
claim returned its lease (where a worker would call the job's function), both read on
``time.monotonic()``, one clock for every process of this machine. p50, p99 and max per mode:

``same process``
    the worker is a thread of the enqueuer's process: woken by the process's bell.
``other process``
    the worker is a process of its own: on PostgreSQL woken by ``NOTIFY`` (the enqueue
    notifies because someone listens), on SQLite by its process's watch of the file (``PRAGMA
    data_version``, every 2 ms); on MariaDB found by its looks (backoff from 10 ms to
    ``WAIT_POLL``, 0.5 s).
``other process, polling``
    PostgreSQL without notifications (as behind PgBouncer in transaction mode): the looks alone.

``--notify-cost`` measures instead what the notification costs an enqueue: 8 threads
enqueueing into PostgreSQL as the store did before notifications (never asking), with nobody
listening (the enqueue that asks finds nobody; the next ones within 0.1 s ask nothing), and
with a worker waiting (every enqueue notifies), as jobs/s and as ratios to the first.

``--throughput`` drains ``--jobs`` no-op jobs, enqueued beforehand, with ``--processes``
processes of ``fencing.Worker`` (``--fronts thread``) or ``fencing.asyncio.AsyncWorker``
(``async``) of ``--concurrency`` slots each (Graphile Worker's perfTest shape): jobs/s from
the workers' start to the last completion. The slots that finish together store their jobs
and claim their next in one transaction (the worker's group commit).

Run::

    python benchmarks/workers.py --backends sqlite postgresql mariadb --jobs 1000
    python benchmarks/workers.py --notify-cost
    python benchmarks/workers.py --throughput --jobs 20000 --processes 4 --concurrency 8 --fronts thread async
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fencing
from fencing._store import announcer

URLS = {
    "postgresql": os.environ.get("FENCING_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mariadb": os.environ.get("FENCING_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}
TABLE = "bench_pickup_jobs"


def engine_for(backend: str, directory: str) -> sa.Engine:
    if backend == "sqlite":
        return fencing.create_sqlite_engine(os.path.join(directory, "pickup.db"), durability="normal")
    return sa.create_engine(URLS[backend])


def store_for(engine: sa.Engine) -> fencing.JobStore:
    return fencing.JobStore(engine, fencing.jobs_table(sa.MetaData(), TABLE))


def fresh(backend: str, directory: str) -> None:
    engine = engine_for(backend, directory)
    table = fencing.jobs_table(sa.MetaData(), TABLE)
    table.drop(engine, checkfirst=True)
    fencing.JobStore(engine, table).create_table()
    engine.dispose()


def work(backend: str, directory: str, jobs: int, taken: Any, ready: Any) -> None:
    """The worker: claim, say when, complete; ``jobs`` times."""
    engine = engine_for(backend, directory)
    store = store_for(engine)
    ready.set()
    done = 0
    while done < jobs:
        for lease in store.claim_next("worker", ttl=30.0, wait=30.0):
            at = time.monotonic()
            taken.put((lease.job_id, at))
            store.complete(lease, "ok")
            done += 1
    engine.dispose()


def measure(backend: str, directory: str, jobs: int, mode: str, gap: float) -> list[float]:
    fresh(backend, directory)
    engine = engine_for(backend, directory)
    store = store_for(engine)
    asks = announcer.Announcer.asks
    if mode == "polling":  # this process's enqueues never notify
        announcer.Announcer.asks = lambda self: False  # type: ignore[method-assign]
    if mode == "same process":
        import queue

        taken: Any = queue.Queue()
        ready: Any = threading.Event()
        worker: Any = threading.Thread(
            target=work, args=(backend, directory, jobs, taken, ready), daemon=True
        )
    else:
        context = multiprocessing.get_context("spawn")
        taken, ready = context.Queue(), context.Event()
        worker = context.Process(target=work, args=(backend, directory, jobs, taken, ready))
    worker.start()
    ready.wait(60)
    time.sleep(1.0)  # it waits now
    latencies = []
    for i in range(jobs):
        time.sleep(gap)
        job_id = f"job-{i}"
        started = time.monotonic()
        store.enqueue(job_id)
        got, at = taken.get(timeout=60)
        assert got == job_id, (got, job_id)
        latencies.append(at - started)
    worker.join(60)
    engine.dispose()
    announcer.Announcer.asks = asks  # type: ignore[method-assign]
    return latencies


def summary(latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"p50 {statistics.median(ms):7.2f} ms   p99 {p99:7.2f} ms   max {ms[-1]:7.2f} ms"


def drain(backend: str, directory: str, count: int, processes: int, concurrency: int, front: str) -> float:
    """``count`` no-op jobs, enqueued beforehand (not timed), drained by ``processes`` processes
    of ``fencing.Worker`` (``front``: ``thread``) or ``fencing.asyncio.AsyncWorker``
    (``async``) with ``concurrency`` slots each: jobs/s from their start to the last job's
    completion."""
    fresh(backend, directory)
    engine = engine_for(backend, directory)
    store = store_for(engine)
    with engine.begin() as conn:
        for i in range(count):
            store.enqueue(f"job-{i:07d}", ready_at=0, conn=conn)
    context = multiprocessing.get_context("spawn")
    started = time.monotonic()
    workers = [
        context.Process(target=RUNNERS[front], args=(backend, directory, concurrency))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    done = sa.select(sa.func.count()).select_from(store._ctx.table).where(store._ctx.table.c.done == 1)
    while True:
        with engine.connect() as conn:
            if conn.execute(done).scalar_one() >= count:
                break
        time.sleep(0.05)
    took = time.monotonic() - started
    for worker in workers:
        worker.terminate()
        worker.join(30)
    engine.dispose()
    return count / took


def run_worker(backend: str, directory: str, concurrency: int) -> None:
    engine = engine_for(backend, directory)
    fencing.Worker(store_for(engine), lambda job: None, concurrency=concurrency, ttl=30.0).run()


#: each server's async driver (the async front's throughput)
ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "mariadb": "mysql+asyncmy"}


def run_async_worker(backend: str, directory: str, concurrency: int) -> None:
    import asyncio

    import fencing.asyncio

    async def nothing(job: fencing.asyncio.AsyncJob) -> None:
        return None

    async def main() -> None:
        if backend == "sqlite":
            engine = fencing.asyncio.create_sqlite_engine(
                os.path.join(directory, "pickup.db"), durability="normal"
            )
        else:
            url = sa.make_url(URLS[backend])
            engine = create_async_engine(url.set(drivername=ASYNC_DRIVERS[backend]))
        store = fencing.asyncio.AsyncJobStore(engine, fencing.jobs_table(sa.MetaData(), TABLE))
        await fencing.asyncio.AsyncWorker(store, nothing, concurrency=concurrency, ttl=30.0).run()

    asyncio.run(main())


RUNNERS = {"thread": run_worker, "async": run_async_worker}


def notify_cost(seconds: float) -> None:
    engine = sa.create_engine(URLS["postgresql"], pool_size=10)
    table = fencing.jobs_table(sa.MetaData(), TABLE)
    table.drop(engine, checkfirst=True)
    store = fencing.JobStore(engine, table)
    store.create_table()

    def rate() -> float:
        stop = time.monotonic() + seconds
        counts = [0] * 8

        def enqueue(n: int) -> None:
            while time.monotonic() < stop:
                store.enqueue(uuid.uuid4().hex)
                counts[n] += 1

        threads = [threading.Thread(target=enqueue, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / seconds

    listening = fencing.JobStore(engine, fencing.jobs_table(sa.MetaData(), "bench_nobody_enqueues"))
    listening.create_table()
    asks = announcer.Announcer.asks
    for _ in range(3):
        announcer.Announcer.asks = lambda self: False  # type: ignore[method-assign]
        never = rate()  # the enqueue without notifications: the store before them
        announcer.Announcer.asks = asks  # type: ignore[method-assign]
        nobody = rate()
        waiter = threading.Thread(target=lambda: listening.claim_next("w", ttl=30.0, wait=seconds + 1.0))
        waiter.start()
        time.sleep(0.3)
        someone = rate()
        waiter.join()
        print(f"8 threads enqueueing, jobs/s: never notifying {never:6.0f}   nobody listens {nobody:6.0f} "
              f"({nobody / never:.2f})   someone listens {someone:6.0f} ({someone / never:.2f})")  # fmt: skip
    table.drop(engine)
    listening._ctx.table.drop(engine)
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql", "mariadb"])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--gap", type=float, default=0.1)
    parser.add_argument("--notify-cost", action="store_true")
    parser.add_argument("--throughput", action="store_true", help="drain --jobs with Worker processes")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--fronts", nargs="+", choices=sorted(RUNNERS), default=["thread"])
    args = parser.parse_args()
    if args.notify_cost:
        notify_cost(args.seconds)
        return
    if args.throughput:
        with tempfile.TemporaryDirectory() as directory:
            for backend in args.backends:
                for front in args.fronts:
                    rate = drain(backend, directory, args.jobs, args.processes, args.concurrency, front)
                    name = {"thread": "Worker", "async": "AsyncWorker"}[front]
                    print(f"{backend:10} {name:11}, {args.processes} processes x {args.concurrency} slots, "
                          f"{args.jobs} no-op jobs: {rate:8.0f} jobs/s", flush=True)  # fmt: skip
        return
    with tempfile.TemporaryDirectory() as directory:
        for backend in args.backends:
            modes = ["same process", "other process"] + (["polling"] if backend == "postgresql" else [])
            for mode in modes:
                latencies = measure(backend, directory, args.jobs, mode, args.gap)
                print(f"{backend:10} {mode:16} {args.jobs} jobs   {summary(latencies)}", flush=True)


if __name__ == "__main__":
    main()
