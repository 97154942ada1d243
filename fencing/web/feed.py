"""One read per interval, shared by every page and event stream open on the dashboard.

A :class:`Feed` reads the table once per ``interval`` while someone watches (an event
stream is open) and hands that one snapshot to every watcher: fifty open pages cost one
read per interval, not fifty. A page that is loaded takes the latest snapshot if it is
younger than the interval, else the one read all loads waiting at that moment share.

A snapshot is JSON: the :class:`~fencing.overview.Summary` (counts by state, the longest
wait, leases ending soon, the highest fence), the leases that end soonest, who holds leases
(the busy workers, :meth:`~fencing.overview.Overview.holders`), the job waiting longest, the
refused writes by reason in the last hour (from the ownership history, when the dashboard is
given its table), and a series of rates per minute over the last
``SERIES`` intervals: claims (the difference of the fences' sum), completions (of the done
count) and refused writes (history rows). ``changed`` says whether anything in the table
moved since the snapshot before, so pages showing a listing re-read it only then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import Connection, Table
from starlette.concurrency import run_in_threadpool

from .._errors import FencingError
from .._sql.dberrors import DB_ERRORS, wrap_database_error
from .._sql.schedules import ScheduleViews
from .._sql.views import HistoryViews
from ..overview import Holder, JobView, Overview

__all__ = ["SERIES", "Feed"]

logger = logging.getLogger("fencing.web")

#: intervals of rates kept for the overview's chart
SERIES = 60
#: leases ending soonest, shown on the overview
EXPIRING = 10
#: owners holding leases (the busy workers), shown on the overview
HOLDERS = 10
#: how far back the refusals by reason count (seconds)
REFUSALS_WINDOW = 3600.0


class Feed:
    """The shared poll of ``overview``'s table (and ``history``'s refusals, if given)."""

    def __init__(
        self,
        overview: Overview,
        *,
        history: Table | None = None,
        interval: float = 1.0,
        max_attempts: int | None = None,
        schedules: Table | None = None,
    ) -> None:
        self.overview = overview
        self.history = history
        self.interval = interval
        #: the seconds the series spans: the chart's time axis
        self.window = SERIES * interval
        self.max_attempts = max_attempts
        #: reads made so far (what "one read per interval" is measured by)
        self.reads = 0
        self.watchers = 0
        self.snapshot: dict[str, Any] | None = None
        self._read_at = -1e18
        self._version = 0
        self._series: deque[dict[str, Any]] = deque(maxlen=SERIES)
        self._last: dict[str, Any] | None = None
        self._reading: asyncio.Future[dict[str, Any]] | None = None
        self._changed: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        #: the last read's thread, as a task: a cancelled caller stops waiting for it, but the
        #: thread reads on, on a pooled connection, until it returns (close() waits for it)
        self._thread: asyncio.Future[dict[str, Any]] | None = None
        self._history = None if history is None else HistoryViews(history)
        #: the schedules' rows, each with its last tick's job state (a primary-key read each)
        self._schedules = None if schedules is None else ScheduleViews(schedules, overview.table)

    # -- reading ----------------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        """One read: every query in one transaction of one connection (in a worker thread)."""
        ov = self.overview
        try:
            with ov.reading() as conn:
                summary = ov.summary(max_attempts=self.max_attempts, conn=conn)
                expiring = ov.jobs("held", limit=EXPIRING, conn=conn)
                holders = ov.holders(limit=HOLDERS, conn=conn)
                oldest = ov.jobs("ready", limit=1, max_attempts=self.max_attempts, conn=conn)
                refusals = self._refusals(conn, summary.now)
                schedules = self._schedules_now(conn)
            error = None
        except FencingError as exc:
            summary, expiring, holders, oldest, refusals, schedules = None, [], [], [], None, None
            error = f"{type(exc).__name__}: {exc}"
        self.reads += 1
        return self._snapshot(summary, expiring, holders, oldest, refusals, error, schedules)

    def _schedules_now(self, conn: Connection) -> list[dict[str, Any]] | None:
        if self._schedules is None:
            return None
        try:
            return self._schedules.read(conn)
        except DB_ERRORS as exc:
            raise wrap_database_error(exc, self._schedules.table.name) from exc

    def _refusals(self, conn: Connection, now: float) -> dict[str, int] | None:
        if self._history is None:
            return None
        try:
            rows = conn.execute(self._history.refusals_by_reason, {"since": now - REFUSALS_WINDOW}).all()
        except DB_ERRORS as exc:
            raise wrap_database_error(exc, self._history.history.name) from exc
        return {str(reason): int(n) for reason, n in rows}

    def _snapshot(
        self,
        summary: Any,
        expiring: list[JobView],
        holders: list[Holder],
        oldest: list[JobView],
        refusals: dict[str, int] | None,
        error: str | None,
        schedules: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        counts: dict[str, Any] | None = None
        if summary is not None:
            counts = summary.as_json()
            point = {
                "now": summary.now,
                "claims": summary.claims,
                "done": summary.done + summary.deleted,
                "refused": None if refusals is None else sum(refusals.values()),
            }
            last = self._last
            if last is not None and point["now"] > last["now"]:
                minutes = (point["now"] - last["now"]) / 60.0
                self._series.append(
                    {
                        "at": point["now"],
                        "claims": max(0, point["claims"] - last["claims"]) / minutes,
                        "completions": max(0, point["done"] - last["done"]) / minutes,
                        "refused": None
                        if point["refused"] is None or last["refused"] is None
                        else max(0, point["refused"] - last["refused"]) / minutes,
                    }
                )
            self._last = point
        previous = self.snapshot
        body = {
            "summary": counts,
            "expiring": [j.as_json() for j in expiring],
            "holders": [h.as_json() for h in holders],
            "oldest_ready": oldest[0].as_json() if oldest else None,
            "refusals": refusals,
            "schedules": schedules,
            "error": error,
        }
        changed = previous is None or _moved(previous, body)
        self._version += 1
        return {
            "version": self._version,
            "changed": changed,
            "series": list(self._series),
            "history": self.history is not None,
            **body,
        }

    async def latest(self) -> dict[str, Any]:
        """The latest snapshot if it is younger than the interval, else a new one (a read
        that every caller arriving meanwhile shares)."""
        if self.snapshot is not None and time.monotonic() - self._read_at < self.interval:
            return self.snapshot
        return await self._shared_read()

    async def _shared_read(self) -> dict[str, Any]:
        if self._reading is not None:
            return await asyncio.shield(self._reading)
        loop = asyncio.get_running_loop()
        self._reading = loop.create_future()
        started = time.monotonic()  # intervals count from each read's start: a steady pace
        try:
            self._thread = thread = asyncio.ensure_future(run_in_threadpool(self._read))
            snapshot = await asyncio.shield(thread)
        except BaseException as exc:
            self._reading.set_exception(exc)
            self._reading.exception()  # retrieved: the waiters get it, no warning
            raise
        finally:
            reading, self._reading = self._reading, None
        self.snapshot, self._read_at = snapshot, started
        reading.set_result(snapshot)
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()
        return snapshot

    # -- watching ---------------------------------------------------------------------------

    async def watch(self) -> AsyncIterator[dict[str, Any] | None]:
        """The snapshots as they are read, one per interval, while the caller iterates;
        ``None`` every 15 s with nothing new (for a keep-alive)."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        self.watchers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())
        try:
            seen = 0
            while True:
                snapshot = self.snapshot
                if snapshot is not None and snapshot["version"] > seen:
                    seen = snapshot["version"]
                    yield snapshot
                    continue
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=15.0)
                    except asyncio.TimeoutError:
                        yield None
        finally:
            self.watchers -= 1

    async def _poll(self) -> None:
        """Read once per interval while anyone watches."""
        while self.watchers > 0:
            started = time.monotonic()
            if started - self._read_at >= self.interval * 0.999:
                try:
                    await self._shared_read()
                except Exception:  # a bug, not the database: log it and keep the feed alive
                    logger.exception("the dashboard's feed failed to read")
            wait = self.interval - (time.monotonic() - self._read_at)
            await asyncio.sleep(max(wait, 0.01))

    async def close(self) -> None:
        """Stop the poll (the application's shutdown), and wait for a read still in its thread:
        it holds a connection of the engine's pool, which the application disposes next."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.wait([thread])
            if not thread.cancelled():
                thread.exception()  # retrieved: its caller has seen it, or was cancelled


def _moved(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether the table moved between two snapshots: counts, fences, the leases shown."""
    a, b = before.get("summary"), after.get("summary")
    if a is None or b is None:
        return a is not b
    keys = ("ready", "held", "deferred", "done", "deleted", "poisoned", "claims", "highest_fence")
    if any(a[k] != b[k] for k in keys):
        return True
    if before.get("refusals") != after.get("refusals"):
        return True
    return _leases(before) != _leases(after)


def _leases(snapshot: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The leases shown, without the clock each was read at."""
    return [(j["job_id"], j["owner"], j["fence"], j["until"]) for j in snapshot.get("expiring", [])]
