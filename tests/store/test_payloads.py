"""A job's arguments: written with its enqueue, handed out with its claim, gone with its delete.

Each test runs on the database under test, on both fronts. The payload lives in a table
beside the jobs table (the contract's six columns stay as they are); ``enqueue(payload=)``
writes it in the enqueue's transaction, only for a job that is new; every claim (by id, the
next ready ones, a worker's step) hands each job its own payload in the claim's statement or
transaction. A value that would not read back equal is refused and nothing is written.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Column, Engine, Integer, MetaData, Table, inspect, select

from fencing import (
    ConfigurationError,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    Lease,
    jobs_table,
    payloads_table,
)
from tests import asyncfront

TTL = 30.0


def tables() -> dict[str, Any]:
    metadata = MetaData()
    return {"table": jobs_table(metadata, "pl_jobs"), "payloads": payloads_table(metadata, "pl_payloads")}


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def store(request: pytest.FixtureRequest, engine: Engine, target: str) -> Iterator[Any]:
    """A store that keeps payloads (its own jobs and payloads tables), on each front."""
    yield from asyncfront.store_on_front(request, engine, target, tables())


def stored_payloads(engine: Engine) -> dict[str, str | None]:
    """The payloads table's rows, read directly through the test's engine: what the database holds."""
    p = tables()["payloads"]
    with engine.connect() as conn:
        rows = conn.execute(select(p.c.id, p.c.payload)).all()
    return {(i.decode() if isinstance(i, bytes) else i): text for i, text in rows}


def test_the_next_jobs_come_each_with_its_own_payload(store: Any, engine: Engine) -> None:
    # several jobs claimed by one statement: each row's payload is its own job's (a payload
    # read that compared the payloads table's id with itself gave every job the first one)
    given_payloads: dict[str, Any] = {
        "a": {"order": 1, "items": ["x", "y"], "note": "é ✓ 𝄞"},
        "b": None,
        "c": [1, 2.5, True, None, "three"],
        "d": "a plain string",
        "e": {"nested": {"deep": [{"k": 0}]}},
    }
    for job_id, payload in given_payloads.items():
        assert store.enqueue(job_id, ready_at=0, payload=payload) is True
    leases = store.claim_next("w", ttl=TTL, now=100.0, limit=10)
    assert {lease.job_id: lease.payload for lease in leases} == given_payloads
    assert set(stored_payloads(engine)) == {"a", "c", "d", "e"}  # None writes no row


def test_a_claim_by_id_and_its_renewals_carry_the_payload(store: Any) -> None:
    store.enqueue("j", ready_at=0, payload={"n": 7})
    store.enqueue("other", ready_at=0, payload={"n": 8})
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    assert lease.payload == {"n": 7}
    renewed = store.renew(lease, ttl=TTL, now=110.0)
    assert renewed.payload == {"n": 7}
    assert renewed.until == 140.0


def test_a_workers_step_hands_out_the_payloads_of_what_it_claims(store: Any) -> None:
    for i in range(4):
        store.enqueue(f"s{i}", ready_at=float(i), payload={"i": i})
    [first] = store.claim_next("w", ttl=TTL, now=100.0)
    assert first.payload == {"i": 0}
    accepted, leases = store.complete_and_claim_next([(first, "done")], "w", ttl=TTL, now=101.0, limit=2)
    assert accepted == [True]
    assert {lease.job_id: lease.payload for lease in leases} == {"s1": {"i": 1}, "s2": {"i": 2}}


def test_enqueueing_an_existing_job_leaves_its_payload(store: Any, engine: Engine) -> None:
    assert store.enqueue("j", ready_at=0, payload={"v": "first"}) is True
    assert store.enqueue("j", ready_at=0, payload={"v": "second"}) is False
    [lease] = store.claim_next("w", ttl=TTL, now=100.0)
    assert lease.payload == {"v": "first"}
    assert json.loads(stored_payloads(engine)["j"] or "null") == {"v": "first"}


def test_a_deleted_job_takes_its_payload_with_it(store: Any, engine: Engine) -> None:
    store.enqueue("j", ready_at=0, payload={"v": 1})
    assert store.delete("j") is True
    assert stored_payloads(engine) == {}
    # enqueued again: with no payload it has none, with one it has the new one
    assert store.enqueue("j", ready_at=0) is True
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    assert lease.payload is None
    store.delete("j")
    assert store.enqueue("j", ready_at=0, payload={"v": 2}) is True
    assert store.claim("j", "w", ttl=TTL, now=200.0).payload == {"v": 2}


@pytest.mark.parametrize("payload", [None, {"v": 2}])
def test_revive_false_leaves_a_deleted_job_deleted(store: Any, engine: Engine, payload: Any) -> None:
    # a schedule's tick is registered once, ever: a deleted one must not come back
    store.enqueue("j", ready_at=0, payload={"v": 1})
    store.delete("j")
    assert store.enqueue("j", ready_at=0, payload=payload, revive=False) is False
    assert store.state("j") is None
    assert stored_payloads(engine) == {}
    assert store.claim_next("w", ttl=TTL, now=100.0) == []
    # a done job stays done, a new id goes in, and without revive=False the tombstone comes back
    store.enqueue("done", ready_at=0)
    store.complete(store.claim("done", "w", ttl=TTL, now=100.0), "r", now=101.0)
    assert store.enqueue("done", ready_at=0, revive=False) is False
    assert store.state("done").result == "r"
    assert store.enqueue("new", ready_at=0, payload=payload, revive=False) is True
    assert store.claim("new", "w", ttl=TTL, now=100.0).payload == payload
    assert store.enqueue("j", ready_at=0, payload=payload) is True


def test_revive_must_be_a_bool(store: Any) -> None:
    with pytest.raises(InvalidArgumentType, match="revive must be a bool, got str"):
        store.enqueue("j", revive="no")
    assert store.state("j") is None


def test_a_payload_left_under_an_id_never_reaches_a_new_job(store: Any, engine: Engine) -> None:
    # a row the application left in the payloads table (it deleted a job's row itself)
    p = store.payloads
    with engine.begin() as conn:
        conn.execute(p.insert().values(id=b"j" if "mysql" in engine.dialect.name else "j", payload='"stale"'))
    store.enqueue("j", ready_at=0, payload="fresh")
    assert store.claim("j", "w", ttl=TTL, now=100.0).payload == "fresh"


def test_the_payload_commits_and_rolls_back_with_the_callers_transaction(store: Any, engine: Engine) -> None:
    with engine.connect() as conn:
        with conn.begin():
            store.enqueue("kept", ready_at=0, payload={"order": 1}, conn=conn)
        tx = conn.begin()
        store.enqueue("undone", ready_at=0, payload={"order": 2}, conn=conn)
        tx.rollback()
    assert store.state("undone") is None
    assert set(stored_payloads(engine)) == {"kept"}
    assert [lease.payload for lease in store.claim_next("w", ttl=TTL, now=100.0, limit=5)] == [{"order": 1}]


def test_a_large_payload_comes_back_whole(store: Any) -> None:
    big = {"blob": "x" * 1_000_000 + "é", "rows": list(range(10_000))}
    store.enqueue("big", ready_at=0, payload=big)
    assert store.claim("big", "w", ttl=TTL, now=100.0).payload == big


BAD_PAYLOADS = [
    pytest.param((1, 2), InvalidArgument, "would read back as [1, 2]", id="tuple"),
    pytest.param({1: "a"}, InvalidArgument, "would read back as {'1': 'a'}", id="int-key"),
    pytest.param({"a": {"b": (1,)}}, InvalidArgument, "would read back as", id="nested-tuple"),
    pytest.param(float("nan"), InvalidArgumentType, "nan is not", id="nan"),
    pytest.param([float("inf")], InvalidArgumentType, "inf", id="inf"),
    pytest.param({1, 2}, InvalidArgumentType, "set is not JSON serializable", id="set"),
    pytest.param(b"bytes", InvalidArgumentType, "bytes is not JSON serializable", id="bytes"),
    pytest.param(object(), InvalidArgumentType, "object is not JSON serializable", id="object"),
    pytest.param("\ud800", InvalidArgument, "lone surrogate", id="surrogate"),
    pytest.param({True: 1}, InvalidArgument, "would read back as {'true': 1}", id="bool-key"),
]


@pytest.mark.parametrize(("payload", "error", "says"), BAD_PAYLOADS)
def test_a_payload_that_would_not_read_back_equal_is_refused_and_nothing_written(
    store: Any, engine: Engine, payload: object, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match="payload") as caught:
        store.enqueue("bad", ready_at=0, payload=payload)
    assert says in str(caught.value)
    assert store.state("bad") is None
    assert stored_payloads(engine) == {}


def test_a_store_without_payloads_refuses_one_and_writes_nothing(engine: Engine) -> None:
    store = JobStore(engine, jobs_table(MetaData(), "np_jobs"))
    store.create_table()
    with pytest.raises(ConfigurationError, match=r"payloads=fencing.payloads_table\(metadata\)"):
        store.enqueue("j", ready_at=0, payload={"a": 1})
    with pytest.raises(ConfigurationError, match=r"payload needs a table for the payloads"):
        store.payload("j")
    assert store.state("j") is None
    # and its claims read no payload: every lease's is None
    store.enqueue("j", ready_at=0)
    assert store.claim_next("w", ttl=TTL, now=100.0)[0].payload is None


def test_what_the_store_takes_as_a_payloads_table(engine: Engine) -> None:
    metadata = MetaData()
    table = jobs_table(metadata, "pt_jobs")
    with pytest.raises(InvalidArgumentType, match="payloads must be a sqlalchemy Table"):
        JobStore(engine, table, payloads="pl_payloads")  # type: ignore[arg-type]
    other = Table("pt_other", metadata, Column("id", Integer, primary_key=True))
    with pytest.raises(InvalidArgument, match=r"not a payloads table \(no payload\)"):
        JobStore(engine, table, payloads=other)


def test_create_table_creates_the_payloads_table(engine: Engine) -> None:
    t = tables()
    JobStore(engine, **t).create_table()
    assert {c["name"] for c in inspect(engine).get_columns("pl_payloads")} == {"id", "payload"}
    JobStore(engine, **t).create_table()  # again: nothing to do


def test_the_payload_is_not_part_of_the_token() -> None:
    with_payload = Lease("j", "w", 3, 10.0, {"big": ["dict"]})
    assert with_payload == Lease("j", "w", 3, 10.0)
    assert hash(with_payload) == hash(Lease("j", "w", 3, 10.0))  # a dict payload: still hashable
    assert "big" not in repr(with_payload)  # a token in a log line does not carry the arguments


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


_FRESH = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=JSON)
def test_every_json_value_comes_back_exactly(store: Any, payload: Any) -> None:
    job_id = f"h{next(_FRESH)}"  # every example a job of its own
    store.enqueue(job_id, ready_at=0, payload=payload)
    got = store.claim(job_id, "w", ttl=TTL, now=100.0).payload
    assert got == payload
    assert json.dumps(got) == json.dumps(payload)  # the same types: 1 is not 1.0 is not True


def test_a_payload_is_read_without_claiming_the_job(store: Any) -> None:
    store.enqueue("j", ready_at=0, payload={"to": "ops@example.com"})
    store.enqueue("bare", ready_at=0)
    assert store.payload("j") == {"to": "ops@example.com"}
    assert store.payload("bare") is None
    assert store.payload("missing") is None
    assert store.holder("j", now=100.0) is None  # still unclaimed
    leases = store.claim_next("w", ttl=TTL, now=100.0, limit=5)  # (in the database's order)
    assert {lease.job_id: lease.payload for lease in leases} == {"j": {"to": "ops@example.com"}, "bare": None}


@pytest.mark.parametrize("how", ["claim_next", "claim"])
def test_a_claim_in_an_older_transaction_gets_the_payload_of_a_job_enqueued_since(
    engine: Engine, how: str
) -> None:
    # on MariaDB a plain read in a transaction sees the snapshot of its first read, while the
    # claim's locking read takes the newest rows: the payload must be read as of now too, or
    # a job enqueued since the caller's first read would come without its payload
    if engine.dialect.name == "sqlite":
        pytest.skip("SQLite refuses a write in a transaction whose read snapshot is stale")
    store = JobStore(engine, **tables())
    store.create_table()
    store.enqueue("old", ready_at=0, payload={"v": "old"})
    with engine.connect() as conn:
        tx = conn.begin()
        assert store.payload("old", conn=conn) == {"v": "old"}  # the transaction's first read
        store.enqueue("new", ready_at=0, payload={"v": "new"})  # committed after it
        if how == "claim_next":
            leases = store.claim_next("w", ttl=TTL, now=100.0, limit=5, conn=conn)
        else:
            leases = [store.claim("new", "w", ttl=TTL, now=100.0, conn=conn)]
        tx.commit()
    assert {lease.job_id: lease.payload for lease in leases if lease.job_id == "new"} == {"new": {"v": "new"}}
