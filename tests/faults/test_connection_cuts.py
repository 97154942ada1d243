"""A connection lost at any point of a write: the caller is told which of three things happened.

Every writing operation runs through :class:`tests.cutting_proxy.CuttingProxy`, which cuts its
connection at one message of what the client sends (before it reaches the server, half of
it, or all of it with the server's answer lost): at the point the test aims at (the write
statement, the COMMIT or, where a statement commits itself, the message that ends it), and at
points drawn from a seed (``FENCING_CUT_SEED``). Whatever the point, the call

* returns its answer, and the database shows exactly what the answer says, done once;
* or raises :class:`~fencing.DatabaseUnavailable`, and the database shows nothing changed;
* or raises :class:`~fencing.OutcomeUnknown`, and the database shows all of the operation or
  none of it, never half; a COMMIT the server ran while the client never heard of it is
  always this, never tried again: a claim cut so never becomes a second fence.

Never a driver's or SQLAlchemy's error, never a plain :class:`~fencing.DatabaseError`. The
history (one variant records it) changes in the same transaction as the jobs, and holds each
(job, fence) claimed once. Both fronts: the sync store on psycopg and pymysql, the async one
on asyncpg and asyncmy. Servers only: SQLite has no network.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Engine,
    MetaData,
    String,
    Table,
    create_engine,
    delete,
    insert,
    make_url,
    select,
)

from fencing import (
    DatabaseUnavailable,
    History,
    JobStore,
    Lease,
    Locks,
    OutcomeUnknown,
    history_table,
    jobs_table,
    locks_table,
)
from fencing.asyncio import AsyncJobStore, AsyncLocks
from tests import backends
from tests.cutting_proxy import HOWS, Cut, CuttingProxy

pytestmark = [
    pytest.mark.sync_only("drives both fronts itself, each on its own driver"),
    pytest.mark.backend("postgresql", "mysql", "mariadb"),  # SQLite has no connection to cut
]

SEED = int(os.environ.get("FENCING_CUT_SEED", "25"))
#: cuts at random points per operation and front (besides the aimed ones)
RANDOM_CUTS = 10

#: the async front's driver, per dialect; asyncpg prepares each statement afresh, so an
#: operation sends the same messages whatever its connection prepared before
ASYNC_URLS = {"postgresql": ("postgresql+asyncpg", {"prepared_statement_cache_size": "0"})}


# -- the fronts ----------------------------------------------------------------------------


class Front:
    """One front (sync or async) on the proxied URL: its store and locks, and a way to run
    an operation of either to its answer."""

    store: Any
    locks: Any
    name: str

    def run(self, operation: Callable[[Front], Any]) -> Any:
        raise NotImplementedError

    def checked_out(self) -> int:
        raise NotImplementedError

    def empty(self) -> None:
        """Close the pool's connections: the next operation connects first."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SyncFront(Front):
    def __init__(self, url: str, tables: Tables, history: History | None) -> None:
        # psycopg prepares nothing (its 5th run of a statement would send other messages);
        # pymysql makes no TLS context for a server that offers none (50 ms a connection)
        connect_args = {"prepare_threshold": None} if url.startswith("postgresql") else {"ssl_disabled": True}
        self.name = "sync" if history is None else "sync+history"
        self.engine = create_engine(url, connect_args=connect_args)
        self.store = JobStore(self.engine, tables.jobs, history=history)
        self.locks = Locks(self.engine, tables.locks)

    def run(self, operation: Callable[[Front], Any]) -> Any:
        return operation(self)

    def checked_out(self) -> int:
        return self.engine.pool.checkedout()  # type: ignore[attr-defined, no-any-return]

    def empty(self) -> None:
        self.engine.dispose()

    def close(self) -> None:
        self.engine.dispose()


class AsyncFront(Front):
    def __init__(self, url: str, tables: Tables) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        parsed = make_url(url)
        driver, query = ASYNC_URLS.get(parsed.get_backend_name(), ("mysql+asyncmy", {}))
        self.name = "async"
        self.loop = asyncio.new_event_loop()
        self.engine = create_async_engine(parsed.set(drivername=driver).update_query_dict(query))
        self.store = AsyncJobStore(self.engine, tables.jobs)
        self.locks = AsyncLocks(self.engine, tables.locks)

    def run(self, operation: Callable[[Front], Any]) -> Any:
        async def main() -> Any:
            answer = operation(self)
            return await answer if inspect.isawaitable(answer) else answer

        return self.loop.run_until_complete(main())

    def checked_out(self) -> int:
        return self.engine.sync_engine.pool.checkedout()  # type: ignore[attr-defined, no-any-return]

    def empty(self) -> None:
        self.loop.run_until_complete(self.engine.dispose())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.dispose())
        self.loop.close()


# -- the database as the test sees it (never through the proxy) ----------------------------


@dataclass
class Tables:
    metadata: MetaData = field(default_factory=MetaData)

    def __post_init__(self) -> None:
        self.jobs = jobs_table(self.metadata, "cut_jobs")
        self.locks = locks_table(self.metadata, "cut_locks")
        self.history = history_table(self.metadata, "cut_history")
        #: the application's own writes in fenced blocks
        self.writes = Table("cut_writes", self.metadata, Column("job", String(64), primary_key=True))


Snapshot = dict[tuple[str, str], tuple[Any, ...]]


def snapshot(engine: Engine, tables: Tables) -> Snapshot:
    """Every row of the jobs, locks and writes tables, by (table, key)."""
    rows: Snapshot = {}
    with engine.connect() as conn:
        for table in (tables.jobs, tables.locks, tables.writes):
            for row in conn.execute(select(table)):
                values = tuple(_text(v) for v in row)
                rows[(table.name, values[0])] = values
    return rows


def _text(value: Any) -> Any:
    """A value as the store gives it back (MariaDB's keys are UTF-8 bytes in their column)."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


@dataclass
class Row:
    """One job's (or lock's) row, by name."""

    owner: str | None
    until: float
    fence: int
    result: str | None
    done: int

    @classmethod
    def of(cls, values: tuple[Any, ...] | None) -> Row | None:
        if values is None:
            return None
        _, owner, until, fence, result, done = values
        return cls(owner, float(until), int(fence), result, int(done))


class Change:
    """What one call changed: the rows that differ between two snapshots."""

    def __init__(self, before: Snapshot, after: Snapshot) -> None:
        self.keys = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        self.before = before
        self.after = after

    def old(self, key: tuple[str, str]) -> Row | None:
        return Row.of(self.before.get(key))

    def new(self, key: tuple[str, str]) -> Row | None:
        return Row.of(self.after.get(key))

    def claimed(self, key: tuple[str, str], owner: str = "w") -> bool:
        old, new = self.old(key), self.new(key)
        return (
            old is not None
            and new is not None
            and new.owner == owner
            and new.fence == old.fence + 1
            and not new.done
            and new.result == old.result
        )

    def claims(self, table: str = "cut_jobs") -> set[tuple[str, int]]:
        """(job, fence) of every row of ``table`` claimed by the call."""
        found = set()
        for key in self.keys:
            new = self.new(key)
            if key[0] == table and self.claimed(key) and new is not None:
                found.add((key[1], new.fence))
        return found


# -- the operations ------------------------------------------------------------------------


@dataclass
class Setup:
    """What an operation runs on: its jobs' ids and the leases taken on them beforehand."""

    ids: list[str]
    leases: list[Lease]


def claimed(direct: JobStore, ids: list[str], count: int) -> list[Lease]:
    leases = []
    for job in ids[:count]:
        lease = direct.claim(job, "w", ttl=60.0)
        assert lease is not None
        leases.append(lease)
    return leases


@dataclass(frozen=True)
class Operation:
    """A writing operation: how many jobs it needs (``ready``; the first ``held`` of them
    claimed beforehand), how it is called, and what the database shows once it happened
    whole (``whole``) or was answered (``answered``: the answer matches the change)."""

    name: str
    ready: int
    held: int
    call: Callable[[Front, Setup], Any]
    whole: Callable[[Change, Setup], bool]
    answered: Callable[[Change, Setup, Any], bool]
    #: the write statement aimed at (bytes of its SQL)
    aim: bytes = b"UPDATE"
    #: on the locks table (a Locks operation), not the jobs table
    locks: bool = False
    #: what a claim may answer once a cut fired: a connection lost before anything committed
    #: is tried again once on a fresh one (as a dead idle connection is), and the cut
    #: session's row locks may linger on the server until it reads the end of the stream, so
    #: SKIP LOCKED passes those rows over: fewer jobs (none, even), as the answer says
    after_cut: Callable[[Change, Setup, Any], bool] | None = None

    def setup(self, direct: JobStore, direct_locks: Locks, trial: int) -> Setup:
        ids = [f"t{trial:05d}-{i}" for i in range(self.ready)]
        if self.locks:
            leases: list[Lease] = []
            for name in ids:
                lease = direct_locks.try_acquire(name, "w" if len(leases) < self.held else "x", ttl=60.0)
                assert lease is not None
                if len(leases) < self.held:
                    leases.append(lease)
                else:
                    assert direct_locks.release(lease)  # exists, free
            return Setup(ids, leases)
        for job in ids:
            assert direct.enqueue(job, ready_at=0.0)
        return Setup(ids, claimed(direct, ids, self.held))


def _key(setup: Setup, i: int = 0, table: str = "cut_jobs") -> tuple[str, str]:
    return (table, setup.ids[i])


def _leases_match(change: Change, leases: list[Lease], table: str = "cut_jobs") -> bool:
    if {(lease.job_id, lease.fence) for lease in leases} != change.claims(table):
        return False
    return all(_until_is(change, (table, lease.job_id), lease.until) for lease in leases)


def _until_is(change: Change, key: tuple[str, str], until: float | None) -> bool:
    new = change.new(key)
    return new is not None and until is not None and abs(new.until - until) < 1e-3


def _only(change: Change, *keys: tuple[str, str]) -> bool:
    return change.keys == set(keys)


def _done(change: Change, key: tuple[str, str], result: str) -> bool:
    old, new = change.old(key), change.new(key)
    return (
        old is not None
        and new is not None
        and bool(new.done)
        and new.result == result
        and new.fence == old.fence
        and new.owner == old.owner
    )


def _renewed(change: Change, key: tuple[str, str]) -> bool:
    old, new = change.old(key), change.new(key)
    return (
        old is not None
        and new is not None
        and new.until > old.until
        and (new.owner, new.fence, new.done, new.result) == (old.owner, old.fence, old.done, old.result)
    )


def _freed(change: Change, key: tuple[str, str], fence_step: int) -> bool:
    old, new = change.old(key), change.new(key)
    return (
        old is not None
        and new is not None
        and new.owner is None
        and new.until == 0
        and new.fence == old.fence + fence_step
        and not new.done
    )


def _claimed_n(change: Change, n: int, table: str = "cut_jobs") -> bool:
    return len(change.claims(table)) == n and len(change.keys) == n


def _fenced(complete: bool) -> Callable[[Front, Setup], Any]:
    def call(front: Front, setup: Setup) -> Any:
        lease = setup.leases[0]
        writes = front.store.table.metadata.tables["cut_writes"]
        if isinstance(front, AsyncFront):

            async def block() -> None:
                async with front.store.fenced(lease, complete=complete, result="r") as conn:
                    await conn.execute(insert(writes).values(job=lease.job_id))

            return block()
        with front.store.fenced(lease, complete=complete, result="r") as conn:
            conn.execute(insert(writes).values(job=lease.job_id))
        return None

    return call


def _fenced_whole(complete: bool) -> Callable[[Change, Setup], bool]:
    def whole(change: Change, setup: Setup) -> bool:
        wrote = ("cut_writes", setup.ids[0])
        if not complete:
            return _only(change, wrote)
        return _only(change, wrote, _key(setup)) and _done(change, _key(setup), "r")

    return whole


OPERATIONS = [
    Operation(
        "claim",
        1,
        0,
        lambda f, s: f.store.claim(s.ids[0], "w", ttl=60.0),
        lambda c, s: _claimed_n(c, 1) and c.claimed(_key(s)),
        lambda c, s, a: a is not None and _leases_match(c, [a]),
    ),
    Operation(
        "claim_next",
        3,
        0,
        lambda f, s: f.store.claim_next("w", ttl=60.0),
        lambda c, s: _claimed_n(c, 1),
        lambda c, s, a: len(a) == 1 and _leases_match(c, a),
        after_cut=lambda c, s, a: len(a) <= 1 and _claimed_n(c, len(a)) and _leases_match(c, a),
    ),
    Operation(
        "claim_next(3)",
        5,
        0,
        lambda f, s: f.store.claim_next("w", ttl=60.0, limit=3),
        lambda c, s: _claimed_n(c, 3),
        lambda c, s, a: len(a) == 3 and _leases_match(c, a),
        after_cut=lambda c, s, a: len(a) <= 3 and _claimed_n(c, len(a)) and _leases_match(c, a),
    ),
    Operation(
        "renew",
        1,
        1,
        lambda f, s: f.store.renew(s.leases[0], ttl=120.0),
        lambda c, s: _only(c, _key(s)) and _renewed(c, _key(s)),
        lambda c, s, a: isinstance(a, Lease) and _until_is(c, _key(s), a.until),
    ),
    Operation(
        "complete",
        1,
        1,
        lambda f, s: f.store.complete(s.leases[0], "r"),
        lambda c, s: _only(c, _key(s)) and _done(c, _key(s), "r"),
        lambda c, s, a: a is True,
    ),
    Operation(
        "complete_many",
        3,
        3,
        lambda f, s: f.store.complete_many([(lease, "r") for lease in s.leases]),
        lambda c, s: (
            _only(c, *(_key(s, i) for i in range(3))) and all(_done(c, _key(s, i), "r") for i in range(3))
        ),
        lambda c, s, a: a == [True, True, True],
    ),
    Operation(
        "complete_and_claim_next(2)",
        4,
        1,
        lambda f, s: f.store.complete_and_claim_next([(s.leases[0], "r")], "w", ttl=60.0, limit=2),
        lambda c, s: (
            _done(c, _key(s), "r") and len(c.claims()) == 2 and len(c.keys) == 3 and _key(s) in c.keys
        ),
        lambda c, s, a: a[0] == [True] and len(a[1]) == 2 and _leases_match(c, a[1]),
    ),
    Operation(
        "fenced",
        1,
        1,
        _fenced(False),
        _fenced_whole(False),
        lambda c, s, a: True,
        aim=b"INSERT",
    ),
    Operation(
        "fenced(complete)",
        1,
        1,
        _fenced(True),
        _fenced_whole(True),
        lambda c, s, a: True,
        aim=b"INSERT",
    ),
    Operation(
        "release",
        1,
        1,
        lambda f, s: f.store.release(s.leases[0]),
        lambda c, s: _only(c, _key(s)) and _freed(c, _key(s), 0),
        lambda c, s, a: a is True,
    ),
    Operation(
        "revoke",
        1,
        1,
        lambda f, s: f.store.revoke(s.ids[0]),
        lambda c, s: _only(c, _key(s)) and _freed(c, _key(s), 1),
        lambda c, s, a: a is True,
    ),
    Operation(
        "locks.try_acquire",
        1,
        0,
        lambda f, s: f.locks.try_acquire(s.ids[0], "w", ttl=60.0),
        lambda c, s: _claimed_n(c, 1, "cut_locks"),
        lambda c, s, a: a is not None and _leases_match(c, [a], "cut_locks"),
        locks=True,
    ),
    Operation(
        "locks.release",
        1,
        1,
        lambda f, s: f.locks.release(s.leases[0]),
        lambda c, s: _only(c, _key(s, 0, "cut_locks")) and _freed(c, _key(s, 0, "cut_locks"), 0),
        lambda c, s, a: a is True,
        locks=True,
    ),
]


# -- the harness ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What the cuts of one operation did: outcome by how the connection was cut."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    unknown_and_whole: int = 0

    def line(self) -> str:
        return ", ".join(f"{how}/{kind}: {n}" for (how, kind), n in sorted(self.outcomes.items()))


class Bench:
    """The proxy, a front through it, and a direct way to the same tables (setup, checks)."""

    def __init__(self, target: str, proxy: CuttingProxy, front: str) -> None:
        self.tables = Tables()
        self.direct_engine = backends.engine_for(target)
        history = (
            History(self.tables.history, retention=None, renewals=True) if front == "sync+history" else None
        )
        self.history = history
        self.direct = JobStore(self.direct_engine, self.tables.jobs, history=history)
        self.direct_locks = Locks(self.direct_engine, self.tables.locks)
        self.direct.create_table()
        self.direct_locks.create_table()
        self.tables.metadata.create_all(self.direct_engine, tables=[self.tables.writes, self.tables.history])
        url = make_url(target).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        self.front: Front = (
            AsyncFront(url, self.tables) if front == "async" else SyncFront(url, self.tables, history)
        )
        self.proxy = proxy
        self.trial = 0
        #: the previous call's connection was cut: the pool makes a new one
        self.replaced = True

    def close(self) -> None:
        self.front.close()
        self.direct_engine.dispose()

    def clear(self) -> None:
        """Forget the previous trial's rows (never a fence of this trial's ids)."""
        with self.direct_engine.begin() as conn:
            for table in (self.tables.jobs, self.tables.locks, self.tables.writes):
                conn.execute(delete(table))

    def history_rows(self) -> list[tuple[Any, ...]]:
        h = self.tables.history
        with self.direct_engine.connect() as conn:
            return [
                tuple(r) for r in conn.execute(select(h.c.job_id, h.c.event, h.c.fence).order_by(h.c.seq))
            ]

    def attempt(
        self, op: Operation, cut: Cut | None, *, cold: bool = False
    ) -> tuple[str, Any, Change, Setup, Any]:
        """Run ``op`` once on fresh jobs with ``cut`` armed: how it ended, its answer or error,
        what it changed, its setup and the cut made (if one was). ``cold``: the pool is empty,
        so the operation connects first (the cut's messages count from the handshake)."""
        self.trial += 1
        self.clear()
        if self.replaced and not cold:
            # the pool's connection is a new one: the operation once uncut on it, so that what
            # a driver learns on a connection's first use (asyncpg's type introspection) is
            # not sent again under the cut, and the operation sends what its uncut run did
            warm = op.setup(self.direct, self.direct_locks, -self.trial)
            self.front.run(lambda f: op.call(f, warm))
            self.clear()
        setup = op.setup(self.direct, self.direct_locks, self.trial)
        before = snapshot(self.direct_engine, self.tables)
        history_before = len(self.history_rows()) if self.history is not None else 0
        if cold:
            self.front.empty()
        else:  # a live pooled connection, so the operation's messages are its own (no handshake)
            self.front.run(lambda f: f.store.state("nothing"))
        self.proxy.arm(cut)
        try:
            answer: Any = self.front.run(lambda f: op.call(f, setup))
            kind = "answered"
        except OutcomeUnknown as exc:
            answer, kind = exc, "unknown"
        except DatabaseUnavailable as exc:
            answer, kind = exc, "unavailable"
        except BaseException as exc:  # a raw driver error, a plain DatabaseError: a failure
            fired = self.proxy.disarm()
            raise AssertionError(
                f"{op.name} cut {fired}: {type(exc).__module__}.{type(exc).__name__}: {exc}"
            ) from exc
        fired = self.proxy.disarm()
        self.replaced = fired is not None
        self.proxy.settle()  # what the server got before the cut has run, or was rolled back
        change = Change(before, snapshot(self.direct_engine, self.tables))
        assert self.front.checked_out() == 0, "a connection was not given back"
        if self.history is not None:
            added = len(self.history_rows()) - history_before
            # the history is written in the same transaction as the change: both or neither
            assert (added > 0) == bool(change.keys), (op.name, fired, kind, added, change.keys)
        return kind, answer, change, setup, fired


def judge(op: Operation, kind: str, answer: Any, change: Change, setup: Setup, fired: Any) -> None:
    """The rule of the module's docstring, for one call."""
    what = f"{op.name}, cut {fired}: {kind} ({answer!r}); changed {sorted(change.keys)}"
    if kind == "answered":
        # every operation here changes its rows when it succeeds, once: as its answer says
        whole = op.whole(change, setup) and op.answered(change, setup, answer)
        # (a claim after a cut: fewer jobs, skipped while the cut session's locks lingered;
        # CI once saw MariaDB's answer [] so; an uncut run always takes them all)
        short = fired is not None and op.after_cut is not None and op.after_cut(change, setup, answer)
        assert whole or short, what
    elif kind == "unavailable":
        assert not change.keys, what
        assert fired is not None, what
    else:
        assert not change.keys or op.whole(change, setup), what
        assert fired is not None, what
        assert "the outcome is unknown" in str(answer)
    if kind != "answered":
        assert answer.__cause__ is not None, what  # the driver's error, kept


def cuts_for(
    op: Operation, messages: list[bytes], rng: random.Random, postgresql: bool
) -> list[tuple[Cut, bool]]:
    """The cuts tried on ``op``, whose uncut run sent ``messages``: each way at the write
    statement and at the end of the commit (aimed: True for the commit's end, forwarded
    whole), then at random points."""
    commits = [i for i, m in enumerate(messages, 1) if b"COMMIT" in m]
    # the message that makes the server run the COMMIT, or where a statement commits itself
    # (PostgreSQL's autocommit), the one that ends it: a Sync, a simple query, a MariaDB packet
    ends = [i for i, m in enumerate(messages, 1) if not postgresql or m[:1] in (b"S", b"Q")]
    end = min(i for i in ends if i >= commits[-1]) if commits else ends[-1]
    aimed = [(Cut(how, end), how == "after") for how in HOWS]
    writes = [i for i, m in enumerate(messages, 1) if op.aim in m]
    if writes:
        aimed += [(Cut(how, writes[0]), False) for how in HOWS]
    drawn = [(Cut.drawn(rng, len(messages)), False) for _ in range(RANDOM_CUTS)]
    return aimed + drawn


@pytest.fixture
def proxy(backend: backends.Backend, target: str) -> Iterator[CuttingProxy]:
    url = make_url(target)
    with CuttingProxy((url.host or "127.0.0.1", url.port or 5432), url.get_backend_name()) as p:
        yield p


#: each operation on each front; the locks record no history here
CASES = [
    pytest.param(op, front, id=f"{op.name}-{front}")
    for op in OPERATIONS
    for front in ("sync", "sync+history", "async")
    if not (op.locks and front == "sync+history")
]


@pytest.mark.parametrize(("op", "front"), CASES)
def test_a_cut_connection_leaves_each_write_whole_or_undone_and_says_which(
    target: str, proxy: CuttingProxy, op: Operation, front: str
) -> None:
    bench = Bench(target, proxy, front)
    tally = Tally()
    try:
        for _ in range(2):  # the second uncut run's messages: what every later one sends
            kind, answer, change, setup, fired = bench.attempt(op, None)
            assert kind == "answered" and fired is None
            judge(op, kind, answer, change, setup, fired)
        messages = list(proxy.messages)
        rng = random.Random(f"{SEED}:{make_url(target).get_backend_name()}:{front}:{op.name}")
        for cut, commits in cuts_for(op, messages, rng, proxy.protocol == "postgresql"):
            kind, answer, change, setup, fired = bench.attempt(op, cut)
            judge(op, kind, answer, change, setup, fired)
            tally.outcomes[(cut.how, kind if fired is not None else "not cut")] += 1
            if commits:
                # the server ran the COMMIT (or the statement that commits itself) and the
                # client never heard: unknown, and the write is there, once
                assert fired is not None and kind == "unknown" and change.keys, (op.name, cut, kind, answer)
                tally.unknown_and_whole += 1
        for at in (1, 2):
            # the connection lost while it is being made: nothing of the operation was sent
            # (unless the one lost was another's, such as the lookup of the server's identity
            # a fenced block makes first, which does without it)
            cut = Cut(rng.choice(HOWS), at, fresh=True)
            kind, answer, change, setup, fired = bench.attempt(op, cut, cold=True)
            judge(op, kind, answer, change, setup, fired)
            assert fired is not None and kind != "unknown", (op.name, cut, kind, answer)
            tally.outcomes[(cut.how, f"{kind} (connecting)")] += 1
        if bench.history is not None:
            claims = [(job, fence) for job, event, fence in bench.history_rows() if event == "claim"]
            assert len(claims) == len(set(claims)), claims  # no (job, fence) claimed twice
    finally:
        bench.close()
    assert tally.unknown_and_whole == 1, tally.line()
    # the points drawn are within what the operation sends: almost every one is cut
    assert sum(n for (_, kind), n in tally.outcomes.items() if kind == "not cut") <= RANDOM_CUTS // 3, (
        tally.line()
    )
    report = os.environ.get("FENCING_CUT_REPORT")
    if report:
        with open(report, "a") as out:
            out.write(f"{make_url(target).get_backend_name()} {front} {op.name}: {tally.line()}\n")
