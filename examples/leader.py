"""Leader election with fencing tokens: several processes, one leader writing under its term.

Run it::

    python examples/leader.py                      # 3 candidates, a temp SQLite file
    python examples/leader.py --stall-leader       # the first leader freezes (SIGSTOP) past
                                                   # its ttl; when it wakes, its write is refused
    python examples/leader.py --url postgresql+psycopg://postgres@127.0.0.1/test

Each candidate process runs a :class:`fencing.Election` on the name ``scheduler``. The
leader's work is a *tick*: a row in the application's own ``ticks`` table, written through
``locks.fenced(lease)``, the transaction that checks the term (the lease's fence) in the
database when it stores the row. A follower only reads who leads, once per ``retry``.

``--stall-leader`` freezes the first leader's whole process (``SIGSTOP``: its heartbeat
thread too) just before a write, for twice the ttl. Another candidate takes over with the
next term. When the frozen one wakes, it still holds the lease it had and writes with it:
the database refuses the write (``LeaseLost``), the way an advisory-lock election could not.

The parent checks the outcome in the database and exits 0 only if every check passes: the
ticks' terms never go down, each term was written by one candidate, and (with the stall) the
woken ex-leader's write was refused.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import fencing

metadata = sa.MetaData()
ticks = sa.Table(
    "ticks",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("term", sa.BigInteger, nullable=False),
    sa.Column("candidate", sa.String(64), nullable=False),
)
locks_table = fencing.locks_table(metadata, "example_locks")


def engine_for(url: str) -> sa.Engine:
    if "://" not in url:
        return fencing.create_sqlite_engine(url)
    return sa.create_engine(url)


#: how many ticks the leader writes before it freezes (``--stall-leader``)
TICKS_BEFORE_THE_STALL = 5


def candidate(url: str, me: str, ttl: float, stall: Any, stop: Any, report: Any) -> None:
    """One candidate: campaign, and while leading write a tick every 50 ms under the term.
    ``stall``: an Event, or None; the first leader to find it unset sets it and freezes."""
    engine = engine_for(url)
    locks = fencing.Locks(engine, locks_table)
    election = fencing.Election(locks, "scheduler", me, ttl=ttl, retry=ttl / 10)
    written = 0
    with election:
        while not stop.is_set():
            lease = election.lease
            if lease is None:
                time.sleep(0.02)
                continue
            if stall is not None and written == TICKS_BEFORE_THE_STALL and not stall.is_set():
                stall.set()
                report.put(("stalling", me, lease.fence))
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process freezes here
            try:
                with locks.fenced(lease) as conn:
                    conn.execute(ticks.insert().values(term=lease.fence, candidate=me))
                written += 1
            except fencing.LeaseLost as lost:
                report.put(("refused", me, lease.fence))
                print(f"{me}: write under term {lease.fence} REFUSED ({lost.reason})", flush=True)
            time.sleep(0.05)
    engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a SQLAlchemy URL or a SQLite file (default: a temp SQLite file)")
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=1.0, help="a term's lease, seconds (default 1)")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long to run (default 4)")
    parser.add_argument("--stall-leader", action="store_true", help="freeze the first leader past its ttl")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url or str(Path(tmp) / "leader.db")
        engine = engine_for(url)
        metadata.create_all(engine)  # the ticks table and the locks table
        with engine.begin() as conn:
            conn.execute(ticks.delete())
        # a fresh run: the name forgotten (its terms never come back: the next is above them)
        fencing.Locks(engine, locks_table).delete("scheduler")
        ctx = multiprocessing.get_context("spawn")
        # a SimpleQueue: its put() is written before it returns, so a candidate that freezes
        # itself right after reporting it has been heard
        stop, report = ctx.Event(), ctx.SimpleQueue()
        stall = ctx.Event() if args.stall_leader else None
        procs = [
            ctx.Process(target=candidate, args=(url, f"candidate-{i}", args.ttl, stall, stop, report))
            for i in range(args.candidates)
        ]
        for proc in procs:
            proc.start()
        by_name = {f"candidate-{i}": proc for i, proc in enumerate(procs)}
        events: list[tuple[str, str, int]] = []
        ends = time.monotonic() + args.seconds
        while time.monotonic() < ends:
            if report.empty():
                time.sleep(0.05)
                continue
            event = report.get()
            events.append(event)
            if event[0] == "stalling":
                print(f"{event[1]}: frozen (SIGSTOP) with term {event[2]} for {2 * args.ttl:g} s", flush=True)
                time.sleep(2 * args.ttl)
                pid = by_name[event[1]].pid
                assert pid is not None
                os.kill(pid, signal.SIGCONT)
                ends = max(ends, time.monotonic() + 1.0)
        stop.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():  # (never expected) frozen or stuck: do not leave it behind
                proc.kill()
                proc.join()
        while not report.empty():
            events.append(report.get())
        with engine.connect() as conn:
            rows = conn.execute(sa.select(ticks.c.term, ticks.c.candidate).order_by(ticks.c.id)).all()
        engine.dispose()
    return check(rows, events, args.stall_leader)


def check(rows: list[Any], events: list[tuple[str, str, int]], stalled: bool) -> int:
    failures = []
    terms = [row.term for row in rows]
    if not rows:
        failures.append("no leader wrote anything")
    if terms != sorted(terms):
        failures.append("a tick under an older term was stored after a newer one")
    by_term: dict[int, set[str]] = {}
    for row in rows:
        by_term.setdefault(row.term, set()).add(row.candidate)
    shared = {term: who for term, who in by_term.items() if len(who) > 1}
    if shared:
        failures.append(f"terms written by more than one candidate: {shared}")
    if stalled:
        frozen = [(who, term) for kind, who, term in events if kind == "stalling"]
        refused = {(who, term) for kind, who, term in events if kind == "refused"}
        if not frozen:
            failures.append("no leader was frozen")
        elif frozen[0] not in refused:
            failures.append(f"the woken ex-leader's write under term {frozen[0][1]} was not refused")
        elif len(by_term) < 2:
            failures.append("no other candidate took over")
    for term, who in sorted(by_term.items()):
        print(f"term {term}: {len([t for t in terms if t == term])} ticks by {', '.join(sorted(who))}")
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}")
        return 1
    print(f"PASS: {len(rows)} ticks under {len(by_term)} terms, each term one leader's, never going back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
