"""Requeue of a poisoned job: its attempts counted again from a base kept beside the jobs table.

A job's fence counts its claims (and revokes) and never goes down, so ``claim_next(
max_attempts=N)`` skips a job at fence ``N`` or more for good. To give such a job its attempts
back without lowering its fence (an old token would be current again) and without a column
the contract's ``jobs`` table does not have, a requeue writes the job's fence at that moment
into a table of its own (:func:`attempts_table`: ``id``, ``base``). A job's attempts are then
``fence - base``; a job without a row there has used ``fence``.

The base is read only for a job at ``max_attempts`` or above (``fence < :max_fence OR EXISTS
(...)``, which every backend evaluates left to right): a claim of jobs never requeued costs
what it did, one lookup by primary key per poisoned job the claim's walk meets.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    MetaData,
    Table,
    and_,
    exists,
    literal_column,
    not_,
    or_,
)

from .checks import FENCE_MAX, check_new_table, check_side_table
from .schema import KEY_COLUMN

__all__ = ["attempts_table", "check_attempts_table", "exhausted", "within_attempts"]

_FENCE_MAX: ColumnElement[int] = literal_column(str(FENCE_MAX))


def attempts_table(metadata: MetaData, name: str = "fencing_attempts", *, schema: str | None = None) -> Table:
    """The table a requeue writes a job's attempts base into (``fencing_attempts`` by
    default): ``id``, the job's id, and ``base``, its fence when it was last requeued."""
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("id", KEY_COLUMN, primary_key=True, nullable=False),
        Column("base", BigInteger, nullable=False),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


def check_attempts_table(attempts: object) -> Table | None:
    """``attempts`` as a store takes it: ``None`` (no requeue) or a table of
    :func:`attempts_table`'s shape, else the error that says what it is not."""
    return check_side_table(attempts, argument="attempts", kind="an attempts table", columns={"id", "base"})


def _requeued_within(jobs: Table, attempts: Table, max_fence: ColumnElement[int]) -> ColumnElement[bool]:
    """The job was requeued, and has used fewer than ``max_fence`` attempts since."""
    return exists().where(attempts.c.id == jobs.c.id, jobs.c.fence - attempts.c.base < max_fence)


def within_attempts(
    jobs: Table,
    attempts: Table | None,
    max_fence: ColumnElement[int],
    fence: ColumnElement[int] | None = None,
) -> ColumnElement[bool]:
    """The job has used fewer than ``max_fence`` attempts: its fence is below it, or (with an
    ``attempts`` table) its fence less its base is, and it is not at the last fence (``max_fence``
    is at most 2**63-1, so without an attempts table the first test says that too).
    ``fence``: the fence as the caller's statement reads it (a re-check by primary key reads
    it unindexed)."""
    fence = jobs.c.fence if fence is None else fence
    if attempts is None:
        return fence < max_fence
    return and_(fence < _FENCE_MAX, or_(fence < max_fence, _requeued_within(jobs, attempts, max_fence)))


def exhausted(jobs: Table, attempts: Table | None, max_fence: ColumnElement[int]) -> ColumnElement[bool]:
    """The job has used ``max_fence`` attempts or more: what :func:`within_attempts` is not."""
    at_least = jobs.c.fence >= max_fence
    if attempts is None:
        return at_least
    return or_(jobs.c.fence >= _FENCE_MAX, and_(at_least, not_(_requeued_within(jobs, attempts, max_fence))))
