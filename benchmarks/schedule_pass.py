"""What one scheduler pass costs (:meth:`fencing.Scheduler.run_pending`), on each database.

A pass is one transaction: it reads the schedules' rows with the database's clock, and for each
schedule with ticks due moves its row (a compare-and-set by primary key) and enqueues the ticks.
Here one schedule, one tick due per pass (the caller's clock moved a second between passes),
then the same pass again with nothing due; 300 of each, p50 and p99::

    python benchmarks/schedule_pass.py sqlite postgresql+psycopg://postgres@127.0.0.1/test \\
        mysql+pymysql://root@127.0.0.1/test

(``Scheduler.run`` makes a pass only when a tick falls due, or when another process's pass
moved a row it read: an idle schedule costs nothing between its ticks.)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fencing

PASSES = 300


def measure(url: str) -> str:
    if url == "sqlite":
        engine = fencing.create_sqlite_engine(str(Path(tempfile.mkdtemp()) / "pass.db"))
    else:
        engine = sa.create_engine(url)
    md = sa.MetaData()
    store = fencing.JobStore(engine, fencing.jobs_table(md, "pb_jobs"))
    store.create_table()
    table = fencing.schedules_table(md, "pb_schedules")
    clock = [1796601600.0]
    scheduler = fencing.Scheduler(
        store, [fencing.Schedule("pb", every=1, missed="all")], table=table, clock=lambda: clock[0]
    )
    scheduler.create_table()
    with engine.begin() as conn:
        conn.execute(table.delete())
        conn.execute(store.table.delete())
    scheduler.run_pending()
    due: list[float] = []
    idle: list[float] = []
    for _ in range(PASSES):
        clock[0] += 1
        started = time.perf_counter()
        assert len(scheduler.run_pending()) == 1
        due.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert scheduler.run_pending() == []
        idle.append(time.perf_counter() - started)
    engine.dispose()

    def q(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1000:.2f} / {sorted(xs)[int(len(xs) * 0.99)] * 1000:.2f} ms"

    return f"| {engine.dialect.name} | {q(due)} | {q(idle)} |"


def main() -> None:
    print("| database | a pass enqueuing one tick (p50 / p99) | a pass with nothing due |")
    print("|---|---:|---:|")
    for url in sys.argv[1:] or ["sqlite"]:
        print(measure(url))


if __name__ == "__main__":
    main()
