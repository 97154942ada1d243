"""Operations per second: raw sqlite3 vs ``fencing.JobStore`` vs ``service.py``, side by side.

What is measured
----------------
For each operation -- ``claim``, ``renew``, ``complete``, ``state``, ``enqueue`` -- N calls in a
row, one transaction each, timed with :func:`time.perf_counter`, three ways:

``raw``
    A ``sqlite3`` connection with ``isolation_level=None`` and the store's PRAGMAs
    (``busy_timeout = 5000``, ``journal_mode = WAL``, ``synchronous = FULL|NORMAL``) replaying
    exactly what the store sends to the driver for that operation: at startup one call of
    each operation runs on a store whose sqlite3 connection records every ``cursor()``,
    ``execute(sql, args)`` and ``fetch*()`` -- ``BEGIN IMMEDIATE``; the statement (compiled
    by the library from SQLAlchemy Core); ``COMMIT``, on one cursor -- and the raw loop
    repeats that sequence with the benchmark's arguments (built before the clock starts).
    It builds no result objects and checks no arguments: it is the floor. (The store also
    lowers and restores the pooled connection's ``busy_timeout`` around its ``BEGIN``, two
    ``PRAGMA`` statements for its bound on lock waits: the store's own cost, not replayed.)
    ``--show-sql``
    prints the recorded transactions; ``--json`` stores them.
``store``
    ``fencing.JobStore(fencing.create_sqlite_engine(path, durability=...))``.
``service``
    ``service.py``, path-based, with its cached stores. ``service.py`` has no durability
    option (it always opens ``durability="full"``); for the ``normal`` rows its engine
    factory (``fencing._engines.create_engine``) is wrapped for the measurement to pass
    ``durability="normal"``, so those rows compare the path layer at equal durability.

Each way gets its own fresh database file in one temporary directory, prepared identically
(the library's ``create_table``, rows written in one transaction, every connection closed),
its own connection(s), and a few untimed warm-up calls. Setup per operation: ``claim`` takes
N distinct claimable jobs; ``renew`` and ``complete`` act once on each of N live leases
(owner ``w``, fence 1); ``state`` reads N distinct existing rows; ``enqueue`` inserts N new
ids. The three ways are interleaved within every repetition: the N timed calls are cut into
10 slices and slice k of raw, store and service run back to back (the order rotating), so a
slow stretch of the disk or a busy neighbour hits all three alike. Every write is checked
in the file afterwards. The figures are medians of R repetitions; ``--json`` also keeps
every sample and the ratio of medians' paired counterpart (median of per-repetition ratios).

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

import functools
import gc
import os
import sqlite3
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import cli, db, dbapi, env, report
from harness.measure import rotated

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # service.py lives at the root

import fencing
import fencing._engines
import fencing._runtime.sqlite
import service

OPS = ("claim", "renew", "complete", "state", "enqueue")
WAYS = ("raw", "store", "service")
DEFAULT_N = {"full": 2000, "normal": 5000}
TARGET_STORE_VS_RAW = {"full": 0.8, "normal": 0.7}
TARGET_SERVICE_VS_STORE = 0.8
WARMUP = 50
CHUNKS = 10  # timed slices per measurement, alternating between the three ways


# -- the benchmark's arguments, and distinct ones for recording the store's driver calls -------


@dataclass(frozen=True)
class Args:
    owner: str
    now: float
    ttl: float
    fence: int
    result: str

    @property
    def until(self) -> float:
        return self.now + self.ttl


BENCH = Args(owner="w", now=1000.0, ttl=60.0, fence=1, result="ok")
# every value distinct, so each recorded driver argument names its role unambiguously
PROBE = Args(owner="probe-owner", now=1000.25, ttl=60.5, fence=7, result="probe-result")
PROBE_JOB = "probe-job"
LIVE_UNTIL = 1e9  # the leases renew/complete act on stay live throughout


# -- setup: identical database files ------------------------------------------------------------


def job_ids(op: str, n: int) -> list[str]:
    return [f"{op}-{i:07d}" for i in range(n)]


def prepare(path: str, op: str, ids: list[str], args: Args) -> None:
    """The library's table and the rows ``op`` needs, in one transaction; then all closed."""
    engine = fencing.create_sqlite_engine(path, durability="normal")
    try:
        fencing.JobStore(engine).create_table()  # whatever table (and indexes) the library makes
    finally:
        engine.dispose()
    conn = db.sqlite_connect(path, "normal")
    try:
        conn.execute("BEGIN IMMEDIATE")
        if op == "claim":  # claimable: not done, never leased
            conn.executemany("INSERT INTO jobs (id) VALUES (?)", ((i,) for i in ids))
        elif op in ("renew", "complete", "state"):  # a live lease held by args.owner
            conn.executemany(
                "INSERT INTO jobs (id, owner, until, fence) VALUES (?, ?, ?, ?)",
                ((i, args.owner, LIVE_UNTIL, args.fence) for i in ids),
            )
        conn.execute("COMMIT")
    finally:
        conn.close()  # the last connection: checkpoints and removes the -wal file


def verify(path: str, op: str, n: int) -> None:
    """Every timed write took effect (the benchmark measured real work, not misses)."""
    b = BENCH
    where, params = {
        "claim": ("owner = ? AND fence = 1 AND until = ?", (b.owner, b.until)),
        "renew": ("owner = ? AND until = ?", (b.owner, b.until)),
        "complete": ("done = 1 AND result = ?", (b.result,)),
        "state": ("1", ()),
        "enqueue": ("owner IS NULL AND fence = 0 AND done = 0", ()),
    }[op]
    conn = sqlite3.connect(path)
    try:
        (count,) = conn.execute(f"SELECT count(*) FROM jobs WHERE {where}", params).fetchone()
    finally:
        conn.close()
    if count != n:
        raise SystemExit(f"{op} on {path}: {count} rows show the operation, expected {n}")


# -- recording what the store sends to the driver -----------------------------------------------


def store_call(store: fencing.JobStore, op: str, job_id: str, a: Args) -> object:
    """One call of ``op`` as the benchmark's store loops make it."""
    if op == "claim":
        return store.claim(job_id, a.owner, now=a.now, ttl=a.ttl)
    if op == "renew":
        return store.renew(fencing.Lease(job_id, a.owner, a.fence), now=a.now, ttl=a.ttl)
    if op == "complete":
        return store.complete(fencing.Lease(job_id, a.owner, a.fence), a.result, now=a.now)
    if op == "state":
        return store.state(job_id)
    return store.enqueue(job_id, ready_at=0.0)  # the row service.enqueue makes


# a step of a recorded transaction: SQL, its arguments as roles/constants, the fetch after it
Step = tuple[str, Any, "str | None"]


def _role(value: object) -> tuple[str, object]:
    p = PROBE
    roles: list[tuple[str, object]] = [
        ("job_id", PROBE_JOB),
        ("owner", p.owner),
        ("result", p.result),
        ("now", p.now),
        ("until", p.until),
        ("ttl", p.ttl),
        ("fence", p.fence),
    ]
    for role, probe in roles:
        if type(value) is type(probe) and value == probe:
            return ("arg", role)
    return ("const", value)


def record(workdir: str, durability: str) -> dict[str, list[Step]]:
    """Per operation, the driver calls one store call makes, with arguments as roles."""
    plans: dict[str, list[Step]] = {}
    for op in OPS:
        path = os.path.join(workdir, f"record-{durability}-{op}.db")
        prepare(path, op, [] if op == "enqueue" else [PROBE_JOB], PROBE)
        engine = fencing.create_sqlite_engine(
            path,
            durability=durability,  # type: ignore[arg-type]
            connect_args={"factory": dbapi.sqlite3_factory(dbapi.Recorder)},
        )
        store = fencing.JobStore(engine)
        try:
            store.state(PROBE_JOB)  # checks a connection out (its PRAGMAs are not the op's)
            with dbapi.tapping(dbapi.Recorder()) as recorder:
                outcome = store_call(store, op, PROBE_JOB, PROBE)
            log = recorder.log
        finally:
            store.engine.dispose()
            engine.dispose()
            db.remove_sqlite(path)
        if outcome is None or outcome is False:
            raise SystemExit(f"recording {op}: the probe call failed ({outcome!r})")
        plans[op] = _plan(op, log)
    return plans


def _template(params: Any) -> Any:
    if isinstance(params, Mapping):
        return {k: _role(v) for k, v in params.items()}
    return tuple(_role(v) for v in params)


def _plan(op: str, log: list[tuple[Any, ...]]) -> list[Step]:
    if len(log) == 1 and log[0][0] == "conn.execute" and log[0][1].lstrip().upper().startswith("SELECT"):
        # a read the store runs as Connection.execute(...).fetchall(), outside a transaction
        return [(log[0][1], _template(log[0][2]), "direct")]
    kinds = [entry[0] for entry in log]
    if kinds.count("cursor") != 1 or any(k in ("executemany", "conn.execute") for k in kinds):
        raise SystemExit(f"recording {op}: the raw replay expects one cursor and execute() calls: {log}")
    steps: list[Step] = []
    for entry in log:
        if entry[0] == "execute":
            _, sql, params = entry
            if isinstance(params, Mapping):
                template: Any = {k: _role(v) for k, v in params.items()}
            else:
                template = tuple(_role(v) for v in params)
            steps.append((sql, template, None))
        elif entry[0] == "fetch":
            if not steps or steps[-1][2] is not None:
                raise SystemExit(f"recording {op}: a fetch without a statement: {log}")
            steps[-1] = (steps[-1][0], steps[-1][1], entry[1])
    # the library lowers the pooled connection's busy_timeout around its BEGIN and restores it
    # (its fairness among writers): its own cost, so not replayed by the raw loop
    steps = [step for step in steps if not step[0].startswith("PRAGMA busy_timeout")]
    # writes: BEGIN IMMEDIATE ... COMMIT; a read: one SELECT, which is its own snapshot
    one_read = len(steps) == 1 and steps[0][0].lstrip().upper().startswith("SELECT")
    transaction = len(steps) >= 3 and steps[0][0] == "BEGIN IMMEDIATE" and steps[-1][0] == "COMMIT"
    if not (one_read or transaction):
        raise SystemExit(f"recording {op}: expected BEGIN IMMEDIATE ... COMMIT or one SELECT, got {log}")
    return steps


def describe(plan: list[Step]) -> list[str]:
    out = []
    for sql, template, fetch in plan:
        items = template.items() if isinstance(template, Mapping) else enumerate(template)
        shown = ", ".join(f"{k}={v[1]}" if v[0] == "arg" else f"{k}={v[1]!r}" for k, v in items)
        line = " ".join(sql.split())
        out.append(line + (f"  [{shown}]" if shown else "") + (f"; {fetch}()" if fetch else ""))
    return out


def bind(plan: list[Step], job_id: str, a: Args) -> list[tuple[str, Any, str | None]]:
    """The plan's steps with this call's arguments in the recorded places."""
    values = {
        "job_id": job_id,
        "owner": a.owner,
        "result": a.result,
        "now": a.now,
        "until": a.until,
        "ttl": a.ttl,
        "fence": a.fence,
    }

    def fill(slot: tuple[str, object]) -> object:
        return values[slot[1]] if slot[0] == "arg" else slot[1]  # type: ignore[index]

    out = []
    for sql, template, fetch in plan:
        if isinstance(template, Mapping):
            args: Any = {k: fill(v) for k, v in template.items()}
        else:
            args = tuple(fill(v) for v in template)
        out.append((sql, args, fetch))
    return out


# -- the three ways -----------------------------------------------------------------------------

# given the job ids, do the untimed preparation and return the loop to time
Runner = Callable[[], None]
Loop = Callable[[list[str]], Runner]


def raw_loop(conn: sqlite3.Connection, plan: list[Step]) -> Loop:
    """The recorded transaction, once per job id, on one cursor per transaction."""
    single = (
        len(plan) == 3 and plan[0][1] == () and plan[2][1] == () and plan[0][2] is None and plan[2][2] is None
    )

    def make(ids: list[str]) -> Runner:
        calls = [bind(plan, i, BENCH) for i in ids]
        if len(plan) == 1 and plan[0][2] == "direct":
            sql, argv = plan[0][0], [steps[0][1] for steps in calls]

            def direct() -> None:  # one SELECT, its own snapshot
                for args in argv:
                    conn.execute(sql, args).fetchall()

            return direct
        if not single:

            def general() -> None:
                for steps in calls:
                    cur = conn.cursor()
                    for sql, args, fetch in steps:
                        cur.execute(sql, args)
                        if fetch is not None:
                            getattr(cur, fetch)()
                    cur.close()

            return general

        begin, (sql, _, fetch), commit = plan[0][0], plan[1], plan[2][0]
        argv = [steps[1][1] for steps in calls]

        def count() -> None:  # BEGIN IMMEDIATE; the statement; COMMIT
            for args in argv:
                cur = conn.cursor()
                cur.execute(begin)
                cur.execute(sql, args)
                cur.rowcount  # noqa: B018 -- the store reads it
                cur.execute(commit)
                cur.close()

        def rows() -> None:
            for args in argv:
                cur = conn.cursor()
                cur.execute(begin)
                cur.execute(sql, args)
                cur.fetchall()
                cur.execute(commit)
                cur.close()

        if fetch is None:
            return count
        if fetch == "fetchall":
            return rows
        return general

    return make


def store_loop(store: fencing.JobStore, op: str) -> Loop:
    b = BENCH
    owner, now, ttl, fence, result = b.owner, b.now, b.ttl, b.fence, b.result

    def make(ids: list[str]) -> Runner:
        leases = [fencing.Lease(i, owner, fence) for i in ids]  # what workers already hold

        def claim() -> None:
            for job_id in ids:
                store.claim(job_id, owner, now=now, ttl=ttl)

        def renew() -> None:
            for lease in leases:
                store.renew(lease, now=now, ttl=ttl)

        def complete() -> None:
            for lease in leases:
                store.complete(lease, result, now=now)

        def state() -> None:
            for job_id in ids:
                store.state(job_id)

        def enqueue() -> None:
            for job_id in ids:
                store.enqueue(job_id, ready_at=0.0)

        return {"claim": claim, "renew": renew, "complete": complete, "state": state, "enqueue": enqueue}[op]

    return make


def service_loop(path: str, op: str) -> Loop:
    b = BENCH
    owner, now, ttl, fence, result = b.owner, b.now, b.ttl, b.fence, b.result

    def make(ids: list[str]) -> Runner:
        def claim() -> None:
            for job_id in ids:
                service.claim(path, job_id, owner, now, ttl)

        def renew() -> None:
            for job_id in ids:
                service.renew(path, job_id, owner, fence, now, ttl)

        def complete() -> None:
            for job_id in ids:
                service.complete(path, job_id, owner, fence, now, result)

        def state() -> None:
            for job_id in ids:
                service.state(path, job_id)

        def enqueue() -> None:
            for job_id in ids:
                service.enqueue(path, job_id)

        return {"claim": claim, "renew": renew, "complete": complete, "state": state, "enqueue": enqueue}[op]

    return make


@contextmanager
def service_durability(durability: str) -> Iterator[None]:
    """``service.py`` always opens ``durability="full"``; match the row's durability."""
    original = getattr(fencing._engines, "create_engine")  # noqa: B009 -- not re-exported
    if durability != "full":
        setattr(fencing._engines, "create_engine", functools.partial(original, durability=durability))  # noqa: B010
    try:
        yield
    finally:
        setattr(fencing._engines, "create_engine", original)  # noqa: B010


def measure(op: str, durability: str, n: int, rep: int, workdir: str, plan: list[Step]) -> dict[str, float]:
    """One repetition of ``op``: ops/s of each way, the three timed in alternating chunks.

    Each way has its own database file, connection and job ids. After untimed warm-up
    calls, the N timed calls are split into CHUNKS slices; slice k of raw, store and service
    run back to back (the order rotating), so a slow stretch of the disk or a busy neighbour
    hits all three alike. Each way's rate is its N calls over the sum of its slices' times.
    """
    ids = job_ids(op, n + WARMUP)
    paths = {way: os.path.join(workdir, f"{durability}-{op}-{way}-{rep}.db") for way in WAYS}
    for path in paths.values():
        prepare(path, op, [] if op == "enqueue" else ids, BENCH)
    conn = db.sqlite_connect(paths["raw"], durability)
    store = fencing.JobStore(fencing.create_sqlite_engine(paths["store"], durability=durability))  # type: ignore[arg-type]
    elapsed = dict.fromkeys(WAYS, 0.0)
    try:
        with service_durability(durability):
            settings = fencing._runtime.sqlite.settings_of(service._stores.get(paths["service"]).engine)
            if settings is None or settings.durability != durability:
                raise SystemExit(f"service opened its file with {settings and settings.durability}")
            loops: dict[str, Loop] = {
                "raw": raw_loop(conn, plan),
                "store": store_loop(store, op),
                "service": service_loop(paths["service"], op),
            }
            for way in WAYS:
                loops[way](ids[:WARMUP])()
            gc.collect()  # once, before the clock: collections during the loops are part of the cost
            bounds = [WARMUP + (n * k) // CHUNKS for k in range(CHUNKS + 1)]
            for k in range(CHUNKS):
                runners = {way: loops[way](ids[bounds[k] : bounds[k + 1]]) for way in WAYS}
                for way in rotated(WAYS, rep + k):
                    run = runners[way]
                    start = time.perf_counter()
                    run()
                    elapsed[way] += time.perf_counter() - start
    finally:
        conn.close()
        store.engine.dispose()
        service._stores.clear()  # close the service's connections too
    for path in paths.values():
        verify(path, op, n + WARMUP)
        db.remove_sqlite(path)
    return {way: n / elapsed[way] for way in WAYS}


# -- running and reporting ----------------------------------------------------------------------


def run(durability: str, n: int, repeat: int, workdir: str) -> list[dict[str, Any]]:
    plans = record(workdir, durability)
    samples: dict[str, dict[str, list[float]]] = {op: {w: [] for w in WAYS} for op in OPS}
    for rep in range(repeat):
        for op in OPS:
            rates = measure(op, durability, n, rep, workdir, plans[op])
            for way in WAYS:
                samples[op][way].append(rates[way])
        print(f"  {durability}: repetition {rep + 1}/{repeat} done", file=sys.stderr, flush=True)
    rows = []
    for op in OPS:
        s = samples[op]
        med = {w: statistics.median(s[w]) for w in WAYS}
        # the ratio within each repetition (the three ran in alternating slices), then the median
        store_raw = [st / r for st, r in zip(s["store"], s["raw"], strict=True)]
        svc_store = [sv / st for sv, st in zip(s["service"], s["store"], strict=True)]
        rows.append(
            {
                "op": op,
                "durability": durability,
                "n": n,
                "repeat": repeat,
                "raw_ops_s": med["raw"],
                "store_ops_s": med["store"],
                "service_ops_s": med["service"],
                "store_vs_raw": statistics.median(store_raw),
                "service_vs_store": statistics.median(svc_store),
                "store_vs_raw_range": [min(store_raw), max(store_raw)],
                "service_vs_store_range": [min(svc_store), max(svc_store)],
                "store_vs_raw_of_medians": med["store"] / med["raw"],
                "service_vs_store_of_medians": med["service"] / med["store"],
                "target_store_vs_raw": TARGET_STORE_VS_RAW[durability],
                "target_service_vs_store": TARGET_SERVICE_VS_STORE,
                "samples": s,
                "transaction": describe(plans[op]),
            }
        )
    return rows


def ratio_cells(r: dict[str, Any], name: str) -> tuple[float, str, str, str]:
    """A ratio's cells: itself, its range, its target and whether it makes it."""
    ratio, (lo, hi), target = r[name], r[f"{name}_range"], r[f"target_{name}"]
    return ratio, f"{lo:.2f}-{hi:.2f}", ">=" + str(target), report.verdict(ratio >= target)


def ratio_columns(title: str) -> tuple[report.Column, ...]:
    return (
        report.Column(title, 6, spec=".2f"),
        report.Column("range", 10),
        report.Column("target", 6),
    )


TABLE = report.Table(
    report.Column("op", 9, "<"),
    report.Column("durab.", 7, "<"),
    report.Column("raw ops/s", 10, spec=",.0f"),
    report.Column("store ops/s", 12, spec=",.0f"),
    *ratio_columns("st/raw"),
    report.Column("", 4, "<"),
    report.Column("service ops/s", 14, spec=",.0f"),
    *ratio_columns("sv/st"),
    report.Column(None, 4, "<"),  # the verdict
)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(TABLE.header())
    print(TABLE.rule())
    for r in rows:
        print(
            TABLE.row(
                r["op"],
                r["durability"],
                r["raw_ops_s"],
                r["store_ops_s"],
                *ratio_cells(r, "store_vs_raw"),
                r["service_ops_s"],
                *ratio_cells(r, "service_vs_store"),
            )
        )
    print(
        "ops/s: median of the repetitions. ratio: median of the per-repetition ratios (the ways ran\n"
        "in alternating slices, so each repetition's ratio cancels the machine's drift); range: min-max."
    )


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--ops", type=int, default=None, help="timed calls per measurement (default 2000 full, 5000 normal)"
    )
    cli.add_repeat(parser, 5, help="repetitions; the median is reported (default {default})")
    cli.add_durability(parser, "both", both=True)
    cli.add_json(parser, help="write the figures (and every sample) here")
    cli.add_dir(parser, metavar="DIR", help="where the database files go (default: $TMPDIR)")
    parser.add_argument("--show-sql", action="store_true", help="print what the raw loops replay")
    cli.add_check(parser, help="exit 1 if a ratio misses its target")
    args = parser.parse_args(argv)
    if args.repeat < 1 or (args.ops is not None and args.ops < 1):
        parser.error("--ops and --repeat must be >= 1")

    durabilities = ("full", "normal") if args.durability == "both" else (args.durability,)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with db.workdir("fencing-bench-", args.dir) as workdir:
        for durability in durabilities:
            n = args.ops or DEFAULT_N[durability]
            rows.extend(run(durability, n, args.repeat, workdir))
    wall = time.perf_counter() - started

    versions = env.versions("fencing", "sqlite", "sqlalchemy", "python", "platform")
    print(
        f"fencing {versions['fencing']}; SQLite {versions['sqlite']}; "
        f"SQLAlchemy {versions['sqlalchemy']}; Python {versions['python']}; "
        f"{os.cpu_count()} CPUs; median of {args.repeat}; {wall:.0f} s"
    )
    print_table(rows)
    if args.show_sql:
        for r in rows:
            print(f"{r['op']} ({r['durability']}), per call on one cursor:")
            for line in r["transaction"]:
                print(f"    {line}")
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
            **versions,
            "cpus": os.cpu_count(),
            "repeat": args.repeat,
            "warmup": WARMUP,
            "wall_seconds": wall,
            "git": env.git_describe(dirty="+dirty"),
        }
        report.write_json(args.json, {"meta": meta, "results": rows}, say=False)
    return 1 if args.check and misses else 0


if __name__ == "__main__":
    sys.exit(main())
