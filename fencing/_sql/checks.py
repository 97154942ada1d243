"""Argument checks shared by the store and ``service.py``.

Every check runs before any database work, so bad input never changes a row.
Messages name the argument and show the offending value.
"""

from __future__ import annotations

import math
import numbers

from sqlalchemy import Engine, MetaData, Table

from .._errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "DATABASE_CLOCK_MIN_TTL",
    "FENCE_MAX",
    "check_count",
    "check_database_ttl",
    "check_fence",
    "check_interval",
    "check_lock_name",
    "check_new_table",
    "check_now",
    "check_result",
    "check_text",
    "check_time",
    "check_timeout",
    "check_ttl",
    "check_until",
    "fence_can_match",
    "show_value",
]

_PREVIEW = 80


def show_value(value: object) -> str:
    """``repr(value)`` for a message: cut at 80 characters, and never an error itself."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits() has no decimal repr
        if isinstance(value, int):
            return f"an int of {value.bit_length()} bits"
        return f"a {type(value).__name__} too long to print"
    if len(text) > _PREVIEW:
        text = text[:_PREVIEW] + f"... ({len(text)} chars)"
    return text


_show = show_value


def _number(name: str, value: object) -> float:
    if type(value) is float:  # the hot path: skip the ABC check
        if value - value == 0.0:  # false for nan and +-inf
            return value
        raise InvalidArgument(f"{name} must be a finite number, got {_show(value)}")
    # bool is an int subclass, but True as a clock or duration is always a bug
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentType(
            f"{name} must be a real number (int or float), got {type(value).__name__} {_show(value)}"
        )
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction past the largest double
        raise InvalidArgument(
            f"{name} must be a finite number within a float's range (about 1.8e308), got {_show(value)}"
        ) from None
    if not math.isfinite(number):
        raise InvalidArgument(f"{name} must be a finite number, got {_show(value)}")
    return number


def check_now(value: object) -> float:
    """``now``: the caller's clock, a finite real number."""
    return _number("now", value)


def check_time(name: str, value: object) -> float:
    """A point in time on the caller's clock, such as ``ready_at``: a finite real number."""
    return _number(name, value)


def check_ttl(value: object, *, name: str = "ttl") -> float:
    """``ttl`` (or another duration): a finite number > 0."""
    ttl = _number(name, value)
    if ttl <= 0:
        raise InvalidArgument(f"{name} must be > 0, got {_show(value)}")
    return ttl


#: the shortest ``ttl`` (or ``delay``) on the database's clock (``now=None``): SQLite's clock
#: ticks in milliseconds, so a shorter lease can be expired the moment it is taken and every
#: claimant "wins"; one floor for every backend, so the rule does not depend on the database
DATABASE_CLOCK_MIN_TTL = 0.001


def check_database_ttl(value: object, *, name: str = "ttl") -> float:
    """A duration on the database's clock: :func:`check_ttl`, and at least
    :data:`DATABASE_CLOCK_MIN_TTL` (on the caller's clock, :func:`check_until` guards instead)."""
    ttl = check_ttl(value, name=name)
    if ttl < DATABASE_CLOCK_MIN_TTL:
        raise InvalidArgument(
            f"{name} must be at least {DATABASE_CLOCK_MIN_TTL} s with the database's clock (now=None), "
            f"got {_show(value)}"
        )
    return ttl


def check_interval(value: object, ttl: float, *, name: str = "interval") -> float:
    """A heartbeat's ``interval``: ``None`` (``ttl / 3``), or a real number > 0 and < ``ttl``
    (the ``ttl`` already checked)."""
    if value is None:
        return ttl / 3
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = type(value).__name__
        raise InvalidArgumentType(
            f"{name} must be a real number (int or float) or None, got {kind} {_show(value)}"
        )
    try:
        interval = float(value)
    except OverflowError:  # beyond a float either way: not between 0 and a finite ttl
        interval = math.nan
    if not 0 < interval < ttl:  # also false for nan
        raise InvalidArgument(f"{name} must be > 0 and < ttl ({ttl!r}), got {_show(value)}")
    return interval


def check_until(now: float, ttl: float) -> float:
    """``now + ttl``, refusing a sum that overflows to infinity."""
    until = now + ttl
    if not math.isfinite(until):
        raise InvalidArgument(f"now + ttl overflows: now={now!r}, ttl={ttl!r}")
    if until <= now:
        # the lease would be expired the moment it was taken, so every claimant would "win"
        raise InvalidArgument(f"ttl={ttl!r} is below the resolution of now={now!r}: now + ttl == now")
    return until


def check_text(name: str, value: object) -> str:
    """Job ids and owners: any ``str`` that can be stored as UTF-8 (NUL, quotes, emoji are data)."""
    if not isinstance(value, str):
        raise InvalidArgumentType(f"{name} must be a str, got {type(value).__name__} {_show(value)}")
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{name} cannot be stored as UTF-8 (lone surrogate at index {exc.start}): {_show(value)}"
        ) from None
    return value


def check_result(value: object) -> str | None:
    """A job's result: a ``str`` or ``None``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgumentType(f"result must be a str or None, got {type(value).__name__} {_show(value)}")
    return check_text("result", value)


FENCE_MAX = 2**63 - 1


def check_fence(value: object) -> int:
    """A fence token: an ``int`` (not bool). Out-of-range values are valid input that never match."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentType(f"fence must be an int, got {type(value).__name__} {_show(value)}")
    return value


def check_count(name: str, value: object) -> int:
    """A count such as ``limit`` or ``max_attempts``: an ``int`` (not bool) from 1 to 2**63-1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentType(f"{name} must be an int, got {type(value).__name__} {_show(value)}")
    if not 1 <= value <= FENCE_MAX:
        raise InvalidArgument(f"{name} must be between 1 and 2**63-1, got {_show(value)}")
    return value


def fence_can_match(fence: int) -> bool:
    """Fences are handed out from 1 upward and stored as signed 64-bit integers."""
    return 1 <= fence <= FENCE_MAX


def check_side_table(value: object, *, argument: str, kind: str, columns: set[str]) -> Table | None:
    """``value`` as a store takes a table beside its jobs table (its ``argument``): ``None``
    (none), or a ``Table`` with ``columns`` made by ``fencing.<argument>_table`` (``kind``:
    "an attempts table"), else the error that says what it is not."""
    if value is None:
        return None
    maker = f"fencing.{argument}_table"
    if not isinstance(value, Table):
        raise InvalidArgumentType(
            f"{argument} must be a sqlalchemy Table ({maker}), got {type(value).__name__}"
        )
    missing = columns - set(value.c.keys())
    if missing:
        raise InvalidArgument(
            f"table {value.name!r} is not {kind} (no {', '.join(sorted(missing))}): "
            f"use {maker}(metadata, name)"
        )
    return value


def check_new_table(metadata: object, name: object, schema: object) -> None:
    """The arguments of a table factory (``jobs_table`` and the like): a ``MetaData`` that
    does not hold a table of that name yet, a non-empty ``name``, a ``schema`` or ``None``."""
    if not isinstance(metadata, MetaData):
        raise InvalidArgumentType(f"metadata must be a sqlalchemy MetaData, got {type(metadata).__name__}")
    if not isinstance(name, str):
        raise InvalidArgumentType(f"name must be a str, got {type(name).__name__} {_show(name)}")
    if not name:
        raise InvalidArgument("name must not be empty")
    if schema is not None and not isinstance(schema, str):
        raise InvalidArgumentType(
            f"schema must be a str or None, got {type(schema).__name__} {_show(schema)}"
        )
    key = f"{schema}.{name}" if schema else name
    if key in metadata.tables:
        # SQLAlchemy would raise its own InvalidRequestError; a second definition is a bug
        raise InvalidArgument(f"metadata already holds a table {key!r}; pass another name or MetaData")


def check_sync_engine(value: object, *, instead: str) -> None:
    """``value`` is a sync ``Engine``; an ``AsyncEngine`` is told which class takes it
    (``instead``, e.g. ``fencing.asyncio.AsyncJobStore``)."""
    if isinstance(value, Engine):
        return
    from sqlalchemy.ext.asyncio import AsyncEngine  # only on the way to the error

    hint = f": an AsyncEngine takes {instead}" if isinstance(value, AsyncEngine) else ""
    raise InvalidArgumentType(f"engine must be a sqlalchemy Engine, got {type(value).__name__}{hint}")


def check_wait(value: object) -> float:
    """How long a claim may wait for work (seconds): a finite number >= 0 (0: not at all)."""
    if value is None:
        raise InvalidArgumentType("wait must be a number of seconds >= 0 (0: do not wait), got None")
    seconds = _number("wait", value)
    if seconds < 0:
        raise InvalidArgument(f"wait must be >= 0 seconds (0: do not wait), got {_show(value)}")
    return seconds


def check_timeout(value: object, *, name: str = "timeout") -> float | None:
    """How long to wait (seconds): a finite number >= 0, or ``None`` (no bound)."""
    if value is None:
        return None
    seconds = _number(name, value)
    if seconds < 0:
        raise InvalidArgument(f"{name} must be >= 0 or None, got {_show(value)}")
    return seconds


#: the longest lock name (bytes of UTF-8): what every backend's key column holds (MariaDB's
#: is the smallest), so a name means the same lock on every database
LOCK_NAME_MAX_BYTES = 1024


def check_lock_name(value: object) -> str:
    """A lock's name: a non-empty ``str`` of UTF-8 text without NUL, at most
    :data:`LOCK_NAME_MAX_BYTES` bytes, the same rule on every database."""
    name = check_text("name", value)
    if not name:
        raise InvalidArgument("name must not be empty")
    if "\x00" in name:
        raise InvalidArgument(
            "name contains NUL (U+0000): a lock's name is the same on every database, and "
            "PostgreSQL's text cannot store it"
        )
    size = len(name) if name.isascii() else len(name.encode("utf-8"))
    if size > LOCK_NAME_MAX_BYTES:
        raise InvalidArgument(
            f"name is {size} bytes in UTF-8; a lock's name holds at most {LOCK_NAME_MAX_BYTES}"
        )
    return name
