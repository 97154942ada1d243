"""Run schedules: each tick becomes exactly one job, whatever number of processes run them.

Every process may run the same schedules at once (every worker, say); none is special, and
none need be up for the others to go on. A pass (:meth:`Scheduler.run_pending`) is one
transaction: it reads each schedule's row (:mod:`fencing._sql.schedules`: every tick at or
before ``decided_through`` is decided), decides the ticks since then by the schedule's policy
(:mod:`.schedule`), moves ``decided_through`` to now with a compare-and-set, and enqueues
each kept tick as the job ``<name>@<instant>`` with ``enqueue(revive=False)``, in that same
transaction. So:

* two processes that see the same tick: one transaction commits it, the other's
  compare-and-set finds the row moved and the transaction is rolled back (nothing of it
  stays); and the job id is the tick's, so even a second insert would be ignored;
* a tick decided once is never decided again: ``decided_through`` only moves forward, so
  neither a clock that goes back nor a job that was completed, deleted (its tombstone stays:
  ``revive=False``) or purged brings a tick back;
* a clock that jumps forward finds the ticks it jumped over due at once, and the policy for
  missed ticks decides them (``"all"`` enqueues each): none is skipped that the policy keeps;
* a process paused or killed in the middle of a pass holds nothing the others need past its
  transaction (nothing is locked between passes; no lease is needed).

The clock is the database's by default (read in the pass's first statement, so processes on
machines with skewed clocks agree), or ``clock=`` (a callable returning seconds since 1970):
the caller's, for tests and an accelerated run.

:meth:`Scheduler.run` runs passes until :meth:`Scheduler.stop`, waking at each next tick (and
every ``poll`` seconds to see ticks other processes' clocks put earlier); :class:`fencing.Worker`
runs one beside its slots (``schedules=``).

It counts on the store's metrics (:mod:`fencing.otel` exports them): ``schedules.enqueued``
(ticks this process enqueued) and ``schedules.raced`` (passes rolled back because another
process's pass committed first: harmless, and a measure of how many processes run them).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Table

from .._errors import ConfigurationError, FencingError, InvalidArgument, InvalidArgumentType, TableMissing
from .._runtime.execution import Executor
from .._sql.checks import show_value
from .._sql.dberrors import is_duplicate_key
from .._sql.payloads import encode_payload
from .._sql.schedules import (
    DEFAULT_SCHEDULES,
    ScheduleStatements,
    check_schedules_table,
    schedules_table,
    tick_id,
    tick_instant,
)
from .._sql.schema import jobs
from .jobstore import JobStore
from .schedule import Schedule

__all__ = ["Scheduler"]

logger = logging.getLogger("fencing.schedules")

#: the longest a running scheduler sleeps between passes (seconds)
POLL = 1.0


class _Raced(Exception):
    """Another process moved a schedule's row since this pass read it: this pass's
    transaction is rolled back (the other decided those ticks)."""


class Scheduler:
    """Runs ``schedules`` (:class:`fencing.Schedule`) on ``store``: each tick one job.

    ``table``: where the schedules' progress is kept (:func:`fencing.schedules_table`; by
    default ``fencing_schedules``: in the jobs table's ``MetaData``, made there if it is not,
    so Alembic's autogenerate sees it; beside :data:`fencing.jobs`, in a ``MetaData`` of its
    own); ``clock``: ``None`` for the database's clock, or a callable returning seconds
    since 1970; ``poll``: the longest :meth:`run` sleeps between passes.
    """

    def __init__(
        self,
        store: JobStore,
        schedules: Iterable[Schedule],
        *,
        table: Table | None = None,
        clock: Callable[[], float] | None = None,
        poll: float = POLL,
    ) -> None:
        if not isinstance(store, JobStore):
            raise InvalidArgumentType(f"store must be a fencing.JobStore, got {type(store).__name__}")
        if isinstance(schedules, (str, bytes, Schedule)) or not isinstance(schedules, Iterable):
            raise InvalidArgumentType(
                f"schedules must be an iterable of fencing.Schedule, got {type(schedules).__name__}"
            )
        listed = list(schedules)
        if not listed:
            raise InvalidArgument("schedules must hold at least one fencing.Schedule")
        by_name: dict[str, Schedule] = {}
        for schedule in listed:
            if not isinstance(schedule, Schedule):
                raise InvalidArgumentType(
                    f"schedules must hold fencing.Schedule objects, got {type(schedule).__name__} "
                    f"{show_value(schedule)}"
                )
            if schedule.name in by_name:
                raise InvalidArgument(f"two schedules are named {schedule.name!r}: each name once")
            by_name[schedule.name] = schedule
        if table is None and store.table is jobs:
            table = DEFAULT_SCHEDULES
        if table is None:
            metadata = store.table.metadata
            key = (
                "fencing_schedules"
                if store.table.schema is None
                else f"{store.table.schema}.fencing_schedules"
            )
            table = metadata.tables.get(key)
            if table is None:
                table = schedules_table(metadata, schema=store.table.schema)
        self.table = check_schedules_table(table)
        if clock is not None and not callable(clock):
            raise InvalidArgumentType(
                f"clock must be a callable returning seconds, or None, got {type(clock).__name__}"
            )
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= 3600:
            raise InvalidArgument(f"poll must be seconds > 0 and <= 3600, got {show_value(poll)}")
        ctx = store._ctx
        limit = ctx.plan.max_key_bytes
        for schedule in listed:
            longest = tick_id(schedule.name, 253402300799)
            if limit is not None and len(longest.encode("utf-8")) > limit:
                raise InvalidArgument(
                    f"schedule {schedule.name!r}: its tick's job id ({len(longest.encode())} bytes) "
                    f"would not fit the jobs table's id ({limit} bytes): use a shorter name"
                )
            if schedule.args is not None and store.payloads is None:
                raise ConfigurationError(
                    f"schedule {schedule.name!r} has args, but the store keeps no payloads: create it with "
                    "payloads=fencing.payloads_table(metadata)"
                )
        self.store = store
        self.schedules = by_name
        self.clock = clock
        self.poll = float(poll)
        self._statements = ScheduleStatements(self.table)
        self._names = list(by_name)
        self._known: dict[str, int] = {}  #: each schedule's decided_through, as last read
        self._skew = 0.0  #: the database's clock less this process's, as last read
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<Scheduler {', '.join(self._names)}>"

    # -- the table -------------------------------------------------------------------------------

    def create_table(self) -> None:
        """Create the schedules table if it does not exist (the jobs table is the store's:
        ``store.create_table()``)."""
        self.store._ctx.create(lambda conn: self.table.create(conn, checkfirst=True), None, self.table)

    # -- passes ----------------------------------------------------------------------------------

    def run_pending(self) -> list[str]:
        """One pass: enqueue every due tick the schedules' policies keep, each once; the job
        ids this pass enqueued (``[]`` when another process did it first)."""
        metrics = self.store.metrics
        try:
            enqueued = self._pass()
        except _Raced:
            logger.debug("a pass raced another process's: its ticks are that one's")
            metrics.add("schedules.raced")
            self._known.clear()
            return []
        if enqueued:
            metrics.add("schedules.enqueued", len(enqueued))
            self.store._ctx.ring()  # committed: this process's waiting claims look now
        return enqueued

    def _now(self, database_now: float) -> float:
        if self.clock is None:
            return database_now
        now = self.clock()
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise InvalidArgument(f"clock() must return finite seconds, got {show_value(now)}")
        return float(now)

    def _pass(self) -> list[str]:
        ctx = self.store._ctx
        st = self._statements
        s = ctx.by_database
        payloads = self.store.payloads is not None
        enqueue_new = ctx.enqueue_new
        with_payload, _ = ctx.enqueue_new_with_payload

        def unit(x: Executor) -> list[str]:
            rows = x.rows(st.read, {})
            found = {str(name): int(through) for name, through, _ in rows}
            database_now = float(rows[0][2] if rows else x.rows(st.database_now, {})[0][0])
            self._skew = database_now - time.time()
            now = self._now(database_now)
            upto = math.floor(now)
            enqueued: list[str] = []
            for name, schedule in self.schedules.items():
                through = found.get(name)
                if through is None:
                    # new: its ticks start after now (one that fell before it existed never runs)
                    x.count(
                        st.register,
                        {
                            "schedule": name,
                            "new_spec": schedule.spec,
                            "first_through": upto,
                            "first_tick": schedule.next_after(upto),
                        },
                    )
                    found[name] = upto
                    continue
                if upto <= through:
                    continue  # nothing due (or this clock is behind the one that decided last)
                ticks = schedule.decide(through, now)
                moved = x.count(
                    st.advance,
                    {
                        "schedule": name,
                        "read": through,
                        "through": upto,
                        "latest": ticks[-1] if ticks else None,
                        "coming": schedule.next_after(upto),
                        "new_spec": schedule.spec,
                    },
                )
                if moved != 1:
                    raise _Raced(name)
                found[name] = upto
                for tick in ticks:
                    job_id = tick_id(name, tick)
                    if payloads:
                        params = {"job_id": job_id, "payload": encode_payload(schedule.job_payload(tick))}
                        added = with_payload(x, s, params)
                    else:
                        added = enqueue_new(x, s, {"job_id": job_id})
                    if added:
                        enqueued.append(job_id)
                    else:
                        logger.warning(
                            "schedule %r: the tick %s exists already as a job: left as it is", name, job_id
                        )
                self._note_decided(schedule, through, upto, ticks)
            self._known = found
            return enqueued

        try:
            return ctx.run(unit, None, self.table)
        except TableMissing:
            raise TableMissing(
                f"table {self.table.name!r} (or the jobs table {self.store.table.name!r}) does not exist; "
                "create it first (scheduler.create_table(), store.create_table())"
            ) from None
        except FencingError as exc:
            if is_duplicate_key(exc.__cause__ or exc):
                raise _Raced("registered") from None  # another process registered it first
            raise

    def _note_decided(self, schedule: Schedule, through: int, upto: int, ticks: list[int]) -> None:
        if not ticks:
            return
        if schedule.missed != "all" and len(ticks) == 1 and ticks[0] > upto - max(schedule.grace, 1):
            logger.info("schedule %r: tick %s enqueued", schedule.name, tick_instant(ticks[0]))
            return
        due = schedule.count_due(through, upto)
        missed = None if due is None else due - len(ticks)
        logger.info(
            "schedule %r: %d tick(s) enqueued, %s to %s%s",
            schedule.name,
            len(ticks),
            tick_instant(ticks[0]),
            tick_instant(ticks[-1]),
            f"; {missed} missed tick(s) passed over (missed={schedule.missed!r})" if missed else "",
        )

    # -- when the next pass is due ---------------------------------------------------------------

    def next_tick(self) -> float | None:
        """When the next tick of any schedule falls (seconds since 1970 on the scheduler's
        clock), as of the last pass; ``None`` before the first."""
        if not self._known:
            return None
        upcoming = [
            tick
            for name, schedule in self.schedules.items()
            if name in self._known and (tick := schedule.next_after(self._known[name])) is not None
        ]
        return float(min(upcoming)) if upcoming else None

    def _clock_now(self) -> float:
        if self.clock is not None:
            return self._now(0.0)
        return time.time() + self._skew

    # -- running ---------------------------------------------------------------------------------

    def run(self) -> None:
        """Run passes until :meth:`stop`: at each next tick, and at least every ``poll``
        seconds. A pass that fails (the database away) is logged and tried again."""
        self._stopping.clear()
        failures = 0
        while not self._stopping.is_set():
            due = self.next_tick()
            if due is None or self._clock_now() >= due:
                try:
                    self.run_pending()
                    failures = 0
                except (FencingError, OSError) as exc:
                    failures += 1
                    logger.warning("a schedules pass failed (%s: %s); trying again", type(exc).__name__, exc)
                    self._stopping.wait(min(self.poll * failures, 30.0))
                    continue
                due = self.next_tick()
            wait = self.poll
            if due is not None and self.clock is None:
                wait = min(wait, max(0.0, due - self._clock_now()) + 0.001)
            elif due is not None:
                wait = min(wait, 0.05)  # a caller's clock may run at any speed: look often
            self._stopping.wait(wait)

    def start(self) -> threading.Thread:
        """:meth:`run` on a daemon thread of its own; :meth:`stop` ends it."""
        if self._thread is not None and self._thread.is_alive():
            raise InvalidArgument("this scheduler runs already")
        self._stopping.clear()
        self._thread = threading.Thread(target=self.run, name="fencing-scheduler", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = None) -> None:
        """End :meth:`run` after its current pass (and join the thread :meth:`start` made)."""
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- reading ---------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """Every schedule's row as stored (any process's), by name."""
        ctx = self.store._ctx

        def unit(x: Executor) -> list[dict[str, Any]]:
            return [
                {"name": n, "spec": spec, "decided_through": d, "last_tick": last, "next_tick": nxt}
                for n, spec, d, last, nxt in x.rows(self._statements.listing, {})
            ]

        return ctx.run(unit, None, self.table, write=False)
