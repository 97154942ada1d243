"""MariaDB and MySQL: no ``UPDATE ... RETURNING``; a batch is a locking read and one UPDATE;
keys are bytes of at most 1,024; a session's lock wait is a session setting."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from .base import FENCE_AGAIN, LOCKING, Database, Rule, Values

__all__ = ["MySQL"]

# error numbers: deadlock, lock wait timeout
_TRANSIENT = {1213, 1205}
# client and server: can't connect (2002 socket, 2003 TCP), server gone away, lost connection
# during query, lost connection at handshake, server shutdown in progress
_UNAVAILABLE = {2002, 2003, 2006, 2013, 2055, 1053}
# table full, disk full
_FULL = {1114, 1021}
# --read-only (1290), a read-only transaction (1792), a read-only table (1036)
_READ_ONLY = {1290, 1792, 1036}
_DUPLICATE_ENTRY = 1062
_BAD_FIELD = 1054  # ER_BAD_FIELD_ERROR: "Unknown column"


def _code(error: Any) -> int | None:
    args: tuple[Any, ...] = getattr(error, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _set_wait(execute: Callable[[str], Any], seconds: int) -> None:
    execute(f"SET SESSION innodb_lock_wait_timeout = {seconds}")


_CONF = "in my.cnf ([mariadbd]/[mysqld]) or SET GLOBAL"
_RULES = (
    Rule(
        "innodb_flush_log_at_trx_commit",
        lambda s: s["innodb_flush_log_at_trx_commit"] == "0",
        "the redo log is written and flushed about once a second: a crash of the server (or "
        f"of its machine) loses up to a second of acknowledged commits: {FENCE_AGAIN}",
        f"innodb_flush_log_at_trx_commit = 1 {_CONF}",
    ),
    Rule(
        "innodb_flush_log_at_trx_commit",
        lambda s: s["innodb_flush_log_at_trx_commit"] == "2",
        "the redo log is flushed about once a second: power loss or an OS crash loses up to a "
        f"second of acknowledged commits (a crash of the server alone does not): {FENCE_AGAIN}",
        f"innodb_flush_log_at_trx_commit = 1 {_CONF}",
    ),
    Rule(
        "sync_binlog",
        lambda s: s["log_bin"] == "on" and s["sync_binlog"] != "1",
        "the binary log is not flushed at every commit: after power loss or an OS crash it can "
        "lack commits InnoDB kept, so replicas and a point-in-time restore miss them, and a "
        "failover to a replica hands a fence out again",
        f"sync_binlog = 1 {_CONF}",
    ),
    Rule(
        "innodb_doublewrite",
        lambda s: s["innodb_doublewrite"] in ("off", "0", "detect_only"),
        "a page torn by power loss or an OS crash cannot be repaired: the jobs table (its "
        "fences) can come back corrupt",
        "innodb_doublewrite = ON in my.cnf, then restart the server",
    ),
)


class MySQL(Database):
    names = ("mysql", "mariadb")
    family = "mysql"
    known = True
    async_drivers = ("asyncmy", "aiomysql")
    extras: ClassVar[dict[str, str]] = {"pymysql": "mysql", "asyncmy": "asyncmy"}
    clock_sql = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) * 1e-6)"
    clock_resolution = 1e-6
    id_max_bytes = 1024  # VARBINARY(1024): InnoDB's index prefix limit, with room to spare
    batch_completion = LOCKING
    backward_walk_hint = "FORCE INDEX ({index})"

    def driven_directly(self, driver: str) -> bool:
        return driver == "pymysql"

    def unindexed(self, sql: str) -> str:
        # MariaDB's optimizer may drive a join through the ready index on these columns
        return "(" + sql + " + 0)"

    def identity(self, cursor: Any) -> str | None:
        cursor.execute("SELECT @@hostname, @@port, @@datadir, DATABASE()")
        host, port, datadir, database = cursor.fetchone()
        return f"mysql {host}:{port}:{datadir} {database}"

    def autocommit_probe(self, driver: str) -> Callable[[Any], bool] | None:
        if driver == "pymysql":
            return lambda dbapi: bool(dbapi.get_autocommit())
        return None

    def wait_for_locks(self, execute: Callable[[str], Any], seconds: float) -> Callable[[], None] | None:
        # a session setting (no transaction-wide form; SET STATEMENT would cover one
        # statement, not the store's after it): the pooled session's own value is put back
        before = int(execute("SELECT @@session.innodb_lock_wait_timeout").scalar_one())
        _set_wait(execute, max(1, math.ceil(seconds)))  # whole seconds, at least 1: its unit
        return lambda: _set_wait(execute, before)

    def transient(self, error: Any) -> bool:
        return _code(error) in _TRANSIENT

    def unavailable(self, error: Any) -> bool:
        return _code(error) in _UNAVAILABLE

    def full(self, error: Any) -> bool:
        return _code(error) in _FULL

    def read_only(self, error: Any) -> bool:
        return _code(error) in _READ_ONLY

    def duplicate_key(self, error: Any) -> bool:
        return _code(error) == _DUPLICATE_ENTRY

    def undefined_column(self, error: Any) -> bool:
        return _code(error) == _BAD_FIELD

    durability_settings = ("innodb_flush_log_at_trx_commit", "sync_binlog", "innodb_doublewrite")
    durability_rules = _RULES

    def read_durability(self, cursor: Any) -> dict[str, str]:
        cursor.execute(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN "
            "('innodb_flush_log_at_trx_commit', 'sync_binlog', 'log_bin', 'innodb_doublewrite')"
        )
        return {str(name).lower(): str(value).lower() for name, value in cursor.fetchall()}

    def shown(self, setting: str, values: Values) -> str:
        if setting == "sync_binlog":
            return f"{values[setting]} (log_bin {values['log_bin']})"
        return values[setting]

    def not_applicable(self, setting: str, values: Values, platform: str) -> str | None:
        if setting == "sync_binlog" and values["log_bin"] != "on":
            return "the binary log is off"
        return None
