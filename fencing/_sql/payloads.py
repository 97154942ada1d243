"""A job's arguments: a JSON payload kept beside the jobs table, handed out with the claim.

The contract's ``jobs`` table keeps its six columns, so a payload lives in a table of its own
(:func:`payloads_table`: ``id``, ``payload``), as a requeue's attempts do. ``enqueue(payload=)``
writes it in the enqueue's transaction (the caller's, with ``conn=``), only when the job is
new or comes back from a delete; a claim reads it in its own statement (a subquery in the
``RETURNING`` on SQLite and PostgreSQL) or its own transaction (MariaDB/MySQL), so a worker
gets its job's arguments in the claim's round trips.

A payload is stored as JSON text, written and read by the library on every database, so what
a worker gets is what was enqueued: a value that would not read back equal (a tuple, a
non-``str`` key, ``NaN``, a set) is refused before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Column, MetaData, Table

from .._errors import InvalidArgument, InvalidArgumentType
from .checks import check_new_table, check_side_table, show_value
from .schema import KEY_COLUMN, LONG_TEXT

__all__ = ["check_payloads_table", "decode_payload", "encode_payload", "payload_of", "payloads_table"]


def payloads_table(metadata: MetaData, name: str = "fencing_payloads", *, schema: str | None = None) -> Table:
    """The table that keeps each job's payload (``fencing_payloads`` by default): ``id``,
    the job's id, and ``payload``, its arguments as JSON text. Pass it to the store
    (``JobStore(engine, table, payloads=...)``); ``create_table`` creates it."""
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("id", KEY_COLUMN, primary_key=True, nullable=False),
        Column("payload", LONG_TEXT, nullable=True),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


def check_payloads_table(payloads: object) -> Table | None:
    """``payloads`` as a store takes it: ``None`` (no payloads) or a table of
    :func:`payloads_table`'s shape, else the error that says what it is not."""
    return check_side_table(payloads, argument="payloads", kind="a payloads table", columns={"id", "payload"})


def encode_payload(payload: object) -> str:
    """``payload`` as the JSON text the table keeps, or the error that says why it cannot be
    kept exactly: only what reads back equal is taken (dicts with ``str`` keys, lists, ``str``,
    ``int``, finite ``float``, ``bool`` and ``None``)."""
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentType(
            f"payload must be JSON (dicts with str keys, lists, str, int, finite float, bool, None): "
            f"{show_value(payload)} is not ({_why_not_json(exc)})"
        ) from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(
            f"payload {show_value(payload)} holds a lone surrogate, which no database's text stores"
        ) from None
    back = json.loads(text)
    if not _same(back, payload):
        raise InvalidArgument(
            f"payload {show_value(payload)} would read back as {show_value(back)}: pass lists, not "
            "tuples, and dicts whose keys are str"
        )
    return text


def _why_not_json(exc: BaseException) -> str:
    """Why ``json.dumps`` refused a value, in words that do not change with Python's version."""
    said = str(exc)
    if isinstance(exc, RecursionError) or "Circular reference" in said:
        return "it contains itself, or is nested too deep"
    if isinstance(exc, ValueError) and "float" in said:
        return "NaN and the infinities are not JSON"
    return said  # "Object of type set is not JSON serializable", an int too long to write


def decode_payload(text: str | None) -> Any:
    """A stored payload's value; ``None`` for a job enqueued without one."""
    return None if text is None else json.loads(text)


def _same(back: object, given: object) -> bool:
    """``back`` (read from JSON) is ``given`` exactly: the same types all the way down (``1``
    and ``1.0`` and ``True`` compare equal in Python, but are not the same payload)."""
    if type(back) is not type(given):
        # an int subclass (an IntEnum) or a str subclass reads back as its base: refused too
        return False
    if isinstance(given, dict):
        assert isinstance(back, dict)
        return back.keys() == given.keys() and all(_same(back[k], v) for k, v in given.items())
    if isinstance(given, list):
        assert isinstance(back, list)
        return len(back) == len(given) and all(_same(b, g) for b, g in zip(back, given, strict=True))
    return bool(back == given)  # (NaN and the infinities were refused by json.dumps)


def payload_of(row: Sequence[Any], at: int) -> tuple[Any, ...]:
    """The payload a claim's ``row`` carries at position ``at``, as the rest of a
    :class:`~fencing.Lease`'s fields: ``(value,)``, or ``()`` where the row has none (a store
    without payloads reads no such column)."""
    return (decode_payload(row[at]),) if len(row) > at else ()
