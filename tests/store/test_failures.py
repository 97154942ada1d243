"""A job's last failure: kept by an accepted release, never by a refused one.

Each test runs on the database under test, on both fronts. A worker whose function raised
hands its job back with ``release(lease, delay=..., failure=text)``; the text goes into a
table beside the jobs table in the release's transaction, only when the release is accepted
(a stale worker's failure never replaces what the current holder's attempt said), and
``store.failure(job_id)`` reads it back with the attempt's fence and its time.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, inspect, select

from fencing import (
    ConfigurationError,
    Failure,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    Refusal,
    failures_table,
    jobs_table,
    payloads_table,
)
from tests import asyncfront

TTL = 30.0


def tables() -> dict[str, Any]:
    metadata = MetaData()
    return {
        "table": jobs_table(metadata, "fl_jobs"),
        "failures": failures_table(metadata, "fl_failures"),
        "payloads": payloads_table(metadata, "fl_payloads"),
    }


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def store(request: pytest.FixtureRequest, engine: Engine, target: str) -> Iterator[Any]:
    """A store that keeps failures (and payloads), on each front."""
    yield from asyncfront.store_on_front(request, engine, target, tables())


def stored_failures(engine: Engine) -> list[tuple[Any, ...]]:
    f = tables()["failures"]
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(select(f.c.fence, f.c.failure))]


def a_traceback() -> str:
    try:
        raise ValueError("card declined: 'insufficient funds' ✗")
    except ValueError:
        return traceback.format_exc()


def test_a_released_attempt_keeps_its_failure_with_its_fence_and_time(store: Any) -> None:
    store.enqueue("j", ready_at=0)
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    text = a_traceback()
    assert store.release(lease, delay=5.0, failure=text, now=101.0) is True
    assert store.failure("j") == Failure("j", lease.fence, 101.0, text)
    assert "ValueError: card declined" in store.failure("j").text
    # the job is back, not before its delay
    assert store.claim_next("w", ttl=TTL, now=105.5) == []
    assert store.claim_next("w", ttl=TTL, now=106.0)[0].fence == lease.fence + 1


def test_a_release_at_once_on_the_databases_clock_stamps_the_databases_time(store: Any) -> None:
    store.enqueue("j")
    [lease] = store.claim_next("w", ttl=TTL)
    before = time.time()
    assert store.release(lease, failure="boom") is True
    failure = store.failure("j")
    assert failure is not None and failure.text == "boom" and failure.fence == lease.fence
    assert before - 2.0 <= failure.at <= time.time() + 2.0  # the server's clock, near this one


def test_the_next_failure_replaces_the_last_and_a_success_leaves_it(store: Any) -> None:
    store.enqueue("j", ready_at=0)
    first = store.claim("j", "w", ttl=TTL, now=100.0)
    store.release(first, failure="attempt 1", now=101.0)
    second = store.claim("j", "w", ttl=TTL, now=102.0)
    store.release(second, failure="attempt 2", now=103.0)
    assert store.failure("j") == Failure("j", second.fence, 103.0, "attempt 2")
    third = store.claim("j", "w", ttl=TTL, now=104.0)
    assert store.complete(third, "ok", now=105.0) is True
    assert store.failure("j") == Failure("j", second.fence, 103.0, "attempt 2")  # what went before


def test_a_stale_workers_failure_is_refused_with_its_release(store: Any, engine: Engine) -> None:
    store.enqueue("j", ready_at=0)
    stale = store.claim("j", "a", ttl=TTL, now=100.0)
    current = store.claim("j", "b", ttl=TTL, now=200.0)  # a's lease ran out; b took the job
    store.release(current, delay=1.0, failure="b's attempt", now=201.0)
    refused = store.release(stale, failure="a's late failure", now=202.0)
    assert isinstance(refused, Refusal) and not refused
    assert store.failure("j") == Failure("j", current.fence, 201.0, "b's attempt")
    assert stored_failures(engine) == [(current.fence, "b's attempt")]


def test_the_failure_commits_and_rolls_back_with_the_callers_transaction(store: Any, engine: Engine) -> None:
    store.enqueue("j", ready_at=0)
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    with engine.connect() as conn:
        tx = conn.begin()
        assert store.release(lease, failure="undone", now=101.0, conn=conn) is True
        tx.rollback()
    assert store.failure("j") is None
    assert store.holder("j", now=101.0) is not None  # the release was undone with it
    assert store.release(lease, failure="kept", now=102.0) is True
    assert store.failure("j") == Failure("j", lease.fence, 102.0, "kept")


def test_a_deleted_job_takes_its_failure_with_it(store: Any, engine: Engine) -> None:
    store.enqueue("j", ready_at=0, payload={"a": 1})
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    store.release(lease, failure="boom", now=101.0)
    assert store.delete("j") is True
    assert store.failure("j") is None
    assert stored_failures(engine) == []


def test_a_long_traceback_comes_back_whole(store: Any) -> None:
    text = (
        "Traceback (most recent call last):\n" + '  File "x.py", line 1, in f\n' * 5000 + "RuntimeError: é\n"
    )
    store.enqueue("j", ready_at=0)
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    store.release(lease, failure=text, now=101.0)
    assert store.failure("j").text == text


@pytest.mark.parametrize(
    ("failure", "error", "says"),
    [
        pytest.param(
            ValueError("x"), InvalidArgumentType, "failure must be a str, got ValueError", id="exception"
        ),
        pytest.param(b"boom", InvalidArgumentType, "failure must be a str, got bytes", id="bytes"),
        pytest.param("\ud800", InvalidArgument, "failure cannot be stored as UTF-8", id="surrogate"),
    ],
)
def test_a_bad_failure_is_refused_and_the_lease_is_kept(
    store: Any, engine: Engine, failure: object, error: type[Exception], says: str
) -> None:
    store.enqueue("j", ready_at=0)
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    with pytest.raises(error, match="failure") as caught:
        store.release(lease, failure=failure, now=101.0)
    assert says in str(caught.value)
    assert store.holder("j", now=101.0) == lease  # nothing changed: still held
    assert stored_failures(engine) == []


def test_a_nul_in_a_failure_is_refused_where_text_cannot_hold_it(store: Any, engine: Engine) -> None:
    store.enqueue("j", ready_at=0)
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    if engine.dialect.name == "postgresql":
        with pytest.raises(InvalidArgument, match=r"failure contains NUL \(U\+0000\)"):
            store.release(lease, failure="a\x00b", now=101.0)
        assert store.holder("j", now=101.0) == lease
    else:
        assert store.release(lease, failure="a\x00b", now=101.0) is True
        assert store.failure("j").text == "a\x00b"


def test_a_store_without_failures_says_what_it_needs_and_keeps_the_lease(engine: Engine) -> None:
    store = JobStore(engine, jobs_table(MetaData(), "nf_jobs"))
    store.create_table()
    store.enqueue("j", ready_at=0)
    lease = store.claim("j", "w", ttl=TTL, now=100.0)
    with pytest.raises(ConfigurationError, match=r"release\(failure=\) needs a table for the failures"):
        store.release(lease, failure="boom", now=101.0)
    assert store.holder("j", now=101.0) == lease
    with pytest.raises(
        ConfigurationError, match=r"failure needs .*failures=fencing.failures_table\(metadata\)"
    ):
        store.failure("j")
    assert store.release(lease, now=101.0) is True  # without one, a release is as it was


def test_what_the_store_takes_as_a_failures_table(engine: Engine) -> None:
    metadata = MetaData()
    table = jobs_table(metadata, "ft_jobs")
    with pytest.raises(InvalidArgumentType, match="failures must be a sqlalchemy Table"):
        JobStore(engine, table, failures="fencing_failures")  # type: ignore[arg-type]
    other = Table("ft_other", metadata, Column("id", Integer, primary_key=True))
    with pytest.raises(InvalidArgument, match=r"not a failures table \(no at, failure, fence\)"):
        JobStore(engine, table, failures=other)


def test_create_table_creates_the_failures_table(engine: Engine) -> None:
    JobStore(engine, **tables()).create_table()
    assert {c["name"] for c in inspect(engine).get_columns("fl_failures")} == {"id", "fence", "at", "failure"}
