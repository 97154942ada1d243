"""Periodic jobs under the same faults, side by side: duplicates and misses per tick.

What is run
-----------
Each system keeps one schedule, "every ``--every`` seconds", with **two scheduling processes**
(as two machines or two pods would run it), for ``--seconds`` of wall time; the same faults,
from one seeded timeline, hit each system's two processes at the same moments:

* ``freeze``: one process ``SIGSTOP``-ped for 3 to 8 s, then ``SIGCONT``;
* ``kill``: one process ``SIGKILL``-ed, and started again 1 s later.

The systems, each as its documentation tells users to run it:

* **fencing**: two processes, each ``fencing.Worker`` keeping ``Schedule("tick", every=N,
  missed="all")`` (``schedules=``), on PostgreSQL; a dispatch is a tick's job;
* **APScheduler 3**: two ``BlockingScheduler`` processes sharing one ``SQLAlchemyJobStore`` on
  PostgreSQL (its documentation says a job store must not be shared: this is what happens when
  it is, as two replicas of one service do), an interval job added by both with
  ``replace_existing=True``, defaults otherwise (``coalesce``, ``misfire_grace_time=1``); a
  dispatch is a job submission (``EVENT_JOB_SUBMITTED``, with its scheduled run time);
* **Celery beat**: two ``celery beat`` processes (each its own schedule file, as on two
  machines) sending an every-N-seconds task through the local Redis to one Celery worker that
  no fault touches; a dispatch is a task the worker ran.

The tally: the run is cut into windows of ``--every`` seconds (for fencing and APScheduler the
tick's scheduled instant names its window; for Celery, whose messages carry no scheduled
instant, the moment the worker started the task); from 10 s after the start to 10 s before
the end, a window with two or more dispatches counts its extra ones as **duplicates**, a
window with none is a **miss**.

Run it in the peers' venv (``pip install -e .[postgresql,cron] "apscheduler>=3.11,<4"
"celery[redis]>=5.5"``)::

    python benchmarks/schedule_peers.py --seconds 120 --every 2
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fencing

PG = os.environ.get("FENCING_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("FENCING_REDIS_URL", "redis://127.0.0.1:6379/12")

FENCING = """
import sys, sqlalchemy as sa, fencing
url, every = sys.argv[1], int(sys.argv[2])
engine = sa.create_engine(url, pool_pre_ping=True)
store = fencing.JobStore(engine, fencing.jobs_table(sa.MetaData(), "sp_jobs"))
scheduler = fencing.Scheduler(store, [fencing.Schedule("tick", every=every, missed="all")], poll=0.2)
scheduler.create_table()
fencing.Worker(store, lambda job: "ran", schedules=scheduler, ttl=5).run()
"""

APSCHEDULER = """
import sys, time, logging
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.events import EVENT_JOB_SUBMITTED
url, every, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def tick():
    pass

def submitted(event):
    with open(log, "a") as f:
        for at in event.scheduled_run_times:
            f.write(f"{at.timestamp()}\\n")

s = BlockingScheduler(jobstores={"default": SQLAlchemyJobStore(url=url, tablename="sp_apscheduler")})
s.add_listener(submitted, EVENT_JOB_SUBMITTED)
s.add_job(tick, "interval", seconds=every, id="tick", replace_existing=True)
s.start()
"""

CELERY = """
import os, time
from celery import Celery
app = Celery("sp_celery", broker=os.environ["SP_REDIS"])
app.conf.beat_schedule = {"tick": {"task": "sp_celery.tick", "schedule": float(os.environ["SP_EVERY"])}}
app.conf.worker_hijack_root_logger = False

@app.task(name="sp_celery.tick")
def tick():
    with open(os.environ["SP_LOG"], "a") as f:
        f.write(f"{time.time()}\\n")
"""


class Pair:
    """A system's two scheduling processes, restarted after a kill."""

    def __init__(self, name: str, start: Any) -> None:
        self.name = name
        self.start = start
        self.processes = [start(n) for n in range(2)]
        self.frozen: dict[int, float] = {}

    def freeze(self, n: int, until: float) -> None:
        self.processes[n].send_signal(signal.SIGSTOP)
        self.frozen[n] = until

    def thaw_due(self, now: float) -> None:
        for n, until in list(self.frozen.items()):
            if until <= now:
                self.processes[n].send_signal(signal.SIGCONT)
                del self.frozen[n]

    def kill(self, n: int) -> None:
        self.frozen.pop(n, None)
        self.processes[n].send_signal(signal.SIGCONT)
        self.processes[n].kill()
        self.processes[n].wait(10)

    def restart(self, n: int) -> None:
        self.processes[n] = self.start(n + 10 * int(time.time()))

    def stop(self) -> None:
        for p in self.processes:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(10)


def tally(instants: list[float], every: int, start: float, end: float) -> tuple[int, int, int, int]:
    """The whole windows between ``start`` and ``end``: how many, their dispatches, the
    duplicates (dispatches past the first of a window) and the misses (windows with none)."""
    first, last = int(start // every) + 1, int(end // every) - 1
    counts = collections.Counter(int(t // every) for t in instants)
    windows = range(first, last + 1)
    dispatches = sum(counts[w] for w in windows)
    duplicates = sum(max(0, counts[w] - 1) for w in windows)
    misses = sum(1 for w in windows if counts[w] == 0)
    return len(windows), dispatches, duplicates, misses


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--seed", default="39")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="schedule-peers-"))
    (work / "sp_fencing.py").write_text(textwrap.dedent(FENCING))
    (work / "sp_aps.py").write_text(textwrap.dedent(APSCHEDULER))
    (work / "sp_celery.py").write_text(textwrap.dedent(CELERY))
    engine = sa.create_engine(PG)
    md = sa.MetaData()
    store = fencing.JobStore(engine, fencing.jobs_table(md, "sp_jobs"))
    with engine.begin() as conn:
        for name in ("sp_jobs", "sp_apscheduler", "fencing_schedules"):
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
    store.create_table()
    aps_log, celery_log = work / "aps.log", work / "celery.log"
    env = {**os.environ, "SP_REDIS": REDIS, "SP_EVERY": str(args.every), "SP_LOG": str(celery_log),
           "PYTHONPATH": str(work)}  # fmt: skip
    flush = f"import redis; redis.Redis.from_url('{REDIS}').flushdb()"
    subprocess.run([sys.executable, "-c", flush], check=True)

    def popen(argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    celery = [sys.executable, "-m", "celery", "-A", "sp_celery"]
    worker = popen([*celery, "worker", "--pool", "threads", "-c", "2", "-l", "WARNING"])
    every = str(args.every)
    pairs = [
        Pair("fencing", lambda n: popen([sys.executable, "sp_fencing.py", PG, every])),
        Pair("APScheduler 3", lambda n: popen([sys.executable, "sp_aps.py", PG, every, str(aps_log)])),
        Pair("Celery beat", lambda n: popen([*celery, "beat", "-s", str(work / f"beat-{n}"), "-l", "ERROR"])),
    ]
    started = time.time()
    rng = random.Random(args.seed)
    faults: collections.Counter[str] = collections.Counter()
    restarts: list[tuple[float, int]] = []
    next_fault = time.monotonic() + 8
    ends = time.monotonic() + args.seconds
    try:
        while time.monotonic() < ends:
            now = time.monotonic()
            for pair in pairs:
                pair.thaw_due(now)
            for due, n in [r for r in restarts if r[0] <= now]:
                restarts.remove((due, n))
                for pair in pairs:
                    pair.restart(n)
            if now >= next_fault:
                n = rng.randrange(2)
                if rng.random() < 0.5 and n not in pairs[0].frozen and all(r[1] != n for r in restarts):
                    until = now + rng.uniform(3, 8)
                    for pair in pairs:
                        pair.freeze(n, until)
                    faults["freeze"] += 1
                elif all(r[1] != n for r in restarts):
                    for pair in pairs:
                        pair.kill(n)
                    restarts.append((now + 1.0, n))
                    faults["kill"] += 1
                next_fault = now + rng.uniform(4, 8)
            time.sleep(0.05)
    finally:
        ended = time.time()
        for pair in pairs:
            pair.stop()
        time.sleep(2)  # the Celery worker runs what was sent
        worker.terminate()
        worker.wait(30)
    t = store.table
    with engine.connect() as conn:
        ids = conn.execute(sa.select(fencing.as_text(t.c.id))).scalars().all()
    utc = dt.timezone.utc
    fencing_ticks = [
        dt.datetime.strptime(i.split("@")[1], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=utc).timestamp()
        for i in ids
        if i.startswith("tick@")
    ]
    read = lambda p: [float(x) for x in p.read_text().split()] if p.exists() else []  # noqa: E731
    span = (started + 10, ended - 10)
    said = f"{args.seconds:.0f} s, every {args.every} s, faults {dict(faults)}"
    print(f"{said} (the same moments for each system)")
    print("| system | windows | dispatches | duplicates | misses |")
    print("|---|---:|---:|---:|---:|")
    for name, instants in (("fencing", fencing_ticks), ("APScheduler 3", read(aps_log)),
                           ("Celery beat", read(celery_log))):  # fmt: skip
        windows, dispatches, duplicates, misses = tally(instants, args.every, *span)
        print(f"| {name} | {windows} | {dispatches} | {duplicates} | {misses} |")


if __name__ == "__main__":
    main()
