"""What a job's payload costs its claim: the same claims with and without the payloads table.

What is measured
----------------
For each backend, a jobs table of the library's schema holds ``--backlog`` ready jobs (not
timed), each with a payload of about ``--payload-bytes`` bytes of JSON in a payloads table
beside it (:func:`fencing.payloads_table`). Two stores work on the same rows: ``with``
(``JobStore(..., payloads=...)``: every claim reads its jobs' payloads) and ``without``
(no payloads table: the claim is the one the library ran before payloads). In alternating
slices (so the backlog and the machine's state are the same for both), each times:

``single``
    ``claim_next(limit=1)`` then ``complete``: cycles/s.
``batched``
    ``claim_next(limit=100)`` then ``complete_many``: jobs/s.

The ratio ``with / without`` is the payload's price (target: at least 0.9 on the servers,
where the claim reads it in the same statement or transaction). ``--explain`` prints the
claim statement's plan on each database (the payload is read by primary key per claimed row).

Run::

    python benchmarks/payloads.py --backends sqlite postgresql mariadb --backlog 100000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fencing
from fencing._sql.schema import KEY_TYPE

URLS = {
    "postgresql": os.environ.get("FENCING_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mariadb": os.environ.get("FENCING_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}


def engine_for(backend: str, directory: str) -> sa.Engine:
    if backend == "sqlite":
        return fencing.create_sqlite_engine(os.path.join(directory, "payloads.db"), durability="normal")
    return sa.create_engine(URLS[backend])


def load(engine: sa.Engine, jobs: sa.Table, payloads: sa.Table, n: int, size: int) -> None:
    """``n`` ready jobs (``until`` spread in id order) and a payload for each, in chunks."""
    filler = "x" * max(0, size - 40)
    with engine.begin() as conn:
        for start in range(0, n, 10_000):
            ids = [f"job-{i:08d}" for i in range(start, min(n, start + 10_000))]
            conn.execute(
                jobs.insert().values(id=sa.bindparam("k", type_=KEY_TYPE), until=sa.bindparam("u")),
                [{"k": k, "u": float(i + 1) / 1000.0} for i, k in enumerate(ids, start)],
            )
            conn.execute(
                payloads.insert().values(id=sa.bindparam("k", type_=KEY_TYPE), payload=sa.bindparam("p")),
                [{"k": k, "p": json.dumps({"job": k, "filler": filler})} for k in ids],
            )


def single(store: fencing.JobStore, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        [lease] = store.claim_next("w", ttl=600)
        assert store.complete(lease, "ok")
    return count / (time.perf_counter() - started)


def batched(store: fencing.JobStore, rounds: int) -> float:
    started = time.perf_counter()
    taken = 0
    for _ in range(rounds):
        leases = store.claim_next("w", ttl=600, limit=100)
        taken += len(leases)
        store.complete_many([(lease, "ok") for lease in leases])
    return taken / (time.perf_counter() - started)


def explain(engine: sa.Engine, store: fencing.JobStore) -> None:
    """The plans of the statements a payload touches: the claim (its RETURNING reads the
    payloads), or on MariaDB the payloads' SELECT and a claim by id's read-back; and the read
    a waiting claim makes between its looks (when the next job comes due)."""
    s = store._ctx.by_database  # the statements the store runs (a benchmark may look inside)
    if store._ctx.plan.returning:
        named = {"claim_next": s.claim_next_returning}
    else:
        named = {"payloads of 2 claimed": s.payloads_of(2), "claim's read-back": s.claimed_lease}
    named["due_in (a waiting claim)"] = s.due_in
    prefix = "EXPLAIN QUERY PLAN " if engine.dialect.name == "sqlite" else "EXPLAIN "
    params = {"holder": "w", "limit": 1, "max_fence": 2**63 - 1, "ttl": 600.0, "job_id": "job-00000001"}
    params.update({"id_0": "job-00000001", "id_1": "job-00000002"})
    with engine.connect() as conn:
        for name, stmt in named.items():
            compiled = stmt.compile(dialect=engine.dialect)
            bound: Any = compiled.construct_params(params)
            if compiled.positional:
                bound = tuple(bound[key] for key in compiled.positiontup or ())
            with conn.begin():  # an EXPLAIN of an UPDATE runs nothing; rolled back all the same
                rows = conn.exec_driver_sql(prefix + str(compiled), bound).all()
                conn.rollback()
            print(f"  plan of {name} ({engine.dialect.name}):")
            for row in rows:
                print("    " + " | ".join(str(c) for c in row))


def measure(backend: str, args: argparse.Namespace, directory: str) -> dict[str, list[float]]:
    engine = engine_for(backend, directory)
    metadata = sa.MetaData()
    name = f"bench_pl_{os.getpid()}"
    jobs = fencing.jobs_table(metadata, name)
    payloads = fencing.payloads_table(metadata, name + "_payloads")
    metadata.drop_all(engine)
    with_payloads = fencing.JobStore(engine, jobs, payloads=payloads)
    without = fencing.JobStore(engine, jobs)
    with_payloads.create_table()
    spare = (args.cycles + args.rounds * 100) * 2 * (args.repeat + 1)
    load(engine, jobs, payloads, args.backlog + spare, args.payload_bytes)
    if args.explain:
        explain(engine, with_payloads)
    found: dict[str, list[float]] = {}
    runs: list[tuple[str, Callable[[fencing.JobStore], float]]] = [
        ("single", lambda s: single(s, args.cycles)),
        ("batched", lambda s: batched(s, args.rounds)),
    ]
    try:
        for mode, run in runs:
            run(without)  # warm-up: statements compiled, caches filled
            run(with_payloads)
            for _ in range(args.repeat):
                a = run(without)
                b = run(with_payloads)
                found.setdefault(f"{mode} without", []).append(a)
                found.setdefault(f"{mode} with", []).append(b)
                found.setdefault(f"{mode} ratio", []).append(b / a)
    finally:
        metadata.drop_all(engine)
        engine.dispose()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql", "mariadb"])
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args(argv)
    print(
        f"backlog {args.backlog:,} ready jobs, payloads of ~{args.payload_bytes} bytes, {args.repeat} repeats"
    )
    with tempfile.TemporaryDirectory(dir=".") as directory:
        for backend in args.backends:
            found: dict[str, Any] = measure(backend, args, directory)
            print(f"{backend}:")
            for key, values in found.items():
                unit = "" if key.endswith("ratio") else "/s"
                median = statistics.median(values)
                shown = f"{median:.2f}" if key.endswith("ratio") else f"{median:,.0f}{unit}"
                print(f"  {key:18} {shown}  (range {min(values):.2f}-{max(values):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
