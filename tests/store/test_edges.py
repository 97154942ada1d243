"""The edges of the guarantee: the last fence, a TTL below the database clock's tick, numbers
too large for a float, and MariaDB's claim_next reading back only what its UPDATE claimed."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from sqlalchemy import Engine, event, select, update

import service
from fencing import (
    FencesExhausted,
    FencingError,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    Lease,
    jobs,
)
from fencing._sql.checks import (
    DATABASE_CLOCK_MIN_TTL,
    FENCE_MAX,
    check_database_ttl,
    check_interval,
    check_now,
    check_time,
    check_ttl,
)
from fencing._sql.schema import as_text
from tests import backends

pytestmark = pytest.mark.dialect

# -- helpers ----------------------------------------------------------------------------------------


def set_fence(engine: Engine, job_id: str, fence: int, **values: Any) -> None:
    """Put a job's fence (and any other column) where a test needs it, behind the store's back."""
    with engine.begin() as conn:
        conn.execute(update(jobs).where(as_text(jobs.c.id) == job_id).values(fence=fence, **values))


def rows(engine: Engine) -> list[tuple[Any, ...]]:
    """Every row of the jobs table, ids as text: what "nothing changed" compares."""
    t = jobs
    with engine.connect() as conn:
        got = conn.execute(
            select(as_text(t.c.id), as_text(t.c.owner), t.c.until, t.c.fence, t.c.result, t.c.done)
        )
        return sorted(tuple(row) for row in got)


# -- item 3: the last fence -------------------------------------------------------------------------


def test_claim_at_the_last_fence_raises_fences_exhausted_and_changes_nothing(store: JobStore) -> None:
    assert store.enqueue("j", ready_at=0.0)
    set_fence(store.engine, "j", FENCE_MAX)
    before = rows(store.engine)
    for now in (100.0, None):
        with pytest.raises(FencesExhausted, match=r"^job 'j' has handed out its last fence") as caught:
            store.claim("j", "w", ttl=30.0, now=now)
        assert "can never be claimed or revoked again" in str(caught.value)
        assert isinstance(caught.value, FencingError)
    assert rows(store.engine) == before
    state = store.state("j")
    assert state is not None and state.fence == FENCE_MAX and type(state.fence) is int


def test_the_last_fence_is_handed_out_once(store: JobStore) -> None:
    assert store.enqueue("j", ready_at=0.0)
    set_fence(store.engine, "j", FENCE_MAX - 1)
    last = store.claim("j", "a", ttl=10.0, now=100.0)
    assert last == Lease("j", "a", FENCE_MAX, 110.0)
    # held: the others are told at once that the job has no fence left for them
    with pytest.raises(FencesExhausted):
        store.claim("j", "b", ttl=10.0, now=105.0)
    # expired: still no second claimer ever gets FENCE_MAX (or a float above it)
    for owner in ("b", "c", "d"):
        with pytest.raises(FencesExhausted):
            store.claim("j", owner, ttl=10.0, now=200.0)
    state = store.state("j")
    assert state is not None and state.fence == FENCE_MAX and state.owner == "a"


def test_claim_many_at_the_last_fence_hands_out_nothing(store: JobStore) -> None:
    assert store.enqueue("j", ready_at=0.0)
    set_fence(store.engine, "j", FENCE_MAX)
    before = rows(store.engine)
    with pytest.raises(FencesExhausted):
        store.claim_many("j", [f"w{i}" for i in range(3)], ttl=30.0, now=100.0)
    assert rows(store.engine) == before


def test_revoke_at_the_last_fence_raises_and_keeps_the_lease(store: JobStore) -> None:
    assert store.enqueue("j", ready_at=0.0)
    set_fence(store.engine, "j", FENCE_MAX - 1)
    lease = store.claim("j", "a", ttl=50.0, now=100.0)
    assert lease is not None and lease.fence == FENCE_MAX
    before = rows(store.engine)
    # a revoke that cannot move the fence on would leave the holder's token valid: never True
    with pytest.raises(FencesExhausted, match="can never be claimed or revoked again"):
        store.revoke("j")
    assert rows(store.engine) == before
    assert store.complete(lease, "last", now=110.0) is True  # the holder of the last fence finishes


def test_revoke_below_the_last_fence_still_moves_it_on(store: JobStore) -> None:
    assert store.enqueue("j", ready_at=0.0)
    set_fence(store.engine, "j", FENCE_MAX - 1)
    assert store.revoke("j") is True
    assert store.state("j").fence == FENCE_MAX  # type: ignore[union-attr]
    with pytest.raises(FencesExhausted):
        store.revoke("j")


def test_refusals_that_are_not_the_last_fence_stay_false_or_none(store: JobStore) -> None:
    assert store.enqueue("held", ready_at=0.0)
    assert store.claim("held", "a", ttl=50.0, now=100.0) is not None
    assert store.claim("held", "b", ttl=50.0, now=110.0) is None
    assert store.claim("missing", "b", ttl=50.0, now=110.0) is None
    assert store.revoke("missing") is False
    # a done job at the last fence is simply done: None and False, as for any done job
    assert store.enqueue("done", ready_at=0.0)
    set_fence(store.engine, "done", FENCE_MAX, done=1)
    assert store.claim("done", "b", ttl=50.0, now=110.0) is None
    assert store.revoke("done") is False


@pytest.mark.parametrize("now", [100.0, None])
def test_claim_next_skips_jobs_at_the_last_fence(store: JobStore, now: float | None) -> None:
    for job_id in ("a-last", "b-free"):
        assert store.enqueue(job_id, ready_at=0.0)
    set_fence(store.engine, "a-last", FENCE_MAX)
    got = store.claim_next("w", ttl=30.0, now=now, limit=5)
    assert [(lease.job_id, lease.fence) for lease in got] == [("b-free", 1)]
    assert store.claim_next("w2", ttl=30.0, now=now, limit=5) == []
    assert store.state("a-last").fence == FENCE_MAX  # type: ignore[union-attr]
    assert store.state("a-last").owner is None  # type: ignore[union-attr]


def test_service_claim_at_the_last_fence_raises_fences_exhausted(target: str) -> None:
    service.init_db(target)
    assert service.enqueue(target, "j")
    engine = backends.engine_for(target)
    try:
        set_fence(engine, "j", FENCE_MAX)
    finally:
        engine.dispose()
    # the contract has no answer for a fence that cannot go up: None would say "held, try later"
    with pytest.raises(FencesExhausted):
        service.claim(target, "j", "w", 100.0, 10.0)
    with pytest.raises(FencesExhausted):
        service.claim_many(target, "j", ["a", "b"], 100.0, 10.0)
    assert service.state(target, "j") == {
        "id": "j",
        "owner": None,
        "until": 0.0,
        "fence": FENCE_MAX,
        "result": None,
        "done": 0,
    }


# -- item 4: a TTL below the database clock's tick --------------------------------------------------


def test_the_database_clock_floor_is_one_millisecond() -> None:
    assert DATABASE_CLOCK_MIN_TTL == 0.001
    assert check_database_ttl(0.001) == 0.001
    with pytest.raises(InvalidArgument, match=r"^delay must be at least 0\.001 s"):
        check_database_ttl(5e-4, name="delay")


@pytest.mark.parametrize("ttl", [1e-9, 5e-4, 0.000999])
def test_a_ttl_below_the_database_clock_tick_is_refused_and_changes_nothing(
    store: JobStore, ttl: float
) -> None:
    assert store.enqueue("free", ready_at=0.0)
    assert store.enqueue("held", ready_at=0.0)
    lease = store.claim("held", "w", ttl=60.0)
    assert lease is not None
    before = rows(store.engine)
    message = rf"^{{name}} must be at least 0\.001 s with the database's clock \(now=None\), got {ttl!r}"
    calls = {
        "ttl": [
            lambda: store.claim("free", "w", ttl=ttl),
            lambda: store.claim_many("free", ["a", "b"], ttl=ttl),
            lambda: store.claim_next("w", ttl=ttl),
            lambda: store.renew(lease, ttl=ttl),
        ],
        "delay": [lambda: store.release(lease, delay=ttl)],
    }
    for name, each in calls.items():
        for call in each:
            with pytest.raises(InvalidArgument, match=message.replace("{name}", name)):
                call()
    assert rows(store.engine) == before


def test_a_short_ttl_on_the_callers_clock_keeps_its_own_rule(store: JobStore) -> None:
    # the floor is the database clock's: the caller's clock is refused only below its resolution
    assert store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", ttl=1e-9, now=100.0)
    assert lease is not None and lease.until == 100.0 + 1e-9


def test_service_refuses_a_ttl_below_the_database_clock_tick(target: str) -> None:
    service.init_db(target)
    assert service.enqueue(target, "j")
    for call in (
        lambda: service.claim(target, "j", "w", None, 5e-4),
        lambda: service.claim_many(target, "j", ["a", "b"], None, 1e-9),
    ):
        with pytest.raises(ValueError, match=r"must be at least 0\.001 s"):
            call()
    assert service.state(target, "j")["fence"] == 0  # type: ignore[index]


def test_claim_many_on_the_database_clock_has_exactly_one_winner(store: JobStore) -> None:
    assert store.enqueue("j")
    got = store.claim_many("j", [f"w{i}" for i in range(8)], ttl=30.0)
    winners = [lease for lease in got if lease is not None]
    assert len(winners) == 1 and winners[0].fence == 1
    assert store.state("j").owner == winners[0].owner  # type: ignore[union-attr]


# -- item 6: numbers too large for a float ----------------------------------------------------------

HUGE = [10**400, -(10**400), Fraction(10**400), Fraction(-(10**400), 3), 10**5000]


@pytest.mark.parametrize(
    "value", HUGE, ids=["int", "negative-int", "Fraction", "negative-Fraction", "int-5000"]
)
def test_a_number_beyond_a_float_is_invalid_argument(value: Any) -> None:
    for check in (check_now, lambda v: check_time("ready_at", v), check_ttl):
        with pytest.raises(InvalidArgument, match=r"must be a finite number within a float's range"):
            check(value)
    with pytest.raises(InvalidArgument, match=r"^interval must be > 0 and < ttl \(10\.0\)"):
        check_interval(value, 10.0)


def test_a_decimal_is_refused_by_type_whatever_its_size() -> None:
    for value in (Decimal("1e400"), Decimal("1")):
        with pytest.raises(
            InvalidArgumentType, match=r"^ttl must be a real number \(int or float\), got Decimal"
        ):
            check_ttl(value)


def test_check_interval_keeps_the_heartbeat_rules() -> None:
    assert check_interval(None, 9.0) == 3.0
    assert check_interval(1, 9.0) == 1.0 and type(check_interval(1, 9.0)) is float
    assert check_interval(Fraction(1, 2), 9.0) == 0.5
    for bad in (0, -1, 9, 9.5, math.nan, math.inf, -math.inf):
        with pytest.raises(InvalidArgument, match=r"^interval must be > 0 and < ttl \(9\.0\), got "):
            check_interval(bad, 9.0)
    for wrong in (True, "1", Decimal("1")):
        with pytest.raises(
            InvalidArgumentType, match=r"^interval must be a real number \(int or float\) or None"
        ):
            check_interval(wrong, 9.0)


def test_every_store_entry_point_refuses_a_huge_number_by_name(store: JobStore) -> None:
    assert store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", ttl=50.0, now=100.0)
    assert lease is not None
    before = rows(store.engine)
    huge = 10**400
    calls = {
        "now": [
            lambda: store.claim("j", "w", ttl=10, now=huge),
            lambda: store.complete(lease, "r", now=huge),
            lambda: store.check(lease, now=huge),
            lambda: store.poisoned(3, now=-huge),
        ],
        "ttl": [
            lambda: store.claim("j", "w", ttl=huge, now=100.0),
            lambda: store.claim("j", "w", ttl=Fraction(huge)),
            lambda: store.renew(lease, ttl=huge),
            lambda: store.claim_next("w", ttl=huge),
            lambda: store.claim_many("j", ["a"], ttl=huge),
        ],
        "ready_at": [lambda: store.enqueue("new", ready_at=huge)],
        "delay": [lambda: store.release(lease, delay=huge, now=100.0)],
    }
    for name, each in calls.items():
        for call in each:
            with pytest.raises(
                InvalidArgument, match=rf"^{name} must be a finite number within a float's range"
            ):
                call()
    for count in ("limit", "max_attempts"):
        with pytest.raises(
            InvalidArgument, match=rf"^{count} must be between 1 and 2\*\*63-1, got an int of "
        ):
            store.claim_next("w", ttl=10, now=100.0, **{count: 10**5000})
    assert rows(store.engine) == before


def test_the_harness_and_the_demo_refuse_a_huge_number_by_name() -> None:
    from fencing.cli import demo
    from fencing.torture import TortureConfig

    for name in ("ttl", "seconds", "drain"):
        with pytest.raises(InvalidArgument, match=rf"^{name} must be a finite number of seconds, got 1000"):
            TortureConfig(url="-", **{name: 10**400})
    with pytest.raises(
        InvalidArgument, match=r"^workers must be between 1 and 256, got an int of 16610 bits$"
    ):
        TortureConfig(url="-", workers=10**5000)
    with pytest.raises(
        InvalidArgument, match=r"^release_rate must be a probability in \[0, 1\], got an int of "
    ):
        TortureConfig(url="-", release_rate=-(10**5000))
    with pytest.raises(InvalidArgument, match=r"^ttl must be a finite number within a float's range"):
        demo.run_demo(10**400)
    with pytest.raises(InvalidArgument, match=r"^ttl must be at least 0\.1 s, got 0\.01$"):
        demo.run_demo(0.01)


# -- item 7: MariaDB's claim_next returns only the rows its UPDATE claimed ------------------------


@pytest.fixture
def stepping_engine(target: str) -> Iterator[tuple[Engine, list[str]]]:
    """An engine that runs the SQL in ``inject`` on the claim's own connection (its
    transaction) just before claim_next's UPDATE (``UPDATE jobs SET owner``) on MariaDB:
    as a change between the pick and the UPDATE, or a server clock stepped back there
    (``SET timestamp``, which ``UTC_TIMESTAMP`` follows; put back after the UPDATE)."""
    eng = backends.engine_for(target)
    inject: list[str] = []

    def run(sql: str, cursor: Any) -> None:
        extra = cursor.connection.cursor()
        try:
            extra.execute(sql)
        finally:
            extra.close()

    @event.listens_for(eng, "before_cursor_execute")
    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if inject and statement.lstrip().upper().startswith("UPDATE JOBS SET OWNER"):
            for sql in inject:
                run(sql, cursor)

    @event.listens_for(eng, "after_cursor_execute")
    def after(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if inject and statement.lstrip().upper().startswith("UPDATE JOBS SET OWNER"):
            run("SET timestamp = DEFAULT", cursor)

    try:
        yield eng, inject
    finally:
        eng.dispose()


@pytest.mark.backend("mariadb", "mysql")
def test_mariadb_session_timestamp_steps_the_database_clock(engine: Engine) -> None:
    """What the next test relies on: ``SET timestamp`` moves ``UTC_TIMESTAMP(6)``."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET timestamp = 1000000")
        stepped = conn.exec_driver_sql(
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) * 1e-6"
        ).scalar_one()
        conn.exec_driver_sql("SET timestamp = DEFAULT")
    assert float(stepped) == 1_000_000.0


@pytest.mark.backend("mariadb", "mysql")
def test_mariadb_claim_next_judges_its_rows_at_the_instant_its_pick_read(
    stepping_engine: tuple[Engine, list[str]],
) -> None:
    # the pick reads the database's clock and the UPDATE claims at that instant: a server
    # clock stepped back in between changes nothing, and every lease returned is the row stored
    engine, inject = stepping_engine
    store = JobStore(engine)
    store.create_table()
    assert store.enqueue("old", ready_at=0.0)
    assert store.enqueue("new", ready_at=0.0)
    now = time.time()
    expired = store.claim("old", "w", ttl=10.0, now=now - 100.0)
    assert expired is not None and expired.fence == 1
    inject.append(f"SET timestamp = {now - 1000.0!r}")
    got = store.claim_next("w", ttl=30.0, limit=2)
    inject.clear()
    assert sorted((lease.job_id, lease.fence) for lease in got) == [("new", 1), ("old", 2)]
    for lease in got:
        state = store.state(lease.job_id)
        assert state is not None and (state.owner, state.fence, state.until) == (
            "w",
            lease.fence,
            lease.until,
        )
        assert lease.until >= now + 30.0 - 1.0  # the pick's instant, not the stepped clock's
    assert not store.complete(expired, "late")  # the old token is stale


@pytest.mark.backend("mariadb", "mysql")
def test_mariadb_claim_next_never_returns_a_row_its_update_did_not_claim(
    stepping_engine: tuple[Engine, list[str]],
) -> None:
    engine, inject = stepping_engine
    store = JobStore(engine)
    store.create_table()
    assert store.enqueue("old", ready_at=0.0)
    assert store.enqueue("new", ready_at=0.0)
    # "old" was leased to this very owner name before, and that lease has expired
    now = time.time()
    expired = store.claim("old", "w", ttl=10.0, now=now - 100.0)
    assert expired is not None and expired.fence == 1
    # between the pick and the UPDATE, "old" stops being ready (done, in the claim's own
    # transaction, which holds its row lock): the UPDATE claims "new" alone, and "old", which
    # still names this owner from its expired lease, must not come back with its old fence
    inject.append("UPDATE jobs SET done = 1 WHERE id = 'old'")
    got = store.claim_next("w", ttl=30.0, limit=2)
    inject.clear()
    assert [(lease.job_id, lease.fence) for lease in got] == [("new", 1)]
    state = store.state("old")
    assert state is not None and (state.owner, state.fence) == ("w", 1)  # not claimed
    assert not store.complete(expired, "late")


def test_claim_next_returns_what_it_claimed_on_every_backend(store: JobStore) -> None:
    for job_id in ("a", "b", "c"):
        assert store.enqueue(job_id, ready_at=0.0)
    first = store.claim("a", "w", ttl=10.0, now=100.0)
    assert first is not None
    # the same owner name takes its expired job again: a new fence, never the old one
    got = store.claim_next("w", ttl=30.0, now=200.0, limit=3)
    assert sorted((lease.job_id, lease.fence) for lease in got) == [("a", 2), ("b", 1), ("c", 1)]
    assert all(lease.until == 230.0 for lease in got)
