"""Crash consistency: SIGKILL a process mid-burst of writes, many times in a row, and reopen.

A child process (``tests/crash_worker.py``, public API only) runs store operations as fast
as it can and acknowledges each one in an fsynced log after it returns. The parent kills
it at a random moment (often inside a fenced transaction it keeps open on purpose), opens
the database afresh and checks, round after round:

* the database is sound (SQLite: ``PRAGMA integrity_check`` and ``quick_check``) and no
  lock outlived the killed process (the next process claims without waiting);
* the whole stored state (jobs, the application's ``crash_writes`` table, fence marks) is
  exactly the state before the round plus every acknowledged operation, plus, at most,
  the one operation in flight at the kill, all of it or none of it (nothing torn);
* every acknowledged answer was possible: a claim's fence is the previous fence plus one,
  deterministic answers (enqueue, release, revoke, delete, accept) are exactly what the
  state said, and a job that was surely claimable was claimed;
* no fence and no fence mark ever went backwards, and jobs a killed process held are
  claimed again once their leases expire.

Operations use the database's clock (``now=None``) and TTLs of 0.2-0.5 s. Reproduce a
failure with the seed it prints: ``FENCING_CRASH_SEED=N pytest tests/faults/test_crash.py``
(timing still varies; the seed fixes every choice the processes make).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import sqlalchemy
from sqlalchemy import Engine, MetaData, select

from fencing import FenceMarks, JobStore, fence_marks_table, jobs
from fencing._sql.clock import database_now
from fencing._sql.schema import as_text
from tests import crash_worker
from tests.backends import engine_for
from tests.crash_worker import Burst, app_metadata, writes

#: process kills take seconds: run in one session per database (see noxfile.py)
pytestmark = pytest.mark.slow

#: the default run: up to ROUNDS kills, stopping after BUDGET seconds once MIN_ROUNDS are done
ROUNDS = 50
MIN_ROUNDS = 30
BUDGET = 10.0
SLOW_ROUNDS = 200
#: a broken worker must be caught well within this many rounds (usually in the first few)
MUTANT_ROUNDS = 150
#: every AIM_EVERY-th kill is aimed inside a fenced transaction
AIM_EVERY = 4
#: how long the killed process may keep locks: the server notices the closed socket on its own
LOCK_GRACE = 2.0
READY_TIMEOUT = 30.0
#: an aimed kill waits this long at most for the burst to sleep inside a fenced transaction
AIM_TIMEOUT = 2.0
JOBS = 60
#: imported once by the fork server, so a burst process starts in milliseconds, not 0.5 s
#: (a driver that is not installed is skipped by the server)
PRELOAD = [
    "tests.crash_worker",
    "sqlalchemy.dialects.postgresql.psycopg",
    "sqlalchemy.dialects.mysql.pymysql",
    "psycopg",
    "pymysql",
]

marks_table = fence_marks_table(MetaData())


# -- the state, as the checker sees it ------------------------------------------------------


class _Any:
    """A value the checker cannot know (an ``until`` set from the database's clock)."""

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()


class Row(NamedTuple):
    owner: str | None
    until: float
    fence: int
    result: str | None
    done: int


#: ("job", id) -> Row; ("write", payload) -> (job, fence, completes); ("mark", resource) -> fence
Key = tuple[str, str]
State = dict[Key, Any]


def matches(actual: Any, expected: Any) -> bool:
    if isinstance(actual, Row) and isinstance(expected, Row):
        return all(e is ANY or a == e for a, e in zip(actual, expected, strict=True))
    return bool(actual == expected)


class Violation(AssertionError):
    pass


def check(ok: bool, message: str) -> None:
    if not ok:
        raise Violation(message)


class Token(NamedTuple):
    job: str
    owner: str
    fence: int
    until: float


def lease_of(raw: list[Any]) -> Token:
    """A lease as the log holds it: job, owner, fence, until."""
    return Token(*raw)


class Model:
    """The stored state as the acknowledged operations say it must be."""

    def __init__(self) -> None:
        self.state: State = {}
        #: a lower bound of the database's clock now: read by the parent before the round
        self.known_now = 0.0

    def job(self, job: str) -> Row | None:
        row: Row | None = self.state.get(("job", job))
        return row

    def holds(self, lease: Token) -> bool:
        """The lease's owner and fence are current and the job is not done (liveness aside)."""
        row = self.job(lease.job)
        return row is not None and (row.owner, row.fence, row.done) == (lease.owner, lease.fence, 0)

    def surely_claimable(self, row: Row | None) -> bool:
        return row is not None and row.done == 0 and row.until is not ANY and row.until <= self.known_now

    def mark(self, resource: str) -> int | None:
        mark: int | None = self.state.get(("mark", resource))
        return mark

    def mark_takes(self, resource: str, fence: int) -> bool:
        mark = self.mark(resource)
        return mark is None or mark <= fence

    # -- an acknowledged call: check its answer, apply its effect ---------------------------

    def apply(self, i: dict[str, Any], ret: Any) -> None:
        op = i["op"]
        getattr(self, f"_ack_{op}")(i, ret)

    def _claimed(self, lease: Token, owner: str) -> None:
        row = self.job(lease.job)
        check(lease.owner == owner, f"claim answered for owner {lease.owner!r}, not {owner!r}")
        check(row is not None and row.done == 0, f"claimed {lease.job!r}, which is {row}")
        assert row is not None
        check(
            lease.fence == row.fence + 1,
            f"claim of {lease.job!r} handed out fence {lease.fence}; the stored fence was {row.fence}",
        )
        self.state[("job", lease.job)] = Row(owner, lease.until, lease.fence, None, 0)

    def _ack_enqueue(self, i: dict[str, Any], ret: bool) -> None:
        row = self.job(i["job"])
        check(ret == (row is None or row.done == 2), f"enqueue({i['job']!r}) answered {ret} for {row}")
        if ret:
            self.state[("job", i["job"])] = self.enqueued(i, row)

    @staticmethod
    def enqueued(i: dict[str, Any], row: Row | None) -> Row:
        until = ANY if i["ready_at"] is None else i["ready_at"]
        return Row(None, until, 0 if row is None else row.fence, None, 0)

    def _ack_claim(self, i: dict[str, Any], ret: list[Any] | None) -> None:
        if ret is None:
            row = self.job(i["job"])
            check(not self.surely_claimable(row), f"claim refused {i['job']!r}, claimable as {row}")
            return
        lease = lease_of(ret)
        check(lease.job == i["job"], f"claim of {i['job']!r} answered {lease}")
        self._claimed(lease, i["owner"])

    def _ack_claim_next(self, i: dict[str, Any], ret: list[list[Any]]) -> None:
        leases = [lease_of(raw) for raw in ret]
        picked = {lease.job for lease in leases}
        check(len(picked) == len(leases) <= i["limit"], f"claim_next(limit={i['limit']}) answered {leases}")
        before = {job: self.job(job) for job in picked}
        passed_over = [
            key[1]
            for key, row in self.state.items()
            if key[0] == "job" and key[1] not in picked and self.surely_claimable(row)
        ]
        for job in passed_over:
            # longest ready first: a claimable job is passed over only for ones ready as long
            check(len(leases) == i["limit"], f"claim_next took {len(leases)} of {i['limit']}, left {job!r}")
            waiting = self.state[("job", job)].until
            for taken, row in before.items():
                check(
                    row is None or row.until is ANY or row.until <= waiting,
                    f"claim_next took {taken!r} (ready at {row}) before {job!r} (ready at {waiting})",
                )
        for lease in leases:
            self._claimed(lease, i["owner"])

    def _ack_renew(self, i: dict[str, Any], ret: list[Any] | None) -> None:
        if ret is None:
            return  # refused: stale, or expired (the clock decides; not checkable here)
        lease, renewed = lease_of(i["lease"]), lease_of(ret)
        check(self.holds(lease), f"renewed {lease}, not current in {self.job(lease.job)}")
        check(renewed[:3] == lease[:3], f"renew of {lease} answered {renewed}")
        self.state[("job", lease.job)] = self.state[("job", lease.job)]._replace(until=renewed.until)

    def _completed(self, lease: Token, result: str | None, ok: bool) -> None:
        if ok:
            check(self.holds(lease), f"completed {lease}, not current in {self.job(lease.job)}")
            self.state[("job", lease.job)] = self.state[("job", lease.job)]._replace(result=result, done=1)

    def _ack_complete(self, i: dict[str, Any], ret: bool) -> None:
        self._completed(lease_of(i["lease"]), i["result"], ret)

    def _ack_complete_many(self, i: dict[str, Any], ret: list[bool]) -> None:
        check(len(ret) == len(i["leases"]), f"complete_many answered {ret} for {len(i['leases'])}")
        for raw, result, ok in zip(i["leases"], i["results"], ret, strict=True):
            self._completed(lease_of(raw), result, ok)

    def _ack_release(self, i: dict[str, Any], ret: bool) -> None:
        lease = lease_of(i["lease"])
        check(ret == self.holds(lease), f"release of {lease} answered {ret} for {self.job(lease.job)}")
        if ret:
            until = 0.0 if i["delay"] is None else ANY
            self.state[("job", lease.job)] = self.state[("job", lease.job)]._replace(owner=None, until=until)

    def _ack_revoke(self, i: dict[str, Any], ret: bool) -> None:
        row = self.job(i["job"])
        check(ret == (row is not None and row.done == 0), f"revoke({i['job']!r}) answered {ret} for {row}")
        if ret:
            assert row is not None
            self.state[("job", i["job"])] = Row(None, 0.0, row.fence + 1, None, 0)

    def _ack_delete(self, i: dict[str, Any], ret: bool) -> None:
        row = self.job(i["job"])
        check(ret == (row is not None and row.done != 2), f"delete({i['job']!r}) answered {ret} for {row}")
        if ret:
            assert row is not None
            self.state[("job", i["job"])] = Row(None, 0.0, row.fence, None, 2)

    def _ack_accept(self, i: dict[str, Any], ret: bool) -> None:
        resource, fence = i["resource"], i["fence"]
        expected = self.mark_takes(resource, fence)
        check(ret == expected, f"accept({resource!r}, {fence}) answered {ret}; mark {self.mark(resource)}")
        if ret:
            self.state[("mark", resource)] = fence

    def _ack_fenced(self, i: dict[str, Any], ret: str) -> None:
        lease, resource = lease_of(i["lease"]), i["resource"]
        if ret == "lost":
            return  # rolled back: nothing of it may be stored (the reconciliation checks)
        check(self.holds(lease), f"fenced block of {lease} ran ({ret}), not current in {self.job(lease.job)}")
        if ret == "mark-refused":
            check(
                resource is not None and not self.mark_takes(resource, lease.fence),
                f"the mark of {resource!r} refused {lease.fence}; it was {self.mark(resource or '')}",
            )
            return
        check(ret == "committed", f"fenced block answered {ret!r}")
        check(resource is None or self.mark_takes(resource, lease.fence), f"{resource!r} took a lower fence")
        self.state.update(self.fenced_effect(i))

    def fenced_effect(self, i: dict[str, Any]) -> State:
        lease = lease_of(i["lease"])
        effect: State = {("write", i["payload"]): (lease.job, lease.fence, int(i["complete"]))}
        if i["complete"]:
            row = self.state[("job", lease.job)]
            effect[("job", lease.job)] = row._replace(result=i["payload"], done=1)
        if i["resource"] is not None:
            effect[("mark", i["resource"])] = lease.fence
        return effect

    # -- the call in flight at the kill: what it may have stored, all or nothing ------------

    def in_flight(self, i: dict[str, Any]) -> tuple[list[State], int]:
        """Groups of changes the call may have committed (each all or nothing), and how many
        of them at most."""
        op = i["op"]
        if op == "enqueue":
            row = self.job(i["job"])
            if row is None or row.done == 2:
                return [{("job", i["job"]): self.enqueued(i, row)}], 1
        elif op in ("claim", "claim_next"):
            candidates = [i["job"]] if op == "claim" else [key[1] for key in self.state if key[0] == "job"]
            groups = []
            for job in candidates:
                row = self.job(job)
                if row is not None and row.done == 0:
                    groups.append({("job", job): Row(i["owner"], ANY, row.fence + 1, None, 0)})
            return groups, i.get("limit", 1)
        elif op in ("renew", "complete", "complete_many", "release"):
            raws = i["leases"] if op == "complete_many" else [i["lease"]]
            results = i["results"] if op == "complete_many" else [i.get("result")] * len(raws)
            groups = []
            for raw, result in zip(raws, results, strict=True):
                lease = lease_of(raw)
                if not self.holds(lease):
                    continue
                row = self.state[("job", lease.job)]
                if op == "renew":
                    changed = row._replace(until=ANY)
                elif op == "release":
                    changed = row._replace(owner=None, until=0.0 if i["delay"] is None else ANY)
                else:
                    changed = row._replace(result=result, done=1)
                groups.append({("job", lease.job): changed})
            return groups, len(groups)
        elif op == "revoke":
            row = self.job(i["job"])
            if row is not None and row.done == 0:
                return [{("job", i["job"]): Row(None, 0.0, row.fence + 1, None, 0)}], 1
        elif op == "delete":
            row = self.job(i["job"])
            if row is not None and row.done != 2:
                return [{("job", i["job"]): Row(None, 0.0, row.fence, None, 2)}], 1
        elif op == "accept":
            if self.mark_takes(i["resource"], i["fence"]):
                return [{("mark", i["resource"]): i["fence"]}], 1
        elif op == "fenced":
            lease = lease_of(i["lease"])
            if self.holds(lease) and (i["resource"] is None or self.mark_takes(i["resource"], lease.fence)):
                return [self.fenced_effect(i)], 1
        else:
            raise Violation(f"unknown operation in the log: {i}")
        return [], 0


def reconcile(expected: State, stored: State, groups: list[State], at_most: int) -> int:
    """Check ``stored`` is ``expected`` with some of ``groups`` applied whole; how many were."""
    problems = []
    grouped: set[Key] = set()
    applied = 0
    for group in groups:
        grouped.update(group)
        done = all(matches(stored.get(k), v) for k, v in group.items())
        undone = all(matches(stored.get(k), expected.get(k)) for k in group)
        if not (done or undone):
            parts = (
                f"{k}: stored {stored.get(k)}, before {expected.get(k)}, after {v}" for k, v in group.items()
            )
            problems.append("torn: the operation in flight is stored in part: " + "; ".join(parts))
        applied += done and not undone
    if applied > at_most:
        problems.append(f"{applied} changes of the operation in flight are stored; it could make {at_most}")
    for key in sorted((set(expected) | set(stored)) - grouped):
        if not matches(stored.get(key), expected.get(key)):
            problems.append(
                f"{key}: stored {stored.get(key)}, the acknowledged calls say {expected.get(key)}"
            )
    check(not problems, "\n".join(problems[:20]))
    return applied


def torn_rows(stored: State) -> list[str]:
    """Rows no sequence of whole operations can leave, whatever was acknowledged."""
    problems = []
    for key, value in stored.items():
        kind, name = key
        if kind == "job":
            row = value
            if row.done not in (0, 1, 2) or row.fence < 0:
                problems.append(f"{name}: impossible {row}")
            if row.done == 2 and (row.owner, row.until, row.result) != (None, 0.0, None):
                problems.append(f"{name}: a tombstone keeps more than its fence: {row}")
            if row.done == 0 and row.result is not None:
                problems.append(f"{name}: a result on a job that is not done: {row}")
            if row.done == 1 and (row.owner is None or row.fence < 1 or row.until <= 0):
                # complete sets result and done only: the completing lease's owner and until stay
                problems.append(f"{name}: done without the lease that completed it: {row}")
            if row.owner is not None and (row.fence < 1 or row.until <= 0):
                problems.append(f"{name}: an owner without a claim: {row}")
            if row.done == 1 and row.result is not None and row.result.startswith("c:"):
                write = stored.get(("write", row.result))
                if write != (name, row.fence, 1):
                    problems.append(
                        f"{name}: completed by fenced block {row.result!r}, whose write is {write}"
                    )
        elif kind == "write":
            job, fence, completes = value
            row = stored.get(("job", job))
            if row is None or fence > row.fence or fence < 1:
                problems.append(f"write {name!r} by fence {fence} of {job!r}, which is {row}")
            elif completes and row.fence == fence and row.done == 1 and row.result != name:
                # (deleted and enqueued again, the job is not done at that fence: that is no tear)
                problems.append(f"write {name!r} completed {job!r}, whose result is {row.result!r}")
    return problems


# -- reading the database and the log ---------------------------------------------------------


def read_state(engine: Engine) -> tuple[State, float]:
    """Every stored row, and the database's clock, in one transaction."""
    stored: State = {}
    with engine.connect() as conn:
        for job, owner, until, fence, result, done in conn.execute(
            select(
                as_text(jobs.c.id),
                as_text(jobs.c.owner),
                jobs.c.until,
                jobs.c.fence,
                jobs.c.result,
                jobs.c.done,
            )
        ):
            stored[("job", job)] = Row(owner, float(until), int(fence), result, int(done))
        for payload, job, fence, completes in conn.execute(
            select(writes.c.payload, writes.c.job_id, writes.c.fence, writes.c.completes)
        ):
            stored[("write", payload)] = (job, int(fence), int(completes))
        for resource, fence in conn.execute(select(as_text(marks_table.c.resource), marks_table.c.fence)):
            stored[("mark", resource)] = int(fence)
        now = float(conn.execute(select(database_now())).scalar_one())
        conn.rollback()
    return stored, now


@dataclass
class Log:
    acked: list[tuple[dict[str, Any], Any]] = field(default_factory=list)
    pending: dict[str, Any] | None = None
    inside: bool = False  # the pending call is a fenced block, killed inside its transaction
    error: str | None = None


def read_log(path: Path) -> Log:
    log = Log()
    if not path.exists():
        return log
    # a line without its newline was never written whole: as if not written at all
    for line in path.read_text().split("\n")[:-1]:
        record = json.loads(line)
        kind = record["t"]
        if kind == "e":
            log.error = record["error"]
        elif kind == "i":
            check(log.pending is None, f"call {record['seq']} began before {log.pending} was acknowledged")
            log.pending, log.inside = record, False
        else:
            check(log.pending is not None and log.pending["seq"] == record["seq"], f"stray log line {record}")
            assert log.pending is not None
            if kind == "n":
                log.inside = True
            else:
                log.acked.append((log.pending, record["ret"]))
                log.pending = None
    return log


# -- locks --------------------------------------------------------------------------------------


def lock_wait(target: str, engine: Engine, grace: float = LOCK_GRACE) -> tuple[float, int]:
    """Seconds until every row (SQLite: the write lock) could be locked without waiting,
    and how many tries found a lock still held; a lock held past ``grace`` is a violation."""
    start = time.monotonic()
    held = 0
    while True:
        try:
            if "://" in target:
                with engine.begin() as conn:
                    for column in (jobs.c.id, writes.c.payload, marks_table.c.resource):
                        conn.execute(select(column).with_for_update(nowait=True)).all()
            else:
                raw = sqlite3.connect(target, timeout=0, isolation_level=None)
                try:
                    raw.execute("BEGIN IMMEDIATE")
                    raw.execute("ROLLBACK")
                finally:
                    raw.close()
            return time.monotonic() - start, held
        except (sqlalchemy.exc.DBAPIError, sqlite3.OperationalError) as exc:
            held += 1
            waited = time.monotonic() - start
            if waited > grace:
                raise Violation(f"a lock outlived the killed process by {waited:.2f} s: {exc}") from exc
            time.sleep(0.005)


def sqlite_checks(engine: Engine) -> list[str]:
    problems = []
    for pragma in ("integrity_check", "quick_check"):
        try:
            with engine.connect() as conn:
                answer = [row[0] for row in conn.exec_driver_sql(f"PRAGMA {pragma}")]
                conn.rollback()
        except sqlalchemy.exc.DBAPIError as exc:  # "database disk image is malformed"
            answer = [str(exc.orig)]
        if answer != ["ok"]:
            problems.append(f"PRAGMA {pragma}: {answer[:10]}")
    return problems


# -- the run ------------------------------------------------------------------------------------


@dataclass
class CrashRun:
    target: str
    logs: Path
    seed: int
    durability: str = "full"
    mutant: str | None = None
    model: Model = field(default_factory=Model)
    fence_max: dict[str, int] = field(default_factory=dict)
    mark_max: dict[str, int] = field(default_factory=dict)
    #: jobs a killed process held: job -> its fence then
    orphaned: dict[str, int] = field(default_factory=dict)
    stale: list[Token] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: {"bursts": 0.0, "checks": 0.0})

    def setup(self) -> None:
        engine = engine_for(self.target)
        try:
            store = JobStore(engine)
            store.create_table()
            store.engine.dispose()
            FenceMarks(engine).create_tables()
            app_metadata.create_all(engine)
            self.model.state, self.model.known_now = read_state(engine)
        finally:
            engine.dispose()

    def rounds(self, count: int, *, budget: float | None = None, at_least: int = 0) -> None:
        """``count`` kills; with a ``budget`` (seconds), stop early once ``at_least`` are done."""
        rng = random.Random(self.seed)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        stop = None if budget is None else time.monotonic() + budget
        for r in range(count):
            if stop is not None and r >= at_least and time.monotonic() > stop:
                break
            burst = Burst(
                target=self.target,
                ack_path=str(self.logs / f"acks-{r}.log"),
                owner=f"w{r}",
                seed=rng.randrange(2**63),
                durability=self.durability,
                mutant=self.mutant,
                checkpoint_pages=rng.choice([None, 4]),
                jobs=JOBS,
                stale=tuple((t.job, t.owner, t.fence, t.until) for t in self.stale[-30:]),
            )
            # a random moment: at once, early, mid-burst; or aimed inside a fenced transaction
            delay = rng.choice([0.0, rng.uniform(0, 0.02), rng.uniform(0.02, 0.2), rng.uniform(0.1, 0.4)])
            aimed = r % AIM_EVERY == AIM_EVERY - 1
            try:
                started = time.monotonic()
                self.kill_one(ctx, burst, delay, aimed)
                checking = time.monotonic()
                self.check_after_kill(Path(burst.ack_path))
                self.seconds["bursts"] += checking - started
                self.seconds["checks"] += time.monotonic() - checking
            except Violation as exc:
                raise Violation(
                    f"seed {self.seed}, round {r} ({self.durability}); rerun with "
                    f"FENCING_CRASH_SEED={self.seed}\n{exc}\nlog tail:\n{tail(Path(burst.ack_path))}"
                ) from None
            self.stats["rounds"] += 1

    def kill_one(self, ctx: Any, burst: Burst, delay: float, aimed: bool) -> None:
        """Start a burst, SIGKILL it after ``delay`` (``aimed``: as soon as it says it is
        inside a fenced transaction, or after at most ``AIM_TIMEOUT``)."""
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=crash_worker.main, args=(burst, send), daemon=True)
        proc.start()
        send.close()
        try:
            ready = receive.poll(READY_TIMEOUT)
            if ready and aimed:
                wait_for_fenced_sleep(Path(burst.ack_path), time.monotonic() + AIM_TIMEOUT)
            elif ready:
                time.sleep(delay)
            proc.kill()
            proc.join(READY_TIMEOUT)
        finally:
            receive.close()
            if proc.is_alive():
                proc.kill()
                proc.join()
        error = read_log(Path(burst.ack_path)).error
        check(error is None, f"the burst failed before the kill:\n{error}")
        check(ready, "the burst process never became ready")
        check(proc.exitcode == -signal.SIGKILL, f"the burst process exited ({proc.exitcode}) before the kill")
        proc.close()

    def check_after_kill(self, path: Path) -> None:
        log = read_log(path)
        engine = engine_for(self.target)  # a fresh engine: nothing cached from before the kill
        try:
            waited, held = lock_wait(self.target, engine)
            problems = [] if "://" in self.target else sqlite_checks(engine)
            stored, now = read_state(engine)
        finally:
            engine.dispose()
        if held:
            self.stats["kills after which a lock was held a moment"] += 1
            self.stats["longest lock hold after a kill, ms"] = max(
                self.stats["longest lock hold after a kill, ms"], round(waited * 1000)
            )
        problems += torn_rows(stored)
        check(not problems, "\n".join(problems))

        model = self.model
        for intent, ret in log.acked:
            self.stats[f"acked {intent['op']}"] += 1
            self.count_reclaims(intent, ret)
            model.apply(intent, ret)
            self.stale.extend(Token(*raw) for raw in leases_in(intent, ret))
        groups: list[State] = []
        at_most = 0
        if log.pending is not None:
            self.stats["killed mid-call"] += 1
            self.stats["killed inside a fenced transaction"] += log.inside
            groups, at_most = model.in_flight(log.pending)
        if reconcile(model.state, stored, groups, at_most):
            self.stats["call in flight found committed"] += 1

        for (kind, name), value in stored.items():
            if kind in ("job", "mark"):
                fence = value.fence if kind == "job" else value
                highest = self.fence_max if kind == "job" else self.mark_max
                before = highest.get(name, 0)
                check(fence >= before, f"{kind} {name!r}: fence {fence} after {before} (went backwards)")
                highest[name] = fence
        model.state, model.known_now = stored, now
        self.orphaned = {
            name: row.fence
            for (kind, name), row in stored.items()
            if kind == "job" and row.done == 0 and row.owner is not None
        }

    def count_reclaims(self, intent: dict[str, Any], ret: Any) -> None:
        for raw in leases_in(intent, ret):
            lease = lease_of(raw)
            if intent["op"] == "renew":
                continue
            if self.orphaned.get(lease.job) == lease.fence - 1:
                self.stats["claimed after a killed holder's lease expired"] += 1
                del self.orphaned[lease.job]


def leases_in(intent: dict[str, Any], ret: Any) -> list[list[Any]]:
    """The leases an acknowledged call handed out (claims) or extended (renew)."""
    if intent["op"] == "claim_next":
        return list(ret)
    return [ret] if intent["op"] in ("claim", "renew") and ret is not None else []


def wait_for_fenced_sleep(path: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        with path.open("rb") as log:
            if b'"t":"n"' in log.read():
                return
        time.sleep(0.002)


def tail(path: Path, lines: int = 12) -> str:
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(no log)"


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("FENCING_CRASH_SEED") or random.randrange(2**32))
    print(f"FENCING_CRASH_SEED={value}")
    return value


def crash_run(
    target: str, tmp_path: Path, seed: int, rounds: int, durability: str = "full", budget: float | None = None
) -> CrashRun:
    run = CrashRun(target, tmp_path, seed, durability)
    run.setup()
    run.rounds(rounds, budget=budget, at_least=MIN_ROUNDS)
    print(f"crash rounds ({durability}):", dict(sorted(run.stats.items())))
    print("seconds:", {k: round(v, 1) for k, v in run.seconds.items()})
    # the kills must land where it matters, or the run proved little
    assert run.stats["killed mid-call"] > 0, run.stats
    assert run.stats["killed inside a fenced transaction"] > 0, run.stats
    assert run.stats["claimed after a killed holder's lease expired"] > 0, run.stats
    assert run.stats["acked fenced"] > 0 and run.stats["acked complete"] > 0, run.stats
    return run


def test_kill_mid_burst_loses_nothing_acknowledged_and_tears_nothing(
    target: str, tmp_path: Path, seed: int
) -> None:
    crash_run(target, tmp_path, seed, ROUNDS, budget=BUDGET)


@pytest.mark.backend("sqlite")
def test_kill_mid_burst_at_normal_durability_loses_nothing_acknowledged(
    target: str, tmp_path: Path, seed: int
) -> None:
    # synchronous=NORMAL skips the fsync per commit: a power loss may lose commits, a process crash may not
    crash_run(target, tmp_path, seed, ROUNDS, durability="normal", budget=BUDGET)


@pytest.mark.long
def test_hundreds_of_kills_in_a_row(target: str, tmp_path: Path, seed: int) -> None:
    crash_run(target, tmp_path, seed, SLOW_ROUNDS)


@pytest.mark.backend("sqlite")  # the checker is the same on every backend
@pytest.mark.parametrize(
    ("mutant", "finding"),
    [
        # the ack of a block that never committed: an acknowledged write is missing, or a later
        # call's answer contradicts the state the acks built (a release answered True for a
        # job the lying ack had completed: seed 3991552590; a claim of a job the lying ack had
        # completed: seed 3940703644)
        (
            "ack-inside",
            r"the acknowledged calls say|answered \S+ for Row\(|claimed '\S+', which is Row\(",
        ),
        # the app write committed apart from the completion: half a block is stored, a
        # refused block left its write behind, or a write claims a completion that is not there
        (
            "torn-fenced",
            r"torn: the operation in flight is stored in part|the acknowledged calls say|completed .* whose",
        ),
    ],
)
def test_the_checker_catches_a_broken_worker(
    target: str, tmp_path: Path, seed: int, mutant: str, finding: str
) -> None:
    run = CrashRun(target, tmp_path, seed, mutant=mutant)
    run.setup()
    with pytest.raises(Violation, match=finding):
        run.rounds(MUTANT_ROUNDS)
    print(f"{mutant}: caught after {run.stats['rounds']} clean rounds")


# -- the checks themselves can fail ----------------------------------------------------------


def test_the_lock_probe_sees_a_lock_still_held(target: str, engine: Engine) -> None:
    """What a killed process must not leave behind, held by a live one on purpose."""
    store = JobStore(engine)
    store.create_table()
    store.engine.dispose()
    FenceMarks(engine).create_tables()
    app_metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(jobs.insert().values(id=as_text("j000")))
    if "://" in target:
        holder = engine.connect()
        holder.execute(select(jobs.c.id).with_for_update()).all()
        release = holder.close
    else:
        raw = sqlite3.connect(target, isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")
        release = raw.close
    try:
        with pytest.raises(Violation, match="a lock outlived the killed process"):
            lock_wait(target, engine, grace=0.2)
    finally:
        release()
    assert lock_wait(target, engine, grace=0.2)[1] == 0


@pytest.mark.backend("sqlite")
def test_the_integrity_checks_see_a_corrupted_page(target: str) -> None:
    engine = engine_for(target)
    try:
        store = JobStore(engine)
        store.create_table()
        for n in range(300):
            store.enqueue(f"job-{n:04d}-" + "x" * 100)
        store.engine.dispose()
        assert sqlite_checks(engine) == []
    finally:
        engine.dispose()  # the last connection checkpoints the WAL into the file
    with open(target, "r+b") as db:
        db.seek(4096 * 3)  # the header of a b-tree page (not the file header on page 1)
        db.write(b"\xff" * 64)
    engine = engine_for(target)
    try:
        problems = sqlite_checks(engine)
    finally:
        engine.dispose()
    assert [p.split(":")[0] for p in problems] == ["PRAGMA integrity_check", "PRAGMA quick_check"], problems
