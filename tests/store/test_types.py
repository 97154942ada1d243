"""Types keep their meaning on every backend: exact doubles, 64-bit fences, exact ids."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from fencing import InvalidArgument, JobStore, Lease
from fencing._dialects import of
from fencing._sql.schema import as_text

pytestmark = pytest.mark.dialect

EPOCH_WITH_MICROS = [1_700_000_000.123456, 1_799_999_999.999999, 4_102_444_800.000001, 0.5, 1e-6]


@pytest.mark.parametrize("now", EPOCH_WITH_MICROS)
def test_until_round_trips_epoch_scale_values_exactly(store: JobStore, now: float) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "a", now=now, ttl=0.000001)
    assert lease is not None
    assert lease.until == now + 0.000001
    assert store.state("j").until == now + 0.000001  # type: ignore[union-attr]
    # the boundary is exact too: at until the lease is over, a hair before it is live
    just_before = (now + 0.000001) - 1e-9 if now < 1e6 else now
    assert not store.complete(lease, "x", now=now + 0.000001)
    assert isinstance(store.renew(lease, now=just_before, ttl=1.0), Lease)


def test_fence_past_2_pow_31_keeps_increasing(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    table = store.table
    with store.engine.begin() as conn:
        conn.execute(update(table).where(as_text(table.c.id) == "j").values(fence=2**31 - 1))
    first = store.claim("j", "a", now=0.0, ttl=1.0)
    assert first is not None and first.fence == 2**31
    second = store.claim("j", "b", now=1.0, ttl=1.0)
    assert second is not None and second.fence == 2**31 + 1
    assert store.complete(second, "r", now=1.5) is True
    assert store.state("j").fence == 2**31 + 1  # type: ignore[union-attr]


def test_fence_near_2_pow_62_keeps_increasing(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    table = store.table
    with store.engine.begin() as conn:
        conn.execute(update(table).where(as_text(table.c.id) == "j").values(fence=2**62))
    lease = store.claim("j", "a", now=0.0, ttl=1.0)
    assert lease is not None and lease.fence == 2**62 + 1
    assert store.release(lease) is True
    assert store.state("j").fence == 2**62 + 1  # type: ignore[union-attr]


def test_ids_differing_only_in_case_or_trailing_space_are_distinct(store: JobStore) -> None:
    for job_id in ("job", "JOB", "job ", "jöb", "job\t"):
        assert store.enqueue(job_id, ready_at=0.0) is True
    assert store.enqueue("job", ready_at=0.0) is False
    lease = store.claim("job ", "a", now=0.0, ttl=5.0)
    assert lease is not None
    assert store.complete(lease, "space", now=1.0) is True
    assert store.state("job").done is False  # type: ignore[union-attr]
    assert store.state("job ").result == "space"  # type: ignore[union-attr]
    assert store.state("JOB").job_id == "JOB"  # type: ignore[union-attr]


def test_owner_compare_is_exact(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "Worker", now=0.0, ttl=5.0)
    assert lease is not None
    assert not store.complete(Lease("j", "worker", lease.fence), "x", now=1.0)
    assert not store.complete(Lease("j", "Worker ", lease.fence), "x", now=1.0)
    assert store.state("j").done is False  # type: ignore[union-attr]


def test_longest_id_the_backend_keys_on_round_trips(store: JobStore) -> None:
    limit = of(store.engine.dialect).id_max_bytes or 100_000
    job_id = "é" * (limit // 2)  # two UTF-8 bytes each: exactly at the limit
    assert store.enqueue(job_id, ready_at=0.0) is True
    lease = store.claim(job_id, "a", now=0.0, ttl=5.0)
    assert lease is not None and store.complete(lease, "ok", now=1.0)
    assert store.state(job_id).job_id == job_id  # type: ignore[union-attr]


@pytest.mark.backend("postgresql", "mysql", "mariadb")  # SQLite keys any length
def test_id_longer_than_the_backend_can_key_is_refused_not_truncated(store: JobStore) -> None:
    limit = of(store.engine.dialect).id_max_bytes
    assert limit is not None
    too_long = "x" * (limit + 1)
    with pytest.raises(InvalidArgument, match=r"job_id is .* bytes"):
        store.enqueue(too_long, ready_at=0.0)
    assert store.state(too_long[:limit]) is None  # nothing truncated and stored
    with store.engine.connect() as conn:
        assert conn.execute(store.table.select()).all() == []


def test_long_results_and_owners_round_trip(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    owner = "o" * 70_000  # past MySQL's 64 KiB TEXT
    lease = store.claim("j", owner, now=0.0, ttl=5.0)
    assert lease is not None
    result = "r" * 300_000
    assert store.complete(lease, result, now=1.0) is True
    row = store.state("j")
    assert row is not None and row.owner == owner and row.result == result
