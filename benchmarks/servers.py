"""Claim -> complete throughput on PostgreSQL and MariaDB: raw driver vs ``fencing.JobStore``.

What is measured
----------------
Jobs per second through the whole life of a job: ``claim`` (one transaction) then
``complete`` (another transaction), both committed, for N freshly enqueued jobs, two ways:

``raw``
    The driver itself -- ``psycopg.connect`` / ``pymysql.connect`` with the connect arguments
    SQLAlchemy's dialect derives from the URL (for pymysql that includes the ``FOUND_ROWS``
    client flag the store's row counts rely on) -- executing the SQL text the library's Core
    statements compile to for the engine's dialect (``fencing._sql.statements``), with the same
    bind parameters, in the same transactions: PostgreSQL in autocommit, as the store runs a
    single statement there, ``UPDATE ... RETURNING`` (its own transaction, one round trip),
    then the guarded ``UPDATE`` of ``complete``; MariaDB with autocommit off, ``UPDATE``, (on
    a row count of 1) ``SELECT fence, until``, ``COMMIT``, then the guarded ``UPDATE`` and
    ``COMMIT``. One cursor, reused; job ids, owner and
    result converted before the clock starts by the library's own bind processors (UTF-8
    bytes for MariaDB's id and owner columns). No argument checks, no result objects: it is
    the floor.
``store``
    ``fencing.JobStore(sqlalchemy.create_engine(url), table)``: ``store.claim(id, owner,
    ttl=60, now=...)`` then ``store.complete(lease, "ok", now=...)``. Nothing observes the
    engine, so the store runs these on its fast path (``fencing._runtime.execution.Runner``):
    statements compiled once for the dialect and executed on a connection checked out of the
    engine's pool for each operation (``fencing.checkout``) and returned with its
    transaction ended, one driver transaction per operation. SQLAlchemy's ``Connection`` and
    the pool's reset-on-return are not on this path; the pool's accounting is.

Before timing, one claim -> complete of each way runs on a *recording driver connection*
and the two transcripts must be identical, else the run stops; ``--show-sql`` prints them.
The recorder is a subclass of the driver's own connection and cursor classes (psycopg
``Connection``/``Cursor``, pymysql ``Connection``/``Cursor``) that logs every
``execute(sql, params)``, ``executemany``, ``fetch*``, ``commit()`` and ``rollback()`` before
passing it on. The raw way gets one directly; the store gets one through a SQLAlchemy
``do_connect`` listener on a probe engine, which returns the recording connection in place
of the driver's, so whatever the store does with the DBAPI connection -- through
SQLAlchemy or around it -- is seen at the level the server sees it. The probe store's
connection is opened (and SQLAlchemy's first-connect initialization run) by an untimed
``state()`` before recording starts; a transcript that is empty, or that differs in one
statement, parameter, fetch, commit or rollback, stops the run. What the transcripts do not
show, because it never reaches the server: the store opens and closes a client-side cursor
per operation where the raw way reuses one, and it passes psycopg SQLAlchemy's adapter map
(``context=``), which the raw way drops.

Clocks: ``caller`` passes ``now=time.time()`` to every call (read in the loop, both ways);
``database`` passes ``now=None`` so the statements read the server's clock (the raw way
executes the same database-clock SQL). The database clock is measured at 1 process by
default (``--database-clock-at 1,4`` adds it at 4).

Concurrency: 1 and 4 worker processes (``multiprocessing`` "spawn"), started once per
database and kept for the whole run, each holding its own engine (so its own pool) and its
own raw connection. Each process works through its own contiguous slice of the N job ids
(N/P each) rather than all racing over the same ids: every claim then finds a claimable row
and no process queues on another's row lock, so the figure is the throughput of the
claim -> complete cycle itself (racing, 3 of 4 claims per job would lose: no-op UPDATEs that
still commit, mixed into the figure). The processes start together on a barrier after an
untimed warm-up (20 cycles each, on extra jobs of their own: connections open, psycopg's
prepared statements and the store's compiled statements built); jobs/s = N / (last finish -
first start). Every claim must get a lease and every complete must return True, else the
run stops. Each process also reports its CPU time: ``client CPU us/job`` (all processes'
CPU seconds / N) is the client-side cost of a job, which, unlike wall time, barely depends
on disk or on other load on the machine.

The run uses a dedicated table, ``bench_servers_<pid>`` (the library's schema,
``fencing.jobs_table``), emptied and refilled with exactly the measurement's jobs before
every measurement (``TRUNCATE``, one bulk insert, ``ANALYZE`` on PostgreSQL; not timed) and
dropped at the end. Interleaving: within a repetition, each (processes, clock) row runs in
``--rounds`` rounds (default 4) of N/rounds jobs, and in every round raw and store run back to
back, which goes first alternating from round to round; the rows' order rotates between
repetitions. A repetition's jobs/s for a way is its jobs over its time summed over the
rounds, so a slow spell of the disk or of the machine's other load, which on a shared
2-core machine lasts seconds, hits both ways alike. ``raw jobs/s`` and ``store jobs/s`` are
medians of R repetitions; ``store/raw`` is the median of the R per-repetition ratios (target
>= 0.7x), which a slow spell that hits one repetition of both ways does not move, unlike the
ratio of the two medians (also in the JSON); ``per-rep ratios`` is their range, a direct
view of the noise.

Durability is the servers' own (PostgreSQL ``synchronous_commit``, MariaDB
``innodb_flush_log_at_trx_commit``, printed in the header): every COMMIT may wait for the
disk, which both ways pay alike. On 2 cores, 4 processes are CPU-bound (clients and server
share the cores), so there the store's extra client CPU per job shows most.

Reproduce
---------
::

    python benchmarks/servers.py                  # both databases, N=1000, R=3 x 4 rounds, 1 and 4 processes
    python benchmarks/servers.py --jobs 2000 --repeat 5 --json servers.json   # quiet machine
    python benchmarks/servers.py --db mariadb --processes 1 --show-sql --profile

URLs default to the local test servers (``--postgresql-url``, ``--mariadb-url`` override).
``--profile`` then runs the store loop once more in this process (caller clock, N jobs) with
one cProfile profiler around the claims and another around the completes, and prints per
operation the microseconds in the driver calls (execute, fetch, commit, rollback, cursors),
in the rest of ``Runner.run`` (fencing's execution layer, with the pool checkout), in the store's own code
(argument checks, parameters, ``Lease``) and, as a check that it is off the path, in
SQLAlchemy, then the top functions.
``--json FILE`` writes every figure, the per-repetition runs, the SQL transcripts and the
profile. ``--check`` exits with status 1 when a ratio misses the target.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import sqlalchemy
from harness import cli, dbapi, env, report
from harness.db import refill
from harness.measure import BARRIER_TIMEOUT, Handler, Pool, rotated, timed
from sqlalchemy import Engine, MetaData, Table

import fencing
from fencing._runtime.execution import Runner
from fencing._sql.statements import Statements

WAYS = ("raw", "store")
CLOCKS = ("caller", "database")
TTL = 60.0
RESULT = "ok"
WARMUP = 20  # untimed cycles per process before every measurement
TARGET = 0.7
PROBE_NOW = 1000.25
#: what the header and the JSON say the run measured with
VERSIONS = ("git", "python", "sqlalchemy", "psycopg", "PyMySQL", "fencing", "platform", "cpus")

NowFn = Callable[[], "float | None"]


def owner_of(index: int) -> str:
    return f"bench-worker-{index}"


def now_fn(clock: str) -> NowFn:
    return time.time if clock == "caller" else lambda: None


# -- the raw way: the library's statements compiled once, run on the driver ---------------------


def compile_for(stmt: Any, dialect: sqlalchemy.Dialect) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """SQL text for ``dialect``, the constant bind values (e.g. ``done_1 = 0``, processed) and
    the bind processors of the parameters each call supplies (``None``: passed as they are)."""
    compiled = stmt.compile(dialect=dialect)
    if compiled.positional:
        raise SystemExit(f"expected a named paramstyle, got {dialect.paramstyle}")
    constants, processors = {}, {}
    for bind, name in compiled.bind_names.items():
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if bind.required:
            processors[name] = process
        else:
            value = bind.effective_value
            constants[name] = value if process is None else process(value)
    return compiled.string, constants, processors


#: parameters whose values are fixed before the clock starts (processed then, once)
PREPARED = ("job_id", "holder", "new_result")


class RawPlan:
    """What the store sends for claim and complete, as driver SQL, for one clock."""

    def __init__(self, dialect: sqlalchemy.Dialect, table: Table, clock: str) -> None:
        s = Statements(table, clock)  # type: ignore[arg-type]
        self.caller_clock = clock == "caller"
        self.returning = bool(getattr(dialect, "update_returning", False))
        claim = s.claim_returning if self.returning else s.claim_counting
        self.claim_sql, self.claim_const, p1 = compile_for(claim, dialect)
        self.lease_sql, self.lease_const, p2 = compile_for(s.lease_of, dialect)
        self.complete_sql, self.complete_const, p3 = compile_for(s.complete, dialect)
        self.processors = {**p1, **p2, **p3}
        per_call = {name for name, p in self.processors.items() if p is not None and name not in PREPARED}
        if per_call:  # the raw loop passes now, new_until, ttl and token unprocessed
            raise SystemExit(f"{dialect.name}: parameters {sorted(per_call)} need a bind processor")

    def value(self, name: str, value: Any) -> Any:
        """``value`` as the driver receives it for the parameter ``name``."""
        process = self.processors.get(name)
        return value if process is None else process(value)

    def values(self, name: str, values: list[Any]) -> list[Any]:
        return [self.value(name, v) for v in values]


def raw_connect(engine: Engine, kind: type[dbapi.Tap] | None = None) -> Any:
    """A driver connection with the arguments the engine's dialect would use, in autocommit
    on PostgreSQL (where the store runs one statement as its own transaction), else not;
    ``kind``: tapped for that kind of tap (:mod:`harness.dbapi`)."""
    _, params = engine.dialect.create_connect_args(engine.url)
    if engine.dialect.name == "postgresql":
        params.pop("context", None)  # SQLAlchemy's copy of psycopg's default adapters
    conn = dbapi.connect(engine.dialect.name, (), params, kind)
    conn.autocommit = engine.dialect.name == "postgresql"
    return conn


def raw_cycles(conn: Any, plan: RawPlan, ids: Iterable[Any], *, owner: Any, result: Any, now: NowFn) -> int:
    """claim -> complete on each job, two transactions each; returns the number of failures.

    ``ids``, ``owner`` and ``result`` are as the driver receives them (:meth:`RawPlan.values`).
    """
    cur = conn.cursor()
    execute, fetchall = cur.execute, cur.fetchall
    commit = (lambda: None) if conn.autocommit else conn.commit  # in autocommit: committed
    claim_sql, lease_sql, complete_sql = plan.claim_sql, plan.lease_sql, plan.complete_sql
    claim_const, lease_const, complete_const = plan.claim_const, plan.lease_const, plan.complete_const
    returning, caller_clock = plan.returning, plan.caller_clock
    failures = 0
    try:
        for job_id in ids:
            if caller_clock:
                t = now()
                params = {**claim_const, "job_id": job_id, "holder": owner, "now": t, "new_until": t + TTL}
            else:
                params = {**claim_const, "job_id": job_id, "holder": owner, "ttl": TTL}
            execute(claim_sql, params)
            if returning:
                rows = fetchall()
            elif cur.rowcount == 1:
                execute(lease_sql, {**lease_const, "job_id": job_id})
                rows = fetchall()
            else:
                rows = []
            commit()
            if not rows:
                failures += 1
                continue
            params = {
                **complete_const,
                "job_id": job_id,
                "holder": owner,
                "token": int(rows[0][0]),
                "new_result": result,
            }
            if caller_clock:
                params["now"] = now()
            execute(complete_sql, params)
            done = cur.rowcount == 1
            commit()
            if not done:
                failures += 1
    finally:
        cur.close()
    return failures


def store_cycles(store: fencing.JobStore, ids: Iterable[str], *, owner: str, now: NowFn) -> int:
    """The same through the store; returns the number of failures."""
    claim, complete = store.claim, store.complete
    failures = 0
    for job_id in ids:
        lease = claim(job_id, owner, ttl=TTL, now=now())
        if lease is None or not complete(lease, RESULT, now=now()):
            failures += 1
    return failures


# -- proving both ways send the same thing ------------------------------------------------------


def transcripts(url: str, table: Table, clock: str) -> dict[str, list[tuple[Any, ...]]]:
    """One claim -> complete of the probe job each way: what reached the driver (through the
    driver's connection and cursor, recording: :class:`harness.dbapi.Recorder`)."""
    engine = dbapi.tap_engine(sqlalchemy.create_engine(url), dbapi.Recorder)
    store = fencing.JobStore(engine, table)
    plan = RawPlan(engine.dialect, table, clock)
    now = (lambda: PROBE_NOW) if clock == "caller" else (lambda: None)
    owner = "probe-owner"
    logs: dict[str, list[tuple[Any, ...]]] = {"store": [], "raw": []}
    try:
        refill(engine, table, ["probe"])
        # opens the store's connection (and runs SQLAlchemy's first-connect queries) unrecorded
        store.state("probe")
        with dbapi.tapping(dbapi.Recorder()) as recorder:
            failures = store_cycles(store, ["probe"], owner=owner, now=now)
        logs["store"] = recorder.log
        refill(engine, table, ["probe"])
        raw = raw_connect(engine, dbapi.Recorder)
        try:
            with dbapi.tapping(dbapi.Recorder()) as recorder:
                failures += raw_cycles(
                    raw,
                    plan,
                    plan.values("job_id", ["probe"]),
                    owner=plan.value("holder", owner),
                    result=plan.value("new_result", RESULT),
                    now=now,
                )
            logs["raw"] = recorder.log
        finally:
            raw.close()
    finally:
        store.engine.dispose()
        engine.dispose()
    if failures:
        raise SystemExit(f"{engine.dialect.name}/{clock}: the probe claim -> complete failed")
    if not logs["store"]:
        raise SystemExit(f"{engine.dialect.name}/{clock}: the recorder saw nothing of the store's calls")
    if logs["store"] != logs["raw"]:
        show_transcripts(logs)
        raise SystemExit(f"{engine.dialect.name}/{clock}: the raw way does not send what the store sends")
    return logs


def show_transcripts(logs: dict[str, list[tuple[Any, ...]]]) -> None:
    for way, log in logs.items():
        print(f"  {way}:")
        for entry in log:
            if entry[0] in ("execute", "executemany"):
                print(f"    {entry[1]}\n      {entry[2]!r}")
            elif entry[0] == "fetch":
                print(f"      -> {entry[1]}()")
            else:
                print(f"    {entry[0].upper()}")


# -- worker processes ---------------------------------------------------------------------------


@contextlib.contextmanager
def worker(index: int, url: str, table_name: str) -> Iterator[Handler]:
    """One process: its own engine and store, its own raw connection, for the whole run."""
    engine = sqlalchemy.create_engine(url)
    table = fencing.jobs_table(MetaData(), table_name)
    store = fencing.JobStore(engine, table)
    plans = {clock: RawPlan(engine.dialect, table, clock) for clock in CLOCKS}
    raw = raw_connect(engine)
    owner = owner_of(index)

    def cycles(
        command: tuple[str, str, list[str], list[str]], barrier: Any
    ) -> tuple[float, float, int, float]:
        way, clock, warm_ids, ids = command
        now = now_fn(clock)
        run: Callable[[list[Any]], int]
        if way == "raw":
            plan = plans[clock]
            warm, timed_ids = plan.values("job_id", warm_ids), plan.values("job_id", ids)
            run = functools.partial(
                raw_cycles,
                raw,
                plan,
                owner=plan.value("holder", owner),
                result=plan.value("new_result", RESULT),
                now=now,
            )
        else:
            warm, timed_ids = warm_ids, ids
            run = functools.partial(store_cycles, store, owner=owner, now=now)
        failures = run(warm)
        gc.collect()
        barrier.wait(BARRIER_TIMEOUT)
        timed_failures, start, finish, cpu = timed(run, timed_ids)
        return start, finish, failures + timed_failures, cpu

    yield cycles
    raw.close()
    engine.dispose()


def measure(
    pool: Pool, way: str, clock: str, slices: list[tuple[list[str], list[str]]]
) -> tuple[int, float, float]:
    """All slices run at once, one process each: the jobs, the seconds from the first
    start to the last finish, and the client processes' CPU seconds."""
    parties = len(slices)
    done = pool.run([(way, clock, warm_ids, ids) for warm_ids, ids in slices])
    failures = sum(m[2] for m in done)
    if failures:
        raise SystemExit(f"{way}/{clock}/{parties} processes: {failures} claim -> complete cycles failed")
    span = max(m[1] for m in done) - min(m[0] for m in done)
    jobs = sum(len(ids) for _, ids in slices)
    return jobs, span, sum(m[3] for m in done)


# -- one database -------------------------------------------------------------------------------


def slices_for(tag: str, jobs: int, parties: int) -> list[tuple[list[str], list[str]]]:
    """Per process: its warm-up ids and its contiguous slice of the timed ids."""
    timed = [f"{tag}-{i:07d}" for i in range(jobs)]
    return [
        (
            [f"{tag}-warm{k}-{j:03d}" for j in range(WARMUP)],
            timed[k * jobs // parties : (k + 1) * jobs // parties],
        )
        for k in range(parties)
    ]


def bench_db(db: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = sqlalchemy.create_engine(url)
    table_name = f"bench_servers_{os.getpid()}"
    table = fencing.jobs_table(MetaData(), table_name)
    fencing.JobStore(engine, table).create_table()
    pool = None
    try:
        info = env.server_settings(engine, mariadb=("sync_binlog", "log_bin"))
        durability = ", ".join(f"{k}={v}" for k, v in info.items() if k != "version")
        print(f"\n{db}: {info['version']} ({durability}); table {table_name}", flush=True)
        sql = {clock: transcripts(url, table, clock) for clock in CLOCKS}
        if args.show_sql:
            for clock, logs in sql.items():
                print(f" {clock} clock, one claim -> complete (the raw way sends the same):")
                show_transcripts({"store": logs["store"]})
        pool = Pool(worker, (url, table_name), args.processes, timeout=BARRIER_TIMEOUT + 60)
        configs = [
            (parties, clock)
            for parties in args.processes
            for clock in CLOCKS
            if clock == "caller" or parties in args.database_clock_at
        ]
        # per (processes, clock, way): one (jobs/s, CPU seconds per job) per repetition
        runs: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
        started = time.perf_counter()
        for rep in range(args.repeat):
            for parties, clock in rotated(configs, rep):
                totals = {way: [0, 0.0, 0.0] for way in WAYS}  # jobs, seconds, CPU seconds
                for k in range(args.rounds):
                    n = args.jobs * (k + 1) // args.rounds - args.jobs * k // args.rounds
                    for way in WAYS if (rep + k) % 2 == 0 else WAYS[::-1]:
                        tag = f"r{rep}k{k}p{parties}{way[0]}{clock[0]}"
                        slices = slices_for(tag, n, parties)
                        refill(engine, table, [i for warm, ids in slices for i in warm + ids])
                        for i, figure in enumerate(measure(pool, way, clock, slices)):
                            totals[way][i] += figure
                for way, (jobs, seconds, cpu) in totals.items():
                    runs.setdefault((parties, clock, way), []).append((jobs / seconds, cpu / jobs))
            print(
                f"  repetition {rep + 1}/{args.repeat} done ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        rows = []
        for parties, clock in configs:
            raw_runs, store_runs = runs[parties, clock, "raw"], runs[parties, clock, "store"]
            raw = statistics.median(rate for rate, _ in raw_runs)
            store = statistics.median(rate for rate, _ in store_runs)
            paired = [s_rate / r_rate for (r_rate, _), (s_rate, _) in zip(raw_runs, store_runs, strict=True)]
            rows.append(
                {
                    "db": db,
                    "processes": parties,
                    "clock": clock,
                    "raw_jobs_per_s": raw,
                    "store_jobs_per_s": store,
                    "store_vs_raw": statistics.median(paired),
                    "paired_ratios": paired,
                    "ratio_of_medians": store / raw,
                    "raw_cpu_us_per_job": statistics.median(cpu for _, cpu in raw_runs) * 1e6,
                    "store_cpu_us_per_job": statistics.median(cpu for _, cpu in store_runs) * 1e6,
                    "raw_runs_jobs_per_s": [rate for rate, _ in raw_runs],
                    "store_runs_jobs_per_s": [rate for rate, _ in store_runs],
                }
            )
        profile = profile_store(engine, table, args.jobs) if args.profile else None
        return {
            "db": db,
            "url": engine.url.render_as_string(hide_password=True),
            "server": info,
            "rows": rows,
            "sql": {clock: logs["store"] for clock, logs in sql.items()},
            "profile": profile,
        }
    finally:
        if pool is not None:
            pool.close()
        with contextlib.suppress(Exception), engine.begin() as conn:
            table.drop(conn, checkfirst=True)
        engine.dispose()


# -- where the store's time goes ----------------------------------------------------------------


#: the DBAPI calls the store makes, by (module file, function): everything under them is driver
DRIVER_CALLS = {
    "execute": [("psycopg/cursor.py", "execute"), ("pymysql/cursors.py", "execute")],
    "fetch": [("psycopg/cursor.py", "fetchall"), ("pymysql/cursors.py", "fetchall")],
    "commit": [("psycopg/connection.py", "commit"), ("pymysql/connections.py", "commit")],
    "rollback": [("psycopg/connection.py", "rollback"), ("pymysql/connections.py", "rollback")],
    "cursor": [
        ("psycopg/connection.py", "cursor"),
        ("pymysql/connections.py", "cursor"),
        ("psycopg/cursor.py", "close"),
        ("pymysql/cursors.py", "close"),
    ],
}
#: the store's unit of work on the driver: a cursor, the statements, COMMIT, the retry frame
STORE_TRANSACTION = (Runner.run.__code__.co_filename, Runner.run.__code__.co_name)


def _cumulative(stats: dict[Any, Any], wanted: list[tuple[str, str]]) -> tuple[float, float]:
    """Calls and cumulative seconds of the functions ``wanted`` (file suffix, name)."""
    calls = seconds = 0.0
    for (path, _, name), (_, ncalls, _, cumtime, _) in stats.items():
        if any(path.endswith(suffix) and name == fn for suffix, fn in wanted):
            calls += ncalls
            seconds += cumtime
    return calls, seconds


def _own_time_under(stats: dict[Any, Any], fragment: str) -> float:
    """Seconds spent in the functions of files whose path contains ``fragment`` themselves."""
    return sum(tottime for (path, _, _), (_, _, tottime, _, _) in stats.items() if fragment in path)


def _breakdown(stats: dict[Any, Any], total: float, n: int) -> dict[str, dict[str, float]]:
    """Microseconds (and calls) per operation: driver calls, fencing's execution layer, the
    store, and SQLAlchemy's own time (which should be nil on the driver path)."""
    out = {}
    driver = 0.0
    for group, wanted in DRIVER_CALLS.items():
        calls, seconds = _cumulative(stats, wanted)
        driver += seconds
        out[f"driver {group}"] = {"us": seconds / n * 1e6, "calls": calls / n}
    run_calls, in_transaction = _cumulative(stats, [STORE_TRANSACTION])
    out["fencing Runner.run (pool checkout, compiled SQL, args; not the driver)"] = {
        "us": (in_transaction - driver) / n * 1e6,
        "calls": run_calls / n,
    }
    out["fencing store (checks, params, unit closures, Lease)"] = {
        "us": (total - in_transaction) / n * 1e6,
        "calls": 0.0,
    }
    out["(SQLAlchemy's own time, anywhere in the above)"] = {
        "us": _own_time_under(stats, f"{os.sep}sqlalchemy{os.sep}") / n * 1e6,
        "calls": 0.0,
    }
    out["total"] = {"us": total / n * 1e6, "calls": 0.0}
    return out


def profile_store(engine: Engine, table: Table, jobs: int, top: int = 25) -> dict[str, Any]:
    """The store loop (caller's clock, one process, in this process) under cProfile, with one
    profiler around the claims and another around the completes: microseconds per operation."""
    store = fencing.JobStore(engine, table)
    owner = owner_of(0)
    warm = [f"prof-warm-{j:03d}" for j in range(WARMUP)]
    ids = [f"prof-{i:07d}" for i in range(jobs)]
    refill(engine, table, warm + ids)
    store_cycles(store, warm, owner=owner, now=time.time)
    gc.collect()
    profilers = {"claim": cProfile.Profile(), "complete": cProfile.Profile()}
    totals = dict.fromkeys(profilers, 0.0)
    claim_profiler, complete_profiler = profilers["claim"], profilers["complete"]
    clock = time.perf_counter
    for job_id in ids:
        t0 = clock()
        claim_profiler.enable()
        lease = store.claim(job_id, owner, ttl=TTL, now=time.time())
        claim_profiler.disable()
        t1 = clock()
        if lease is None:
            raise SystemExit(f"profile: claim of {job_id} failed")
        complete_profiler.enable()
        done = store.complete(lease, RESULT, now=time.time())
        complete_profiler.disable()
        totals["claim"] += t1 - t0
        totals["complete"] += clock() - t1
        if not done:
            raise SystemExit(f"profile: complete of {job_id} failed")
    report: dict[str, Any] = {"jobs": jobs, "operations": {}}
    print(f"\n cProfile of the store loop, {engine.dialect.name}, caller clock, 1 process, {jobs} jobs:")
    for op, profiler in profilers.items():
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        groups = _breakdown(stats, totals[op], jobs)
        functions = sorted(
            (
                {
                    "function": f"{os.path.basename(path)}:{line}({name})" if line else name,
                    "calls": ncalls / jobs,
                    "own_us": tottime / jobs * 1e6,
                    "cum_us": cumtime / jobs * 1e6,
                }
                for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.items()
            ),
            key=lambda e: e["own_us"],
            reverse=True,
        )[:top]
        report["operations"][op] = {"groups": groups, "top_by_own_time": functions}
        print(f"\n  store.{op}: {groups['total']['us']:.0f} us per call under the profiler")
        for group, figures in groups.items():
            if group != "total":
                calls = f"{figures['calls']:.0f} calls" if figures["calls"] else ""
                print(f"    {figures['us']:8.1f} us  {group} {calls}")
        print(f"    {'own us':>8} {'cum us':>8} {'calls':>5}  top {top} functions by own time")
        for e in functions:
            print(f"    {e['own_us']:8.1f} {e['cum_us']:8.1f} {e['calls']:5.1f}  {e['function']}")
    return report


# -- main ---------------------------------------------------------------------------------------


TABLE = report.Table(
    report.Column("db", 11, "<"),
    report.Column("processes", 9),
    report.Column("clock", 9, "<"),
    report.Column("raw jobs/s", 11, spec=".0f"),
    report.Column("store jobs/s", 13, spec=".0f"),
    report.Column("store/raw", 10),
    report.Column("per-rep ratios", 15, pad=False),
    report.Column("client CPU us/job raw, store", 28, sep="   ", pad=False),
)


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print(TABLE.header())
    for r in rows:
        paired = r["paired_ratios"]
        miss = "" if r["store_vs_raw"] >= TARGET else f"  < {TARGET}x"
        print(
            TABLE.row(
                r["db"],
                r["processes"],
                r["clock"],
                r["raw_jobs_per_s"],
                r["store_jobs_per_s"],
                f"{r['store_vs_raw']:.3f}x",
                f"{min(paired):>7.2f}-{max(paired):.2f}x",
                f"{r['raw_cpu_us_per_job']:>16.0f}, {r['store_cpu_us_per_job']:.0f}{miss}",
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--db", choices=["postgresql", "mariadb", "both"], default="both")
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per measurement (default 1000)")
    cli.add_repeat(parser)
    cli.add_rounds(
        parser, 4, help="rounds per repetition: raw and store alternate on N/rounds jobs each (default 4)"
    )
    cli.add_processes(parser)
    parser.add_argument(
        "--database-clock-at",
        default="1",
        type=lambda s: {int(p) for p in s.split(",") if p},
        help="process counts that also measure now=None, the database clock (default 1; '' for none)",
    )
    cli.add_json(parser)
    cli.add_server_urls(parser)
    parser.add_argument("--show-sql", action="store_true", help="print what one claim -> complete sends")
    parser.add_argument("--profile", action="store_true", help="cProfile the store loop afterwards")
    cli.add_check(parser, help=f"exit 1 if a ratio is below {TARGET}x")
    args = parser.parse_args(argv)
    if (
        args.jobs < max(args.processes) * args.rounds
        or min(args.processes) < 1
        or min(args.repeat, args.rounds) < 1
    ):
        parser.error("need --jobs >= processes x rounds, processes >= 1, --repeat >= 1 and --rounds >= 1")

    dbs = ["postgresql", "mariadb"] if args.db == "both" else [args.db]
    urls = cli.server_urls(args)
    versions = env.versions(*VERSIONS)
    print(
        f"claim -> complete, N={args.jobs} jobs per measurement, R={args.repeat}, "
        f"processes {','.join(map(str, args.processes))}; python {versions['python']}, "
        f"SQLAlchemy {versions['sqlalchemy']}, psycopg {versions['psycopg']}, pymysql {versions['pymysql']}, "
        f"{versions['cpus']} CPUs, git {versions['git']}"
    )
    started = time.perf_counter()
    results = [bench_db(db, urls[db], args) for db in dbs]
    rows = [r for result in results for r in result["rows"]]
    print_table(rows)
    print(
        f"\nstore/raw: median of the per-repetition ratios (raw and store back to back); "
        f"target >= {TARGET}x. {time.perf_counter() - started:.0f} s"
    )
    if args.json:
        figures = {
            "benchmark": "claim -> complete throughput, raw driver vs fencing.JobStore",
            "jobs": args.jobs,
            "repeat": args.repeat,
            "rounds": args.rounds,
            "processes": args.processes,
            "warmup_per_process": WARMUP,
            "target_store_vs_raw": TARGET,
            "environment": versions,
            "databases": results,
            "rows": rows,
        }
        report.write_json(args.json, figures)
    if args.check and any(r["store_vs_raw"] < TARGET for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
