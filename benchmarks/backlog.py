"""Does ``claim_next`` cost depend on the backlog? One worker's rate at 1,000 to 1,000,000 ready jobs.

What is measured
----------------
For each backend and each backlog size N (``--sizes``), a jobs table of the library's schema
is loaded with ready jobs (not timed), then this process, alone, times a fixed amount of
work on it -- the same amount at every N:

``single``
    M cycles (``--cycles``, default 500) of ``leases = store.claim_next(owner, ttl=600,
    limit=1)`` then ``store.complete(lease, "ok")``: two transactions per job; cycles/s.
``batched``
    K rounds (``--rounds``, default 20) of ``leases = store.claim_next(owner, ttl=600,
    limit=100)`` then ``store.complete_many([(lease, "ok") for lease in leases])``; jobs/s.
``step``
    Only where ``JobStore.complete_and_claim_next`` exists (skipped silently otherwise): M
    steps of ``done, leases = store.complete_and_claim_next([(lease, "ok")], owner,
    ttl=600, limit=1)``, each completing the previous step's lease and claiming the next in
    one transaction; cycles/s. The first lease comes from an untimed ``claim_next`` (before
    the warm-up), the last one is completed untimed after the last slice.

If a claim walks the ready index in claim order and stops at its LIMIT, the rate is the
same at every N; a plan that reads, filters or sorts the ready set costs time that grows
with N. ``vs <smallest>`` is each repetition's rate over the same mode's rate at the
smallest size in that repetition, shown as the median (and range) over the repetitions;
target >= 0.8.

Each measurement's table holds N + W ready jobs, W being every job the measurement takes
(warm-up, timed work and, for ``step``, the first and last lease), so the backlog goes from
N + W down to exactly N and never below it; for ``batched`` at N = 1,000, W (2,200) is larger
than N. The jobs are ``job-00000001``, ``job-00000002``... with ``until = 0``
(``--layout tied``, the contract's "ready at once" row that ``enqueue(id, ready_at=0.0)``
writes; every job ties, so the claim order is the id order: the worst case for a plan that
sorts) or ``until`` = 1 ms times the job's number (``--layout spread``: distinct ready
times, long past, in id order). ``fence = 0``, ``done = 0``, no owner. Loading
(``--load``): ``server`` generates the rows in the database in one ``INSERT ... SELECT``
(SQLite a recursive CTE, PostgreSQL ``generate_series``, MariaDB the sequence engine's
``seq_1_to_N``); ``executemany`` sends them from Python in chunks of 10,000, ids bound as
``bindparam("k", type_=fencing._sql.schema.KEY_TYPE)`` (bytes on MariaDB). The table is made by
``fencing.JobStore(engine, fencing.jobs_table(MetaData(), name)).create_table()`` -- so it
has whatever index the library makes -- before the rows go in. ``--analyze`` runs
``ANALYZE`` after loading; by default there is none, but PostgreSQL's autovacuum may
analyze a freshly loaded table on its own (checked: see below), and InnoDB computes its
persistent statistics itself.

Backends:

``sqlite``
    ``fencing.create_sqlite_engine(path, durability=...)`` (``--durability``, default
    ``normal``: no fsync per commit, which is what the backlog issue measured; ``full`` is
    the library's default). A fresh file per measurement, in ``--dir`` (default: a
    temporary directory under the working directory), deleted after it.
``postgresql`` / ``mariadb``
    ``sqlalchemy.create_engine(url)`` per measurement (``--postgresql-url``,
    ``--mariadb-url``), on dedicated tables ``bench_backlog_<pid>_<k>``, dropped and made
    afresh for every measurement and dropped at the end.

Clock: the database's (``now=None``) by default; ``--clock caller`` passes
``now=time.time()`` to every call.

Timing and interleaving: for one (backend, mode) the tables of all sizes are loaded first,
each store does an untimed warm-up (20 cycles or steps, 2 batched rounds: connection open,
statements compiled, psycopg's statements prepared), then the timed work is cut into
``--slices`` slices (default 5) and slice k of every size runs back to back, the sizes'
order rotating from slice to slice, so a slow spell of the disk or of the machine's other
load hits every size alike. A size's time is the sum of its slices (``perf_counter``;
Python's garbage collector off during a slice, as ``timeit`` does); ``--repeat R``
(default 3) repetitions, the backends' and modes' order rotating; rates are medians.
``call ms`` is the latency of every claiming call (``claim_next``, or the step) over all
repetitions (p50/p99), ``cpu us/job`` this process's CPU time per job (the client's share
of the cost), ``load s`` the median untimed load time.

Checks: every claim must return its ``limit`` of leases and every completion be accepted
(else counted in ``errors``, the first few kept and printed; an exception a call raises is
counted the same way and the loop goes on). After each measurement the table must hold
exactly W jobs done with fence 1 and N untouched, and the jobs done must be the first W ids
(the claim order is the ready order, ties by id); a miss is printed as ``CHECK``. On
PostgreSQL the end of each measurement also reads whether the table had planner statistics
(``pg_stats``), and says so when it had them without ``--analyze``.

``--explain`` (first repetition only) then records, on a second engine with a
``before_cursor_execute`` listener, the statements one ``claim_next`` sends, and shows their
plans on the table as it is after the measurement: SQLite ``EXPLAIN QUERY PLAN``,
PostgreSQL ``EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)`` and MariaDB ``ANALYZE``, both executed
in a transaction that is rolled back.

Reproduce
---------
::

    python benchmarks/backlog.py                                   # all three, 1e3..1e6, R=3
    python benchmarks/backlog.py --sizes 1000,10000,100000 --repeat 2
    python benchmarks/backlog.py --backends sqlite --durability full --layout spread
    python benchmarks/backlog.py --backends postgresql --sizes 1000,1000000 --explain

``--json FILE`` writes every figure; ``--check`` exits with status 1 when a ratio misses
its target or a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import sqlite3
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy
from harness import cli, db, dbapi, env, report
from harness.measure import rotated
from sqlalchemy import Double, Engine, MetaData, bindparam, func, select, text, type_coerce

import fencing
from fencing._sql.schema import KEY_TYPE

BACKENDS = ("sqlite", "postgresql", "mariadb")
ALL_MODES = ("single", "batched", "step")
#: jobs per unit of work: a cycle or step takes one, a batched round takes BATCH
BATCH = 100
LIMITS = {"single": 1, "batched": BATCH, "step": 1}
WARMUP_UNITS = {"single": 20, "batched": 2, "step": 20}
TTL = 600.0  # no lease expires during a measurement
OWNER = "bench-worker"
RESULT = "ok"
TARGET = 0.8
CHUNK = 10_000
MAX_ERRORS = 50  # per measurement; past that the run stops
KEPT_ERRORS = 5
#: what the header and the JSON say the run measured with (the drivers where installed)
VERSIONS = ("fencing", "sqlite", "sqlalchemy", "python", "platform", "cpus", "git", "psycopg", "PyMySQL")


def job_id(number: int) -> str:
    """The id of job ``number`` (1-based); ids sort in number order."""
    return f"job-{number:08d}"


def available_modes() -> tuple[str, ...]:
    return tuple(m for m in ALL_MODES if m != "step" or hasattr(fencing.JobStore, "complete_and_claim_next"))


def units_of(args: argparse.Namespace, mode: str) -> int:
    """The timed units of work of ``mode``: cycles, rounds or steps."""
    return int(args.rounds if mode == "batched" else args.cycles)


def jobs_taken(args: argparse.Namespace, mode: str) -> int:
    """W: every job one measurement of ``mode`` takes off the backlog (all completed)."""
    taken = (WARMUP_UNITS[mode] + units_of(args, mode)) * LIMITS[mode]
    return taken + (1 if mode == "step" else 0)  # the step loop's first lease


# -- one loaded table and the store that works on it -------------------------------------------


class Lane:
    """A jobs table holding a backlog of ``size`` (+ W) ready jobs, and its store."""

    def __init__(self, backend: Backend, mode: str, size: int, slot: int) -> None:
        self.backend = backend
        self.mode = mode
        self.size = size
        self.taken = jobs_taken(backend.args, mode)
        self.name = f"bench_backlog_{os.getpid()}_{slot}"
        self.path: str | None = None
        if backend.name == "sqlite":
            backend.counter += 1
            self.path = os.path.join(backend.workdir, f"backlog-{backend.counter}.db")
        self.table = fencing.jobs_table(MetaData(), self.name)
        self.engine = self.make_engine()
        self.store = fencing.JobStore(self.engine, self.table)
        self.lease: fencing.Lease | None = None  # the step loop's current lease
        self.seconds = 0.0
        self.cpu = 0.0
        self.jobs = 0
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.load_s = 0.0
        self.had_statistics: bool | None = None

    def make_engine(self) -> Engine:
        if self.path is not None:
            return fencing.create_sqlite_engine(self.path, durability=self.backend.args.durability)
        return sqlalchemy.create_engine(self.backend.url)

    # -- loading (not timed) ---------------------------------------------------------------

    def load(self) -> None:
        args = self.backend.args
        total = self.size + self.taken
        t0 = time.perf_counter()
        if self.path is None:
            with self.engine.begin() as conn:
                self.table.drop(conn, checkfirst=True)
        self.store.create_table()
        with self.engine.begin() as conn:
            if args.load == "server":
                conn.execute(self.generate_sql(total))
            else:
                stmt = self.table.insert().values(
                    id=bindparam("k", type_=KEY_TYPE), until=bindparam("u", type_=Double())
                )
                spread = args.layout == "spread"
                for first in range(1, total + 1, CHUNK):
                    last = min(first + CHUNK, total + 1)
                    conn.execute(
                        stmt,
                        [{"k": job_id(i), "u": i * 0.001 if spread else 0.0} for i in range(first, last)],
                    )
        with self.engine.begin() as conn:
            count = conn.execute(select(func.count()).select_from(self.table)).scalar_one()
            if count != total:
                raise SystemExit(f"{self.backend.name}: loaded {count} rows, expected {total}")
            if args.analyze:
                quoted = conn.dialect.identifier_preparer.format_table(self.table)
                statement = {"mariadb": f"ANALYZE TABLE {quoted}"}.get(self.backend.name, f"ANALYZE {quoted}")
                result = conn.exec_driver_sql(statement)
                if result.returns_rows:  # MariaDB's ANALYZE TABLE answers with a status row
                    result.fetchall()
        self.load_s = time.perf_counter() - t0

    def generate_sql(self, total: int) -> Any:
        """One ``INSERT ... SELECT`` making jobs 1..total in the database."""
        spread = self.backend.args.layout == "spread"
        with self.engine.connect() as conn:
            table = conn.dialect.identifier_preparer.format_table(self.table)
        if self.backend.name == "sqlite":
            until = "i * 0.001" if spread else "0"
            return text(
                "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < :n) "
                f"INSERT INTO {table} (id, until) SELECT printf('job-%08d', i), {until} FROM seq"
            ).bindparams(n=total)
        if self.backend.name == "postgresql":
            until = "i * 0.001" if spread else "0"
            return text(
                f"INSERT INTO {table} (id, until) SELECT 'job-' || lpad(i::text, 8, '0'), {until} "
                "FROM generate_series(1, :n) AS s(i)"
            ).bindparams(n=total)
        until = "seq * 0.001" if spread else "0"
        return text(  # the sequence engine: seq_1_to_<n> is a table of 1..n
            f"INSERT INTO {table} (id, until) SELECT CONCAT('job-', LPAD(seq, 8, '0')), {until} "
            f"FROM seq_1_to_{int(total)}"
        )

    # -- the timed work ----------------------------------------------------------------------

    def problem(self, message: str) -> None:
        self.errors.append(message)
        if len(self.errors) >= MAX_ERRORS:
            raise SystemExit(
                f"{self.backend.name}/{self.mode}/N={self.size}: {len(self.errors)} errors, "
                f"stopping; first: {self.errors[:KEPT_ERRORS]}"
            )

    def failed(self, call: str, exc: Exception) -> None:
        self.problem(f"{call}: {type(exc).__name__}: {exc}"[:300])

    def warm_up(self) -> None:
        if self.mode == "step":
            leases = self.store.claim_next(OWNER, ttl=TTL, now=self.backend.now(), limit=1)
            if len(leases) != 1:
                raise SystemExit(f"{self.backend.name}: the first claim_next found {len(leases)} jobs")
            self.lease = leases[0]
        self.run(WARMUP_UNITS[self.mode])

    def timed(self, units: int) -> None:
        """``units`` of the mode's work, timed, added to this lane's totals."""
        gc.collect()
        gc.disable()
        try:
            cpu, t0 = time.process_time(), time.perf_counter()
            jobs = self.run(units)
            self.seconds += time.perf_counter() - t0
            self.cpu += time.process_time() - cpu
            self.jobs += jobs
        finally:
            gc.enable()

    def run(self, units: int) -> int:
        """The loop itself; the jobs it completed."""
        latencies = self.latencies
        clock = time.perf_counter
        now = self.backend.now
        store = self.store
        done_jobs = 0
        if self.mode == "single":
            claim_next, complete = store.claim_next, store.complete
            for _ in range(units):
                t0 = clock()
                try:
                    leases = claim_next(OWNER, ttl=TTL, now=now(), limit=1)
                except Exception as exc:
                    self.failed("claim_next", exc)
                    continue
                latencies.append(clock() - t0)
                if len(leases) != 1:
                    self.problem(f"claim_next(limit=1) returned {len(leases)} leases")
                for lease in leases:
                    try:
                        if complete(lease, RESULT, now=now()):
                            done_jobs += 1
                        else:
                            self.problem(f"complete refused {lease}")
                    except Exception as exc:
                        self.failed("complete", exc)
        elif self.mode == "batched":
            claim_next, complete_many = store.claim_next, store.complete_many
            for _ in range(units):
                t0 = clock()
                try:
                    leases = claim_next(OWNER, ttl=TTL, now=now(), limit=BATCH)
                except Exception as exc:
                    self.failed("claim_next", exc)
                    continue
                latencies.append(clock() - t0)
                if len(leases) != BATCH:
                    self.problem(f"claim_next(limit={BATCH}) returned {len(leases)} leases")
                try:
                    accepted = complete_many([(lease, RESULT) for lease in leases], now=now())
                except Exception as exc:
                    self.failed("complete_many", exc)
                    continue
                done_jobs += sum(map(bool, accepted))
                if not all(accepted):
                    self.problem(f"complete_many refused {accepted.count(False)} of {len(leases)}")
        else:
            step = store.complete_and_claim_next
            for _ in range(units):
                if self.lease is None:
                    raise SystemExit(f"{self.backend.name}/step/N={self.size}: no lease to go on with")
                t0 = clock()
                try:
                    accepted, leases = step([(self.lease, RESULT)], OWNER, ttl=TTL, now=now(), limit=1)
                except Exception as exc:
                    self.failed("complete_and_claim_next", exc)
                    continue
                latencies.append(clock() - t0)
                done_jobs += sum(map(bool, accepted))
                if accepted != [True]:
                    self.problem(f"complete_and_claim_next accepted {accepted} for {self.lease}")
                if len(leases) != 1:
                    self.problem(f"complete_and_claim_next(limit=1) returned {len(leases)} leases")
                self.lease = leases[0] if leases else None
        return done_jobs

    def finish(self) -> None:
        """The step loop's last lease, completed (untimed)."""
        if self.lease is not None:
            if not self.store.complete(self.lease, RESULT, now=self.backend.now()):
                self.problem(f"the last lease was refused: {self.lease}")
            self.lease = None

    # -- after the measurement ---------------------------------------------------------------

    def verify(self) -> str | None:
        """What is wrong with the table after the measurement, or ``None``."""
        t = self.table
        with self.engine.connect() as conn:
            groups = conn.execute(
                select(t.c.done, t.c.fence, func.count()).group_by(t.c.done, t.c.fence)
            ).all()
            last_done = conn.execute(
                select(func.max(type_coerce(t.c.id, KEY_TYPE))).where(t.c.done == 1)
            ).scalar()
            if self.backend.name == "postgresql":
                self.had_statistics = bool(
                    conn.execute(
                        text("SELECT count(*) FROM pg_stats WHERE tablename = :t"), {"t": self.name}
                    ).scalar()
                )
        counts = {(int(done), int(fence)): int(n) for done, fence, n in groups}
        problems = []
        expected = {(1, 1): self.taken, (0, 0): self.size}
        if counts != expected:
            problems.append(f"rows by (done, fence): {counts}, expected {expected}")
        if last_done != job_id(self.taken):
            problems.append(
                f"the last job done is {last_done!r}, expected {job_id(self.taken)!r} (claim order)"
            )
        return "; ".join(problems) or None

    def explain(self) -> list[str]:
        """The plans of the statements one ``claim_next`` sends, on the table as it is now."""
        probe = self.make_engine()
        limit = LIMITS[self.mode]
        try:
            store = fencing.JobStore(probe, fencing.jobs_table(MetaData(), self.name))
            with dbapi.statements(probe) as recorded:
                leases = store.claim_next(OWNER, ttl=TTL, now=self.backend.now(), limit=limit)
            store.complete_many([(lease, RESULT) for lease in leases], now=self.backend.now())
        finally:
            probe.dispose()
        lines = [f"{self.backend.name} N={self.size} claim_next(limit={limit}):"]
        prefix = {
            "sqlite": "EXPLAIN QUERY PLAN ",
            "postgresql": "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) ",
            "mariadb": "ANALYZE ",
        }[self.backend.name]
        for sql, params in recorded:
            if sql.split(None, 1)[0].upper() not in ("SELECT", "UPDATE", "WITH", "DELETE", "INSERT"):
                continue  # BEGIN, COMMIT, PRAGMA...
            lines.append("  " + re.sub(r"\s+", " ", sql).strip()[:400])
            with self.engine.connect() as conn:
                try:
                    result = conn.exec_driver_sql(prefix + sql, params)
                    keys = list(result.keys())
                    rows = result.all()
                finally:
                    conn.rollback()
            for row in rows:
                if self.backend.name == "sqlite":
                    lines.append(f"    {row[-1]}")
                elif self.backend.name == "postgresql":
                    lines.append(f"    {row[0]}")
                else:
                    cells = dict(zip(keys, row, strict=True))
                    wanted = ("table", "type", "key", "rows", "r_rows", "filtered", "r_filtered", "Extra")
                    lines.append("    " + ", ".join(f"{k}={cells.get(k)}" for k in wanted if k in cells))
        return lines

    def close(self) -> None:
        if self.path is None:
            with contextlib.suppress(Exception), self.engine.begin() as conn:
                self.table.drop(conn, checkfirst=True)
        self.engine.dispose()
        if self.path is not None:
            db.remove_sqlite(self.path)


class Backend:
    """Where one backend's tables live, and what the header says about it."""

    def __init__(self, name: str, args: argparse.Namespace, workdir: str) -> None:
        self.name = name
        self.args = args
        self.workdir = workdir
        self.counter = 0
        self.url: str = cli.server_urls(args).get(name, "")
        self.now: Callable[[], float | None] = time.time if args.clock == "caller" else _no_time

    def info(self) -> str:
        if self.name == "sqlite":
            return f"SQLite {sqlite3.sqlite_version} (WAL, synchronous={self.args.durability.upper()})"
        engine = sqlalchemy.create_engine(self.url)
        try:
            settings = env.server_settings(
                engine, postgresql=("autovacuum",), mariadb=("innodb_stats_auto_recalc",)
            )
        finally:
            engine.dispose()
        version = settings.pop("version")
        if "innodb_stats_auto_recalc" in settings:
            settings["stats_auto_recalc"] = settings.pop("innodb_stats_auto_recalc")
        server = "PostgreSQL" if self.name == "postgresql" else "MariaDB"
        return f"{server} {version} ({', '.join(f'{k}={v}' for k, v in settings.items())})"

    def leftovers(self) -> None:
        """Drop this process's tables, should a failed run have left any."""
        if self.name == "sqlite":
            return
        engine = sqlalchemy.create_engine(self.url)
        try:
            with engine.begin() as conn:
                for slot in range(len(self.args.sizes)):
                    name = f"bench_backlog_{os.getpid()}_{slot}"
                    fencing.jobs_table(MetaData(), name).drop(conn, checkfirst=True)
        finally:
            engine.dispose()


def _no_time() -> float | None:
    return None


# -- one measurement: every size of one (backend, mode), interleaved ----------------------------


def measure(
    backend: Backend, mode: str, rep: int, explained: set[tuple[str, int, int]] | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every size's figures for one repetition of ``mode`` on ``backend``; the plans of the
    claims not ``explained`` yet, if asked (``explained`` is not ``None``)."""
    args = backend.args
    lanes: list[Lane] = []
    plans: list[str] = []
    try:
        for slot, size in enumerate(args.sizes):
            lane = Lane(backend, mode, size, slot)
            lanes.append(lane)
            lane.load()
        for lane in lanes:
            lane.warm_up()
        units = units_of(args, mode)
        order = lanes if rep % 2 == 0 else lanes[::-1]
        for k in range(args.slices):
            part = units * (k + 1) // args.slices - units * k // args.slices
            for lane in rotated(order, k):
                lane.timed(part)
        results = []
        for lane in lanes:
            lane.finish()
            problem = lane.verify()
            results.append(
                {
                    "size": lane.size,
                    "jobs": lane.jobs,
                    "seconds": lane.seconds,
                    "rate": lane.jobs / lane.seconds if lane.seconds else 0.0,
                    "cpu_s": lane.cpu,
                    "latencies": lane.latencies,
                    "errors": lane.errors,
                    "load_s": lane.load_s,
                    "check": problem,
                    "had_statistics": lane.had_statistics,
                    "taken": lane.taken,
                }
            )
            key = (backend.name, lane.size, LIMITS[mode])
            if explained is not None and key not in explained:
                explained.add(key)
                try:
                    plans.extend(lane.explain())
                except Exception as exc:  # a plan is a diagnosis: its failure is shown, not fatal
                    plans.append(f"{backend.name} N={lane.size}: EXPLAIN failed: {type(exc).__name__}: {exc}")
        return results, plans
    finally:
        for lane in lanes:
            lane.close()


# -- figures ------------------------------------------------------------------------------------


def summarize(
    runs: dict[tuple[str, str], list[list[dict[str, Any]]]], sizes: list[int]
) -> list[dict[str, Any]]:
    """One row per (backend, mode, size): medians over the repetitions, ratios to the smallest."""
    rows = []
    smallest = min(sizes)
    order = {b: i for i, b in enumerate(BACKENDS)}
    for (backend, mode), reps in sorted(
        runs.items(), key=lambda kv: (order[kv[0][0]], ALL_MODES.index(kv[0][1]))
    ):
        for size in sizes:
            mine = [next(r for r in rep if r["size"] == size) for rep in reps]
            base = [next(r for r in rep if r["size"] == smallest) for rep in reps]
            ratios = [m["rate"] / b["rate"] for m, b in zip(mine, base, strict=True) if b["rate"]]
            latencies = [x for r in mine for x in r["latencies"]]
            jobs = sum(r["jobs"] for r in mine)
            errors = [e for r in mine for e in r["errors"]]
            rows.append(
                {
                    "backend": backend,
                    "mode": mode,
                    "size": size,
                    "rate": statistics.median(r["rate"] for r in mine),
                    "rates": [r["rate"] for r in mine],
                    "ratio": statistics.median(ratios) if ratios and size != smallest else None,
                    "ratios": ratios,
                    "call_ms_p50": report.percentile(latencies, 0.5) * 1e3,
                    "call_ms_p99": report.percentile(latencies, 0.99) * 1e3,
                    "cpu_us_per_job": sum(r["cpu_s"] for r in mine) / jobs * 1e6 if jobs else 0.0,
                    "load_s": statistics.median(r["load_s"] for r in mine),
                    "errors": len(errors),
                    "error_samples": errors[:KEPT_ERRORS],
                    "checks": [r["check"] for r in mine if r["check"]],
                    "statistics_seen": sum(bool(r["had_statistics"]) for r in mine),
                    "taken": mine[0]["taken"],
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]], sizes: list[int]) -> None:
    table = report.Table(
        report.Column("backend", 10, "<"),
        report.Column("mode", 7, "<"),
        report.Column("backlog", 9, spec=","),
        report.Column("rate/s", 9, spec=",.0f"),
        report.Column("range", 13),
        report.Column(f"vs {min(sizes):,}", 9),
        report.Column("range", 11),
        report.Column("target", 6),
        report.Column("", 4, "<"),
        report.Column("call ms p50/p99", 15),
        report.Column("cpu us/job", 10, spec=".0f"),
        report.Column("load s", 7, spec=".1f"),
        report.Column("errors", 6),
    )
    print(table.header())
    print(table.rule())
    for r in rows:
        if r["ratio"] is None:
            ratio = ratio_range = target = verdict = ""
        else:
            ratio, ratio_range = f"{r['ratio']:.2f}", report.spread(r["ratios"])
            target, verdict = f">={TARGET}", report.verdict(r["ratio"] >= TARGET)
        print(
            table.row(
                r["backend"],
                r["mode"],
                r["size"],
                r["rate"],
                report.spread(r["rates"], ",.0f"),
                ratio,
                ratio_range,
                target,
                verdict,
                f"{r['call_ms_p50']:.2f}/{r['call_ms_p99']:.2f}",
                r["cpu_us_per_job"],
                r["load_s"],
                r["errors"],
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__, epilog="See the module docstring (what is measured, how, and the checks).")
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        type=cli.comma_list(str),
        help="comma-separated: sqlite,postgresql,mariadb (default all three)",
    )
    parser.add_argument(
        "--sizes",
        default="1000,10000,100000,1000000",
        type=cli.comma_list(int),
        help="backlog sizes N, comma-separated; ratios are to the smallest (default 1000,...,1000000)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(available_modes()),
        type=cli.comma_list(str),
        help=f"comma-separated, of {','.join(available_modes())} (default all; step where the API has it)",
    )
    parser.add_argument(
        "--cycles", type=int, default=500, help="M: timed cycles of single and step (default 500)"
    )
    cli.add_rounds(parser, 20, help=f"K: timed rounds of batched, {BATCH} jobs each (default 20)")
    cli.add_repeat(parser)
    parser.add_argument(
        "--slices",
        type=int,
        default=5,
        help="the timed work is cut into this many interleaved slices (default 5)",
    )
    parser.add_argument(
        "--layout",
        choices=("tied", "spread"),
        default="tied",
        help="tied: until = 0 for every job (default, the worst case); spread: until 1 ms apart",
    )
    parser.add_argument(
        "--load",
        choices=("server", "executemany"),
        default="server",
        help="how the rows go in (default server)",
    )
    parser.add_argument("--analyze", action="store_true", help="run ANALYZE after loading (default: none)")
    parser.add_argument(
        "--clock",
        choices=("database", "caller"),
        default="database",
        help="now=None (default) or time.time()",
    )
    cli.add_durability(parser, "normal", help="SQLite's (default normal)")
    cli.add_dir(parser)
    cli.add_server_urls(parser)
    parser.add_argument("--explain", action="store_true", help="print the claim's plans (first repetition)")
    cli.add_json(parser)
    cli.add_check(parser, help="exit 1 if a ratio misses its target or a check fails")
    args = parser.parse_args(argv)
    unknown = [b for b in args.backends if b not in BACKENDS] + [m for m in args.modes if m not in ALL_MODES]
    if unknown:
        parser.error(f"unknown backend or mode: {', '.join(unknown)}")
    args.backends = [b for b in BACKENDS if b in args.backends]
    args.modes = [m for m in available_modes() if m in args.modes]
    args.sizes = sorted(set(args.sizes))
    if not args.backends or not args.modes or not args.sizes or min(args.sizes) < 1:
        parser.error("need a backend, a mode and sizes >= 1")
    if min(args.cycles, args.rounds, args.repeat, args.slices) < 1:
        parser.error("--cycles, --rounds, --repeat and --slices must be >= 1")
    if max(args.sizes) + max(jobs_taken(args, m) for m in args.modes) > 99_999_999:
        parser.error("job ids have 8 digits: sizes must stay below 99,999,999")

    versions = env.versions(*VERSIONS, missing="omit")
    print(
        f"claim_next cost vs backlog: fencing {versions['fencing']}; SQLite {versions['sqlite']}; "
        f"SQLAlchemy {versions['sqlalchemy']}; Python {versions['python']}; {versions['cpus']} CPUs; "
        f"git {versions['git']}",
        flush=True,
    )
    work = ", ".join(
        f"{m} {units_of(args, m)} {'rounds' if m == 'batched' else 'cycles'} (W={jobs_taken(args, m)})"
        for m in args.modes
    )
    print(
        f"  sizes {','.join(f'{n:,}' for n in args.sizes)}; {work}; R={args.repeat}, {args.slices} slices; "
        f"layout {args.layout}, {args.clock} clock, load {args.load}, "
        f"{'ANALYZE after loading' if args.analyze else 'no ANALYZE'}",
        flush=True,
    )
    started = time.perf_counter()
    with db.workdir("bench-backlog-", args.dir or os.getcwd()) as workdir:
        runs, plans = bench(args, workdir, started)

    rows = summarize(runs, args.sizes)
    print()
    print_table(rows, args.sizes)
    print(
        f"rate/s: cycles/s (single, step) or jobs/s (batched), median of {args.repeat}; range: min-max. "
        f"vs {min(args.sizes):,}: median (range) of the per-repetition ratios to the smallest backlog. "
        f"{time.perf_counter() - started:.0f} s"
    )
    problems: list[str] = []
    for r in rows:
        where = f"{r['backend']} {r['mode']} N={r['size']:,}"
        problems.extend(f"CHECK {where}: {c}" for c in r["checks"])
        problems.extend(f"ERROR {where}: {e}" for e in r["error_samples"])
    for line in problems:
        print(line)
    if not args.analyze:
        for name in ("postgresql",):
            seen = [r for r in rows if r["backend"] == name and r["statistics_seen"]]
            if seen:
                total = sum(r["statistics_seen"] for r in seen)
                cells = ", ".join(f"{r['mode']} N={r['size']:,}" for r in seen)
                print(
                    f"note: {name} tables had planner statistics (autovacuum's ANALYZE) at the end of "
                    f"{total} measurement(s) without --analyze: {cells}"
                )
    if plans:
        print("\nplans (--explain, first repetition, after the measurement):")
        for line in plans:
            print(line)
    misses = [r for r in rows if r["ratio"] is not None and r["ratio"] < TARGET]
    if args.json:
        figures = {
            "benchmark": "claim_next cost vs backlog",
            "environment": versions,
            "arguments": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "target": TARGET,
            "rows": rows,
            "plans": plans,
        }
        report.write_json(args.json, figures)
    return 1 if args.check and (misses or problems) else 0


def bench(
    args: argparse.Namespace, workdir: str, started: float
) -> tuple[dict[tuple[str, str], list[list[dict[str, Any]]]], list[str]]:
    """Every (backend, mode)'s results, one list of sizes per repetition; the plans asked for."""
    backends = {name: Backend(name, args, workdir) for name in args.backends}
    runs: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    plans: list[str] = []
    explained: set[tuple[str, int, int]] | None = set() if args.explain else None
    try:
        for backend in backends.values():
            print(f"  {backend.name}: {backend.info()}", flush=True)
        for rep in range(args.repeat):
            for name in rotated(list(backends), rep):
                for mode in rotated(args.modes, rep):
                    results, found = measure(backends[name], mode, rep, explained if rep == 0 else None)
                    runs.setdefault((name, mode), []).append(results)
                    plans.extend(found)
            print(
                f"  repetition {rep + 1}/{args.repeat} done ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    finally:
        for backend in backends.values():
            with contextlib.suppress(Exception):
                backend.leftovers()
    return runs, plans


if __name__ == "__main__":
    sys.exit(main())
