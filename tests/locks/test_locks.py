"""Named locks: one holder at a time, tokens that only go up, writes fenced by the token.

The ``locks`` fixture is a :class:`fencing.Locks` and (``async``) an
:class:`fencing.asyncio.AsyncLocks` driven from the test body, on every backend.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, func, insert, select

from fencing import (
    ConfigurationError,
    Election,
    History,
    InvalidArgument,
    InvalidArgumentType,
    Lease,
    LeaseLost,
    Locks,
    LockTimeout,
    history_table,
    locks_table,
)
from tests import asyncfront, backends
from tests.processes import reap

TTL = 60.0


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def locks(request: pytest.FixtureRequest, engine: Engine, target: str) -> Iterator[Any]:
    """Locks on a fresh database whose locks table exists and is empty."""
    if request.param == asyncfront.ASYNC:
        from fencing.asyncio import AsyncLocks

        loop = asyncio.new_event_loop()
        async_engine = backends.async_engine_for(target)
        try:
            front = asyncfront.BlockingAsyncLocks(AsyncLocks(async_engine), loop)
            front.create_table()
            request.node._fencing_loop = loop  # type: ignore[attr-defined]  # the body runs on it
            yield front
        finally:
            asyncfront.dispose(async_engine, loop)
            loop.close()
        return
    sync = Locks(engine)
    sync.create_table()
    yield sync


def rows_of(engine: Engine, table: Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


# -- one holder, tokens up ---------------------------------------------------------------------


def test_a_lock_is_held_by_one_owner_at_a_time(locks: Any) -> None:
    first = locks.try_acquire("nightly", "a", ttl=TTL)
    assert first is not None and (first.job_id, first.owner, first.fence) == ("nightly", "a", 1)
    assert locks.try_acquire("nightly", "b", ttl=TTL) is None
    assert locks.try_acquire("nightly", "a", ttl=TTL) is None  # not re-entrant: renew instead
    other = locks.try_acquire("weekly", "b", ttl=TTL)  # another name is another lock
    assert other is not None and other.fence == 1
    holder = locks.holder("nightly")
    assert holder is not None and (holder.owner, holder.fence) == ("a", 1)
    assert holder.until == pytest.approx(first.until)


def test_a_released_lock_is_taken_at_once_with_a_higher_token(locks: Any) -> None:
    first = locks.try_acquire("nightly", "a", ttl=TTL)
    assert first is not None
    assert locks.release(first) is True
    assert locks.holder("nightly") is None
    assert not locks.release(first)  # it held nothing any more
    second = locks.try_acquire("nightly", "b", ttl=TTL)
    assert second is not None and second.fence == 2
    assert not locks.renew(first, ttl=TTL)  # the old token never holds it again


def test_an_expired_lock_goes_to_the_next_owner_and_the_old_holder_is_refused(locks: Any) -> None:
    first = locks.try_acquire("nightly", "a", ttl=10.0, now=100.0)
    assert first is not None and first.until == 110.0
    assert locks.try_acquire("nightly", "b", ttl=10.0, now=109.999) is None
    second = locks.try_acquire("nightly", "b", ttl=10.0, now=110.0)  # until == now: expired
    assert second is not None and second.fence == 2
    assert not locks.renew(first, ttl=10.0, now=110.0)
    with pytest.raises(LeaseLost):
        locks.check(first, now=110.0)
    with pytest.raises(LeaseLost), locks.fenced(first, now=110.0):
        pass


def test_a_deleted_name_never_hands_out_a_token_again(locks: Any) -> None:
    lease = locks.try_acquire("nightly", "a", ttl=TTL)
    assert lease is not None and lease.fence == 1
    assert locks.delete("nightly") is True
    assert locks.holder("nightly") is None
    assert not locks.renew(lease, ttl=TTL)
    again = locks.try_acquire("nightly", "a", ttl=TTL)
    assert again is not None and again.fence == 2
    assert locks.delete("never-taken") is False


def test_revoke_frees_the_lock_and_refuses_its_holder(locks: Any) -> None:
    lease = locks.try_acquire("nightly", "a", ttl=TTL)
    assert lease is not None
    assert locks.revoke("nightly") is True
    assert locks.holder("nightly") is None
    with pytest.raises(LeaseLost) as lost:
        locks.check(lease)
    assert lost.value.reason == "stale fence"
    taken = locks.try_acquire("nightly", "b", ttl=TTL)
    assert taken is not None and taken.fence == 3  # the revoke took a token of its own
    assert locks.revoke("never-taken") is False


def test_acquire_gives_up_at_its_timeout(locks: Any) -> None:
    assert locks.try_acquire("nightly", "a", ttl=TTL) is not None
    started = time.monotonic()
    assert locks.acquire("nightly", "b", ttl=TTL, timeout=0.2) is None
    assert time.monotonic() - started >= 0.2
    assert locks.acquire("nightly", "b", ttl=TTL) is None  # timeout 0: one try


def test_writes_under_a_lock_are_fenced_by_its_token(locks: Any, engine: Engine) -> None:
    metadata = MetaData()
    billed = Table("billed", metadata, Column("token", Integer))
    metadata.create_all(engine)
    first = locks.try_acquire("billing", "a", ttl=10.0, now=100.0)
    assert first is not None
    with locks.fenced(first, now=101.0) as conn:
        conn.execute(insert(billed).values(token=first.fence))
    second = locks.try_acquire("billing", "b", ttl=10.0, now=200.0)  # a's lease ran out
    assert second is not None
    with pytest.raises(LeaseLost), locks.fenced(first, now=201.0) as conn:
        conn.execute(insert(billed).values(token=first.fence))  # a woke up: refused
    with locks.fenced(second, now=201.0) as conn:
        conn.execute(insert(billed).values(token=second.fence))
    with engine.connect() as conn:
        assert [row.token for row in conn.execute(select(billed.c.token))] == [1, 2]


# -- bad input: a named error, nothing changed ---------------------------------------------------


BAD_NAMES = [
    ("", InvalidArgument),
    ("x" * 100_000, InvalidArgument),
    ("a\x00b", InvalidArgument),
    ("\udcff", InvalidArgument),
    (b"nightly", InvalidArgumentType),
    (None, InvalidArgumentType),
    (7, InvalidArgumentType),
]


@pytest.mark.parametrize(("name", "error"), BAD_NAMES, ids=[f"name{i}" for i in range(len(BAD_NAMES))])
def test_a_bad_name_is_refused_by_every_operation_and_changes_nothing(
    locks: Any, engine: Engine, name: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="name"):
        locks.try_acquire(name, "a", ttl=TTL)
    with pytest.raises(error, match="name"):
        locks.acquire(name, "a", ttl=TTL, timeout=1.0)
    with pytest.raises(error, match="name"):
        locks.holder(name)
    with pytest.raises(error, match="name"):
        locks.revoke(name)
    with pytest.raises(error, match="name"):
        locks.delete(name)
    assert rows_of(engine, locks.table) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "word"),
    [
        ({"ttl": 0}, InvalidArgument, "ttl"),
        ({"ttl": -1.0}, InvalidArgument, "ttl"),
        ({"ttl": math.nan}, InvalidArgument, "ttl"),
        ({"ttl": "30"}, InvalidArgumentType, "ttl"),
        ({"ttl": TTL, "timeout": -1}, InvalidArgument, "timeout"),
        ({"ttl": TTL, "timeout": math.inf}, InvalidArgument, "timeout"),
        ({"ttl": TTL, "timeout": "1"}, InvalidArgumentType, "timeout"),
        ({"ttl": TTL, "now": 5.0}, InvalidArgumentType, "now"),
    ],
)
def test_bad_arguments_to_acquire_are_refused_and_change_nothing(
    locks: Any, engine: Engine, kwargs: dict[str, Any], error: type[Exception], word: str
) -> None:
    with pytest.raises(error, match=word):
        locks.acquire("nightly", "a", **kwargs)
    assert rows_of(engine, locks.table) == 0


@pytest.mark.parametrize("owner", [None, 3, b"a", "\udcff"])
def test_a_bad_owner_is_refused_and_changes_nothing(locks: Any, engine: Engine, owner: object) -> None:
    with pytest.raises((InvalidArgument, InvalidArgumentType), match="owner"):
        locks.try_acquire("nightly", owner, ttl=TTL)
    assert rows_of(engine, locks.table) == 0


# -- holding for a block (a thread keeps the lock) ------------------------------------------------


@pytest.fixture
def sync_locks(engine: Engine) -> Locks:
    made = Locks(engine, poll=0.05)
    made.create_table()
    return made


def test_acquire_takes_the_lock_as_soon_as_it_is_released(sync_locks: Locks) -> None:
    lease = sync_locks.try_acquire("nightly", "a", ttl=TTL)
    assert lease is not None
    releaser = threading.Timer(0.3, sync_locks.release, args=(lease,))
    releaser.start()
    started = time.monotonic()
    try:
        taken = sync_locks.acquire("nightly", "b", ttl=TTL, timeout=30.0)
    finally:
        releaser.join()
    waited = time.monotonic() - started
    assert taken is not None and taken.fence == 2
    assert 0.3 <= waited < 10.0  # soon after the release (a pause of at most poll), not at the timeout


def test_hold_keeps_the_lock_for_its_block_and_releases_it(sync_locks: Locks) -> None:
    # a ttl a loaded machine's stall (seen in CI: 2 s between renewals) does not outlast
    with sync_locks.hold("nightly", "a", ttl=3.0, interval=0.1) as lock:
        assert lock.held and lock.token == 1 and lock.name == "nightly"
        time.sleep(3.5)  # past one ttl: the heartbeat renewed it
        assert lock.held
        holder = sync_locks.holder("nightly")
        assert holder is not None and (holder.owner, holder.fence) == ("a", 1)
        with pytest.raises(LockTimeout) as busy, sync_locks.hold("nightly", "b", ttl=TTL, timeout=0.1):
            pass
        assert busy.value.holder is not None and busy.value.holder.owner == "a"
    assert sync_locks.holder("nightly") is None  # released at the block's end
    with sync_locks.hold("nightly", "b", ttl=TTL) as lock:
        assert lock.token == 2


def test_hold_tells_the_block_the_moment_the_lock_is_lost(sync_locks: Locks, engine: Engine) -> None:
    metadata = MetaData()
    writes = Table("writes", metadata, Column("n", Integer))
    metadata.create_all(engine)
    told: list[Any] = []
    with sync_locks.hold("nightly", "a", ttl=3.0, interval=0.05, on_lost=told.append) as lock:
        with lock.fenced() as conn:
            conn.execute(insert(writes).values(n=1))
        assert sync_locks.revoke("nightly")  # an operator takes it
        assert lock.lost.wait(5.0)
        assert not lock.held
        with pytest.raises(LeaseLost):
            lock.check()
        with pytest.raises(LeaseLost), lock.fenced() as conn:
            conn.execute(insert(writes).values(n=2))
    assert told == [lock]  # once, by the heartbeat's thread (joined when the block ended)
    with engine.connect() as conn:
        assert [row.n for row in conn.execute(select(writes.c.n))] == [1]


def test_try_acquire_joins_the_callers_transaction(sync_locks: Locks, engine: Engine) -> None:
    with engine.connect() as conn:
        lease = sync_locks.try_acquire("nightly", "a", ttl=TTL, conn=conn)
        assert lease is not None
        conn.rollback()  # the caller's transaction: the lock was never taken
    assert sync_locks.holder("nightly") is None


# -- leader election ------------------------------------------------------------------------------


def test_one_candidate_leads_and_hands_over_when_it_resigns(sync_locks: Locks, engine: Engine) -> None:
    metadata = MetaData()
    work = Table("leader_work", metadata, Column("term", Integer))
    metadata.create_all(engine)
    events: list[tuple[str, str, int | None]] = []

    def candidate(name: str) -> Election:
        return Election(
            sync_locks,
            "scheduler",
            name,
            ttl=2.0,
            retry=0.05,
            on_elected=lambda lease: events.append(("elected", name, lease.fence)),
            on_deposed=lambda lease, reason: events.append(("deposed", name, lease.fence)),
        )

    a, b = candidate("a"), candidate("b")
    with a, b:
        assert a.elected.wait(10.0) or b.elected.wait(10.0)
        leader, follower = (a, b) if a.is_leader else (b, a)
        assert not follower.is_leader
        first = leader.term
        assert first == 1
        with leader.fenced() as conn:
            conn.execute(insert(work).values(term=first))
        deposed_lease = leader.lease
        assert deposed_lease is not None
        leader.resign()  # hands over at once: the follower takes it at its next try
        assert follower.elected.wait(5.0)
        assert follower.term == 2
        assert follower.leader is not None and follower.leader.owner == follower.candidate
        with pytest.raises(LeaseLost):
            leader.fenced()  # it no longer leads
        with pytest.raises(LeaseLost), sync_locks.fenced(deposed_lease) as conn:
            conn.execute(insert(work).values(term=first))  # its old term is refused in the database
    assert ("elected", leader.candidate, 1) in events and ("elected", follower.candidate, 2) in events
    with engine.connect() as conn:
        assert [row.term for row in conn.execute(select(work.c.term))] == [1]


def test_a_deposed_leader_is_told_and_its_term_refused(sync_locks: Locks) -> None:
    deposed = threading.Event()
    with Election(
        sync_locks, "scheduler", "a", ttl=2.0, interval=0.05, retry=0.05, on_deposed=lambda *_: deposed.set()
    ) as election:
        assert election.elected.wait(10.0)
        lease = election.lease
        assert lease is not None and lease.fence == 1
        assert sync_locks.revoke("scheduler")  # its term is taken from it
        assert deposed.wait(5.0)
        with pytest.raises(LeaseLost):
            sync_locks.check(lease)
        assert election.elected.wait(5.0)  # it campaigned again: a new term
        assert election.term is not None and election.term > 2


def test_a_release_inside_the_locks_own_fenced_block_is_refused_at_once(locks: Any) -> None:
    # it would wait for the block's own row lock (SQLite: its write lock): refused, not hung
    with locks.hold("nightly", "a", ttl=TTL) as lock:
        started = time.monotonic()
        with pytest.raises(ConfigurationError, match="after the block"), locks.fenced(lock.lease):
            locks.release(lock.lease)
        assert time.monotonic() - started < 2.0
        assert lock.held
    assert locks.holder("nightly") is None  # released when the hold ended


def released_within(locks: Any, name: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while locks.holder(name) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_leader_that_stops_inside_its_own_fenced_block_steps_down_after_it(
    sync_locks: Locks, engine: Engine, target: str
) -> None:
    # stop() used to join the campaign, whose release waited for the block's own row lock:
    # PostgreSQL hung for ever, SQLite for its busy timeout, MariaDB retried its lock waits
    metadata = MetaData()
    work = Table("leader_work", metadata, Column("term", Integer))
    metadata.create_all(engine)
    election = Election(sync_locks, "scheduler", "a", ttl=30.0, retry=0.05).start()
    stopped_in: list[float] = []
    done = threading.Event()

    def step_down_from_inside() -> None:
        with election.fenced() as conn:
            conn.execute(insert(work).values(term=election.term))
            started = time.monotonic()
            election.stop()
            stopped_in.append(time.monotonic() - started)
            assert election.is_leader  # it leads until the block ends
        done.set()

    try:
        assert election.elected.wait(10.0)
        leader = threading.Thread(target=step_down_from_inside, daemon=True)
        leader.start()
        assert done.wait(10.0), "stop() inside the leader's own fenced block did not return"
        assert stopped_in[0] < 1.0
        assert released_within(sync_locks, "scheduler", 5.0), "the term was not released after the block"
        election.stop()  # outside the block: joins the campaign, which stepped down after it
        assert not election._thread.is_alive()  # type: ignore[union-attr]
        # (read after the join: the campaign releases the term, then says it no longer leads)
        assert not election.is_leader and not election.elected.is_set()
        with engine.connect() as conn:
            assert [row.term for row in conn.execute(select(work.c.term))] == [1]  # committed under it
    finally:
        if not done.is_set() and "://" in target:
            backends.end_other_sessions(target)  # the hung release's and the block's sessions
        election.stop()


@pytest.mark.sync_only("drives the async election from asyncio code of its own")
def test_an_async_leader_that_stops_inside_its_own_fenced_block_steps_down_after_it(
    target: str, engine: Engine
) -> None:
    from fencing.asyncio import AsyncElection, AsyncLocks

    metadata = MetaData()
    work = Table("leader_work", metadata, Column("term", Integer))
    metadata.create_all(engine)

    async def main() -> float:
        async_engine = backends.async_engine_for(target)
        try:
            locks = AsyncLocks(async_engine)
            await locks.create_table()
            election = AsyncElection(locks, "scheduler", "a", ttl=30.0, retry=0.05)
            async with election:
                await asyncio.wait_for(election.elected.wait(), 10.0)
                async with election.fenced() as conn:
                    await conn.execute(insert(work).values(term=election.term))
                    started = time.monotonic()
                    # wait_for: on Python 3.11 a task of its own, which the block's hold covers too
                    await asyncio.wait_for(election.stop(), 5.0)
                    took = time.monotonic() - started
                    assert election.is_leader
                deadline = time.monotonic() + 5.0
                while await locks.holder("scheduler") is not None:
                    assert time.monotonic() < deadline, "the term was not released after the block"
                    await asyncio.sleep(0.01)
                await asyncio.wait_for(election.stop(), 5.0)  # outside the block: awaits the campaign
                # (read after it: the campaign releases the term, then says it no longer leads)
                assert not election.is_leader and not election.elected.is_set()
            return took
        finally:
            await async_engine.dispose()

    assert asyncio.run(main()) < 1.0
    with engine.connect() as conn:
        assert [row.term for row in conn.execute(select(work.c.term))] == [1]


def test_an_election_refuses_bad_arguments(sync_locks: Locks) -> None:
    with pytest.raises(InvalidArgument, match="name"):
        Election(sync_locks, "", "a")
    with pytest.raises(InvalidArgumentType, match="candidate"):
        Election(sync_locks, "x", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="retry"):
        Election(sync_locks, "x", "a", ttl=1.0, retry=5.0)
    with pytest.raises(InvalidArgumentType, match="locks"):
        Election(object(), "x", "a")  # type: ignore[arg-type]


# -- processes contend: one holder at any instant of the database's clock ----------------------------

PROCESSES = 4
ROUNDS = 15


def _contend(target: str, name: str, rounds: int, barrier: Any, out: Any) -> None:
    problem = None
    taken: list[int] = []
    engine = backends.engine_for(target)
    try:
        metadata = MetaData()
        locks = Locks(engine, locks_table(metadata), history=History(history_table(metadata)))
        barrier.wait(timeout=60)
        for _ in range(rounds):
            lease = locks.acquire("the-lock", name, ttl=5.0, timeout=30.0)
            if lease is None:
                raise AssertionError(f"{name} never got the lock")
            taken.append(lease.fence)
            locks.release(lease)
    except BaseException:
        problem = traceback.format_exc()
        barrier.abort()
    finally:
        engine.dispose()
    out.put((name, taken, problem))


@pytest.mark.slow
def test_processes_contending_for_a_lock_never_hold_it_together(engine: Engine, target: str) -> None:
    metadata = MetaData()
    locks = Locks(engine, locks_table(metadata), history=History(history_table(metadata)))
    locks.create_table()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_contend, args=(target, f"p{i}", ROUNDS, barrier, out)) for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [out.get(timeout=300) for _ in procs]
    finally:
        reap(procs, 60)
    problems = [problem for _, _, problem in reports if problem]
    assert not problems, "\n".join(problems)
    tokens = sorted(token for _, taken, _ in reports for token in taken)
    assert tokens == list(range(1, PROCESSES * ROUNDS + 1)), "a token was handed out twice or skipped"
    # the history, in the order it was written: each claim at a higher token, and never while
    # the lease before it was live (released first, or past its until) on the database's clock
    entries = locks.store.history("the-lock")
    claims = [e for e in entries if e.event == "claim"]
    assert [e.fence for e in claims] == sorted(e.fence for e in claims)
    held: Lease | None = None
    for e in entries:
        if e.event == "claim":
            assert e.fence is not None and e.owner is not None and e.until is not None
            if held is not None:
                assert held.until is not None and e.at >= held.until, f"{e} while {held} was live"
            held = Lease(e.job_id, e.owner, e.fence, e.until)
        elif e.event == "release":
            assert held is not None and (e.owner, e.fence) == (held.owner, held.fence)
            held = None


# -- the waiters' queue: no waiter starves ------------------------------------------------------


def sync_of(locks: Any) -> Locks:
    """The sync locks behind a fixture's (the async front's rules are these)."""
    if isinstance(locks, Locks):
        return locks
    target = getattr(locks, "target", locks)  # a BlockingAsyncLocks wraps the AsyncLocks
    return target.sync_locks  # type: ignore[no-any-return]


def waiters_of(engine: Engine, locks: Any) -> int:
    return rows_of(engine, sync_of(locks).store.waiters)


def test_a_waiter_is_not_starved_by_an_owner_that_takes_the_lock_again_at_once(engine: Engine) -> None:
    """The classic starvation: a loop of short critical sections re-takes the lock the
    instant it releases it, while the waiter pauses between tries. Without the queue the
    loop goes on taking it (the waiter's looks nearly always meet a held lock); with it the
    loop's claims are refused once the waiter is queued, and the waiter takes the next turn."""
    sync_locks = Locks(engine, poll=0.5)
    sync_locks.create_table()
    stop = threading.Event()
    taken_by_loop: list[int] = []
    got: list[Lease | None] = []

    def greedy() -> None:
        while not stop.is_set():
            lease = sync_locks.try_acquire("hot", "greedy", ttl=TTL)
            if lease is not None:
                taken_by_loop.append(lease.fence)
                time.sleep(0.05)  # the critical section
                sync_locks.release(lease)  # ... and at once the next try

    loop = threading.Thread(target=greedy, daemon=True)
    patient = threading.Thread(
        target=lambda: got.append(sync_locks.acquire("hot", "patient", ttl=TTL, timeout=20.0)), daemon=True
    )
    loop.start()
    try:
        while not taken_by_loop:
            time.sleep(0.01)
        patient.start()
        deadline = time.monotonic() + 30
        while waiters_of(engine, sync_locks) == 0:
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.005)
        before_queued = len(taken_by_loop)
        patient.join(30)
    finally:
        stop.set()
        loop.join(10)
    lease = got[0]
    assert lease is not None, "the waiter starved while the loop took the lock again and again"
    claims_while_queued = lease.fence - 1 - before_queued
    assert claims_while_queued <= 2, (
        f"the loop cut in {claims_while_queued} times while the waiter was queued"
    )
    assert waiters_of(engine, sync_locks) == 0  # it left the queue


def test_waiters_take_the_lock_in_the_order_they_came(sync_locks: Locks) -> None:
    first = sync_locks.try_acquire("queue", "holder", ttl=TTL)
    assert first is not None
    order: list[str] = []
    problems: list[str] = []

    def wait(name: str) -> None:
        try:
            lease = sync_locks.acquire("queue", name, ttl=TTL, timeout=60.0)
            assert lease is not None
            order.append(name)
            time.sleep(0.05)
            sync_locks.release(lease)
        except BaseException:
            problems.append(traceback.format_exc())

    threads = []
    for i in range(4):
        thread = threading.Thread(target=wait, args=(f"w{i}",), daemon=True)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 30
        while waiters_of(sync_locks.engine, sync_locks) < i + 1:  # queued before the next starts
            assert time.monotonic() < deadline, "a waiter never queued"
            time.sleep(0.01)
    sync_locks.release(first)
    for thread in threads:
        thread.join(60)
    assert not problems, "\n".join(problems)
    assert order == ["w0", "w1", "w2", "w3"]
    assert waiters_of(sync_locks.engine, sync_locks) == 0


def test_a_queued_waiter_keeps_out_a_newcomer_until_its_ticket_lapses(locks: Any, engine: Engine) -> None:
    """A waiter that died leaves a ticket that blocks claims only until it lapses: at its
    ``until`` exactly it no longer counts (the boundary, on the caller's clock)."""
    sync = sync_of(locks)
    sync.store.enqueue("gate", ready_at=0.0)
    sync.queue.enter("gate", "ghost", keep=1.0, now=100.0)
    assert locks.try_acquire("gate", "newcomer", ttl=TTL, now=100.5) is None
    assert locks.try_acquire("gate", "newcomer", ttl=TTL, now=100.999) is None
    lease = locks.try_acquire("gate", "newcomer", ttl=TTL, now=101.0)
    assert lease is not None and lease.fence == 1


def test_a_refreshed_ticket_lives_on_and_a_lapsed_one_is_gone(locks: Any) -> None:
    sync = sync_of(locks)
    sync.store.enqueue("gate", ready_at=0.0)
    ticket = sync.queue.enter("gate", "waiter", keep=1.0, now=100.0)
    assert sync.queue.refresh(ticket, keep=1.0, now=100.9)  # now until 101.9
    assert locks.try_acquire("gate", "newcomer", ttl=TTL, now=101.5) is None
    assert not sync.queue.refresh(ticket, keep=1.0, now=101.9)  # lapsed at its until exactly
    assert locks.try_acquire("gate", "newcomer", ttl=TTL, now=101.9) is not None


def test_a_waiter_keeps_its_place_while_it_waits_longer_than_a_ticket_lives(engine: Engine) -> None:
    """A ticket lives ``keep`` seconds unrefreshed (1 s here); the waiter refreshes it while
    it waits, so 2.5 s on it is still ahead of a newcomer that tries the instant the lock
    is released."""
    sync_locks = Locks(engine, poll=0.05)
    sync_locks.create_table()
    assert sync_locks.keep == 1.0
    held = sync_locks.try_acquire("long", "holder", ttl=30.0)
    assert held is not None
    got: list[Lease | None] = []
    waiter = threading.Thread(
        target=lambda: got.append(sync_locks.acquire("long", "waiter", ttl=TTL, timeout=30.0)), daemon=True
    )
    waiter.start()
    time.sleep(2.5)
    assert sync_locks.release(held)
    assert sync_locks.try_acquire("long", "newcomer", ttl=TTL) is None
    waiter.join(30)
    assert got and got[0] is not None and got[0].owner == "waiter"


def test_a_waiter_that_gives_up_leaves_the_queue(locks: Any, engine: Engine) -> None:
    held = locks.try_acquire("busy", "holder", ttl=TTL)
    assert held is not None
    assert locks.acquire("busy", "waiter", ttl=TTL, timeout=0.2) is None
    assert waiters_of(engine, locks) == 0
    assert locks.release(held)
    after = locks.try_acquire("busy", "newcomer", ttl=TTL)  # nobody queued: no one to wait for
    assert after is not None and after.fence == 2


@pytest.mark.sync_only("drives the async locks from asyncio code of its own")
def test_a_cancelled_async_waiter_leaves_the_queue(target: str, engine: Engine) -> None:
    from fencing.asyncio import AsyncLocks

    async def main() -> None:
        async_engine = backends.async_engine_for(target)
        try:
            locks = AsyncLocks(async_engine, poll=0.05)
            await locks.create_table()
            held = await locks.try_acquire("busy", "holder", ttl=TTL)
            assert held is not None
            waiter = asyncio.create_task(locks.acquire("busy", "waiter", ttl=TTL, timeout=None))
            deadline = time.monotonic() + 30
            while waiters_of(engine, locks) == 0:
                assert time.monotonic() < deadline, "the waiter never queued"
                await asyncio.sleep(0.02)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert waiters_of(engine, locks) == 0
            await locks.release(held)
            assert await locks.try_acquire("busy", "newcomer", ttl=TTL) is not None
        finally:
            await async_engine.dispose()

    asyncio.run(main())


@pytest.mark.sync_only("drives the async locks from asyncio code of its own")
def test_a_waiter_cancelled_while_it_queues_leaves_the_queue(
    target: str, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancellation arrives while the waiter's ticket is being written: the write goes on
    to its end (the bridge never cuts a driver call), and the ticket it answered is taken out
    of the queue again, not left to lapse (other waiters would wait for it for keep seconds)."""
    from fencing._store.lock_queue import WaitQueue
    from fencing.asyncio import AsyncLocks

    waiting: list[asyncio.Task[Any]] = []
    enter = WaitQueue.enter

    def enter_then_cancelled(self: WaitQueue, *args: Any, **kwargs: Any) -> int:
        ticket = enter(self, *args, **kwargs)  # committed: the ticket is in the queue
        waiting[0].cancel()  # the caller is cancelled before the answer reaches it
        return ticket

    monkeypatch.setattr(WaitQueue, "enter", enter_then_cancelled)

    async def main() -> None:
        async_engine = backends.async_engine_for(target)
        try:
            locks = AsyncLocks(async_engine, poll=0.05)
            await locks.create_table()
            held = await locks.try_acquire("busy", "holder", ttl=TTL)
            assert held is not None
            waiting.append(asyncio.create_task(locks.acquire("busy", "waiter", ttl=TTL, timeout=None)))
            with pytest.raises(asyncio.CancelledError):
                await waiting[0]
            assert waiters_of(engine, locks) == 0
            await locks.release(held)
            assert await locks.try_acquire("busy", "newcomer", ttl=TTL) is not None
        finally:
            await async_engine.dispose()

    asyncio.run(main())


# -- the async front, on the loop ----------------------------------------------------------------


@pytest.mark.sync_only("drives the async locks from asyncio code of its own")
def test_async_waiters_take_turns_without_blocking_the_loop(target: str) -> None:
    from fencing.asyncio import AsyncLocks

    async def main() -> list[int]:
        engine = backends.async_engine_for(target)
        try:
            locks = AsyncLocks(engine, poll=0.05)
            await locks.create_table()
            tokens: list[int] = []
            inside = 0

            async def worker(name: str) -> None:
                nonlocal inside
                for _ in range(3):
                    async with locks.hold("shared", name, ttl=5.0, timeout=30.0) as lock:
                        inside += 1
                        assert inside == 1
                        tokens.append(lock.token)
                        await asyncio.sleep(0.01)  # the others' waits go on meanwhile
                        inside -= 1

            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            tick = asyncio.create_task(ticker())
            await asyncio.gather(*(worker(f"t{i}") for i in range(3)))
            tick.cancel()
            assert ticks > 5  # the loop ran while tasks waited for the lock
            return tokens
        finally:
            await engine.dispose()

    tokens = asyncio.run(main())
    assert tokens == list(range(1, 10))


@pytest.mark.sync_only("drives the async election from asyncio code of its own")
def test_async_candidates_elect_one_leader_and_hand_over_on_resign(target: str) -> None:
    from fencing.asyncio import AsyncElection, AsyncLocks

    async def main() -> list[tuple[str, str, int]]:
        engine = backends.async_engine_for(target)
        events: list[tuple[str, str, int]] = []
        try:
            locks = AsyncLocks(engine)
            await locks.create_table()

            async def elected(name: str, lease: Lease) -> None:  # a coroutine callback, awaited
                events.append(("elected", name, lease.fence))

            def candidate(name: str) -> AsyncElection:
                return AsyncElection(
                    locks,
                    "scheduler",
                    name,
                    ttl=2.0,
                    retry=0.05,
                    on_elected=lambda lease: elected(name, lease),
                    on_deposed=lambda lease, reason: events.append(("deposed", name, lease.fence)),
                )

            a, b = candidate("a"), candidate("b")
            async with a, b:
                await asyncio.wait_for(
                    asyncio.wait(
                        [asyncio.ensure_future(a.elected.wait()), asyncio.ensure_future(b.elected.wait())],
                        return_when=asyncio.FIRST_COMPLETED,
                    ),
                    10.0,
                )
                leader, follower = (a, b) if a.is_leader else (b, a)
                assert leader.term == 1 and not follower.is_leader
                old = leader.lease
                assert old is not None
                async with leader.fenced():
                    pass
                await leader.resign()
                await asyncio.wait_for(follower.elected.wait(), 5.0)
                assert follower.term == 2
                with pytest.raises(LeaseLost):
                    leader.fenced()
                with pytest.raises(LeaseLost):
                    async with locks.fenced(old):
                        pass
            return events
        finally:
            await engine.dispose()

    events = asyncio.run(main())
    assert [(kind, term) for kind, _, term in events if kind == "elected"] == [("elected", 1), ("elected", 2)]


def test_an_async_election_refuses_sync_locks(sync_locks: Locks) -> None:
    from fencing.asyncio import AsyncElection

    with pytest.raises(InvalidArgumentType, match="AsyncLocks"):
        AsyncElection(sync_locks, "scheduler", "a")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentType, match=r"fencing\.Locks"):
        Election(object(), "scheduler", "a")  # type: ignore[arg-type]


def test_a_lock_outlives_its_holders_session_ended_by_the_server(sync_locks: Locks, target: str) -> None:
    # what breaks advisory-lock elections: the server ends the holder's session (an idle cull,
    # pg_terminate_backend, a failover) and with it the lock, while the holder's process still
    # believes it holds it. Here the lock is a row: the holder's heartbeat renews it on a fresh
    # connection, nobody else can take it meanwhile, and its writes go on under its token
    if "://" not in target:
        pytest.skip("SQLite has no sessions a server could end")
    with sync_locks.hold("nightly", "a", ttl=3.0, interval=0.1) as lock:
        assert backends.end_other_sessions(target) >= 1  # the heartbeat's pooled connection too
        time.sleep(0.6)  # renewals after it, on new connections
        assert lock.held, lock
        assert sync_locks.try_acquire("nightly", "b", ttl=3.0) is None
        with lock.fenced():
            pass
        holder = sync_locks.holder("nightly")
        assert holder is not None and (holder.owner, holder.fence) == ("a", 1)
