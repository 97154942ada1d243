"""Instants and durations for people, shared by the CLI and the dashboard's pages."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timezone

from .overview import JobView


def instant(epoch: float | None, none: str = "-") -> str:
    """A point on the database's clock, in UTC to the millisecond; ``none`` for no point."""
    if epoch is None:
        return none
    try:
        moment = datetime.fromtimestamp(epoch, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{epoch:.3f}"
    return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def duration(seconds: float) -> str:
    """``3.2s``, ``42s``, ``5m 02s``, ``2h 05m``, ``3d 04h``: rounded down, so a time left is
    never shown longer than it is. The dashboard's ``live.js`` ``duration()`` redraws its
    durations the same way (change both together)."""
    s = max(seconds, 0.0)
    if s < 10:
        return f"{math.floor(s * 10) / 10:.1f}s"
    whole = int(s)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def when(job: JobView, length: Callable[[float], str] = duration) -> str:
    """The lease's time left, when a deferred job becomes ready, or how long a ready one has
    waited: ``until`` against the database's ``now``; ``-`` for no point in time."""
    delta = job.until_in
    if delta is None:
        return "-"
    if job.state == "held":
        return f"{length(delta)} left"
    if job.state == "deferred":
        return f"ready in {length(delta)}"
    # a poisoned job may have an until still ahead: never a negative wait
    waited = length(max(-delta, 0.0))
    return f"lease expired {waited} ago" if job.owner is not None else f"waiting {waited}"
