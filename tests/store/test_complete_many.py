"""complete_many: each completion judged on its own, in one transaction, with a constant
number of statements per batch on the servers. On every backend, both clocks."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from sqlalchemy import Engine, bindparam, event

from fencing import InvalidArgument, InvalidArgumentType, JobState, JobStore, Lease, Refusal
from fencing._sql.schema import KEY_TYPE
from fencing._sql.statements import COMPLETE_CHUNK

pytestmark = pytest.mark.dialect

T0 = 1_000.0
FENCE = 3

#: every way a completion can be judged, and whether it is accepted
KINDS = {
    "current": True,
    "stale_fence": False,  # the job was claimed again since: its fence moved on
    "expired": False,  # the lease ran out, nobody claimed the job since
    "at_until": False,  # until == now is expired (caller's clock only)
    "done": False,  # already completed
    "wrong_owner": False,  # the right fence, presented by another owner
    "missing": False,  # no such job
    "deleted": False,  # a tombstone
    "duplicate": True,  # the same lease twice: the first is accepted, the second refused
}


class Clock:
    """The instants a test needs, on the caller's clock or the database's (``now=None``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        base = T0 if name == "caller" else time.time()
        self.live_until = base + 3_600.0
        self.past_until = base - 3_600.0
        self.at = base
        self.now: float | None = T0 if name == "caller" else None


@pytest.fixture(params=["caller", "database"])
def clock(request: pytest.FixtureRequest) -> Clock:
    return Clock(request.param)


def kinds_for(clock: Clock) -> list[str]:
    # the database's clock cannot be made to stand exactly on a lease's until
    return [k for k in KINDS if clock.name == "caller" or k != "at_until"]


def build(
    store: JobStore, clock: Clock, n: int, kinds: list[str] | None = None
) -> tuple[list[tuple[Lease, str | None]], list[bool], list[str]]:
    """``n`` completions cycling through ``kinds`` (default: every kind), the rows they meet
    (written in one insert, exactly as the store's operations leave them), and the expected
    verdicts."""
    kinds = kinds or kinds_for(clock)
    rows: list[dict[str, Any]] = []
    items: list[tuple[Lease, str | None]] = []
    expected: list[bool] = []
    job_ids: list[str] = []
    for k in range(n):
        kind = kinds[k % len(kinds)]
        job = f"{kind}-{k:05d}"
        job_ids.append(job)
        lease = Lease(job, "w", FENCE)
        row = {"id": job, "owner": "w", "until": clock.live_until, "fence": FENCE, "result": None, "done": 0}
        if kind == "stale_fence":
            row.update(owner="other", fence=FENCE + 1)
        elif kind == "expired":
            row.update(until=clock.past_until)
        elif kind == "at_until":
            row.update(until=clock.at)
        elif kind == "done":
            row.update(done=1, result="earlier")
        elif kind == "wrong_owner":
            lease = Lease(job, "intruder", FENCE)
        elif kind == "deleted":
            row.update(owner=None, until=0.0, done=2)
        if kind != "missing":
            rows.append(row)
        items.append((lease, f"r-{k}"))
        expected.append(KINDS[kind])
        if kind == "duplicate":
            items.append((lease, f"again-{k}"))
            expected.append(False)
    if rows:
        insert_rows(store, rows)
    return items, expected, job_ids


def insert_rows(store: JobStore, rows: list[dict[str, Any]]) -> None:
    """Rows written directly, ids and owners as text (the columns are bytes on MariaDB/MySQL)."""
    t = store.table
    typed = t.insert().values(id=bindparam("id", type_=KEY_TYPE), owner=bindparam("owner", type_=KEY_TYPE))
    with store.engine.begin() as conn:
        conn.execute(typed, rows)


def snapshot(store: JobStore, job_ids: list[str]) -> dict[str, JobState | None]:
    return {job: store.state(job) for job in job_ids}


def check_outcome(
    store: JobStore,
    items: list[tuple[Lease, str | None]],
    verdicts: list[bool] | list[Literal[True] | Refusal],
    before: dict[str, JobState | None],
) -> None:
    """Accepted completions stored their result; everything else is exactly as it was."""
    accepted = {lease.job_id: result for (lease, result), ok in zip(items, verdicts, strict=True) if ok}
    for job, old in before.items():
        now = store.state(job)
        if job in accepted:
            assert old is not None and now is not None
            assert now == old._replace(result=accepted[job], done=True), job
        else:
            assert now == old, f"{job} changed although its completion was refused"


@pytest.mark.parametrize("n", [1, 2, 9, 100, COMPLETE_CHUNK + 476])
def test_each_completion_is_judged_on_its_own_in_input_order(store: JobStore, clock: Clock, n: int) -> None:
    items, expected, job_ids = build(store, clock, n)
    before = snapshot(store, job_ids)

    verdicts = store.complete_many(items, now=clock.now)

    assert [bool(v) for v in verdicts] == expected
    assert all(v is True or (isinstance(v, Refusal) and not v) for v in verdicts)
    check_outcome(store, items, verdicts, before)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_batch_of_one_of_each_kind(store: JobStore, kind: str) -> None:
    clock = Clock("caller")
    items, _, job_ids = build(store, clock, len(KINDS))
    k = list(KINDS).index(kind)
    mine = [item for item in items if item[0].job_id == job_ids[k]]
    before = snapshot(store, job_ids)

    verdicts = store.complete_many(mine, now=clock.now)

    assert [bool(v) for v in verdicts] == ([True, False] if kind == "duplicate" else [KINDS[kind]])
    check_outcome(store, mine, verdicts, before)


#: the jobs of the next test and the result each holds at its end
JOBS = {"current": "ok", "stale": "newer", "expired": None, "done": "earlier", "dup": "first"}


def test_operations_made_through_the_api_are_judged_on_the_database_clock(store: JobStore) -> None:
    for job in JOBS:
        store.enqueue(job, ready_at=0.0)  # ready for the caller clock an hour behind, too
    current = store.claim("current", "w", ttl=600.0)
    stale = store.claim("stale", "w", now=time.time() - 1_000.0, ttl=10.0)
    newer = store.claim("stale", "b", ttl=600.0)  # the stale lease expired by the server's clock
    expired = store.claim("expired", "w", now=time.time() - 1_000.0, ttl=10.0)
    done = store.claim("done", "w", ttl=600.0)
    dup = store.claim("dup", "w", ttl=600.0)
    assert None not in (current, stale, newer, expired, done, dup)
    assert store.complete(done, "earlier")  # type: ignore[arg-type]
    missing = Lease("never-enqueued", "w", 1)
    items = [
        (dup, "first"),
        (current, "ok"),
        (stale, "late"),
        (expired, "late"),
        (done, "again"),
        (missing, "x"),
        (dup, "second"),
        (newer, "newer"),
    ]

    verdicts = store.complete_many(items)  # type: ignore[arg-type]

    assert [bool(v) for v in verdicts] == [True, True, False, False, False, False, False, True]
    results = {job: state.result for job, state in snapshot(store, list(JOBS)).items() if state}
    assert results == JOBS
    assert store.state("expired").done is False  # type: ignore[union-attr]
    assert store.state("never-enqueued") is None


@pytest.mark.parametrize("order", ["stale_first", "current_first"])
def test_two_leases_of_one_job_only_the_current_one_is_accepted(store: JobStore, order: str) -> None:
    store.enqueue("j", ready_at=0.0)
    stale = store.claim("j", "a", now=T0, ttl=10.0)
    current = store.claim("j", "b", now=T0 + 20.0, ttl=10.0)
    assert stale is not None and current is not None
    items = [(stale, "stale"), (current, "current")]
    if order == "current_first":
        items.reverse()
    verdicts = store.complete_many(items, now=T0 + 25.0)
    assert [bool(v) for v in verdicts] == ([False, True] if order == "stale_first" else [True, False])
    assert store.state("j") == JobState("j", "b", T0 + 30.0, current.fence, "current", True)


@pytest.mark.parametrize("via", ["complete_many", "step"])
@pytest.mark.parametrize("order", ["refused_first", "current_first"])
def test_a_refused_item_is_judged_against_the_lease_it_met_not_the_job_the_batch_left_done(
    store: JobStore, order: str, via: str
) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "a", now=T0, ttl=10.0)
    assert lease is not None
    forged_fence = Lease("j", "a", lease.fence + 5)  # a fence never handed out
    forged_owner = Lease("j", "z", lease.fence)  # the current fence, another owner
    items = [(forged_fence, "f"), (forged_owner, "o"), (lease, "ok")]
    if order == "current_first":
        items = [items[2], items[0], items[1]]
    before = store.metrics.snapshot()
    if via == "step":
        verdicts, _ = store.complete_and_claim_next(items, "w", ttl=10.0, now=T0 + 5.0)
    else:
        verdicts = store.complete_many(items, now=T0 + 5.0)
    after = store.metrics.snapshot()
    refused = {
        key.removeprefix("complete_many.refused."): after[key] - before.get(key, 0)
        for key in after
        if key.startswith("complete_many.refused.") and after[key] != before.get(key, 0)
    }
    assert [bool(v) for v in verdicts] == (
        [False, False, True] if order == "refused_first" else [True, False, False]
    )
    # before the accepted item the forgeries met its live lease; after it, the job done
    assert refused == ({"stale fence": 1, "other owner": 1} if order == "refused_first" else {"done": 2})


def test_a_duplicate_of_a_refused_lease_is_refused_too(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "a", now=T0, ttl=10.0)
    assert lease is not None
    assert [bool(v) for v in store.complete_many([(lease, "x"), (lease, "y")], now=T0 + 10.0)] == [
        False,
        False,
    ]
    assert store.state("j") == JobState("j", "a", T0 + 10.0, lease.fence, None, False)


def test_fences_out_of_range_are_refused_without_a_statement(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "a", now=T0, ttl=10.0)
    assert lease is not None
    items = [(Lease("j", "a", 0), "zero"), (Lease("j", "a", -1), "neg"), (Lease("j", "a", 2**63), "huge")]
    assert [bool(v) for v in store.complete_many([*items, (lease, "ok")], now=T0)] == [
        False,
        False,
        False,
        True,
    ]
    assert store.state("j").result == "ok"  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [("not a lease", "r"), "not a pair", (Lease("j", "w", 1), 5)])
def test_an_invalid_item_at_the_end_of_a_large_batch_changes_nothing(
    store: JobStore, clock: Clock, bad: object
) -> None:
    items, _, job_ids = build(store, clock, COMPLETE_CHUNK + 10)
    before = snapshot(store, job_ids)

    def lazily() -> Iterator[Any]:
        yield from items  # a generator: the bad item is met only after all the good ones
        yield bad

    with pytest.raises(InvalidArgumentType):
        store.complete_many(lazily(), now=clock.now)
    assert snapshot(store, job_ids) == before


def test_an_invalid_value_anywhere_changes_nothing(store: JobStore, clock: Clock) -> None:
    items, _, job_ids = build(store, clock, 50)
    before = snapshot(store, job_ids)
    with pytest.raises(InvalidArgument):
        store.complete_many([*items, (Lease("j", "w\ud800", 1), "r")], now=clock.now)
    with pytest.raises(InvalidArgument):
        store.complete_many(items, now=float("nan"))
    assert snapshot(store, job_ids) == before


def test_an_empty_batch_is_an_empty_list(store: JobStore) -> None:
    assert [bool(v) for v in store.complete_many([])] == []
    assert [bool(v) for v in store.complete_many(iter([]), now=T0)] == []


def test_large_results_are_split_across_statements_and_stored_whole(store: JobStore) -> None:
    clock = Clock("caller")
    n = 12
    store_rows = [
        {
            "id": f"j{k:02d}",
            "owner": "w",
            "until": clock.live_until,
            "fence": FENCE,
            "result": None,
            "done": 0,
        }
        for k in range(n)
    ]
    insert_rows(store, store_rows)
    results = [f"{k:02d}" + "é" * 300_000 for k in range(n)]  # 3.6 M characters in all
    items = [(Lease(f"j{k:02d}", "w", FENCE), results[k]) for k in range(n)]
    assert store.complete_many(items, now=clock.now) == [True] * n
    assert [store.state(f"j{k:02d}").result for k in range(n)] == results  # type: ignore[union-attr]


def _count_statements(engine: Engine) -> list[str]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        verb = statement.split(None, 1)[0].upper()
        if verb != "BEGIN":  # SQLite's BEGIN IMMEDIATE, sent by the engine's begin listener
            seen.append(verb)

    event.listen(engine, "before_cursor_execute", record)
    return seen


@pytest.mark.parametrize("n", [1, 100, 1000, COMPLETE_CHUNK + 1])
def test_a_batch_costs_a_constant_number_of_statements_on_the_servers_one_each_on_sqlite(
    store: JobStore, clock: Clock, n: int
) -> None:
    items, expected, _ = build(store, clock, n, ["current"])
    seen = _count_statements(store.engine)
    with store.engine.begin() as conn:  # conn=: the statements go through SQLAlchemy, where we count them
        verdicts = store.complete_many(items, now=clock.now, conn=conn)
    assert verdicts == expected == [True] * n
    chunks = math.ceil(n / COMPLETE_CHUNK)
    dialect = store.engine.dialect.name
    if dialect == "postgresql":
        assert seen == ["UPDATE"] * chunks
    elif dialect in ("mysql", "mariadb"):
        # a locking read, then one UPDATE for the completions it found current; one
        # completion is its guarded UPDATE alone
        assert seen == (["UPDATE"] if n == 1 else ["SELECT", "UPDATE"] * chunks)
    else:
        # SQLite: an UPDATE per completion (a statement there is a function call, not a round trip)
        assert seen == ["UPDATE"] * n
