"""A heartbeat and a fenced block on the same lease, in one process: never a hang.

The block holds the job's row (SQLite: the database's write lock) until its transaction
ends; the heartbeat renews on another connection. Before :mod:`fencing._runtime.holds` a heartbeat
started in the block, or ``stop()`` called in it, hung PostgreSQL forever and cost SQLite
its busy timeout. Every scenario here runs under a watchdog, so a hang fails the test
instead of the run. Also here: the end check of a block on either clock, a serialization
failure at COMMIT (PostgreSQL SERIALIZABLE), and SQLite's warning for a long block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, event, insert, select
from sqlalchemy.orm import Session

from fencing import ConfigurationError, DatabaseBusy, Heartbeat, JobStore, Lease, LeaseLost
from tests import backends

pytestmark = pytest.mark.sync_only(
    "Heartbeats and watchdog threads; the async blocks and heartbeats have their own tests"
)

#: how long a scenario may take on a loaded machine before it counts as a hang
WATCHDOG = 30.0


def within(seconds: float, scenario: Callable[[], Any]) -> Any:
    """Run ``scenario`` on a thread; fail (not hang) if it has not finished in ``seconds``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = scenario()
        except BaseException as exc:  # handed to the test's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the scenario hung for {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def claimed(store: JobStore, ttl: float, job_id: str = "j", owner: str = "a") -> Lease:
    store.enqueue(job_id, ready_at=0.0)
    lease = store.claim(job_id, owner, ttl=ttl)
    assert lease is not None
    return lease


@pytest.fixture
def results(store: JobStore) -> Iterator[Table]:
    """The application's own table, written inside fenced blocks."""
    table = Table("nesting_results", MetaData(), Column("n", Integer, primary_key=True))
    table.create(store.engine)
    return table


def rows(engine: Engine, table: Table) -> list[int]:
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(select(table.c.n).order_by(table.c.n))]


# -- item 1: the natural nestings work -------------------------------------------------------


def test_stop_inside_a_block_returns_at_once(store: JobStore, results: Table) -> None:
    ttl = 3.0
    lease = claimed(store, ttl)
    hb = Heartbeat(store, lease, ttl, interval=0.05).start()

    def scenario() -> float:
        with store.fenced(lease, complete=True, result="ok") as conn:
            conn.execute(insert(results).values(n=1))
            time.sleep(0.3)  # several intervals: renewals are due while the block holds the row
            started = time.monotonic()
            hb.stop()  # the docs say: stop before completing; here, inside the block
            return time.monotonic() - started

    stopped_in = within(WATCHDOG, scenario)
    assert stopped_in < 1.0
    assert rows(store.engine, results) == [1]
    state = store.state("j")
    assert state is not None and state.done and state.result == "ok"
    assert not hb.lost.is_set()


def test_a_block_under_a_running_heartbeat_gets_a_whole_ttl(store: JobStore, results: Table) -> None:
    # the times scale with it: 1.2 s of the block's ttl to spare on a loaded machine (0.6 s, with
    # a 3 s ttl, was once not enough in CI: stalls of 2 s were seen there)
    ttl = 6.0
    lease = claimed(store, ttl)
    lost: list[Heartbeat] = []
    with Heartbeat(store, lease, ttl, interval=0.3 * ttl, on_lost=lost.append) as hb:

        def scenario() -> float:
            with store.fenced(lease) as conn:
                began = time.monotonic()
                # longer than what is left of the lease the last renewal gave (at most 0.7 ttl)
                # and no renewal can reach the row meanwhile: the block's own extension counts
                time.sleep(0.8 * ttl)
                conn.execute(insert(results).values(n=1))
            return began

        began = within(WATCHDOG, scenario)
        # the heartbeat took the block's extension once it committed, and goes on renewing
        assert hb.held, hb.reason
        assert hb.deadline > began + 0.5 * ttl
        before = hb.lease.until
        assert before is not None
        time.sleep(0.5 * ttl)
        after = hb.lease.until
        assert after is not None and after > before  # renewing again after the block
    assert not lost
    assert rows(store.engine, results) == [1]


def test_a_block_that_completes_the_job_ends_its_heartbeat_quietly(store: JobStore) -> None:
    # long enough that a loaded machine's stall between the claim and the block's end cannot
    # outlast it (CI: 2 s did once); renewals are still due every 0.05 s
    ttl = 10.0
    lease = claimed(store, ttl)
    lost: list[Heartbeat] = []
    with Heartbeat(store, lease, ttl, interval=0.05, on_lost=lost.append) as hb:
        within(WATCHDOG, lambda: _complete_in_block(store, lease))
        time.sleep(0.2)  # renewals would be due: none is sent, none reports a loss
        assert not hb.held
        assert not hb.lost.is_set()
        assert "completed" in repr(hb)
    assert not lost


def _complete_in_block(store: JobStore, lease: Lease) -> None:
    with store.fenced(lease, complete=True, result="done"):
        time.sleep(0.15)


def test_complete_without_stopping_the_heartbeat_is_not_a_loss(store: JobStore) -> None:
    ttl = 2.0
    lease = claimed(store, ttl)
    lost: list[Heartbeat] = []
    with Heartbeat(store, lease, ttl, interval=0.05, on_lost=lost.append) as hb:
        assert store.complete(lease, "done")
        time.sleep(0.3)  # the next renewal is refused: the job was completed under this lease
        assert not hb.held
        assert not hb.lost.is_set()
    assert not lost


def test_a_heartbeat_started_inside_a_block_on_its_lease_is_refused_at_once(store: JobStore) -> None:
    ttl = 2.0
    lease = claimed(store, ttl)

    def scenario() -> None:
        with store.fenced(lease), pytest.raises(ConfigurationError, match="start the Heartbeat before"):
            Heartbeat(store, lease, ttl).start()

    within(WATCHDOG, scenario)
    # the block committed and the lease is untouched
    state = store.state("j")
    assert state is not None and state.owner == "a" and state.fence == lease.fence


def test_an_operation_that_would_wait_for_its_own_block_is_refused(
    store: JobStore, backend: backends.Backend
) -> None:
    ttl = 2.0
    lease = claimed(store, ttl)
    store.enqueue("other", ready_at=0.0)

    def scenario() -> None:
        with store.fenced(lease):
            for call in (
                lambda: store.renew(lease, ttl=ttl),
                lambda: store.release(lease),
                lambda: store.complete(lease, "x"),
                lambda: store.revoke("j"),
                lambda: store.claim("j", "b", ttl=ttl),
            ):
                with pytest.raises(ConfigurationError, match="would wait for it"):
                    call()
            with pytest.raises(ConfigurationError, match="would wait for it forever"), store.fenced(lease):
                pass
            if backend.dialect == "sqlite":  # the write lock holds every row
                with pytest.raises(ConfigurationError, match="write lock"):
                    store.claim("other", "b", ttl=ttl)
            else:  # another row is free
                assert store.claim("other", "b", ttl=ttl) is not None

    within(WATCHDOG, scenario)
    state = store.state("j")
    assert state is not None and state.owner == "a" and not state.done and state.fence == lease.fence


def test_a_block_nested_on_the_outer_blocks_connection_joins_its_transaction(
    store: JobStore, results: Table
) -> None:
    ttl = 30.0
    lease = claimed(store, ttl)
    other = claimed(store, ttl, job_id="k")

    def scenario() -> None:
        # what the refusal above advises: nest with conn= the outer block's connection
        with store.fenced(lease) as conn:
            conn.execute(insert(results).values(n=1))
            store.check(lease, conn=conn)
            store.check(other, conn=conn)
            with store.fenced(lease, conn=conn):
                conn.execute(insert(results).values(n=2))
            with store.fenced(other, conn=conn, complete=True, result="by the nested block"):
                conn.execute(insert(results).values(n=3))
            assert not store.complete(other, "late", conn=conn)  # done in this transaction

    within(WATCHDOG, scenario)
    # everything committed with the outer block, once
    assert rows(store.engine, results) == [1, 2, 3]
    state = store.state("k")
    assert state is not None and state.done and state.result == "by the nested block"
    state = store.state("j")
    assert state is not None and state.owner == "a" and not state.done and state.fence == lease.fence


@pytest.mark.parametrize("begun", [True, False], ids=["begun", "autobegin"])
def test_a_block_joined_to_a_connection_holds_from_its_first_check_even_before_autobegin(
    store: JobStore, results: Table, begun: bool
) -> None:
    # the documented worker pattern (docs/tutorials/worker-pool-sqlite.md) in SQLAlchemy
    # 2.0's commit-as-you-go style: the caller's
    # Connection has no transaction until the block's first check begins one
    ttl = 3.0
    lease = claimed(store, ttl)
    store.enqueue("other", ready_at=0.0)

    def scenario() -> float:
        with Heartbeat(store, lease, ttl, interval=0.05) as hb, store.engine.connect() as conn:
            if begun:
                conn.begin()
            with store.fenced(hb.lease, conn=conn):
                conn.execute(insert(results).values(n=1))
                time.sleep(0.2)  # renewals fall due: the heartbeat must wait for the block
                with pytest.raises(ConfigurationError, match="would wait for it forever"):
                    store.renew(lease, ttl=ttl)  # this job's row, on a connection of its own
                started = time.monotonic()
                hb.stop()
                stopped = time.monotonic() - started
            conn.commit()
            assert not hb.lost.is_set()
        return stopped

    stopped = within(WATCHDOG, scenario)
    assert stopped < 1.0, f"stop() inside the block took {stopped:.2f} s"
    assert rows(store.engine, results) == [1]


def test_a_heartbeat_leaving_inside_a_block_does_not_wait_to_release(store: JobStore) -> None:
    ttl = 2.0
    lease = claimed(store, ttl)
    hb = Heartbeat(store, lease, ttl, interval=0.05, release_on_exit=True).start()

    def scenario() -> None:
        with store.fenced(lease):
            # its release would wait for this block's lock: it is skipped, and logged
            hb.__exit__(None, None, None)

    within(WATCHDOG, scenario)
    state = store.state("j")
    assert state is not None and state.owner == "a"  # not released: it expires at its until
    assert not hb.held


def test_a_block_joined_to_a_session_keeps_renewals_off_until_the_commit(
    store: JobStore, results: Table
) -> None:
    ttl = 3.0
    lease = claimed(store, ttl)
    hb = Heartbeat(store, lease, ttl, interval=0.05).start()

    def scenario() -> None:
        with Session(store.engine) as session, session.begin():
            with store.fenced(lease, conn=session):
                session.execute(insert(results).values(n=1))
            # the block is over, but the row stays locked until this transaction ends
            time.sleep(0.3)
            hb.stop()  # must not wait for a renewal stuck behind the session's lock
            assert store.complete(lease, "done", conn=session)

    within(WATCHDOG, scenario)
    assert rows(store.engine, results) == [1]
    state = store.state("j")
    assert state is not None and state.done and state.result == "done"


def test_a_block_in_another_thread_holds_renewals_until_it_commits(store: JobStore) -> None:
    ttl = 3.0
    lease = claimed(store, ttl)
    in_block = threading.Event()
    leave = threading.Event()

    def block() -> None:
        with store.fenced(lease):
            in_block.set()
            leave.wait(WATCHDOG)

    worker = threading.Thread(target=block, daemon=True)
    worker.start()
    assert in_block.wait(WATCHDOG)
    hb = Heartbeat(store, lease, ttl, interval=0.05)
    starter = threading.Thread(target=hb.start, daemon=True)  # waits for the block's row
    starter.start()
    time.sleep(0.2)
    leave.set()
    worker.join(WATCHDOG)
    starter.join(WATCHDOG)
    assert not worker.is_alive() and not starter.is_alive()
    assert hb.held
    within(WATCHDOG, hb.stop)


# -- item 2: held is never true once another worker could claim -------------------------------


@pytest.mark.parametrize("clock", ["database", "caller"])
def test_held_is_false_whenever_another_claim_succeeds(store: JobStore, clock: str) -> None:
    ttl = 0.05
    now: Callable[[], float | None] = (lambda: None) if clock == "database" else time.time
    early = trials = 0
    for attempt in range(600):
        if trials == 150:
            break
        job = f"j{attempt}"
        store.enqueue(job, ready_at=0.0)
        lease = store.claim(job, "a", ttl=ttl, now=now())
        assert lease is not None
        hb = Heartbeat(store, lease, ttl, interval=ttl / 2, clock=None if clock == "database" else time.time)
        try:
            hb.start()
        except LeaseLost:
            continue  # a loaded machine let it expire before the first renewal: no trial
        hb.stop()  # no more renewals: the lease runs out at the deadline the start gave it
        trials += 1
        while store.claim(job, "b", ttl=ttl, now=now()) is None:
            pass
        if hb.held:  # read after B's claim returned: A must no longer vouch for the lease
            early += 1
    assert trials == 150
    assert early == 0, f"held was still true after another worker's claim in {early} of {trials} trials"


# -- item 5: the end check is made when the block ends, on either clock -----------------------


@pytest.mark.parametrize("clock", ["database", "caller"])
def test_a_block_that_outlives_its_lease_is_rolled_back_on_either_clock(
    store: JobStore, results: Table, clock: str
) -> None:
    ttl = 0.3
    store.enqueue("j", ready_at=0.0)
    now = None if clock == "database" else time.time()
    lease = store.claim("j", "a", ttl=ttl, now=now)
    assert lease is not None

    def late_block() -> None:
        with store.fenced(lease, now=now) as conn:
            conn.execute(insert(results).values(n=1))
            time.sleep(ttl + 0.2)

    with pytest.raises(LeaseLost, match="end of the fenced block"):
        late_block()
    assert rows(store.engine, results) == []


# -- item 8: PostgreSQL SERIALIZABLE --------------------------------------------------------


@pytest.fixture
def serializable(backend: backends.Backend, target: str) -> Iterator[JobStore]:
    if backend.dialect != "postgresql":
        pytest.skip("serialization failures at COMMIT are PostgreSQL's (SERIALIZABLE)")
    engine = backends.engine_for(target).execution_options(isolation_level="SERIALIZABLE")
    store = JobStore(engine)
    store.create_table()
    try:
        yield store
    finally:
        engine.dispose()


def test_the_stores_own_units_retry_a_serialization_failure_at_commit(serializable: JobStore) -> None:
    store = serializable
    for n in range(400):
        store.enqueue(f"j{n}", ready_at=0.0)
    errors: list[BaseException] = []
    done: list[int] = []
    stop = time.monotonic() + 4.0

    def worker(name: str) -> None:
        try:
            while time.monotonic() < stop:
                leases = store.claim_next(name, ttl=30.0, limit=2)
                if not leases:
                    return
                done.append(sum(map(bool, store.complete_many([(lease, name) for lease in leases]))))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(done) > 0


def test_a_commit_the_server_refused_is_run_again_for_the_stores_unit(
    store: JobStore, backend: backends.Backend
) -> None:
    """A lock race reported at COMMIT (the server rolled the transaction back) is retried
    for the store's own unit, never reported as DatabaseBusy. (SQLite in WAL mode does not
    refuse a COMMIT for a lock race.)"""
    if backend.dialect == "sqlite":
        pytest.skip("SQLite in WAL mode does not refuse a COMMIT for a lock race")
    engine = store.engine
    failures = [1]

    @event.listens_for(engine, "commit")
    def refuse_once(conn: Any) -> None:
        if failures[0]:
            failures[0] -= 1
            raise _serialization_failure(engine)

    lease = claimed(store, 5.0)
    assert store.complete(lease, "ok")  # the first COMMIT was refused, the second kept
    assert failures == [0]
    state = store.state("j")
    assert state is not None and state.done and state.result == "ok"


def _serialization_failure(engine: Engine) -> BaseException:
    """What each server's driver raises for a lock race it rolled back whole."""
    if engine.dialect.name == "postgresql":
        import psycopg

        return psycopg.errors.SerializationFailure("could not serialize access")
    import pymysql

    return pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock")


def test_a_fenced_block_rolled_back_at_commit_says_so(serializable: JobStore, results: Table) -> None:
    """Write skew under SERIALIZABLE: the block reads what another transaction writes and
    writes what it reads; the other commits first, so PostgreSQL refuses the block's COMMIT."""
    store = serializable
    other_table = Table("nesting_other", MetaData(), Column("n", Integer, primary_key=True))
    other_table.create(store.engine)
    lease = claimed(store, 30.0)

    def skewed_block() -> None:
        with store.fenced(lease) as conn:
            conn.execute(select(other_table.c.n)).all()
            conn.execute(insert(results).values(n=1))
            with store.engine.connect() as skew, skew.begin():
                skew.execute(select(results.c.n)).all()
                skew.execute(insert(other_table).values(n=1))

    with pytest.raises(DatabaseBusy, match=r"rolled the fenced block back at its end.*run the block again"):
        skewed_block()
    assert rows(store.engine, results) == []
    state = store.state("j")
    assert state is not None and not state.done and state.owner == "a"


# -- item 11: SQLite says when a block kept every writer waiting ------------------------------


def test_sqlite_logs_a_block_that_holds_the_write_lock_too_long(
    store: JobStore, backend: backends.Backend, caplog: pytest.LogCaptureFixture
) -> None:
    if backend.dialect != "sqlite":
        pytest.skip("only SQLite's write lock stops every other writer")
    lease = claimed(store, 0.8)
    with caplog.at_level(logging.WARNING, logger="fencing.store"):
        with store.fenced(lease):
            pass
        assert not caplog.records  # a short block says nothing
        with store.fenced(lease):
            time.sleep(0.3)  # more than a quarter of the shortest ttl seen (0.8 s)
    [record] = caplog.records
    assert "held SQLite's write lock" in record.getMessage()
    assert record.__dict__["job_id"] == "j" and record.__dict__["fence"] == lease.fence
    assert record.__dict__["held_seconds"] >= 0.3


def test_two_engines_on_one_file_meet_in_the_holds(tmp_path: Any) -> None:
    """The holds are per database and table: two stores on one file meet there."""
    from fencing import create_sqlite_engine as sqlite_engine

    path = tmp_path / "two.db"
    first, second = sqlite_engine(str(path)), sqlite_engine(str(path))
    try:
        a, b = JobStore(first), JobStore(second)
        a.create_table()
        assert a.holds_key == b.holds_key
        lease = claimed(a, 2.0)
        hb = Heartbeat(b, lease, 2.0, interval=0.05).start()

        def scenario() -> None:
            with a.fenced(lease):
                time.sleep(0.2)
                hb.stop()

        within(WATCHDOG, scenario)
    finally:
        first.dispose()
        second.dispose()


# -- issue 22, item 2: a block is found however its database is reached ----------------------


def another_way_to(target: str, tmp_path: Any) -> Engine:
    """An engine on the database of ``target`` whose URL does not say so."""
    return backends.engine_for(backends.another_way_to(target, tmp_path))


def test_another_engine_on_the_same_job_is_refused_at_once_not_left_waiting(
    store: JobStore, target: str, tmp_path: Any
) -> None:
    # keyed by the URL string, the same database reached another way slipped past: SQLite
    # waited out its busy timeout and blamed "other writers", PostgreSQL waited forever
    lease = claimed(store, 60.0)
    store.enqueue("other", ready_at=0.0)
    elsewhere = another_way_to(target, tmp_path)
    try:
        there = JobStore(elsewhere)
        assert there.holds_key != store.holds_key or "://" not in target  # servers: not known yet
        there.state("j")  # its first connection: the server says who it is
        assert there.holds_key == store.holds_key

        def scenario() -> None:
            with store.fenced(lease) as conn:
                started = time.monotonic()
                with pytest.raises(ConfigurationError, match="would wait for it forever"):
                    there.complete(lease, "late")
                if store.engine.dialect.name != "sqlite":  # another row: nothing to wait for
                    assert there.claim("other", "b", ttl=60.0) is not None
                assert time.monotonic() - started < 5.0
                conn.execute(select(1))

        within(WATCHDOG, scenario)
    finally:
        elsewhere.dispose()
    assert store.state("j").owner == "a"  # type: ignore[union-attr]


def test_fence_marks_and_another_table_meet_a_blocks_write_lock_on_sqlite(store: JobStore) -> None:
    from fencing import FenceMarks, jobs_table

    marks = FenceMarks(store.engine)
    marks.create_tables()
    other = JobStore(store.engine, jobs_table(MetaData(), "other_jobs"))
    other.create_table()
    other.enqueue("k", ready_at=0.0)
    lease = claimed(store, 60.0)

    def scenario() -> None:
        with store.fenced(lease):
            started = time.monotonic()
            if store.engine.dialect.name == "sqlite":  # the block holds the whole database
                with pytest.raises(ConfigurationError, match="the database's write lock"):
                    marks.accept("invoice-1", lease.fence)
                with pytest.raises(ConfigurationError, match="the database's write lock"):
                    other.claim("k", "b", ttl=60.0)
            else:  # a row of the jobs table: nothing of theirs waits for it
                assert marks.accept("invoice-1", lease.fence)
                assert other.claim("k", "b", ttl=60.0) is not None
            assert time.monotonic() - started < 5.0

    within(WATCHDOG, scenario)


def test_a_heartbeat_on_another_engine_never_waits_on_its_own_block(
    store: JobStore, target: str, tmp_path: Any
) -> None:
    ttl = 1.5
    lease = claimed(store, ttl)
    elsewhere = another_way_to(target, tmp_path)
    try:
        there = JobStore(elsewhere)
        there.state("j")  # connected once: its database is known

        def scenario() -> float:
            with (
                Heartbeat(there, lease, ttl, interval=0.05) as hb,
                store.fenced(hb.lease, complete=True, result="r"),
            ):
                time.sleep(0.3)  # renewals are due while the block holds the row
                started = time.monotonic()
                hb.stop()
                return time.monotonic() - started

        stopped_in = within(WATCHDOG, scenario)
    finally:
        elsewhere.dispose()
    assert stopped_in < 1.0
    state = store.state("j")
    assert state is not None and state.done and state.result == "r"
