"""A PostgreSQL failover under a workload, and what the new primary kept of what the
workers were told.

Two private servers (:mod:`tests.private_servers`): a primary and a streaming standby made
by ``pg_basebackup``. Workers (threads, one store on one engine) reach whichever takes
writes through one multi-host URL (``target_session_attrs=read-write``): they claim a job,
renew its lease, complete it, half with ``complete()``, half in a ``fenced()`` block that
also writes a row of the application's own (``failover_effects``, one per token), and
enqueue a new job in its place.
Every answer the database acknowledged is journaled, with the phase of the run its
operation began in (so an answer journaled in a phase was given after it began).

Mid-run the harness kills the primary (SIGKILL of every process of it) and promotes the
standby. Optionally the standby lags first: it is frozen (SIGSTOP) while the workers go on,
then killed, not thawed, since what the primary sent and it had not read yet would still
arrive from its socket, and started again, knowing only what it had received before the
freeze. That is a standby cut off by the network when the primary's machine dies.

Workers ride through: :class:`~fencing.DatabaseUnavailable` and
:class:`~fencing.DatabaseReadOnly` (nothing changed; a fenced block whose own statement
lost its connection says so too: nothing of the block was kept) are retried after a pause;
:class:`~fencing.OutcomeUnknown` is journaled as unknown and the lease dropped. Anything
else (a raw driver error) fails the run.

The verdict reads the new primary: **(a)** no token (job, fence) was acknowledged to two
claims, and none acknowledged is above its job's fence there (forgotten: the next claim
reissues it); **(b)** every acknowledged completion is there (the job done with that
result; for a fenced block, its own row too), and every acknowledged enqueue. A loss is
labelled by what ``fencing doctor`` said of the old primary just before the kill: with a
setting at risk it is an unsafe configuration, not a failure of the library; with none it
is a failure.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy
from sqlalchemy import BigInteger, Column, MetaData, String, Table, select
from sqlalchemy.pool import NullPool

from fencing import (
    DatabaseReadOnly,
    DatabaseUnavailable,
    JobStore,
    Lease,
    LeaseLost,
    OutcomeUnknown,
    Refusal,
    jobs,
)
from tests.private_servers import PrivatePostgres, multi_host_url, private_server

T = TypeVar("T")

#: longer than a run: a lease taken before the failover is still live after it, so a
#: worker completes it then (or is refused because the new primary forgot it)
TTL = 30.0
SCRIPT = Path(sys.executable).with_name("fencing")

app_metadata = MetaData()
#: the application's own write in a fenced block: one row per token, with the block's result
effects = Table(
    "failover_effects",
    app_metadata,
    Column("job_id", String(64), primary_key=True),
    Column("fence", BigInteger, primary_key=True),
    Column("result", String(64), nullable=False),
)

# the phases of a run: before the fault, the standby frozen, the kill until the standby is
# promoted, and after
BEFORE, LAGGING, FAILOVER, AFTER = "before", "standby frozen", "failing over", "promoted"


@dataclass
class Journal:
    """What the workers were told, as they were told it (list.append is atomic)."""

    #: (job, fence, owner, phase) per claim acknowledged
    issued: list[tuple[str, int, str, str]] = field(default_factory=list)
    #: (job, fence, result, how, phase) per completion acknowledged (how: complete, fenced)
    completed: list[tuple[str, int, str, str, str]] = field(default_factory=list)
    #: (job, phase) per enqueue acknowledged (a new job)
    enqueued: list[tuple[str, str]] = field(default_factory=list)
    #: renewals acknowledged, by phase
    renewed: Counter[str] = field(default_factory=Counter)
    #: operations whose outcome is unknown (OutcomeUnknown), by operation
    unknown: Counter[str] = field(default_factory=Counter)
    #: retried failures (DatabaseUnavailable, DatabaseReadOnly), by class
    outages: Counter[str] = field(default_factory=Counter)
    #: stale leases refused (renew None, complete False, LeaseLost), by operation
    refused: Counter[str] = field(default_factory=Counter)
    #: anything else a worker met (none is expected)
    errors: list[str] = field(default_factory=list)

    def by_phase(self, entries: list[Any]) -> dict[str, int]:
        counted = Counter(entry[-1] for entry in entries)
        return {phase: counted[phase] for phase in (BEFORE, LAGGING, FAILOVER, AFTER) if counted[phase]}


_UNKNOWN = object()  # an operation's answer when its outcome is unknown
_STOPPED = object()  # the run stopped while the operation was being retried


class Workload:
    """``workers`` threads through ``url`` until :meth:`stop`: each claims a job, renews
    its lease, completes it (every other one in a fenced block), and enqueues a job in its
    place, so the queue never runs dry; every acknowledged answer in :attr:`journal`."""

    def __init__(self, url: str, workers: int) -> None:
        self.engine = sqlalchemy.create_engine(url, pool_size=workers, max_overflow=2)
        self.store = JobStore(self.engine)
        self.journal = Journal()
        #: the phase an operation begun now is journaled in (set by the harness)
        self.phase = BEFORE
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(f"w{i}",), name=f"failover-w{i}", daemon=True)
            for i in range(workers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), f"{thread.name} did not stop"
        self.engine.dispose()

    def _call(self, name: str, operation: Callable[[], T]) -> tuple[T | object, str]:
        """``operation``'s answer, and the phase its last attempt began in (what it did
        happened after that phase began); retried while the database is unreachable or
        read-only (nothing changed); ``_UNKNOWN`` if it was lost while committing;
        ``_STOPPED`` if the run stopped first."""
        attempt = 0
        while not self._stopping.is_set():
            phase = self.phase
            try:
                return operation(), phase
            except (DatabaseUnavailable, DatabaseReadOnly) as exc:
                self.journal.outages[type(exc).__name__] += 1
                attempt += 1
                time.sleep(min(0.1, 0.005 * 2**attempt))
            except OutcomeUnknown:
                self.journal.unknown[name] += 1
                return _UNKNOWN, phase
        return _STOPPED, self.phase

    def _work(self, owner: str) -> None:
        journal, store = self.journal, self.store
        answers = 0  # this worker's: a result names its answer, unique in the run
        while not self._stopping.is_set():
            try:
                leases, phase = self._call("claim", lambda: store.claim_next(owner, ttl=TTL))
                if not isinstance(leases, list):
                    continue
                if not leases:
                    time.sleep(0.01)  # every job is taken
                    continue
                [lease] = leases
                journal.issued.append((lease.job_id, lease.fence, owner, phase))
                answers += 1
                self._finish(lease, f"{owner}/{lease.fence}/{answers}", fenced=answers % 2 == 0)
                job_id = f"{owner}-{answers}"
                added, phase = self._call("enqueue", functools.partial(store.enqueue, job_id))
                if added is True:
                    journal.enqueued.append((job_id, phase))
            except Exception as exc:  # journaled: the verdict fails on any
                journal.errors.append(f"{owner}: {type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def _finish(self, lease: Lease, result: str, *, fenced: bool) -> None:
        journal, store = self.journal, self.store
        renewed, phase = self._call("renew", lambda: store.renew(lease, ttl=TTL))
        if isinstance(renewed, Refusal):
            journal.refused["renew"] += 1
        if not isinstance(renewed, Lease):
            return
        journal.renewed[phase] += 1
        how = "fenced" if fenced else "complete"
        if fenced:
            done, phase = self._call(how, lambda: self._fenced(renewed, result))
        else:
            done, phase = self._call(how, lambda: store.complete(renewed, result))
        if done is True:
            journal.completed.append((lease.job_id, lease.fence, result, how, phase))
        elif done is False or isinstance(done, Refusal):  # the fenced block's False, or complete's
            journal.refused[how] += 1

    def _fenced(self, lease: Lease, result: str) -> bool:
        try:
            with self.store.fenced(lease, complete=True, result=result) as conn:
                conn.execute(effects.insert().values(job_id=lease.job_id, fence=lease.fence, result=result))
        except LeaseLost:
            return False
        return True


@dataclass
class Verdict:
    """What the new primary lost of what the workers were told."""

    #: tokens acknowledged to two claims or more
    reissued: list[tuple[str, int]]
    #: acknowledged tokens above their job's fence on the new primary: (job, fence, its fence)
    forgotten: list[tuple[str, int, int]]
    #: acknowledged completions absent: (job, fence, result, how)
    lost: list[tuple[str, int, str, str]]
    #: acknowledged enqueues absent: the jobs
    vanished: list[str]

    @property
    def violations(self) -> int:
        return len(self.reissued) + len(self.forgotten) + len(self.lost) + len(self.vanished)


def judge(journal: Journal, url: str) -> Verdict:
    """The verdict on ``journal`` by the database at ``url`` (the new primary)."""
    engine = sqlalchemy.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            rows = {
                job_id: (int(fence), bool(done), result)
                for job_id, fence, done, result in conn.execute(
                    select(jobs.c.id, jobs.c.fence, jobs.c.done, jobs.c.result)
                )
            }
            written = {
                (job_id, int(fence), result)
                for job_id, fence, result in conn.execute(
                    select(effects.c.job_id, effects.c.fence, effects.c.result)
                )
            }
    finally:
        engine.dispose()
    absent = (0, False, None)  # a job the new primary does not have: no fence handed out
    claims = Counter((job_id, fence) for job_id, fence, _, _ in journal.issued)
    reissued = sorted(token for token, times in claims.items() if times > 1)
    forgotten = sorted(
        (job, fence, rows.get(job, absent)[0]) for job, fence in claims if fence > rows.get(job, absent)[0]
    )
    lost = sorted(
        (job, fence, result, how)
        for job, fence, result, how, _ in journal.completed
        if rows.get(job, absent)[1:] != (True, result)
        or (how == "fenced" and (job, fence, result) not in written)
    )
    vanished = sorted(job for job, _ in journal.enqueued if job not in rows)
    return Verdict(reissued, forgotten, lost, vanished)


@dataclass
class Report:
    """One failover run: how it went, what the old primary's settings risked, the verdict."""

    configuration: str
    jobs: int
    workers: int
    journal: Journal
    verdict: Verdict
    #: ``fencing doctor --url <old primary>``, run just before the kill: exit code, output
    doctor: tuple[int, str]
    #: the store's own WARNINGs on ``fencing.durability`` (one per risk), their settings
    store_warned: list[str]
    #: seconds: the kill, the new primary taking writes, the whole run (from the workers' start)
    killed_at: float
    promoted_at: float
    ran: float
    #: seconds from the workers' start, per step of the failover between the two
    steps: dict[str, float] = field(default_factory=dict)

    @property
    def doctor_risks(self) -> list[str]:
        """The RISK lines of the doctor's output."""
        return [line for line in self.doctor[1].splitlines() if line.startswith("RISK")]

    @property
    def label(self) -> str:
        if self.verdict.violations == 0:
            return "safe: the new primary kept everything the workers were told"
        if self.doctor_risks:
            return (
                "UNSAFE CONFIGURATION (not a library failure): the old primary acknowledged "
                "commits its standby did not have, under settings fencing doctor named as a risk"
            )
        return "FAILURE: acknowledged writes lost under settings fencing doctor calls safe"

    def render(self) -> str:
        j, v = self.journal, self.verdict
        lines = [
            f"failover, {self.configuration}: {self.jobs} jobs queued at the start, "
            f"{self.workers} workers, {self.ran:.1f} s",
            f"  the primary killed at {self.killed_at:.2f} s, the standby took writes at "
            f"{self.promoted_at:.2f} s ({self.promoted_at - self.killed_at:.2f} s later); "
            + ", ".join(f"{step} at {at:.2f} s" for step, at in self.steps.items()),
            f"  claims acknowledged {len(j.issued)} {j.by_phase(j.issued)}",
            f"  completions acknowledged {len(j.completed)} {j.by_phase(j.completed)}",
            f"  enqueues acknowledged {len(j.enqueued)} {j.by_phase(j.enqueued)}",
            f"  renewals acknowledged {sum(j.renewed.values())}; outcomes unknown {dict(j.unknown)}; "
            f"retried {dict(j.outages)}; stale leases refused {dict(j.refused)}; "
            f"other errors {len(j.errors)}",
            f"  fencing doctor on the old primary before the kill: exit {self.doctor[0]}",
            *(f"    {line}" for line in self.doctor_risks),
            f"  the store's own warnings (fencing.durability): {self.store_warned}",
            f"  tokens reissued {len(v.reissued)} {v.reissued[:5]}",
            f"  tokens forgotten (above the new primary's fence) {len(v.forgotten)} {v.forgotten[:5]}",
            f"  acknowledged completions gone {len(v.lost)} {v.lost[:3]}",
            f"  acknowledged enqueues gone {len(v.vanished)} {v.vanished[:5]}",
            f"  verdict: {self.label}",
            *(f"  error: {e}" for e in j.errors[:5]),
        ]
        return "\n".join(lines)


@contextlib.contextmanager
def durability_warnings() -> Iterator[list[str]]:
    """The settings the store logs a risk of (``fencing.durability``) inside the block."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(str(getattr(record, "setting", record.getMessage())))

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("fencing.durability")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def doctor(url: str) -> tuple[int, str]:
    """``fencing doctor --url url``, as an operator runs it: its exit code and output."""
    done = subprocess.run([str(SCRIPT), "doctor", "--url", url], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


def failover(
    *,
    settings: Mapping[str, str],
    lag: bool,
    jobs_count: int = 200,
    workers: int = 4,
    before: float = 1.5,
    lagging: float = 1.0,
    after: float = 2.0,
) -> Report:
    """One run: a primary with ``settings`` (``ALTER SYSTEM``, once its standby streams)
    and its standby; ``workers`` on ``jobs_count`` jobs (each replaced when it is done)
    for ``before`` seconds; with
    ``lag`` the standby frozen for ``lagging`` seconds more (and while ``fencing doctor``
    reads the primary); the primary killed and the standby promoted; ``after`` seconds on
    the new primary; the verdict."""
    with contextlib.ExitStack() as stack:
        primary = stack.enter_context(private_server("postgresql"))
        assert isinstance(primary, PrivatePostgres)
        standby = primary.standby()
        stack.callback(standby.close)
        standby.start()
        primary.wait_for_standby()
        if settings:
            # after the base backup: the promoted standby must not wait for a standby of its own
            primary.alter_system(settings)
        synchronous = bool(settings.get("synchronous_standby_names"))
        primary.wait_for_standby(sync=synchronous)

        url = multi_host_url(primary, standby)
        load = Workload(url, workers)
        stack.callback(load.engine.dispose)
        warned = stack.enter_context(durability_warnings())
        load.store.create_table()
        app_metadata.create_all(load.engine)
        with load.engine.begin() as conn:
            for n in range(jobs_count):
                load.store.enqueue(f"job-{n:05d}", conn=conn)
        primary.wait_for_standby(caught_up=True)  # the jobs are on the standby

        started = time.monotonic()
        steps: dict[str, float] = {}
        load.start()
        try:
            time.sleep(before)
            if lag:
                standby.freeze()
                load.phase = LAGGING
                steps["standby frozen"] = time.monotonic() - started
                time.sleep(lagging)
            checked = doctor(primary.url)  # (while the standby is frozen, if it is)
            steps["fencing doctor ran"] = time.monotonic() - started
            load.phase = FAILOVER
            killed_at = time.monotonic() - started
            primary.kill()
            if lag:
                standby.kill()  # not thawed: the unread WAL in its socket dies with it
                steps["standby killed"] = time.monotonic() - started
                standby.start()
                steps["standby restarted"] = time.monotonic() - started
            else:
                time.sleep(0.3)  # the failover manager notices
            steps["promoting"] = time.monotonic() - started
            standby.promote()
            load.phase = AFTER
            promoted_at = time.monotonic() - started
            time.sleep(after)
        finally:
            load.stop()
        ran = time.monotonic() - started
        configuration = ", ".join(f"{k}={v!r}" for k, v in settings.items()) or "asynchronous standby"
        if lag:
            configuration += f", standby frozen {killed_at - steps['standby frozen']:.1f} s before the kill"
        return Report(
            configuration=configuration,
            jobs=jobs_count,
            workers=workers,
            journal=load.journal,
            verdict=judge(load.journal, standby.url),
            doctor=checked,
            store_warned=list(warned),
            killed_at=killed_at,
            promoted_at=promoted_at,
            steps=steps,
            ran=ran,
        )
    raise AssertionError("unreachable")  # mypy: the ExitStack may swallow
