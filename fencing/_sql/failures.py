"""A job's last failure: what went wrong, kept beside the jobs table until it next fails.

A worker whose function raised hands its job back (``release(lease, delay=..., failure=...)``)
with the failure's text: the exception's type and message, and its traceback. The contract's
``jobs`` table keeps its six columns, so the text goes into a table of its own
(:func:`failures_table`: ``id``, ``fence``, ``at``, ``failure``), in the release's transaction
and only when the release is accepted: a stale worker's failure never replaces the current
holder's. The fence says which attempt failed; ``at`` when, on the release's clock.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Column, MetaData, Table

from .checks import check_new_table, check_side_table
from .schema import KEY_COLUMN, LONG_TEXT, SECONDS

__all__ = ["Failure", "check_failures_table", "failures_table"]


class Failure(NamedTuple):
    """A job's last failure, as its worker handed the job back (:meth:`~fencing.JobStore.failure`).

    A named tuple: ``job_id, fence, at, text = failure`` unpacks it.
    """

    job_id: str
    #: the fence of the lease whose attempt failed
    fence: int
    #: when it was handed back, on the release's clock (the database's, or the caller's ``now``)
    at: float
    #: what the worker said: the exception's type and message, and its traceback
    text: str

    @classmethod
    def from_row(cls, job_id: str, row: Any) -> Failure:
        fence, at, text = row
        return cls(job_id, int(fence), float(at), text)


def failures_table(metadata: MetaData, name: str = "fencing_failures", *, schema: str | None = None) -> Table:
    """The table that keeps each job's last failure (``fencing_failures`` by default): ``id``,
    the job's id; ``fence``, the attempt that failed; ``at``, when; ``failure``, its text.
    Pass it to the store (``JobStore(engine, table, failures=...)``); ``create_table``
    creates it."""
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("id", KEY_COLUMN, primary_key=True, nullable=False),
        Column("fence", BigInteger, nullable=False),
        Column("at", SECONDS, nullable=False),
        Column("failure", LONG_TEXT, nullable=False),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


def check_failures_table(failures: object) -> Table | None:
    """``failures`` as a store takes it: ``None`` (no failures kept) or a table of
    :func:`failures_table`'s shape, else the error that says what it is not."""
    columns = {"id", "fence", "at", "failure"}
    return check_side_table(failures, argument="failures", kind="a failures table", columns=columns)
