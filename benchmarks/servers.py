"""Claim -> complete throughput on PostgreSQL and MariaDB: raw driver vs ``fencing.JobStore``.

What is measured
----------------
Jobs per second through the whole life of a job: ``claim`` (one transaction) then
``complete`` (another transaction), both committed, for N freshly enqueued jobs, two ways:

``raw``
    The driver itself -- ``psycopg.connect`` / ``pymysql.connect`` with the connect arguments
    SQLAlchemy's dialect derives from the URL (for pymysql that includes the ``FOUND_ROWS``
    client flag the store's row counts rely on), autocommit off -- executing the SQL text the
    library's Core statements compile to for the engine's dialect (``fencing.statements``),
    with the same bind parameters: PostgreSQL ``UPDATE ... RETURNING`` then ``COMMIT``;
    MariaDB ``UPDATE``, (on a row count of 1) ``SELECT fence, until``, ``COMMIT``; then the
    guarded ``UPDATE`` of ``complete`` and ``COMMIT``. One cursor, reused; job ids, owner and
    result converted before the clock starts by the library's own bind processors (UTF-8
    bytes for MariaDB's id and owner columns). No argument checks, no result objects: it is
    the floor.
``store``
    ``fencing.JobStore(sqlalchemy.create_engine(url), table)``: ``store.claim(id, owner,
    ttl=60, now=...)`` then ``store.complete(lease, "ok", now=...)``. Nothing observes the
    engine, so the store runs these on its fast path (``fencing.execution.Runner``):
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
import json
import multiprocessing
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any

import sqlalchemy
from sqlalchemy import Engine, MetaData, Table, bindparam, event

import fencing
from fencing.schema import KEY_TYPE
from fencing.statements import Statements

URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
WAYS = ("raw", "store")
CLOCKS = ("caller", "database")
TTL = 60.0
RESULT = "ok"
WARMUP = 20  # untimed cycles per process before every measurement
TARGET = 0.7
BARRIER_TIMEOUT = 300.0
PROBE_NOW = 1000.25

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


def raw_connect(engine: Engine, *, recording: bool = False) -> Any:
    """A driver connection with the arguments the engine's dialect would use, autocommit off;
    ``recording``: one of the recording subclasses (see :func:`recording_classes`)."""
    _, params = engine.dialect.create_connect_args(engine.url)
    if engine.dialect.name == "postgresql":
        params.pop("context", None)  # SQLAlchemy's copy of psycopg's default adapters
    conn = open_driver_connection(engine.dialect.name, (), params, recording=recording)
    conn.autocommit = False
    return conn


def open_driver_connection(db: str, cargs: Any, cparams: dict[str, Any], *, recording: bool) -> Any:
    """``psycopg.connect`` / ``pymysql.connect``, or the same on the recording classes."""
    if db == "postgresql":
        import psycopg

        if not recording:
            return psycopg.connect(*cargs, **cparams)
        connection_class, cursor_class = recording_classes(db)
        return connection_class.connect(*cargs, cursor_factory=cursor_class, **cparams)
    import pymysql

    if not recording:
        return pymysql.connect(*cargs, **cparams)
    connection_class, cursor_class = recording_classes(db)
    return connection_class(*cargs, cursorclass=cursor_class, **cparams)


def raw_cycles(conn: Any, plan: RawPlan, ids: Iterable[Any], *, owner: Any, result: Any, now: NowFn) -> int:
    """claim -> complete on each job, two transactions each; returns the number of failures.

    ``ids``, ``owner`` and ``result`` are as the driver receives them (:meth:`RawPlan.values`).
    """
    cur = conn.cursor()
    execute, fetchall, commit = cur.execute, cur.fetchall, conn.commit
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

#: where the recording connections and cursors log their calls; ``None``: not recording
_LOG: list[list[tuple[Any, ...]] | None] = [None]


def _record(*entry: Any) -> None:
    log = _LOG[0]
    if log is not None:
        log.append(entry)


def _params(params: Any) -> Any:
    if params is None:
        return None
    return dict(params) if isinstance(params, dict) else tuple(params)


class _RecordsFetches:
    """Mixed into a driver's cursor: each fetch is logged, then done (the same on every driver)."""

    def fetchone(self) -> Any:
        _record("fetch", "fetchone")
        return super().fetchone()  # type: ignore[misc]

    def fetchmany(self, *size: Any) -> Any:
        _record("fetch", "fetchmany")
        return super().fetchmany(*size)  # type: ignore[misc]

    def fetchall(self) -> Any:
        _record("fetch", "fetchall")
        return super().fetchall()  # type: ignore[misc]


class _RecordsTransactions:
    """Mixed into a driver's connection: ``commit()`` and ``rollback()`` are logged, then done."""

    def commit(self) -> None:
        _record("commit")
        super().commit()  # type: ignore[misc]

    def rollback(self) -> None:
        _record("rollback")
        super().rollback()  # type: ignore[misc]


@functools.cache
def recording_classes(db: str) -> tuple[type, type]:
    """Subclasses of the driver's connection and cursor that log what they are asked to do
    (while :data:`_LOG` holds a list) and then do it: ``execute``/``executemany`` with their
    SQL and parameters, ``fetch*``, ``commit()`` and ``rollback()``."""
    if db == "postgresql":
        import psycopg

        class PgCursor(_RecordsFetches, psycopg.Cursor):
            def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
                _record("execute", str(query), _params(params))
                return super().execute(query, params, **kw)

            def executemany(self, query: Any, params_seq: Any, **kw: Any) -> Any:
                params_seq = list(params_seq)
                _record("executemany", str(query), [_params(p) for p in params_seq])
                return super().executemany(query, params_seq, **kw)

        class PgConnection(_RecordsTransactions, psycopg.Connection):
            pass

        return PgConnection, PgCursor
    import pymysql
    import pymysql.cursors

    class MyCursor(_RecordsFetches, pymysql.cursors.Cursor):
        def execute(self, query: Any, args: Any = None) -> Any:
            _record("execute", query, _params(args))
            return super().execute(query, args)

        def executemany(self, query: Any, args: Any) -> Any:
            args = list(args)
            _record("executemany", query, [_params(a) for a in args])
            return super().executemany(query, args)

    class MyConnection(_RecordsTransactions, pymysql.connections.Connection):
        pass

    return MyConnection, MyCursor


@contextlib.contextmanager
def recording(log: list[tuple[Any, ...]]) -> Any:
    _LOG[0] = log
    try:
        yield log
    finally:
        _LOG[0] = None


def recording_engine(url: str) -> Engine:
    """An engine whose every new DBAPI connection is a recording one: a ``do_connect``
    listener opens it with the arguments SQLAlchemy would have used."""
    engine = sqlalchemy.create_engine(url)
    db = engine.dialect.name

    def do_connect(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        return open_driver_connection(db, cargs, cparams, recording=True)

    event.listen(engine, "do_connect", do_connect)
    return engine


def transcripts(url: str, table: Table, clock: str) -> dict[str, list[tuple[Any, ...]]]:
    """One claim -> complete of the probe job each way: what reached the driver."""
    engine = recording_engine(url)
    store = fencing.JobStore(engine, table)
    plan = RawPlan(engine.dialect, table, clock)
    now = (lambda: PROBE_NOW) if clock == "caller" else (lambda: None)
    owner = "probe-owner"
    logs: dict[str, list[tuple[Any, ...]]] = {"store": [], "raw": []}
    try:
        reset_table(engine, table, ["probe"])
        # opens the store's connection (and runs SQLAlchemy's first-connect queries) unrecorded
        store.state("probe")
        with recording(logs["store"]):
            failures = store_cycles(store, ["probe"], owner=owner, now=now)
        reset_table(engine, table, ["probe"])
        raw = raw_connect(engine, recording=True)
        try:
            with recording(logs["raw"]):
                failures += raw_cycles(
                    raw,
                    plan,
                    plan.values("job_id", ["probe"]),
                    owner=plan.value("holder", owner),
                    result=plan.value("new_result", RESULT),
                    now=now,
                )
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


# -- the table ----------------------------------------------------------------------------------


def reset_table(engine: Engine, table: Table, ids: list[str]) -> None:
    """Empty the table, then enqueue ``ids`` (claimable, never leased) in one transaction."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE TABLE {table.name}")
    with engine.begin() as conn:
        # typed: MariaDB's id column is UTF-8 bytes (fencing.schema.KEY_TYPE converts)
        conn.execute(table.insert().values(id=bindparam("id", type_=KEY_TYPE)), [{"id": i} for i in ids])
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.exec_driver_sql(f"ANALYZE {table.name}")


def server_info(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        run = conn.exec_driver_sql
        if engine.dialect.name == "postgresql":
            return {
                "version": run("SHOW server_version").scalar(),
                "synchronous_commit": run("SHOW synchronous_commit").scalar(),
                "fsync": run("SHOW fsync").scalar(),
            }
        version, flush, sync_binlog, log_bin = run(
            "SELECT VERSION(), @@innodb_flush_log_at_trx_commit, @@sync_binlog, @@log_bin"
        ).one()
        return {
            "version": version,
            "innodb_flush_log_at_trx_commit": int(flush),
            "sync_binlog": int(sync_binlog),
            "log_bin": int(log_bin),
        }


# -- worker processes ---------------------------------------------------------------------------


def worker(
    index: int, url: str, table_name: str, barriers: dict[int, Any], commands: Any, results: Any
) -> None:
    """One process: its own engine and store, its own raw connection, for the whole run."""
    barrier = None
    try:
        engine = sqlalchemy.create_engine(url)
        table = fencing.jobs_table(MetaData(), table_name)
        store = fencing.JobStore(engine, table)
        plans = {clock: RawPlan(engine.dialect, table, clock) for clock in CLOCKS}
        raw = raw_connect(engine)
        owner = owner_of(index)
        results.put(("ready", index))
        while (command := commands.get()) is not None:
            way, clock, warm_ids, ids, parties = command
            barrier = barriers[parties]
            now = now_fn(clock)
            run: Callable[[list[Any]], int]
            if way == "raw":
                plan = plans[clock]
                warm, timed = plan.values("job_id", warm_ids), plan.values("job_id", ids)
                run = functools.partial(
                    raw_cycles,
                    raw,
                    plan,
                    owner=plan.value("holder", owner),
                    result=plan.value("new_result", RESULT),
                    now=now,
                )
            else:
                warm, timed = warm_ids, ids
                run = functools.partial(store_cycles, store, owner=owner, now=now)
            failures = run(warm)
            gc.collect()
            barrier.wait(BARRIER_TIMEOUT)
            start, cpu = time.perf_counter(), time.process_time()  # perf_counter: CLOCK_MONOTONIC,
            failures += run(timed)  # comparable across processes
            finish, cpu = time.perf_counter(), time.process_time() - cpu
            results.put(("done", index, start, finish, failures, cpu))
        raw.close()
        engine.dispose()
    except BaseException:
        if barrier is not None:
            barrier.abort()
        results.put(("error", index, traceback.format_exc()))


class Pool:
    """max(``sizes``) spawned workers on one database; a measurement uses the first ``parties``."""

    def __init__(self, url: str, table_name: str, sizes: list[int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        barriers = {p: ctx.Barrier(p) for p in sizes}
        self.commands = [ctx.Queue() for _ in range(max(sizes))]
        self.procs = [
            ctx.Process(
                target=worker,
                args=(i, url, table_name, barriers, q, self.results),
                name=f"bench-{i}",
                daemon=True,
            )
            for i, q in enumerate(self.commands)
        ]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self._get("ready")

    def _get(self, kind: str) -> tuple[Any, ...]:
        message = self.results.get(timeout=BARRIER_TIMEOUT + 60)
        if message[0] == "error":
            raise SystemExit(f"worker {message[1]} failed:\n{message[2]}")
        if message[0] != kind:
            raise SystemExit(f"unexpected worker message {message!r}")
        return message  # type: ignore[no-any-return]

    def measure(
        self, way: str, clock: str, slices: list[tuple[list[str], list[str]]]
    ) -> tuple[int, float, float]:
        """All slices run at once, one process each: the jobs, the seconds from the first
        start to the last finish, and the client processes' CPU seconds."""
        parties = len(slices)
        for q, (warm_ids, ids) in zip(self.commands, slices, strict=False):
            q.put((way, clock, warm_ids, ids, parties))
        done = [self._get("done") for _ in range(parties)]
        failures = sum(m[4] for m in done)
        if failures:
            raise SystemExit(f"{way}/{clock}/{parties} processes: {failures} claim -> complete cycles failed")
        span = max(m[3] for m in done) - min(m[2] for m in done)
        jobs = sum(len(ids) for _, ids in slices)
        return jobs, span, sum(m[5] for m in done)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


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
        info = server_info(engine)
        durability = ", ".join(f"{k}={v}" for k, v in info.items() if k != "version")
        print(f"\n{db}: {info['version']} ({durability}); table {table_name}", flush=True)
        sql = {clock: transcripts(url, table, clock) for clock in CLOCKS}
        if args.show_sql:
            for clock, logs in sql.items():
                print(f" {clock} clock, one claim -> complete (the raw way sends the same):")
                show_transcripts({"store": logs["store"]})
        pool = Pool(url, table_name, args.processes)
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
            shift = rep % len(configs)
            for parties, clock in configs[shift:] + configs[:shift]:
                totals = {way: [0, 0.0, 0.0] for way in WAYS}  # jobs, seconds, CPU seconds
                for k in range(args.rounds):
                    n = args.jobs * (k + 1) // args.rounds - args.jobs * k // args.rounds
                    for way in WAYS if (rep + k) % 2 == 0 else WAYS[::-1]:
                        tag = f"r{rep}k{k}p{parties}{way[0]}{clock[0]}"
                        slices = slices_for(tag, n, parties)
                        reset_table(engine, table, [i for warm, ids in slices for i in warm + ids])
                        for i, figure in enumerate(pool.measure(way, clock, slices)):
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
STORE_TRANSACTION = ("fencing/execution.py", "run")


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
    reset_table(engine, table, warm + ids)
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


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'db':<11} {'processes':>9} {'clock':<9} {'raw jobs/s':>11} {'store jobs/s':>13} "
        f"{'store/raw':>10} {'per-rep ratios':>15}   {'client CPU us/job raw, store':>28}"
    )
    for r in rows:
        paired = r["paired_ratios"]
        miss = "" if r["store_vs_raw"] >= TARGET else f"  < {TARGET}x"
        print(
            f"{r['db']:<11} {r['processes']:>9} {r['clock']:<9} {r['raw_jobs_per_s']:>11.0f} "
            f"{r['store_jobs_per_s']:>13.0f} {r['store_vs_raw']:>9.3f}x "
            f"{min(paired):>7.2f}-{max(paired):.2f}x"
            f"   {r['raw_cpu_us_per_job']:>16.0f}, {r['store_cpu_us_per_job']:.0f}{miss}"
        )


def versions() -> dict[str, str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        git = subprocess.run(
            ["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        git = ""
    return {
        "git": git or "unknown",
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": metadata.version("psycopg"),
        "pymysql": metadata.version("PyMySQL"),
        "fencing": fencing.__version__,
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--db", choices=["postgresql", "mariadb", "both"], default="both")
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per measurement (default 1000)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; medians reported (default 3)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds per repetition: raw and store alternate on N/rounds jobs each (default 4)",
    )
    parser.add_argument(
        "--processes",
        default="1,4",
        type=lambda s: sorted({int(p) for p in s.split(",")}),
        help="comma-separated worker process counts (default 1,4)",
    )
    parser.add_argument(
        "--database-clock-at",
        default="1",
        type=lambda s: {int(p) for p in s.split(",") if p},
        help="process counts that also measure now=None, the database clock (default 1; '' for none)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    parser.add_argument("--postgresql-url", default=URLS["postgresql"])
    parser.add_argument("--mariadb-url", default=URLS["mariadb"])
    parser.add_argument("--show-sql", action="store_true", help="print what one claim -> complete sends")
    parser.add_argument("--profile", action="store_true", help="cProfile the store loop afterwards")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if a ratio is below {TARGET}x")
    args = parser.parse_args(argv)
    if (
        args.jobs < max(args.processes) * args.rounds
        or min(args.processes) < 1
        or min(args.repeat, args.rounds) < 1
    ):
        parser.error("need --jobs >= processes x rounds, processes >= 1, --repeat >= 1 and --rounds >= 1")

    dbs = ["postgresql", "mariadb"] if args.db == "both" else [args.db]
    urls = {"postgresql": args.postgresql_url, "mariadb": args.mariadb_url}
    env = versions()
    print(
        f"claim -> complete, N={args.jobs} jobs per measurement, R={args.repeat}, "
        f"processes {','.join(map(str, args.processes))}; python {env['python']}, "
        f"SQLAlchemy {env['sqlalchemy']}, psycopg {env['psycopg']}, pymysql {env['pymysql']}, "
        f"{env['cpus']} CPUs, git {env['git']}"
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
            "environment": env,
            "databases": results,
            "rows": rows,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2, default=repr)
        print(f"figures written to {args.json}")
    if args.check and any(r["store_vs_raw"] < TARGET for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
