"""Elections under faults: candidates in processes, leaders frozen, killed, revoked, cut off.

Four candidate processes run a :class:`fencing.Election` on one name, with the ownership
history on. The leader writes a row under its term every 10 ms through ``Locks.fenced``,
stamped with the database's clock inside the transaction. Meanwhile the test injects, at
random (seeded): ``SIGSTOP`` of the leader past its ttl then ``SIGCONT`` (it wakes believing
it leads), ``SIGKILL`` of a candidate (restarted), an operator's revoke of the name, and on
the servers the end of every session of the database (``pg_terminate_backend``, ``KILL``):
what splits an advisory-lock election.

The verdict, from the database alone:

1. no term is issued twice: the history's claims of the name have strictly increasing fences;
2. no write under a term is stored after a newer term's write: the rows, in the order they
   were stored, never go back in term;
3. the intervals of leadership never overlap: every write under term ``t`` was made before
   any term above ``t`` was claimed (on the database's clock), and while ``t`` was the
   holder's lease, live.
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
from fencing.core.clock import database_now
from tests import backends
from tests.processes import reap

pytestmark = [pytest.mark.slow, pytest.mark.sync_only("candidates are processes of their own")]

CANDIDATES = 4
TTL = 0.6
RETRY = 0.05
#: the fault phase; the ``election_soak`` nox session runs it longer (outside CI)
SECONDS = float(os.environ.get("FENCING_ELECTION_TORTURE_SECONDS", "8"))
NAME = "torture-leader"


def tables() -> tuple[MetaData, Table, Table, Table]:
    metadata = MetaData()
    writes = Table(
        "torture_writes",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("term", BigInteger, nullable=False),
        Column("owner", String(32), nullable=False),
        Column("at", Double, nullable=False),
    )
    return (
        metadata,
        writes,
        locks_table(metadata, "torture_locks"),
        history_table(metadata, "torture_history"),
    )


def candidate(target: str, me: str, front: str, problems: Any) -> None:
    """One candidate: campaign, and while leading write under the term every 10 ms."""
    try:
        if front == "async":
            asyncio.run(async_candidate(target, me))
            return
        _, writes, locks_t, history_t = tables()
        engine = backends.engine_for(target)
        locks = Locks(engine, locks_t, history=History(history_t, retention=None))
        with Election(locks, NAME, me, ttl=TTL, retry=RETRY, interval=TTL / 4) as election:
            while True:
                lease = election.lease
                if lease is not None:
                    try:
                        with locks.fenced(lease) as conn:
                            conn.execute(
                                writes.insert().values(term=lease.fence, owner=me, at=database_now())
                            )
                    except (LeaseLost, fencing.DatabaseError, DBAPIError):
                        # deposed, or its session was ended (the store's statement or the
                        # block's own INSERT): nothing of the block was kept; it goes on
                        pass
                time.sleep(0.01)
    except BaseException:
        problems.put(f"{me}: {traceback.format_exc()}")
        raise


async def async_candidate(target: str, me: str) -> None:
    """The same candidate on the async front: AsyncLocks, AsyncElection, an asyncio task."""
    from fencing.asyncio import AsyncElection, AsyncLocks

    _, writes, locks_t, history_t = tables()
    engine = backends.async_engine_for(target)
    locks = AsyncLocks(engine, locks_t, history=History(history_t, retention=None))
    async with AsyncElection(locks, NAME, me, ttl=TTL, retry=RETRY, interval=TTL / 4) as election:
        while True:
            lease = election.lease
            if lease is not None:
                try:
                    async with locks.fenced(lease) as conn:
                        await conn.execute(
                            writes.insert().values(term=lease.fence, owner=me, at=database_now())
                        )
                except (LeaseLost, fencing.DatabaseError, DBAPIError):
                    pass
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("front", ["sync", "async"])
def test_elections_under_faults_never_have_two_leaders_in_the_data(
    engine: Engine, target: str, front: str
) -> None:
    metadata, writes, locks_t, history_t = tables()
    metadata.create_all(engine)
    locks = Locks(engine, locks_t, history=History(history_t, retention=None))
    ctx = multiprocessing.get_context("spawn")
    problems = ctx.Queue()
    names = [f"c{i}" for i in range(CANDIDATES)]

    def spawn(name: str) -> Any:
        proc = ctx.Process(target=candidate, args=(target, name, front, problems), daemon=True)
        proc.start()
        return proc

    procs = {name: spawn(name) for name in names}
    rng = random.Random(int(os.environ.get("FENCING_TORTURE_SEED", "7")))
    done: dict[str, int] = {"stop": 0, "kill": 0, "revoke": 0, "sessions": 0}
    kinds = ["stop", "kill", "revoke"] + (["sessions"] if "://" in target else [])
    try:
        _wait_for_a_write(engine, writes, 60.0)  # every candidate up, a leader elected
        ends = time.monotonic() + SECONDS
        schedule: list[str] = []
        while time.monotonic() < ends:
            time.sleep(rng.uniform(0.1, 0.4))
            if not schedule:  # every kind once per round, in a random order
                schedule = rng.sample(kinds, len(kinds))
            kind = schedule.pop()
            holder = locks.holder(NAME)
            if kind == "stop" and holder is not None:
                proc = procs[holder.owner]
                os.kill(proc.pid, signal.SIGSTOP)  # frozen past its ttl: it wakes believing it leads
                time.sleep(TTL * rng.uniform(1.2, 1.6))
                os.kill(proc.pid, signal.SIGCONT)
            elif kind == "kill":
                victim = rng.choice(names)
                procs[victim].kill()
                procs[victim].join(10)
                procs[victim] = spawn(victim)
            elif kind == "revoke":
                locks.revoke(NAME)
            elif kind == "sessions":
                backends.end_other_sessions(target)
            else:
                continue
            done[kind] += 1
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
        rows = conn.execute(select(writes.c.term, writes.c.owner, writes.c.at).order_by(writes.c.id)).all()
    assert rows, "no leader wrote anything"
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
    print(f"{front}: faults {done}; {len(claims)} terms; {len(rows)} writes; 0 violations")


def _wait_for_a_write(engine: Engine, writes: Table, timeout: float) -> None:
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        with engine.connect() as conn:
            if conn.execute(select(writes.c.id).limit(1)).first() is not None:
                return
        time.sleep(0.05)
    raise AssertionError(f"no leader wrote within {timeout} s")
