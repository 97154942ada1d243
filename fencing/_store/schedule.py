"""A schedule, declared in code: when its ticks fall, what a pass does with the ones it finds
late, and the job each tick becomes. Pure: no database here (:mod:`.scheduler` runs it).

**Ticks** fall on whole seconds: ``every=`` seconds from ``start`` (by default 1970-01-01
UTC, so ``every=3600`` ticks on each UTC hour, on every machine alike), or a standard
five-field ``cron=`` expression read by croniter (the ``fencing[cron]`` extra) in
``timezone`` (a ``zoneinfo`` name; UTC by default). Daylight saving: a time that does not
exist on the day clocks go forward runs at the first minute after the gap (as cron does); on
the day they go back, a tick whose hour is fixed by the expression runs once, at its first
occurrence, while one whose hour field is ``*`` runs in both hours (as cron does).

**Each tick is one job**, ``<name>@<instant>`` (the instant in UTC, ISO 8601 to the second:
``report@2026-12-07T03:00:00Z``), with the payload ``{"schedule": name, "tick": instant,
"args": args}`` when the store keeps payloads.

**Missed ticks**: a tick a pass finds more than ``grace`` seconds after its instant was missed
(nothing ran the schedule then); ``missed`` says what becomes of those:

* ``"latest"`` (the default): folded into one run: the latest missed tick is enqueued unless a
  tick on time is enqueued by the same pass; the others are passed over;
* ``"all"``: each is enqueued, oldest first, up to ``catch_up`` per pass (the latest ones);
* ``"none"``: none is; only ticks on time are enqueued.
"""

from __future__ import annotations

import datetime as dt
import math
import numbers
import re
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .._errors import ConfigurationError, InvalidArgument, InvalidArgumentType
from .._sql.checks import check_text, show_value
from .._sql.payloads import encode_payload
from .._sql.schedules import tick_instant

__all__ = ["MISSED", "Schedule"]

#: what a schedule may do with missed ticks
MISSED = ("latest", "all", "none")

Missed = Literal["latest", "all", "none"]

_UTC = dt.timezone.utc
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=_UTC)
#: the latest tick an instant column holds comfortably (year 9999)
_LAST = 253402300799


def _seconds(name: str, value: object, *, least: float) -> float:
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentType(
            f"{name} must be seconds (int, float or datetime.timedelta), got {type(value).__name__} "
            f"{show_value(value)}"
        )
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < least:
        raise InvalidArgument(
            f"{name} must be a finite number of seconds >= {least:g}, got {show_value(value)}"
        )
    return seconds


class Schedule:
    """A schedule: ``name`` and either ``cron=`` (five fields, in ``timezone``) or ``every=``
    (whole seconds, or a ``timedelta``, from ``start``); what becomes of ticks found late
    (``missed``, ``grace``, ``catch_up``, see :mod:`fencing._store.schedule`); ``args``: JSON
    handed to each tick's job. Every argument is checked here."""

    def __init__(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: float | dt.timedelta | None = None,
        timezone: str | dt.tzinfo = "UTC",
        start: dt.datetime | None = None,
        missed: Missed = "latest",
        grace: float | dt.timedelta = 60.0,
        catch_up: int = 100,
        args: Any = None,
    ) -> None:
        name = check_text("name", name)
        if not name or "@" in name or name != name.strip():
            raise InvalidArgument(
                f"name must be non-empty, without '@' (it separates the name from the tick in a job id) "
                f"and without surrounding spaces, got {show_value(name)}"
            )
        self.name = name
        if (cron is None) == (every is None):
            raise InvalidArgument(f"schedule {name!r}: pass either cron= or every=, not both or neither")
        if missed not in MISSED:
            raise InvalidArgument(f"missed must be one of {', '.join(MISSED)}, got {show_value(missed)}")
        self.missed: Missed = missed
        self.grace = _seconds("grace", grace, least=0.0)
        if isinstance(catch_up, bool) or not isinstance(catch_up, int):
            raise InvalidArgumentType(f"catch_up must be an int, got {type(catch_up).__name__}")
        if not 1 <= catch_up <= 100_000:
            raise InvalidArgument(f"catch_up must be between 1 and 100000, got {catch_up}")
        self.catch_up = catch_up
        self.args = args
        #: the args as the payload keeps them (checked now: a bad one fails here, not at a tick)
        self._args_text = encode_payload(args)
        self._cron: Any = None
        self._fixed_hour = False
        if cron is not None:
            self.zone = _zone(timezone)
            self._cron, self._fixed_hour = _cron(name, cron)
            self.cron: str | None = cron
            self.every: float | None = None
            self.start = None
            where = "" if self.zone.key == "UTC" else f" {self.zone.key}"
            self.spec = f"cron {cron}{where}"
        else:
            assert every is not None
            seconds = _seconds("every", every, least=1.0)
            if seconds != int(seconds):
                raise InvalidArgument(
                    f"every must be whole seconds (ticks fall on seconds), got {show_value(every)}"
                )
            if start is None:
                start = _EPOCH
            if not isinstance(start, dt.datetime) or start.tzinfo is None:
                raise InvalidArgumentType(
                    f"start must be an aware datetime.datetime (with its tzinfo), got {show_value(start)}"
                )
            if start.microsecond:
                raise InvalidArgument(f"start must fall on a whole second, got {start.isoformat()}")
            if timezone != "UTC":
                raise InvalidArgument(
                    f"schedule {name!r}: timezone is for cron=; an every= schedule counts from start= "
                    "(give it an aware datetime in your time zone)"
                )
            self.cron = None
            self.zone = _zone(timezone)
            self.every = seconds
            self.start = start
            self._start = int(start.timestamp())
            self._every = int(seconds)
            self.spec = f"every {_duration(self._every)}" + (
                f" from {tick_instant(self._start)}" if self._start else ""
            )
        if len(self.spec) > 255:
            raise InvalidArgument(
                f"schedule {name!r}: its cron expression is too long ({len(self.spec)} chars)"
            )

    def __repr__(self) -> str:
        return f"<Schedule {self.name!r} {self.spec} missed={self.missed}>"

    # -- ticks -----------------------------------------------------------------------------------

    def decide(self, after: int, now: float) -> list[int]:
        """The ticks a pass at ``now`` enqueues, every tick at or before ``after`` decided
        already: those in ``(after, floor(now)]`` the policy keeps, oldest first."""
        upto = math.floor(now)
        on_time = self.due(max(after, math.ceil(now - self.grace) - 1), upto, self.catch_up)
        if self.missed == "all":
            return self.due(after, upto, self.catch_up)
        if self.missed == "latest" and not on_time:
            return self.due(after, upto, 1)
        return on_time

    def due(self, after: int, upto: int, limit: int) -> list[int]:
        """The latest ``limit`` ticks in ``(after, upto]``, oldest first."""
        if upto <= after:
            return []
        if self._cron is None:
            first = max(0, (after - self._start) // self._every + 1)
            last = (upto - self._start) // self._every
            if last < first:
                return []
            first = max(first, last - limit + 1)
            return [self._start + k * self._every for k in range(first, last + 1)]
        found: list[int] = []
        for tick in self._cron_back(upto + 1):
            if tick <= after or len(found) == limit:
                break
            found.append(tick)
        found.reverse()
        return found

    def count_due(self, after: int, upto: int) -> int | None:
        """How many ticks fall in ``(after, upto]`` (``None`` for a cron schedule: not counted)."""
        if self._cron is None and upto > after:
            first = max(0, (after - self._start) // self._every + 1)
            return max(0, (upto - self._start) // self._every - first + 1)
        return None if self._cron is not None else 0

    def next_after(self, instant: int) -> int | None:
        """The first tick after ``instant``; ``None`` past year 9999."""
        if self._cron is None:
            k = max(0, (instant - self._start) // self._every + 1)
            tick = self._start + k * self._every
        else:
            tick = next(self._cron_forward(instant), _LAST + 1)
        return tick if tick <= _LAST else None

    def _cron_back(self, before: int) -> Any:
        """The cron ticks strictly before ``before``, latest first."""
        from croniter import croniter

        it = croniter(self._cron, dt.datetime.fromtimestamp(before, self.zone))
        while True:
            when = it.get_prev(dt.datetime)
            if when.year < 1971:
                return
            tick = int(when.timestamp())
            if tick >= before:
                continue
            if self._fixed_hour and _second_of_repeated(when, self.zone):
                continue  # the day clocks go back: a fixed-hour tick runs at the first of the two
            yield tick

    def _cron_forward(self, after: int) -> Any:
        from croniter import croniter

        it = croniter(self._cron, dt.datetime.fromtimestamp(after, self.zone))
        while True:
            when = it.get_next(dt.datetime)
            if when.year > 9999:
                return
            tick = int(when.timestamp())
            if tick <= after:
                continue
            if self._fixed_hour and _second_of_repeated(when, self.zone):
                continue
            yield tick

    def job_payload(self, tick: int) -> dict[str, Any]:
        """What a tick's job carries: ``{"schedule", "tick", "args"}``."""
        return {"schedule": self.name, "tick": tick_instant(tick), "args": self.args}


def _second_of_repeated(when: dt.datetime, zone: dt.tzinfo) -> bool:
    """``when`` is the later of two instants that read the same on the wall (the hour that
    repeats when clocks go back)."""
    wall = when.astimezone(zone).replace(tzinfo=None)
    first = wall.replace(tzinfo=zone, fold=0)
    second = wall.replace(tzinfo=zone, fold=1)
    if first.utcoffset() == second.utcoffset():
        return False
    return int(when.timestamp()) == int(second.timestamp()) and int(first.timestamp()) != int(
        second.timestamp()
    )


def _zone(timezone: object) -> ZoneInfo:
    if isinstance(timezone, ZoneInfo):
        return timezone
    if timezone is dt.timezone.utc:
        return ZoneInfo("UTC")
    if not isinstance(timezone, str):
        raise InvalidArgumentType(
            f"timezone must be a zoneinfo name (str) or a zoneinfo.ZoneInfo, got {type(timezone).__name__}"
        )
    try:
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidArgument(
            f"timezone {timezone!r} is not a zoneinfo time zone (such as 'Europe/Paris'; on a system "
            "without a time zone database, pip install tzdata)"
        ) from None


_FIELDS = re.compile(r"^\S+(\s+\S+){4}$")
_ALIASES = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}


def _cron(name: str, expression: object) -> tuple[str, bool]:
    """The expression as croniter takes it, and whether its hour is fixed (not ``*``)."""
    if not isinstance(expression, str):
        raise InvalidArgumentType(f"cron must be a str, got {type(expression).__name__}")
    text = " ".join(expression.split())
    if text not in _ALIASES and not _FIELDS.match(text):
        raise InvalidArgument(
            f"schedule {name!r}: cron must have five fields (minute hour day month weekday) or be one "
            f"of {', '.join(sorted(_ALIASES))}, got {expression!r}"
        )
    try:
        from croniter import croniter
    except ImportError:
        raise ConfigurationError(
            "cron schedules need croniter: pip install 'fencing[cron]' (or use every=)"
        ) from None
    if not croniter.is_valid(text):
        raise InvalidArgument(f"schedule {name!r}: {expression!r} is not a valid cron expression")
    hours = croniter(text).expanded[1]
    return text, hours != ["*"]


def _duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
