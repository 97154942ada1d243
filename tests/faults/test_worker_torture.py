"""The worker runtime under faults: ``fencing worker`` processes frozen past their leases,
killed (anywhere: in a job, in a completion's transaction, in a claim), stopped by SIGTERM
and revoked, on the database under test, thread slots and asyncio slots.

What must hold, checked against the database and the journal of every start:

- **every job is done**, however often its workers were frozen, killed or stopped;
- **a result is stored once, by the job's last lease holder**: each job's effect (a row the
  job's function writes into an application table in its completion's transaction,
  ``job.completing``) exists exactly once, with the job's final fence; a job whose function
  returns its result has that result from its final fence;
- **no lease runs twice**: each (job, fence) started once;
- **a worker killed inside its completion's transaction** (after the function's own write in
  ``job.completing``, or after the completion's UPDATE of a returned result; before the
  COMMIT; each of ``DIE``'s jobs once) leaves nothing: the write vanishes with the
  transaction, and the job is completed once, by a later holder;
- **SIGTERM is graceful**: a stopped worker exits (code 0) within the drain plus a heartbeat
  (and slack for a loaded machine), and holds nothing once it has exited: each of its jobs
  completed or handed back;
- **a run past the timeout writes nothing**: the workers run with ``--timeout``, and the first
  run of each of ``HANG``'s jobs outlasts it (a thread sleeps on, then tries its write; a
  coroutine is cancelled): the job is retried and its effect and result are still its last
  holder's alone.

``FENCING_WORKER_TORTURE_SECONDS`` sets the fault phase (CI: 8 s per database and front;
``nox -s worker_soak -- SECONDS`` the long form).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import BigInteger, Column, Engine, Integer, MetaData, String, Table, select

from fencing import JobStore, failures_table, jobs_table, payloads_table

pytestmark = [pytest.mark.slow, pytest.mark.sync_only("workers are processes of their own")]

SECONDS = float(os.environ.get("FENCING_WORKER_TORTURE_SECONDS", "8"))
PROCESSES = 4
CONCURRENCY = 3
TTL = 1.5
DRAIN = 1.0
#: a SIGTERM'd worker's exit, past the drain and one heartbeat: interpreter shutdown, the
#: hand-back's round trips, a loaded 2-core machine
SLACK = 4.0
KINDS = ["freeze", "kill", "term", "revoke"]
#: each run's time limit (every ordinary run is shorter), and how long a HANG job's first run takes
TIMEOUT = 3.0
HANG_FOR = 4.5
#: enough jobs to keep the slots busy through the fault phase (about 20 finish a second)
JOBS = max(150, int(SECONDS * 15))

TASKS = """
import asyncio
import os
import re
import signal
import time

import sqlalchemy as sa

effects = sa.Table(
    "wt_effects", sa.MetaData(),
    sa.Column("job_id", sa.String(64)), sa.Column("fence", sa.BigInteger), sa.Column("pid", sa.Integer),
)

#: jobs whose function returned and whose worker dies inside the completion that stores them
_DIE_AT_COMPLETION = set()
_COMPLETION = re.compile(r"\\bSET\\b.*\\bdone\\s*=\\s*1\\b", re.I | re.S)


def _started(job):
    with open("starts.log", "a") as journal:  # one short append per start: whole lines
        journal.write(f"{job.job_id} {job.attempt} {os.getpid()}\\n")


def _dies(job_ids, where):
    \"\"\"SIGKILL, once per job (a marker file says it died already), said in dies.log.\"\"\"
    for job_id in job_ids:
        open(f"died-{job_id}", "w").close()
    with open("dies.log", "a") as journal:
        journal.write(f"{where} {os.getpid()} {' '.join(sorted(job_ids))}\\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _first_run(job):
    return job.payload.get("die") and not os.path.exists(f"died-{job.job_id}")


def _pause(job):
    \"\"\"The run's sleep: past the worker's timeout the first time a ``hang`` job runs.\"\"\"
    if job.payload.get("hang") and not os.path.exists(f"hung-{job.job_id}"):
        open(f"hung-{job.job_id}", "w").close()
        return job.payload["hang"]
    return job.payload["sleep"]


@sa.event.listens_for(sa.Engine, "after_cursor_execute")
def _inside_the_completion(conn, cursor, statement, parameters, context, executemany):
    # the completion's UPDATE has run, its transaction is open: die before its COMMIT
    if _DIE_AT_COMPLETION and _COMPLETION.search(statement):
        _dies(_DIE_AT_COMPLETION, "completion")


def _effect(conn, job):
    conn.execute(effects.insert().values(job_id=job.job_id, fence=job.attempt, pid=os.getpid()))


def work(job):
    _started(job)
    time.sleep(_pause(job))  # past the timeout: then its write below is refused
    if job.payload["effect"]:
        with job.completing(str(job.attempt)) as conn:
            _effect(conn, job)
            if _first_run(job):  # the effect written, not committed: it must vanish
                _dies([job.job_id], "block")
        return None
    if _first_run(job):
        _DIE_AT_COMPLETION.add(job.job_id)
    return str(job.attempt)


async def work_async(job):
    _started(job)
    await asyncio.sleep(_pause(job))  # cancelled at the timeout
    if job.payload["effect"]:
        async with job.completing(str(job.attempt)) as conn:
            await conn.run_sync(_effect, job)
            if _first_run(job):
                _dies([job.job_id], "block")
        return None
    if _first_run(job):
        _DIE_AT_COMPLETION.add(job.job_id)
    return str(job.attempt)
"""
#: jobs whose worker kills itself (once each) inside the completion's transaction: after the
#: function's own write in ``job.completing`` (even ids), or after the completion's UPDATE of
#: a returned result (odd ids), before the COMMIT
DIE = {10, 11, 40, 41, 70, 71}
#: jobs whose first run outlasts the workers' timeout (effects and returned results alike)
HANG = {i for i in range(150) if i % 15 == 7}


class _Worker:
    """One ``fencing worker`` process, its owner name and its log."""

    def __init__(self, tmp_path: Path, target: str, function: str, number: int) -> None:
        self.owner = f"wt-{number}"
        self.log = tmp_path / f"{self.owner}.log"
        self.frozen = False
        self.replaced = False  #: its replacement started (it was killed)
        with self.log.open("w") as log:  # the child has its own descriptor of it
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "fencing", "worker", f"tasks:{function}", "--url", target,
                    "--owner", self.owner, "--concurrency", str(CONCURRENCY), "--ttl", str(TTL),
                    "--drain", str(DRAIN), "--max-attempts", "100000", "--retry-delay", "0.05",
                    "--max-retry-delay", "0.2", "--timeout", str(TIMEOUT),
                ],
                cwd=tmp_path,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )  # fmt: skip

    def started(self) -> bool:
        """Its signal handlers are in place (it says so before its slots start)."""
        return "slot(s) on" in self.log.read_text(errors="replace")


@pytest.fixture
def store(engine: Engine) -> JobStore:
    metadata = MetaData()
    store = JobStore(
        engine, jobs_table(metadata), payloads=payloads_table(metadata), failures=failures_table(metadata)
    )
    store.create_table()
    return store


@pytest.mark.parametrize("function", ["work", "work_async"], ids=["threads", "asyncio"])
def test_workers_under_faults_store_each_result_once_by_its_last_holder(
    tmp_path: Path, target: str, engine: Engine, store: JobStore, function: str
) -> None:
    effects = Table(
        "wt_effects",
        MetaData(),
        Column("job_id", String(64)),
        Column("fence", BigInteger),
        Column("pid", Integer),
    )
    effects.create(engine)
    (tmp_path / "tasks.py").write_text(textwrap.dedent(TASKS))
    rng = random.Random(20261206)
    with engine.begin() as conn:
        for i in range(JOBS):
            # some jobs outlast the drain: a SIGTERM hands them back
            payload = {
                "sleep": rng.choice([0.0, 0.02, 0.1, 0.4, 0.4, 2.5]),
                "effect": i % 2 == 0,
                "die": i in DIE,
                "hang": HANG_FOR if i in HANG else None,
            }
            store.enqueue(f"job-{i:04d}", payload=payload, conn=conn)
    numbers = iter(range(1_000_000))

    def new_worker() -> _Worker:
        return _Worker(tmp_path, target, function, next(numbers))

    workers = [new_worker() for _ in range(PROCESSES)]
    faults: Counter[str] = Counter()
    late: list[str] = []  # what a SIGTERM'd worker did wrong
    timers: list[threading.Timer] = []
    try:
        # the fault phase starts once the workers are up (a loaded machine takes seconds to
        # start four interpreters), and deals the kinds in rounds: each once per round, in a
        # seeded order, so even a short phase has every kind
        _until(lambda: all(w.started() for w in workers), 120.0)
        ends = time.monotonic() + SECONDS
        kinds: list[str] = []
        while time.monotonic() < ends or len(faults) < len(KINDS):
            time.sleep(rng.uniform(0.2, 0.6))
            _replace_the_dead(workers, new_worker)
            live = [w for w in workers if w.process.poll() is None and not w.frozen and w.started()]
            if not live:
                continue
            victim = rng.choice(live)
            kinds = kinds or rng.sample(KINDS, len(KINDS))
            kind = kinds.pop()
            faults[kind] += 1
            if kind == "freeze":  # past its leases: the others take its jobs meanwhile
                victim.frozen = True
                victim.process.send_signal(signal.SIGSTOP)
                timer = threading.Timer(rng.uniform(1.2, 2.5) * TTL, _thaw, (victim,))
                timers.append(timer)
                timer.start()
            elif kind == "kill":
                victim.process.kill()
                victim.process.wait(30)
                victim.replaced = True
                workers.append(new_worker())
            elif kind == "term":
                _terminate(victim, store, late)
                victim.replaced = True
                workers.append(new_worker())
            else:
                held = [f"job-{i:04d}" for i in rng.sample(range(JOBS), 20)]
                for job_id in held:
                    holder = store.holder(job_id)
                    if holder is not None:
                        store.revoke(job_id)
                        break
        for timer in timers:
            timer.join()

        # the faults end: the workers left finish the queue (those that die in a completion
        # replaced as they die)
        def finished() -> bool:
            _replace_the_dead(workers, new_worker)
            return _all_done(store)

        _until(finished, 120.0)
        for worker in workers:
            if worker.process.poll() is None:
                # a replacement started a moment ago may still be importing: SIGTERM before
                # its handlers are in place kills it (-15), which is no promise of the runtime
                _until(partial(_up_or_gone, worker), 120.0)
                _terminate(worker, store, late)
    finally:
        for timer in timers:
            timer.cancel()
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGCONT)
                worker.process.kill()
                worker.process.wait(30)
    starts = [line.split() for line in (tmp_path / "starts.log").read_text().splitlines()]
    logs = "".join(w.log.read_text(errors="replace") for w in workers)
    print(
        f"faults: {dict(faults)}; worker processes: {len(workers)}; jobs: {JOBS}; runs: {len(starts)};"
        f" handed back: {logs.count('handed back')}; results not stored (lease lost):"
        f" {logs.count('is not stored') + logs.count('cancelled after')};"
        f" refused: {logs.count('was refused')}; timed out: {logs.count('ran past')}"
    )
    assert not late, late
    assert set(faults) == set(KINDS), faults
    # each chosen job's worker died once inside its completion's transaction, both ways
    dies = [line.split() for line in (tmp_path / "dies.log").read_text().splitlines()]
    died = {job for _, _, *jobs in dies for job in jobs}
    assert died == {f"job-{i:04d}" for i in DIE}, dies
    assert {where for where, *_ in dies} == {"block", "completion"}, dies
    assert logs.count("ran past") >= 1, "no run timed out"  # of 10 HANG jobs' first runs

    twice = [key for key, n in Counter((job, fence) for job, fence, _ in starts).items() if n > 1]
    assert twice == [], f"a lease ran twice: {twice[:5]}"
    with engine.connect() as conn:
        rows = conn.execute(select(effects.c.job_id, effects.c.fence)).all()
    effects_of = Counter(job for job, _ in rows)
    fence_of = dict(rows)
    for i in range(JOBS):
        job_id = f"job-{i:04d}"
        state = store.state(job_id)
        assert state is not None and state.done, job_id
        if i % 2 == 0:  # written in the completion's transaction: once, by the last holder
            assert effects_of[job_id] == 1, (job_id, effects_of[job_id])
            assert fence_of[job_id] == state.fence, (job_id, fence_of[job_id], state.fence)
        else:
            assert effects_of[job_id] == 0, job_id
        assert state.result == str(state.fence), (job_id, state.result, state.fence)


def _replace_the_dead(workers: list[_Worker], new: Callable[[], _Worker]) -> None:
    """A worker that killed itself (in a completion, ``DIE``) is replaced, once."""
    for worker in list(workers):
        if worker.process.poll() == -signal.SIGKILL and not worker.replaced:
            worker.replaced = True
            workers.append(new())


def _thaw(worker: _Worker) -> None:
    if worker.process.poll() is None:
        worker.process.send_signal(signal.SIGCONT)
    worker.frozen = False


def _terminate(worker: _Worker, store: JobStore, late: list[str]) -> None:
    """SIGTERM, then what the runtime promises: exit 0 within the drain and a heartbeat, and
    nothing held by it afterwards."""
    sent = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    try:
        code = worker.process.wait(DRAIN + TTL / 3 + SLACK)
    except subprocess.TimeoutExpired:
        worker.process.send_signal(signal.SIGCONT)  # (not frozen: only live ones are stopped)
        late.append(f"{worker.owner} still running {time.monotonic() - sent:.1f} s after SIGTERM")
        worker.process.kill()
        worker.process.wait(30)
        return
    if code == -signal.SIGKILL and _died_in_a_completion(worker):
        return  # draining, it finished a job chosen to kill its worker in the completion
    if code != 0:
        late.append(f"{worker.owner} exited {code} after SIGTERM: {worker.log.read_text()[-2000:]}")
    held = [
        job_id
        for job_id in (f"job-{i:04d}" for i in range(JOBS))
        if (holder := store.holder(job_id)) is not None and holder.owner == worker.owner
    ]
    if held:
        late.append(f"{worker.owner} exited still holding {held}")


def _died_in_a_completion(worker: _Worker) -> bool:
    """Whether the worker killed itself in a completion (``DIE``: said in dies.log)."""
    dies = worker.log.parent / "dies.log"
    lines = dies.read_text().splitlines() if dies.exists() else []
    return any(line.split()[1] == str(worker.process.pid) for line in lines)


def _all_done(store: JobStore) -> bool:
    return all(store.state(f"job-{i:04d}").done for i in range(JOBS))  # type: ignore[union-attr]


def _up_or_gone(worker: _Worker) -> bool:
    return worker.started() or worker.process.poll() is not None


def _until(condition: object, timeout: float) -> None:
    ends = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < ends, "timed out"
        time.sleep(0.1)
