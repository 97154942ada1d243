"""A claim that waits for work: ``claim_next(..., wait=seconds)``.

Each test runs on the database under test. A waiting claim returns at once when a job is
ready; when none is, it waits without holding a connection, and is woken by a job this
process makes ready (an enqueue, a release, from any thread or task), or at the time the
next deferred job comes due; after ``wait`` seconds it returns ``[]``. The backoff between
its looks is made minutes long here, so a test that returns in seconds proves the wake-up,
not a look that happened to come.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, func, select, text

from fencing import InvalidArgument, InvalidArgumentType, JobStore, jobs_table
from fencing._sql.channels import LISTENING, listening_notice
from fencing._store import batches, bell, waiting
from fencing._store.announcer import FRESH, Announcer
from fencing.asyncio import AsyncJobStore
from tests import backends

TTL = 30.0


@pytest.fixture
def slow_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting claim's looks minutes apart: only a wake-up ends its wait early."""
    monkeypatch.setattr(waiting, "FIRST_PAUSE", 300.0)
    monkeypatch.setattr(batches, "WAIT_POLL", 300.0)


def test_a_ready_job_is_claimed_at_once(store: Any) -> None:
    store.enqueue("j")
    started = time.monotonic()
    [lease] = store.claim_next("w", ttl=TTL, wait=30.0)
    assert lease.job_id == "j" and lease.fence == 1
    assert time.monotonic() - started < 20.0  # not the wait: there was a job


def test_nothing_ready_waits_the_whole_wait_then_answers_empty(store: Any) -> None:
    started = time.monotonic()
    assert store.claim_next("w", ttl=TTL, wait=0.3) == []
    assert time.monotonic() - started >= 0.3


def test_a_deferred_job_wakes_its_waiter_at_its_time(store: Any, slow_looks: None) -> None:
    due = time.time() + 1.0  # on this machine's clock, the database's too (same host)
    store.enqueue("later", ready_at=due)
    started = time.monotonic()
    [lease] = store.claim_next("w", ttl=TTL, wait=30.0)
    assert lease.job_id == "later"
    assert time.time() >= due - 0.05  # not before its time
    assert time.monotonic() - started < 20.0  # at its time, not at the next look (300 s)


def test_an_enqueue_of_another_thread_wakes_the_waiter(engine: Engine, slow_looks: None) -> None:
    table = jobs_table(MetaData(), "wait_jobs")
    waiter, enqueuer = JobStore(engine, table), JobStore(engine, table)
    waiter.create_table()
    looked = threading.Event()
    claim_now = waiter._claim_now

    def counted(*args: Any) -> Any:
        answer = claim_now(*args)
        looked.set()  # its first look found nothing: it waits now
        return answer

    waiter._claim_now = counted  # type: ignore[method-assign]
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(waiter.claim_next("w", ttl=TTL, wait=60.0)))
    started = time.monotonic()
    thread.start()
    assert looked.wait(20.0)
    assert enqueuer.enqueue("woken")
    thread.join(30.0)
    assert not thread.is_alive()
    assert [lease.job_id for lease in got[0]] == ["woken"]
    assert time.monotonic() - started < 30.0  # woken, not timed out (60 s) nor a look (300 s)
    assert not bell._BELLS[waiter._ctx.bell_key()]._waiting  # its subscription is gone


def test_a_waiter_holds_no_connection_while_it_waits(engine: Engine, slow_looks: None) -> None:
    table = jobs_table(MetaData(), "idle_jobs")
    store = JobStore(engine, table)
    store.create_table()
    thread = threading.Thread(target=lambda: store.claim_next("w", ttl=TTL, wait=1.0))
    thread.start()
    time.sleep(0.5)  # (its first look is long done)
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    thread.join(30.0)


def test_an_async_waiter_is_woken_by_a_task_and_by_a_thread(
    engine: Engine, target: str, slow_looks: None
) -> None:
    table = jobs_table(MetaData(), "async_wait_jobs")
    JobStore(engine, table).create_table()

    async def main() -> list[str]:
        async_engine = backends.async_engine_for(target)
        store = AsyncJobStore(async_engine, table)
        try:
            waiting_claim = asyncio.create_task(store.claim_next("w", ttl=TTL, wait=60.0))
            await asyncio.sleep(0.5)
            await store.enqueue("by-a-task")
            first = await asyncio.wait_for(waiting_claim, 30.0)
            # rung from another thread: the waiter's event is set on its own loop
            second_claim = asyncio.create_task(store.claim_next("w", ttl=TTL, wait=60.0))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(JobStore(engine, table).enqueue, "by-a-thread")
            second = await asyncio.wait_for(second_claim, 30.0)
            # a cancelled waiter leaves nothing behind: no subscription, no lease
            cancelled = asyncio.create_task(store.claim_next("w", ttl=TTL, wait=60.0))
            await asyncio.sleep(0.3)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            return [lease.job_id for lease in first + second]
        finally:
            await async_engine.dispose()

    started = time.monotonic()
    assert asyncio.run(main()) == ["by-a-task", "by-a-thread"]
    assert time.monotonic() - started < 60.0  # woken twice, not timed out


@pytest.mark.parametrize(
    ("wait", "more", "error", "says"),
    [
        pytest.param(
            -1.0, {}, InvalidArgument, "wait must be >= 0 seconds (0: do not wait), got -1.0", id="negative"
        ),
        pytest.param(None, {}, InvalidArgumentType, "wait must be a number of seconds", id="none"),
        pytest.param(float("inf"), {}, InvalidArgument, "wait must be a finite number", id="infinite"),
        pytest.param("5", {}, InvalidArgumentType, "wait must be a real number", id="text"),
        pytest.param(5.0, {"now": 100.0}, InvalidArgument, "wait= waits on the database's clock", id="now"),
    ],
)
def test_bad_waits_are_refused_and_nothing_is_claimed(
    store: Any, wait: Any, more: dict[str, Any], error: type[Exception], says: str
) -> None:
    store.enqueue("j", ready_at=0)
    with pytest.raises(error, match="wait") as caught:
        store.claim_next("w", ttl=TTL, wait=wait, **more)
    assert says in str(caught.value)
    assert store.holder("j", now=100.0) is None


def test_a_wait_in_the_callers_transaction_is_refused(store: Any, engine: Engine) -> None:
    store.enqueue("j", ready_at=0)
    refused = pytest.raises(InvalidArgument, match=r"wait= cannot wait in your transaction \(conn=\)")
    with engine.connect() as conn, conn.begin(), refused:
        store.claim_next("w", ttl=TTL, wait=5.0, conn=conn)
    assert store.holder("j", now=100.0) is None


_ENQUEUE_ELSEWHERE = """
import sys
from sqlalchemy import MetaData, create_engine
from fencing import JobStore, configure_sqlite, jobs_table
engine = create_engine(sys.argv[1])
if engine.dialect.name == "sqlite":
    configure_sqlite(engine)
store = JobStore(engine, jobs_table(MetaData(), sys.argv[2]))
assert store.enqueue(sys.argv[3])
"""


def _enqueue_in_another_process(engine: Engine, table: str, job_id: str) -> None:
    url = engine.url.render_as_string(hide_password=False)
    subprocess.run([sys.executable, "-c", _ENQUEUE_ELSEWHERE, url, table, job_id], check=True, timeout=60)


def _waiting_claim(store: JobStore) -> tuple[threading.Thread, list[Any]]:
    """A thread whose claim waits (a minute) in ``store``'s new table, and what it got;
    returns once its looks are done and it listens."""
    store.create_table()
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(store.claim_next("w", ttl=TTL, wait=60.0)))
    thread.start()
    time.sleep(0.5)
    return thread, got


@pytest.mark.backend("postgresql", "sqlite")
def test_an_enqueue_of_another_process_wakes_a_waiter(engine: Engine, target: str, slow_looks: None) -> None:
    table = jobs_table(MetaData(), "notified_jobs")
    started = time.monotonic()
    thread, got = _waiting_claim(JobStore(engine, table))
    _enqueue_in_another_process(engine, "notified_jobs", "from-afar")
    thread.join(30.0)
    assert not thread.is_alive()
    assert [lease.job_id for lease in got[0]] == ["from-afar"]
    assert time.monotonic() - started < 30.0  # notified: the next look was minutes away

    async def main() -> list[str]:  # and a task, through the loop's own listening connection
        async_engine = backends.async_engine_for(target)
        store = AsyncJobStore(async_engine, table)
        try:
            waiting_claim = asyncio.create_task(store.claim_next("w", ttl=TTL, wait=60.0))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(_enqueue_in_another_process, engine, "notified_jobs", "to-a-task")
            return [lease.job_id for lease in await asyncio.wait_for(waiting_claim, 30.0)]
        finally:
            await async_engine.dispose()

    started = time.monotonic()
    assert asyncio.run(main()) == ["to-a-task"]
    assert time.monotonic() - started < 30.0


@pytest.mark.backend("postgresql")
def test_an_enqueue_in_the_callers_transaction_wakes_a_waiter_at_its_commit(
    engine: Engine, slow_looks: None
) -> None:
    store = JobStore(engine, jobs_table(MetaData(), "committed_jobs"))
    thread, got = _waiting_claim(store)
    with engine.connect() as conn, conn.begin():
        assert store.enqueue("with-my-order", conn=conn)
        time.sleep(0.5)  # not before the commit: the job is not there yet
        assert not got
    thread.join(30.0)
    assert [lease.job_id for lease in got[0]] == ["with-my-order"]


@pytest.mark.backend("postgresql")
def test_an_enqueue_notifies_only_while_someone_listens(engine: Engine) -> None:
    # the look: a session of that name in pg_stat_activity, or no notification (a name of
    # this test's own: other tests' listeners are about on this server)
    name = f"fencing test {uuid.uuid4().hex[:12]}"
    look = select(listening_notice("fencing:probe", name))
    with engine.connect() as conn:
        assert conn.execute(look).scalar() is None
        conn.rollback()  # (pg_stat_activity is read once per transaction)
        with engine.connect() as listener:
            listener.exec_driver_sql(f"SET application_name = '{name}'")
            listener.commit()
            assert conn.execute(look).scalar() is True
    # a waiting claim's listening connection bears the name the enqueue looks for
    table = jobs_table(MetaData(), "announced_jobs")
    store = JobStore(engine, table)
    store.create_table()
    mine = (
        select(func.count())
        .select_from(text("pg_stat_activity"))
        .where(text("application_name = :name").bindparams(name=LISTENING), text("pid <> pg_backend_pid()"))
    )
    thread = threading.Thread(target=lambda: store.claim_next("w", ttl=TTL, wait=1.5))
    thread.start()
    time.sleep(0.5)  # it listens now
    with engine.connect() as conn:
        assert conn.execute(mine).scalar_one() >= 1
        [(_, announced)] = conn.execute(
            store._ctx.by_database.enqueue_announcing_postgresql, {"job_id": "b"}
        ).all()
        assert announced is True
        conn.rollback()
    thread.join(30.0)


def test_an_enqueue_that_found_no_listener_spares_the_next_ones_the_look() -> None:
    announcer = Announcer()
    assert announcer.asks()
    assert announcer.heard([("a", None)]) and not announcer.asks()
    assert not announcer.heard([])  # the job existed: nothing learned
    assert not announcer.asks()
    time.sleep(FRESH)
    assert announcer.asks()
    assert announcer.heard([("b", True)]) and announcer.asks()  # someone listens: every enqueue notifies


@pytest.mark.backend("sqlite")
def test_other_commits_to_the_file_wake_a_sqlite_waiter_but_it_claims_only_what_is_due(
    engine: Engine, slow_looks: None
) -> None:
    store = JobStore(engine, jobs_table(MetaData(), "watched_jobs"))
    other = JobStore(engine, jobs_table(MetaData(), "other_jobs"))
    other.create_table()
    claims = []
    claim_now = store._claim_now

    def counted(*args: Any) -> Any:
        claims.append(time.monotonic())
        return claim_now(*args)

    store._claim_now = counted  # type: ignore[method-assign]
    thread, got = _waiting_claim(store)
    looked = len(claims)  # the first claim, and the one after it began to listen
    for i in range(20):  # commits to the same file, none of them a job of its table
        other.enqueue(f"elsewhere-{i}")
        time.sleep(0.02)
    assert len(claims) == looked  # woken each time (the file changed), it read, and did not claim
    other.enqueue("deferred", ready_at=time.time() + 3600)
    store.enqueue("mine", ready_at=time.time() + 3600)  # its table, but not due
    time.sleep(0.2)
    assert len(claims) == looked
    _enqueue_in_another_process(engine, "watched_jobs", "due")
    thread.join(30.0)
    assert [lease.job_id for lease in got[0]] == ["due"]
    assert len(claims) == looked + 1
