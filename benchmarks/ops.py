"""Operations per second: raw sqlite3 vs ``fencing.JobStore`` vs ``service.py``, side by side.

What is measured
----------------
For each operation -- ``claim``, ``renew``, ``complete``, ``state``, ``enqueue`` -- N calls in a
row, one transaction each, timed with :func:`time.perf_counter`, three ways:

``raw``
    A ``sqlite3`` connection with ``isolation_level=None`` and the store's PRAGMAs
    (``busy_timeout = 5000``, ``journal_mode = WAL``, ``synchronous = FULL|NORMAL``) running the
    SQL text the library runs (compiled here from ``fencing.statements.Statements`` for the
    ``sqlite`` dialect) in the same transactions: a cursor per operation, ``BEGIN IMMEDIATE``,
    the one statement (``fetchall`` for ``claim ... RETURNING`` and ``state``), ``COMMIT``.
    It builds no result objects and checks no arguments: it is the floor.
``store``
    ``fencing.JobStore(fencing.create_sqlite_engine(path, durability=...))``.
``service``
    ``service.py``, path-based, with its cached stores. ``service.py`` has no durability
    option (it always opens ``durability="full"``); for the ``normal`` rows its engine
    factory (``fencing.cache.create_engine``) is wrapped for the measurement to pass
    ``durability="normal"``, so those rows compare the path layer at equal durability.

Every measurement gets its own fresh database file in one temporary directory, prepared
identically (rows written in one transaction, then every connection closed) and warmed up
with a few untimed calls. Setup per operation: ``claim`` takes N distinct claimable jobs;
``renew`` and ``complete`` act once on each of N live leases (owner ``w``, fence 1);
``state`` reads N distinct existing rows; ``enqueue`` inserts N new ids. The three ways are
interleaved within every repetition (their order rotates), so machine noise hits all three
alike; the figures are medians of R repetitions.

The FULL rows are fsync-bound and slow on a real disk, so N defaults to 2000 there and
5000 at NORMAL. Targets: store >= 0.8x raw at full and >= 0.7x raw at normal; service
>= 0.8x store. Write operations wait for the disk: measure on the filesystem you care
about (``--dir``); tmpfs makes FULL look like NORMAL.

Reproduce
---------
::

    nox -s bench                      # runs: python benchmarks/ops.py
    python benchmarks/ops.py --durability both --repeat 5 --json bench.json
    python benchmarks/ops.py --durability normal --ops 20000 --repeat 3

``--check`` exits with status 1 when a ratio misses its target.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import sqlalchemy
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.schema import CreateTable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # service.py lives at the root

import fencing
import fencing.cache
import service
from fencing.statements import Statements

OPS = ("claim", "renew", "complete", "state", "enqueue")
WAYS = ("raw", "store", "service")
DEFAULT_N = {"full": 2000, "normal": 5000}
TARGET_STORE_VS_RAW = {"full": 0.8, "normal": 0.7}
TARGET_SERVICE_VS_STORE = 0.8
WARMUP = 50

NOW = 1000.0
TTL = 60.0
OWNER = "w"
LIVE_UNTIL = 1e9  # the leases renew/complete act on stay live throughout
RESULT = "ok"

# -- the SQL the library runs, compiled from its own statements ---------------------------------


class RawSQL:
    """The library's statements compiled for SQLite, checked against what the raw loops pass.

    The raw loops pass positional tuples in a fixed order; this checks, without depending
    on the library's bind parameter names, that the compiled SQL text is the one below and
    that Core's literal binds (the ``0`` of ``done = 0`` ...) are the constants passed.
    """

    # SQL text -> per ``?``: None for a call argument, else the constant Core binds there
    EXPECTED: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        "enqueue_sqlite": ("INSERT INTO jobs (id) VALUES (?) ON CONFLICT DO NOTHING", (None,)),
        "state": (
            "SELECT jobs.id, jobs.owner, jobs.until, jobs.fence, jobs.result, jobs.done "
            "FROM jobs WHERE jobs.id = ?",
            (None,),
        ),
        "claim_returning": (
            "UPDATE jobs SET owner=?, until=?, fence=(jobs.fence + ?) "
            "WHERE jobs.id = ? AND jobs.done = ? AND jobs.until <= ? RETURNING fence, until",
            (None, None, 1, None, 0, None),
        ),
        "renew": (
            "UPDATE jobs SET until=? WHERE jobs.id = ? AND jobs.owner = ? AND jobs.fence = ? "
            "AND jobs.done = ? AND jobs.until > ?",
            (None, None, None, None, 0, None),
        ),
        "complete": (
            "UPDATE jobs SET result=?, done=? WHERE jobs.id = ? AND jobs.owner = ? AND jobs.fence = ? "
            "AND jobs.done = ? AND jobs.until > ?",
            (None, 1, None, None, None, 0, None),
        ),
    }

    def __init__(self) -> None:
        stmts = Statements(fencing.jobs)
        dialect = sqlite_dialect.dialect()
        self.sql: dict[str, str] = {}
        for name, (want_sql, want_binds) in self.EXPECTED.items():
            compiled: Any = getattr(stmts, name).compile(dialect=dialect)
            binds = tuple(
                None if b.required else b.effective_value
                for b in (compiled.binds[k] for k in compiled.positiontup)
            )
            got_sql = " ".join(compiled.string.split())
            if got_sql != want_sql or binds != want_binds:
                raise SystemExit(
                    f"the library's {name} statement changed; update the raw loop in {__file__}:\n"
                    f"  library: {got_sql}  binds {binds}\n  raw:     {want_sql}  binds {want_binds}"
                )
            self.sql[name] = compiled.string
        self.create_table = str(CreateTable(fencing.jobs).compile(dialect=dialect))


def raw_connect(path: str, durability: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in (
        "PRAGMA busy_timeout = 5000",
        "PRAGMA journal_mode = WAL",
        f"PRAGMA synchronous = {durability.upper()}",
    ):
        conn.execute(pragma).fetchall()
    return conn


# -- setup: identical database files ------------------------------------------------------------


def job_ids(op: str, n: int) -> list[str]:
    return [f"{op}-{i:07d}" for i in range(n)]


def prepare(path: str, op: str, ids: list[str], sql: RawSQL) -> None:
    """The table and the rows ``op`` needs, written in one transaction; then closed."""
    conn = raw_connect(path, "normal")
    try:
        conn.execute(sql.create_table)
        conn.execute("BEGIN IMMEDIATE")
        if op == "claim":  # claimable: not done, never leased
            conn.executemany("INSERT INTO jobs (id) VALUES (?)", ((i,) for i in ids))
        elif op in ("renew", "complete", "state"):  # held by OWNER with fence 1, live
            conn.executemany(
                "INSERT INTO jobs (id, owner, until, fence) VALUES (?, ?, ?, 1)",
                ((i, OWNER, LIVE_UNTIL) for i in ids),
            )
        conn.execute("COMMIT")
    finally:
        conn.close()  # last connection: checkpoints and removes the -wal file


def verify(path: str, op: str, n: int) -> None:
    """Every timed write took effect (the benchmark measured real work, not misses)."""
    where = {
        "claim": f"owner = '{OWNER}' AND fence = 1 AND until = {NOW + TTL!r}",
        "renew": f"until = {NOW + TTL!r}",
        "complete": f"done = 1 AND result = '{RESULT}'",
        "state": "1",
        "enqueue": "1",
    }[op]
    conn = sqlite3.connect(path)
    try:
        (count,) = conn.execute(f"SELECT count(*) FROM jobs WHERE {where}").fetchone()
    finally:
        conn.close()
    if count != n:
        raise SystemExit(f"{op} on {path}: {count} rows show the operation, expected {n}")


# -- the three ways -----------------------------------------------------------------------------

Loop = Callable[[list[str]], None]


def raw_loops(conn: sqlite3.Connection, sql: RawSQL) -> dict[str, Loop]:
    begin, commit = "BEGIN IMMEDIATE", "COMMIT"
    s_claim, s_renew, s_complete = sql.sql["claim_returning"], sql.sql["renew"], sql.sql["complete"]
    s_state, s_enqueue = sql.sql["state"], sql.sql["enqueue_sqlite"]

    def claim(ids: list[str]) -> None:
        for job_id in ids:
            cur = conn.cursor()
            cur.execute(begin)
            cur.execute(s_claim, (OWNER, NOW + TTL, 1, job_id, 0, NOW))
            cur.fetchall()
            cur.execute(commit)
            cur.close()

    def renew(ids: list[str]) -> None:
        for job_id in ids:
            cur = conn.cursor()
            cur.execute(begin)
            cur.execute(s_renew, (NOW + TTL, job_id, OWNER, 1, 0, NOW))
            cur.rowcount  # noqa: B018 -- the library reads it
            cur.execute(commit)
            cur.close()

    def complete(ids: list[str]) -> None:
        for job_id in ids:
            cur = conn.cursor()
            cur.execute(begin)
            cur.execute(s_complete, (RESULT, 1, job_id, OWNER, 1, 0, NOW))
            cur.rowcount  # noqa: B018
            cur.execute(commit)
            cur.close()

    def state(ids: list[str]) -> None:
        for job_id in ids:
            cur = conn.cursor()
            cur.execute(begin)
            cur.execute(s_state, (job_id,))
            cur.fetchall()
            cur.execute(commit)
            cur.close()

    def enqueue(ids: list[str]) -> None:
        for job_id in ids:
            cur = conn.cursor()
            cur.execute(begin)
            cur.execute(s_enqueue, (job_id,))
            cur.rowcount  # noqa: B018
            cur.execute(commit)
            cur.close()

    return {"claim": claim, "renew": renew, "complete": complete, "state": state, "enqueue": enqueue}


def store_loops(store: fencing.JobStore) -> dict[str, Loop]:
    Lease = fencing.Lease

    def claim(ids: list[str]) -> None:
        for job_id in ids:
            store.claim(job_id, OWNER, now=NOW, ttl=TTL)

    def renew(ids: list[str]) -> None:
        leases = [Lease(job_id, OWNER, 1) for job_id in ids]  # what a worker holds already
        for lease in leases:
            store.renew(lease, now=NOW, ttl=TTL)

    def complete(ids: list[str]) -> None:
        leases = [Lease(job_id, OWNER, 1) for job_id in ids]
        for lease in leases:
            store.complete(lease, RESULT, now=NOW)

    def state(ids: list[str]) -> None:
        for job_id in ids:
            store.state(job_id)

    def enqueue(ids: list[str]) -> None:
        for job_id in ids:
            store.enqueue(job_id)

    return {"claim": claim, "renew": renew, "complete": complete, "state": state, "enqueue": enqueue}


def service_loops(path: str) -> dict[str, Loop]:
    def claim(ids: list[str]) -> None:
        for job_id in ids:
            service.claim(path, job_id, OWNER, NOW, TTL)

    def renew(ids: list[str]) -> None:
        for job_id in ids:
            service.renew(path, job_id, OWNER, 1, NOW, TTL)

    def complete(ids: list[str]) -> None:
        for job_id in ids:
            service.complete(path, job_id, OWNER, 1, NOW, RESULT)

    def state(ids: list[str]) -> None:
        for job_id in ids:
            service.state(path, job_id)

    def enqueue(ids: list[str]) -> None:
        for job_id in ids:
            service.enqueue(path, job_id)

    return {"claim": claim, "renew": renew, "complete": complete, "state": state, "enqueue": enqueue}


@contextmanager
def service_durability(durability: str) -> Iterator[None]:
    """``service.py`` always opens ``durability="full"``; match the row's durability."""
    original = getattr(fencing.cache, "create_engine")  # noqa: B009 -- not re-exported
    if durability != "full":
        setattr(fencing.cache, "create_engine", functools.partial(original, durability=durability))  # noqa: B010
    try:
        yield
    finally:
        setattr(fencing.cache, "create_engine", original)  # noqa: B010


def timed(loop: Loop, ids: list[str]) -> float:
    """Run the warm-up calls untimed, then time the rest; ops per second."""
    loop(ids[:WARMUP])
    timed_ids = ids[WARMUP:]
    gc.collect()
    start = time.perf_counter()
    loop(timed_ids)
    elapsed = time.perf_counter() - start
    return len(timed_ids) / elapsed


def measure(way: str, op: str, durability: str, n: int, path: str, sql: RawSQL) -> float:
    ids = job_ids(op, n + WARMUP)
    prepare(path, op, ids if op != "enqueue" else [], sql)
    if way == "raw":
        conn = raw_connect(path, durability)
        try:
            rate = timed(raw_loops(conn, sql)[op], ids)
        finally:
            conn.close()
    elif way == "store":
        store = fencing.JobStore(fencing.create_sqlite_engine(path, durability=durability))  # type: ignore[arg-type]
        try:
            rate = timed(store_loops(store)[op], ids)
        finally:
            store.dispose()
            store.engine.dispose()
    else:
        with service_durability(durability):
            settings = fencing.sqlite.settings_of(service._stores.get(path).engine)
            if settings is None or settings.durability != durability:
                raise SystemExit(f"service opened {path} with {settings and settings.durability}")
            try:
                rate = timed(service_loops(path)[op], ids)
            finally:
                service._stores.clear()  # close this file's connections, as the other two do
    verify(path, op, n + WARMUP)
    return rate


# -- running and reporting ----------------------------------------------------------------------


def run(durability: str, n: int, repeat: int, workdir: str, sql: RawSQL) -> list[dict[str, Any]]:
    samples: dict[str, dict[str, list[float]]] = {op: {w: [] for w in WAYS} for op in OPS}
    for rep in range(repeat):
        order = WAYS[rep % 3 :] + WAYS[: rep % 3]  # rotate who goes first
        for op in OPS:
            for way in order:
                path = os.path.join(workdir, f"{durability}-{op}-{way}-{rep}.db")
                samples[op][way].append(measure(way, op, durability, n, path, sql))
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(path + suffix):
                        os.remove(path + suffix)
        print(f"  {durability}: repetition {rep + 1}/{repeat} done", file=sys.stderr, flush=True)
    rows = []
    for op in OPS:
        s = samples[op]
        med = {w: statistics.median(s[w]) for w in WAYS}
        rows.append(
            {
                "op": op,
                "durability": durability,
                "n": n,
                "repeat": repeat,
                "raw_ops_s": med["raw"],
                "store_ops_s": med["store"],
                "service_ops_s": med["service"],
                "store_vs_raw": med["store"] / med["raw"],
                "service_vs_store": med["service"] / med["store"],
                # ratios within each repetition (the three ran back to back), then the median
                "store_vs_raw_paired": statistics.median(
                    st / r for st, r in zip(s["store"], s["raw"], strict=True)
                ),
                "service_vs_store_paired": statistics.median(
                    sv / st for sv, st in zip(s["service"], s["store"], strict=True)
                ),
                "target_store_vs_raw": TARGET_STORE_VS_RAW[durability],
                "target_service_vs_store": TARGET_SERVICE_VS_STORE,
                "samples": s,
            }
        )
    return rows


def mark(ratio: float, target: float) -> str:
    return f"{ratio:5.2f} {'ok ' if ratio >= target else 'MISS'}"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'op':<9} {'durab.':<7} {'raw ops/s':>10} {'store ops/s':>12} {'store/raw':>10} "
        f"{'(target)':>8} {'service ops/s':>14} {'svc/store':>10} {'(target)':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['op']:<9} {r['durability']:<7} {r['raw_ops_s']:>10,.0f} {r['store_ops_s']:>12,.0f} "
            f"{mark(r['store_vs_raw'], r['target_store_vs_raw']):>10} "
            f"{'>=' + str(r['target_store_vs_raw']):>8} "
            f"{r['service_ops_s']:>14,.0f} "
            f"{mark(r['service_vs_store'], r['target_service_vs_store']):>10} "
            f"{'>=' + str(r['target_service_vs_store']):>8}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--ops", type=int, default=None, help="timed calls per measurement (default 2000 full, 5000 normal)"
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="repetitions; the median is reported (default 5)"
    )
    parser.add_argument("--durability", choices=("full", "normal", "both"), default="both")
    parser.add_argument("--json", metavar="FILE", help="write the figures (and every sample) here")
    parser.add_argument(
        "--dir", metavar="DIR", default=None, help="where the database files go (default: $TMPDIR)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a ratio misses its target")
    args = parser.parse_args(argv)
    if args.repeat < 1 or (args.ops is not None and args.ops < 1):
        parser.error("--ops and --repeat must be >= 1")

    durabilities = ("full", "normal") if args.durability == "both" else (args.durability,)
    sql = RawSQL()
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fencing-bench-", dir=args.dir) as workdir:
        for durability in durabilities:
            n = args.ops or DEFAULT_N[durability]
            rows.extend(run(durability, n, args.repeat, workdir, sql))
    wall = time.perf_counter() - started

    print(
        f"fencing {fencing.__version__}; SQLite {sqlite3.sqlite_version}; "
        f"SQLAlchemy {sqlalchemy.__version__}; Python {platform.python_version()}; "
        f"{os.cpu_count()} CPUs; median of {args.repeat}; {wall:.0f} s"
    )
    print_table(rows)
    if "normal" in durabilities:
        print("service at normal: its engine factory wrapped to durability='normal' (it ships 'full' only)")
    misses = [
        r
        for r in rows
        if r["store_vs_raw"] < r["target_store_vs_raw"]
        or r["service_vs_store"] < r["target_service_vs_store"]
    ]
    if args.json:
        meta = {
            "fencing": fencing.__version__,
            "sqlite": sqlite3.sqlite_version,
            "sqlalchemy": sqlalchemy.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "repeat": args.repeat,
            "warmup": WARMUP,
            "wall_seconds": wall,
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    return 1 if args.check and misses else 0


if __name__ == "__main__":
    sys.exit(main())
