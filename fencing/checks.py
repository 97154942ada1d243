"""Argument checks shared by the store and ``service.py``.

Every check runs before any database work, so bad input never changes a row.
Messages name the argument and show the offending value.
"""

from __future__ import annotations

import math
import numbers

from sqlalchemy import MetaData

from .errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "FENCE_MAX",
    "check_fence",
    "check_new_table",
    "check_now",
    "check_result",
    "check_text",
    "check_time",
    "check_ttl",
    "check_until",
    "fence_can_match",
]

_PREVIEW = 80


def _show(value: object) -> str:
    text = repr(value)
    if len(text) > _PREVIEW:
        text = text[:_PREVIEW] + f"... ({len(text)} chars)"
    return text


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
    number = float(value)
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


def fence_can_match(fence: int) -> bool:
    """Fences are handed out from 1 upward and stored as signed 64-bit integers."""
    return 1 <= fence <= FENCE_MAX


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
