"""A heartbeat keeps a lease alive, reports its loss promptly, and never revives it.

Real, short TTLs (fractions of a second) on the tested backend; timings have generous
slack so a loaded machine slows the suite down rather than failing it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine

from fencing import DatabaseError, FencingError, InvalidArgument, InvalidArgumentType, JobStore, Lease
from fencing._sql.schema import as_text
from fencing._store.heartbeat import Heartbeat, LeaseLost

pytestmark = pytest.mark.sync_only("Heartbeat renews from a thread; AsyncHeartbeat has its own tests")

#: scheduling slack on a busy 2-core machine (xdist, a server on the same host)
SLACK = 0.3


class Spy:
    """The real store, with every renewal recorded and, if a test says so, disturbed.

    ``disturb(n, lease)`` runs before renewal ``n`` (0 is the one ``start()`` sends): it may
    raise, block, or return a ``Lease`` to answer instead of the database.
    """

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.nows: list[float | None] = []
        self.released: list[Lease] = []
        self.threads: set[str] = set()
        self.disturb: Callable[[int, Lease], Lease | None] = lambda n, lease: None
        self.fail_release = False

    @property
    def renewals(self) -> int:
        return len(self.nows)

    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | None:
        n = len(self.nows)
        self.nows.append(now)
        self.threads.add(threading.current_thread().name)
        answer = self.disturb(n, lease)
        if answer is not None:
            return answer
        return self.store.renew(lease, ttl=ttl, now=now)

    def release(self, lease: Lease) -> bool:
        self.released.append(lease)
        if self.fail_release:
            raise DatabaseError("the server went away")
        return self.store.release(lease)


class FakeClock:
    """A caller clock that runs with real time, plus jumps a test makes."""

    def __init__(self) -> None:
        self.origin = time.monotonic()
        self.offset = 1000.0

    def __call__(self) -> float:
        return self.offset + time.monotonic() - self.origin

    def jump(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def spy(store: JobStore) -> Spy:
    return Spy(store)


def claimed(store: JobStore, ttl: float, now: float | None = None, job_id: str = "j") -> Lease:
    store.enqueue(job_id, ready_at=0.0)
    lease = store.claim(job_id, "a", ttl=ttl, now=now)
    assert lease is not None
    return lease


def revoke(engine: Engine, store: JobStore, job_id: str = "j") -> None:
    """What an administrator (or a claim after expiry) does: the fence moves on."""
    table = store.table
    with engine.begin() as conn:
        conn.execute(table.update().where(as_text(table.c.id) == job_id).values(fence=table.c.fence + 1))


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def lost_calls() -> list[tuple[Heartbeat, str]]:
    """What ``on_lost`` was called with, and on which thread."""
    return []


def recorder(calls: list[tuple[Heartbeat, str]]) -> Callable[[Heartbeat], None]:
    return lambda hb: calls.append((hb, threading.current_thread().name))


# -- keeping it ------------------------------------------------------------------------------


def test_heartbeat_keeps_the_lease_past_several_ttls(store: JobStore) -> None:
    # long enough that a loaded CI machine's stall (seen: over 2 s between two renewals, with
    # a 2 s lease in CI) does not outlast it; the block still runs past two ttls
    ttl = 2.5
    lease = claimed(store, ttl)
    untils: list[float] = []
    with Heartbeat(store, lease, ttl) as hb:
        end = time.monotonic() + 2.2 * ttl
        while time.monotonic() < end:
            # read from this thread while the heartbeat thread writes
            assert hb.held
            hb.check()
            until = hb.lease.until
            assert until is not None
            untils.append(until)
            assert store.claim("j", "b", ttl=ttl) is None
            time.sleep(0.05)
        assert hb.held and not hb.lost.is_set()
    state = store.state("j")
    assert state is not None and state.owner == "a" and state.fence == lease.fence
    assert untils == sorted(untils)
    assert len(set(untils)) >= 5  # renewed about every ttl / 3: 6 or 7 times
    assert lease.until is not None and untils[-1] > lease.until + ttl  # renewed past the first ttl


def test_deadline_is_measured_before_each_renewal_is_sent(spy: Spy) -> None:
    ttl = 1.0
    lease = claimed(spy.store, ttl)
    before = time.monotonic()
    with Heartbeat(spy, lease, ttl, interval=0.1) as hb:
        after = time.monotonic()
        # early by the database clock's resolution, twice (the spy does not say it: 2 ms)
        assert hb.margin == 0.002
        assert before + ttl - hb.margin <= hb.deadline <= after + ttl - hb.margin
        seen = spy.renewals  # renewal `seen` had not begun at `after`, so the next one was sent later
        # once renewal seen + 2 has begun, renewal seen + 1 has returned (they run one by one),
        # however long this thread was kept from running after `after` on a loaded machine
        assert wait_until(lambda: spy.renewals >= seen + 3, 1 + SLACK)
        # the deadline advanced with the renewals, and is never later than one ttl from now
        assert after + ttl - hb.margin < hb.deadline <= time.monotonic() + ttl - hb.margin


def test_renewals_use_the_database_clock_unless_a_clock_is_given(spy: Spy) -> None:
    ttl = 1.0
    with Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=0.05):
        assert wait_until(lambda: spy.renewals >= 3, 1 + SLACK)
    assert set(spy.nows) == {None}


def test_a_caller_clock_is_passed_to_every_renewal(spy: Spy) -> None:
    ttl = 1.0
    clock = FakeClock()
    lease = claimed(spy.store, ttl, now=clock())
    with Heartbeat(spy, lease, ttl, interval=0.05, clock=clock) as hb:
        assert wait_until(lambda: spy.renewals >= 3, 1 + SLACK)
    latest = hb.lease  # after stop() joined the thread: the last renewal
    nows = [n for n in spy.nows if n is not None]
    assert len(nows) == spy.renewals and nows == sorted(nows)
    assert latest.until in {n + ttl for n in nows}
    state = spy.store.state("j")
    assert state is not None and state.until == latest.until


# -- losing it --------------------------------------------------------------------------------


def steal_by_revoking(engine: Engine, store: JobStore, lease: Lease, clock: FakeClock | None) -> None:
    revoke(engine, store)


def steal_with_a_fast_clock(engine: Engine, store: JobStore, lease: Lease, clock: FakeClock | None) -> None:
    assert lease.until is not None
    # a thief whose clock runs a minute ahead sees the lease expired and takes it
    assert store.claim("j", "thief", ttl=10.0, now=lease.until + 60) is not None


@pytest.mark.parametrize(
    ("steal", "with_clock"),
    [(steal_by_revoking, False), (steal_with_a_fast_clock, True)],
    ids=["revoked", "stolen-by-a-fast-clock"],
)
def test_loss_is_reported_within_one_renewal_period(
    engine: Engine,
    spy: Spy,
    lost_calls: list[tuple[Heartbeat, str]],
    steal: Callable[[Engine, JobStore, Lease, FakeClock | None], None],
    with_clock: bool,
) -> None:
    ttl, interval = 0.9, 0.2
    clock = FakeClock() if with_clock else None
    lease = claimed(spy.store, ttl, now=clock() if clock else None)
    with Heartbeat(spy, lease, ttl, interval=interval, clock=clock, on_lost=recorder(lost_calls)) as hb:
        steal(engine, spy.store, hb.lease, clock)
        stolen_at = time.monotonic()
        assert hb.lost.wait(interval + SLACK)
        assert time.monotonic() - stolen_at <= interval + SLACK
        assert not hb.held
        with pytest.raises(LeaseLost, match="refused"):
            hb.check()
        assert hb.reason is not None and "refused" in hb.reason
        assert hb.error is None
        assert wait_until(lambda: len(lost_calls) == 1, SLACK)
    assert len(lost_calls) == 1
    assert lost_calls[0][0] is hb
    assert lost_calls[0][1].startswith("fencing-heartbeat")
    assert isinstance(LeaseLost("x"), FencingError)


def test_a_refused_renewal_says_the_stores_own_reason(engine: Engine, spy: Spy) -> None:
    """The loss says why the store refused the renewal (its Refusal), without reading again."""
    ttl, interval = 0.6, 0.05
    lease = claimed(spy.store, ttl)
    with Heartbeat(spy, lease, ttl, interval=interval) as hb:
        assert spy.store.delete(lease.job_id)
        assert hb.lost.wait(interval + SLACK)
        assert hb.reason == "a renewal was refused (deleted)"
    with Heartbeat(spy, claimed(spy.store, ttl, job_id="k"), ttl, interval=interval) as hb:
        revoke(engine, spy.store, "k")
        assert hb.lost.wait(interval + SLACK)
        assert hb.reason == "a renewal was refused (stale fence)"
        with pytest.raises(LeaseLost) as lost:
            hb.check()
        assert lost.value.reason == "stale fence"


def test_a_lost_lease_is_never_renewed_again(engine: Engine, spy: Spy) -> None:
    ttl, interval = 0.6, 0.05
    lease = claimed(spy.store, ttl)
    with Heartbeat(spy, lease, ttl, interval=interval) as hb:
        assert wait_until(lambda: spy.renewals >= 2, 1 + SLACK)
        revoke(engine, spy.store)
        assert hb.lost.wait(interval + SLACK)
        calls = spy.renewals
        time.sleep(4 * interval)
        assert spy.renewals == calls
        assert not hb.held
    assert spy.renewals == calls
    assert spy.threads == {"MainThread", f"fencing-heartbeat-{lease.job_id}"}


def test_held_turns_false_at_the_local_deadline_even_if_the_renewal_hangs(
    spy: Spy, lost_calls: list[tuple[Heartbeat, str]]
) -> None:
    ttl, interval = 0.5, 0.1
    lease = claimed(spy.store, ttl)
    hanging = threading.Event()
    let_go = threading.Event()

    def hang(n: int, lease: Lease) -> Lease | None:
        if n == 0:
            return None
        hanging.set()
        let_go.wait(10)
        # a late success must not bring the lease back
        return dataclasses.replace(lease, until=math.inf)

    spy.disturb = hang
    try:
        with Heartbeat(spy, lease, ttl, interval=interval, on_lost=recorder(lost_calls)) as hb:
            assert hanging.wait(interval + SLACK)
            deadline = hb.deadline
            if time.monotonic() < deadline - 0.05:
                assert hb.held
            assert wait_until(lambda: time.monotonic() >= deadline, ttl + SLACK)
            assert not hb.held
            assert hb.lost.is_set()
            with pytest.raises(LeaseLost, match="deadline"):
                hb.check()
            assert lost_calls == []  # the heartbeat thread is still stuck
            let_go.set()
            assert wait_until(lambda: len(lost_calls) == 1, SLACK)
            assert not hb.held
            assert hb.lease.until != math.inf
            assert hb.deadline == deadline
    finally:
        let_go.set()
    assert len(lost_calls) == 1
    assert spy.renewals == 2


def test_a_transient_database_error_is_retried_before_the_deadline(spy: Spy) -> None:
    ttl, interval = 0.8, 0.2

    def fail_twice(n: int, lease: Lease) -> Lease | None:
        if n in (1, 2):
            raise DatabaseError("connection reset")
        return None

    spy.disturb = fail_twice
    with Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=interval) as hb:
        # first failure after one interval, retries every interval / 4
        assert wait_until(lambda: spy.renewals >= 4, interval + 3 * interval / 4 + SLACK)
        assert hb.held and not hb.lost.is_set()
        assert hb.deadline > time.monotonic() + ttl - interval - SLACK
    assert hb.error is None


def test_database_errors_past_the_deadline_lose_the_lease(
    spy: Spy, lost_calls: list[tuple[Heartbeat, str]], caplog: pytest.LogCaptureFixture
) -> None:
    ttl, interval = 0.5, 0.15

    def fail_after_start(n: int, lease: Lease) -> Lease | None:
        if n:
            raise DatabaseError("server down")
        return None

    spy.disturb = fail_after_start
    caplog.set_level(logging.WARNING, logger="fencing.heartbeat")
    with Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=interval, on_lost=recorder(lost_calls)) as hb:
        deadline = hb.deadline
        assert hb.lost.wait(ttl + SLACK)
        assert time.monotonic() >= deadline
        assert not hb.held
        assert isinstance(hb.error, DatabaseError)
        assert hb.reason is not None and "server down" in hb.reason
        retries = spy.renewals - 1
        assert retries >= 3  # retried at a short interval, not once per interval
    assert len(lost_calls) == 1
    assert "server down" in caplog.text


def test_an_unexpected_error_in_a_renewal_loses_the_lease_inside_the_thread(
    spy: Spy, lost_calls: list[tuple[Heartbeat, str]]
) -> None:
    ttl, interval = 1.0, 0.05

    def bug(n: int, lease: Lease) -> Lease | None:
        if n:
            raise ZeroDivisionError("a bug")
        return None

    spy.disturb = bug
    # filterwarnings=error: an exception escaping the thread would fail this test
    with Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=interval, on_lost=recorder(lost_calls)) as hb:
        assert hb.lost.wait(interval + SLACK)
        assert isinstance(hb.error, ZeroDivisionError)
        assert spy.renewals == 2
    assert len(lost_calls) == 1


def test_an_on_lost_that_raises_or_stops_is_contained(
    engine: Engine, spy: Spy, caplog: pytest.LogCaptureFixture
) -> None:
    ttl, interval = 1.0, 0.05
    calls = []

    def on_lost(hb: Heartbeat) -> None:
        calls.append(hb)
        hb.stop()  # from the heartbeat thread itself: must not deadlock
        raise RuntimeError("callback bug")

    with Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=interval, on_lost=on_lost) as hb:
        revoke(engine, spy.store)
        assert wait_until(lambda: bool(calls), interval + SLACK)
    assert calls == [hb]
    assert "callback bug" in caplog.text


def test_the_caller_clock_reaching_until_loses_the_lease_without_a_renewal(
    spy: Spy, lost_calls: list[tuple[Heartbeat, str]]
) -> None:
    ttl, interval = 1.0, 0.2
    clock = FakeClock()
    lease = claimed(spy.store, ttl, now=clock())
    with Heartbeat(spy, lease, ttl, interval=interval, clock=clock, on_lost=recorder(lost_calls)) as hb:
        calls = spy.renewals
        clock.jump(ttl)  # until == now is expired
        assert not hb.held
        with pytest.raises(LeaseLost, match="clock"):
            hb.check()
        assert wait_until(lambda: len(lost_calls) == 1, interval + SLACK)
    assert spy.renewals == calls  # an expired lease is not even sent


def test_starting_on_a_lost_lease_raises_and_starts_no_thread(
    engine: Engine, spy: Spy, lost_calls: list[tuple[Heartbeat, str]]
) -> None:
    ttl = 1.0
    lease = claimed(spy.store, ttl)
    revoke(engine, spy.store)
    hb = Heartbeat(spy, lease, ttl, on_lost=recorder(lost_calls))
    with pytest.raises(LeaseLost, match="first renewal was refused"), hb:
        pytest.fail("the block must not run")
    assert hb.lost.is_set() and not hb.held
    assert spy.threads == {"MainThread"}
    assert lost_calls == []


def test_held_is_false_before_start_and_start_twice_is_an_error(spy: Spy) -> None:
    ttl = 1.0
    hb = Heartbeat(spy, claimed(spy.store, ttl), ttl)
    assert not hb.held and not hb.lost.is_set()
    with pytest.raises(LeaseLost, match="no renewal"):
        hb.check()
    hb.stop()  # harmless before start
    with hb:
        assert hb.held
        with pytest.raises(RuntimeError, match="once"):
            hb.start()
    with pytest.raises(RuntimeError, match="once"), hb:
        pass


# -- stopping and releasing ---------------------------------------------------------------------


def test_stop_is_prompt(spy: Spy) -> None:
    # prompt: well within the interval it would otherwise sleep out (a 10 s interval, so a
    # loaded machine's stall of a second or two does not read as waiting for it)
    ttl, interval = 30.0, 10.0
    hb = Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=interval).start()
    time.sleep(0.05)
    began = time.monotonic()
    hb.stop()
    assert time.monotonic() - began < 3.0 < interval
    assert spy.renewals == 1
    hb.stop()  # idempotent
    assert hb.held  # stopping is not releasing: the lease runs to its until


def test_exit_keeps_the_lease_by_default(spy: Spy) -> None:
    ttl = 1.0
    with Heartbeat(spy, claimed(spy.store, ttl), ttl) as hb:
        pass
    assert spy.released == []
    assert hb.held
    assert spy.store.claim("j", "b", ttl=ttl) is None


def test_release_on_exit_gives_the_lease_back(spy: Spy) -> None:
    ttl = 1.0
    lease = claimed(spy.store, ttl)
    with Heartbeat(spy, lease, ttl, release_on_exit=True) as hb:
        pass
    assert spy.released == [hb.lease]
    assert not hb.held and not hb.lost.is_set()
    with pytest.raises(LeaseLost, match="released"):
        hb.check()
    taken = spy.store.claim("j", "b", ttl=ttl)
    assert taken is not None and taken.fence == lease.fence + 1


@pytest.mark.parametrize("release_on_error", [True, False])
def test_an_error_in_the_block_releases_the_lease_unless_told_not_to(
    spy: Spy, release_on_error: bool
) -> None:
    ttl = 1.0
    with (
        pytest.raises(KeyError, match="boom"),
        Heartbeat(spy, claimed(spy.store, ttl), ttl, release_on_error=release_on_error),
    ):
        raise KeyError("boom")
    assert len(spy.released) == int(release_on_error)
    assert (spy.store.claim("j", "b", ttl=ttl) is not None) is release_on_error


def test_a_failing_release_never_masks_the_blocks_error(spy: Spy, caplog: pytest.LogCaptureFixture) -> None:
    ttl = 1.0
    spy.fail_release = True
    with pytest.raises(KeyError, match="boom"), Heartbeat(spy, claimed(spy.store, ttl), ttl):
        raise KeyError("boom")
    assert len(spy.released) == 1
    assert "server went away" in caplog.text


def test_a_failing_release_on_a_clean_exit_is_logged_not_raised(
    spy: Spy, caplog: pytest.LogCaptureFixture
) -> None:
    ttl = 1.0
    spy.fail_release = True
    with Heartbeat(spy, claimed(spy.store, ttl), ttl, release_on_exit=True) as hb:
        pass
    assert len(spy.released) == 1 and not hb.held
    assert "server went away" in caplog.text


def test_a_lost_lease_is_not_released(engine: Engine, spy: Spy) -> None:
    ttl, interval = 1.0, 0.05
    with Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=interval, release_on_exit=True) as hb:
        revoke(engine, spy.store)
        assert hb.lost.wait(interval + SLACK)
    assert spy.released == []


# -- arguments ----------------------------------------------------------------------------------


class NoDatabase:
    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | None:
        raise AssertionError("bad arguments must be refused before any database work")

    def release(self, lease: Lease) -> bool:
        raise AssertionError("bad arguments must be refused before any database work")


LEASE = Lease("j", "a", 1, 10.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": 0},
        {"ttl": -1.0},
        {"ttl": math.nan},
        {"ttl": math.inf},
        {"ttl": 1.0, "interval": 1.0},
        {"ttl": 1.0, "interval": 2},
        {"ttl": 1.0, "interval": 0},
        {"ttl": 1.0, "interval": -0.1},
        {"ttl": 1.0, "interval": math.nan},
        {"ttl": 1.0, "interval": math.inf},
    ],
)
def test_bad_durations_are_invalid_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        Heartbeat(NoDatabase(), LEASE, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((NoDatabase(), ("j", "a", 1), 1.0), {}),
        ((NoDatabase(), None, 1.0), {}),
        ((NoDatabase(), {"job_id": "j"}, 1.0), {}),
        ((object(), LEASE, 1.0), {}),
        ((NoDatabase(), LEASE, "1"), {}),
        ((NoDatabase(), LEASE, True), {}),
        ((NoDatabase(), LEASE, 1.0), {"interval": "0.1"}),
        ((NoDatabase(), LEASE, 1.0), {"interval": True}),
        ((NoDatabase(), LEASE, 1.0), {"clock": 5.0}),
        ((NoDatabase(), LEASE, 1.0), {"on_lost": "print"}),
        ((NoDatabase(), LEASE, 1.0), {"release_on_exit": 1}),
        ((NoDatabase(), LEASE, 1.0), {"release_on_error": None}),
    ],
)
def test_wrong_types_are_invalid_argument_types(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentType):
        Heartbeat(*args, **kwargs)


def test_the_default_interval_is_a_third_of_the_ttl() -> None:
    hb = Heartbeat(NoDatabase(), LEASE, 0.9)
    assert hb.ttl == 0.9 and hb.interval == pytest.approx(0.3)


def test_stopping_before_complete_reports_no_loss(spy: Spy, lost_calls: list[tuple[Heartbeat, str]]) -> None:
    ttl, interval = 1.0, 0.02
    with Heartbeat(spy, claimed(spy.store, ttl), ttl, interval=interval, on_lost=recorder(lost_calls)) as hb:
        assert wait_until(lambda: spy.renewals >= 3, 1 + SLACK)
        hb.stop()
        hb.check()
        assert spy.store.complete(hb.lease, "done")
        time.sleep(3 * interval)
    assert lost_calls == [] and not hb.lost.is_set()
