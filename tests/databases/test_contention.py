"""Many writers on one SQLite file: waiting for the write lock, and giving up on it.

The store's own connections wait in SQLite's busy handler for a moment only; a waiter that
is still waiting then takes priority, the others hold back for it, and the whole wait is
bounded by the engine's ``busy_timeout`` (``fencing._runtime.writelock``). What must hold:

* a caller never sees SQLite's "database is locked": only ``DatabaseBusy``, and only once
  the budget is spent; a ``DatabaseBusy`` call changed nothing;
* with the default budget, workers that contend for the lock never see an error at all,
  and every job is still claimed exactly once;
* a unit whose ``COMMIT`` was refused is never run again;
* a waiter that has waited long takes priority, the others hold back for it, and a
  priority holder that stalls holds nobody back for long;
* the engine's pooled connections (``conn=``) still wait the whole ``busy_timeout``.

No assertion here depends on how fast the machine is, beyond generous upper bounds.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import queue
import sqlite3
import stat
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

import fencing
import fencing._runtime.execution
import fencing._runtime.sqlite
import fencing._runtime.writelock
from fencing import DatabaseBusy, DatabaseError, JobState, JobStore, Lease
from fencing._runtime.execution import TRANSIENT_RETRIES, LockWait
from fencing._runtime.writelock import COURTESY, STARVING, WriteLock, sidecar_path
from tests.processes import reap

PROCESSES = 4
TIMEOUT = 120.0
NOW = 1000.0
TTL = 1e6  # no lease expires during a test: a job is claimed at most once
SLACK = 10.0  # how late a loaded machine may wake a sleeper: bounds, never expectations

pytestmark = pytest.mark.backend("sqlite")


@contextlib.contextmanager
def write_locked(path: str) -> Iterator[sqlite3.Connection]:
    """Another connection holding SQLite's write lock (``BEGIN IMMEDIATE``) for the block."""
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield other
        if other.in_transaction:
            other.execute("ROLLBACK")
    finally:
        other.close()


def release_later(other: sqlite3.Connection, delay: float) -> threading.Thread:
    def release() -> None:
        time.sleep(delay)
        other.execute("ROLLBACK")

    thread = threading.Thread(target=release, name="lock-holder", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def sqlite_store(path: Path, **options: Any) -> Iterator[JobStore]:
    engine = fencing.create_sqlite_engine(path, **options)
    store = JobStore(engine)
    try:
        store.create_table()
        yield store
    finally:
        store.engine.dispose()
        engine.dispose()


def pragma_busy_timeout(conn: Any) -> int:
    return int(conn.execute("PRAGMA busy_timeout").fetchone()[0])


# -- one held lock --------------------------------------------------------------------------


BUDGET = 0.4


@pytest.mark.parametrize(
    "call",
    ["claim", "claim_next", "complete", "complete_many", "enqueue", "renew", "release", "revoke"],
)
def test_a_lock_held_past_the_budget_raises_database_busy_after_it_and_changes_nothing(
    tmp_path: Path, call: str
) -> None:
    path = tmp_path / "held.db"
    with sqlite_store(path, busy_timeout=BUDGET) as store:
        store.enqueue("held", ready_at=0.0)
        store.enqueue("free", ready_at=0.0)
        lease = store.claim("held", "w", now=NOW, ttl=TTL)
        assert lease is not None
        before = {job: store.state(job) for job in ("held", "free", "new")}
        calls = {
            "claim": lambda: store.claim("free", "w", now=NOW, ttl=TTL),
            "claim_next": lambda: store.claim_next("w", now=NOW, ttl=TTL, limit=5),
            "complete": lambda: store.complete(lease, "r", now=NOW),
            "complete_many": lambda: store.complete_many([(lease, "r")], now=NOW),
            "enqueue": lambda: store.enqueue("new"),
            "renew": lambda: store.renew(lease, now=NOW, ttl=TTL + 1),
            "release": lambda: store.release(lease),
            "revoke": lambda: store.revoke("held"),
        }
        with write_locked(str(path)):
            started = time.monotonic()
            with pytest.raises(DatabaseBusy) as excinfo:
                calls[call]()
            waited = time.monotonic() - started
        assert BUDGET <= waited < BUDGET + SLACK, f"gave up after {waited:.3f} s"
        assert "database is locked" in str(excinfo.value.__cause__)
        assert "busy_timeout" in str(excinfo.value)
        assert {job: store.state(job) for job in before} == before
        # the lock is free again: the same call goes through
        calls[call]()


def test_a_lock_released_within_the_budget_is_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "released.db"
    with sqlite_store(path, busy_timeout=30.0) as store:
        store.enqueue("j", ready_at=0.0)
        with write_locked(str(path)) as other:
            holder = release_later(other, 0.3)
            started = time.monotonic()
            leases = store.claim_next("w", now=NOW, ttl=TTL)
            waited = time.monotonic() - started
            holder.join(TIMEOUT)
        assert leases == [Lease("j", "w", 1, NOW + TTL)]
        assert 0.3 <= waited < 30.0


def test_a_zero_budget_tries_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "zero.db"
    with sqlite_store(path, busy_timeout=0) as store:
        store.enqueue("j", ready_at=0.0)
        pauses: list[int] = []
        monkeypatch.setattr(
            fencing._runtime.writelock, "poll_pause", lambda attempt, left: pauses.append(attempt)
        )
        with write_locked(str(path)), pytest.raises(DatabaseBusy):
            store.claim("j", "w", now=NOW, ttl=TTL)
        assert pauses == []
        assert store.state("j") == JobState("j", None, 0.0, 0, None, False)


@pytest.mark.parametrize("budget", [7.0, 0.03])
def test_a_write_waits_in_sqlites_handler_briefly_and_the_pooled_connection_keeps_its_budget(
    tmp_path: Path, budget: float
) -> None:
    path = tmp_path / "handlers.db"
    with sqlite_store(path, busy_timeout=budget) as store:
        seen: list[tuple[str, int]] = []

        def observe(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            seen.append((statement, pragma_busy_timeout(cursor.connection)))

        # a listener: the store's statements go through Core, and this sees each one
        sqlalchemy.event.listen(store.engine, "before_cursor_execute", observe)
        store.enqueue("j", ready_at=0.0)
        sqlalchemy.event.remove(store.engine, "before_cursor_execute", observe)
        begins = [timeout for statement, timeout in seen if statement == "BEGIN IMMEDIATE"]
        # then the library takes over: priority, within the budget
        assert begins == [int(min(budget, STARVING) * 1000)]
        store.enqueue("k", ready_at=0.0)  # and on the driver directly, nobody listening
        assert store.engine.pool.checkedin() == 1  # one connection, the one both used
        # the application's next transaction on it waits the engine's whole busy_timeout
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == int(budget * 1000)


def test_a_fenced_block_that_cannot_get_the_lock_raises_database_busy_and_changes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fenced.db"
    with sqlite_store(path, busy_timeout=BUDGET) as store:
        store.enqueue("j", ready_at=0.0)
        lease = store.claim("j", "w", now=NOW, ttl=TTL)
        assert lease is not None
        before = store.state("j")
        with (
            write_locked(str(path)),
            pytest.raises(DatabaseBusy) as excinfo,
            store.fenced(lease, now=NOW, complete=True, result="r"),
        ):
            pytest.fail("the block ran without the write lock")
        assert "database is locked" in str(excinfo.value.__cause__)
        assert store.state("j") == before


def test_a_callers_connection_still_waits_the_whole_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "conn.db"
    with sqlite_store(path, busy_timeout=30.0) as store:
        store.enqueue("j", ready_at=0.0)
        with write_locked(str(path)) as other:
            holder = release_later(other, 0.3)
            started = time.monotonic()
            with store.engine.begin() as conn:  # BEGIN IMMEDIATE waits in SQLite's handler
                lease = store.claim("j", "w", now=NOW, ttl=TTL, conn=conn)
            waited = time.monotonic() - started
            holder.join(TIMEOUT)
        assert lease == Lease("j", "w", 1, NOW + TTL)
        assert 0.3 <= waited < 30.0


# -- COMMIT is never sent twice ---------------------------------------------------------------


class CommitRefused(sqlite3.Connection):
    """A connection whose COMMIT fails as a lost lock race would (before committing), the
    first ``refusals`` times."""

    commits = 0
    refusals = 1

    def cursor(self, factory: Any = None) -> Any:
        return super().cursor(factory or CommitRefusedCursor)

    def commit(self) -> None:
        CommitRefused.refuse()
        super().commit()

    @staticmethod
    def refuse() -> None:
        CommitRefused.commits += 1
        if CommitRefused.commits <= CommitRefused.refusals:
            raise sqlite3.OperationalError("database is locked")


class CommitRefusedCursor(sqlite3.Cursor):
    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        if sql.strip().upper() == "COMMIT":
            CommitRefused.refuse()
        return super().execute(sql, parameters)


def test_a_refused_commit_is_rolled_back_and_run_again_once(tmp_path: Path) -> None:
    # a lock race at COMMIT: the store rolls its unit back (SQLite keeps the transaction
    # open after a busy COMMIT; the servers have already rolled it back) and runs it again,
    # so the claim is made exactly once
    path = tmp_path / "commit.db"
    with sqlite_store(path) as store:
        store.enqueue("j", ready_at=0.0)
        fencing.FenceMarks(store.engine).create_tables()
    engine = fencing.create_sqlite_engine(path, connect_args={"factory": CommitRefused})
    store = JobStore(engine)
    CommitRefused.commits, CommitRefused.refusals = 0, 1
    try:
        assert store.claim("j", "w", now=NOW, ttl=TTL) == Lease("j", "w", 1, NOW + TTL)
        assert CommitRefused.commits == 2
        assert store.state("j") == JobState("j", "w", NOW + TTL, 1, None, False)
        # the engine-owned transactions (FenceMarks) follow the same rule
        marks = fencing.FenceMarks(engine)
        CommitRefused.commits = 0
        assert marks.accept("r", 1)
        assert CommitRefused.commits == 2
        assert marks.highest("r") == 1
    finally:
        store.engine.dispose()
        engine.dispose()


def test_a_commit_refused_past_the_budget_is_busy_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "commit.db"
    with sqlite_store(path) as store:
        store.enqueue("j", ready_at=0.0)
    engine = fencing.create_sqlite_engine(path, busy_timeout=0.3, connect_args={"factory": CommitRefused})
    store = JobStore(engine)
    CommitRefused.commits, CommitRefused.refusals = 0, 10**9
    try:
        with pytest.raises(DatabaseBusy):
            store.claim("j", "w", now=NOW, ttl=TTL)
        assert CommitRefused.commits >= 2  # retried, within the budget
        CommitRefused.refusals = 0
        assert store.state("j") == JobState("j", None, 0.0, 0, None, False)
    finally:
        engine.dispose()


# -- the retry policy itself --------------------------------------------------------------------


def test_servers_retry_a_lost_race_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fencing._runtime.execution, "backoff", lambda attempt: None)
    wait = LockWait(None)
    assert all(wait.again(attempt, 0.0) for attempt in range(1, TRANSIENT_RETRIES + 1))
    assert not wait.again(TRANSIENT_RETRIES + 1, 0.0)


class FakeClock:
    """``time`` for fencing._runtime.writelock: sleeping moves the clock, nothing really sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class LockedCursor:
    """A cursor whose BEGIN always loses the race for the write lock."""

    def __init__(self) -> None:
        self.tries = 0

    def execute(self, sql: str) -> None:
        self.tries += 1
        raise sqlite3.OperationalError("database is locked")


def test_a_lost_race_the_handler_did_not_wait_for_is_not_retried_in_a_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(fencing._runtime.writelock, "time", clock)
    cursor = LockedCursor()  # BEGIN fails at once, as if SQLite's handler did not wait
    with pytest.raises(DatabaseBusy, match="busy_timeout"):
        WriteLock(0.05, None).begin(cursor.execute, "BEGIN IMMEDIATE", (sqlite3.Error,))
    assert cursor.tries == len(clock.slept) + 1 >= 5  # a pause after every try but the first
    assert min(clock.slept) > 0 and max(clock.slept) <= 0.01
    assert clock.now == pytest.approx(100.05)  # the last pause ends at the budget, not past it


def test_a_starving_waiter_takes_priority_and_gives_it_up_once_it_has_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "starving.db"
    sidecar = sidecar_path(str(path))
    assert sidecar is not None
    with sqlite_store(path, busy_timeout=60.0) as store:
        store.enqueue("j", ready_at=0.0)
        assert not Path(sidecar).exists()  # made the first time someone starves
        result: list[Any] = []
        with write_locked(str(path)) as other:
            waiter = threading.Thread(
                target=lambda: result.append(store.claim_next("w", now=NOW, ttl=TTL)), daemon=True
            )
            waiter.start()
            deadline = time.monotonic() + TIMEOUT
            while not priority_taken(sidecar) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert priority_taken(sidecar), "the waiter never took priority"
            other.execute("ROLLBACK")
            waiter.join(TIMEOUT)
        assert result == [[Lease("j", "w", 1, NOW + TTL)]]
        assert not priority_taken(sidecar)
        assert stat.S_ISREG(os.stat(sidecar).st_mode)
        assert os.path.getsize(sidecar) == 0


def priority_taken(sidecar: str) -> bool:
    try:
        fd = os.open(sidecar, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def priority_held(sidecar: str) -> Iterator[None]:
    """The test holds priority, like a waiter of another process that waited long."""
    fd = os.open(sidecar, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def test_writers_hold_back_while_another_waiter_has_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "courtesy.db"
    sidecar = sidecar_path(str(path))
    assert sidecar is not None
    monkeypatch.setattr(fencing._runtime.writelock, "COURTESY", 60.0)  # hold back as long as it is taken
    with sqlite_store(path) as store:
        holding_back = threading.Event()
        original = fencing._runtime.writelock._priority_taken

        def looking(fd: int) -> bool:
            taken = original(fd)
            if taken:
                holding_back.set()
            return taken

        monkeypatch.setattr(fencing._runtime.writelock, "_priority_taken", looking)
        done = threading.Event()
        with priority_held(sidecar):
            # a store looks for a sidecar that did not exist at most every _LOOK_EVERY
            time.sleep(2 * fencing._runtime.writelock._LOOK_EVERY)
            writer = threading.Thread(target=lambda: (store.enqueue("second"), done.set()), daemon=True)
            writer.start()
            assert holding_back.wait(TIMEOUT)
            time.sleep(0.2)
            # the lock is free, yet the writer has not taken it: it is ours, the priority holder's
            assert not done.is_set()
            with contextlib.closing(sqlite3.connect(path, isolation_level=None, timeout=0)) as raw_conn:
                raw_conn.execute("BEGIN IMMEDIATE")
                raw_conn.execute("INSERT INTO jobs (id) VALUES ('first')")
                raw_conn.execute("COMMIT")
            assert store.state("second") is None
        writer.join(TIMEOUT)
        assert done.is_set()
        assert [job for job, *_ in _table(path)] == ["first", "second"]


def test_a_stalled_priority_holder_holds_a_writer_back_for_a_moment_only(tmp_path: Path) -> None:
    path = tmp_path / "stalled.db"
    sidecar = sidecar_path(str(path))
    assert sidecar is not None
    with sqlite_store(path, busy_timeout=60.0) as store, priority_held(sidecar):
        time.sleep(2 * fencing._runtime.writelock._LOOK_EVERY)  # see test_writers_hold_back_...
        started = time.monotonic()
        assert store.enqueue("j")  # no error, and long before the budget
        waited = time.monotonic() - started
    assert COURTESY <= waited < COURTESY + SLACK


# -- many processes -------------------------------------------------------------------------------


def _hammer(path: str, name: str, busy_timeout: float, limit: int, barrier: Any, out: Any) -> None:
    """claim_next -> complete(_many) until no job is left; what happened, by kind."""
    engine = fencing.create_sqlite_engine(path, busy_timeout=busy_timeout)
    store = JobStore(engine)
    claimed: list[tuple[str, int]] = []
    done: list[str] = []
    failures: Counter[str] = Counter()
    try:
        barrier.wait(TIMEOUT)
        while True:
            try:
                leases = store.claim_next(name, now=NOW, ttl=TTL, limit=limit)
            except DatabaseBusy:
                failures["claim_next: DatabaseBusy"] += 1
                continue
            if not leases:  # no lease expires: every job has been claimed
                break
            claimed.extend((lease.job_id, lease.fence) for lease in leases)
            pending = leases
            while pending:  # a completion refused as busy is tried again: the lease is ours
                try:
                    verdicts = store.complete_many([(lease, name) for lease in pending], now=NOW)
                except DatabaseBusy:
                    failures["complete_many: DatabaseBusy"] += 1
                    continue
                assert all(verdicts), f"{name}: a completion under a live lease was refused"
                done.extend(lease.job_id for lease in pending)
                pending = []
        out.put(("ok", name, claimed, done, dict(failures)))
    except BaseException:
        barrier.abort()
        out.put(("error", name, traceback.format_exc(), [], {}))
    finally:
        store.engine.dispose()
        engine.dispose()


def _run_workers(path: Path, busy_timeout: float, limit: int) -> dict[str, tuple[Any, Any, dict[str, int]]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(PROCESSES)
    procs = [
        ctx.Process(target=_hammer, args=(str(path), f"w{p}", busy_timeout, limit, barrier, out))
        for p in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    reports: dict[str, tuple[Any, Any, dict[str, int]]] = {}
    try:
        for _ in procs:
            try:
                status, name, claimed, done, failures = out.get(timeout=TIMEOUT)
            except queue.Empty:
                pytest.fail("a worker process did not report back")
            assert status == "ok", f"{name} failed:\n{claimed}"
            reports[name] = (claimed, done, failures)
    finally:
        reap(procs, 30)
    return reports


def _enqueue(path: Path, jobs: list[str]) -> None:
    with sqlite_store(path) as store, store.engine.begin() as conn:
        conn.execute(store.table.insert(), [{"id": job} for job in jobs])


def _table(path: Path) -> list[tuple[str, str | None, int, str | None, int]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute("SELECT id, owner, fence, result, done FROM jobs ORDER BY id").fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 20])
def test_contending_processes_with_the_default_budget_see_no_error_and_claim_each_job_once(
    tmp_path: Path, limit: int
) -> None:
    path = tmp_path / "default.db"
    jobs = [f"job-{n:04d}" for n in range(400 if limit == 1 else 2000)]
    _enqueue(path, jobs)
    reports = _run_workers(path, fencing._runtime.sqlite.DEFAULT_BUSY_TIMEOUT, limit)
    assert {name: failures for name, (_, _, failures) in reports.items()} == {name: {} for name in reports}, (
        "an error reached a caller"
    )
    claimed = sorted(item for claimed, _, _ in reports.values() for item in claimed)
    assert claimed == [(job, 1) for job in jobs], "a job was claimed twice, or not at all"
    owner = {job: name for name, (_, done, _) in reports.items() for job in done}
    assert _table(path) == [(job, owner[job], 1, owner[job], 1) for job in jobs]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.0, 0.002])
def test_contending_processes_with_a_tiny_budget_see_only_database_busy_which_changed_nothing(
    tmp_path: Path, budget: float
) -> None:
    path = tmp_path / "tiny.db"
    jobs = [f"job-{n:04d}" for n in range(600)]
    _enqueue(path, jobs)
    # 0: one try, no wait at all; a busy caller must get DatabaseBusy, never the driver's error
    reports = _run_workers(path, budget, 3)
    busy = sum(sum(failures.values()) for _, _, failures in reports.values())
    if budget == 0:  # four processes and not one wait allowed: some calls must have been refused
        assert busy > 0, "the workers never contended: the test proved nothing"
    # every claim that was not refused handed its jobs out once; a refused one changed nothing
    claimed = sorted(item for claimed, _, _ in reports.values() for item in claimed)
    assert claimed == [(job, 1) for job in jobs]
    owner = {job: name for name, (_, done, _) in reports.items() for job in done}
    assert _table(path) == [(job, owner[job], 1, owner[job], 1) for job in jobs]


def test_database_busy_is_a_database_error() -> None:
    assert issubclass(DatabaseBusy, DatabaseError)
