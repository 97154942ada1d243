"""Schedules (:class:`fencing.Scheduler`), on the database under test: each tick one job,
once, ever, whatever number of schedulers run, whatever their clocks do.

The schedulers here run on a caller's clock the test moves (``clock=``), so every pass is
deterministic; the database's clock (the default) has a test of its own. A model of the
rules (:func:`expected`) is checked against the database by hypothesis: any sequence of
clock moves, forward or back, small or past many ticks, and any policy.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, MetaData, select

from fencing import (
    ConfigurationError,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    Schedule,
    Scheduler,
    TableMissing,
    jobs_table,
    payloads_table,
    schedules_table,
)

pytestmark = pytest.mark.sync_only("a scheduler runs on a sync store")

#: 2026-12-07 00:00:00 UTC
T0 = 1796601600


class Clock:
    """A caller's clock the test moves."""

    def __init__(self, now: float = T0) -> None:
        self.now = float(now)

    def __call__(self) -> float:
        return self.now


def ticks_in(store: JobStore, name: str) -> list[str]:
    """The job ids of ``name``'s ticks, deleted ones included (the row stays as a tombstone)."""
    t = store.table
    with store.engine.connect() as conn:
        ids = conn.execute(select(t.c.id)).scalars().all()
    found = [i.decode() if isinstance(i, bytes) else i for i in ids]
    return sorted(i for i in found if i.startswith(f"{name}@"))


def at(offset: int) -> str:
    return (dt.datetime.fromtimestamp(T0 + offset, dt.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def made(store: JobStore) -> Any:
    """A scheduler maker on the test's store, its table created once."""

    def make(*schedules: Schedule, clock: Clock, **kw: Any) -> Scheduler:
        scheduler = Scheduler(store, schedules, clock=clock, **kw)
        scheduler.create_table()
        return scheduler

    return make


def test_each_tick_becomes_one_job_named_by_the_schedule_and_its_instant(store: JobStore, made: Any) -> None:
    clock = Clock(T0 + 5)
    scheduler = made(Schedule("minutely", every=60), clock=clock)
    assert scheduler.run_pending() == []  # new: its first tick is the next one
    assert scheduler.next_tick() == T0 + 60
    clock.now = T0 + 59.999
    assert scheduler.run_pending() == []
    clock.now = T0 + 60
    assert scheduler.run_pending() == [f"minutely@{at(60)}"]
    assert scheduler.run_pending() == []  # decided: never again
    clock.now = T0 + 185
    assert scheduler.run_pending() == [f"minutely@{at(180)}"]  # 120 was missed: the latest only
    [lease] = store.claim_next("w", ttl=30)
    assert lease.job_id == f"minutely@{at(60)}"
    [row] = scheduler.rows()
    assert row["name"] == "minutely" and row["spec"] == "every 1 min"
    assert (row["decided_through"], row["last_tick"], row["next_tick"]) == (T0 + 185, T0 + 180, T0 + 240)


def test_ticks_carry_their_schedule_and_instant_when_the_store_keeps_payloads(engine: Engine) -> None:
    md = MetaData()
    store = JobStore(engine, jobs_table(md, "sc_jobs"), payloads=payloads_table(md, "sc_payloads"))
    store.create_table()
    clock = Clock(T0)
    scheduler = Scheduler(store, [Schedule("mail", every=10, args={"to": "ops"})], clock=clock)
    scheduler.create_table()
    assert scheduler.table.name == "fencing_schedules" and scheduler.table.metadata is md
    scheduler.run_pending()
    clock.now = T0 + 10
    scheduler.run_pending()
    [lease] = store.claim_next("w", ttl=30)
    assert lease.payload == {"schedule": "mail", "tick": at(10), "args": {"to": "ops"}}


@pytest.mark.parametrize(
    ("missed", "grace", "expected"),
    [
        ("all", 60, [60, 120, 180, 240, 300]),  # each missed tick, oldest first
        ("latest", 60, [300]),  # 300 is on time (5 s late): the missed ones fold into it
        ("latest", 1, [300]),  # 300 late too: the latest of them, once
        ("none", 60, [300]),  # on time only
        ("none", 1, []),  # nothing on time: nothing
    ],
)
def test_ticks_missed_while_nothing_ran_follow_the_policy(
    store: JobStore, made: Any, missed: str, grace: float, expected: list[int]
) -> None:
    clock = Clock(T0)
    scheduler = made(Schedule("s", every=60, missed=missed, grace=grace), clock=clock)
    scheduler.run_pending()
    clock.now = T0 + 305  # five ticks while nothing ran
    assert scheduler.run_pending() == [f"s@{at(o)}" for o in expected]
    clock.now = T0 + 360
    assert scheduler.run_pending() == [f"s@{at(360)}"]  # and on time again


def test_catch_up_bounds_the_missed_ticks_a_pass_keeps_the_latest(store: JobStore, made: Any) -> None:
    clock = Clock(T0)
    scheduler = made(Schedule("s", every=1, missed="all", catch_up=3), clock=clock)
    scheduler.run_pending()
    clock.now = T0 + 10
    assert scheduler.run_pending() == [f"s@{at(o)}" for o in (8, 9, 10)]


def test_a_clock_that_goes_back_enqueues_nothing_twice_and_one_that_jumps_skips_nothing_kept(
    store: JobStore, made: Any
) -> None:
    clock = Clock(T0)
    scheduler = made(Schedule("s", every=10, missed="all", catch_up=1000), clock=clock)
    scheduler.run_pending()
    clock.now = T0 + 30
    assert len(scheduler.run_pending()) == 3
    clock.now = T0 + 5  # back 25 s
    assert scheduler.run_pending() == []
    clock.now = T0 + 30
    assert scheduler.run_pending() == []
    clock.now = T0 + 3600  # forward an hour: every tick in between, once
    assert len(scheduler.run_pending()) == 357
    assert len(ticks_in(store, "s")) == 360


def test_a_done_or_deleted_tick_never_comes_back_even_when_the_schedule_is_reset(
    store: JobStore, made: Any
) -> None:
    clock = Clock(T0)
    scheduler = made(Schedule("s", every=10, missed="all"), clock=clock)
    scheduler.run_pending()
    clock.now = T0 + 20
    first, second = scheduler.run_pending()
    store.complete(store.claim(first, "w", ttl=30), "ran")
    assert store.delete(second)
    # an operator deletes the schedule's row and the clock is behind: the ticks come up again
    with store.engine.begin() as conn:
        conn.execute(scheduler.table.delete())
    clock.now = T0 + 1
    assert scheduler.run_pending() == []  # registered again, from now
    clock.now = T0 + 25
    assert scheduler.run_pending() == []  # 10 done, 20 deleted: both left as they are
    assert store.state(first).result == "ran"
    assert store.state(second) is None
    clock.now = T0 + 30
    assert scheduler.run_pending() == [f"s@{at(30)}"]


def test_any_number_of_schedulers_enqueue_each_tick_once(store: JobStore, target: str) -> None:
    # eight schedulers (threads, each with its own engine: as processes) on one moving clock
    from tests import backends

    clock = Clock(T0)
    schedules = [Schedule("fast", every=1, missed="all"), Schedule("slow", every=7, missed="all")]
    engines = [backends.engine_for(target) for _ in range(8)]
    try:
        schedulers = [Scheduler(JobStore(e), schedules, clock=clock) for e in engines]
        schedulers[0].create_table()
        schedulers[0].run_pending()
        enqueued: list[str] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def run(s: Scheduler) -> None:
            while not stop.is_set():
                try:
                    enqueued.extend(s.run_pending())
                except BaseException as exc:  # the test reports it
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=run, args=(s,)) for s in schedulers]
        for thread in threads:
            thread.start()
        for _ in range(60):
            clock.now += 1
            time.sleep(0.01)
        stop.set()
        for thread in threads:
            thread.join(30)
        for s in schedulers:  # one last pass: what is due at the end is decided
            enqueued.extend(s.run_pending())
    finally:
        for e in engines:
            e.dispose()
    assert errors == []
    assert len(enqueued) == len(set(enqueued))
    counted = [s.store.metrics.snapshot() for s in schedulers]
    assert sum(c.get("schedules.enqueued", 0) for c in counted) == len(enqueued)
    assert sorted(enqueued) == ticks_in(store, "fast") + ticks_in(store, "slow")
    assert ticks_in(store, "fast") == sorted(f"fast@{at(o)}" for o in range(1, 61))
    assert ticks_in(store, "slow") == sorted(f"slow@{at(o)}" for o in range(1, 61) if (T0 + o) % 7 == 0)


def test_on_the_database_clock_by_default(store: JobStore) -> None:
    scheduler = Scheduler(store, [Schedule("s", every=1, missed="all")])
    scheduler.create_table()
    scheduler.run_pending()
    started = time.time()
    time.sleep(2.2)
    enqueued = scheduler.run_pending()
    assert 2 <= len(enqueued) <= 3, enqueued
    nxt = scheduler.next_tick()
    assert nxt is not None and started < nxt < time.time() + 1.5


def test_run_keeps_the_schedule_until_stopped(store: JobStore) -> None:
    scheduler = Scheduler(store, [Schedule("s", every=1, missed="all")], poll=0.2)
    scheduler.create_table()
    scheduler.start()
    try:
        time.sleep(2.5)
    finally:
        scheduler.stop(5)
    assert 1 <= len(ticks_in(store, "s")) <= 3
    # a waiting claim wakes on the tick: it is ready at once
    scheduler.start()
    try:
        [lease] = store.claim_next("w", ttl=30, wait=3) or [None]
    finally:
        scheduler.stop(5)
    assert lease is not None and lease.job_id.startswith("s@")


def test_a_missing_table_is_named(store: JobStore) -> None:
    scheduler = Scheduler(store, [Schedule("s", every=1)], table=schedules_table(MetaData(), "sc_missing"))
    with pytest.raises(TableMissing, match=r"sc_missing.*scheduler\.create_table"):
        scheduler.run_pending()


# -- the model -----------------------------------------------------------------------------------


def expected(moves: list[int], every: int, missed: str, grace: int, catch_up: int) -> set[int]:
    """The ticks a sequence of clock readings enqueues (offsets from T0), by the rules."""
    through = moves[0]
    out: set[int] = set()
    for now in moves[1:]:
        if now <= through:
            continue
        due = [t for t in range(through + 1, now + 1) if (T0 + t) % every == 0]
        on_time = [t for t in due if now - t <= grace][-catch_up:]
        if missed == "all":
            kept = due[-catch_up:]
        elif missed == "latest":
            kept = on_time or due[-1:]
        else:
            kept = on_time
        assert not out & set(kept)
        out |= set(kept)
        through = now
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    moves=st.lists(st.integers(min_value=-300, max_value=900), min_size=2, max_size=12),
    every=st.sampled_from([1, 7, 60]),
    missed=st.sampled_from(["all", "latest", "none"]),
    grace=st.sampled_from([0, 5, 120]),
    catch_up=st.sampled_from([3, 100_000]),
)
def test_the_ticks_are_the_models_under_any_clock(
    store: JobStore, moves: list[int], every: int, missed: str, grace: int, catch_up: int
) -> None:
    table = schedules_table(MetaData(), "sc_model")
    clock = Clock()
    schedule = Schedule("m", every=every, missed=missed, grace=grace, catch_up=catch_up)  # type: ignore[arg-type]
    scheduler = Scheduler(store, [schedule], table=table, clock=clock)
    scheduler.create_table()
    with store.engine.begin() as conn:
        conn.execute(table.delete())
        conn.execute(store.table.delete())
    got: list[str] = []
    for move in moves:
        clock.now = T0 + move
        got.extend(scheduler.run_pending())
    want = {f"m@{at(o)}" for o in expected(moves, every, missed, grace, catch_up)}
    assert len(got) == len(set(got))
    assert set(got) == want
    assert ticks_in(store, "m") == sorted(want)


# -- cron and time zones -------------------------------------------------------------------------


def utc(*args: int) -> int:
    return int(dt.datetime(*args, tzinfo=dt.timezone.utc).timestamp())


def iso(ticks: list[int]) -> list[str]:
    return [dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%m-%dT%H:%MZ") for t in ticks]


def test_cron_in_a_time_zone_runs_a_fixed_hour_once_on_each_day_daylight_saving_included() -> None:
    daily = Schedule("d", cron="30 2 * * *", timezone="Europe/Paris", missed="all")
    # clocks go forward on 2026-03-29 (02:30 does not exist: 03:00 local, as cron does)
    assert iso(daily.due(utc(2026, 3, 27), utc(2026, 3, 31), 100)) == [
        "03-27T01:30Z",
        "03-28T01:30Z",
        "03-29T01:00Z",
        "03-30T00:30Z",
    ]
    # and back on 2026-10-25 (02:30 happens twice: once)
    assert iso(daily.due(utc(2026, 10, 23), utc(2026, 10, 27), 100)) == [
        "10-23T00:30Z",
        "10-24T00:30Z",
        "10-25T00:30Z",
        "10-26T01:30Z",
    ]
    assert daily.next_after(utc(2026, 10, 25, 0, 30)) == utc(2026, 10, 26, 1, 30)
    # an hour field of * runs in both of the repeated hours, as cron does
    half_hourly = Schedule("h", cron="*/30 * * * *", timezone="Europe/Paris")
    assert len(half_hourly.due(utc(2026, 10, 24, 23, 0), utc(2026, 10, 25, 2, 0), 100)) == 6
    assert daily.spec == "cron 30 2 * * * Europe/Paris"


def test_a_long_downtime_costs_a_bounded_look_back() -> None:
    minutely = Schedule("m", cron="* * * * *", missed="all", catch_up=5)
    started = time.perf_counter()
    assert len(minutely.due(utc(2020, 1, 1), utc(2026, 1, 1), 5)) == 5
    assert minutely.decide(utc(2020, 1, 1), utc(2026, 1, 1) + 0.5)[-1] == utc(2026, 1, 1)
    assert time.perf_counter() - started < 5


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "a@b", "every": 1}, InvalidArgument, "without '@'"),
        ({"name": "", "every": 1}, InvalidArgument, "non-empty"),
        ({"name": 5, "every": 1}, InvalidArgumentType, "name must be a str"),
        ({"name": "s"}, InvalidArgument, "either cron= or every="),
        ({"name": "s", "every": 1, "cron": "* * * * *"}, InvalidArgument, "not both"),
        ({"name": "s", "every": 0.5}, InvalidArgument, "every must be a finite number of seconds >= 1"),
        ({"name": "s", "every": 1.5}, InvalidArgument, "whole seconds"),
        ({"name": "s", "every": "1"}, InvalidArgumentType, "every must be seconds"),
        ({"name": "s", "every": float("nan")}, InvalidArgument, "finite"),
        ({"name": "s", "cron": "* * * *"}, InvalidArgument, "five fields"),
        ({"name": "s", "cron": "61 * * * *"}, InvalidArgument, "not a valid cron"),
        ({"name": "s", "cron": "* * * * * *"}, InvalidArgument, "five fields"),
        ({"name": "s", "cron": 5}, InvalidArgumentType, "cron must be a str"),
        ({"name": "s", "cron": "@daily", "timezone": "Mars/Base"}, InvalidArgument, "not a zoneinfo"),
        ({"name": "s", "cron": "@daily", "timezone": 2}, InvalidArgumentType, "timezone must be"),
        ({"name": "s", "every": 60, "timezone": "Europe/Paris"}, InvalidArgument, "timezone is for cron"),
        ({"name": "s", "every": 1, "start": dt.datetime(2026, 1, 1)}, InvalidArgumentType, "aware"),
        ({"name": "s", "every": 1, "missed": "some"}, InvalidArgument, "missed must be one of"),
        ({"name": "s", "every": 1, "grace": -1}, InvalidArgument, "grace must be"),
        ({"name": "s", "every": 1, "catch_up": 0}, InvalidArgument, "catch_up must be between"),
        ({"name": "s", "every": 1, "catch_up": True}, InvalidArgumentType, "catch_up must be an int"),
        ({"name": "s", "every": 1, "args": (1, 2)}, InvalidArgument, "payload"),
    ],
)
def test_a_bad_schedule_is_refused_when_declared(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Schedule(**kwargs)


def test_a_bad_scheduler_is_refused_and_writes_nothing(store: JobStore) -> None:
    s = Schedule("s", every=1)
    with pytest.raises(InvalidArgumentType, match=r"store must be a fencing\.JobStore"):
        Scheduler("store", [s])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentType, match="schedules must be an iterable"):
        Scheduler(store, s)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="at least one"):
        Scheduler(store, [])
    with pytest.raises(InvalidArgumentType, match=r"fencing\.Schedule objects"):
        Scheduler(store, ["s"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="two schedules are named 's'"):
        Scheduler(store, [s, Schedule("s", every=2)])
    with pytest.raises(ConfigurationError, match="keeps no payloads"):
        Scheduler(store, [Schedule("a", every=1, args={"x": 1})])
    with pytest.raises(InvalidArgumentType, match="clock must be a callable"):
        Scheduler(store, [s], clock=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="poll must be"):
        Scheduler(store, [s], poll=0)
    scheduler = Scheduler(store, [s], clock=lambda: float("inf"))
    scheduler.create_table()
    with pytest.raises(InvalidArgument, match="clock\\(\\) must return finite seconds"):
        scheduler.run_pending()
    assert scheduler.rows() == []


# -- kept by workers -------------------------------------------------------------------------------


def test_two_workers_keep_one_schedule_and_run_each_tick_once(store: JobStore, target: str) -> None:
    from fencing import Job, Worker
    from tests import backends

    ran: list[str] = []
    lock = threading.Lock()

    def work(job: Job) -> str:
        with lock:
            ran.append(job.job_id)
        return "ok"

    engines = [backends.engine_for(target) for _ in range(2)]
    try:
        workers = []
        for e in engines:
            s = JobStore(e)
            scheduler = Scheduler(s, [Schedule("tick", every=1, missed="all")], poll=0.1)
            scheduler.create_table()
            workers.append(Worker(s, work, schedules=scheduler, concurrency=2, drain=5))
        threads = [threading.Thread(target=w.run, kwargs={"handle_signals": False}) for w in workers]
        for thread in threads:
            thread.start()
        time.sleep(3.5)
        for w in workers:
            w.stop()
        for thread in threads:
            thread.join(30)
    finally:
        for e in engines:
            e.dispose()
    ticks = ticks_in(store, "tick")
    assert 2 <= len(ticks) <= 5, ticks
    # each tick ran once, by one of the two (one enqueued as they stopped may wait for the next)
    assert len(ran) == len(set(ran)) and set(ran) <= set(ticks) and len(ticks) - len(ran) <= 1
    assert all(store.state(t).done for t in ran)


def test_an_async_worker_keeps_a_schedule(store: JobStore, target: str) -> None:
    import asyncio

    from fencing.asyncio import AsyncJob, AsyncJobStore, AsyncWorker
    from tests import backends

    ran: list[str] = []

    async def work(job: AsyncJob) -> None:
        ran.append(job.job_id)

    scheduler = Scheduler(store, [Schedule("tick", every=1, missed="all")], poll=0.1)
    scheduler.create_table()

    async def main() -> None:
        engine = backends.async_engine_for(target)
        try:
            worker = AsyncWorker(AsyncJobStore(engine), work, schedules=scheduler, drain=5)
            task = asyncio.create_task(worker.run(handle_signals=False))
            await asyncio.sleep(2.5)
            worker.stop()
            await task
        finally:
            await engine.dispose()

    asyncio.run(main())
    ticks = ticks_in(store, "tick")
    assert 1 <= len(ticks) <= 4, ticks
    assert len(ran) == len(set(ran)) and set(ran) <= set(ticks) and len(ticks) - len(ran) <= 1
    assert ran


def test_a_worker_takes_a_scheduler_or_nothing(store: JobStore) -> None:
    from fencing import Worker

    with pytest.raises(InvalidArgumentType, match="schedules must be a fencing"):
        Worker(store, print, schedules=[Schedule("s", every=1)])  # type: ignore[arg-type]


def test_a_pass_runs_through_sqlalchemys_own_execution_too(store: JobStore, made: Any) -> None:
    # an application that observes the engine (a cursor listener) takes the store off its
    # driver path: every statement of a pass compiles and runs through SQLAlchemy's own
    from sqlalchemy import event

    seen: list[str] = []

    def observe(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement.split()[0].upper())

    event.listen(store.engine, "before_cursor_execute", observe)
    try:
        clock = Clock(T0)
        scheduler = made(Schedule("s", every=10, missed="all"), clock=clock)
        scheduler.run_pending()
        clock.now = T0 + 20
        assert scheduler.run_pending() == [f"s@{at(10)}", f"s@{at(20)}"]
        assert [r["last_tick"] for r in scheduler.rows()] == [T0 + 20]
    finally:
        event.remove(store.engine, "before_cursor_execute", observe)
    assert "UPDATE" in seen and "INSERT" in seen
