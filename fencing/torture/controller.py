"""A torture run: set up, start the workers, inject faults, drain, take the verdict.

The controller is the only process that decides faults, from one RNG seeded with
``config.seed``. The faults:

* ``stop``: SIGSTOP a worker while it holds a lease, for 1.5-3 TTLs, then SIGCONT: the
  late writer. Its heartbeat thread is frozen with it, like in a GC pause or a suspended VM;
* ``kill``: SIGKILL a worker wherever it is, then start a new incarnation in its place;
* ``kill-in-transaction``: SIGKILL a worker while it is inside a write transaction (its
  shared state says so), then restart it;
* ``revoke``: :meth:`fencing.JobStore.revoke` a job some worker holds;
* ``server-crash``: SIGKILL the database server itself, every process of it, keep it down
  0.2-2 s, then start it again (crash recovery): only on a server the harness was handed to
  kill (``run_torture(config, server=...)``, a :class:`CrashableServer`), never one it was
  merely given the URL of. It runs on a clock of its own (``config.crash_every``), outside
  the rounds below; the other faults wait while the server is down.

The kinds come in rounds (each kind once per round, shuffled), at exponentially distributed
intervals (mean ``fault_every``); a kind with nobody to inject it into (no worker holding a
lease yet) is tried again at the end of its round, so even a short run on a slow machine,
where restarts take seconds, has every kind, and no kind can hold the others up.

Workers also give jobs back with a delay (``release_rate``), which the journals count.
After ``seconds`` (or once every job is done) the faults stop, stopped workers go on,
and the workers get ``drain`` seconds to finish every job.

With an ``operations`` target (a soak), the fault phase also ends once the workers have made
that many operations (:data:`.journal.OPERATIONS`, counted by each worker in a shared array
as it journals them), and the jobs never run out: once fewer than half of ``jobs`` are open,
the controller enqueues more, so a run of a million operations keeps a backlog of ``jobs``,
not a million rows up front. The verdict is then taken a shard of jobs at a time
(:func:`.verdict.judge_journals`): its memory does not grow with the run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from sqlalchemy import Engine, Table, func, select, text
from sqlalchemy.exc import DBAPIError

from .._dialects import of
from .._errors import ConfigurationError, DatabaseError, OutcomeUnknown
from .._sql.schema import as_text
from .._store.jobstore import JobStore
from .config import SERVER_CRASH, TortureConfig
from .connect import open_engine
from .fronts import with_front
from .journal import Journal, journal_files
from .tables import TortureTables
from .verdict import DatabaseState, Verdict, job_id, judge_journals
from .worker import HOLDING, IN_TRANSACTION, STARTING, run_worker

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess

__all__ = ["CrashableServer", "Progress", "Run", "run_torture"]

#: how long a fault waits for a worker in the state it targets before giving up
TARGET_WAIT = 0.5
#: how long workers get to stop once asked; one still running then is hung (a violation)
SHUTDOWN_TIMEOUT = 30.0
#: how long the fault phase waits for the workers to start (spawn, imports, the front opened)
#: before its clock starts anyway
STARTUP_TIMEOUT = 120.0
#: enqueued per transaction while setting up
ENQUEUE_CHUNK = 500
#: how long a crashed server stays down before it is started again (s, drawn uniformly)
CRASH_DOWN = (0.2, 2.0)


class CrashableServer(Protocol):
    """A database server the harness may crash: the one ``config.url`` points to, of the
    run's own (never a shared one). ``kill()``: SIGKILL of the server and every process of
    it, returning once none is left; ``start()``: start it again, returning once it answers."""

    def kill(self) -> None: ...

    def start(self) -> None: ...


#: told how a run goes, to show it (the harness never waits on it): the phase ("setup",
#: "starting", "faults", "drain", "stopping", "verdict"), seconds into the phase, the phase's longest
#: length (None: no bound), and the jobs done so far (None: not counted in this phase)
Progress: TypeAlias = "Callable[[str, float, float | None, int | None], None]"


def _no_progress(phase: str, elapsed: float, total: float | None, done: int | None) -> None:
    pass


@dataclass
class Run:
    """What a run did and what the verdict found."""

    config: TortureConfig
    verdict: Verdict
    elapsed: float
    fault_phase: float
    #: where the journals are, if they were kept (``config.journal_dir``)
    journal_dir: Path | None
    jobs_done: int
    #: the jobs enqueued: ``config.jobs``, and more when an ``operations`` target replenished them
    jobs_enqueued: int = 0

    @property
    def violations(self) -> int:
        return self.verdict.total

    @property
    def operations(self) -> int:
        """The operations the journals hold (:data:`.journal.OPERATIONS`)."""
        return self.verdict.tallies[("operations",)]


class _Pool:
    """The worker processes, by index; a killed one is replaced by its next incarnation."""

    def __init__(self, config: TortureConfig, journal_dir: Path) -> None:
        self.config = config
        self.journal_dir = journal_dir
        self.ctx = multiprocessing.get_context("spawn")
        self.states: Any = self.ctx.Array("i", [STARTING] * config.workers, lock=False)
        #: the operations each worker journaled, over all its incarnations
        self.operations: Any = self.ctx.Array("q", [0] * config.workers, lock=False)
        self.stop = self.ctx.Event()
        self.procs: list[SpawnProcess] = []
        self.incarnations = [0] * config.workers
        #: frozen workers and the timers that thaw them: on their own thread, so a controller
        #: blocked on a row lock the frozen worker holds cannot keep it frozen forever
        self.stopped: dict[int, threading.Timer] = {}
        self._lock = threading.Lock()

    def start(self, index: int) -> None:
        proc = self.ctx.Process(
            target=run_worker,
            args=(
                self.config,
                index,
                self.incarnations[index],
                self.states,
                self.stop,
                str(self.journal_dir),
                self.operations,
            ),
            name=f"torture-worker-{index}",
            daemon=True,
        )
        proc.start()
        if index < len(self.procs):
            self.procs[index] = proc
        else:
            self.procs.append(proc)

    def restart(self, index: int) -> None:
        self.procs[index].join()
        self.states[index] = STARTING
        self.incarnations[index] += 1
        self.start(index)

    def wait_until_started(self, timeout: float) -> bool:
        """Wait for every worker to open its front (or die trying); ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.states[i] != STARTING or not p.is_alive() for i, p in enumerate(self.procs)):
                return True
            time.sleep(0.01)
        return False

    def running(self) -> list[int]:
        """Workers alive and not frozen."""
        return [i for i, p in enumerate(self.procs) if p.is_alive() and i not in self.stopped]

    def wait_for(self, state: int, rng: random.Random) -> int | None:
        deadline = time.monotonic() + TARGET_WAIT
        while time.monotonic() < deadline:
            ready = [i for i in self.running() if self.states[i] == state]
            if ready:
                return rng.choice(ready)
            time.sleep(0.0005)
        return None

    def signal(self, index: int, signum: int) -> None:
        pid = self.procs[index].pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it died meanwhile
                os.kill(pid, signum)

    def freeze(self, index: int, pause: float) -> None:
        """SIGSTOP worker ``index`` and SIGCONT it ``pause`` seconds later."""
        timer = threading.Timer(pause, self.thaw, args=(index,))
        timer.daemon = True
        with self._lock:
            self.signal(index, signal.SIGSTOP)
            self.stopped[index] = timer
        timer.start()

    def thaw(self, index: int) -> None:
        with self._lock:
            timer = self.stopped.pop(index, None)
            if timer is not None:
                timer.cancel()
                self.signal(index, signal.SIGCONT)

    def thaw_all(self) -> None:
        for index in list(self.stopped):
            self.thaw(index)

    def shutdown(self, timeout: float) -> list[int]:
        """Ask every worker to stop; the indexes of those that had to be killed."""
        self.thaw_all()
        self.stop.set()
        deadline = time.monotonic() + timeout
        stuck = []
        for index, proc in enumerate(self.procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                stuck.append(index)
                proc.kill()
                proc.join()
        return stuck


def run_torture(
    config: TortureConfig, *, progress: Progress | None = None, server: CrashableServer | None = None
) -> Run:
    """One whole run; the returned :class:`Run` holds the verdict (``violations == 0`` is a pass).
    ``progress`` is called as the run goes (:data:`Progress`), from this thread. ``server``:
    the server at ``config.url``, which the ``server-crash`` fault kills and starts again
    (required for that fault, :class:`ConfigurationError` without it)."""
    if SERVER_CRASH in config.faults and server is None:
        raise ConfigurationError(
            f"the {SERVER_CRASH} fault kills the database server: it needs a server of the run's own "
            "to kill and start again (run_torture(config, server=...)), never a shared one"
        )
    report = progress or _no_progress
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fencing-torture-") as scratch:
        journal_dir = Path(config.journal_dir or scratch)
        journal_dir.mkdir(parents=True, exist_ok=True)
        for old in journal_files(journal_dir):
            old.unlink()  # an earlier run's journals (only the harness's own file names)
        tables = TortureTables.named(config.prefix)
        engine = open_engine(config.url)
        try:
            # the workers' front opened once here: a bad store or driver fails now, not in each worker
            for index in range(len(config.fronts)):
                with_front(config.for_worker(index), tables, lambda _front: None)
            report("setup", 0.0, None, None)
            tables.recreate(engine)
            store = JobStore(engine, tables.jobs, history=tables.recorded)
            backlog = _Backlog(engine, store, tables.jobs)
            backlog.enqueue(config.jobs)
            journal = Journal(journal_dir / "controller.jsonl")
            try:
                fault_phase = _drive(config, engine, backlog, tables, journal, journal_dir, report, server)
            finally:
                journal.close()
            report("verdict", 0.0, None, None)
            jobs, done, integrity = _database_totals(engine, tables)
            verdict = judge_journals(
                config,
                journal_dir,
                lambda first, end: _database_state(engine, tables, first, end),
                jobs=jobs,
                enqueued=backlog.enqueued,
                integrity=integrity,
            )
            if not config.keep_tables:
                tables.drop(engine)
        finally:
            engine.dispose()
        kept = journal_dir if config.journal_dir else None
        return Run(config, verdict, time.monotonic() - started, fault_phase, kept, done, backlog.enqueued)


class _Backlog:
    """The run's jobs, numbered from 0 (:func:`.verdict.job_id`) as they are enqueued."""

    def __init__(self, engine: Engine, store: JobStore, jobs: Table) -> None:
        self.engine = engine
        self.store = store
        self.jobs = jobs
        self.enqueued = 0
        #: a chunk's COMMIT failed: it may have committed, the rows say (before the next chunk)
        self.unsure = False

    def enqueue(self, jobs: int) -> None:
        """``jobs`` more, a chunk per transaction; counted once committed."""
        end = self.enqueued + jobs
        while self.enqueued < end:
            chunk = min(ENQUEUE_CHUNK, end - self.enqueued)
            with self.engine.begin() as conn:
                for n in range(self.enqueued, self.enqueued + chunk):
                    self.store.enqueue(job_id(n), conn=conn)
            self.enqueued += chunk

    def replenish(self, open_jobs: int, backlog: int) -> None:
        """Top the open jobs up to ``backlog`` once fewer than half of it are left."""
        if open_jobs >= backlog // 2:
            return
        try:
            if self.unsure:
                with self.engine.connect() as conn:
                    self.enqueued = int(
                        conn.execute(select(func.count()).select_from(self.jobs)).scalar_one()
                    )
                self.unsure = False
            self.enqueue(backlog - open_jobs)
        except (DBAPIError, DatabaseError):  # the server just crashed: again next time
            self.unsure = True


def _open_jobs(engine: Engine, tables: TortureTables) -> int | None:
    """The jobs not done yet; None when the database did not answer (a crash just ended)."""
    jobs = tables.jobs
    try:
        with engine.connect() as conn:
            count = conn.execute(select(func.count()).select_from(jobs).where(jobs.c.done == 0))
            return int(count.scalar_one())
    except DBAPIError:
        return None


def _drive(
    config: TortureConfig,
    engine: Engine,
    backlog: _Backlog,
    tables: TortureTables,
    journal: Journal,
    journal_dir: Path,
    report: Progress = _no_progress,
    server: CrashableServer | None = None,
) -> float:
    """Run the workers through the fault phase and the drain; the fault phase's length."""
    store = backlog.store
    rng = random.Random(config.seed)
    # the server's crashes on a clock and an RNG of their own: the other faults draw as without
    crashes = random.Random(f"{config.seed}/{SERVER_CRASH}")
    kinds = [kind for kind in config.faults if kind != SERVER_CRASH]
    crashing = server if SERVER_CRASH in config.faults else None
    pool = _Pool(config, journal_dir)
    for index in range(config.workers):
        pool.start(index)
    try:
        # the fault clock starts once the workers are up: on a loaded machine spawning them can
        # take most of a short phase, which then injected nothing
        report("starting", 0.0, STARTUP_TIMEOUT, None)
        if not pool.wait_until_started(STARTUP_TIMEOUT):
            journal.record("slow start", waited=STARTUP_TIMEOUT, t=time.time())
        begun = time.monotonic()
        next_fault = begun + rng.expovariate(1.0 / config.fault_every)
        next_crash = begun + _crash_interval(config, crashes)
        deck: list[str] = []
        #: the kinds of fault injected so far: an operations target ends the phase only once
        #: each has been (a fast run once reached it before the first server crash was due)
        injected: set[str] = set()
        next_count = begun
        while time.monotonic() - begun < config.seconds:
            now = time.monotonic()
            _restart_the_dead(pool, journal)
            if now >= next_count:
                open_jobs = _open_jobs(engine, tables)
                done = None if open_jobs is None else backlog.enqueued - open_jobs
                report("faults", now - begun, config.seconds, done)
                if config.operations is not None:
                    if sum(pool.operations) >= config.operations and injected >= set(config.faults):
                        break
                    if open_jobs is not None:
                        backlog.replenish(open_jobs, config.jobs)
                elif open_jobs == 0:
                    break
                next_count = now + 0.25
            if crashing is not None and now >= next_crash:
                _crash(crashing, crashes, journal)
                injected.add(SERVER_CRASH)
                next_crash = time.monotonic() + _crash_interval(config, crashes)
                continue
            if now >= next_fault and kinds:
                if not deck:  # every kind once per round, in a shuffled order: on a slow machine,
                    deck = list(kinds)  # where a restart takes seconds and few faults
                    rng.shuffle(deck)  # fit in the phase, each kind still gets its turn
                kind = deck.pop()
                if _inject(kind, config, rng, pool, engine, store, tables, journal):
                    injected.add(kind)
                elif deck:
                    deck.insert(0, kind)  # nobody to inject it into yet: last of this round
                next_fault = time.monotonic() + rng.expovariate(1.0 / config.fault_every)
            time.sleep(0.002)
        fault_phase = time.monotonic() - begun
        pool.thaw_all()
        drain_from = time.monotonic()
        drain_until = drain_from + config.drain
        while (now := time.monotonic()) < drain_until:
            open_jobs = _open_jobs(engine, tables)
            report(
                "drain",
                now - drain_from,
                config.drain,
                None if open_jobs is None else backlog.enqueued - open_jobs,
            )
            if open_jobs == 0:
                break
            _restart_the_dead(pool, journal)
            time.sleep(0.05)
    finally:
        report("stopping", 0.0, None, None)
        for index in pool.shutdown(timeout=SHUTDOWN_TIMEOUT):
            journal.record("hung", worker=index, waited=SHUTDOWN_TIMEOUT, t=time.time())
    return fault_phase


def _crash_interval(config: TortureConfig, rng: random.Random) -> float:
    return config.crash_every * rng.uniform(0.5, 1.5)


def _crash(server: CrashableServer, rng: random.Random, journal: Journal) -> None:
    """SIGKILL the server (every process of it), keep it down a while, start it again: its
    crash recovery runs. Journaled once it answers again (``t1``): the verdict and the report
    count the crashes, and what the workers did after each."""
    down = rng.uniform(*CRASH_DOWN)
    t0 = time.time()
    server.kill()
    killed = time.time()
    time.sleep(down)
    server.start()
    journal.record("fault", kind=SERVER_CRASH, down=down, t0=t0, killed=killed, t1=time.time())


def _restart_the_dead(pool: _Pool, journal: Journal) -> None:
    """A worker that died without being killed by us: its journal says why; replace it."""
    for index, proc in enumerate(pool.procs):
        if proc.exitcode is not None and index not in pool.stopped:
            journal.record("died", worker=index, exitcode=proc.exitcode, t=time.time())
            pool.restart(index)


def _inject(
    kind: str,
    config: TortureConfig,
    rng: random.Random,
    pool: _Pool,
    engine: Engine,
    store: JobStore,
    tables: TortureTables,
    journal: Journal,
) -> bool:
    """Inject one fault of ``kind``; ``False`` when there was nobody to inject it into."""
    if kind == "revoke":
        jobs = tables.jobs
        try:
            with engine.connect() as conn:
                query = select(as_text(jobs.c.id)).where(jobs.c.done == 0, jobs.c.owner.is_not(None))
                held = conn.execute(query.limit(50)).scalars().all()
        except DBAPIError:  # the server just came back from a crash
            return False
        if not held:
            return False
        job = rng.choice(held)
        t0 = time.time()
        ok: bool | None
        try:
            ok = store.revoke(job)
        except OutcomeUnknown:
            ok = None  # it may have revoked: no write after it is held to it (only ok ones are)
        except DatabaseError:
            return False  # nothing changed
        journal.record("fault", kind="revoke", job=job, ok=ok, t0=t0, t1=time.time())
        return True
    if kind == "stop":
        if len(pool.running()) <= 1:
            return False  # someone must stay awake to take the jobs over
        index = pool.wait_for(HOLDING, rng)
        if index is None:
            return False
        pause = config.ttl * rng.uniform(1.5, 3.0)
        pool.freeze(index, pause)
        journal.record("fault", kind="stop", worker=index, pause=pause, t0=time.time(), t1=time.time())
        return True
    if kind == "kill-in-transaction":
        index = pool.wait_for(IN_TRANSACTION, rng)
    else:
        # a plain kill: a worker outside a write transaction where there is one (a kill that
        # lands inside one is told as such; on a loaded machine, busy writing after a server
        # crash, every kill of a short run could land there and none count as plain)
        running = pool.running()
        outside = [i for i in running if pool.states[i] != IN_TRANSACTION]
        index = rng.choice(outside or running) if running else None
    if index is None:
        return False
    in_transaction = pool.states[index] == IN_TRANSACTION
    pool.signal(index, signal.SIGKILL)
    journal.record(
        "fault",
        kind="kill-in-transaction" if in_transaction else "kill",
        worker=index,
        t0=time.time(),
        t1=time.time(),
    )
    pool.restart(index)
    return True


def _database_totals(engine: Engine, tables: TortureTables) -> tuple[int, int, str | None]:
    """The job rows, those done, and SQLite's integrity check (None elsewhere)."""
    jobs = tables.jobs
    with engine.connect() as conn:
        rows = int(conn.execute(select(func.count()).select_from(jobs)).scalar_one())
        done = int(conn.execute(select(func.count()).select_from(jobs).where(jobs.c.done == 1)).scalar_one())
        integrity = None
        if of(engine.dialect).is_file:  # SQLite's
            integrity = "; ".join(str(row[0]) for row in conn.execute(text("PRAGMA integrity_check")))
    return rows, done, integrity


def _database_state(engine: Engine, tables: TortureTables, first: str, end: str) -> DatabaseState:
    """The rows of the jobs whose ids are in ``[first, end)`` (and of their resources); ids
    compared as text (bytes on MariaDB/MySQL: ``as_text``), which sorts them as their numbers."""
    j, r, e, m, h = tables.jobs, tables.results, tables.external, tables.marks, tables.history
    # the library's tables hold ids, owners and resources as bytes on MariaDB/MySQL
    jobs_row = (as_text(j.c.id), as_text(j.c.owner), j.c.until, j.c.fence, j.c.result, j.c.done)
    history_row = (h.c.seq, as_text(h.c.job_id), h.c.event, as_text(h.c.owner), h.c.fence)
    refusal = (h.c.path, h.c.reason, as_text(h.c.holder), h.c.current_fence)
    first_resource, end_resource = f"job:{first}", f"job:{end}"
    with engine.connect() as conn:
        jobs = [
            tuple(row)
            for row in conn.execute(select(*jobs_row).where(as_text(j.c.id) >= first, as_text(j.c.id) < end))
        ]
        in_results = (r.c.job_id >= first) & (r.c.job_id < end)
        results = [
            tuple(row)
            for row in conn.execute(select(r.c.seq, r.c.job_id, r.c.owner, r.c.fence).where(in_results))
        ]
        in_external = (e.c.resource >= first_resource) & (e.c.resource < end_resource)
        external_row = (
            select(e.c.seq, e.c.resource, e.c.owner, e.c.fence).where(in_external).order_by(e.c.seq)
        )
        external = [tuple(row) for row in conn.execute(external_row)]
        in_marks = (as_text(m.c.resource) >= first_resource) & (as_text(m.c.resource) < end_resource)
        marks_row = select(as_text(m.c.resource), m.c.fence).where(in_marks)
        marks = {res: int(fence) for res, fence in conn.execute(marks_row)}
        in_history = (as_text(h.c.job_id) >= first) & (as_text(h.c.job_id) < end)
        history_rows = select(*history_row, *refusal).where(in_history).order_by(h.c.seq)
        history = [tuple(row) for row in conn.execute(history_rows)]
    return DatabaseState(jobs=jobs, results=results, external=external, marks=marks, history=history)
