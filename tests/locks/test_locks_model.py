"""Random sequences of lock operations against a small model of the lock rules.

The model: per name, the highest token it ever had (never reissued, not even after a delete)
and the lease that holds it (owner, token, until) or none. A lease holds the name while
``now < until``; ``until == now`` is free. Every answer of :class:`fencing.Locks` and every
``holder`` read must be the model's. The clock (the caller's) only moves forward, in steps
that are multiples of the ttls, so the boundary comes up often; old leases are kept and
replayed on purpose.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import fencing
from fencing import Lease, LeaseLost, Locks

pytestmark = pytest.mark.backend("sqlite")

NAMES = ("nightly", "scheduler", "tenant-ü")
OWNERS = ("a", "b", "c")
names = st.sampled_from(NAMES)
owners = st.sampled_from(OWNERS)
ttls = st.sampled_from([1.0, 2.0, 3.0])
steps = st.sampled_from([0.0, 1.0, 2.0, 3.0])


@dataclass
class Held:
    owner: str
    token: int
    until: float


class LockModel:
    def __init__(self) -> None:
        self.top: dict[str, int] = {}  # the highest token a name ever had
        self.held: dict[str, Held] = {}  # the lease on a name (live or not)
        self.exists: set[str] = set()

    def live(self, name: str, now: float) -> Held | None:
        held = self.held.get(name)
        return held if held is not None and now < held.until else None

    def acquire(self, name: str, owner: str, ttl: float, now: float) -> int | None:
        if self.live(name, now) is not None:
            return None
        token = self.top.get(name, 0) + 1
        self.top[name] = token
        self.held[name] = Held(owner, token, now + ttl)
        self.exists.add(name)
        return token

    def current(self, lease: Lease, now: float) -> bool:
        held = self.live(lease.job_id, now)
        return held is not None and (held.owner, held.token) == (lease.owner, lease.fence)

    def renew(self, lease: Lease, ttl: float, now: float) -> bool:
        if not self.current(lease, now):
            return False
        self.held[lease.job_id].until = now + ttl
        return True

    def release(self, lease: Lease) -> bool:
        held = self.held.get(lease.job_id)
        if held is None or (held.owner, held.token) != (lease.owner, lease.fence):
            return False  # (a release needs no live lease: an expired one frees its name too)
        del self.held[lease.job_id]
        return True

    def revoke(self, name: str) -> bool:
        if name not in self.exists:
            return False
        self.top[name] = self.top.get(name, 0) + 1  # the revoke takes a token of its own
        self.held.pop(name, None)
        return True

    def delete(self, name: str) -> bool:
        if name not in self.exists:
            return False
        self.exists.discard(name)
        self.held.pop(name, None)
        return True


class LockMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR"))
        self.engine = fencing.create_sqlite_engine(os.path.join(self.dir.name, "locks.db"))
        self.locks = Locks(self.engine)
        self.locks.create_table()
        self.model = LockModel()
        self.now = 100.0

    def teardown(self) -> None:
        self.engine.dispose()
        self.dir.cleanup()

    @rule(step=steps)
    def time_passes(self, step: float) -> None:
        self.now += step

    @rule(target=leases, name=names, owner=owners, ttl=ttls)
    def acquire(self, name: str, owner: str, ttl: float) -> Lease:
        lease = self.locks.try_acquire(name, owner, ttl=ttl, now=self.now)
        token = self.model.acquire(name, owner, ttl, self.now)
        if token is None:
            assert lease is None
            return Lease(name, owner, 0)  # a token that never held anything
        assert lease is not None and (lease.fence, lease.until) == (token, self.now + ttl)
        return lease

    @rule(lease=leases, ttl=ttls)
    def renew(self, lease: Lease, ttl: float) -> None:
        if lease.fence == 0:
            return
        renewed = self.locks.renew(lease, ttl=ttl, now=self.now)
        assert bool(renewed) == self.model.renew(lease, ttl, self.now)

    @rule(lease=leases)
    def release(self, lease: Lease) -> None:
        if lease.fence == 0:
            return
        assert bool(self.locks.release(lease)) == self.model.release(lease)

    @rule(lease=leases)
    def check(self, lease: Lease) -> None:
        if lease.fence == 0:
            return
        current = self.model.current(lease, self.now)
        try:
            self.locks.check(lease, now=self.now)
        except LeaseLost:
            assert not current
        else:
            assert current

    @rule(name=names)
    def revoke(self, name: str) -> None:
        assert self.locks.revoke(name) == self.model.revoke(name)

    @rule(name=names)
    def delete(self, name: str) -> None:
        assert self.locks.delete(name) == self.model.delete(name)

    @invariant()
    def holders_are_the_models(self) -> None:
        for name in NAMES:
            holder = self.locks.holder(name, now=self.now)
            held = self.model.live(name, self.now)
            if held is None:
                assert holder is None
            else:
                assert holder is not None
                assert (holder.owner, holder.fence, holder.until) == (held.owner, held.token, held.until)


def test_locks_follow_the_model() -> None:
    run_state_machine_as_test(
        LockMachine, settings=settings(max_examples=60, stateful_step_count=40, deadline=None)
    )
