"""The harness's own tables, all named ``<prefix>...``: it never touches anything else.

* ``<prefix>jobs``: a jobs table (:func:`fencing.jobs_table`), the one under test;
* ``<prefix>results``: the application's own table, written in fenced blocks; a row
  commits if and only if its job's completion commits with it;
* ``<prefix>fence_marks`` / ``<prefix>idempotency_keys``: the high-water marks of an
  "external" resource per job (:class:`fencing.FenceMarks`);
* ``<prefix>external``: the writes that resource accepted, in the order it accepted them
  (a write and its accepted token commit together, under the mark's row lock);
* ``<prefix>history``: the store's ownership history (:func:`fencing.history_table`), every
  row kept, which the verdict sets against the journals and the jobs table.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import BigInteger, Column, Engine, Integer, MetaData, String, Table, inspect

from .._sql.schema import KEY_TYPE, jobs_table
from .._store.history import History, history_table
from .._store.marks import fence_marks_table, idempotency_keys_table

__all__ = ["TortureTables"]


@dataclass(frozen=True)
class TortureTables:
    metadata: MetaData
    jobs: Table
    results: Table
    marks: Table
    keys: Table
    external: Table
    history: Table

    @property
    def recorded(self) -> History:
        """How every store of the run records its history: all of it, kept for the verdict."""
        return History(self.history, retention=None)

    @classmethod
    def named(cls, prefix: str) -> TortureTables:
        # the application's own tables (results, external) are never migrated: their keys
        # use the codec itself as column type, so they read and write str on every backend
        metadata = MetaData()
        return cls(
            metadata=metadata,
            jobs=jobs_table(metadata, f"{prefix}jobs"),
            results=Table(
                f"{prefix}results",
                metadata,
                Column("seq", Integer, primary_key=True, autoincrement=True),
                Column("job_id", KEY_TYPE, nullable=False),
                Column("owner", String(200), nullable=False),
                Column("fence", BigInteger, nullable=False),
            ),
            marks=fence_marks_table(metadata, f"{prefix}fence_marks"),
            keys=idempotency_keys_table(metadata, f"{prefix}idempotency_keys"),
            external=Table(
                f"{prefix}external",
                metadata,
                Column("seq", Integer, primary_key=True, autoincrement=True),
                Column("resource", KEY_TYPE, nullable=False),
                Column("owner", String(200), nullable=False),
                Column("fence", BigInteger, nullable=False),
            ),
            history=history_table(metadata, f"{prefix}history"),
        )

    def recreate(self, engine: Engine) -> None:
        """Drop the harness's tables (only those) and create them empty."""
        self.drop(engine)
        self.metadata.create_all(engine)

    def drop(self, engine: Engine) -> None:
        names = set(inspect(engine).get_table_names())
        present = [t for t in self.metadata.sorted_tables if t.name in names]
        self.metadata.drop_all(engine, tables=present)
