"""Named locks and elections: acquire -> release cycles/s, and how long a stalled leader lasts.

What is measured
----------------
**Uncontended cycles.** One process takes a lock and gives it back, N times in a row (one
name, nobody else wanting it), timed with ``time.perf_counter``; cycles/s, medians of R
repetitions, each way side by side in the same run:

``fencing``
    ``locks.try_acquire(name, "bench", ttl=30)`` then ``locks.release(lease)`` on
    ``fencing.Locks(engine)``: two durable transactions, a token that only goes up, writes
    fenced by it. SQLite (``create_sqlite_engine``, ``durability="full"``), PostgreSQL
    (psycopg) and MariaDB (pymysql), as the URLs given.
``advisory``
    PostgreSQL's ``SELECT pg_try_advisory_lock(k)`` then ``SELECT pg_advisory_unlock(k)`` on
    one raw psycopg connection in autocommit: what an advisory-lock election does per term.
    No token, nothing durable (the lock lives in the server's memory, tied to the session).
``filelock``
    ``filelock.FileLock(path).acquire()`` / ``release()`` (one machine only: ``flock`` on a
    local file, no token, gone with the process).

**Takeover.** ``--candidates`` processes run a :class:`fencing.Election` on one name (``ttl``,
``retry``), and the leader writes a row under its term through ``Election.fenced()`` every
20 ms. The parent repeatedly freezes the leader (``SIGSTOP``) and measures the time until the
first row written under a newer term appears (polled every 5 ms): the time from a leader's
stall to the next leader's first accepted write. Then it thaws the old leader (it finds its
term lost and campaigns again). Over ``--takeovers`` takeovers: p50, p99, max, against the
target ``ttl + retry`` at the 99th percentile.

**Contended.** ``--contenders`` processes take turns on one lock for ``--contended-seconds``,
each holding it ``--hold`` s a turn (``acquire(timeout=None)``, sleep, ``release``): turns
per second, how long an acquire waited (p50, p99, max), and the fewest and most turns one
process got (fairness). ``fencing`` at ``poll`` 0.5 s (the default) and 0.05 s, beside
``filelock`` (which polls every 0.05 s) and PostgreSQL's blocking ``pg_advisory_lock`` (the
server wakes the next waiter at the unlock: the handoff a notification could approach).

Reproduce (``pip install -e .[postgresql,mysql] filelock``)::

    python benchmarks/locks.py                                  # SQLite only
    python benchmarks/locks.py --postgresql-url postgresql+psycopg://postgres@127.0.0.1/test \\
        --mariadb-url mysql+pymysql://root@127.0.0.1/test --takeovers 50
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import fencing

METADATA = sa.MetaData()
TERMS = sa.Table(
    "bench_terms",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("term", sa.BigInteger, nullable=False),
)
LOCKS = fencing.locks_table(METADATA, "bench_locks")


def engine_for(url: str) -> sa.Engine:
    return fencing.create_sqlite_engine(url) if "://" not in url else sa.create_engine(url)


def fencing_cycles(url: str, n: int) -> float:
    engine = engine_for(url)
    try:
        locks = fencing.Locks(engine, LOCKS)
        locks.create_table()
        for _ in range(20):  # warm: the pool, the compiled statements, the name's row
            lease = locks.try_acquire("bench", "bench", ttl=30)
            assert lease is not None and locks.release(lease)
        started = time.perf_counter()
        for _ in range(n):
            lease = locks.try_acquire("bench", "bench", ttl=30)
            if lease is None or not locks.release(lease):
                raise SystemExit("the uncontended lock was not taken and given back")
        return n / (time.perf_counter() - started)
    finally:
        engine.dispose()


def advisory_cycles(url: str, n: int) -> float:
    import psycopg

    conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for _ in range(20):
            conn.execute("SELECT pg_try_advisory_lock(42)").fetchone()
            conn.execute("SELECT pg_advisory_unlock(42)").fetchone()
        started = time.perf_counter()
        for _ in range(n):
            row = conn.execute("SELECT pg_try_advisory_lock(42)").fetchone()
            if row is None or not row[0]:
                raise SystemExit("the uncontended advisory lock was not taken")
            conn.execute("SELECT pg_advisory_unlock(42)").fetchone()
        return n / (time.perf_counter() - started)


def filelock_cycles(directory: str, n: int) -> float:
    import filelock

    lock = filelock.FileLock(os.path.join(directory, "bench.lock"))
    started = time.perf_counter()
    for _ in range(n):
        lock.acquire()
        lock.release()
    return n / (time.perf_counter() - started)


# -- contended: several processes taking turns ---------------------------------------------------


def contender(
    kind: str, url: str, me: str, poll: float, hold: float, start: float, end: float, out: Any
) -> None:
    """Take the lock, hold it ``hold`` s, let go, again, from ``start`` to ``end`` (wall clock):
    how long each acquire waited."""
    waits: list[float] = []
    if kind == "fencing":
        engine = engine_for(url)
        locks = fencing.Locks(engine, LOCKS, poll=poll)

        def take() -> Any:
            lease = locks.acquire("contended", me, ttl=30, timeout=None)
            assert lease is not None
            return lease

        def give(lease: Any) -> None:
            assert locks.release(lease)

    elif kind == "advisory":
        import psycopg

        conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        conn = psycopg.connect(conninfo, autocommit=True)

        def take() -> Any:
            conn.execute("SELECT pg_advisory_lock(43)").fetchone()

        def give(lease: Any) -> None:
            conn.execute("SELECT pg_advisory_unlock(43)").fetchone()

    else:
        import filelock

        flock = filelock.FileLock(os.path.join(url, "contended.lock"))

        def take() -> Any:
            flock.acquire()

        def give(lease: Any) -> None:
            flock.release()

    time.sleep(max(0.0, start - time.time()))
    while time.time() < end:
        began = time.perf_counter()
        lease = take()
        waits.append(time.perf_counter() - began)
        time.sleep(hold)
        give(lease)
    out.put((me, waits))


def contended(
    kind: str, url: str, processes: int, seconds: float, poll: float, hold: float
) -> dict[str, float]:
    """``processes`` contenders for ``seconds``: handoffs/s, waits' p50/p99/max, and the
    fewest and most turns one contender got."""
    if kind == "fencing":  # the table, and no leftover holder or waiter from an earlier way
        engine = engine_for(url)
        locks = fencing.Locks(engine, LOCKS)
        locks.create_table()
        locks.delete("contended")
        engine.dispose()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start = time.time() + 3.0  # every process up (spawned, imported) before the race starts
    end = start + seconds
    procs = [
        ctx.Process(target=contender, args=(kind, url, f"p{i}", poll, hold, start, end, out))
        for i in range(processes)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(30)
    waits = [w for _, ws in results for w in ws]
    turns = [len(ws) for _, ws in results]
    return {
        "handoffs": sum(turns) / seconds,
        "p50": statistics.median(waits),
        "p99": percentile(waits, 99),
        "max": max(waits),
        "fewest": min(turns),
        "most": max(turns),
    }


# -- takeovers ---------------------------------------------------------------------------------


def candidate(url: str, me: str, ttl: float, retry: float, stop: Any) -> None:
    engine = engine_for(url)
    locks = fencing.Locks(engine, LOCKS)
    with fencing.Election(locks, "bench-leader", me, ttl=ttl, retry=retry) as election:
        while not stop.is_set():
            lease = election.lease
            if lease is not None:
                try:
                    with locks.fenced(lease) as conn:
                        conn.execute(TERMS.insert().values(term=lease.fence))
                except fencing.LeaseLost:
                    pass
            time.sleep(0.02)
    engine.dispose()


def takeovers(url: str, count: int, candidates: int, ttl: float, retry: float) -> list[float]:
    engine = engine_for(url)
    METADATA.create_all(engine)
    with engine.begin() as conn:
        conn.execute(TERMS.delete())
    locks = fencing.Locks(engine, LOCKS)
    locks.delete("bench-leader")
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    names = [f"c{i}" for i in range(candidates)]
    procs = {name: ctx.Process(target=candidate, args=(url, name, ttl, retry, stop)) for name in names}
    for proc in procs.values():
        proc.start()
    times: list[float] = []
    try:
        for _ in range(count):
            leader = _wait_for(lambda: locks.holder("bench-leader"), 30.0)
            top = _wait_for(lambda leader=leader: _term_written(engine, leader.fence), 30.0)
            del top
            frozen = procs[leader.owner]
            assert frozen.pid is not None
            stalled = time.monotonic()
            os.kill(frozen.pid, signal.SIGSTOP)
            _wait_for(
                lambda leader=leader: _term_written(engine, leader.fence + 1, above=True), 60.0, poll=0.005
            )
            times.append(time.monotonic() - stalled)
            os.kill(frozen.pid, signal.SIGCONT)
    finally:
        stop.set()
        for proc in procs.values():
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGCONT)
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        engine.dispose()
    return times


def _term_written(engine: sa.Engine, term: int, *, above: bool = False) -> bool | None:
    with engine.connect() as conn:
        found = conn.execute(sa.select(sa.func.max(TERMS.c.term))).scalar_one()
    if found is None:
        return None
    return (found >= term) if above else (found == term) or None


def _wait_for(probe: Any, timeout: float, *, poll: float = 0.01) -> Any:
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        value = probe()
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"waited {timeout} s in vain")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--postgresql-url", help="also PostgreSQL (and its advisory locks)")
    parser.add_argument("--mariadb-url", help="also MariaDB/MySQL")
    parser.add_argument("--cycles", type=int, default=1000, help="acquire -> release cycles per repetition")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--takeovers", type=int, default=50)
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--retry", type=float, default=0.1)
    parser.add_argument("--contenders", type=int, default=4, help="processes taking turns on one lock")
    parser.add_argument("--contended-seconds", type=float, default=10.0)
    parser.add_argument("--hold", type=float, default=0.005, help="how long a contender holds the lock")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:
        sqlite_path = str(Path(tmp) / "locks.db")
        ways: list[tuple[str, Any]] = [
            ("fencing, SQLite (full)", lambda: fencing_cycles(sqlite_path, args.cycles)),
            ("filelock (one machine)", lambda: filelock_cycles(tmp, args.cycles)),
        ]
        if args.postgresql_url:
            ways += [
                ("fencing, PostgreSQL", lambda: fencing_cycles(args.postgresql_url, args.cycles)),
                ("pg advisory lock", lambda: advisory_cycles(args.postgresql_url, args.cycles)),
            ]
        if args.mariadb_url:
            ways.append(("fencing, MariaDB", lambda: fencing_cycles(args.mariadb_url, args.cycles)))
        rates: dict[str, list[float]] = {name: [] for name, _ in ways}
        for _ in range(args.repeat):
            for name, way in ways:
                rates[name].append(way())
        print(f"uncontended acquire -> release, {args.cycles} cycles, medians of {args.repeat}:")
        for name, samples in rates.items():
            print(f"  {name:<26} {statistics.median(samples):>10,.0f} cycles/s")
        print(
            f"\ncontended: {args.contenders} processes take turns on one lock for "
            f"{args.contended_seconds:g} s, each holding it {args.hold * 1000:g} ms a turn:"
        )
        contended_ways = [
            ("fencing, SQLite, poll 0.5 s", "fencing", sqlite_path, 0.5),
            ("fencing, SQLite, poll 0.05 s", "fencing", sqlite_path, 0.05),
            ("filelock (one machine)", "filelock", tmp, 0.0),
        ]
        if args.postgresql_url:
            contended_ways += [
                ("fencing, PostgreSQL, poll 0.5 s", "fencing", args.postgresql_url, 0.5),
                ("fencing, PostgreSQL, poll 0.05 s", "fencing", args.postgresql_url, 0.05),
                ("pg_advisory_lock (blocking)", "advisory", args.postgresql_url, 0.0),
            ]
        if args.mariadb_url:
            contended_ways += [
                ("fencing, MariaDB, poll 0.5 s", "fencing", args.mariadb_url, 0.5),
                ("fencing, MariaDB, poll 0.05 s", "fencing", args.mariadb_url, 0.05),
            ]
        for name, kind, url, poll in contended_ways:
            r = contended(kind, url, args.contenders, args.contended_seconds, poll, args.hold)
            print(
                f"  {name:<34} {r['handoffs']:>7,.1f} turns/s  wait p50 {r['p50']:.3f} s  "
                f"p99 {r['p99']:.3f} s  max {r['max']:.3f} s  "
                f"turns per process {r['fewest']:.0f}-{r['most']:.0f}"
            )
        urls = [("SQLite", sqlite_path)]
        if args.postgresql_url:
            urls.append(("PostgreSQL", args.postgresql_url))
        if args.mariadb_url:
            urls.append(("MariaDB", args.mariadb_url))
        target = args.ttl + args.retry
        print(
            f"\ntakeover: a leader SIGSTOPped -> the next leader's first accepted write; "
            f"{args.takeovers} takeovers, {args.candidates} candidates, ttl {args.ttl:g} s, "
            f"retry {args.retry:g} s (target p99 <= {target:g} s):"
        )
        for name, url in urls:
            times = takeovers(url, args.takeovers, args.candidates, args.ttl, args.retry)
            p50, p99 = statistics.median(times), percentile(times, 99)
            verdict = "met" if p99 <= target else "MISSED"
            print(f"  {name:<12} p50 {p50:.3f} s  p99 {p99:.3f} s  max {max(times):.3f} s  ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
