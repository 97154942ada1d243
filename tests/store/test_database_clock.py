"""now=None: the database server's clock decides, inside the statement, on every backend."""

from __future__ import annotations

import time

import pytest

import service
from fencing import JobStore, Lease

pytestmark = pytest.mark.dialect

# a worker whose clock is a day off: with now=None its own clock must not matter
SKEW = 86_400.0


def test_database_clock_claim_sets_until_from_server_time(store: JobStore) -> None:
    store.enqueue("j")
    before = time.time()
    lease = store.claim("j", "a", ttl=30.0)
    after = time.time()
    assert lease is not None and lease.until is not None
    # the server runs on this machine: its clock agrees with ours to well within a second
    assert before + 30.0 - 1.0 <= lease.until <= after + 30.0 + 1.0
    assert store.state("j").until == lease.until  # type: ignore[union-attr]


def test_database_clock_ignores_a_skewed_caller(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)  # the contract's row: ready at any clock
    # a caller whose clock runs a day behind takes a lease that, by the server, expired long ago
    stale = store.claim("j", "slow-clock", now=time.time() - SKEW, ttl=60.0)
    assert stale is not None
    # by the database's clock the lease is over: another worker may claim it
    fresh = store.claim("j", "b", ttl=60.0)
    assert fresh is not None and fresh.fence == stale.fence + 1
    # and the skewed worker's writes are refused by the database's clock too
    assert not store.complete(stale, "late")
    assert not store.renew(stale, ttl=60.0)
    assert store.complete(fresh, "ok") is True
    assert store.state("j").result == "ok"  # type: ignore[union-attr]


def test_database_clock_refuses_claim_of_live_lease_whatever_the_caller_thinks(store: JobStore) -> None:
    store.enqueue("j")
    held = store.claim("j", "a", ttl=600.0)
    assert held is not None
    # a caller clock far in the future would think the lease expired; the server does not
    assert store.claim("j", "b", ttl=60.0) is None
    assert store.claim("j", "b", now=time.time() + SKEW, ttl=60.0) is not None  # caller clock: it trusts you


def test_database_clock_renew_extends_and_complete_accepts(store: JobStore) -> None:
    store.enqueue("j")
    lease = store.claim("j", "a", ttl=30.0)
    assert lease is not None and lease.until is not None
    renewed = store.renew(lease, ttl=600.0)
    assert isinstance(renewed, Lease) and renewed.until is not None
    assert renewed.until > lease.until + 500.0
    assert renewed.fence == lease.fence
    assert store.state("j").until == pytest.approx(renewed.until)  # type: ignore[union-attr]
    assert store.complete(renewed, "r") is True


def test_database_clock_expiry_is_real_time(store: JobStore) -> None:
    store.enqueue("j")
    lease = store.claim("j", "a", ttl=0.3)
    assert lease is not None
    assert store.claim("j", "b", ttl=5.0) is None
    time.sleep(0.5)
    # the server's clock moved past until: the old holder is out, a new claim is in
    assert not store.complete(lease, "late")
    assert store.claim("j", "b", ttl=5.0) is not None


def test_service_accepts_now_none(target: str) -> None:
    service.init_db(target)
    assert service.enqueue(target, "j")
    fence = service.claim(target, "j", "a", None, 60.0)
    assert fence == 1
    assert service.claim(target, "j", "b", None, 60.0) is None
    assert service.renew(target, "j", "a", fence, None, 60.0) is True
    assert service.complete(target, "j", "a", fence, None, "done") is True
    row = service.state(target, "j")
    assert row is not None and row["result"] == "done" and row["done"] == 1


def test_database_clock_works_inside_caller_transaction(store: JobStore) -> None:
    store.enqueue("j")
    with store.engine.begin() as conn:
        lease = store.claim("j", "a", ttl=60.0, conn=conn)
        assert lease is not None
        assert store.complete(Lease("j", "a", lease.fence), "in-tx", conn=conn) is True
    assert store.state("j").result == "in-tx"  # type: ignore[union-attr]
