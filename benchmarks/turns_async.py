"""Client turns per job of an idle ``AsyncWorker``: jobs enqueued one at a time, 0.1 s apart.

The worker's async engine reaches the server through ``tests/turns_proxy.py`` (a turn: a client
burst that waited for the server); the enqueues go direct. What it counts is the waiting
claim's cost: its looks, its listening connection (PostgreSQL) and the job's claim, run and
completion::

    python benchmarks/turns_async.py postgresql   # or mariadb
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fencing
from fencing.asyncio import AsyncJob, AsyncJobStore, AsyncWorker
from tests.turns_proxy import TurnsProxy

JOBS = 20
SERVERS = {
    "postgresql": (5432, "postgresql+asyncpg://postgres@127.0.0.1:{port}/test", "postgresql+psycopg"),
    "mariadb": (3306, "mysql+asyncmy://root@127.0.0.1:{port}/test", "mysql+pymysql"),
}


async def per_job(proxy: TurnsProxy, url: str, store: fencing.JobStore) -> float:
    engine = create_async_engine(url)
    done = asyncio.Event()

    async def run(job: AsyncJob) -> None:
        done.set()

    worker = AsyncWorker(AsyncJobStore(engine, store.table), run, ttl=30.0)
    running = asyncio.create_task(worker.run(handle_signals=False))
    await asyncio.sleep(1.0)
    proxy.reset()
    for i in range(JOBS):
        done.clear()
        await asyncio.to_thread(store.enqueue, f"job-{i}")
        await done.wait()
        await asyncio.sleep(0.1)
    turns = proxy.reset()
    worker.stop()
    await running
    await engine.dispose()
    return turns / JOBS


def main() -> None:
    database = sys.argv[1] if len(sys.argv) > 1 else "postgresql"
    port, url, sync_driver = SERVERS[database]
    direct = sa.make_url(url.format(port=port)).set(drivername=sync_driver)
    table = fencing.jobs_table(sa.MetaData(), "bench_turns_async")
    engine = sa.create_engine(direct)
    table.drop(engine, checkfirst=True)
    store = fencing.JobStore(engine, table)
    store.create_table()
    try:
        with TurnsProxy(("127.0.0.1", port)) as proxy:
            turns = asyncio.run(per_job(proxy, url.format(port=proxy.port), store))
        print(f"{database}: an idle AsyncWorker, {turns:.1f} client turns per job")
    finally:
        table.drop(engine)
        engine.dispose()


if __name__ == "__main__":
    main()
