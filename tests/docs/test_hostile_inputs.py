"""The hostile-input table: what every public function does with bad input, row by row.

The rows below are the one source of truth. ``test_row`` runs each of them and checks the
exception's exact type, its message, its ``__cause__``, and that nothing changed (every row of
every table of the database, every byte of every file in the row's directory, an empty working
directory). ``test_the_document_is_the_table`` checks that docs/HOSTILE-INPUTS.md is exactly
the table rendered from the rows. After changing a row, regenerate the document:

    python -m tests.docs.test_hostile_inputs > docs/HOSTILE-INPUTS.md
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, Text
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine

import fencing
import service
from fencing import (
    ConfigurationError,
    DatabaseCorrupt,
    DatabaseError,
    DatabaseMissing,
    DatabaseReadOnly,
    DatabaseUnavailable,
    Election,
    FenceMarks,
    FencingError,
    Heartbeat,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    Lease,
    LeaseLost,
    Locks,
    SchemaMismatch,
    TableMissing,
)
from fencing._store.heartbeat_task import AsyncHeartbeat
from fencing.asyncio import AsyncFenceMarks, AsyncJobStore, AsyncLocks
from tests import asyncfront, backends

DOC = Path(__file__).resolve().parents[2] / "docs" / "HOSTILE-INPUTS.md"

#: servers that are down: nothing listens on port 1, and connect_timeout bounds the wait anyway
DOWN_PG = "postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2"
DOWN_MYSQL = "mysql+pymysql://root@127.0.0.1:1/test?connect_timeout=2"

SQL = "'; DROP TABLE jobs; --"

#: how a message shows 10**400 (or -10**400), an int too large for a float: its repr, cut
HUGE = "1" + "0" * 79 + "... (401 chars)"
HUGE_RANGE = "must be a finite number within a float's range (about 1.8e308), got "
DB_FLOOR = "must be at least 0.001 s with the database's clock (now=None), got "


@dataclass(frozen=True)
class Row:
    """One bad input: the public function, what is wrong, the exact call, and what users get."""

    function: str
    bad: str
    #: the exact code run (an expression, or one statement), in the names of NAMESPACE_DOC
    call: str
    #: the exception raised, or None: the input is valid data and the call returns ``returns``
    raises: type[BaseException] | None
    #: the exact message (``{tmp}`` stands for the row's directory), or a regex for a message
    #: with a part that is not ours (a driver's wording)
    message: str | re.Pattern[str] | None = None
    #: the SQLAlchemy error kept as ``__cause__`` (an instance of it), or None: no cause
    cause: type[BaseException] | None = None
    #: for valid data: the repr of the value returned
    returns: str | None = None
    #: for valid data: an expression evaluated after the call, and the repr of its value
    #: (how the data was stored), and the job ids whose rows the call may write
    stored: tuple[str, str] | None = None
    writes: tuple[str, ...] = ()
    #: "seeded": the seeded database of the tested backend; "none": no database; the other
    #: setups make files in the row's directory (SQLite only)
    setup: str = "seeded"
    #: dialect names the row runs on (() = every backend)
    backends: tuple[str, ...] = ()
    #: a known gap: what users get today (the row runs as xfail(strict) until it is fixed)
    today: str | None = None
    note: str = ""
    #: the async front's message, where it names its own types (else ``message``)
    async_message: str | None = None
    #: a function the async front does not have (a sync helper)
    sync_only: bool = False

    def runs_async(self) -> bool:
        """Whether the row also runs through the async front: a call of the library on the
        seeded database (``service.py`` is sync by contract; a file row is about the file)."""
        return self.setup == "seeded" and not self.call.startswith("service.") and not self.sync_only

    def where(self) -> str:
        if self.setup == "none":
            return "no database"
        if self.setup != "seeded":
            return "SQLite file"
        if not self.backends:
            return "all"
        return ", ".join(BACKEND_NAMES[b] for b in self.backends)


BACKEND_NAMES = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "mysql": "MariaDB/MySQL"}

FILE_SETUPS = (
    "directory",
    "text_file",
    "missing_parent",
    "missing_file",
    "readonly_file",
    "readonly_engine",
    "corrupt_header",
    "corrupt_pages",
)

UNREACHABLE = (
    "the database could not be reached or the connection was lost before anything committed; "
    "nothing was changed; try again once it answers ("
)
PG_DOWN_MESSAGE = re.compile(
    re.escape(UNREACHABLE)
    + r'OperationalError: connection failed: connection to server at "127\.0\.0\.1", port 1 failed: '
    r"Connection refused\n.*\)",
    re.DOTALL,
)
MYSQL_DOWN_MESSAGE = (
    UNREACHABLE + "OperationalError: (2003, \"Can't connect to MySQL server on '127.0.0.1' "
    '([Errno 111] Connection refused)"))'
)
#: a read-only SQLite file, named (``{tmp}`` for the test's directory)
READ_ONLY_FILE = (
    "the SQLite database {name!r} is read-only here: the file (or its -wal, -shm) is not writable "
    "by this process, it was opened read-only (mode=ro), or its filesystem is mounted read-only; "
    "make it writable for this user, or open it read-write; nothing was changed "
    "(OperationalError: attempt to write a readonly database)"
)

ROWS: list[Row] = [
    # -- JobStore ---------------------------------------------------------------------------------
    Row(
        "JobStore",
        "a URL where the engine goes",
        'JobStore("sqlite:///jobs.db")',
        InvalidArgumentType,
        "engine must be a sqlalchemy Engine, got str",
        async_message="engine must be a sqlalchemy AsyncEngine, got str",
    ),
    Row(
        "JobStore",
        "a SQLite engine without BEGIN IMMEDIATE",
        'JobStore(create_engine(f"sqlite:///{tmp}/plain.db"))',
        ConfigurationError,
        "this SQLite engine does not begin transactions with BEGIN IMMEDIATE, so compare-and-set "
        "would not be atomic: create it with fencing.create_sqlite_engine() or pass it to "
        "fencing.configure_sqlite()",
        setup="none",
    ),
    Row(
        "JobStore.create_table",
        "an existing table with other columns",
        'JobStore(engine, jobs_table(MetaData(), "other")).create_table()',
        SchemaMismatch,
        "existing table 'other' does not match the jobs schema (left unchanged): column 'owner' is "
        "missing; column 'until' is missing; column 'fence' is missing; column 'result' is missing; "
        "column 'done' is missing; unexpected column 'x'",
    ),
    Row(
        "JobStore.enqueue",
        "`None` as the job id",
        "store.enqueue(None)",
        InvalidArgumentType,
        "job_id must be a str, got NoneType None",
    ),
    Row(
        "JobStore.enqueue",
        "a bool as a time",
        'store.enqueue("new", ready_at=True)',
        InvalidArgumentType,
        "ready_at must be a real number (int or float), got bool True",
    ),
    Row(
        "JobStore.enqueue",
        "a negative int too large for a float as a time",
        'store.enqueue("new", ready_at=-10**400)',
        InvalidArgument,
        "ready_at " + HUGE_RANGE + "-" + HUGE[:79] + "... (402 chars)",
    ),
    Row(
        "JobStore.enqueue",
        "SQL in the job id (valid data)",
        f"store.enqueue({SQL!r})",
        None,
        returns="True",
        stored=(f"store.state({SQL!r}).job_id", repr(SQL)),
        writes=(SQL,),
    ),
    Row(
        "JobStore.enqueue",
        "a job id of 1,000,000 characters (valid data)",
        'store.enqueue("x" * 1_000_000)',
        None,
        returns="True",
        stored=('store.state("x" * 1_000_000).job_id == "x" * 1_000_000', "True"),
        writes=("x" * 1_000_000,),
        backends=("sqlite",),
        note="no limit on SQLite",
    ),
    Row(
        "JobStore.enqueue",
        "NUL inside the job id",
        'store.enqueue("a\\x00b")',
        InvalidArgument,
        "job_id contains NUL (U+0000), which PostgreSQL text cannot store",
        backends=("postgresql",),
    ),
    Row(
        "JobStore.enqueue",
        "NUL inside the job id (valid data)",
        'store.enqueue("a\\x00b")',
        None,
        returns="True",
        stored=('store.state("a\\x00b").job_id', "'a\\x00b'"),
        writes=("a\x00b",),
        backends=("sqlite", "mysql"),
        note="stored whole: `a` and `a\\x00` are other jobs",
    ),
    Row(
        "JobStore.state",
        "a lone surrogate in the job id",
        'store.state("job\\ud800")',
        InvalidArgument,
        "job_id cannot be stored as UTF-8 (lone surrogate at index 3): 'job\\ud800'",
    ),
    Row(
        "JobStore.claim",
        "a zero TTL",
        'store.claim("free", "w", ttl=0, now=110.0)',
        InvalidArgument,
        "ttl must be > 0, got 0",
    ),
    Row(
        "JobStore.claim",
        "a str as the TTL",
        'store.claim("free", "w", ttl="30", now=110.0)',
        InvalidArgumentType,
        "ttl must be a real number (int or float), got str '30'",
    ),
    Row(
        "JobStore.claim",
        "`now + ttl` overflows to infinity",
        'store.claim("free", "w", ttl=1e308, now=1e308)',
        InvalidArgument,
        "now + ttl overflows: now=1e+308, ttl=1e+308",
    ),
    Row(
        "JobStore.claim",
        "a TTL below the resolution of `now`",
        'store.claim("free", "w", ttl=1e-7, now=1e10)',
        InvalidArgument,
        "ttl=1e-07 is below the resolution of now=10000000000.0: now + ttl == now",
        note="the lease would be expired when taken",
    ),
    Row(
        "JobStore.claim",
        "a TTL below the database clock's tick (1 ms)",
        'store.claim("free", "w", ttl=1e-9)',
        InvalidArgument,
        "ttl " + DB_FLOOR + "1e-09",
        note="now=None: SQLite's clock counts milliseconds; one floor on every backend",
    ),
    Row(
        "JobStore.claim",
        "an int too large for a float as the clock",
        'store.claim("free", "w", ttl=10, now=10**400)',
        InvalidArgument,
        "now " + HUGE_RANGE + HUGE,
    ),
    Row(
        "JobStore.claim",
        "an int too large for a float as the TTL",
        'store.claim("free", "w", ttl=10**400, now=110.0)',
        InvalidArgument,
        "ttl " + HUGE_RANGE + HUGE,
    ),
    Row(
        "JobStore.claim",
        "a Decimal as the TTL",
        'store.claim("free", "w", ttl=Decimal("1e400"), now=110.0)',
        InvalidArgumentType,
        "ttl must be a real number (int or float), got Decimal Decimal('1E+400')",
        note="a Decimal of any size: not a real number to Python's numeric tower",
    ),
    Row(
        "JobStore.claim",
        "a job id over the key limit (2000 bytes)",
        'store.claim("x" * 2001, "w", ttl=10, now=110.0)',
        InvalidArgument,
        "job_id is 2001 bytes in UTF-8; postgresql keys hold at most 2000",
        backends=("postgresql",),
    ),
    Row(
        "JobStore.claim",
        "a job id over the key limit (1024 bytes)",
        'store.claim("é" * 513, "w", ttl=10, now=110.0)',
        InvalidArgument,
        "job_id is 1026 bytes in UTF-8; mysql keys hold at most 1024",
        backends=("mysql",),
        note="counted in UTF-8 bytes, not characters",
    ),
    Row(
        "JobStore.renew",
        "a tuple where the Lease goes",
        'store.renew(("job", "w", 1), ttl=10, now=110.0)',
        InvalidArgumentType,
        "lease must be a fencing.Lease, got tuple ('job', 'w', 1)",
    ),
    Row(
        "Lease",
        "a bool as the fence",
        'store.renew(Lease("job", "w", True), ttl=10, now=110.0)',
        InvalidArgumentType,
        "fence must be an int, got bool True",
        note="a Lease is a plain value: its fields are checked where it is used",
    ),
    Row(
        "JobStore.renew",
        "a fence beyond 64 bits (valid: never matches)",
        'store.renew(Lease("job", "w", 2**64), ttl=10, now=110.0)',
        None,
        returns=(
            "Refusal(path='renew', job_id='job', owner='w', fence=18446744073709551616, "
            "reason='stale fence', holder=None, current_fence=None)"
        ),
        note="no fence that large was ever handed out: refused unread",
    ),
    Row(
        "JobStore.complete",
        "an int as the result",
        "store.complete(lease, 42, now=110.0)",
        InvalidArgumentType,
        "result must be a str or None, got int 42",
    ),
    Row(
        "JobStore.complete",
        "NUL inside the result",
        'store.complete(lease, "r\\x00s", now=110.0)',
        InvalidArgument,
        "result contains NUL (U+0000), which PostgreSQL text cannot store",
        backends=("postgresql",),
    ),
    Row(
        "JobStore.release",
        "a negative infinite delay",
        "store.release(lease, delay=-inf, now=110.0)",
        InvalidArgument,
        "delay must be a finite number, got -inf",
    ),
    Row(
        "JobStore.release",
        "a delay too large for a float",
        "store.release(lease, delay=10**400, now=110.0)",
        InvalidArgument,
        "delay " + HUGE_RANGE + HUGE,
    ),
    Row(
        "JobStore.release",
        "a delay below the database clock's tick (1 ms)",
        "store.release(lease, delay=5e-4)",
        InvalidArgument,
        "delay " + DB_FLOOR + "0.0005",
    ),
    Row(
        "JobStore.revoke",
        "`None` as the job id",
        "store.revoke(None)",
        InvalidArgumentType,
        "job_id must be a str, got NoneType None",
    ),
    Row(
        "JobStore.delete",
        "a float as the job id",
        "store.delete(1.5)",
        InvalidArgumentType,
        "job_id must be a str, got float 1.5",
    ),
    Row(
        "JobStore.requeue",
        "a store made without an attempts table",
        'store.requeue("job")',
        ConfigurationError,
        "requeue needs a table for the attempts' bases: JobStore(engine, table, "
        "attempts=fencing.attempts_table(metadata)), created by store.create_table()",
    ),
    Row(
        "JobStore.requeue",
        "`None` as the job id",
        "JobStore(engine, attempts=attempts_table(MetaData())).requeue(None)",
        InvalidArgumentType,
        "job_id must be a str, got NoneType None",
    ),
    Row(
        "JobStore",
        "a table name where the attempts table goes",
        'JobStore(engine, attempts="fencing_attempts")',
        InvalidArgumentType,
        "attempts must be a sqlalchemy Table (fencing.attempts_table), got str",
    ),
    Row(
        "JobStore.enqueue",
        "a payload in a store without a payloads table",
        'store.enqueue("new", payload={"a": 1})',
        ConfigurationError,
        "enqueue(payload=) needs a table for the payloads: JobStore(engine, table, "
        "payloads=fencing.payloads_table(metadata)), created by store.create_table()",
    ),
    Row(
        "JobStore.enqueue",
        "a payload that would not read back equal (a tuple)",
        'JobStore(engine, payloads=payloads_table(MetaData())).enqueue("new", payload={"at": (1, 2)})',
        InvalidArgument,
        "payload {'at': (1, 2)} would read back as {'at': [1, 2]}: pass lists, not tuples, and "
        "dicts whose keys are str",
    ),
    Row(
        "JobStore.enqueue",
        "a payload that is not JSON (NaN)",
        'JobStore(engine, payloads=payloads_table(MetaData())).enqueue("new", payload=[nan])',
        InvalidArgumentType,
        "payload must be JSON (dicts with str keys, lists, str, int, finite float, bool, None): "
        "[nan] is not (NaN and the infinities are not JSON)",
    ),
    Row(
        "JobStore.payload",
        "a store without a payloads table",
        'store.payload("job")',
        ConfigurationError,
        "payload needs a table for the payloads: JobStore(engine, table, "
        "payloads=fencing.payloads_table(metadata)), created by store.create_table()",
    ),
    Row(
        "JobStore.claim_next",
        "a negative wait",
        'store.claim_next("w", ttl=30.0, wait=-1)',
        InvalidArgument,
        "wait must be >= 0 seconds (0: do not wait), got -1",
    ),
    Row(
        "JobStore.claim_next",
        "a wait in the caller's transaction",
        'store.claim_next("w", ttl=30.0, wait=5.0, conn="session")',
        InvalidArgument,
        "wait= cannot wait in your transaction (conn=): it would hold it open; claim in it without "
        "wait=, or wait in a transaction of the store's own",
    ),
    Row(
        "JobStore",
        "a table name where the payloads table goes",
        'JobStore(engine, payloads="fencing_payloads")',
        InvalidArgumentType,
        "payloads must be a sqlalchemy Table (fencing.payloads_table), got str",
    ),
    Row(
        "JobStore.release",
        "a failure in a store without a failures table",
        'store.release(lease, failure="boom", now=110.0)',
        ConfigurationError,
        "release(failure=) needs a table for the failures: JobStore(engine, table, "
        "failures=fencing.failures_table(metadata)), created by store.create_table()",
    ),
    Row(
        "JobStore.release",
        "an exception where the failure's text goes",
        'JobStore(engine, failures=failures_table(MetaData())).release(lease, failure=ValueError("x"))',
        InvalidArgumentType,
        "failure must be a str, got ValueError ValueError('x')",
    ),
    Row(
        "JobStore.failure",
        "a store without a failures table",
        'store.failure("job")',
        ConfigurationError,
        "failure needs a table for the failures: JobStore(engine, table, "
        "failures=fencing.failures_table(metadata)), created by store.create_table()",
    ),
    Row(
        "JobStore",
        "a table name where the failures table goes",
        'JobStore(engine, failures="fencing_failures")',
        InvalidArgumentType,
        "failures must be a sqlalchemy Table (fencing.failures_table), got str",
    ),
    Row(
        "failures_table",
        "`None` where the MetaData goes",
        "failures_table(None)",
        InvalidArgumentType,
        "metadata must be a sqlalchemy MetaData, got NoneType",
        setup="none",
    ),
    Row(
        "payloads_table",
        "`None` where the MetaData goes",
        "payloads_table(None)",
        InvalidArgumentType,
        "metadata must be a sqlalchemy MetaData, got NoneType",
        setup="none",
    ),
    Row(
        "attempts_table",
        "`None` where the MetaData goes",
        "attempts_table(None)",
        InvalidArgumentType,
        "metadata must be a sqlalchemy MetaData, got NoneType",
        setup="none",
    ),
    Row(
        "JobStore.fenced",
        "a stale fence",
        'with store.fenced(Lease("job", "w", 7), now=110.0): pass',
        LeaseLost,
        "lease on 'job' (fence 7) is not current at the start of the fenced block; rolled back",
    ),
    Row(
        "JobStore.fenced",
        "a str where the bool `complete` goes",
        'with store.fenced(lease, now=110.0, complete="no", result="paid"): pass',
        InvalidArgumentType,
        "complete must be a bool, got str 'no'",
    ),
    Row(
        "JobStore.fenced",
        "a str where the caller's Connection or Session goes",
        'with store.fenced(lease, now=110.0, conn="session"): pass',
        InvalidArgumentType,
        "conn must be a sqlalchemy Connection, an ORM Session or None, got str",
        async_message="conn must be a sqlalchemy AsyncConnection, an AsyncSession or None, got str",
    ),
    Row(
        "JobStore.revoke",
        "inside the fenced block of the same job, on the block's own thread (it would wait for the block)",
        'with store.fenced(lease, now=110.0): store.revoke("job")',
        ConfigurationError,
        "a fenced block (or a check(conn=)) of this thread holds job 'job''s row until its "
        "transaction ends: this operation would wait for it forever; pass conn= (the block's "
        "connection) or run it after the block",
        backends=("postgresql", "mysql"),
    ),
    Row(
        "JobStore.enqueue",
        "while the caller's own transaction on another connection holds SQLite's write lock",
        'with engine.begin() as c: c.exec_driver_sql("UPDATE other SET x = x"); store.enqueue("new")',
        ConfigurationError,
        "this thread (or task) holds SQLite's write lock itself, in a transaction of its own on "
        "another connection of this engine (an ORM Session or a Connection that has written and not "
        "yet committed): the store's write would wait for it until busy_timeout. Run the operation "
        "in that transaction with conn= (your Session or Connection), or commit it first; nothing "
        "was changed",
        backends=("sqlite",),
        sync_only=True,
        note="at once, not after busy_timeout; a transaction that only read is not in the way",
    ),
    Row(
        "JobStore.check",
        "a stale fence",
        'store.check(Lease("job", "w", 7), now=110.0)',
        LeaseLost,
        "lease on 'job' (fence 7) is not current",
    ),
    Row(
        "JobStore.check",
        "a lease whose time is up",
        "store.check(lease, now=1e9)",
        LeaseLost,
        "lease on 'job' (fence 1) is not current",
    ),
    Row(
        "JobStore.claim_next",
        "a zero limit",
        'store.claim_next("w", ttl=10, now=110.0, limit=0)',
        InvalidArgument,
        "limit must be between 1 and 2**63-1, got 0",
    ),
    Row(
        "JobStore.claim_next",
        "a Fraction too large for a float as the TTL",
        'store.claim_next("w", ttl=Fraction(10**400), now=110.0)',
        InvalidArgument,
        "ttl " + HUGE_RANGE + "Fraction(" + "1" + "0" * 70 + "... (414 chars)",
    ),
    Row(
        "JobStore.claim_next",
        "an int too long to print as the limit",
        'store.claim_next("w", ttl=10, now=110.0, limit=10**5000)',
        InvalidArgument,
        "limit must be between 1 and 2**63-1, got an int of 16610 bits",
        note="past Python's 4300-digit limit for printing an int",
    ),
    Row(
        "JobStore.complete_many",
        "a bare Lease where a pair goes",
        "store.complete_many([lease], now=110.0)",
        InvalidArgumentType,
        "completions must hold (lease, result) pairs, got Lease(job_id='job', owner='w', fence=1, "
        "until=150.0)",
    ),
    Row(
        "JobStore.complete_many",
        "`None` where the pairs go",
        "store.complete_many(None, now=110.0)",
        InvalidArgumentType,
        "completions must be an iterable of (lease, result) pairs, got NoneType None",
    ),
    Row(
        "JobStore.complete_and_claim_next",
        "a bare Lease where a pair goes",
        'store.complete_and_claim_next([lease], "w", ttl=10, now=110.0)',
        InvalidArgumentType,
        "completions must hold (lease, result) pairs, got Lease(job_id='job', owner='w', fence=1, "
        "until=150.0)",
    ),
    Row(
        "JobStore.complete_and_claim_next",
        "a zero limit (the completion is not made either)",
        'store.complete_and_claim_next([(lease, "paid")], "w", ttl=10, now=110.0, limit=0)',
        InvalidArgument,
        "limit must be between 1 and 2**63-1, got 0",
    ),
    Row(
        "JobStore.complete_and_claim_next",
        "`None` as the owner",
        'store.complete_and_claim_next([(lease, "paid")], None, ttl=10, now=110.0)',
        InvalidArgumentType,
        "owner must be a str, got NoneType None",
    ),
    Row(
        "JobStore.poisoned",
        "`None` as the attempt count",
        "store.poisoned(None)",
        InvalidArgumentType,
        "max_attempts must be an int, got NoneType None",
    ),
    Row(
        "JobStore.claim_many",
        "one str where the owners go",
        'store.claim_many("free", "wx", ttl=10, now=110.0)',
        InvalidArgumentType,
        "owners must be an iterable of str, got str 'wx'",
        note="not two owners `w` and `x`",
    ),
    Row(
        "JobStore.enqueue",
        "a table that does not exist",
        'JobStore(engine, jobs_table(MetaData(), "nosuch")).enqueue("new")',
        TableMissing,
        "table 'nosuch' does not exist; create it first (JobStore.create_table() or service.init_db())",
        cause=sa_exc.DBAPIError,
    ),
    Row(
        "JobStore.holder",
        "None where the job id goes",
        "store.holder(None)",
        InvalidArgumentType,
        "job_id must be a str, got NoneType None",
    ),
    Row(
        "JobStore.holder",
        "a NaN clock",
        'store.holder("job", now=nan)',
        InvalidArgument,
        "now must be a finite number, got nan",
    ),
    Row(
        "JobStore.check_key",
        "an int where the key goes",
        'store.check_key(7, name="candidate")',
        InvalidArgumentType,
        "candidate must be a str, got int 7",
        sync_only=True,
    ),
    # -- Worker ------------------------------------------------------------------------------------
    Row(
        "Schedule",
        "an @ in the name (it separates the name from the tick in a job id)",
        'Schedule("nightly@paris", cron="0 3 * * *")',
        InvalidArgument,
        "name must be non-empty, without '@' (it separates the name from the tick in a job id) and "
        "without surrounding spaces, got 'nightly@paris'",
        setup="none",
    ),
    Row(
        "Schedule",
        "a cron expression with a seconds field",
        'Schedule("s", cron="0 0 3 * * *")',
        InvalidArgument,
        "schedule 's': cron must have five fields (minute hour day month weekday) or be one of "
        "@annually, @daily, @hourly, @midnight, @monthly, @weekly, @yearly, got '0 0 3 * * *'",
        setup="none",
    ),
    Row(
        "Schedule",
        "a time zone that does not exist",
        'Schedule("s", cron="0 3 * * *", timezone="Europe/Pariss")',
        InvalidArgument,
        "timezone 'Europe/Pariss' is not a zoneinfo time zone (such as 'Europe/Paris'; on a system "
        "without a time zone database, pip install tzdata)",
        setup="none",
    ),
    Row(
        "Schedule",
        "an interval shorter than the tick's second",
        'Schedule("s", every=0.5)',
        InvalidArgument,
        "every must be a finite number of seconds >= 1, got 0.5",
        setup="none",
    ),
    Row(
        "Schedule",
        "a policy for missed ticks that does not exist",
        'Schedule("s", every=60, missed="skip")',
        InvalidArgument,
        "missed must be one of latest, all, none, got 'skip'",
        setup="none",
    ),
    Row(
        "Scheduler",
        "one schedule where the list goes",
        'Scheduler(store, Schedule("s", every=60))',
        InvalidArgumentType,
        "schedules must be an iterable of fencing.Schedule, got Schedule",
        sync_only=True,
    ),
    Row(
        "Scheduler",
        "two schedules of one name",
        'Scheduler(store, [Schedule("s", every=60), Schedule("s", every=30)])',
        InvalidArgument,
        "two schedules are named 's': each name once",
        sync_only=True,
    ),
    Row(
        "schedules_table",
        "`None` where the MetaData goes",
        "schedules_table(None)",
        InvalidArgumentType,
        "metadata must be a sqlalchemy MetaData, got NoneType",
        setup="none",
    ),
    Row(
        "Worker",
        "no slots",
        "Worker(store, print, concurrency=0)",
        InvalidArgument,
        "concurrency must be between 1 and 2**63-1, got 0",
        sync_only=True,
    ),
    Row(
        "Worker",
        "a ttl of zero",
        "Worker(store, print, ttl=0)",
        InvalidArgument,
        "ttl must be a finite number of seconds > 0, got 0",
        sync_only=True,
    ),
    Row(
        "Worker",
        "a timeout that is not a positive number of seconds",
        'Worker(store, print, timeout=float("nan"))',
        InvalidArgument,
        "timeout must be a finite number of seconds > 0, got nan",
        sync_only=True,
    ),
    Row(
        "Worker",
        "a text where the function goes",
        'Worker(store, "tasks:send")',
        InvalidArgumentType,
        "function must be callable, got str 'tasks:send'",
        sync_only=True,
    ),
    Row(
        "Worker",
        "an async def function",
        "Worker(store, asyncio.sleep)",
        InvalidArgumentType,
        "function is an async def function (sleep): use fencing.asyncio.AsyncWorker",
        sync_only=True,
    ),
    Row(
        "AsyncWorker",
        "a sync store",
        "fencing.asyncio.AsyncWorker(store, asyncio.sleep)",
        InvalidArgumentType,
        "store must be a fencing.asyncio.AsyncJobStore, got JobStore (a sync store: use fencing.Worker)",
        sync_only=True,
    ),
    Row(
        "Worker",
        "a negative retry delay",
        "Worker(store, print, retry_delay=-1)",
        InvalidArgument,
        "retry_delay must be a finite number of seconds >= 0, got -1",
        sync_only=True,
    ),
    # -- Heartbeat ---------------------------------------------------------------------------------
    Row(
        "Heartbeat",
        "a claim instant in the future",
        "Heartbeat(store, lease, 10, claimed_at=10**10)",
        InvalidArgument,
        "claimed_at must be time.monotonic() read before the claim, got 10000000000",
    ),
    Row(
        "Heartbeat",
        "`None` where the store goes",
        "Heartbeat(None, lease, 10)",
        InvalidArgumentType,
        "store must have renew() and release() (a fencing.JobStore), got NoneType",
        async_message="store must have renew() and release() (a fencing.asyncio.AsyncJobStore), got NoneType",
    ),
    Row(
        "Heartbeat",
        "an interval as long as the TTL",
        "Heartbeat(store, lease, 10, interval=10)",
        InvalidArgument,
        "interval must be > 0 and < ttl (10.0), got 10",
    ),
    Row(
        "Heartbeat",
        "an interval too large for a float",
        "Heartbeat(store, lease, 10, interval=10**400)",
        InvalidArgument,
        "interval must be > 0 and < ttl (10.0), got " + HUGE,
    ),
    Row(
        "Heartbeat",
        "a TTL too large for a float",
        "Heartbeat(store, lease, 10**400)",
        InvalidArgument,
        "ttl " + HUGE_RANGE + HUGE,
    ),
    Row(
        "Heartbeat",
        "a number where the clock function goes",
        "Heartbeat(store, lease, 10, clock=110.0)",
        InvalidArgumentType,
        "clock must be callable or None, got float",
    ),
    Row(
        "Heartbeat",
        "an int where a bool goes",
        "Heartbeat(store, lease, 10, release_on_exit=1)",
        InvalidArgumentType,
        "release_on_exit must be a bool, got int 1",
    ),
    Row(
        "Heartbeat.start",
        "a clock that returns NaN",
        "Heartbeat(store, lease, 10, clock=lambda: nan).start()",
        InvalidArgument,
        "clock() must be a finite number, got nan",
    ),
    Row(
        "Heartbeat.start",
        "a stale fence",
        'Heartbeat(store, Lease("job", "w", 7), 10, clock=lambda: 110.0).start()',
        LeaseLost,
        "the lease (job 'job', owner 'w', fence 7) is not held: the first renewal was refused (stale fence)",
    ),
    Row(
        "Heartbeat.check",
        "checked before start()",
        "Heartbeat(store, lease, 10).check()",
        LeaseLost,
        "the lease (job 'job', owner 'w', fence 1) is not held: no renewal has succeeded yet",
    ),
    # -- Locks and Election ------------------------------------------------------------------------
    Row(
        "Locks",
        "a URL where the engine goes",
        'Locks("sqlite:///jobs.db")',
        InvalidArgumentType,
        "engine must be a sqlalchemy Engine, got str",
        async_message="engine must be a sqlalchemy AsyncEngine, got str",
    ),
    Row("Locks", "a zero poll", "Locks(engine, poll=0)", InvalidArgument, "poll must be > 0, got 0"),
    Row(
        "Locks.create_table",
        "an int where the Connection goes",
        "locks.create_table(conn=1)",
        InvalidArgumentType,
        "conn must be a sqlalchemy Connection, an ORM Session or None, got int",
        async_message="conn must be a sqlalchemy AsyncConnection, an AsyncSession or None, got int",
    ),
    Row(
        "Locks.try_acquire",
        "an empty name",
        'locks.try_acquire("", "w", ttl=30)',
        InvalidArgument,
        "name must not be empty",
    ),
    Row(
        "Locks.try_acquire",
        "a name with NUL",
        'locks.try_acquire("a\\x00b", "w", ttl=30)',
        InvalidArgument,
        "name contains NUL (U+0000): a lock's name is the same on every database, and PostgreSQL's text "
        "cannot store it",
        note="refused on every backend, SQLite too: a lock's name means the same everywhere",
    ),
    Row(
        "Locks.try_acquire",
        "a name of 2,000 bytes",
        'locks.try_acquire("x" * 2000, "w", ttl=30)',
        InvalidArgument,
        "name is 2000 bytes in UTF-8; a lock's name holds at most 1024",
        note="the smallest key column of the three databases (MariaDB's), on every backend",
    ),
    Row(
        "Locks.try_acquire",
        "a name that is not UTF-8",
        'locks.try_acquire("\\udcff", "w", ttl=30)',
        InvalidArgument,
        "name cannot be stored as UTF-8 (lone surrogate at index 0): '\\udcff'",
    ),
    Row(
        "Locks.try_acquire",
        "bytes where the name goes",
        'locks.try_acquire(b"nightly", "w", ttl=30)',
        InvalidArgumentType,
        "name must be a str, got bytes b'nightly'",
    ),
    Row(
        "Locks.try_acquire",
        "None where the owner goes",
        'locks.try_acquire("nightly", None, ttl=30)',
        InvalidArgumentType,
        "owner must be a str, got NoneType None",
    ),
    Row(
        "Locks.try_acquire",
        "a zero ttl",
        'locks.try_acquire("nightly", "w", ttl=0)',
        InvalidArgument,
        "ttl must be > 0, got 0",
    ),
    Row(
        "Locks.acquire",
        "a negative timeout",
        'locks.acquire("nightly", "w", ttl=30, timeout=-1)',
        InvalidArgument,
        "timeout must be >= 0 or None, got -1",
    ),
    Row(
        "Locks.acquire",
        "an infinite timeout (None waits without bound)",
        'locks.acquire("nightly", "w", ttl=30, timeout=inf)',
        InvalidArgument,
        "timeout must be a finite number, got inf",
    ),
    Row(
        "Locks.acquire",
        "a number where the clock goes",
        'locks.acquire("nightly", "w", ttl=30, now=5.0)',
        InvalidArgumentType,
        "now must be a callable clock or None, got float",
    ),
    Row(
        "Locks.hold",
        "a string timeout",
        'locks.hold("nightly", "w", ttl=30, timeout="1").__enter__()',
        InvalidArgumentType,
        "timeout must be a real number (int or float), got str '1'",
    ),
    Row(
        "Locks.renew",
        "a name where the lease goes",
        'locks.renew("job", ttl=30)',
        InvalidArgumentType,
        "lease must be a fencing.Lease, got str 'job'",
    ),
    Row(
        "Locks.release",
        "a tuple where the lease goes",
        'locks.release(("job", "w", 1))',
        InvalidArgumentType,
        "lease must be a fencing.Lease, got tuple ('job', 'w', 1)",
    ),
    Row(
        "Locks.check",
        "None where the lease goes",
        "locks.check(None)",
        InvalidArgumentType,
        "lease must be a fencing.Lease, got NoneType None",
    ),
    Row(
        "Locks.fenced",
        "an int where the lease goes",
        "locks.fenced(7).__enter__()",
        InvalidArgumentType,
        "lease must be a fencing.Lease, got int 7",
    ),
    Row(
        "Locks.holder",
        "None where the name goes",
        "locks.holder(None)",
        InvalidArgumentType,
        "name must be a str, got NoneType None",
    ),
    Row("Locks.revoke", "an empty name", 'locks.revoke("")', InvalidArgument, "name must not be empty"),
    Row(
        "Locks.delete",
        "an int where the name goes",
        "locks.delete(7)",
        InvalidArgumentType,
        "name must be a str, got int 7",
    ),
    Row(
        "locks_table",
        "an int where the table name goes",
        "locks_table(MetaData(), 7)",
        InvalidArgumentType,
        "name must be a str, got int 7",
        setup="none",
    ),
    Row(
        "Election",
        "an empty name",
        'Election(Locks(create_sqlite_engine(f"{tmp}/e.db")), "", "a")',
        InvalidArgument,
        "name must not be empty",
        setup="none",
    ),
    Row(
        "Election",
        "None where the candidate goes",
        'Election(Locks(create_sqlite_engine(f"{tmp}/e.db")), "scheduler", None)',
        InvalidArgumentType,
        "candidate must be a str, got NoneType None",
        setup="none",
    ),
    Row(
        "Election",
        "a retry period longer than the ttl",
        'Election(Locks(create_sqlite_engine(f"{tmp}/e.db")), "scheduler", "a", ttl=1, retry=5)',
        InvalidArgument,
        "retry must be > 0 and < ttl (1.0), got 5",
        setup="none",
    ),
    Row(
        "Election",
        "a string where the locks go",
        'Election("locks", "scheduler", "a")',
        InvalidArgumentType,
        "locks must be a fencing.Locks, got str",
        setup="none",
    ),
    Row(
        "Election",
        "a callback that is not callable",
        'Election(Locks(create_sqlite_engine(f"{tmp}/e.db")), "scheduler", "a", on_elected=3)',
        InvalidArgumentType,
        "on_elected must be callable or None, got int",
        setup="none",
    ),
    # -- FenceMarks --------------------------------------------------------------------------------
    Row(
        "FenceMarks",
        "`None` where the engine goes",
        "FenceMarks(None)",
        InvalidArgumentType,
        "engine must be a sqlalchemy Engine, got NoneType",
        async_message="engine must be a sqlalchemy AsyncEngine, got NoneType",
    ),
    Row(
        "FenceMarks.create_tables",
        "an int where the Connection goes",
        "marks.create_tables(conn=1)",
        InvalidArgumentType,
        "conn must be a sqlalchemy Connection, an ORM Session or None, got int",
        async_message="conn must be a sqlalchemy AsyncConnection, an AsyncSession or None, got int",
    ),
    Row(
        "FenceMarks.accept",
        "a negative fence",
        'marks.accept("invoice-7", -1)',
        InvalidArgument,
        "fence must be between 0 and 2**63-1, got -1",
    ),
    Row(
        "FenceMarks.accept",
        "a fence too long to print",
        'marks.accept("invoice-7", 10**5000)',
        InvalidArgument,
        "fence must be between 0 and 2**63-1, got an int of 16610 bits",
        note="past Python's 4300-digit limit for printing an int",
    ),
    Row(
        "FenceMarks.accept",
        "a table that does not exist",
        'FenceMarks(engine, fence_marks_table(MetaData(), "no_marks")).accept("invoice-7", 1)',
        TableMissing,
        "table 'no_marks' does not exist; create it first (FenceMarks.create_tables())",
        cause=sa_exc.DBAPIError,
    ),
    Row(
        "FenceMarks.highest",
        "`None` as the resource",
        "marks.highest(None)",
        InvalidArgumentType,
        "resource must be a str, got NoneType None",
    ),
    Row(
        "FenceMarks.record_once",
        "a str as the fence",
        'marks.record_once("charge-7", fence="3")',
        InvalidArgumentType,
        "fence must be an int, got str '3'",
    ),
    # -- engines and tables ------------------------------------------------------------------------
    Row(
        "create_sqlite_engine",
        "`None` as the path",
        "create_sqlite_engine(None)",
        InvalidArgumentType,
        "path must be a str or os.PathLike, got NoneType None",
        setup="none",
    ),
    Row(
        "create_sqlite_engine",
        "an in-memory database",
        'create_sqlite_engine(":memory:")',
        InvalidArgument,
        "path must name a database file, got ':memory:'",
        setup="none",
        note="every connection would see its own empty database",
    ),
    Row(
        "create_sqlite_engine",
        "NUL inside the path",
        'create_sqlite_engine("jobs\\x00.db")',
        InvalidArgument,
        "path must not contain NUL bytes, got 'jobs\\x00.db'",
        setup="none",
    ),
    Row(
        "create_sqlite_engine",
        "NaN as the busy timeout",
        'create_sqlite_engine(f"{tmp}/jobs.db", busy_timeout=nan)',
        InvalidArgument,
        "busy_timeout must be between 0 and 2147483 seconds, got nan",
        setup="none",
    ),
    Row(
        "configure_sqlite",
        "`None` where the engine goes",
        "configure_sqlite(None)",
        InvalidArgumentType,
        "engine must be a sqlalchemy Engine or AsyncEngine, got NoneType",
        setup="none",
    ),
    Row(
        "configure_sqlite",
        "an engine configured already",
        'configure_sqlite(create_sqlite_engine(f"{tmp}/jobs.db"))',
        ConfigurationError,
        "Engine(sqlite:///{tmp}/jobs.db) is already configured by fencing.configure_sqlite()",
        setup="none",
        note="the first settings would silently win",
    ),
    Row(
        "as_text",
        "a number where a column or a str goes",
        "as_text(5)",
        InvalidArgumentType,
        "as_text takes a column, a str or None, got int",
        setup="none",
        note="it would be bound as a literal and fail, or match nothing, only when run",
    ),
    Row(
        "jobs_table",
        "`None` where the MetaData goes",
        "jobs_table(None)",
        InvalidArgumentType,
        "metadata must be a sqlalchemy MetaData, got NoneType",
        setup="none",
    ),
    Row(
        "jobs_table",
        "a name already defined in the MetaData",
        "jobs_table(fencing.jobs.metadata)",
        InvalidArgument,
        "metadata already holds a table 'jobs'; pass another name or MetaData",
        setup="none",
    ),
    Row(
        "history_table",
        "`None` where the MetaData goes",
        "history_table(None)",
        InvalidArgumentType,
        "metadata must be a sqlalchemy MetaData, got NoneType",
        setup="none",
    ),
    Row(
        "History",
        "a table name where the Table goes",
        'History("fencing_history")',
        InvalidArgumentType,
        "History table must be a sqlalchemy Table (fencing.history_table), got str",
        setup="none",
    ),
    Row(
        "History",
        "the jobs table where the history table goes",
        "History(jobs_table(MetaData()))",
        InvalidArgument,
        "table 'jobs' is not a history table (no at, event, job_id, seq): "
        "use fencing.history_table(metadata)",
        setup="none",
    ),
    Row(
        "History",
        "a bool as the retention",
        "History(history_table(MetaData()), retention=True)",
        InvalidArgument,
        "retention must be a positive number of seconds or None, got True",
        setup="none",
    ),
    Row(
        "History",
        "NaN as the retention",
        "History(history_table(MetaData()), retention=nan)",
        InvalidArgument,
        "retention must be a positive number of seconds or None, got nan",
        setup="none",
    ),
    Row(
        "holder_at",
        "one entry where the list goes",
        "holder_at(HistoryEntry(1, 'j', 'claim', 'w', 1, 9.0, 1.0), 2.0)",
        InvalidArgumentType,
        "entries must be a list of HistoryEntry (JobStore.history), got HistoryEntry",
        setup="none",
    ),
    Row(
        "holder_at",
        "NaN as the instant",
        "holder_at([], nan)",
        InvalidArgument,
        "at must be a finite number, got nan",
        setup="none",
    ),
    Row(
        "JobStore",
        "a history table where the History goes",
        "JobStore(engine, history=history_table(MetaData()))",
        InvalidArgumentType,
        "history must be a fencing.History (around a history table), got Table",
    ),
    Row(
        "JobStore.history",
        "a store that records no history",
        'store.history("job")',
        ConfigurationError,
        "this store records no history: JobStore(engine, table, history=fencing.History(...))",
    ),
    Row(
        "JobStore.prune_history",
        "a store that records no history",
        "store.prune_history()",
        ConfigurationError,
        "this store records no history: JobStore(engine, table, history=fencing.History(...))",
    ),
    Row(
        "fence_marks_table",
        "`None` as the table name",
        "fence_marks_table(MetaData(), None)",
        InvalidArgumentType,
        "name must be a str, got NoneType None",
        setup="none",
    ),
    Row(
        "idempotency_keys_table",
        "an int as the schema",
        "idempotency_keys_table(MetaData(), schema=1)",
        InvalidArgumentType,
        "schema must be a str or None, got int 1",
        setup="none",
    ),
    # -- service.py: paths and arguments -----------------------------------------------------------
    Row(
        "service.init_db",
        "`None` as the path",
        "service.init_db(None)",
        InvalidArgumentType,
        "path must be a str, os.PathLike or database URL, got NoneType None",
        setup="none",
    ),
    Row(
        "service.state",
        "an empty path",
        'service.state("", "job")',
        InvalidArgument,
        "path must name a database file, got ''",
        setup="none",
    ),
    Row(
        "service.claim",
        "a zero TTL (the contract's ValueError)",
        'service.claim(db, "free", "w", 110.0, 0)',
        InvalidArgument,
        "ttl must be > 0, got 0",
    ),
    Row(
        "service.renew",
        "a negative TTL (the contract's ValueError)",
        'service.renew(db, "job", "w", 1, 110.0, -1.0)',
        InvalidArgument,
        "ttl must be > 0, got -1.0",
    ),
    Row(
        "service.claim_many",
        "a zero TTL (the contract's ValueError)",
        'service.claim_many(db, "free", ["a", "b"], 110.0, 0.0)',
        InvalidArgument,
        "ttl must be > 0, got 0.0",
    ),
    Row(
        "service.claim",
        "NaN as the clock",
        'service.claim(db, "free", "w", nan, 10.0)',
        InvalidArgument,
        "now must be a finite number, got nan",
    ),
    Row(
        "service.claim",
        "an int too large for a float as the clock",
        'service.claim(db, "free", "w", 10**400, 10.0)',
        InvalidArgument,
        "now " + HUGE_RANGE + HUGE,
    ),
    Row(
        "service.claim",
        "a TTL below the database clock's tick (1 ms)",
        'service.claim(db, "free", "w", None, 5e-4)',
        InvalidArgument,
        "ttl " + DB_FLOOR + "0.0005",
        note="now=None is the library's extension of the contract; the caller's clock keeps its rule",
    ),
    Row(
        "service.release",
        "`None` as the owner",
        'service.release(db, "job", None, 1)',
        InvalidArgumentType,
        "owner must be a str, got NoneType None",
    ),
    Row(
        "service.claim",
        "SQL in the owner (valid data)",
        "service.claim(db, \"free\", \"' OR '1'='1\", 110.0, 10.0)",
        None,
        returns="1",
        stored=('service.state(db, "free")["owner"]', "\"' OR '1'='1\""),
        writes=("free",),
    ),
    Row(
        "service.complete",
        "a result of 1,000,000 characters (valid data)",
        'service.complete(db, "job", "w", 1, 110.0, "r" * 1_000_000)',
        None,
        returns="True",
        stored=('service.state(db, "job")["result"] == "r" * 1_000_000', "True"),
        writes=("job",),
    ),
    # -- files (SQLite) --------------------------------------------------------------------------
    Row(
        "service.init_db",
        "a path that is a directory",
        "service.init_db(path)",
        InvalidArgument,
        "path is a directory, not a database file: '{tmp}/adir'",
        setup="directory",
    ),
    Row(
        "create_sqlite_engine",
        "a path that is a directory",
        "JobStore(create_sqlite_engine(path)).create_table()",
        InvalidArgument,
        "path is a directory, not a database file: '{tmp}/adir'",
        setup="directory",
    ),
    Row(
        "service.init_db",
        "a file that is not SQLite",
        "service.init_db(path)",
        DatabaseError,
        "DatabaseError: file is not a database",
        cause=sa_exc.DatabaseError,
        setup="text_file",
        note="the file is not touched",
    ),
    Row(
        "JobStore.state",
        "a file that is not SQLite",
        'JobStore(create_sqlite_engine(path)).state("job")',
        DatabaseError,
        "DatabaseError: file is not a database",
        cause=sa_exc.DatabaseError,
        setup="text_file",
    ),
    Row(
        "service.init_db",
        "a missing parent directory",
        "service.init_db(path)",
        DatabaseError,
        "cannot create database file '{tmp}/nodir/jobs.db': its directory '{tmp}/nodir' does not exist",
        cause=sa_exc.OperationalError,
        setup="missing_parent",
    ),
    Row(
        "JobStore.create_table",
        "a missing parent directory",
        "JobStore(create_sqlite_engine(path)).create_table()",
        DatabaseError,
        "OperationalError: unable to open database file",
        cause=sa_exc.OperationalError,
        setup="missing_parent",
        note="SQLite's own words; service.init_db names the directory",
    ),
    Row(
        "service.state",
        "a database file that does not exist",
        'service.state(path, "job")',
        DatabaseMissing,
        "no database file at '{tmp}/jobs.db'; call init_db() to create it",
        setup="missing_file",
        note="only init_db creates a file",
    ),
    Row(
        "service.enqueue",
        "a read-only file (chmod 0444)",
        'service.enqueue(path, "new")',
        DatabaseReadOnly,
        READ_ONLY_FILE.format(name="{tmp}/jobs.db"),
        cause=sa_exc.OperationalError,
        setup="readonly_file",
        note="as root (whom chmod does not stop) the test runs the call as user `nobody`",
    ),
    Row(
        "service.state",
        "a read-only file (valid: reads work)",
        'service.state(path, "job")',
        None,
        returns="{'id': 'job', 'owner': None, 'until': 0.0, 'fence': 0, 'result': None, 'done': 0}",
        setup="readonly_file",
    ),
    Row(
        "JobStore.claim",
        "an engine opened read-only (`mode=ro`)",
        'JobStore(configure_sqlite(create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")))'
        '.claim("job", "w", ttl=10, now=110.0)',
        DatabaseReadOnly,
        READ_ONLY_FILE.format(name="file:{tmp}/jobs.db"),
        cause=sa_exc.OperationalError,
        setup="readonly_engine",
    ),
    Row(
        "service.state",
        "a database whose header is garbage",
        'service.state(path, "job")',
        DatabaseError,
        "DatabaseError: file is not a database",
        cause=sa_exc.DatabaseError,
        setup="corrupt_header",
    ),
    Row(
        "service.enqueue",
        "a database whose pages are garbage",
        'service.enqueue(path, "new")',
        DatabaseError,
        "DatabaseError: database disk image is malformed",
        cause=sa_exc.DatabaseError,
        setup="corrupt_pages",
    ),
    Row(
        "service.init_db",
        "a database whose pages are garbage",
        "service.init_db(path)",
        DatabaseCorrupt,
        "the SQLite database '{tmp}/jobs.db' is corrupt: PRAGMA quick_check of table 'jobs' and its "
        "indexes found: database disk image is malformed. Nothing was changed; restore the file from "
        "a backup (sqlite.org/recovery.html can salvage rows)",
        cause=sa_exc.DatabaseError,
        setup="corrupt_pages",
        note="init_db (create_table) checks the jobs table's pages once, before anything is written",
    ),
    # -- servers that are down ---------------------------------------------------------------------
    Row(
        "service.init_db",
        "a PostgreSQL server that is down",
        "service.init_db(DOWN_PG)",
        DatabaseUnavailable,
        PG_DOWN_MESSAGE,
        cause=sa_exc.OperationalError,
        setup="none",
    ),
    Row(
        "service.enqueue",
        "a MariaDB server that is down",
        'service.enqueue(DOWN_MYSQL, "new")',
        DatabaseUnavailable,
        MYSQL_DOWN_MESSAGE,
        cause=sa_exc.OperationalError,
        setup="none",
    ),
    Row(
        "FenceMarks.accept",
        "a MariaDB server that is down",
        'FenceMarks(create_engine(DOWN_MYSQL)).accept("invoice-7", 1)',
        DatabaseUnavailable,
        MYSQL_DOWN_MESSAGE,
        cause=sa_exc.OperationalError,
        setup="none",
    ),
    Row(
        "Heartbeat.start",
        "a PostgreSQL server that is down",
        "Heartbeat(JobStore(create_engine(DOWN_PG)), lease, 10).start()",
        DatabaseUnavailable,
        PG_DOWN_MESSAGE,
        cause=sa_exc.OperationalError,
        setup="none",
        note="the first renewal runs in the caller's thread; no thread is started",
    ),
    Row(
        "service.init_db",
        "a URL whose driver is not installed",
        'service.init_db("postgresql+nosuch://u@h/db")',
        InvalidArgument,
        "cannot use database URL 'postgresql+nosuch://u@h/db': Can't load plugin: "
        "sqlalchemy.dialects:postgresql.nosuch",
        cause=sa_exc.NoSuchModuleError,
        setup="none",
    ),
    Row(
        "service.init_db",
        "a postgres:// URL (the scheme libpq prints; SQLAlchemy's is postgresql)",
        'service.init_db("postgres://u:pw@h/db")',
        InvalidArgument,
        "cannot use database URL 'postgres://u:***@h/db': SQLAlchemy names this database "
        "'postgresql', not 'postgres': use 'postgresql+psycopg://u:***@h/db' (pip install "
        "'fencing[postgresql]')",
        setup="none",
        note="no engine is made; the password is never shown",
    ),
    Row(
        "service.init_db",
        "a URL whose port is not a number",
        'service.init_db("postgresql://u:pw@h:port/db")',
        InvalidArgument,
        "not a database URL: 'postgresql://u:***@h:port/db' (invalid literal for int() with base 10: 'port')",
        setup="none",
        note="SQLAlchemy's bare ValueError, named; the password is not shown",
    ),
    Row(
        "service.init_db",
        "a text SQLAlchemy cannot read as a URL",
        'service.init_db("x y://u:pw@h/db")',
        InvalidArgument,
        "not a database URL: 'x y://u:***@h/db' (not of the form "
        "dialect+driver://user:password@host:port/database)",
        setup="none",
        note="the password, as far as the text's shape shows one, is not shown; the reason in "
        "fencing's words (SQLAlchemy's own differ between its releases)",
    ),
]


# -- running a row ----------------------------------------------------------------------------------

NAMESPACE_DOC = [
    ("db", "the seeded database: the SQLite file's path, or the server's URL"),
    ("engine", "an engine on `db` (`create_sqlite_engine(db)`, or `create_engine(db)` for a server)"),
    ("store", "`JobStore(engine)`"),
    ("marks", "`FenceMarks(engine)`"),
    (
        "lease",
        '`Lease("job", "w", 1, 150.0)`: the live lease of the seeded job `job` (live at `now=110.0`)',
    ),
    ("tmp", "the row's own directory, empty unless the row's setup made a file in it"),
    ("path", "the file (or directory) the row's setup made in `tmp`"),
    ("create_engine", "`sqlalchemy.create_engine`"),
    ("nan, inf", "`math.nan`, `math.inf`"),
    ("Fraction, Decimal", "`fractions.Fraction`, `decimal.Decimal`"),
    ("DOWN_PG", f"`{DOWN_PG}` (nothing listens on port 1)"),
    ("DOWN_MYSQL", f"`{DOWN_MYSQL}`"),
]

ASYNC_DOC = (
    "Every row on the seeded database that calls the library runs twice: as shown, and through "
    "the async front (*async* in *where*), with `engine` an `AsyncEngine` on `db` (aiosqlite, "
    "asyncpg, asyncmy), `store` its `AsyncJobStore`, `marks` its `AsyncFenceMarks`, and "
    "`JobStore`, `FenceMarks`, `Heartbeat` standing for `AsyncJobStore`, `AsyncFenceMarks`, "
    "`AsyncHeartbeat`; every coroutine is awaited. The exception, its message, its cause and "
    "the unchanged database are checked the same way; where the async message differs (it "
    "names its own types), the row shows it"
)

SEED_DOC = (
    "jobs `job` (owner `w`, fence 1, until 150.0), `free` (never claimed) and `done` (fence 1, "
    'result `"kept"`); fence mark `invoice-42` = 3; idempotency key `charge-42`; and a table '
    "`other(id, x)` with one row, which is not a jobs table"
)

SETUP_DOC = {
    "directory": "`path` = `{tmp}/adir`, an empty directory",
    "text_file": "`path` = `{tmp}/notes.txt`, a text file",
    "missing_parent": "`path` = `{tmp}/nodir/jobs.db`; `{tmp}/nodir` does not exist",
    "missing_file": "`path` = `{tmp}/jobs.db`, which does not exist",
    "readonly_file": "`path` = `{tmp}/jobs.db`, a database with job `job`, chmod 0444",
    "readonly_engine": "`path` = `{tmp}/jobs.db`, a database with job `job`",
    "corrupt_header": "`path` = `{tmp}/jobs.db`, a database with its first 16 bytes overwritten",
    "corrupt_pages": "`path` = `{tmp}/jobs.db`, a database with every page after the first "
    "overwritten with 0xFF",
}


class Tracker:
    """Keeps what a row's call creates, so its connections are closed after the row."""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def wrap(self, factory: Callable[..., Any]) -> Callable[..., Any]:
        def make(*args: Any, **kwargs: Any) -> Any:
            made = factory(*args, **kwargs)
            self.made.append(made)
            return made

        return make

    def close(self) -> None:
        for made in reversed(self.made):
            if isinstance(made, Heartbeat) or isinstance(getattr(made, "target", None), AsyncHeartbeat):
                made.stop()
            elif isinstance(made, JobStore):
                made.engine.dispose()
                made.engine.dispose()
            elif isinstance(made, FenceMarks):
                made.engine.dispose()
            elif isinstance(made, Engine):
                made.dispose()
        self.made.clear()
        service._stores.clear()


def namespace(tracker: Tracker, tmp: Path, **names: Any) -> dict[str, Any]:
    """The names a row's call sees: the public API (its constructors tracked) and the setup's."""
    return {
        "fencing": fencing,
        "asyncio": asyncio,
        "service": service,
        "JobStore": tracker.wrap(JobStore),
        "FenceMarks": tracker.wrap(FenceMarks),
        "Heartbeat": tracker.wrap(Heartbeat),
        "Locks": tracker.wrap(Locks),
        "Election": Election,
        "Worker": fencing.Worker,
        "locks_table": fencing.locks_table,
        "create_sqlite_engine": tracker.wrap(fencing.create_sqlite_engine),
        "create_engine": tracker.wrap(sqlalchemy.create_engine),
        "configure_sqlite": fencing.configure_sqlite,
        "as_text": fencing.as_text,
        "jobs_table": fencing.jobs_table,
        "fence_marks_table": fencing.fence_marks_table,
        "idempotency_keys_table": fencing.idempotency_keys_table,
        "history_table": fencing.history_table,
        "attempts_table": fencing.attempts_table,
        "payloads_table": fencing.payloads_table,
        "schedules_table": fencing.schedules_table,
        "Schedule": fencing.Schedule,
        "Scheduler": fencing.Scheduler,
        "failures_table": fencing.failures_table,
        "History": fencing.History,
        "HistoryEntry": fencing.HistoryEntry,
        "holder_at": fencing.holder_at,
        "Lease": Lease,
        "MetaData": MetaData,
        "nan": math.nan,
        "inf": math.inf,
        "Fraction": Fraction,
        "Decimal": Decimal,
        "DOWN_PG": DOWN_PG,
        "DOWN_MYSQL": DOWN_MYSQL,
        "lease": Lease("job", "w", 1, 150.0),
        "tmp": str(tmp),
        **names,
    }


def async_names(tracker: Tracker, loop: asyncio.AbstractEventLoop, engine: AsyncEngine) -> dict[str, Any]:
    """The names of ASYNC_DOC: the async front on ``engine``, each coroutine awaited."""

    def store(engine: Any, *args: Any, **kwargs: Any) -> Any:
        return asyncfront.BlockingAsyncStore(AsyncJobStore(engine, *args, **kwargs), loop)

    def marks(engine: Any, *args: Any, **kwargs: Any) -> Any:
        return asyncfront.Blocking(AsyncFenceMarks(engine, *args, **kwargs), loop)

    def locks(engine: Any, *args: Any, **kwargs: Any) -> Any:
        return asyncfront.BlockingAsyncLocks(AsyncLocks(engine, *args, **kwargs), loop)

    def heartbeat(store: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(store, asyncfront.BlockingAsyncStore):
            store = store.async_store
        return asyncfront.Blocking(AsyncHeartbeat(store, *args, **kwargs), loop)

    return {
        "engine": engine,
        "store": store(engine),
        "marks": marks(engine),
        "locks": locks(engine),
        "Locks": locks,
        "JobStore": store,
        "FenceMarks": marks,
        "Heartbeat": tracker.wrap(heartbeat),
    }


@dataclass
class Outcome:
    error: BaseException | None = None
    value: Any = None


def run(call: str, names: dict[str, Any]) -> Outcome:
    """Run the row's code exactly as the table shows it."""
    try:
        code = compile(call, "<row>", "eval")
    except SyntaxError:
        code = compile(call, "<row>", "exec")  # a statement: `with store.fenced(...): pass`
    try:
        return Outcome(value=eval(code, names))
    except Exception as exc:
        return Outcome(error=exc)


def check(row: Row, outcome: Outcome, tmp: Path, front: str = "sync") -> None:
    """The outcome is exactly the row's; AssertionError otherwise."""
    message = row.async_message if front == asyncfront.ASYNC and row.async_message else row.message
    error = outcome.error
    if row.raises is None:
        assert error is None, f"raised {type(error).__name__}: {error}"
        assert repr(outcome.value) == row.returns
        return
    assert error is not None, f"returned {outcome.value!r}, expected {row.raises.__name__}"
    assert type(error) is row.raises, f"{type(error).__module__}.{type(error).__name__}: {error}"
    # one family, and the builtins the contract names stay true
    assert isinstance(error, FencingError)
    if isinstance(error, InvalidArgument):
        assert isinstance(error, ValueError)
    if isinstance(error, InvalidArgumentType):
        assert isinstance(error, TypeError)
    if isinstance(message, re.Pattern):
        assert message.fullmatch(str(error)), str(error)
    else:
        assert str(error) == (message or "").replace("{tmp}", str(tmp))
    if row.cause is None:
        assert error.__cause__ is None, repr(error.__cause__)
    else:
        assert isinstance(error.__cause__, row.cause), repr(error.__cause__)
    if isinstance(error, (DatabaseError, TableMissing)):
        # a database error arrives wrapped, never as the raw driver error
        assert isinstance(error.__cause__, sa_exc.SQLAlchemyError)


# -- snapshots: "nothing changed" -------------------------------------------------------------------


def database_snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table in the database, keyed by table."""
    meta = MetaData()
    meta.reflect(engine)
    snap = {}
    with engine.connect() as conn:
        for name, table in sorted(meta.tables.items()):
            rows = [tuple(_plain(v) for v in row) for row in conn.execute(table.select())]
            snap[name] = sorted(rows, key=repr)
    return snap


def _plain(value: Any) -> Any:
    # MariaDB keys are UTF-8 bytes; compare them as the text they hold
    return bytes(value).decode("utf-8") if isinstance(value, (bytes, bytearray, memoryview)) else value


def files_snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes (None for a directory) under ``root``.

    SQLite's ``-shm`` (a shared-memory index, no data) and an empty ``-wal`` (no data) are left
    out: a read-only connection cannot remove them when it closes.
    """
    snap: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_dir():
            snap[name] = None
        elif name.endswith("-shm") or (name.endswith("-wal") and path.stat().st_size == 0):
            continue
        else:
            snap[name] = path.read_bytes()
    return snap


def assert_only_writes(
    before: dict[str, list[tuple[Any, ...]]], after: dict[str, list[tuple[Any, ...]]], writes: tuple[str, ...]
) -> None:
    """Nothing changed, except the rows of the jobs ``writes`` names (valid data is stored)."""
    assert after.keys() == before.keys()
    for table in before:
        if table != "jobs":
            assert after[table] == before[table], table
    kept = [r for r in before["jobs"] if r[0] not in writes]
    assert [r for r in after["jobs"] if r[0] not in writes] == kept
    assert sorted(r[0] for r in after["jobs"] if r[0] in writes) == sorted(writes)


# -- setups ---------------------------------------------------------------------------------------


def seed(engine: Engine) -> None:
    """The seeded database (see SEED_DOC)."""
    store = JobStore(engine)
    try:
        store.create_table()
        for job_id in ("job", "free", "done"):
            assert store.enqueue(job_id, ready_at=0.0)  # the contract's row: claimable at once
        assert store.claim("job", "w", ttl=50.0, now=100.0) == Lease("job", "w", 1, 150.0)
        done = store.claim("done", "w", ttl=50.0, now=100.0)
        assert done is not None and store.complete(done, "kept", now=101.0)
    finally:
        store.engine.dispose()
    marks = FenceMarks(engine)
    marks.create_tables()
    assert marks.accept("invoice-42", 3)
    assert marks.record_once("charge-42", fence=3)
    other = Table(
        "other",
        MetaData(),
        Column("id", Text().with_variant(String(100), "mysql", "mariadb"), primary_key=True),
        Column("x", Integer),
    )
    other.create(engine)
    with engine.begin() as conn:
        conn.execute(other.insert().values(id="keep", x=1))


@pytest.fixture(scope="module")
def sqlite_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded SQLite file, made once and copied per row."""
    path = tmp_path_factory.mktemp("seed") / "seed.db"
    engine = fencing.create_sqlite_engine(path)
    try:
        seed(engine)
    finally:
        engine.dispose()  # the last connection closes: the WAL is checkpointed into the file
    assert not Path(f"{path}-wal").exists()
    return path


def _small_database(path: Path) -> None:
    """A valid database file holding the job ``job``, every connection closed."""
    engine = fencing.create_sqlite_engine(path)
    store = JobStore(engine)
    try:
        store.create_table()
        store.enqueue("job", ready_at=0.0)
    finally:
        store.engine.dispose()
        engine.dispose()


def make_files(setup: str, tmp: Path) -> Path:
    """The row's file (or directory) in ``tmp``."""
    if setup == "directory":
        (tmp / "adir").mkdir()
        return tmp / "adir"
    if setup == "text_file":
        (tmp / "notes.txt").write_text("these are notes, not a database\n" * 200)
        return tmp / "notes.txt"
    if setup == "missing_parent":
        return tmp / "nodir" / "jobs.db"
    path = tmp / "jobs.db"
    if setup == "missing_file":
        return path
    _small_database(path)
    data = bytearray(path.read_bytes())
    if setup == "corrupt_header":
        data[:16] = b"garbage garbage!"
    elif setup == "corrupt_pages":
        page = int.from_bytes(data[16:18], "big")
        data[page:] = b"\xff" * (len(data) - page)
    path.write_bytes(bytes(data))
    if setup == "readonly_file":
        path.chmod(0o444)
    return path


NOBODY = 65534


def chmod_binds() -> bool:
    """Whether file permissions stop this process (not for root, who has CAP_DAC_OVERRIDE)."""
    return os.geteuid() != 0


@contextlib.contextmanager
def unprivileged(tmp: Path) -> Iterator[None]:
    """Run as user ``nobody`` for a moment, so that chmod binds as it does for everyone else.

    Only the effective ids change (root keeps its real and saved ids, so it can come back).
    Every module the call needs is imported first: the interpreter's files may not be
    readable by ``nobody``.
    """
    scratch = Path(tempfile.mkdtemp())
    try:
        service.init_db(scratch / "warm.db")
        service.enqueue(scratch / "warm.db", "w")
        service.state(scratch / "warm.db", "w")
    finally:
        service._stores.clear()
        shutil.rmtree(scratch)
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@contextlib.contextmanager
def row_directory(row: Row, tmp_path: Path) -> Iterator[Path]:
    """The row's directory; as root, a read-only file lives where ``nobody`` can reach it."""
    if row.setup != "readonly_file" or chmod_binds():
        tmp = tmp_path / "row"
        tmp.mkdir()
        yield tmp
        return
    tmp = Path(tempfile.mkdtemp(prefix="fencing-hostile-"))
    try:
        os.chmod(tmp, 0o755)
        yield tmp
    finally:
        shutil.rmtree(tmp)


def _give_to_nobody(tmp: Path) -> None:
    for path in [tmp, *tmp.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)


# -- the tests ----------------------------------------------------------------------------------


def _param(index: int, row: Row, front: str = "sync") -> Any:
    marks: list[Any] = []
    if row.setup in FILE_SETUPS or row.setup == "none":
        marks.append(pytest.mark.backend("sqlite"))  # no server involved: run once
    elif row.backends:
        marks.append(pytest.mark.backend(*row.backends))
    if row.today is not None:
        marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=row.today))
    suffix = "-async" if front == asyncfront.ASYNC else ""
    return pytest.param(row, front, id=f"{index + 1}-{row.function}-{row.bad}{suffix}", marks=marks)


PARAMS = [_param(i, r) for i, r in enumerate(ROWS)]
PARAMS += [_param(i, r, asyncfront.ASYNC) for i, r in enumerate(ROWS) if r.runs_async()]


@pytest.mark.parametrize(("row", "front"), PARAMS)
def test_row(
    row: Row,
    front: str,
    backend: backends.Backend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: Any,
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a relative path that slipped through would create a file here
    tracker = Tracker()
    loop = asyncio.new_event_loop()
    with row_directory(row, tmp_path) as tmp:
        names: dict[str, Any] = {}
        engine: Engine | None = None
        if row.setup == "seeded":
            target = request.getfixturevalue("target")
            if "://" in target:
                names_engine = backends.engine_for(target)
                seed(names_engine)
                names_engine.dispose()
            else:
                shutil.copyfile(request.getfixturevalue("sqlite_seed"), target)
            engine = backends.engine_for(target)
            store = JobStore(engine)
            names = {
                "db": target,
                "engine": engine,
                "store": store,
                "marks": FenceMarks(engine),
                "locks": Locks(engine),
            }
            tracker.made.append(store)
            if front == asyncfront.ASYNC:
                async_engine = backends.async_engine_for(target)
                names.update(async_names(tracker, loop, async_engine))
        elif row.setup != "none":
            names["path"] = str(make_files(row.setup, tmp))
        before_db = None if engine is None else database_snapshot(engine)
        before_files = files_snapshot(tmp)

        as_nobody = row.setup == "readonly_file" and not chmod_binds()
        if as_nobody:
            _give_to_nobody(tmp)

        def run_row() -> tuple[Outcome, Outcome | None]:
            try:
                outcome = run(row.call, namespace(tracker, tmp, **names))
                stored = None if row.stored is None else run(row.stored[0], namespace(tracker, tmp, **names))
            finally:
                tracker.close()
            return outcome, stored

        with unprivileged(tmp) if as_nobody else contextlib.nullcontext():
            if front == asyncfront.ASYNC:  # inside the bridge on the row's loop, as a test body
                try:
                    outcome, stored = asyncfront.run_in_bridge(loop, run_row, {})
                finally:
                    asyncfront.dispose(async_engine, loop)
            else:
                outcome, stored = run_row()
        try:
            check(row, outcome, tmp, front)
            if row.stored is not None:
                assert stored is not None and stored.error is None, stored
                assert repr(stored.value) == row.stored[1]
            assert files_snapshot(tmp) == before_files
            assert os.listdir(cwd) == []
            if engine is not None:
                assert before_db is not None
                assert_only_writes(before_db, database_snapshot(engine), row.writes)
        finally:
            if engine is not None:
                engine.dispose()
            loop.close()


def test_a_clock_that_breaks_inside_a_heartbeat_block_is_named_and_never_hides_the_blocks_error(
    store: JobStore,
) -> None:
    assert store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", ttl=50.0, now=100.0)
    assert lease is not None
    readings = iter([101.0])  # the first renewal's, then nan

    def clock() -> float:
        return next(readings, math.nan)

    def block() -> None:
        with Heartbeat(store, lease, 50.0, clock=clock) as hb:
            with pytest.raises(InvalidArgument, match=r"^clock\(\) must be a finite number, got nan$"):
                _ = hb.held
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        block()
    # the lease was still within its local deadline: released on the error, as without the bad clock
    state = store.state("j")
    assert state is not None and state.owner is None and state.fence == 1


def test_every_public_function_has_a_row() -> None:
    """Every public callable that takes an argument is in the table at least once."""
    public: set[str] = set()
    for name in service.__all__:
        public.add(f"service.{name}")
    for name in fencing.__all__:
        obj = getattr(fencing, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            continue
        if callable(obj) and not isinstance(obj, Table):
            public.add(name)
    for cls in (JobStore, FenceMarks, Heartbeat, Locks):
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            takes = [p for p in inspect.signature(member).parameters if p != "self"]
            if not name.startswith("_") and takes:
                public.add(f"{cls.__name__}.{name}")
    # a value the library hands back, never one it takes
    public.discard("JobState")
    public.discard("Failure")  # JobStore.failure hands it out
    public.discard("HistoryEntry")
    public.discard("HeldLock")  # Locks.hold hands it out
    public.discard("Job")  # the worker hands it to the function
    public.discard("Refusal")  # a refused write's reason, as the log and the API give it
    covered = {row.function for row in ROWS}
    assert public - covered == set()
    # no arguments, misused; and the async worker, whose refusal of a sync store is a sync row
    assert covered - public <= {"Heartbeat.start", "Heartbeat.check", "AsyncWorker"}


def test_every_public_function_of_the_async_front_has_an_async_row() -> None:
    """The async classes are covered under their sync names (ASYNC_DOC), each row run async."""
    public: set[str] = set()
    for cls, name in (
        (AsyncJobStore, "JobStore"),
        (AsyncFenceMarks, "FenceMarks"),
        (AsyncHeartbeat, "Heartbeat"),
        (AsyncLocks, "Locks"),
    ):
        public.add(name)
        for method, member in inspect.getmembers(cls, inspect.isfunction):
            takes = [p for p in inspect.signature(member).parameters if p != "self"]
            if not method.startswith("_") and takes:
                public.add(f"{name}.{method}")
    assert public - {row.function for row in ROWS if row.runs_async()} == set()


def test_the_table_has_what_the_issue_asks() -> None:
    assert len(ROWS) >= 40
    assert len({(r.function, r.bad, r.call, r.backends) for r in ROWS}) == len(ROWS)
    setups = {r.setup for r in ROWS}
    assert set(FILE_SETUPS) <= setups
    calls = " ".join(r.call for r in ROWS)
    for needed in ("nan", "inf", "True", "None", "\\x00", "1_000_000", "DROP TABLE", "DOWN_PG", "DOWN_MYSQL"):
        assert needed in calls, needed


# -- over HTTP: the lease API and the dashboard ------------------------------------------------------

#: the lease API's tokens in the HTTP rows: each acts as one owner
HTTP_TOKENS = {"token-of-owner-w-0123456789": "w", "token-of-worker-b-0123456789": "worker-b"}
#: a cursor of the dashboard's job listing whose instant is an int of 400 digits
HUGE_CURSOR = base64.urlsafe_b64encode(json.dumps([0, int("9" * 400), "j"]).encode()).decode().rstrip("=")


@dataclass(frozen=True)
class HttpRow:
    """One bad request to the lease API or the dashboard, and what it gets: nothing read for
    another owner, nothing changed, the field or rule named."""

    face: str  # "lease API" (lease_api) or "dashboard"
    bad: str
    method: str
    path: str
    status: int
    #: text the answer carries (the problem's detail, or the page's message)
    says: str
    #: JSON for the lease API, a form for the dashboard
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    cookies: dict[str, str] = field(default_factory=dict)
    #: the lease API: the owner whose token asks
    as_owner: str = "w"
    #: the dashboard's authorize answers this name, or None (refuses everyone)
    operator: str | None = "op"
    #: the app's options beyond the ones every row has (shown as written)
    options: str = ""

    def request(self) -> str:
        path = self.path if len(self.path) <= 60 else self.path[:40] + f"... ({len(self.path)} chars)"
        shown = f"{self.method} {path}"
        if self.body is not None:
            shown += f" {self.body!r}" if self.face == "dashboard" else " " + _json(self.body)
        extra = [f"{k}: {v}" for k, v in self.headers.items()] + [
            f"cookie {k}={v[:8]}..." for k, v in self.cookies.items()
        ]
        if self.face == "lease API":
            extra.insert(0, f"the token of {self.as_owner!r}")
        return shown + (f" ({'; '.join(extra)})" if extra else "")


def _json(value: Any) -> str:
    return json.dumps(value)


_A_LEASE = {"job_id": "job", "owner": "w", "fence": 1}

HTTP_ROWS: list[HttpRow] = [
    HttpRow(
        "lease API",
        "another owner's lease (its owner and fence read from GET /jobs/ID)",
        "POST",
        "/complete",
        403,
        "'worker-b' may not complete as owner 'w': a token acts only as the owners it is granted "
        "('worker-b'); nothing was read or changed",
        body={"lease": _A_LEASE, "result": "forged"},
        as_owner="worker-b",
    ),
    HttpRow(
        "lease API",
        "a renewal of another owner's lease",
        "POST",
        "/renew",
        403,
        "'worker-b' may not renew as owner 'w'",
        body={"lease": _A_LEASE, "ttl": 60},
        as_owner="worker-b",
    ),
    HttpRow(
        "lease API",
        "a release of another owner's lease",
        "POST",
        "/release",
        403,
        "'worker-b' may not release as owner 'w'",
        body={"lease": _A_LEASE},
        as_owner="worker-b",
    ),
    HttpRow(
        "lease API",
        "a claim in another owner's name",
        "POST",
        "/claim",
        403,
        "'worker-b' may not claim as owner 'w'",
        body={"owner": "w", "ttl": 60},
        as_owner="worker-b",
    ),
    HttpRow(
        "lease API",
        "a ttl of 1e308",
        "POST",
        "/claim",
        422,
        "ttl must be at most 86400 s here",
        body={"owner": "w", "ttl": 1e308},
    ),
    HttpRow(
        "lease API",
        "a renewal past max_ttl",
        "POST",
        "/renew",
        422,
        "ttl must be at most 86400 s here",
        body={"lease": _A_LEASE, "ttl": 86401},
    ),
    HttpRow(
        "lease API",
        "a claim of 100,000 jobs",
        "POST",
        "/claim",
        422,
        "limit must be at most 1000 here (the API's max_limit), got 100000",
        body={"owner": "w", "ttl": 30, "limit": 100000},
    ),
    HttpRow(
        "lease API",
        "max_attempts above the API's own",
        "POST",
        "/claim",
        422,
        "max_attempts must be at most 5 here",
        body={"owner": "w", "ttl": 30, "max_attempts": 6},
        options="max_attempts=5",
    ),
    HttpRow(
        "lease API",
        "a release of a lease that never was (fence 0)",
        "POST",
        "/release",
        409,
        "the release of job 'free' with fence 0 was refused: stale fence",
        body={"lease": {"job_id": "free", "owner": "w", "fence": 0}},
    ),
    HttpRow(
        "dashboard",
        "a page read that authorize refuses",
        "GET",
        "/job?id=job",
        403,
        "not authorized to read",
        operator=None,
    ),
    HttpRow(
        "dashboard",
        "the event stream, which authorize refuses",
        "GET",
        "/events",
        403,
        "not authorized to read",
        operator=None,
    ),
    HttpRow(
        "dashboard",
        "a Host it does not serve (DNS rebinding)",
        "GET",
        "/",
        400,
        "Invalid host header",
        headers={"Host": "attacker.example"},
        options='allowed_hosts=["dash.test"]',
    ),
    HttpRow(
        "dashboard",
        "an action posted from Origin: null",
        "POST",
        "/act",
        403,
        "another origin (null)",
        body={"action": "revoke", "id": "job", "csrf": "A" * 43},
        headers={"Origin": "null"},
        cookies={"fencing_csrf": "A" * 43},
    ),
    HttpRow(
        "dashboard",
        "a CSRF cookie and token the attacker chose",
        "POST",
        "/act",
        403,
        "CSRF token does not match",
        body={"action": "revoke", "id": "job", "csrf": "A" * 43},
        headers={"Origin": "http://testserver"},
        cookies={"fencing_csrf": "A" * 43},
    ),
    HttpRow(
        "dashboard",
        "a page cursor whose instant is an int of 400 digits",
        "GET",
        "/jobs?after=" + HUGE_CURSOR,
        422,
        "not a cursor of this listing",
    ),
]


def _http_app(row: HttpRow, engine: Engine) -> Any:
    from fencing.web import bearer_tokens, dashboard, lease_api

    options = eval(f"dict({row.options})")  # the options exactly as the table shows them
    if row.face == "lease API":
        store = JobStore(engine)
        return lease_api(store, authorize=bearer_tokens(HTTP_TOKENS), **options)
    name = row.operator
    return dashboard(engine, authorize=lambda request: name, **options)


@pytest.mark.parametrize("row", HTTP_ROWS, ids=[f"H{n}" for n in range(1, len(HTTP_ROWS) + 1)])
def test_http_row(row: HttpRow, backend: backends.Backend, request: Any) -> None:
    pytest.importorskip("starlette", reason="the web extra is not installed: pip install 'fencing[web]'")
    from starlette.testclient import TestClient

    target = request.getfixturevalue("target")
    if "://" in target:
        seeding = backends.engine_for(target)
        seed(seeding)
        seeding.dispose()
    else:
        shutil.copyfile(request.getfixturevalue("sqlite_seed"), target)
    engine = backends.engine_for(target)
    try:
        before = database_snapshot(engine)
        headers = dict(row.headers)
        if row.face == "lease API":
            token = next(t for t, owner in HTTP_TOKENS.items() if owner == row.as_owner)
            headers["Authorization"] = f"Bearer {token}"
        with TestClient(_http_app(row, engine), raise_server_exceptions=False) as client:
            for name, value in row.cookies.items():
                client.cookies.set(name, value)
            if row.method == "GET":
                answer = client.get(row.path, headers=headers)
            elif row.face == "lease API":
                answer = client.post(row.path, json=row.body, headers=headers)
            else:
                answer = client.post(row.path, data=row.body, headers=headers, follow_redirects=False)
        assert answer.status_code == row.status, (answer.status_code, answer.text[:300])
        assert row.says in answer.text, answer.text[:500]
        assert database_snapshot(engine) == before
    finally:
        engine.dispose()


# -- the document -----------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if "`" not in text else f"`` {_cell(text)} ``"


def _outcome(row: Row) -> str:
    if row.raises is None:
        text = f"returns `{row.returns}`"
        if row.stored is not None:
            text += f"; then `{row.stored[0]}` is `{_cell(row.stored[1])}`"
        return text
    text = f"`{row.raises.__name__}`"
    if isinstance(row.message, re.Pattern):
        text += f": regex {_code(row.message.pattern)}"
    else:
        text += f": {_code(row.message or '')}"
    if row.cause is not None:
        text += f"; `__cause__` is a `{row.cause.__module__}.{row.cause.__name__}`"
    return text


def render() -> str:
    lines = [
        "# Hostile inputs",
        "",
        "What every public function of `fencing` and `service.py` does with bad input: the exact",
        "exception and message you get. Every row is a test in `tests/docs/test_hostile_inputs.py`, which",
        "also checks that nothing changed: every row of every table of the database (or, for the file",
        "rows, every byte of every file in the row's directory) is the same before and after, and no",
        "file appears in the working directory. Rows marked *valid data* show inputs that look",
        "dangerous but are just data: they are stored verbatim and nothing else changes.",
        "",
        "All errors belong to one family, `fencing.FencingError`. Bad arguments raise",
        "`InvalidArgument` (also a `ValueError`, as the contract's `ttl <= 0` asks) or",
        "`InvalidArgumentType` (also a `TypeError`) before any database work. A database error",
        "arrives as `DatabaseError` (or `TableMissing`) with SQLAlchemy's error as `__cause__`, never",
        "as the raw driver error.",
        "",
        "This file is generated from the rows; do not edit it by hand:",
        "",
        "```bash",
        "python -m tests.docs.test_hostile_inputs > docs/HOSTILE-INPUTS.md",
        "```",
        "",
        "## The names in the calls",
        "",
        f"The seeded database (rows that run on *all* backends, or on one): {SEED_DOC}.",
        "",
    ]
    lines += [f"* `{name}`: {text}" for name, text in NAMESPACE_DOC]
    lines += ["", f"{ASYNC_DOC}."]
    lines += ["", "File rows (SQLite only) prepare `path` in the row's directory:", ""]
    lines += [f"* *{setup.replace('_', ' ')}*: {text}" for setup, text in SETUP_DOC.items()]
    lines += [
        "",
        "*Where*: the backends the row runs on (*all*: SQLite, PostgreSQL and MariaDB; *no",
        "database*: the call is refused or fails before any database is reached; these rows run in",
        "the SQLite pass). A message given as a regex has a part in a driver's own words.",
        "",
        "## The table",
        "",
        "| # | function | bad input | call | where | what you get |",
        "| ---: | --- | --- | --- | --- | --- |",
    ]
    for number, row in enumerate(ROWS, 1):
        outcome = _outcome(row)
        if row.today is not None:
            outcome += f" (**pending**; today: {_cell(row.today)})"
        if row.note:
            outcome += f" ({_cell(row.note)})"
        if row.async_message:
            outcome += f"; async: {_code(row.async_message)}"
        where = row.where() + ("; async" if row.runs_async() else "")
        cells = [str(number), f"`{row.function}`", _cell(row.bad), _code(row.call), where, outcome]
        lines.append(f"| {' | '.join(cells)} |")
    lines += [
        "",
        "## Over HTTP",
        "",
        "What the lease API (`fencing.web.lease_api`) and the dashboard (`fencing.web.dashboard`)",
        "answer to a bad or hostile request, on the seeded database of every backend. Every row is",
        "a test in `tests/docs/test_hostile_inputs.py` (`test_http_row`), which also checks that every",
        "row of every table is the same after it. The lease API's app is",
        "`lease_api(JobStore(engine), authorize=bearer_tokens(...))` with one token per owner",
        f"({', '.join(repr(o) for o in HTTP_TOKENS.values())}); the dashboard's is",
        "`dashboard(engine, authorize=...)` whose `authorize` answers `'op'` (or refuses everyone,",
        "where the row says so); *options* are the app's arguments beyond those.",
        "",
        "| # | face | bad request | request | options | what you get |",
        "| ---: | --- | --- | --- | --- | --- |",
    ]
    for number, http in enumerate(HTTP_ROWS, 1):
        bad = http.bad + (
            "; authorize refuses everyone" if http.face == "dashboard" and http.operator is None else ""
        )
        got = f"`{http.status}`, saying {_code(http.says)}"
        options = _code(http.options) if http.options else ""
        cells = [f"H{number}", http.face, _cell(bad), _code(http.request()), options, got]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def test_the_document_is_the_table() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/HOSTILE-INPUTS.md is out of date: "
        "python -m tests.docs.test_hostile_inputs > docs/HOSTILE-INPUTS.md"
    )


if __name__ == "__main__":
    sys.stdout.write(render())
