"""SQLite: a file on this machine, one writer at a time (``BEGIN IMMEDIATE``, the library's
engine glue in ``fencing._runtime.sqlite``), statements without round trips."""

from __future__ import annotations

import sqlite3
from typing import Any, ClassVar

from sqlalchemy import ColumnElement, func

from .base import COUNTED, FENCE_AGAIN, WATCHED, Database, Rule, Values

__all__ = ["SQLite", "result_code"]

#: PRAGMA synchronous's numbers, by name
_SYNCHRONOUS = {"0": "off", "1": "normal", "2": "full", "3": "extra"}

# SQLite's primary result codes (an extended code's low byte)
_BUSY, _LOCKED, _READONLY, _CORRUPT, _FULL, _NOTADB = 5, 6, 8, 11, 13, 26


def result_code(error: Any) -> int | None:
    """SQLite's primary result code of ``error`` (Python 3.11+ says it), or ``None``."""
    code = getattr(error, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


_SYNCHRONOUS_FULL = "synchronous = FULL (fencing.create_sqlite_engine's default, durability='full')"
_RULES = (
    Rule(
        "journal_mode",
        lambda s: s["journal_mode"] in ("off", "memory"),
        "no journal on disk: a crash in the middle of a commit leaves the database corrupt",
        "journal_mode = WAL (fencing.create_sqlite_engine and fencing.configure_sqlite set it)",
    ),
    Rule(
        "synchronous",
        lambda s: s["synchronous"] == "off",
        "nothing is synced: power loss or an OS crash can lose the last commits or corrupt the "
        f"database: {FENCE_AGAIN}",
        _SYNCHRONOUS_FULL,
    ),
    Rule(
        "synchronous",
        lambda s: s["synchronous"] == "normal" and s["journal_mode"] == "wal",
        "the WAL is not synced at each commit: power loss or an OS crash rolls back the last "
        f"commits (a crash of the process alone does not): {FENCE_AGAIN}",
        _SYNCHRONOUS_FULL,
    ),
    Rule(
        "synchronous",
        lambda s: s["synchronous"] == "normal",
        "with a rollback journal, power loss at the wrong moment can corrupt the database "
        "(SQLite documents the chance as small, on older filesystems)",
        f"{_SYNCHRONOUS_FULL}, or journal_mode = WAL with synchronous = FULL",
    ),
    Rule(
        "fullfsync",
        lambda s: s["fullfsync"] == "off",
        "on macOS fsync leaves the commit in the drive's cache: power loss can lose commits even "
        f"with synchronous = FULL: {FENCE_AGAIN}",
        "PRAGMA fullfsync = ON (and PRAGMA checkpoint_fullfsync = ON) on every connection, in "
        "a connect listener",
    ),
)


class SQLite(Database):
    names = ("sqlite",)
    family = "sqlite"
    known = True
    # julianday('now') counts milliseconds
    clock_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    clock_resolution = 1e-3
    upsert = COUNTED
    locks_whole_database = True
    ranges_at_row_values = True
    is_file = True
    async_drivers = ("aiosqlite",)
    # pysqlite: the standard library's own
    extras: ClassVar[dict[str, str]] = {"pysqlite": "", "aiosqlite": "aiosqlite"}
    #: the drivers the library's engine glue (``fencing.configure_sqlite``) supports
    glued_drivers = ("pysqlite", "aiosqlite")
    types_are_declared_names = True
    # the engine's begin listener always opens a real transaction
    honours_autocommit = False

    def glues(self, driver: str) -> bool:
        return driver in self.glued_drivers

    def wakeups(self, driver: str, *, is_async: bool) -> str | None:
        # PRAGMA data_version changes when another connection commits (8 µs to read)
        return WATCHED if driver in self.glued_drivers else None

    def driven_directly(self, driver: str) -> bool:
        return driver == "pysqlite"

    def unindexed(self, sql: str) -> str:
        return "+" + sql  # SQLite's way to keep an index out of a join

    def fence_sum(self, fence: ColumnElement[Any]) -> ColumnElement[Any]:
        # sum() fails on a 64-bit overflow (a job at the last fence); total() is a float
        return func.total(fence)

    def prefix_match(self, column: ColumnElement[Any], pattern: ColumnElement[Any]) -> ColumnElement[bool]:
        # LIKE folds ASCII case; GLOB does not (and uses the key)
        return column.op("GLOB")(pattern)

    def prefix_pattern(self, prefix: str) -> str:
        return "".join(f"[{c}]" if c in "*?[" else c for c in prefix) + "*"

    def transient(self, error: Any) -> bool:
        if not isinstance(error, sqlite3.OperationalError):
            return False
        code = result_code(error)
        if code is not None:
            return code in (_BUSY, _LOCKED)
        return "database is locked" in str(error) or "database table is locked" in str(error)

    def full(self, error: Any) -> bool:
        if not isinstance(error, sqlite3.Error):
            return False
        code = result_code(error)
        return code == _FULL if code is not None else "database or disk is full" in str(error)

    def read_only(self, error: Any) -> bool:
        if not isinstance(error, sqlite3.Error):
            return False
        code = result_code(error)
        return code == _READONLY if code is not None else "readonly database" in str(error)

    def corrupt(self, error: Any) -> bool:
        if not isinstance(error, sqlite3.DatabaseError):
            return False
        code = result_code(error)
        if code is not None:
            return code in (_CORRUPT, _NOTADB)
        return "malformed" in str(error) or "not a database" in str(error)

    def duplicate_key(self, error: Any) -> bool:
        return isinstance(error, sqlite3.IntegrityError) and "UNIQUE constraint failed" in str(error)

    def undefined_column(self, error: Any) -> bool:
        said = str(error)  # a read's "no such column: x", an insert's "table t has no column named x"
        return isinstance(error, sqlite3.OperationalError) and (
            "no such column" in said or "has no column named" in said
        )

    durability_settings = ("journal_mode", "synchronous", "fullfsync")
    durability_rules = _RULES

    def read_durability(self, cursor: Any) -> dict[str, str]:
        values = {}
        for pragma in self.durability_settings:
            cursor.execute(f"PRAGMA {pragma}")
            values[pragma] = str(cursor.fetchone()[0]).lower()
        values["synchronous"] = _SYNCHRONOUS.get(values["synchronous"], values["synchronous"])
        values["fullfsync"] = "on" if values["fullfsync"] == "1" else "off"
        return values

    def shown(self, setting: str, values: Values) -> str:
        if setting == "synchronous":
            return f"{values[setting]} (journal_mode {values['journal_mode']})"
        return values[setting]

    def not_applicable(self, setting: str, values: Values, platform: str) -> str | None:
        if setting == "fullfsync" and platform != "darwin":
            return f"applies on macOS only (F_FULLFSYNC); on {platform} fsync reaches the disk"
        return None
