"""The ownership history: one row per change of a lease, in the change's own transaction.

Each test runs on the database under test. The history answers "who held the job, with which
fence, and whose write was refused": every accepted write's lease is claimed before it, every
refused write is there with the holder and fence the guard saw, a rolled-back transaction
leaves no row, retention prunes old rows, and the jobs table is the contract's as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, bindparam, event, func, inspect, select
from sqlalchemy.orm import Session

from fencing import (
    ConfigurationError,
    Heartbeat,
    History,
    HistoryEntry,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    Lease,
    LeaseLost,
    history_table,
    holder_at,
    jobs_table,
)
from fencing._sql.clock import database_now
from fencing._sql.schema import KEY_TYPE, as_text
from fencing._store.history import PRUNE_BATCH
from tests import backends

pytestmark = pytest.mark.dialect

TTL = 30.0


def table_in(metadata: MetaData | None = None) -> Any:
    return history_table(metadata or MetaData())


@pytest.fixture
def recorded(engine: Engine) -> JobStore:
    """A store recording everything, renewals included, kept forever."""
    s = JobStore(engine, history=History(table_in(), retention=None, renewals=True))
    s.create_table()
    return s


def brief(entries: list[HistoryEntry]) -> list[tuple[Any, ...]]:
    """What a row says, without its instants."""
    return [(e.event, e.owner, e.fence, e.path, e.reason, e.holder, e.current_fence) for e in entries]


def test_every_change_of_a_lease_is_recorded_in_order(recorded: JobStore) -> None:
    s = recorded
    for job in ("a", "b", "c"):
        assert s.enqueue(job)
    a1 = s.claim("a", "w1", ttl=TTL)
    assert a1 is not None
    renewed = s.renew(a1, ttl=TTL)
    assert isinstance(renewed, Lease)
    assert s.complete(renewed, "r1")
    assert not s.complete(a1, "late")  # refused: done
    b1, c1 = sorted(s.claim_next("w2", ttl=TTL, limit=2), key=lambda lease: lease.job_id)
    assert [bool(v) for v in s.complete_many([(b1, "x"), (b1, "again")])] == [True, False]
    assert s.release(c1)
    c2 = s.claim("c", "w3", ttl=TTL)
    assert c2 is not None and s.release(c2, delay=0.001)
    assert s.delete("a")

    assert brief(s.history("a")) == [
        ("claim", "w1", 1, None, None, None, None),
        ("renew", "w1", 1, None, None, None, None),
        ("complete", "w1", 1, None, None, None, None),
        ("refused", "w1", 1, "complete", "done", "w1", 1),
        ("delete", None, 1, None, None, None, None),
    ]
    assert brief(s.history("b")) == [
        ("claim", "w2", 1, None, None, None, None),
        ("complete", "w2", 1, "complete_many", None, None, None),
        ("refused", "w2", 1, "complete_many", "done", "w2", 1),
    ]
    assert brief(s.history("c")) == [
        ("claim", "w2", 1, None, None, None, None),
        ("release", "w2", 1, None, None, None, None),
        ("claim", "w3", 2, None, None, None, None),
        ("release", "w3", 2, None, None, None, None),
    ]
    entries = s.history("a")
    assert [e.seq for e in entries] == sorted(e.seq for e in entries)
    assert entries[0].until == pytest.approx(a1.until) and entries[1].until == pytest.approx(renewed.until)
    assert all(math.isfinite(e.at) and abs(e.at - time.time()) < 60 for e in entries)


def test_revoke_records_the_new_fence_and_the_holders_late_write_its_reason(recorded: JobStore) -> None:
    s = recorded
    s.enqueue("j")
    lease = s.claim("j", "w1", ttl=TTL)
    assert lease is not None and s.revoke("j")
    assert not s.renew(lease, ttl=TTL)
    assert not s.release(lease)
    assert brief(s.history("j")) == [
        ("claim", "w1", 1, None, None, None, None),
        ("revoke", None, 2, None, None, None, None),
        ("refused", "w1", 1, "renew", "stale fence", None, 2),
        ("refused", "w1", 1, "release", "stale fence", None, 2),
    ]


def test_a_refused_write_carries_the_holder_who_took_over(recorded: JobStore) -> None:
    s = recorded
    s.enqueue("j", ready_at=0)
    old = s.claim("j", "stalled", ttl=10, now=1000.0)
    assert old is not None
    new = s.claim("j", "fresh", ttl=10, now=1010.0)  # the old lease ran out at 1010
    assert new is not None
    assert not s.complete(old, "stale", now=1011.0)
    *_, refused = s.history("j")
    assert (refused.event, refused.owner, refused.fence, refused.reason) == (
        "refused",
        "stalled",
        1,
        "stale fence",
    )
    assert (refused.holder, refused.current_fence, refused.at) == ("fresh", 2, 1011.0)
    # and who held the job at each instant, from the history alone
    entries = s.history("j")
    assert holder_at(entries, 999.0) is None
    first = holder_at(entries, 1005.0)
    assert first is not None and (first.owner, first.fence) == ("stalled", 1)
    second = holder_at(entries, 1012.0)
    assert second is not None and (second.owner, second.fence) == ("fresh", 2)


def test_the_history_row_commits_or_rolls_back_with_the_callers_transaction(
    recorded: JobStore, engine: Engine
) -> None:
    s = recorded
    s.enqueue("j")
    with engine.connect() as conn, conn.begin():
        assert s.claim("j", "w", ttl=TTL, conn=conn) is not None
        assert [e.event for e in s.history("j", conn=conn)] == ["claim"]
        conn.rollback()
    assert s.history("j") == [] and s.state("j").fence == 0  # type: ignore[union-attr]
    with engine.begin() as conn:
        lease = s.claim("j", "w", ttl=TTL, conn=conn)
    assert lease is not None and [e.event for e in s.history("j")] == ["claim"]


def test_a_fenced_block_records_its_commit_and_a_lost_block_its_refusal_after_the_rollback(
    recorded: JobStore, engine: Engine
) -> None:
    s = recorded
    for job in ("kept", "done", "lost", "joined"):
        s.enqueue(job, ready_at=0)
    kept = s.claim("kept", "w", ttl=TTL)
    assert kept is not None
    with s.fenced(kept):
        pass
    done = s.claim("done", "w", ttl=TTL)
    assert done is not None
    with s.fenced(done, complete=True, result="r"):
        pass
    assert brief(s.history("kept"))[1:] == [("fenced", "w", 1, "fenced", None, None, None)]
    assert brief(s.history("done"))[1:] == [("complete", "w", 1, "fenced", None, None, None)]

    # lost at the end: the caller's clock runs past the lease while the block runs
    lost = s.claim("lost", "w", ttl=10, now=1000.0)
    assert lost is not None
    with pytest.raises(LeaseLost) as caught, s.fenced(lost, now=1009.99, complete=True, result="x"):
        time.sleep(0.05)
    assert caught.value.reason == "expired"
    assert brief(s.history("lost"))[1:] == [("refused", "w", 1, "fenced", "expired", "w", 1)]
    assert s.state("lost").done == 0  # type: ignore[union-attr]

    # lost at the start, in the caller's transaction, which commits: the refusal is written in
    # a transaction of the store's own, once the caller's has ended
    joined = s.claim("joined", "w", ttl=TTL)
    assert joined is not None and s.revoke("joined")
    with engine.begin() as conn, pytest.raises(LeaseLost), s.fenced(joined, conn=conn):
        pass
    s._ctx.late.join(30)
    assert brief(s.history("joined"))[2:] == [("refused", "w", 1, "fenced", "stale fence", None, 2)]


@pytest.mark.parametrize("lost_at", ["start", "end"])
@pytest.mark.parametrize("caller", ["Connection", "Session"])
def test_a_joined_blocks_refusal_outlives_the_callers_rollback(
    recorded: JobStore, engine: Engine, lost_at: str, caller: str
) -> None:
    # the documented ORM pattern (docs/how-to/join-a-session.md): the LeaseLost rolls the
    # caller's transaction back, which took
    # the refusal written into it along (the metrics counted it, the history never showed it)
    s = recorded
    s.enqueue("j", ready_at=0)
    # on the caller's clock: a block entered at 1009.99 of a lease that ends at 1010 is lost
    # by its end check; a revoked one at its start
    lease = s.claim("j", "A", ttl=10, now=1000.0)
    assert lease is not None
    if lost_at == "start":
        assert s.revoke("j")
    with contextlib.ExitStack() as stack:
        if caller == "Session":
            session = stack.enter_context(Session(engine))
            stack.enter_context(session.begin())
            conn: Any = session
        else:
            conn = stack.enter_context(engine.begin())
        # the LeaseLost leaves the caller's transaction through its with-block: a rollback
        with (
            pytest.raises(LeaseLost) as caught,
            stack,
            s.fenced(lease, conn=conn, now=1009.99, complete=True, result="late"),
        ):
            time.sleep(0.05)
    assert caught.value.reason == ("stale fence" if lost_at == "start" else "expired")
    s._ctx.late.join(60)
    assert s.metrics.refused()
    history = brief(s.history("j"))
    assert history[0][:3] == ("claim", "A", 1)
    assert history[-1] == ("refused", "A", 1, "fenced", caught.value.reason, *history[-1][5:]), history
    assert s.state("j").result is None  # type: ignore[union-attr]


def test_every_claim_of_a_batch_is_recorded_with_its_own_lease(recorded: JobStore) -> None:
    s = recorded
    jobs = [f"j{i:03}" for i in range(150)]  # more than one INSERT chunk (128)
    for job in jobs:
        s.enqueue(job, ready_at=0)
    leases = s.claim_next("w", ttl=TTL, limit=150)
    assert len(leases) == 150
    accepted, more = s.complete_and_claim_next([(lease, "r") for lease in leases], "w", ttl=TTL)
    assert all(accepted) and more == []
    for lease in leases:
        assert [(e.event, e.owner, e.fence) for e in s.history(lease.job_id)] == [
            ("claim", "w", 1),
            ("complete", "w", 1),
        ]


def test_racing_threads_leave_a_history_where_every_write_follows_its_claim(recorded: JobStore) -> None:
    s = recorded
    jobs = [f"j{i}" for i in range(40)]
    for job in jobs:
        s.enqueue(job, ready_at=0)
    refused = []

    def work(me: str) -> None:
        while leases := s.claim_next(me, ttl=0.05, limit=2):
            time.sleep(0.03)  # sometimes past the lease: another worker takes the job over
            for lease, ok in zip(leases, s.complete_many([(le, me) for le in leases]), strict=True):
                if not ok:
                    refused.append(lease)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for job in jobs:
        entries = s.history(job)
        claims = {(e.owner, e.fence): e.seq for e in entries if e.event == "claim"}
        [done] = [e for e in entries if e.event == "complete"]
        assert claims.get((done.owner, done.fence), math.inf) < done.seq, entries
        state = s.state(job)
        assert state is not None and (state.owner, state.fence) == (done.owner, done.fence)
        for e in entries:
            if e.event == "refused":  # the holder and fence it names are a claim made before it
                assert claims.get((e.holder, e.current_fence), math.inf) < e.seq, entries
    for lease in refused:
        assert any(
            (e.event, e.owner, e.fence) == ("refused", lease.owner, lease.fence)
            for e in s.history(lease.job_id)
        )


def _old_rows(engine: Engine, table: Any, count: int, age: float) -> None:
    """``count`` history rows written ``age`` seconds ago on the database's clock."""
    with engine.connect() as conn:
        now = float(conn.execute(select(database_now())).scalar_one())
    keys = {f: bindparam(f, type_=KEY_TYPE) for f in ("job_id", "owner")}  # bytes on MariaDB
    with engine.begin() as conn:
        conn.execute(
            table.insert().values(**keys),
            [
                {
                    "job_id": f"old-{i}",
                    "event": "claim",
                    "owner": "w",
                    "fence": 1,
                    "until": 0.0,
                    "at": now - age,
                }
                for i in range(count)
            ],
        )


def _deletes_of(engine: Engine, table: Any) -> list[tuple[int, int]]:
    """Every DELETE of ``table`` from now on, as (thread ident, rows deleted)."""
    seen: list[tuple[int, int]] = []

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE") and table.name in statement:
            seen.append((threading.get_ident(), cursor.rowcount))

    event.listen(engine, "after_cursor_execute", after)
    return seen


def test_retention_prunes_rows_older_than_it_on_the_database_clock(engine: Engine) -> None:
    history = History(table_in(), retention=60.0)
    assert history.prune_every == 6.0
    s = JobStore(engine, history=history)
    s.create_table()
    _old_rows(engine, history.table, 3, age=120.0)
    _old_rows(engine, history.table, 1, age=30.0)
    s.enqueue("new", ready_at=0)  # the store's first write: a prune is due, and starts
    assert s.claim("new", "w", ttl=TTL) is not None
    s._ctx.pruner.join(30)
    with engine.connect() as conn:
        ages = (
            conn.execute(select(as_text(history.table.c.job_id)).order_by(history.table.c.seq))
            .scalars()
            .all()
        )
    assert ages == ["old-0", "new"]  # older than the retention on the database's clock: gone
    _old_rows(engine, history.table, 2, age=120.0)
    assert s.prune_history() == 2  # on demand (the next automatic one is 6 s away)
    keep_all = JobStore(engine, history=History(history.table, retention=None))
    _old_rows(engine, history.table, 2, age=120.0)
    assert keep_all.prune_history() == 0 and len(keep_all.history("old-1")) == 1


def test_a_due_prune_runs_off_the_callers_path_in_bounded_batches(engine: Engine) -> None:
    # with millions of old rows, the prune ran inside the claim that found it due: the claim
    # returned a lease already expired, and on SQLite every writer waited for the DELETE
    history = History(table_in(), retention=60.0)
    setup = JobStore(engine, history=History(history.table, retention=None))
    setup.create_table()
    _old_rows(engine, history.table, 2 * PRUNE_BATCH + 5, age=120.0)
    setup.enqueue("job", ready_at=0)
    deletes = _deletes_of(engine, history.table)
    s = JobStore(engine, history=history)  # a worker starting: its first write finds a prune due
    lease = s.claim("job", "w", ttl=TTL)
    assert lease is not None
    s._ctx.pruner.join(60)
    assert not s._ctx.pruner.running()
    caller = threading.get_ident()
    assert deletes, "no prune ran"
    assert all(thread != caller for thread, _ in deletes), "the prune ran on the caller's thread"
    assert [rows for _, rows in deletes] == [PRUNE_BATCH, PRUNE_BATCH, 5]  # one transaction each
    with engine.connect() as conn:
        left = conn.execute(
            select(as_text(history.table.c.job_id)).where(history.table.c.event == "claim")
        ).all()
    assert len(left) == 1  # only the new claim's row
    assert [e.event for e in s.history("job")] == ["claim"]


def test_a_write_on_the_callers_clock_is_refused_when_retention_prunes_on_the_databases(
    engine: Engine,
) -> None:
    # rows written at now=100.0 were compared with the database's clock and deleted at once,
    # silently, by the next prune of any store on the table
    history = History(table_in(), retention=7 * 86400.0)
    s = JobStore(engine, history=history)
    s.create_table()
    s.enqueue("j", ready_at=0)
    with pytest.raises(ConfigurationError, match="prunes rows older than 604800 s on the database's clock"):
        s.claim("j", "A", ttl=10.0, now=100.0)
    assert s.state("j").owner is None and s.history("j") == []  # refused before any statement
    lease = s.claim("j", "A", ttl=TTL)
    assert lease is not None
    for write in (
        lambda: s.renew(lease, ttl=TTL, now=time.time()),
        lambda: s.complete(lease, "r", now=time.time()),
        lambda: s.release(lease, now=time.time()),
        lambda: s.claim_next("B", ttl=TTL, now=time.time()),
    ):
        with pytest.raises(ConfigurationError, match="pass now=None"):
            write()
    s.check(lease, now=time.time())  # a read records nothing: any clock (LeaseLost if not current)
    assert s.poisoned(3, now=time.time()) == []
    assert [e.event for e in s.history("j")] == ["claim"]
    # a history kept whole takes either clock
    forever = JobStore(engine, history=History(history.table, retention=None))
    assert forever.complete(lease, "r", now=time.time())
    assert [e.event for e in forever.history("j")] == ["claim", "complete"]


def test_create_table_makes_the_history_table_and_leaves_the_jobs_table_as_the_contract_has_it(
    engine: Engine,
) -> None:
    metadata = MetaData()
    jobs = jobs_table(metadata)
    history = history_table(metadata)
    s = JobStore(engine, jobs, history=History(history))
    s.create_table()
    s.create_table()  # idempotent
    found = inspect(engine)
    assert [c["name"] for c in found.get_columns("jobs")] == [
        "id",
        "owner",
        "until",
        "fence",
        "result",
        "done",
    ]
    assert {c["name"] for c in found.get_columns("fencing_history")} == set(history.c.keys())
    assert {i["name"] for i in found.get_indexes("fencing_history")} >= {
        "ix_fencing_history_job",
        "ix_fencing_history_at",
    }
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(history)).scalar() == 0


@pytest.mark.parametrize(
    ("build", "error", "says"),
    [
        (lambda: History("fencing_history"), InvalidArgumentType, "must be a sqlalchemy Table"),  # type: ignore[arg-type]
        (lambda: History(jobs_table(MetaData())), InvalidArgument, "is not a history table"),
        (lambda: History(table_in(), retention=0), InvalidArgument, "retention must be a positive"),
        (lambda: History(table_in(), retention=-5.0), InvalidArgument, "retention must be a positive"),
        (
            lambda: History(table_in(), retention=float("nan")),
            InvalidArgument,
            "retention must be a positive",
        ),
        (
            lambda: History(table_in(), retention=float("inf")),
            InvalidArgument,
            "retention must be a positive",
        ),
        (lambda: History(table_in(), retention=True), InvalidArgument, "retention must be a positive"),
        (lambda: History(table_in(), retention="7d"), InvalidArgument, "retention must be a positive"),  # type: ignore[arg-type]
        (lambda: History(table_in(), renewals="yes"), InvalidArgumentType, "renewals must be a bool"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_history_setting_is_refused_with_what_was_wrong(build: Any, error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        build()


def test_a_store_without_history_says_so_and_bad_arguments_change_nothing(
    engine: Engine, recorded: JobStore
) -> None:
    with pytest.raises(
        InvalidArgumentType, match=r"history must be a fencing\.History \(around a history table\), got Table"
    ):
        JobStore(engine, history=table_in())  # type: ignore[arg-type]
    plain = JobStore(engine)
    with pytest.raises(ConfigurationError, match="records no history"):
        plain.history("j")
    with pytest.raises(ConfigurationError, match="records no history"):
        plain.prune_history()
    with pytest.raises(InvalidArgumentType):
        recorded.history(7)  # type: ignore[arg-type]
    recorded.enqueue("j")
    with pytest.raises(InvalidArgumentType):
        recorded.complete(Lease("j", "w", 1, 0.0), b"bytes")  # type: ignore[arg-type]
    assert recorded.history("j") == []


def test_holder_at_follows_claims_and_the_ends_of_leases() -> None:
    def e(seq: int, event: str, at: float, owner: str | None = "w", fence: int = 1) -> HistoryEntry:
        return HistoryEntry(seq, "j", event, owner, fence, at + 10, at)

    entries = [
        e(1, "claim", 100),
        e(2, "release", 105),
        e(3, "claim", 110, "v", 2),
        e(4, "complete", 115, "v", 2),
    ]
    assert holder_at(entries, 99) is None
    assert holder_at(entries, 100) == entries[0]
    assert holder_at(entries, 104.9) == entries[0]
    assert holder_at(entries, 105) is None
    assert holder_at(entries, 112) == entries[2]
    assert holder_at(entries, 200) is None
    assert holder_at([e(1, "claim", 100), e(2, "revoke", 101, None, 2)], 102) is None


def test_the_async_store_records_the_same_history(target: str) -> None:
    from fencing.asyncio import AsyncJobStore

    async def run() -> list[tuple[Any, ...]]:
        engine = backends.async_engine_for(target)
        try:
            s = AsyncJobStore(engine, history=History(table_in(), retention=None))
            await s.create_table()
            await s.enqueue("j")
            lease = await s.claim("j", "w", ttl=TTL)
            assert lease is not None and await s.complete(lease, "r")
            assert not await s.complete(lease, "again")
            assert await s.prune_history() == 0
            return brief(await s.history("j"))
        finally:
            await engine.dispose()

    assert asyncio.run(run()) == [
        ("claim", "w", 1, None, None, None, None),
        ("complete", "w", 1, None, None, None, None),
        ("refused", "w", 1, "complete", "done", "w", 1),
    ]


def test_the_async_store_prunes_in_a_task_of_its_loop_after_the_operation(
    engine: Engine, target: str
) -> None:
    from fencing.asyncio import AsyncJobStore

    history = History(table_in(), retention=60.0)
    setup = JobStore(engine, history=History(history.table, retention=None))
    setup.create_table()
    _old_rows(engine, history.table, PRUNE_BATCH + 1, age=120.0)
    setup.enqueue("job", ready_at=0)

    async def run() -> None:
        async_engine = backends.async_engine_for(target)
        try:
            s = AsyncJobStore(async_engine, history=history)
            pruner = s.sync_store._ctx.pruner
            assert await s.claim("job", "w", ttl=TTL) is not None
            task = pruner.task()
            assert task is not None, "no prune was started"
            await task  # a task of this loop, through the same bridge: two batches
            assert [e.event for e in await s.history("job")] == ["claim"]
        finally:
            await async_engine.dispose()

    asyncio.run(run())
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(history.table)).scalar_one() == 1


@pytest.mark.parametrize("renewals", [True, False])
def test_a_blocks_extension_of_its_lease_is_a_renewal_when_renewals_are_recorded(
    engine: Engine, renewals: bool
) -> None:
    s = JobStore(engine, history=History(table_in(), retention=None, renewals=renewals))
    s.create_table()
    s.enqueue("j")
    lease = s.claim("j", "w", ttl=TTL)
    assert lease is not None
    with Heartbeat(s, lease, ttl=TTL, interval=TTL / 2) as hb:  # its next renewal after the test
        with s.fenced(hb.lease):
            pass  # the block's first check extends the lease by the heartbeat's ttl
        row = s.state("j")
        assert row is not None and row.until > lease.until  # type: ignore[operator]
        hb.stop()
    entries = s.history("j")
    renewed = [e for e in entries if e.event == "renew"]
    if renewals:
        # the heartbeat's first renewal at its start, then the block's extension: the
        # history's lease ends where the row's does
        assert [e.event for e in entries] == ["claim", "renew", "renew", "fenced"]
        assert renewed[-1].until == row.until and renewed[-1].fence == lease.fence
    else:
        assert [e.event for e in entries] == ["claim", "fenced"]
