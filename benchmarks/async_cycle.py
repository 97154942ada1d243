"""The async store's worker cycle against the sync store's, side by side in one run.

``claim_next -> complete`` (``single``, two transactions per job) and ``claim_next(limit=100)
-> complete_many`` (``batched``) on each database, by one worker: the sync ``JobStore`` on
the sync driver, and ``AsyncJobStore`` on the asyncio driver (aiosqlite, asyncpg, asyncmy)
as one task and as 4 tasks of one loop. Each repetition refills the table with N ready jobs
(one bulk INSERT, not timed) and runs every configuration once, interleaved; the table
shows the median jobs/s and, per repetition, the ratio to the sync store's single worker.
What the async front costs: SQLAlchemy's greenlet bridge around the same units, a task per
operation (run to its end on cancellation), and the asyncio driver itself.

    python benchmarks/async_cycle.py [--jobs 2000] [--repeat 3] [--db sqlite,postgresql,mariadb]

SQLite runs at the library's default durability (FULL) in a fresh file under ``--dir``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy
from harness import cli, report
from harness.db import URLS, async_engine, insert_ids, workdir
from sqlalchemy.ext.asyncio import AsyncEngine

import fencing
import fencing.asyncio
from fencing.asyncio import AsyncJobStore

TTL = 600.0
BATCH = 100


def fill(engine: sqlalchemy.Engine, jobs: int) -> None:
    with engine.begin() as conn:
        conn.execute(fencing.jobs.delete())
        insert_ids(conn, fencing.jobs, (f"j{i:07}" for i in range(jobs)))


def sync_run(store: fencing.JobStore, batched: bool) -> int:
    done = 0
    while leases := store.claim_next("w", ttl=TTL, limit=BATCH if batched else 1):
        if batched:
            done += sum(map(bool, store.complete_many([(lease, "r") for lease in leases])))
        else:
            done += store.complete(leases[0], "r")
    return done


async def async_worker(store: AsyncJobStore, owner: str, batched: bool) -> int:
    done = 0
    while leases := await store.claim_next(owner, ttl=TTL, limit=BATCH if batched else 1):
        if batched:
            done += sum(map(bool, await store.complete_many([(lease, "r") for lease in leases])))
        else:
            done += await store.complete(leases[0], "r")
    return done


async def async_run(store: AsyncJobStore, batched: bool, tasks: int) -> int:
    counts = await asyncio.gather(*(async_worker(store, f"w{i}", batched) for i in range(tasks)))
    return sum(counts)


def timed(run: Callable[[], int], jobs: int) -> float:
    started = time.perf_counter()
    done = run()
    elapsed = time.perf_counter() - started
    if done != jobs:
        raise SystemExit(f"{done} of {jobs} jobs completed: the run is wrong")
    return jobs / elapsed


def engines(db: str, where: str) -> tuple[sqlalchemy.Engine, AsyncEngine]:
    if db == "sqlite":
        path = os.path.join(where, "async_cycle.db")
        return fencing.create_sqlite_engine(path), fencing.asyncio.create_sqlite_engine(path)
    return sqlalchemy.create_engine(URLS[db]), async_engine(URLS[db])


TABLE = report.Table(
    report.Column("configuration", 24, "<"),
    report.Column("jobs/s (median)", 16, spec=",.0f"),
    report.Column("vs sync, same mode", 22, pad=False),
    indent="  ",
)


def bench(db: str, jobs: int, repeat: int, where: str) -> None:
    sync_engine, async_engine = engines(db, where)
    sync_store = fencing.JobStore(sync_engine)
    sync_store.create_table()
    async_store = AsyncJobStore(async_engine)
    loop = asyncio.new_event_loop()
    configs: dict[str, Callable[[], int]] = {
        "sync single": lambda: sync_run(sync_store, False),
        "async single, 1 task": lambda: loop.run_until_complete(async_run(async_store, False, 1)),
        "async single, 4 tasks": lambda: loop.run_until_complete(async_run(async_store, False, 4)),
        "sync batched": lambda: sync_run(sync_store, True),
        "async batched, 1 task": lambda: loop.run_until_complete(async_run(async_store, True, 1)),
        "async batched, 4 tasks": lambda: loop.run_until_complete(async_run(async_store, True, 4)),
    }
    rates: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for _ in range(repeat):
            for name, run in configs.items():
                fill(sync_engine, jobs)
                rates[name].append(timed(run, jobs))
    finally:
        loop.run_until_complete(async_engine.dispose())
        loop.close()
        with sync_engine.begin() as conn:
            conn.execute(fencing.jobs.delete())
        sync_engine.dispose()
    base = {mode: rates[f"sync {mode}"] for mode in ("single", "batched")}
    print(f"\n{db}: {jobs} jobs per run, {repeat} interleaved repetitions")
    print(TABLE.header())
    for name, values in rates.items():
        mode = "batched" if "batched" in name else "single"
        ratios = [a / b for a, b in zip(values, base[mode], strict=True)]
        ratio = f"{statistics.median(ratios):>12.2f} ({report.spread(ratios)})"
        print(TABLE.row(name, statistics.median(values), ratio))


def main(argv: Any = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--jobs", type=int, default=2000)
    cli.add_repeat(parser, help=None)
    parser.add_argument("--db", default="sqlite,postgresql,mariadb")
    cli.add_dir(parser, help="where the SQLite file goes (default: a temp dir here)")
    args = parser.parse_args(argv)
    with workdir(None, args.dir or ".") as where:
        for db in args.db.split(","):
            bench(db, args.jobs, args.repeat, where)


if __name__ == "__main__":
    main()
