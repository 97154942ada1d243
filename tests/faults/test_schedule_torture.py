"""Schedules under faults: four scheduling processes on an accelerated clock, killed, frozen,
restarted, their clocks jumping forward and back, while the ticks' jobs are completed,
deleted and purged; on the database under test.

Each process runs :class:`fencing.Scheduler` on a caller's clock ``SPEED`` times faster than
the wall's (every process reads the same accelerated clock, plus the jumps it was sent:
SIGUSR1 moves its clock half an hour forward, SIGUSR2 half an hour back); a process that
is restarted comes back on the shared clock. Faults, at random through the run: SIGKILL (the
process is restarted a moment later), SIGSTOP for one to three seconds (an hour and more of
the accelerated clock: past any grace, holding whatever it held), a clock jump; and, beside
them, the ticks' jobs are claimed and completed, deleted (a tombstone) or purged (the row
removed, as a retention job would).

What must hold, checked against the database and every process's journal of what it
enqueued (a line per job id, written after the pass committed):

- **0 duplicates**: no job id enqueued twice, across every process and restart; no deleted
  tick brought back (its tombstone stays), no purged one enqueued again;
- **0 missed** (policy ``all``): every tick of the ``every=60`` schedule and of the cron
  schedule (``*/5 * * * *`` in Europe/Paris, the run crossing the night its clocks go back)
  from the first pass to the last one is a job, or was one and was purged;
- the other policies (``latest``, ``none``) enqueue only their schedule's own ticks, once.

``FENCING_SCHEDULE_TORTURE_SECONDS`` sets the fault phase (CI: 12 s per database, some 200
ticks of the minute schedule; ``nox -s schedule_soak -- SECONDS``: 60 s makes 1,000).
"""

from __future__ import annotations

import datetime as dt
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import Engine, delete, select
from sqlalchemy.exc import OperationalError

from fencing import DatabaseBusy, JobStore, Schedule, Scheduler, as_text

pytestmark = [pytest.mark.slow, pytest.mark.sync_only("schedulers are processes of their own")]

SECONDS = float(os.environ.get("FENCING_SCHEDULE_TORTURE_SECONDS", "12"))
PROCESSES = 4
#: accelerated seconds per wall second: 60 s of the wall make 1,000 ticks of a minute schedule
SPEED = 1000.0
#: 2026-10-24 23:00 UTC: Europe/Paris goes back from 03:00 CEST to 02:00 CET at 01:00 UTC
T0 = int(dt.datetime(2026, 10, 24, 23, 0, tzinfo=dt.timezone.utc).timestamp())
JUMP = 1800.0

SCHEDULER = """
import os
import random
import signal
import sys
import time

import sqlalchemy as sa

import fencing

target, wall0, t0, speed, jump, number = sys.argv[1:7]
wall0, t0, speed, jump = float(wall0), float(t0), float(speed), float(jump)
if "://" in target:
    engine = sa.create_engine(target, pool_pre_ping=True)
else:
    engine = fencing.create_sqlite_engine(target)
offset = 0.0


@sa.event.listens_for(engine, "before_cursor_execute")
def dawdle(conn, cursor, statement, parameters, context, executemany):
    # a pass that pauses between reading its schedules and moving them (as a loaded machine
    # would): the window in which another process's pass commits first
    if statement.lstrip().upper().startswith("UPDATE FENCING_SCHEDULES") and random.random() < 0.5:
        time.sleep(random.uniform(0.0, 0.03))


def clock():
    return t0 + (time.time() - wall0) * speed + offset


def jumped(signum, frame):
    global offset
    offset += jump if signum == signal.SIGUSR1 else -jump


signal.signal(signal.SIGUSR1, jumped)
signal.signal(signal.SIGUSR2, jumped)
SCHEDULES = [
    fencing.Schedule("all", every=60, missed="all", catch_up=100_000),
    fencing.Schedule("cron", cron="*/5 * * * *", timezone="Europe/Paris", missed="all", catch_up=100_000),
    fencing.Schedule("latest", every=120, missed="latest", grace=300),
    fencing.Schedule("none", every=180, missed="none", grace=300),
]
scheduler = fencing.Scheduler(fencing.JobStore(engine), SCHEDULES, clock=clock)
with open(f"enqueued-{number}.log", "a") as journal:  # its existence says: started
    while True:
        try:
            enqueued = scheduler.run_pending()
        except fencing.FencingError as exc:
            print(type(exc).__name__, exc, file=sys.stderr, flush=True)
            time.sleep(0.05)
            continue
        for job_id in enqueued:
            journal.write(f"{job_id} {os.getpid()}\\n")
        journal.flush()
        time.sleep(0.01)
"""


def schedules() -> list[Schedule]:
    return [
        Schedule("all", every=60, missed="all", catch_up=100_000),
        Schedule("cron", cron="*/5 * * * *", timezone="Europe/Paris", missed="all", catch_up=100_000),
        Schedule("latest", every=120, missed="latest", grace=300),
        Schedule("none", every=180, missed="none", grace=300),
    ]


class _Process:
    def __init__(self, tmp_path: Path, target: str, wall0: float, number: int) -> None:
        self.number = number
        self.stopped = False
        self.process = subprocess.Popen(
            [sys.executable, "scheduler.py", target, str(wall0), str(T0), str(SPEED), str(JUMP), str(number)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.journal = tmp_path / f"enqueued-{number}.log"

    def ready(self) -> bool:
        return self.journal.exists()

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)


def _ids(engine: Engine, store: JobStore) -> dict[str, int]:
    t = store.table
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.id, t.c.done)).all()
    return {(i.decode() if isinstance(i, bytes) else i): done for i, done in rows}


def test_each_tick_is_one_job_whatever_the_schedulers_go_through(
    tmp_path: Path, target: str, engine: Engine
) -> None:
    store = JobStore(engine)
    store.create_table()
    wall0 = time.time()
    scheduler = Scheduler(store, schedules(), clock=lambda: T0 + (time.time() - wall0) * SPEED)
    scheduler.create_table()
    assert scheduler.run_pending() == []  # registered: the ticks start after now
    first = {row["name"]: row["decided_through"] for row in scheduler.rows()}
    (tmp_path / "scheduler.py").write_text(textwrap.dedent(SCHEDULER))
    processes = [_Process(tmp_path, target, wall0, n) for n in range(PROCESSES)]
    started = time.monotonic()
    while not all(p.ready() for p in processes):
        assert time.monotonic() < started + 60, "the schedulers did not start"
        time.sleep(0.05)
    rng = random.Random(os.environ.get("FENCING_SCHEDULE_TORTURE_SEED", "7"))
    faults: Counter[str] = Counter()
    deleted: set[str] = set()
    purged: set[str] = set()
    thawing: list[tuple[float, _Process]] = []
    restarts = PROCESSES
    ends = time.monotonic() + SECONDS
    try:
        while time.monotonic() < ends:
            time.sleep(rng.uniform(0.05, 0.25))
            now = time.monotonic()
            for when, p in [t for t in thawing if t[0] <= now]:
                p.signal(signal.SIGCONT)
                thawing.remove((when, p))
            kind = rng.choice(["kill", "freeze", "forward", "back", "complete", "delete", "purge"])
            p = rng.choice(processes)
            if kind == "kill" and all(q is not p for _, q in thawing):
                p.signal(signal.SIGKILL)
                p.process.wait(10)
                processes[processes.index(p)] = _Process(tmp_path, target, wall0, restarts)
                restarts += 1
            elif kind == "freeze" and all(q is not p for _, q in thawing):
                p.signal(signal.SIGSTOP)
                thawing.append((now + rng.uniform(1.0, 3.0), p))
            elif kind in ("forward", "back"):
                p.signal(signal.SIGUSR1 if kind == "forward" else signal.SIGUSR2)
            elif kind in ("complete", "delete", "purge"):
                try:
                    _tend(kind, engine, store, rng, deleted, purged)
                except (DatabaseBusy, OperationalError):  # SQLite: a frozen scheduler holds the lock
                    kind = "busy"
            faults[kind] += 1
        for _, p in thawing:
            p.signal(signal.SIGCONT)
        time.sleep(1.0)  # every process runs again on the shared clock: passes commit
    finally:
        for p in processes:
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGKILL)
            p.process.wait(10)

    journal: Counter[str] = Counter()
    for log in tmp_path.glob("enqueued-*.log"):
        for line in log.read_text().splitlines():
            journal[line.split()[0]] += 1
    stored = _ids(engine, store)
    last = {row["name"]: row["decided_through"] for row in scheduler.rows()}
    by_name = {s.name: s for s in schedules()}
    report = f"faults {dict(faults)}, {len(deleted)} deleted, {len(purged)} purged"

    # 0 duplicates: once in every journal together, none back after a delete or a purge
    assert [i for i, n in journal.items() if n > 1] == [], report
    assert [i for i in deleted if stored.get(i) != 2] == [], report  # each still a tombstone
    assert purged.isdisjoint(stored), report
    assert set(journal) <= set(stored) | purged, report  # what was journaled was committed
    # 0 missed where the policy keeps every tick
    for name in ("all", "cron"):
        want = {f"{name}@{_iso(t)}" for t in by_name[name].due(first[name], last[name], 10_000_000)}
        got = {i for i in stored if i.startswith(f"{name}@")} | {
            i for i in purged if i.startswith(f"{name}@")
        }
        assert got == want, (name, sorted(want - got)[:5], sorted(got - want)[:5], report)
    # the other policies: their own ticks only
    for name in ("latest", "none"):
        s = by_name[name]
        for job_id in (i for i in stored if i.startswith(f"{name}@")):
            tick = int(
                dt.datetime.strptime(job_id.split("@")[1], "%Y-%m-%dT%H:%M:%SZ")
                .replace(tzinfo=dt.timezone.utc)
                .timestamp()
            )
            assert s.due(tick - 1, tick, 1) == [tick], (job_id, report)
    minute_ticks = len(by_name["all"].due(first["all"], last["all"], 10_000_000))
    assert minute_ticks >= SECONDS * SPEED / 60 * 0.8, (minute_ticks, report)
    for kind in ("kill", "freeze", "forward", "back"):
        assert faults[kind] > 0, report
    print(f"\n{minute_ticks} minute ticks, 0 duplicates, 0 missed; {report}")


def _tend(
    kind: str, engine: Engine, store: JobStore, rng: random.Random, deleted: set[str], purged: set[str]
) -> None:
    """What happens to the ticks' jobs beside the schedulers: completed, deleted, purged."""
    if kind == "complete":
        for lease in store.claim_next("harness", ttl=30, limit=5):
            store.complete(lease, "ran")
    elif kind == "delete":
        for lease in store.claim_next("harness", ttl=30, limit=2):
            if store.delete(lease.job_id):
                deleted.add(lease.job_id)
    else:
        done = [i for i, d in _ids(engine, store).items() if d == 1 and i not in purged]
        for job_id in rng.sample(done, min(3, len(done))):
            with engine.begin() as conn:  # a retention job removes the row itself
                conn.execute(delete(store.table).where(as_text(store.table.c.id) == job_id))
            purged.add(job_id)


def _iso(tick: int) -> str:
    return dt.datetime.fromtimestamp(tick, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
