"""A fence is never reset and never reused: not by a release, a restart, or many generations."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine

import service
from fencing import JobState, JobStore, Lease
from tests import backends

pytestmark = pytest.mark.dialect

TTL = 10.0


def test_release_then_reclaim_gives_the_next_fence(db: str) -> None:
    service.enqueue(db, "j")
    fences = []
    for generation in range(1, 6):
        fence = service.claim(db, "j", "w", float(generation), TTL)
        assert fence == generation
        fences.append(fence)
        assert service.release(db, "j", "w", fence) is True
        assert service.state(db, "j")["fence"] == generation
    assert fences == [1, 2, 3, 4, 5]


def test_fence_is_never_reused_after_release(db: str) -> None:
    service.enqueue(db, "j")
    seen: list[int] = []
    now = 0.0
    for i in range(20):
        fence = service.claim(db, "j", "same-owner", now, TTL)
        assert fence is not None
        assert fence not in seen
        seen.append(fence)
        if i % 2:
            assert service.release(db, "j", "same-owner", fence)
        else:
            now += TTL  # let it expire instead
    assert seen == list(range(1, 21))


def test_fence_survives_service_restart(db: str) -> None:
    service.enqueue(db, "j")
    assert service.claim(db, "j", "a", 0.0, TTL) == 1
    assert service.release(db, "j", "a", 1)
    service._stores.clear()  # a fresh process: no cache, same file
    service.init_db(db)
    assert service.enqueue(db, "j") is False
    assert service.state(db, "j")["fence"] == 1
    assert service.claim(db, "j", "a", 1.0, TTL) == 2
    service._stores.clear()
    assert service.claim(db, "j", "a", 1.0 + TTL, TTL) == 3
    # the tokens of generations before the restarts are dead
    assert not service.complete(db, "j", "a", 1, 2.0 + TTL, "stale")
    assert not service.complete(db, "j", "a", 2, 2.0 + TTL, "stale")
    assert service.complete(db, "j", "a", 3, 2.0 + TTL, "fresh") is True


def test_fence_survives_a_new_store_on_a_new_engine(store: JobStore, target: str) -> None:
    store.enqueue("j", ready_at=0.0)
    first = store.claim("j", "a", now=0.0, ttl=TTL)
    assert first is not None
    store.engine.dispose()
    store.engine.dispose()

    engine = backends.engine_for(target)
    fresh = JobStore(engine)
    try:
        fresh.create_table()
        assert fresh.enqueue("j", ready_at=0.0) is False
        second = fresh.claim("j", "a", now=TTL, ttl=TTL)
        assert second == Lease("j", "a", first.fence + 1, 2 * TTL)
        assert not fresh.complete(first, "stale", now=TTL + 1)
        assert not fresh.release(first)
    finally:
        fresh.engine.dispose()
        engine.dispose()


def test_200_claim_expire_cycles_give_fences_1_to_200(store: JobStore) -> None:
    store.enqueue("j", ready_at=0.0)
    fences = []
    for generation in range(200):
        lease = store.claim("j", f"w{generation % 3}", now=generation * TTL, ttl=TTL)
        assert lease is not None
        fences.append(lease.fence)
    assert fences == list(range(1, 201))
    assert store.state("j") == JobState("j", "w1", 200 * TTL, 200, None, False)


def test_many_generations_through_the_service_strictly_increase(db: str) -> None:
    service.enqueue(db, "j")
    fences = []
    for generation in range(60):
        now = generation * TTL
        fence = service.claim(db, "j", "w", now, TTL)
        assert fence is not None
        fences.append(fence)
        if generation % 3 == 1:
            assert service.release(db, "j", "w", fence)
        if generation % 20 == 19:
            service._stores.clear()
    assert fences == list(range(1, 61))
    assert all(a < b for a, b in itertools.pairwise(fences))


@pytest.mark.parametrize("generations", [1, 2, 7])
def test_stale_fence_can_never_act_after_a_newer_generation_exists(store: JobStore, generations: int) -> None:
    store.enqueue("j", ready_at=0.0)
    stale: list[Lease] = []
    for g in range(generations):
        lease = store.claim("j", "w", now=g * TTL, ttl=TTL)
        assert lease is not None
        stale.append(lease)
    now = generations * TTL
    current = store.claim("j", "w", now=now, ttl=TTL)  # the same owner name: only the fence differs
    assert current == Lease("j", "w", generations + 1, now + TTL)
    before = store.state("j")

    for old in stale:
        # a live clock for the current lease: only the fence can refuse these
        assert not store.renew(old, now=now + 1, ttl=TTL)
        assert not store.complete(old, "stale", now=now + 1)
        assert not store.release(old)
    assert store.state("j") == before

    # still refused once the current lease is released or done
    assert store.release(current) is True
    for old in stale:
        assert not store.renew(old, now=now + 2, ttl=TTL)
        assert not store.complete(old, "stale", now=now + 2)
        assert not store.release(old)
    newest = store.claim("j", "w", now=now + 2, ttl=TTL)
    assert newest is not None
    assert newest.fence == generations + 2
    assert store.complete(newest, "fresh", now=now + 3) is True
    for old in [*stale, current]:
        assert not store.complete(old, "stale", now=now + 3)
        assert not store.release(old)
    assert store.state("j") == JobState("j", "w", now + 2 + TTL, generations + 2, "fresh", True)


def test_stale_fence_through_the_service_cannot_renew_complete_or_release(db: str) -> None:
    service.enqueue(db, "j")
    old = service.claim(db, "j", "w", 0.0, TTL)
    new = service.claim(db, "j", "w", TTL, TTL)
    assert (old, new) == (1, 2)
    assert not service.renew(db, "j", "w", old, TTL + 1, TTL)
    assert not service.complete(db, "j", "w", old, TTL + 1, "stale")
    assert not service.release(db, "j", "w", old)
    assert service.state(db, "j") == {
        "id": "j",
        "owner": "w",
        "until": 2 * TTL,
        "fence": 2,
        "result": None,
        "done": 0,
    }


def test_fence_is_per_job(store: JobStore) -> None:
    store.enqueue("a", ready_at=0.0)
    store.enqueue("b", ready_at=0.0)
    for g in range(3):
        assert store.claim("a", "w", now=g * TTL, ttl=TTL) is not None
    lease_b = store.claim("b", "w", now=0.0, ttl=TTL)
    assert lease_b == Lease("b", "w", 1, TTL)
    # a fence from another job is not a token for this one
    assert not store.complete(Lease("a", "w", 1), "x", now=1.0)
    assert store.complete(lease_b, "b done", now=1.0) is True
    state_a = store.state("a")
    assert state_a is not None
    assert (state_a.fence, state_a.done) == (3, False)


# -- random histories against a model -----------------------------------------------------


@dataclass
class Model:
    owner: str | None = None
    until: float = 0.0
    fence: int = 0
    result: str | None = None
    done: bool = False

    def holds(self, lease: Lease, now: float | None) -> bool:
        live = now is None or self.until > now
        return lease.owner == self.owner and lease.fence == self.fence and not self.done and live


OWNERS = st.sampled_from(["a", "b", "c"])
STEP = st.integers(min_value=0, max_value=4).map(float)
DURATION = st.integers(min_value=1, max_value=4).map(float)
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), OWNERS, STEP, DURATION),
        st.tuples(st.just("renew"), st.integers(0, 20), STEP, DURATION),
        # no NUL: PostgreSQL text cannot hold it (the store refuses it there, tested elsewhere)
        st.tuples(
            st.just("complete"),
            st.integers(0, 20),
            STEP,
            st.text(st.characters(exclude_characters="\x00"), max_size=3),
        ),
        st.tuples(st.just("release"), st.integers(0, 20)),
        st.tuples(st.just("enqueue")),
    ),
    max_size=20,
)


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(actions=ACTIONS)
def test_random_histories_never_reuse_a_fence_and_match_the_contract(
    store: JobStore, engine: Engine, actions: list[tuple]
) -> None:
    with engine.begin() as conn:
        conn.execute(store.table.delete())
    store.enqueue("j", ready_at=0.0)
    model = Model()
    now = 0.0
    handed_out: list[Lease] = []
    for action in actions:
        kind = action[0]
        if kind == "claim":
            _, owner, step, ttl = action
            now += step
            lease = store.claim("j", owner, now=now, ttl=ttl)
            if not model.done and model.until <= now:
                model = Model(owner, now + ttl, model.fence + 1, model.result, False)
                assert lease == Lease("j", owner, model.fence, now + ttl)
                assert all(lease.fence > old.fence for old in handed_out)
                handed_out.append(lease)
            else:
                assert lease is None
        elif kind == "renew" and handed_out:
            _, index, step, ttl = action
            now += step
            token = handed_out[index % len(handed_out)]
            expected = model.holds(token, now)
            assert bool(store.renew(token, now=now, ttl=ttl)) == expected
            if expected:
                model.until = now + ttl
        elif kind == "complete" and handed_out:
            _, index, step, result = action
            now += step
            token = handed_out[index % len(handed_out)]
            expected = model.holds(token, now)
            assert bool(store.complete(token, result, now=now)) is expected
            if expected:
                model.result, model.done = result, True
        elif kind == "release" and handed_out:
            token = handed_out[action[1] % len(handed_out)]
            expected = model.holds(token, None)
            assert bool(store.release(token)) is expected
            if expected:
                model.owner, model.until = None, 0.0
        elif kind == "enqueue":
            assert store.enqueue("j", ready_at=0.0) is False
        assert store.state("j") == JobState(
            "j", model.owner, model.until, model.fence, model.result, model.done
        )
    assert [lease.fence for lease in handed_out] == list(range(1, len(handed_out) + 1))
