"""What "one road to the database through Core" would cost (issue 37): the same store
operations through the store's driver path and through Core, side by side.

Two stores on one database, each with a jobs table of its own: one as the library makes it
(its units on the pooled driver connection), one with ``DRIVER_PATH`` off while it is
made (every unit through ``Connection.execute``, as when something observes the engine). The
N calls of each operation are cut into 10 slices run alternately, so a slow stretch hits
both; medians of R repetitions. It measures the library against itself, not against raw
drivers (``ops.py`` and ``servers.py`` do that).

Reproduce::

    python benchmarks/one_road.py sqlite-normal     # or sqlite-full, postgresql, mariadb
    N=1000 R=3 python benchmarks/one_road.py postgresql
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

import fencing
import fencing._runtime.execution as execution

URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
OPERATIONS = ("enqueue", "claim", "complete", "state", "fenced")
SLICES = 10


def make_engine(where: str) -> sa.Engine:
    if where.startswith("sqlite"):
        path = os.path.join(tempfile.mkdtemp(), "one-road.db")
        return fencing.create_sqlite_engine(path, durability=where.split("-")[1])
    return sa.create_engine(URLS[where])


def make_store(where: str, name: str, *, core: bool) -> fencing.JobStore:
    saved = execution.DRIVER_PATH
    execution.DRIVER_PATH = not core  # read when the store's runner is made
    try:
        store = fencing.JobStore(make_engine(where), fencing.jobs_table(sa.MetaData(), name))
    finally:
        execution.DRIVER_PATH = saved
    store.table.drop(store.engine, checkfirst=True)
    store.create_table()
    return store


def one_slice(op: str, store: fencing.JobStore, ids: list[str], leases: list[Any]) -> float:
    """Seconds the slice's calls of ``op`` took (a fenced block's claim is set up untimed)."""
    if op == "fenced":
        for job in ids:
            store.enqueue(job + "f", ready_at=0.0)
        taken = [store.claim(job + "f", "w", ttl=600.0) for job in ids]
    started = time.perf_counter()
    for n, job in enumerate(ids):
        if op == "enqueue":
            store.enqueue(job, ready_at=0.0)
        elif op == "claim":
            leases.append(store.claim(job, "w", ttl=600.0))
        elif op == "complete":
            store.complete(leases[n], "r")
        elif op == "state":
            store.state(job)
        else:
            with store.fenced(taken[n], complete=True, result="r"):
                pass
    return time.perf_counter() - started


def measure(ways: dict[str, fencing.JobStore], n: int, repeat: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {op: {w: [] for w in ways} for op in OPERATIONS}
    for rep in range(repeat):
        for store in ways.values():
            with store.engine.begin() as conn:
                conn.execute(store.table.delete())
        ids = [f"r{rep}-{i}" for i in range(n)]
        leases: dict[str, list[Any]] = {w: [] for w in ways}
        for op in OPERATIONS:
            spent = dict.fromkeys(ways, 0.0)
            for k in range(SLICES):
                part = slice(k * n // SLICES, (k + 1) * n // SLICES)
                order = list(ways) if k % 2 == 0 else list(reversed(ways))
                for w in order:
                    done = leases[w][part] if op == "complete" else leases[w]
                    spent[w] += one_slice(op, ways[w], ids[part], done)
            for w in ways:
                results[op][w].append(n / spent[w])
    return results


def main(where: str, n: int, repeat: int, show: Callable[[str], None] = print) -> None:
    ways = {
        "driver": make_store(where, "road_driver", core=False),
        "core": make_store(where, "road_core", core=True),
    }
    assert ways["driver"]._ctx.runner._fast and not ways["core"]._ctx.runner._fast
    try:
        results = measure(ways, n, repeat)
    finally:
        for store in ways.values():
            store.table.drop(store.engine, checkfirst=True)
            store.engine.dispose()
    show(f"{where}: N={n}, median of {repeat}, SQLAlchemy {sa.__version__}")
    show(f"{'op':10s} {'driver ops/s':>13s} {'core ops/s':>11s} {'core/driver':>12s} {'us/op added':>12s}")
    for op, r in results.items():
        d, c = statistics.median(r["driver"]), statistics.median(r["core"])
        show(f"{op:10s} {d:13,.0f} {c:11,.0f} {c / d:12.2f} {1e6 / c - 1e6 / d:12.1f}")


if __name__ == "__main__":
    main(sys.argv[1], int(os.environ.get("N", "1500")), int(os.environ.get("R", "5")))
