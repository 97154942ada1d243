"""Jobs per second through the full worker cycle ``claim_next -> complete``, 1 and 4 processes.

What is measured
----------------
N jobs are enqueued first (not timed), then P worker processes (``multiprocessing``
"spawn"), each with its own engine and ``fencing.JobStore``, start together on a barrier
and loop until ``claim_next`` returns nothing:

``single``
    ``leases = store.claim_next(owner, ttl=600, limit=1)``, then
    ``store.complete(lease, owner)``: two transactions per job.
``batched``
    ``leases = store.claim_next(owner, ttl=600, limit=100)``, then
    ``store.complete_many([(lease, owner) for lease in leases])``: two transactions per
    (up to) 100 jobs.

jobs/s = N / (the last completion - the first worker's start). The workers' exit after
that -- each one's last, empty ``claim_next`` -- is shown apart as ``tail ms``: on SQLite a
worker asleep in the busy handler reaches it up to ~100 ms late, which is the benchmark's
end condition, not work done. Backends:

``sqlite``
    ``fencing.create_sqlite_engine(path)``: the library's default durability, WAL +
    ``synchronous = FULL`` (every commit is fsynced). A fresh database file for every
    measurement, in ``--dir`` (default: a temporary directory under the working directory,
    i.e. on a real disk; tmpfs would make FULL look like NORMAL).
``postgresql`` / ``mariadb``
    ``sqlalchemy.create_engine(url)`` on the local test servers (``--postgresql-url``,
    ``--mariadb-url``), a dedicated table ``bench_cycle_<pid>`` (the library's schema),
    emptied (``TRUNCATE``) and refilled before every measurement (then ``ANALYZE`` on
    PostgreSQL), dropped at the end. Durability is the servers' own (printed in the header).

The jobs are written in one bulk ``INSERT`` of bare ids, which is the row ``enqueue(id)``
makes (``until = 0``, ``fence = 0``, ``done = 0``, no owner), then every connection of the
main process is closed. Each worker opens its store's connection before the barrier (an
untimed ``state()`` call). Every exception a store call raises in a worker is caught,
counted and kept (type and message), and the worker goes on; ``errors`` in the table is
their total -- in particular ``database is locked`` / ``DatabaseBusy`` on SQLite, which the
library is meant to absorb (target: none). ``retries`` counts the lock races the library
absorbed itself (its pauses before trying again, counted by wrapping
``fencing._runtime.execution.backoff`` and ``fencing._runtime.writelock.poll_pause`` in the
workers; waits inside SQLite's own busy handler are not counted), and ``max op ms`` is the
slowest single ``claim_next``/``complete`` call any worker saw. ``cpu us/job`` is the
workers' CPU time (user + system, summed over the workers) per job: what waiting for a lock
costs in CPU, which a busy machine's wall-clock figures hide.

Fairness, i.e. whether a worker starves while others take the lock: ``claim ms`` is the
latency of every ``claim_next`` call (p50/p99/max over all repetitions; on SQLite a claim
waits for the write lock, so its tail is the longest any worker waited), and ``share`` is
each worker's completions over its fair share ``N/P``, as the lowest and highest of any
worker in any repetition (1.00-1.00 is perfectly even; 0.00 means a worker got nothing).
``per-worker`` lists each worker's completions in the median repetition.

After every measurement the table is checked: all N jobs done, each claimed exactly once
(``fence = 1``), with the result naming the worker that completed it, and the per-worker
counts in the table equal to what the workers reported; otherwise the run stops.

Interleaving: the worker processes are spawned once and kept. A repetition runs each
backend's four configurations (1/4 processes x single/batched) in ``--rounds`` rounds
(default 3) of N/rounds jobs each. In a round the two process counts of a mode run one
right after the other, in alternating order from round to round, and the modes' order
rotates (as does the backends' from repetition to repetition), so a slow spell of the disk
or of the machine's other load hits both sides of a ratio alike. A repetition's jobs/s for
a configuration is its jobs over its time summed over the rounds; ``jobs/s`` is the median
of R repetitions. The ratios ``batched/single`` (same backend and processes) and ``vs 1p``
(same backend and mode) are taken round by round, between the two measurements of the same
round, and shown as the median of all R x rounds of them, with their range: on a machine
whose load changes from second to second this is far steadier than a ratio of totals. A
last line compares each configuration's fastest quarter of rounds (the median of them):
load only slows a round down, so this is the ratio an otherwise idle machine would show.
Targets: batched >= 10x single on SQLite at its default durability; 4 processes >= 0.9x one
process on SQLite, with no "database is locked" reaching a caller.

Reproduce
---------
::

    python benchmarks/cycle.py                        # sqlite, postgresql, mariadb; R=3 (~3 min)
    python benchmarks/cycle.py --backends sqlite --repeat 5 --json cycle.json
    python benchmarks/cycle.py --backends sqlite --profile    # where the workers' time goes

``--single-jobs`` / ``--batched-jobs`` set N per backend (defaults: SQLite 6000 / 60000,
servers 2000 / 20000). ``--profile`` runs every worker under cProfile and times every driver
call by statement kind (``BEGIN``, claim, complete, ``COMMIT``) through a subclass of the
driver's connection and cursor (sqlite3 ``factory=``; a SQLAlchemy ``do_connect`` listener
for psycopg/pymysql); on SQLite it also records when each worker held the write lock (from
the return of ``BEGIN IMMEDIATE`` to the return of ``COMMIT``) and merges the workers'
intervals into one timeline: held, idle before the same process took the lock again, idle
at a handoff to another process. It prints, per configuration, where the time went (median
repetition); it slows the loop, so its jobs/s are not the headline figures. ``--json FILE``
writes every figure, error and profile; ``--check`` exits with status 1 when a target is
missed.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import os
import pstats
import re
import sqlite3
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy
from harness import cli, db, dbapi, env, report
from harness.measure import BARRIER_TIMEOUT, Handler, Pool, rotated, timed
from sqlalchemy import Engine, MetaData, func, select

import fencing
import fencing._runtime.execution
import fencing._runtime.writelock

BACKENDS = ("sqlite", "postgresql", "mariadb")
MODES = {"single": 1, "batched": 100}
DEFAULT_JOBS = {
    ("sqlite", "single"): 6000,
    ("sqlite", "batched"): 60000,
    ("server", "single"): 2000,
    ("server", "batched"): 20000,
}
TTL = 600.0  # no lease expires during a measurement
TARGET_BATCHED_VS_SINGLE = 10.0
TARGET_4P_VS_1P = 0.9
MAX_ERRORS_PER_WORKER = 200  # a worker that keeps failing stops; the check then reports it
KEPT_ERRORS = 5
#: what the header and the JSON say the run measured with (the drivers where installed)
VERSIONS = ("git", "python", "sqlite", "sqlalchemy", "fencing", "platform", "cpus", "psycopg", "PyMySQL")


def owner_of(index: int) -> str:
    return f"worker-{index}"


# -- timing the driver calls by statement kind (--profile) --------------------------------------


def sql_kind(statement: Any, *_: Any) -> str:
    """The kind of ``statement`` (a string, or psycopg's ``Composed``), for the profile."""
    sql = str(statement)
    head = sql.lstrip()[:12].upper()
    if head.startswith("BEGIN"):
        return "BEGIN"
    if head.startswith("COMMIT"):
        return "COMMIT"
    if head.startswith("ROLLBACK"):
        return "ROLLBACK"
    if head.startswith("SELECT"):
        return "SELECT (pick)" if "FOR UPDATE" in sql.upper() or "LIMIT" in sql.upper() else "SELECT"
    if head.startswith(("UPDATE", "WITH")):  # claim_next may pick in a CTE first
        return "UPDATE (complete)" if "SET result" in sql else "UPDATE (claim)"
    return head.split(" ")[0]


def _timing(kind: str | Callable[..., str]) -> Callable[..., Any]:
    """A :class:`DriverTimer` method that times the driver call it is handed, as ``kind`` (a
    statement's kind, or a function of the call's arguments that tells it)."""

    def _timed(self: DriverTimer, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        what = kind if isinstance(kind, str) else kind(*args)
        t0 = time.perf_counter()
        try:
            return call(*args, **kw)
        except BaseException:
            what = "BEGIN (failed)" if what == "BEGIN" else what
            raise
        finally:
            self.add(what, t0, time.perf_counter())

    return _timed


class DriverTimer(dbapi.Tap):
    """Seconds and calls per statement kind, and per driver ``commit()``; on SQLite also
    when this process held the write lock: from the return of ``BEGIN IMMEDIATE`` to the
    return of ``COMMIT``/``ROLLBACK`` (``perf_counter`` is comparable across processes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.holds: list[tuple[float, float]] = []
        self._acquired: float | None = None

    def add(self, kind: str, start: float, end: float) -> None:
        self.seconds[kind] += end - start
        self.calls[kind] += 1
        if kind == "BEGIN":
            self._acquired = end
        elif kind in ("COMMIT", "ROLLBACK") and self._acquired is not None:
            self.holds.append((self._acquired, end))
            self._acquired = None

    # the driver calls it times: every statement (on SQLite also those sent with the
    # connection's own execute()) by its kind, and the driver's commit()
    execute = connection_execute = _timing(sql_kind)
    commit = _timing("COMMIT")


# -- the worker side ----------------------------------------------------------------------------


def make_engine(backend: str, target: str, *, timing: bool = False) -> Engine:
    """The worker's engine; ``timing``: its driver calls timed (:class:`DriverTimer`)."""
    if backend == "sqlite":
        kwargs: dict[str, Any] = (
            {"connect_args": {"factory": dbapi.sqlite3_factory(DriverTimer)}} if timing else {}
        )
        return fencing.create_sqlite_engine(target, **kwargs)
    engine = sqlalchemy.create_engine(target)
    return dbapi.tap_engine(engine, DriverTimer) if timing else engine


#: the library's pauses before it tries again: (module, function); ``poll_pause`` is SQLite's
#: write lock (its priority holder's short sleeps are not counted)
PAUSES = ((fencing._runtime.execution, "backoff"), (fencing._runtime.writelock, "poll_pause"))


class Retries:
    """Wraps the library's pauses to count the lock races it absorbed, and the sleeps."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    def install(self) -> None:
        for module, name in PAUSES:
            original = getattr(module, name)  # a pause that moved fails here, never goes uncounted
            setattr(module, name, self._counting(original))
            # a module that imported the function by name calls it through its own global
            for other in (fencing._runtime.execution,):
                if getattr(other, name, None) is original:
                    setattr(other, name, getattr(module, name))

    def _counting(self, original: Any) -> Any:
        def counting(*args: Any) -> Any:
            self.count += 1
            t0 = time.perf_counter()
            try:
                return original(*args)
            finally:
                self.seconds += time.perf_counter() - t0

        return counting

    def reset(self) -> None:
        self.count = 0
        self.seconds = 0.0


def work(store: fencing.JobStore, owner: str, limit: int) -> dict[str, Any]:
    """The cycle until ``claim_next`` returns nothing; what happened."""
    completions = claims = 0
    claim_latencies: list[float] = []
    errors: list[str] = []
    slowest = 0.0
    last_done = None
    clock = time.perf_counter
    claim_next, complete, complete_many = store.claim_next, store.complete, store.complete_many
    while len(errors) < MAX_ERRORS_PER_WORKER:
        t0 = clock()
        try:
            leases = claim_next(owner, ttl=TTL, limit=limit)
        except Exception as exc:
            errors.append(f"claim_next: {type(exc).__name__}: {exc}")
            continue
        t1 = clock()
        slowest = max(slowest, t1 - t0)
        claim_latencies.append(t1 - t0)
        if not leases:
            break
        claims += len(leases)
        if len(leases) > limit:  # a bug to report; all of them are completed below
            errors.append(f"claim_next: {len(leases)} leases returned for limit={limit}")
        try:
            if len(leases) == 1:
                completions += complete(leases[0], owner)
            else:
                completions += sum(map(bool, complete_many([(lease, owner) for lease in leases])))
        except Exception as exc:
            errors.append(f"complete: {type(exc).__name__}: {exc}")
        last_done = clock()
        slowest = max(slowest, last_done - t1)
    return {
        "completions": completions,
        "claims": claims,
        "errors": errors,
        "slowest": slowest,
        "claim_latencies": claim_latencies,
        "last_done": last_done,
    }


@contextlib.contextmanager
def worker(index: int, profile: bool) -> Iterator[Handler]:
    """One process for the whole run; one measurement per command."""
    retries = Retries()
    retries.install()
    stores: dict[tuple[str, str], tuple[Engine, fencing.JobStore]] = {}

    def run(command: tuple[str, str, str, int], barrier: Any) -> dict[str, Any]:
        backend, target, table_name, limit = command
        key = (target, table_name)
        if key not in stores:
            engine = make_engine(backend, target, timing=profile)
            stores[key] = (engine, fencing.JobStore(engine, fencing.jobs_table(MetaData(), table_name)))
        engine, store = stores[key]
        store.state("no-such-job")  # opens the store's connection before the clock starts
        owner = owner_of(index)
        timer = DriverTimer() if profile else None
        profiler = cProfile.Profile() if profile else None
        retries.reset()
        barrier.wait(BARRIER_TIMEOUT)
        with dbapi.tapping(timer):
            if profiler is not None:
                profiler.enable()
            outcome, start, finish, cpu = timed(work, store, owner, limit)
            if profiler is not None:
                profiler.disable()
        wal = target + "-wal"
        outcome.update(
            wal_bytes=os.path.getsize(wal) if backend == "sqlite" and os.path.exists(wal) else None,
            index=index,
            cpu_s=cpu,
            start=start,
            finish=finish,
            retries=retries.count,
            backoff_s=retries.seconds,
            profile=summarize(profiler, timer, finish - start) if profiler and timer else None,
        )
        if backend == "sqlite":  # a fresh file per measurement: let it go
            del stores[key]
            store.engine.dispose()
            engine.dispose()
        return outcome

    yield run
    for engine, store in stores.values():
        store.engine.dispose()
        engine.dispose()


def _defined(function: Any) -> tuple[str, str]:
    """Where ``function`` is defined, as the profile names it: (its file, its name)."""
    return function.__code__.co_filename, function.__code__.co_name


#: functions whose cumulative time is a category of the profile (file suffix, name)
PROFILE_GROUPS = {
    "library backoff sleeps": [("benchmarks/cycle.py", "counting")],
    "claim_next (total)": [_defined(fencing.JobStore.claim_next)],
    "complete/complete_many (total)": [
        _defined(fencing.JobStore.complete),
        _defined(fencing.JobStore.complete_many),
    ],
}


def summarize(profiler: cProfile.Profile, timer: DriverTimer, wall: float, top: int = 12) -> dict[str, Any]:
    """Seconds by driver statement kind, by store call, and the top functions by own time."""
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    groups = {}
    for group, wanted in PROFILE_GROUPS.items():
        groups[group] = sum(
            cum
            for (path, _, name), (_, _, _, cum, _) in stats.items()
            if any(path.replace(os.sep, "/").endswith(s) and name == n for s, n in wanted)
        )
    functions = sorted(
        (
            (tottime, cumtime, ncalls, f"{os.path.basename(path)}:{line}({name})" if line else _plain(name))
            for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.items()
        ),
        reverse=True,
    )[:top]
    return {
        "wall_s": wall,
        "holds": timer.holds,
        "driver_s": dict(timer.seconds),
        "driver_calls": dict(timer.calls),
        "groups_s": groups,
        "top_own": [{"own_s": t, "cum_s": c, "calls": n, "function": f} for t, c, n, f in functions],
    }


def _plain(name: str) -> str:
    """A built-in's profile name without its address (the same in every worker)."""
    return re.sub(r" at 0x[0-9a-f]+", "", name)


# -- the main side: tables, checks, figures ------------------------------------------------------


class Backend:
    """Where one backend's measurements run: a fresh SQLite file each, or one server table."""

    def __init__(self, name: str, args: argparse.Namespace, workdir: str) -> None:
        self.name = name
        self.table_name = "jobs" if name == "sqlite" else f"bench_cycle_{os.getpid()}"
        self.table = fencing.jobs_table(MetaData(), self.table_name)
        self.workdir = workdir
        self.url = cli.server_urls(args).get(name)
        self.engine: Engine | None = None
        self.counter = 0
        if self.url is not None:
            self.engine = sqlalchemy.create_engine(self.url)
            fencing.JobStore(self.engine, self.table).create_table()

    def prepare(self, n: int) -> str:
        """A table holding exactly ``n`` enqueued jobs; the target the workers open."""
        ids = [f"job-{i:07d}" for i in range(n)]
        if self.name == "sqlite":
            self.counter += 1
            path = os.path.join(self.workdir, f"cycle-{self.counter}.db")
            engine = fencing.create_sqlite_engine(path)
            try:
                fencing.JobStore(engine, self.table).create_table()
                with engine.begin() as conn:
                    db.insert_ids(conn, self.table, ids)
            finally:
                engine.dispose()
            return path
        assert self.engine is not None and self.url is not None
        db.refill(self.engine, self.table, ids)
        self.engine.dispose()
        return str(self.url)

    def verify(self, target: str, n: int, outcomes: list[dict[str, Any]]) -> str | None:
        """What is wrong with the table after a measurement, or ``None``."""
        t = self.table
        engine = self.engine if self.engine is not None else fencing.create_sqlite_engine(target)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    select(t.c.result, t.c.done, t.c.fence, func.count()).group_by(
                        t.c.result, t.c.done, t.c.fence
                    )
                ).all()
        finally:
            engine.dispose()
            if self.name == "sqlite":
                db.remove_sqlite(target)
        by_owner = Counter({owner_of(o["index"]): o["completions"] for o in outcomes})
        in_table: Counter[str] = Counter()
        problems = []
        for result, done, fence, count in rows:
            if done != 1 or fence != 1:
                problems.append(f"{count} rows with done={done}, fence={fence}, result={result!r}")
            else:
                in_table[result] += count
        if sum(in_table.values()) != n:
            problems.append(f"{sum(in_table.values())} of {n} jobs done exactly once")
        if +in_table != +by_owner:
            problems.append(f"per-worker completions {dict(by_owner)} but the table says {dict(in_table)}")
        return "; ".join(problems) or None

    def info(self) -> dict[str, Any]:
        if self.name == "sqlite":
            return {"version": sqlite3.sqlite_version, "journal_mode": "wal", "synchronous": "full"}
        assert self.engine is not None
        return env.server_settings(self.engine)

    def close(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception), self.engine.begin() as conn:
                self.table.drop(conn, checkfirst=True)
            self.engine.dispose()


def jobs_for(args: argparse.Namespace, backend: str, mode: str) -> int:
    chosen = args.single_jobs if mode == "single" else args.batched_jobs
    if chosen is not None:
        return int(chosen)
    return DEFAULT_JOBS["sqlite" if backend == "sqlite" else "server", mode]


def measure(workers: Pool, backend: Backend, mode: str, parties: int, n: int) -> dict[str, Any]:
    """One run of ``n`` jobs by ``parties`` workers, checked in the table afterwards."""
    target = backend.prepare(n)
    outcomes = workers.run([(backend.name, target, backend.table_name, MODES[mode])] * parties)
    problem = backend.verify(target, n, outcomes)
    if problem is not None:
        errors = [e for o in outcomes for e in o["errors"][:KEPT_ERRORS]]
        raise SystemExit(f"{backend.name}/{mode}/{parties}p: {problem}\nerrors: {errors}")
    # the clock stops at the last completion; the workers' exit (each one's last, empty
    # claim_next, which a worker asleep in SQLite's busy handler reaches late) is the tail
    first_start = min(o["start"] for o in outcomes)
    done_at = max(o["last_done"] for o in outcomes if o["last_done"] is not None)
    span = done_at - first_start
    errors = [e for o in outcomes for e in o["errors"]]
    return {
        "jobs": n,
        "seconds": span,
        "tail_s": max(o["finish"] for o in outcomes) - done_at,
        "cpu_s": sum(o["cpu_s"] for o in outcomes),
        "errors": len(errors),
        "locked_errors": sum("locked" in e or "DatabaseBusy" in e for e in errors),
        "error_samples": errors[:KEPT_ERRORS],
        "per_worker": [o["completions"] for o in outcomes],
        "shares": shares([o["completions"] for o in outcomes], n),
        "claim_latencies": [x for o in outcomes for x in o["claim_latencies"]],
        "retries": sum(o["retries"] for o in outcomes),
        "backoff_s": sum(o["backoff_s"] for o in outcomes),
        "slowest_op_s": max(o["slowest"] for o in outcomes),
        "wal_bytes": max((o["wal_bytes"] or 0) for o in outcomes) if backend.name == "sqlite" else None,
        "profile": merge_profiles(outcomes, span, done_at) if outcomes[0]["profile"] else None,
    }


def shares(per_worker: list[int], n: int) -> tuple[float, float]:
    """The lowest and highest worker's completions over its fair share ``n / workers``."""
    fair = n / len(per_worker)
    return min(per_worker) / fair, max(per_worker) / fair


def percentiles(latencies: list[float]) -> dict[str, float]:
    p50, p99, top = (report.percentile(latencies, q) for q in (0.5, 0.99, 1.0))
    return {"p50": p50, "p99": p99, "max": top, "calls": float(len(latencies))}


def merge_profiles(outcomes: list[dict[str, Any]], span: float, done_at: float) -> dict[str, Any]:
    """The workers' profiles of one run, summed; plus, on SQLite, the write lock's timeline."""
    merged: dict[str, Any] = {"wall_s": 0.0, "span_s": span}
    for part in ("driver_s", "driver_calls", "groups_s", "top_own"):
        merged[part] = Counter()
    holds: list[tuple[float, float, int]] = []
    for o in outcomes:
        p = o["profile"]
        merged["wall_s"] += p["wall_s"]
        merged["driver_s"].update(p["driver_s"])
        merged["driver_calls"].update(p["driver_calls"])
        merged["groups_s"].update(p["groups_s"])
        merged["top_own"].update({f["function"]: f["own_s"] for f in p["top_own"]})
        holds.extend((start, end, o["index"]) for start, end in p["holds"] if start < done_at)
    merged["lock"] = lock_timeline(holds, span) if holds else None
    return merged


def lock_timeline(holds: list[tuple[float, float, int]], span: float) -> dict[str, Any]:
    """How the write lock was used: held, idle before the same process took it again, idle
    before another process took it (a handoff), how many handoffs and each one's idle gap."""
    holds.sort()
    held = sum(end - start for start, end, _ in holds)
    idle_same = idle_handoff = overlap = 0.0
    handoffs = 0
    gaps = []
    for (_, prev_end, prev_worker), (start, _, worker) in itertools.pairwise(holds):
        gap = start - prev_end
        if gap < 0:  # the clocks disagree or the intervals are not the lock's: shown, not hidden
            overlap += -gap
        elif worker == prev_worker:
            idle_same += gap
        else:
            idle_handoff += gap
        if worker != prev_worker:
            handoffs += 1
            gaps.append(max(gap, 0.0))
    return {
        "transactions": float(len(holds)),
        "span_s": span,
        "held_s": held,
        "idle_same_s": idle_same,
        "idle_handoff_s": idle_handoff,
        "handoffs": float(handoffs),
        "overlap_s": overlap,
        "handoff_gaps_s": gaps,
    }


def combine(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one repetition of one configuration, as one run."""
    jobs = sum(p["jobs"] for p in parts)
    seconds = sum(p["seconds"] for p in parts)
    run: dict[str, Any] = {
        "jobs": jobs,
        "seconds": seconds,
        "jobs_per_s": jobs / seconds,
        "rounds_jobs_per_s": [p["jobs"] / p["seconds"] for p in parts],
        "errors": sum(p["errors"] for p in parts),
        "locked_errors": sum(p["locked_errors"] for p in parts),
        "error_samples": [e for p in parts for e in p["error_samples"]][:KEPT_ERRORS],
        "per_worker": [sum(w) for w in zip(*(p["per_worker"] for p in parts), strict=True)],
        "shares": (min(p["shares"][0] for p in parts), max(p["shares"][1] for p in parts)),
        "claim_latencies": [x for p in parts for x in p["claim_latencies"]],
        "retries": sum(p["retries"] for p in parts),
        "backoff_s": sum(p["backoff_s"] for p in parts),
        "slowest_op_s": max(p["slowest_op_s"] for p in parts),
        "tail_s": max(p["tail_s"] for p in parts),
        "cpu_s": sum(p["cpu_s"] for p in parts),
        "wal_bytes": None if parts[0]["wal_bytes"] is None else max(p["wal_bytes"] for p in parts),
        "profile": None,
    }
    if parts[0]["profile"] is not None:
        profile: dict[str, Any] = {"wall_s": 0.0, "span_s": 0.0, "lock": None}
        for key in ("driver_s", "driver_calls", "groups_s", "top_own"):
            profile[key] = sum((p["profile"][key] for p in parts), Counter())
        for p in parts:
            profile["wall_s"] += p["profile"]["wall_s"]
            profile["span_s"] += p["profile"]["span_s"]
            lock = p["profile"]["lock"]
            if lock is not None:
                total = profile["lock"] or {"handoff_gaps_s": []}
                for key, value in lock.items():
                    total[key] = (
                        total.get(key, 0.0) + value if key != "handoff_gaps_s" else total[key] + value
                    )
                profile["lock"] = total
        run["profile"] = profile
    return run


def best_quarter(rates: list[float]) -> float:
    """The median of the fastest quarter of the rounds: what a configuration does when the
    machine's other load leaves it alone (load only ever slows a round down)."""
    ordered = sorted(rates)
    return statistics.median(ordered[-max(1, len(ordered) // 4) :])


def print_best_quarters(rows: list[dict[str, Any]], processes: list[int]) -> None:
    by_key = {(r["backend"], r["mode"], r["processes"]): r for r in rows}
    cells = []
    for (backend, mode, parties), r in by_key.items():
        fewest = by_key.get((backend, mode, min(processes)))
        if parties == min(processes) or fewest is None:
            continue
        mine, theirs = ([x for rep in row["rounds_jobs_per_s"] for x in rep] for row in (r, fewest))
        cells.append(f"{backend} {mode} {best_quarter(mine) / best_quarter(theirs):.2f}x")
    if cells:
        print(
            f"{max(processes)}p/{min(processes)}p, fastest quarter of the rounds of each: " + ", ".join(cells)
        )


def round_ratios(reps: list[dict[str, Any]], others: list[dict[str, Any]]) -> list[float]:
    """jobs/s over the other configuration's, round by round, every repetition."""
    return [
        a / b
        for rep, other in zip(reps, others, strict=True)
        for a, b in zip(rep["rounds_jobs_per_s"], other["rounds_jobs_per_s"], strict=True)
    ]


def summarize_runs(
    runs: dict[tuple[str, str, int], list[dict[str, Any]]], processes: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for (backend, mode, parties), reps in runs.items():
        rates = [r["jobs_per_s"] for r in reps]
        median_rep = sorted(reps, key=lambda r: r["jobs_per_s"])[len(reps) // 2]
        row: dict[str, Any] = {
            "backend": backend,
            "processes": parties,
            "mode": mode,
            "jobs_per_s": statistics.median(rates),
            "runs_jobs_per_s": rates,
            "errors": sum(r["errors"] for r in reps),
            "locked_errors": sum(r["locked_errors"] for r in reps),
            "error_samples": [e for r in reps for e in r["error_samples"]][:KEPT_ERRORS],
            "retries": sum(r["retries"] for r in reps),
            "backoff_s": sum(r["backoff_s"] for r in reps),
            "slowest_op_s": max(r["slowest_op_s"] for r in reps),
            "tail_s": max(r["tail_s"] for r in reps),
            "cpu_us_per_job": statistics.median(r["cpu_s"] / r["jobs"] * 1e6 for r in reps),
            "wal_bytes_runs": [r["wal_bytes"] for r in reps],
            "rounds_jobs_per_s": [r["rounds_jobs_per_s"] for r in reps],
            "per_worker_median_rep": median_rep["per_worker"],
            "share_min": min(r["shares"][0] for r in reps),
            "share_max": max(r["shares"][1] for r in reps),
            "claim_latency_s": percentiles([x for r in reps for x in r["claim_latencies"]]),
            "per_worker_runs": [r["per_worker"] for r in reps],
            "profile_median_rep": median_rep["profile"],
            "profile_runs": [r["profile"] for r in reps] if reps[0]["profile"] else None,
        }
        if mode == "batched" and (backend, "single", parties) in runs:
            row["batched_vs_single"] = round_ratios(reps, runs[backend, "single", parties])
        if parties != min(processes) and (backend, mode, min(processes)) in runs:
            row["vs_fewest_processes"] = round_ratios(reps, runs[backend, mode, min(processes)])
        rows.append(row)
    order = {b: i for i, b in enumerate(BACKENDS)}
    rows.sort(key=lambda r: (order[r["backend"]], r["mode"] != "single", r["processes"]))
    return rows


def print_table(rows: list[dict[str, Any]], processes: list[int]) -> None:
    table = report.Table(
        report.Column("backend", 10, "<"),
        report.Column("procs", 5),
        report.Column("mode", 7, "<"),
        report.Column("jobs/s", 7, spec=".0f"),
        report.Column("batched/single", 18),
        report.Column(f"vs {min(processes)}p", 18),
        report.Column("errors", 6),
        report.Column("retries", 7),
        report.Column("claim ms p50/p99/max", 20),
        report.Column("max op ms", 9, spec=".0f"),
        report.Column("tail ms", 7, spec=".0f"),
        report.Column("cpu us/job", 10, spec=".0f"),
        report.Column("share", 9),
        report.Column("per-worker completions", align="<", sep="  ", pad=False),
    )
    print()
    print(table.header())
    for r in rows:
        bs, vp = (
            report.median_spread(r[key], unit="x") if key in r else ""
            for key in ("batched_vs_single", "vs_fewest_processes")
        )
        lat = r["claim_latency_s"]
        claim = f"{lat['p50'] * 1e3:.2f}/{lat['p99'] * 1e3:.1f}/{lat['max'] * 1e3:.0f}"
        print(
            table.row(
                r["backend"],
                r["processes"],
                r["mode"],
                r["jobs_per_s"],
                bs,
                vp,
                r["errors"],
                r["retries"],
                claim,
                r["slowest_op_s"] * 1e3,
                r["tail_s"] * 1e3,
                r["cpu_us_per_job"],
                f"{r['share_min']:.2f}-{r['share_max']:.2f}",
                r["per_worker_median_rep"],
            )
        )


def print_profiles(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        profile = r["profile_median_rep"]
        if not profile:
            continue
        jobs = sum(r["per_worker_median_rep"])
        wall = profile["wall_s"]

        def us(seconds: float, jobs: int = jobs) -> str:
            return f"{seconds / jobs * 1e6:9.1f} us"

        print(
            f"\n {r['backend']} {r['processes']}p {r['mode']} (median repetition, {jobs} jobs, "
            f"{jobs / profile['span_s']:.0f} jobs/s under the profiler): per job"
        )
        print(f"    {us(profile['span_s'])}  elapsed")
        print(f"    {us(wall)}  workers' wall time, summed over {r['processes']} worker(s)")
        kinds, calls = profile["driver_s"], profile["driver_calls"]
        for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"    {us(seconds)}    driver {kind} ({calls[kind] / jobs:.2f} calls/job)")
        groups = profile["groups_s"]
        for group, seconds in groups.items():
            print(f"    {us(seconds)}    {group}")
        rest = wall - sum(kinds.values()) - groups.get("library backoff sleeps", 0.0)
        print(f"    {us(rest)}    the rest: Python (store, Runner, pool checkout, this loop, profiler)")
        lock = profile["lock"]
        if lock:
            print(
                f"    write lock: held {us(lock.get('held_s', 0.0))}, idle before the same process "
                f"took it again {us(lock.get('idle_same_s', 0.0))}, idle at a handoff to another "
                f"process {us(lock.get('idle_handoff_s', 0.0))}"
            )
            handoffs = lock.get("handoffs", 0.0)
            gaps = sorted(lock["handoff_gaps_s"]) or [0.0]
            quartiles = [gaps[int(q * (len(gaps) - 1))] * 1e3 for q in (0.25, 0.5, 0.75)]
            print(
                f"      {lock.get('transactions', 0.0) / jobs:.2f} transactions/job, {handoffs:.0f} "
                f"handoffs (idle per handoff: quartiles {quartiles[0]:.2f}/{quartiles[1]:.2f}/"
                f"{quartiles[2]:.2f} ms, max {gaps[-1] * 1e3:.1f} ms), "
                f"held {lock.get('held_s', 0.0) / lock['span_s']:.0%} of the elapsed time"
                + (
                    f" (intervals overlapping by {lock['overlap_s'] * 1e3:.1f} ms in all: releases "
                    "timestamped late)"
                    if lock.get("overlap_s")
                    else ""
                )
            )
        if r["wal_bytes_runs"][0] is not None:
            print(f"    -wal file at the end, KiB per repetition: {[b // 1024 for b in r['wal_bytes_runs']]}")
        print("    top functions by own time (us/job):")
        for name, seconds in profile["top_own"].most_common(6):
            print(f"      {us(seconds)}  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        type=lambda s: [b for b in BACKENDS if b in {x.strip() for x in s.split(",")}],
        help="comma-separated: sqlite,postgresql,mariadb (default all three)",
    )
    cli.add_processes(parser)
    parser.add_argument(
        "--modes", default="single,batched", type=lambda s: [m for m in MODES if m in s.split(",")]
    )
    cli.add_repeat(parser)
    cli.add_rounds(
        parser, 3, help="rounds per repetition: N/rounds jobs per configuration, alternating (default 3)"
    )
    parser.add_argument("--single-jobs", type=int, help="N for single (default 6000 SQLite, 2000 servers)")
    parser.add_argument(
        "--batched-jobs", type=int, help="N for batched (default 60000 SQLite, 20000 servers)"
    )
    cli.add_dir(parser)
    cli.add_server_urls(parser)
    parser.add_argument("--profile", action="store_true", help="cProfile the workers; time driver calls")
    cli.add_json(parser)
    cli.add_check(parser, help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    if not args.backends or not args.modes or min(args.processes) < 1 or min(args.repeat, args.rounds) < 1:
        parser.error("need a backend, a mode, processes >= 1, --repeat >= 1 and --rounds >= 1")

    versions = env.versions(*VERSIONS, missing="omit")
    print(
        f"claim_next -> complete cycle, R={args.repeat}, processes {','.join(map(str, args.processes))}; "
        f"python {versions['python']}, SQLite {versions['sqlite']}, SQLAlchemy {versions['sqlalchemy']}, "
        f"{versions['cpus']} CPUs, git {versions['git']}{'; PROFILING (slower)' if args.profile else ''}",
        flush=True,
    )
    started = time.perf_counter()
    with db.workdir("bench-cycle-", args.dir or os.getcwd()) as workdir:
        runs = bench(args, workdir, started)

    rows = summarize_runs(runs, args.processes)
    print_table(rows, args.processes)
    print(
        f"\njobs/s: median of {args.repeat}; ratios: median (range) of the {args.repeat * args.rounds} "
        "per-round ratios. "
        f"errors: exceptions that reached the workers; retries: lock races the library absorbed. "
        f"{time.perf_counter() - started:.0f} s"
    )
    print_best_quarters(rows, args.processes)
    misses = check_targets(rows, args.processes)
    for line in misses:
        print(f"MISSED: {line}")
    if args.profile:
        print_profiles(rows)
    if args.json:
        figures = {
            "benchmark": "claim_next -> complete(_many) cycle, jobs/s",
            "repeat": args.repeat,
            "processes": args.processes,
            "jobs": {f"{b}/{m}": jobs_for(args, b, m) for b in args.backends for m in args.modes},
            "ttl": TTL,
            "targets": {"batched_vs_single": TARGET_BATCHED_VS_SINGLE, "4p_vs_1p": TARGET_4P_VS_1P},
            "environment": versions,
            "rows": rows,
            "misses": misses,
            "profiled": args.profile,
        }
        report.write_json(args.json, figures)
    return 1 if args.check and misses else 0


def bench(
    args: argparse.Namespace, workdir: str, started: float
) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """Every configuration's runs, by (backend, mode, processes): one per repetition."""
    backends: dict[str, Backend] = {}
    workers = None
    try:
        for name in args.backends:
            backends[name] = Backend(name, args, workdir)
            info = backends[name].info()
            details = ", ".join(f"{k}={v}" for k, v in info.items() if k != "version")
            modes = ", ".join(f"{m} N={jobs_for(args, name, m)}" for m in args.modes)
            print(f"  {name}: {info['version']} ({details}); {modes}", flush=True)
        workers = Pool(worker, (args.profile,), args.processes, timeout=BARRIER_TIMEOUT + 120, name="cycle")
        configs = [(mode, parties) for mode in args.modes for parties in args.processes]
        runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        for rep in range(args.repeat):
            for name in rotated(list(backends), rep):
                rounds: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
                for k in range(args.rounds):
                    step = rep * args.rounds + k
                    counts = args.processes if step % 2 == 0 else args.processes[::-1]
                    for mode in rotated(
                        args.modes, step
                    ):  # a mode's process counts one right after the other
                        for parties in counts:
                            total = jobs_for(args, name, mode)
                            n = total * (k + 1) // args.rounds - total * k // args.rounds
                            rounds[mode, parties].append(measure(workers, backends[name], mode, parties, n))
                for (mode, parties), parts in rounds.items():
                    runs.setdefault((name, mode, parties), []).append(combine(parts))
            print(
                f"  repetition {rep + 1}/{args.repeat} done ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    finally:
        if workers is not None:
            workers.close()
        for backend in backends.values():
            backend.close()
    return runs


def check_targets(rows: list[dict[str, Any]], processes: list[int]) -> list[str]:
    """The SQLite targets that were missed, as sentences."""
    misses = []
    for r in rows:
        if r["backend"] != "sqlite":
            continue
        where = f"sqlite {r['processes']}p {r['mode']}"
        if "batched_vs_single" in r and statistics.median(r["batched_vs_single"]) < TARGET_BATCHED_VS_SINGLE:
            misses.append(f"{where}: batched {statistics.median(r['batched_vs_single']):.2f}x single")
        if "vs_fewest_processes" in r and statistics.median(r["vs_fewest_processes"]) < TARGET_4P_VS_1P:
            misses.append(
                f"{where}: {statistics.median(r['vs_fewest_processes']):.2f}x of {min(processes)} process(es)"
            )
        if r["locked_errors"]:
            misses.append(f"{where}: {r['locked_errors']} 'database is locked'/DatabaseBusy reached callers")
    return misses


if __name__ == "__main__":
    sys.exit(main())
