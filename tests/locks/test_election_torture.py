"""Locks and elections under faults: holders in processes, frozen, killed, revoked, cut off.

Four candidate processes contend for one name, with the ownership history on, in one of two
modes: ``election`` (each runs a :class:`fencing.Election`; the leader writes under its term)
or ``lock`` (each loops on :meth:`fencing.Locks.hold`, waiting in the name's queue, writes a
few times under the lock's token, and lets go). A holder writes a row every 10 ms through a
fenced block, stamped with the database's clock inside the transaction, and keeps the block
open 20 ms after its INSERT. Meanwhile the test injects, at random (seeded): ``SIGSTOP`` of
the holder past its ttl then ``SIGCONT`` (it wakes believing it holds), ``SIGKILL`` of a
candidate (restarted), ``SIGKILL`` of the holder *inside* its fenced transaction (after its
INSERT, before its COMMIT), an operator's revoke of the name, and on the servers the end of
every session of the database (``pg_terminate_backend``, ``KILL``): what splits an
advisory-lock election.

The verdict, from the database alone:

1. no term (token) is issued twice: the history's claims of the name have strictly
   increasing fences;
2. no write under a term is stored after a newer term's write: the rows, in the order they
   were stored, never go back in term;
3. the intervals of holding never overlap: every write under term ``t`` was made by its
   holder, after ``t`` was claimed and before any term above ``t`` was claimed (on the
   database's clock);
4. nothing of a transaction killed before its commit is stored;
5. (``lock`` mode) no candidate starves: every one of them held the lock (by the end of a
   calm of :data:`CALM` seconds after the faults, so that one restarted late has its turn).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time
import traceback
from typing import Any

import pytest
from sqlalchemy import BigInteger, Column, Double, Engine, Integer, MetaData, String, Table, select
from sqlalchemy.exc import DBAPIError

import fencing
from fencing import Election, History, LeaseLost, Locks, history_table, locks_table
from fencing._sql.clock import database_now
from tests import backends
from tests.processes import reap

pytestmark = [pytest.mark.slow, pytest.mark.sync_only("candidates are processes of their own")]

CANDIDATES = 4
TTL = 0.6
RETRY = 0.05
#: a lock's waiters pause at most this long between looks at the lock
POLL = 0.1
#: the writes a lock holder makes before it lets go
WRITES_PER_HOLD = 5
#: how long a holder keeps its fenced transaction open after its INSERT
IN_BLOCK = 0.02
#: the fault phase; the ``election_soak`` nox session runs it longer (outside CI)
SECONDS = float(os.environ.get("FENCING_ELECTION_TORTURE_SECONDS", "8"))
NAME = "torture-leader"
#: lock mode: seconds without faults after the fault phase, before the verdict, and at most
#: how long the calm goes on until every candidate has held the lock once (a waiter's turn
#: comes, however late it was restarted; one that never comes fails the verdict)
CALM = 3.0
CALM_AT_MOST = 30.0
#: what a candidate's fenced block raises when it is deposed or its session was ended (the
#: store's statement or the block's own INSERT): nothing of the block was kept; it goes on
REFUSED = (LeaseLost, fencing.DatabaseError, DBAPIError)


def tables() -> tuple[MetaData, Table, Table, Table]:
    metadata = MetaData()
    writes = Table(
        "torture_writes",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("term", BigInteger, nullable=False),
        Column("owner", String(32), nullable=False),
        Column("tag", String(64), nullable=False),
        Column("at", Double, nullable=False),
    )
    return (
        metadata,
        writes,
        locks_table(metadata, "torture_locks"),
        history_table(metadata, "torture_history"),
    )


class Shared:
    """What the controller shares with one candidate (across its restarts): whether it is
    inside its fenced block, past its INSERT (``inside``), and that INSERT's tag."""

    def __init__(self, ctx: Any) -> None:
        self.inside = ctx.Value("i", 0)
        self.tag = ctx.Array("c", 64)


class Writer:
    """A holder's fenced write: a tagged row under the term, the transaction kept open
    :data:`IN_BLOCK` seconds after the INSERT with ``inside`` set, so that the controller's
    kill lands between the INSERT and the COMMIT (it kills only while holding ``inside``'s
    lock and seeing it set; the block clears it, under that lock, before it commits)."""

    def __init__(self, writes: Table, me: str, shared: Shared) -> None:
        self.writes, self.me, self.shared, self.n = writes, me, shared, 0

    def row(self, term: int) -> Any:
        self.n += 1
        tag = f"{self.me}-{os.getpid()}-{self.n}"
        self._tag = tag
        return self.writes.insert().values(term=term, owner=self.me, tag=tag, at=database_now())

    def enter(self) -> None:
        with self.shared.inside.get_lock():
            self.shared.tag.value = self._tag.encode()
            self.shared.inside.value = 1

    def leave(self) -> None:
        with self.shared.inside.get_lock():
            self.shared.inside.value = 0


def candidate(target: str, me: str, front: str, mode: str, shared: Shared, problems: Any) -> None:
    """One candidate: campaign (or wait for the lock), and while holding write every 10 ms."""
    try:
        if front == "async":
            asyncio.run(async_candidate(target, me, mode, shared))
            return
        _, writes, locks_t, history_t = tables()
        engine = backends.engine_for(target)
        locks = Locks(engine, locks_t, history=History(history_t, retention=None), poll=POLL)
        writer = Writer(writes, me, shared)

        def write(lease: fencing.Lease) -> None:
            try:
                with locks.fenced(lease) as conn:
                    conn.execute(writer.row(lease.fence))
                    writer.enter()
                    time.sleep(IN_BLOCK)
                    writer.leave()
            except REFUSED:
                pass

        if mode == "lock":
            while True:
                try:
                    with locks.hold(NAME, me, ttl=TTL, timeout=None, interval=TTL / 4) as held:
                        for _ in range(WRITES_PER_HOLD):
                            if not held.held:
                                break
                            write(held.lease)
                            time.sleep(0.01)
                except REFUSED:
                    # its session was ended while it waited or let go, or the lock was taken
                    # from it before its block began (hold raises LeaseLost): it waits anew
                    pass
        with Election(locks, NAME, me, ttl=TTL, retry=RETRY, interval=TTL / 4) as election:
            while True:
                lease = election.lease
                if lease is not None:
                    write(lease)
                time.sleep(0.01)
    except BaseException:
        problems.put(f"{me}: {traceback.format_exc()}")
        raise


async def async_candidate(target: str, me: str, mode: str, shared: Shared) -> None:
    """The same candidate on the async front: AsyncLocks, AsyncElection, asyncio tasks."""
    from fencing.asyncio import AsyncElection, AsyncLocks

    _, writes, locks_t, history_t = tables()
    engine = backends.async_engine_for(target)
    locks = AsyncLocks(engine, locks_t, history=History(history_t, retention=None), poll=POLL)
    writer = Writer(writes, me, shared)

    async def write(lease: fencing.Lease) -> None:
        try:
            async with locks.fenced(lease) as conn:
                await conn.execute(writer.row(lease.fence))
                writer.enter()
                await asyncio.sleep(IN_BLOCK)
                writer.leave()
        except REFUSED:
            pass

    if mode == "lock":
        while True:
            try:
                async with locks.hold(NAME, me, ttl=TTL, timeout=None, interval=TTL / 4) as held:
                    for _ in range(WRITES_PER_HOLD):
                        if not held.held:
                            break
                        await write(held.lease)
                        await asyncio.sleep(0.01)
            except REFUSED:
                pass  # as the sync candidate: its session ended, or the lock taken from it
    async with AsyncElection(locks, NAME, me, ttl=TTL, retry=RETRY, interval=TTL / 4) as election:
        while True:
            lease = election.lease
            if lease is not None:
                await write(lease)
            await asyncio.sleep(0.01)


def kill_inside_transaction(proc: Any, shared: Shared, timeout: float) -> str | None:
    """SIGKILL ``proc`` between its INSERT and its COMMIT: the tag of the write that must not
    be stored, or ``None`` if it did not enter a block within ``timeout``."""
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        with shared.inside.get_lock():
            if shared.inside.value:
                os.kill(proc.pid, signal.SIGKILL)
                shared.inside.value = 0
                return str(shared.tag.value.decode())
        time.sleep(0.001)
    return None


def _every_one_held(locks: Locks, names: list[str]) -> bool:
    """Whether each of ``names`` has held the lock at least once (its history's claims)."""
    return {e.owner for e in locks.store.history(NAME) if e.event == "claim"} >= set(names)


@pytest.mark.parametrize("front", ["sync", "async"])
@pytest.mark.parametrize("mode", ["election", "lock"])
def test_holders_under_faults_never_overlap_in_the_data(
    engine: Engine, target: str, front: str, mode: str
) -> None:
    metadata, writes, locks_t, history_t = tables()
    metadata.create_all(engine)
    locks = Locks(engine, locks_t, history=History(history_t, retention=None))
    locks.create_table()  # and its waiters' queue
    ctx = multiprocessing.get_context("spawn")
    problems = ctx.Queue()
    names = [f"c{i}" for i in range(CANDIDATES)]
    shared = {name: Shared(ctx) for name in names}

    def spawn(name: str) -> Any:
        args = (target, name, front, mode, shared[name], problems)
        proc = ctx.Process(target=candidate, args=args, daemon=True)
        proc.start()
        return proc

    procs = {name: spawn(name) for name in names}
    rng = random.Random(int(os.environ.get("FENCING_TORTURE_SEED", "7")))
    done: dict[str, int] = {"stop": 0, "kill": 0, "kill-in-transaction": 0, "revoke": 0, "sessions": 0}
    kinds = ["stop", "kill", "kill-in-transaction", "revoke"] + (["sessions"] if "://" in target else [])
    killed_tags: list[str] = []
    try:
        _wait_for_a_write(engine, writes, 60.0)  # every candidate up, a holder writing
        ends = time.monotonic() + SECONDS
        schedule: list[str] = []
        # the phase, then as long again at most until each kind was injected once: a loaded
        # machine's holder once let every kill-in-transaction of a phase find it between blocks
        while (now := time.monotonic()) < ends or (
            not all(done[kind] for kind in kinds) and now < ends + SECONDS
        ):
            time.sleep(rng.uniform(0.1, 0.4))
            if not schedule:  # every kind once per round, in a random order
                schedule = rng.sample(kinds, len(kinds))
            kind = schedule.pop()
            holder = locks.holder(NAME)
            if kind == "stop" and holder is not None:
                proc = procs[holder.owner]
                os.kill(proc.pid, signal.SIGSTOP)  # frozen past its ttl: it wakes believing it holds
                time.sleep(TTL * rng.uniform(1.2, 1.6))
                os.kill(proc.pid, signal.SIGCONT)
            elif kind == "kill":
                victim = rng.choice(names)
                procs[victim].kill()
                procs[victim].join(10)
                procs[victim] = spawn(victim)
            elif kind == "kill-in-transaction" and holder is not None:
                tag = kill_inside_transaction(procs[holder.owner], shared[holder.owner], 2.0)
                if tag is None:
                    continue  # it did not write within 2 s (lost, or not started yet)
                killed_tags.append(tag)
                procs[holder.owner].join(10)
                procs[holder.owner] = spawn(holder.owner)
            elif kind == "revoke":
                locks.revoke(NAME)
            elif kind == "sessions":
                backends.end_other_sessions(target)
            else:
                continue
            done[kind] += 1
        if mode == "lock":
            # no faults: the candidates restarted last take their turns too (on a loaded
            # machine a candidate respawned late in the phase may need more than CALM)
            time.sleep(CALM)
            calm_ends = time.monotonic() + CALM_AT_MOST
            while time.monotonic() < calm_ends and not _every_one_held(locks, names):
                time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        reap(procs.values(), 30)
    reported = []
    while not problems.empty():
        reported.append(problems.get())
    assert not [p for p in reported if "KeyboardInterrupt" not in p], "\n".join(reported)
    assert all(done[kind] for kind in kinds), done

    entries = locks.store.history(NAME)
    claims = [e for e in entries if e.event == "claim"]
    fences = [e.fence for e in claims]
    assert len(claims) >= 3, "too few terms to judge anything"
    # 1. no term issued twice
    assert fences == sorted(set(fences)), f"a term was issued twice or out of order: {fences}"
    with engine.connect() as conn:
        rows = conn.execute(
            select(writes.c.term, writes.c.owner, writes.c.tag, writes.c.at).order_by(writes.c.id)
        ).all()
    assert rows, "no holder wrote anything"
    # 2. never back in term, in the order the writes were stored
    terms = [row.term for row in rows]
    assert terms == sorted(terms), "a write under an older term was stored after a newer term's"
    # 3. no overlap: each write under its term's live lease, before any newer term was claimed
    claimed = {e.fence: e for e in claims}
    for row in rows:
        claim = claimed[row.term]
        assert claim.owner == row.owner, f"{row} written by another than its term's holder {claim}"
        assert claim.at <= row.at, f"{row} before its term was claimed {claim}"
        later = [e for e in claims if e.fence > row.term]
        assert all(e.at >= row.at for e in later), f"{row} after a newer term was claimed"
    # 4. a transaction killed between its INSERT and its COMMIT left nothing
    stored = {row.tag for row in rows}
    assert not stored & set(killed_tags), f"killed before commit, yet stored: {stored & set(killed_tags)}"
    # 5. no candidate starved (a lock's waiters take their turns)
    holders = {e.owner for e in claims}
    if mode == "lock":
        assert holders == set(names), f"only {sorted(holders)} ever held the lock"
    print(
        f"{mode}/{front}: faults {done}; {len(claims)} terms by {len(holders)} holders; "
        f"{len(rows)} writes; 0 violations"
    )


def _wait_for_a_write(engine: Engine, writes: Table, timeout: float) -> None:
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        with engine.connect() as conn:
            if conn.execute(select(writes.c.id).limit(1)).first() is not None:
                return
        time.sleep(0.05)
    raise AssertionError(f"no leader wrote within {timeout} s")
