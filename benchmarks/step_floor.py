"""The worker's step on SQLite against its floor: raw ``sqlite3`` sending the same statements.

What is measured
----------------
One worker, a table of ``--ready`` ready jobs, on the database clock, three ways, each on its
own database file prepared identically (the library's ``create_table``, the jobs inserted in
one transaction):

``store step``
    ``done, [lease] = store.complete_and_claim_next([(lease, "r")], "w", ttl=600)``: the last
    lease completed and the next claimed in one transaction (one commit per job).
``raw step``
    A ``sqlite3`` connection (``isolation_level=None``, WAL, the same ``synchronous``)
    replaying exactly what the store sends for one step: ``BEGIN IMMEDIATE``, the completion
    ``UPDATE``, the claim ``UPDATE ... RETURNING``, ``COMMIT``. The statements are recorded
    from the store at startup (a ``before_cursor_execute`` listener on one untimed step), so
    they are the library's own, compiled by SQLAlchemy Core. No argument checks, no result
    objects: the floor of one commit per job.
``raw two commits``
    The same two statements, each in its own transaction (``claim_next`` then ``complete``,
    as the peers' one-at-a-time cycles do): the floor of two commits per job.

The timed steps are cut into ``--slices`` slices and slice k of each way runs back to back
(the order rotating), so a slow stretch of the disk hits all three alike; rates are medians
of ``--repeat`` repetitions, ratios the medians of the per-repetition ratios. At
``synchronous=FULL`` each commit waits for an fsync: what the disk allows decides, so
measure on the filesystem you care about (``--dir``).

Reproduce::

    python benchmarks/step_floor.py                       # full and normal
    python benchmarks/step_floor.py --durability full --steps 3000 --repeat 5
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from harness import cli, db, dbapi, env, report
from harness.measure import rotated

import fencing

OWNER = "w"
RESULT = "r"
TTL = 600.0
#: the recorded step's arguments, told apart by value when the raw loop fills in its own
MARK_RESULT, MARK_OWNER = "result-marker", "owner-marker"


def prepare(path: str, durability: str, ready: int) -> fencing.JobStore:
    store = fencing.JobStore(fencing.create_sqlite_engine(path, durability=durability))
    store.create_table()
    rows = [
        {"id": f"job-{n:08d}", "owner": None, "until": 0.0, "fence": 0, "result": None, "done": 0}
        for n in range(ready)
    ]
    with store.engine.begin() as conn:
        conn.execute(sa.insert(store.table), rows)
    return store


def record_step(store: fencing.JobStore) -> list[tuple[str, tuple[Any, ...]]]:
    """The statements (and their arguments) one store step sends, BEGIN and COMMIT aside."""
    [lease] = store.claim_next(MARK_OWNER, ttl=TTL)
    with dbapi.statements(store.engine) as sent:
        store.complete_and_claim_next([(lease, MARK_RESULT)], MARK_OWNER, ttl=TTL)
    statements = [
        (sql, tuple(params)) for sql, params in sent if sql.split()[0].upper() in ("UPDATE", "WITH")
    ]
    if len(statements) != 2:
        raise SystemExit(f"expected a completion and a claim, recorded {sent!r}")
    complete, claim = statements
    if complete[1] != (MARK_RESULT, lease.job_id, MARK_OWNER, lease.fence):
        raise SystemExit(f"the completion's arguments are not (result, id, owner, fence): {complete[1]!r}")
    return [complete, claim]


class RawWorker:
    """Replays the recorded step; ``commits`` 1 (the step) or 2 (claim, then complete)."""

    def __init__(
        self, conn: sqlite3.Connection, plan: list[tuple[str, tuple[Any, ...]]], commits: int
    ) -> None:
        (self.complete_sql, _), (self.claim_sql, claim_args) = plan
        self.claim_args = tuple(OWNER if a == MARK_OWNER else a for a in claim_args)
        self.conn, self.commits = conn, commits
        self.cur = conn.cursor()
        self.cur.execute("BEGIN IMMEDIATE")
        self.lease = self.cur.execute(self.claim_sql, self.claim_args).fetchone()
        self.cur.execute("COMMIT")

    def steps(self, n: int) -> None:
        cur, complete_sql, claim_sql, claim_args = (
            self.cur,
            self.complete_sql,
            self.claim_sql,
            self.claim_args,
        )
        job_id, fence, _ = self.lease
        for _ in range(n):
            cur.execute("BEGIN IMMEDIATE")
            if cur.execute(complete_sql, (RESULT, job_id, OWNER, fence)).rowcount != 1:
                raise RuntimeError(f"raw completion of {job_id} refused")
            if self.commits == 2:
                cur.execute("COMMIT")
                cur.execute("BEGIN IMMEDIATE")
            job_id, fence, _ = cur.execute(claim_sql, claim_args).fetchone()
            cur.execute("COMMIT")
        self.lease = (job_id, fence, None)

    def close(self) -> None:
        self.conn.close()


class StoreWorker:
    def __init__(self, store: fencing.JobStore) -> None:
        self.store = store
        [self.lease] = store.claim_next(OWNER, ttl=TTL)

    def steps(self, n: int) -> None:
        store, lease = self.store, self.lease
        for _ in range(n):
            done, [lease] = store.complete_and_claim_next([(lease, RESULT)], OWNER, ttl=TTL)
            if done != [True]:
                raise RuntimeError(f"store completion of {lease.job_id} refused")
        self.lease = lease

    def close(self) -> None:
        self.store.engine.dispose()


def repetition(root: str, durability: str, args: argparse.Namespace, rep: int) -> dict[str, float]:
    with db.workdir(f"rep{rep}-", root) as where:
        workdir = Path(where)
        stores = {
            way: prepare(str(workdir / f"{way}.db"), durability, args.ready + args.steps + 10) for way in WAYS
        }
        plan = record_step(stores["store step"])
        for way in ("raw step", "raw two commits"):
            stores[way].engine.dispose()
        workers: dict[str, Any] = {
            "store step": StoreWorker(stores["store step"]),
            "raw step": RawWorker(db.sqlite_connect(str(workdir / "raw step.db"), durability), plan, 1),
            "raw two commits": RawWorker(
                db.sqlite_connect(str(workdir / "raw two commits.db"), durability), plan, 2
            ),
        }
        for worker in workers.values():
            worker.steps(20)  # warm-up
        spent = dict.fromkeys(WAYS, 0.0)
        per_slice = args.steps // args.slices
        for k in range(args.slices):
            for way in rotated(WAYS, k + rep):
                started = time.perf_counter()
                workers[way].steps(per_slice)
                spent[way] += time.perf_counter() - started
        for worker in workers.values():
            worker.close()
    return {way: per_slice * args.slices / spent[way] for way in WAYS}


WAYS = ("raw step", "store step", "raw two commits")


def rate(reps: list[dict[str, float]], way: str) -> float:
    return statistics.median(r[way] for r in reps)


def ratio(reps: list[dict[str, float]], way: str, to: str) -> float:
    """The median of the per-repetition ratios."""
    return statistics.median(r[way] / r[to] for r in reps)


TABLE = report.Table(
    report.Column("durability", 10, "<"),
    report.Column("raw step/s", 11, spec=",.0f"),
    report.Column("store step/s", 13, spec=",.0f"),
    report.Column("store/raw", 10, spec=".2f"),
    report.Column("raw 2 commits/s", 16, spec=",.0f"),
    report.Column("raw step/raw 2", 15, spec=".2f"),
)


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_durability(parser, "both", both=True)
    parser.add_argument("--ready", type=int, default=10_000, help="ready jobs in each table (default 10,000)")
    parser.add_argument(
        "--steps", type=int, default=2000, help="timed steps per way and repetition (default 2000)"
    )
    parser.add_argument("--slices", type=int, default=10)
    cli.add_repeat(parser, help=None)
    cli.add_dir(parser, ".", help="where the database files go (default: a temporary dir under the cwd)")
    args = parser.parse_args(argv)
    if min(args.ready, args.steps, args.slices, args.repeat) < 1 or args.steps < args.slices:
        parser.error(
            "--ready, --steps, --slices and --repeat must be positive, and --steps at least --slices"
        )
    with db.workdir("bench-step-", args.dir) as root:
        v = env.versions("sqlite", "sqlalchemy", "python")
        versions = f"SQLite {v['sqlite']}, SQLAlchemy {v['sqlalchemy']}, Python {v['python']}"
        work = f"{args.ready:,} ready, {args.steps} steps x {args.repeat}"
        print(f"worker step vs raw sqlite3: {versions}; {work}")
        durabilities = ("full", "normal") if args.durability == "both" else (args.durability,)
        print(TABLE.header())
        for durability in durabilities:
            reps = [repetition(root, durability, args, rep) for rep in range(args.repeat)]
            print(
                TABLE.row(
                    durability,
                    rate(reps, "raw step"),
                    rate(reps, "store step"),
                    ratio(reps, "store step", "raw step"),
                    rate(reps, "raw two commits"),
                    ratio(reps, "raw step", "raw two commits"),
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
