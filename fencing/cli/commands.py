"""The ``fencing`` command (also ``python -m fencing``): a thin layer over the library.

The commands are a table, :data:`COMMANDS`: one :class:`Command` each, its arguments
declared as data (:class:`Arg`, :class:`OneOf`) and its handler, a function from a
:class:`Call` to an exit code. :func:`build_parser` makes every subcommand from the table in
one loop, and one dispatch runs them. The database commands only parse, call the library
(:class:`fencing.JobStore` for changes, :class:`fencing.overview.Overview` for reads) and
print: aligned tables for people, ``--json`` (one object per line) for scripts. Exit codes:
0 done; 1 a failure (bad URL, server down, table missing) or, for ``revoke``, ``release``,
``delete`` and ``requeue``, nothing changed; 2 bad arguments (argparse's own); 3 a change
whose outcome is unknown (the connection was lost while it was committing: read the job
before doing it again). Errors go to stderr,
never as a traceback. The torture harness (:mod:`fencing.torture`) loads only when the
``torture`` command runs, not to build the parser or print its help.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata as package_metadata
from types import MappingProxyType
from typing import Any, TextIO, TypeAlias

import sqlalchemy
from sqlalchemy import Connection, Engine, MetaData, Table, make_url
from sqlalchemy.exc import ArgumentError

from .. import _engines as cache
from .._admin import locked_change, transaction
from .._errors import (
    DatabaseBusy,
    DatabaseMissing,
    FencingError,
    InvalidArgument,
    OutcomeUnknown,
    TableMissing,
)
from .._format import duration, instant, when
from .._runtime.sqlite import create_engine as create_sqlite_engine
from .._sql.attempts import attempts_table
from .._sql.checks import FENCE_MAX, check_lock_name
from .._sql.dberrors import DB_ERRORS, database_errors, wrap_database_error
from .._sql.schema import jobs, jobs_table
from .._sql.values import Lease
from .._store.history import History, HistoryEntry, history_table
from .._store.jobstore import JobStore
from .._store.locks import Locks, locks_table
from .._store.marks import fence_marks_table, idempotency_keys_table
from ..overview import STATES, JobView, Overview, Summary
from ..torture.config import FAULT_KINDS, FINISH_MODES, FRONTS, SERVER_CRASH, TortureConfig
from . import demo, doctor

__all__ = ["build_parser", "main"]

Run = Callable[[argparse.Namespace], int]

#: the exit code of a change whose outcome is unknown: the connection was lost while it was
#: committing (:class:`fencing.OutcomeUnknown`), so it may or may not have been made
EXIT_UNKNOWN = 3

#: how a missing locks table comes to be (``fencing init`` makes a jobs table)
LOCKS_TABLE_WAY_OUT = "the application's fencing.Locks(engine).create_table() creates it"
#: where ``--url`` comes from when it is not given
URL_VARIABLE = "FENCING_URL"
#: ids enqueued per transaction: one commit (one fsync on SQLite) each, and a write lock
#: held for milliseconds, so workers on the same database are not kept waiting
ENQUEUE_CHUNK = 500


# -- the table's types -----------------------------------------------------------------------


@dataclass(frozen=True)
class Arg:
    """One ``add_argument`` call as data: its flags (or a positional's name) and keywords."""

    flags: tuple[str, ...]
    kwargs: Mapping[str, Any]

    def add_to(self, parser: argparse._ActionsContainer) -> None:
        parser.add_argument(*self.flags, **self.kwargs)


def arg(*flags: str, **kwargs: Any) -> Arg:
    """``arg("--limit", type=int)`` for ``Arg(("--limit",), {"type": int})``."""
    return Arg(flags, MappingProxyType(kwargs))


@dataclass(frozen=True)
class OneOf:
    """Arguments that exclude one another: a mutually exclusive group."""

    arguments: tuple[Arg, ...]

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_mutually_exclusive_group()
        for argument in self.arguments:
            argument.add_to(group)


def one_of(*arguments: Arg) -> OneOf:
    return OneOf(arguments)


@dataclass(frozen=True)
class Call:
    """One run of a command: what its handler gets."""

    args: argparse.Namespace
    #: the command's own parser: its ``prog`` ("fencing jobs") names the command in messages
    parser: argparse.ArgumentParser
    out: _Output
    database: _Database | None = None

    @property
    def db(self) -> _Database:
        """The database of a command that ``needs_database``."""
        if self.database is None:
            raise TypeError(f"{self.parser.prog} runs without a database")
        return self.database

    def fail(self, message: str) -> int:
        """The message on stderr, after the command's name; exit code 1."""
        return _fail(self.parser, message)


Handler: TypeAlias = "Callable[[Call], int]"
#: why the parsed arguments do not go together (exit code 2, before any database work), or None
Check: TypeAlias = "Callable[[argparse.Namespace], str | None]"


def _no_check(args: argparse.Namespace) -> str | None:
    return None


@dataclass(frozen=True)
class Command:
    """One subcommand: its name and help, its arguments, and its handler. A command that
    ``needs_database`` also takes ``--url``, ``--table`` and ``--json``; its handler gets the
    opened database (:attr:`Call.db`), and the library's errors become one line on stderr
    and exit code 1."""

    name: str
    help: str
    description: str
    run: Handler
    arguments: tuple[Arg | OneOf, ...] = ()
    needs_database: bool = True
    #: a SQLite file is created if it is missing (else: an error)
    creates: bool = False
    check: Check = _no_check
    #: the default of ``--table``: the jobs table, or the named locks' table
    table: str = "jobs"


# -- argument types --------------------------------------------------------------------------


def _at_least(minimum: float) -> Callable[[str], float]:
    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g} seconds, got {text!r}")
        return value

    return seconds


def _whole(minimum: int, maximum: int) -> Callable[[str], int]:
    def number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be between {minimum} and {maximum}, got {value}")
        return value

    return number


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


# -- the database commands: what every one of them shares ----------------------------------


def _database_options(table: str = "jobs") -> argparse.ArgumentParser:
    """``--url``, ``--table`` (default ``table``) and ``--json``: the parent of every
    database command."""
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("database")
    default = os.environ.get(URL_VARIABLE)
    where.add_argument(
        "--url",
        default=default,
        required=default is None,
        metavar="URL_OR_PATH",
        help=f"a SQLite file path or a database URL (default: ${URL_VARIABLE})",
    )
    what = "the named locks' table" if table != "jobs" else "the jobs table"
    where.add_argument("--table", default=table, metavar="NAME", help=f"{what} (%(default)s)")
    common.add_argument("--json", action="store_true", help="one JSON object per line, for scripts")
    return common


def _max_attempts(what: str) -> Arg:
    return arg(
        "--max-attempts",
        type=_whole(1, FENCE_MAX),
        metavar="N",
        help=f"{what}: jobs claimed N times or more are poisoned, as claim_next(max_attempts=N) "
        "skips them (the fence counts claims)",
    )


def _limit(what: str) -> Arg:
    return arg(
        "--limit", type=_whole(1, 1_000_000), default=50, help=f"at most this many {what} (%(default)s)"
    )


#: a job's id, the positional argument of the commands about one job
_JOB_ID = arg("id", metavar="ID", help="the job's id")


#: how long a change waits for the job's row (a worker's open fenced block holds it)
_WAIT = arg(
    "--wait",
    type=_at_least(0.001),
    default=10.0,
    metavar="SECONDS",
    help="wait at most this long for the job's row, which a worker's fenced block may hold (%(default)g)",
)


def _history_table(use: str) -> Arg:
    """``--history-table``: the ownership history's table, used (``use``) when it exists."""
    return arg(
        "--history-table",
        default="fencing_history",
        metavar="NAME",
        help=f"the ownership history table {use}",
    )


def _attempts_table(use: str) -> Arg:
    """``--attempts-table``: the table of the workers' requeued jobs' attempts bases."""
    return arg(
        "--attempts-table",
        default="fencing_attempts",
        metavar="NAME",
        help=f"the attempts table (fencing.attempts_table) {use}",
    )


#: ``--attempts-table`` of the commands that tell poisoned jobs (with ``--max-attempts``)
_COUNTED_FROM_REQUEUE = _attempts_table(
    "(%(default)s): when it exists, poisoned jobs count from their requeue"
)


@dataclass
class _Database:
    """What a database command works on: the library's objects for one table."""

    engine: Engine
    table: Table
    store: JobStore
    overview: Overview

    @contextlib.contextmanager
    def transaction(self, *, wait: float | None = None) -> Iterator[Connection]:
        """One transaction of the command's own, for the store's operations (``conn=``) and
        locked reads that must go together; on SQLite it takes the write lock first.
        ``wait``: the longest a lock is waited for, in seconds, on the servers too (SQLite's
        is the engine's busy timeout); past it the transaction fails with DatabaseBusy."""
        with transaction(self.store, wait=wait) as conn:
            yield conn


def _engine(url: str, *, create: bool, wait: float | None = None) -> Engine:
    """The engine for ``--url``: a SQLite file (a path or a ``sqlite:`` URL; it must exist
    unless ``create``) through :func:`fencing.create_sqlite_engine` (``wait``: its busy
    timeout), any other URL through ``sqlalchemy.create_engine``. Messages never show the
    URL's password."""
    if "://" in url:
        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError) as exc:  # e.g. a port that is not a number
            raise InvalidArgument(f"not a database URL ({exc})") from None
        if parsed.get_backend_name() != "sqlite":
            try:
                # pre-ping: a --watch outlives a server restart
                return sqlalchemy.create_engine(parsed, pool_pre_ping=True)
            except (ArgumentError, ImportError) as exc:
                shown = parsed.render_as_string(hide_password=True)
                raise InvalidArgument(f"cannot use database URL {shown!r}: {exc}") from None
    path = cache.normalize_target(url)[1]
    if not create and not os.path.exists(path):
        raise DatabaseMissing(f"no database file at {path!r} (`fencing init` creates one)")
    return create_sqlite_engine(path) if wait is None else create_sqlite_engine(path, busy_timeout=wait)


def _existing_attempts(engine: Engine, table: Table, args: argparse.Namespace) -> Table | None:
    """The workers' attempts table (``--attempts-table``) when ``--max-attempts`` is given
    and the table exists: poisoned jobs then count from their last requeue, as the workers'
    ``claim_next`` counts them. Not looked for otherwise (one read fewer)."""
    name = getattr(args, "attempts_table", None)
    if name is None or getattr(args, "max_attempts", None) is None:
        return None
    return _attempts_beside(engine, table, name)


def _attempts_beside(engine: Engine, table: Table, name: str) -> Table | None:
    """The attempts table ``name`` beside ``table`` (:func:`fencing.attempts_table`), or
    ``None`` if there is no such table."""
    with database_errors(name):
        if not sqlalchemy.inspect(engine).has_table(name, schema=table.schema):
            return None
    return attempts_table(MetaData(), name, schema=table.schema)


def _open(args: argparse.Namespace, *, create: bool) -> _Database:
    """The library's objects for ``--url`` and ``--table``, on a connection that works."""
    # the contract's own table for the default name (on SQLite its exact DDL, as init_db makes it)
    table = jobs if args.table == "jobs" else jobs_table(MetaData(), args.table)
    meta = MetaData()
    marks = fence_marks_table(meta, getattr(args, "marks_table", "fence_marks"))
    keys = idempotency_keys_table(meta, getattr(args, "keys_table", "idempotency_keys"))
    engine = _engine(args.url, create=create, wait=getattr(args, "wait", None))
    try:
        try:
            with engine.connect():  # a bad host, password or option is said here, once
                pass
        except TypeError as exc:  # a driver refusing an option of the URL's query string
            shown = engine.url.render_as_string(hide_password=True)
            raise InvalidArgument(f"cannot use database URL {shown!r}: {exc}") from None
        except DB_ERRORS as exc:
            raise wrap_database_error(exc, table.name) from exc
        attempts = _existing_attempts(engine, table, args)
        overview = Overview(engine, table, marks=marks, keys=keys, attempts=attempts)
        return _Database(engine, table, JobStore(engine, table), overview)
    except BaseException:
        engine.dispose()
        raise


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    print(f"{parser.prog}: {message}", file=sys.stderr)
    return 1


# -- output: aligned tables for people, JSON lines for scripts ------------------------------


class _Output:
    def __init__(self, stream: TextIO, *, as_json: bool) -> None:
        self.stream = stream
        self.json = as_json

    def record(self, **fields: Any) -> None:
        """One JSON object on its own line (ASCII: exact under any locale)."""
        print(json.dumps(fields), file=self.stream)

    def lines(self, lines: Sequence[str]) -> None:
        for line in lines:
            print(line, file=self.stream)

    def result(self, fields: Mapping[str, Any], lines: Sequence[str]) -> None:
        """A command's one result: ``fields`` as a record with ``--json``, else ``lines``."""
        if self.json:
            self.record(**fields)
        else:
            self.lines(lines)


def _shown(value: str | None) -> str:
    """A value in a table cell: ``-`` for none, control characters escaped (a newline in an
    id must not break the table); quotes and non-ASCII text as they are."""
    if value is None:
        return "-"
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in value)


def _width(text: str) -> int:
    """Terminal columns: East Asian wide characters take two, combining marks none."""
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        for ch in text
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> list[str]:
    """Columns two spaces apart, each as wide as its widest cell; ``numeric`` ones right-aligned."""
    widths = [max(_width(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = []
    for row in (headers, *rows):
        cells = []
        for i, (cell, width) in enumerate(zip(row, widths, strict=True)):
            pad = " " * (width - _width(cell))
            cells.append(pad + cell if i in numeric else cell + pad)
        lines.append("  ".join(cells).rstrip())
    return lines


def _cell(value: object) -> str:
    """A stored value in a table: text as :func:`_shown`, a float as a point in time."""
    if value is None or isinstance(value, str):
        return _shown(value)
    if isinstance(value, float):
        return instant(value)
    return str(value)


def _job_record(job: JobView) -> dict[str, Any]:
    """The job's JSON, its id named ``id`` as in every record of the CLI."""
    record = job.as_json()
    return {"id": record.pop("job_id"), **record}


def _where(db: _Database) -> str:
    url = db.engine.url
    if url.get_backend_name() == "sqlite":
        return url.database or ""
    return url.render_as_string(hide_password=True)


# -- the handlers: init, enqueue -------------------------------------------------------------


def _init(call: Call) -> int:
    db = call.db
    existed = db.overview.has_table(db.table)
    db.store.create_table()
    if existed:
        line = f"table {db.table.name!r} already exists in {_where(db)} and matches: unchanged"
    else:
        line = f"created table {db.table.name!r} in {_where(db)}"
    call.out.result({"table": db.table.name, "created": not existed}, [line])
    return 0


def _stdin_ids() -> list[str]:
    """One id per line, its line ending removed; empty lines are skipped. UTF-8."""
    if sys.stdin.isatty():
        print("reading job ids from stdin, one per line; end with Ctrl-D", file=sys.stderr)
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:
        text = sys.stdin.read()
    else:
        data = raw.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise InvalidArgument(f"stdin is not UTF-8 text (line {line}): job ids are text") from None
    return [line.removesuffix("\r") for line in text.split("\n") if line.removesuffix("\r")]


def _enqueue(call: Call) -> int:
    args, db, out = call.args, call.db, call.out
    ids = _stdin_ids() if args.ids in ([], ["-"]) else list(args.ids)
    ready_at = args.ready_at
    if args.delay is not None:
        ready_at = db.overview.now() + args.delay
    answers: list[bool] = []
    try:
        for start in range(0, len(ids), ENQUEUE_CHUNK):
            chunk = ids[start : start + ENQUEUE_CHUNK]
            with db.transaction() as conn:
                done = [db.store.enqueue(job_id, ready_at=ready_at, conn=conn) for job_id in chunk]
            answers += done  # committed
    except FencingError as exc:
        new = sum(answers)
        raise type(exc)(
            f"{exc} (before it: {new} new, {len(answers) - new} existing; the rest not enqueued)"
        ) from exc
    if out.json:
        for job_id, new in zip(ids, answers, strict=True):
            out.record(id=job_id, new=new)
        return 0
    new = sum(answers)
    kept = f"; {len(ids) - new} already existed, unchanged" if new < len(ids) else ""
    out.lines([f"enqueued {new} new job{'' if new == 1 else 's'}{kept}"])
    return 0


# -- reading: jobs, show, stats, marks -------------------------------------------------------


def _jobs(call: Call) -> int:
    args, db, out = call.args, call.db, call.out
    found = db.overview.jobs(args.state, limit=args.limit + 1, max_attempts=args.max_attempts)
    shown = found[: args.limit]
    if out.json:
        for job in shown:
            out.record(**_job_record(job))
        return 0
    if not shown:
        out.lines([f"no {args.state + ' ' if args.state else ''}jobs in table {db.table.name!r}"])
        return 0
    rows = [[_shown(j.job_id), j.state, _shown(j.owner), str(j.fence), when(j)] for j in shown]
    out.lines(_table(["ID", "STATE", "OWNER", "FENCE", "WHEN"], rows, numeric=[3]))
    if len(found) > args.limit:
        print(f"(more not shown: --limit {args.limit})", file=sys.stderr)
    return 0


def _poisoned_needs_max_attempts(args: argparse.Namespace) -> str | None:
    if args.state == "poisoned" and args.max_attempts is None:
        return "--state poisoned needs --max-attempts N (the workers' max_attempts)"
    return None


def _show(call: Call) -> int:
    args, db, out = call.args, call.db, call.out
    job = db.overview.job(args.id, max_attempts=args.max_attempts)
    if job is None:
        return call.fail(f"no job {args.id!r} in table {db.table.name!r}")
    history = _history_of(db, args.history_table, job.job_id)
    if out.json:
        recorded = None if history is None else [asdict(e) for e in history]
        out.record(**_job_record(job), history=recorded)
        return 0
    until = "-" if job.until == 0 else f"{instant(job.until)} ({when(job)})"
    rows = [
        ["id", _shown(job.job_id)],
        ["state", job.state],
        ["owner", _shown(job.owner)],
        ["fence", str(job.fence)],
        ["until", until],
        ["result", _shown(job.result)],
        ["now", f"{instant(job.now)} (the database's clock)"],
    ]
    out.lines(_table(["", ""], rows)[1:])
    if history:
        out.lines(["", f"history ({args.history_table}, oldest first)", *_history_lines(history)])
    return 0


def _history_in(db: _Database, name: str) -> History | None:
    """The ownership history in table ``name`` beside the command's table, or ``None`` if
    there is no such table. It never prunes: retention is the application's."""
    with database_errors(name):
        if not sqlalchemy.inspect(db.engine).has_table(name, schema=db.table.schema):
            return None
    return History(history_table(MetaData(), name, schema=db.table.schema), retention=None)


def _attempts_in(db: _Database, name: str) -> Table | None:
    """The attempts table ``name`` beside the command's table, or ``None``."""
    return _attempts_beside(db.engine, db.table, name)


def _recording(db: _Database, name: str) -> JobStore | None:
    """A store on the command's table that records the ownership history in table ``name``,
    or ``None`` if there is no such table."""
    history = _history_in(db, name)
    return None if history is None else JobStore(db.engine, db.table, history=history)


def _history_of(db: _Database, name: str, job_id: str) -> list[HistoryEntry] | None:
    """The job's ownership history from table ``name``, or ``None`` if there is no such table."""
    store = _recording(db, name)
    return None if store is None else store.history(job_id)


def _history_lines(entries: Sequence[HistoryEntry]) -> list[str]:
    rows = []
    for e in entries:
        if e.event == "refused":
            detail = f"{e.path}: {e.reason}; holder {_shown(e.holder)}, fence {_cell(e.current_fence)}"
        elif e.until is not None and e.event in ("claim", "renew"):
            detail = f"until {instant(e.until)}"
        else:
            detail = "" if e.path is None else f"by {e.path}"
        rows.append([str(e.seq), instant(e.at), e.event, _shown(e.owner), _cell(e.fence), detail])
    return _table(["SEQ", "AT", "EVENT", "OWNER", "FENCE", "DETAIL"], rows, numeric=(0, 4))


def _stats_lines(s: Summary) -> list[str]:
    rows = [
        ["ready", str(s.ready), "claimable now"],
        ["held", str(s.held), "live leases"],
        ["deferred", str(s.deferred), "not claimable yet"],
        ["done", str(s.done), ""],
        ["deleted", str(s.deleted), "tombstones, kept for their fence"],
    ]
    if s.max_attempts is not None or s.poisoned:
        limit = "the last fence" if s.max_attempts is None else f"{s.max_attempts} claims"
        rows.append(["poisoned", str(s.poisoned), f"at {limit} or more, not held"])
    age = s.oldest_ready_age
    rows += [
        ["oldest ready", "-" if age is None else duration(age), "longest wait of a ready job"],
        ["expiring", str(s.expiring), f"leases ending within {s.within:g}s"],
        ["highest fence", "-" if s.highest_fence is None else str(s.highest_fence), ""],
    ]
    return _table(["", "", ""], rows, numeric=[1])[1:]


def _stats_record(s: Summary) -> dict[str, Any]:
    # null, not 0, for poisoned jobs no --max-attempts counted (as the table leaves the row out)
    return {**s.as_json(), "poisoned": s.poisoned if s.max_attempts is not None or s.poisoned else None}


def _stats(call: Call) -> int:
    args, db, out = call.args, call.db, call.out

    def summary() -> Summary:
        return db.overview.summary(within=args.within, max_attempts=args.max_attempts)

    if args.watch is None:
        s = summary()
        out.result(_stats_record(s), _stats_lines(s))
        return 0
    in_place = not out.json and out.stream.isatty()
    title = f"table {db.table.name!r} in {_where(db)}, every {args.watch:g}s (Ctrl-C to stop)"
    if in_place:
        out.stream.write("\x1b[2J")  # clear the screen once; each refresh overwrites
    shown = 0
    try:
        while True:
            s = summary()
            if out.json:
                out.record(**_stats_record(s))
            elif in_place:
                frame = [f"{instant(s.now)}  {title}", "", *_stats_lines(s)]
                # home, each line cleared to its end, then everything below it
                out.stream.write("\x1b[H" + "".join(f"{line}\x1b[K\n" for line in frame) + "\x1b[J")
            else:
                out.lines([f"{instant(s.now)}  {title}", *_stats_lines(s), ""])
            out.stream.flush()
            shown += 1
            if args.count is not None and shown >= args.count:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _count_needs_watch(args: argparse.Namespace) -> str | None:
    return "--count goes with --watch" if args.count and not args.watch else None


def _marks(call: Call) -> int:
    args, out, o = call.args, call.out, call.db.overview
    kinds = (("fence marks", o.marks, o.fence_marks), ("idempotency keys", o.keys, o.idempotency_keys))
    found = {
        table.name: [asdict(row) for row in read(limit=args.limit + 1)] if o.has_table(table) else None
        for _, table, read in kinds
    }
    if all(rows is None for rows in found.values()):
        return call.fail(
            f"neither {o.marks.name!r} nor {o.keys.name!r} exists here: nothing uses FenceMarks "
            "on this database yet (FenceMarks.create_tables() makes them)",
        )
    lines: list[str] = []
    for what, table, _ in kinds:
        rows = found[table.name]
        if rows is None:
            if out.json:
                print(f"{call.parser.prog}: no table {table.name!r}", file=sys.stderr)
            lines += ["", f"{what}: no table {table.name!r}"]
            continue
        if len(rows) > args.limit:
            print(f"(more in {table.name} than shown: --limit {args.limit})", file=sys.stderr)
        rows = rows[: args.limit]
        for row in rows if out.json else ():
            out.record(table=table.name, **row)
        lines += ["", f"{what} ({table.name}):{'' if rows else ' none'}"]
        if rows:
            headers = [name.split("_")[0].upper() for name in rows[0]]  # RECORDED for recorded_at
            cells = [[_cell(value) for value in row.values()] for row in rows]
            lines += _table(headers, cells, numeric=[headers.index("FENCE")])
    if not out.json:
        out.lines(lines[1:])
    return 0


# -- changing one job: revoke, release, delete -----------------------------------------------

#: a change to one job, made in the command's transaction with the job's row locked: whether
#: the store changed it
Change: TypeAlias = "Callable[[argparse.Namespace, JobStore, Connection, JobView], bool]"
#: what a change says it did: its JSON fields and its line for people
Told: TypeAlias = "Callable[[argparse.Namespace, JobView], tuple[dict[str, Any], str]]"


def _one_job(
    name: str,
    *,
    help: str,
    description: str,
    held_only: bool,
    change: Change,
    told: Told,
    arguments: tuple[Arg, ...] = (),
) -> Command:
    """``revoke``, ``release``, ``delete``, ``requeue``: the job is read with its row locked,
    judged and changed by the store in one transaction, so what is judged is what is changed
    (:func:`fencing._admin.locked_change`). Exit code 1 when nothing changed (no such
    job, or with ``held_only`` a job nobody holds), :data:`EXIT_UNKNOWN` when the connection
    was lost while the change was committing."""
    did = f"{name}d"  # revoked, released, deleted, requeued

    def run(call: Call) -> int:
        args, db, out = call.args, call.db, call.out
        # the change is recorded in the ownership history, in its transaction, when there is one
        store = _recording(db, args.history_table) or db.store
        if name == "requeue":
            attempts = _attempts_in(db, args.attempts_table)
            if attempts is None:
                return call.fail(
                    f"no attempts table {args.attempts_table!r}: requeue needs the one the workers' "
                    "store keeps (JobStore(..., attempts=fencing.attempts_table(metadata)), or "
                    "--attempts-table NAME); nothing changed"
                )
            store = JobStore(db.engine, db.table, history=store.history_config, attempts=attempts)

        def judged(conn: Connection, job: JobView) -> bool:
            return (not held_only or job.state == "held") and change(args, store, conn, job)

        try:
            changed = locked_change(name, store, db.overview, args.id, judged, wait=args.wait)
        except DatabaseBusy as exc:
            raise DatabaseBusy(
                f"job {args.id!r} stayed locked by another transaction for more than {args.wait:g} s "
                "(--wait): a worker's fenced block or check(conn=) holds its row until it commits, "
                "or another writer does; nothing changed"
            ) from exc
        except OutcomeUnknown as exc:
            if out.json:  # null: neither done nor not done
                out.record(id=args.id, **{did: None})
            command = call.parser.prog.rsplit(" ", 1)[0]
            shown = shlex.quote(args.id) if args.id.isprintable() else "ID"  # one line on stderr
            raise OutcomeUnknown(
                f"{exc}; `{command} show {shown}` (with the same --url and --table) shows it"
            ) from exc
        job = changed.before
        if job is None or not changed.changed:
            why = "no such job" if job is None else f"it is {job.state}, not held"
            if job is not None and not held_only:
                why = f"it is {job.state}"
            if out.json:
                out.record(id=args.id, **{did: False}, state=None if job is None else job.state)
            return call.fail(f"job {args.id!r}: {why}; nothing changed")
        fields, line = told(args, job)
        out.result({"id": job.job_id, did: True, **fields}, [line])
        return 0

    recorded = _history_table("(%(default)s): the change is recorded in it when it exists")
    return Command(name, help, description, run, (_JOB_ID, *arguments, _WAIT, recorded))


def _revoked(args: argparse.Namespace, job: JobView) -> tuple[dict[str, Any], str]:
    fence, new = job.fence, job.fence + 1
    return {"owner": job.owner, "fence": fence, "new_fence": new}, (
        f"revoked job {job.job_id!r}: the lease of {job.owner!r} (fence {fence}, {when(job)}) "
        f"ended; the fence is now {new}, so fence {fence} is stale"
    )


def _release(args: argparse.Namespace, store: JobStore, conn: Connection, job: JobView) -> bool:
    if job.owner is None:
        return False
    return store.release(Lease(job.job_id, job.owner, job.fence), delay=args.delay, conn=conn)


def _released(args: argparse.Namespace, job: JobView) -> tuple[dict[str, Any], str]:
    again = "now" if args.delay is None else f"in {duration(args.delay)}"
    return {"owner": job.owner, "fence": job.fence, "delay": args.delay}, (
        f"released job {job.job_id!r} from {job.owner!r} (fence {job.fence} kept, {when(job)}); "
        f"claimable again {again}"
    )


def _requeued(args: argparse.Namespace, job: JobView) -> tuple[dict[str, Any], str]:
    return {"state": job.state, "fence": job.fence, "base": job.fence}, (
        f"requeued job {job.job_id!r} (it was {job.state}; fence {job.fence} kept): its attempts "
        f"count again from fence {job.fence}, and it is ready"
    )


def _deleted(args: argparse.Namespace, job: JobView) -> tuple[dict[str, Any], str]:
    holder = f" by {job.owner!r}" if job.state == "held" else ""
    return {"state": job.state, "owner": job.owner, "fence": job.fence}, (
        f"deleted job {job.job_id!r} (it was {job.state}{holder}; fence {job.fence} kept)"
    )


# -- the web face ------------------------------------------------------------------------------


def _serve(call: Call) -> int:
    try:
        from . import serve
    except ImportError as exc:
        return call.fail(
            f"the web extra is not installed ({exc.name} is missing): pip install 'fencing[web]'"
        )
    args, db = call.args, call.db
    history = _history_in(db, args.history_table)
    with database_errors(args.locks_table):
        has_locks = sqlalchemy.inspect(db.engine).has_table(args.locks_table, schema=db.table.schema)
    locks = locks_table(MetaData(), args.locks_table, schema=db.table.schema) if has_locks else None
    tokens = serve.read_tokens(args.api_tokens) if args.api_tokens else None
    hosts = serve.allowed_hosts(args.host, args.allowed_host or ())
    app = serve.app_for(
        db.engine,
        db.table,
        history=None if history is None else history.table,
        locks=locks,
        attempts=_attempts_in(db, args.attempts_table),
        interval=args.interval,
        max_attempts=args.max_attempts,
        tokens=tokens,
        hosts=hosts,
        max_ttl=args.api_max_ttl,
        max_limit=args.api_max_limit,
    )
    api = f" and the lease API at http://{args.host}:{args.port}/api" if tokens else ""
    print(
        f"fencing: the dashboard of table {db.table.name!r} at http://{args.host}:{args.port}/{api}, "
        f"answering the host names {', '.join(hosts)} (--allowed-host adds one)",
        file=sys.stderr,
    )
    if not serve.is_loopback(args.host):
        print(
            f"fencing: the dashboard's pages are open to whoever reaches {args.host}:{args.port}: "
            "every job's id, owner and result (mount fencing.web.dashboard with authorize to close them)",
            file=sys.stderr,
        )
    serve.run(app, host=args.host, port=args.port)
    return 0


# -- without a database: demo, torture -------------------------------------------------------


def _demo(call: Call) -> int:
    return demo.run_demo(call.args.ttl)


class _ProgressLine:
    """A long run's progress on a terminal: one line, rewritten in place (``\\r``), cut to the
    terminal's width so it never wraps, and cleared at the end. A ``torture.Progress``."""

    def __init__(self, stream: TextIO, prog: str, jobs: int) -> None:
        self.stream = stream
        self.prog = prog
        self.jobs = jobs
        self.shown = False

    def __call__(self, phase: str, elapsed: float, total: float | None, done: int | None) -> None:
        if phase == "setup":
            text = f"setting up: enqueuing {self.jobs} jobs"
        elif phase == "starting":
            text = "starting the workers"
        elif phase == "stopping":
            text = "stopping the workers"
        elif phase == "verdict":
            text = "checking the journals and the database"
        else:
            text = phase if total is None else f"{phase} {elapsed:.1f}/{total:g}s"
            if done is not None:
                text += f", {done}/{self.jobs} jobs done"
        self._write(f"{self.prog}: {text}")

    def clear(self) -> None:
        if self.shown:
            self._write("")
            self.shown = False

    def _write(self, text: str) -> None:
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns or 80  # 0: size unknown
        except (OSError, ValueError):
            width = 80
        with contextlib.suppress(OSError, ValueError):  # a closed terminal: the run goes on
            self.stream.write("\r" + text[: max(width - 1, 0)] + "\x1b[K")
            self.stream.flush()
            self.shown = bool(text)


@contextlib.contextmanager
def _cleared(progress: _ProgressLine | None) -> Iterator[None]:
    """The progress line gone before anything else is printed, however the run ends."""
    try:
        yield
    finally:
        if progress is not None:
            progress.clear()


def _torture(call: Call) -> int:
    from .. import torture

    args = call.args
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    faults = tuple(kind for kind in args.faults.split(",") if kind)
    progress = _ProgressLine(sys.stderr, call.parser.prog, args.jobs) if sys.stderr.isatty() else None
    with tempfile.TemporaryDirectory(prefix="fencing-torture-db-") as scratch, _cleared(progress):
        try:
            config = torture.TortureConfig(
                url=args.url or os.path.join(scratch, "torture.db"),
                workers=args.workers,
                jobs=args.jobs,
                seconds=args.seconds,
                seed=seed,
                ttl=args.ttl,
                work=args.work,
                finish=args.finish,
                batch=args.batch,
                fault_every=args.fault_every,
                check_heartbeat=args.check_heartbeat,
                release_rate=args.release_rate,
                drain=args.drain,
                prefix=args.prefix,
                front=args.front,
                store_factory=args.store,
                journal_dir=args.journal,
                keep_tables=args.keep_tables,
                faults=faults,
                operations=args.operations,
            )
            outcome = torture.run_torture(config, progress=progress)
        except (FencingError, ValueError, TypeError) as exc:
            if progress is not None:
                progress.clear()
            print(f"fencing torture: {exc}", file=sys.stderr)
            return 2
    print(torture.summary(outcome))
    return 1 if outcome.violations else 0


def _doctor(call: Call) -> int:
    url = call.args.url or os.environ.get(URL_VARIABLE)
    if url is None:
        call.parser.error(f"--url is required (or ${URL_VARIABLE})")
    opened = functools.partial(_engine, create=False)
    return doctor.run(
        url, opened, prog=call.parser.prog, as_json=call.args.json, out=sys.stdout, err=sys.stderr
    )


#: the harness's defaults: its config module is all the parser reads (the harness itself,
#: workers, controller and verdict, loads only when the command runs)
_TORTURE = TortureConfig(url="-")


# -- named locks and elections (fencing.Locks: the locks table has the jobs table's columns) -----


def _lock_record(job: JobView) -> dict[str, Any]:
    held = job.state == "held"
    return {
        "name": job.job_id,
        "state": "held" if held else "free",
        "holder": job.owner if held else None,
        "token": job.fence,
        "until": job.until if held else None,
        "until_in": job.until_in if held else None,
        "now": job.now,
    }


def _locks(call: Call) -> int:
    args, db, out = call.args, call.db, call.out
    if args.name is not None:
        return _one_lock(call, args.name, args.revoke, "lock")
    if args.revoke:
        return call.fail("--revoke needs the NAME of the lock")
    found = db.overview.jobs(None, limit=args.limit + 1)
    shown = [job for job in found[: args.limit] if job.state != "done"]
    if out.json:
        for job in shown:
            out.record(**_lock_record(job))
        return 0
    if not shown:
        out.lines([f"no locks in table {db.table.name!r}"])
        return 0
    rows = []
    for job in shown:
        lock = _lock_record(job)
        left = when(job) if lock["state"] == "held" else "-"
        rows.append([_shown(job.job_id), lock["state"], _shown(lock["holder"]), str(job.fence), left])
    out.lines(_table(["NAME", "STATE", "HOLDER", "TOKEN", "LEFT"], rows, numeric=[3]))
    if len(found) > args.limit:
        print(f"(more not shown: --limit {args.limit})", file=sys.stderr)
    return 0


def _leader(call: Call) -> int:
    return _one_lock(call, call.args.name, call.args.revoke, "leader")


def _one_lock(call: Call, name: str, revoke: bool, kind: str) -> int:
    """One lock (``kind`` "lock") or election ("leader"): who holds it, with which token
    (term), until when; with ``revoke``, taken from its holder (the token moves on)."""
    db, out, args = call.db, call.out, call.args
    name = check_lock_name(name)
    # a revoke is recorded in the ownership history, in its transaction, when there is one
    history = _history_in(db, args.history_table)
    locks = Locks(db.store.engine, db.store.table, history=history)
    if revoke:
        holder = locks.holder(name)
        if not locks.revoke(name):
            return call.fail(f"no lock {name!r} in table {db.table.name!r}; nothing changed")
        after = db.overview.job(name)
        token = None if after is None else after.fence
        who = "nobody held it" if holder is None else f"{holder.owner!r} held it with token {holder.fence}"
        out.result(
            {
                "name": name,
                "revoked": True,
                "holder": None if holder is None else holder.owner,
                "token": token,
            },
            [f"revoked {name!r} ({who}); its token is now {token}: writes under an older one are refused"],
        )
        return 0
    job = db.overview.job(name)
    if job is None or job.state == "done":
        return call.fail(f"no lock {name!r} in table {db.table.name!r}")
    lock = _lock_record(job)
    entries = None if history is None else locks.store.history(name)
    if out.json:
        out.record(**lock, history=None if entries is None else [asdict(e) for e in entries])
        return 0
    word = "term" if kind == "leader" else "token"
    if lock["state"] == "held":
        who = "leader" if kind == "leader" else "holder"
        until = f"{instant(job.until)} ({when(job)})"
        rows = [["name", _shown(name)], [who, _shown(job.owner)], [word, str(job.fence)], ["until", until]]
    else:
        free = "nobody leads" if kind == "leader" else "free"
        rows = [["name", _shown(name)], ["state", free], [f"last {word}", str(job.fence)]]
    rows.append(["now", f"{instant(job.now)} (the database's clock)"])
    out.lines(_table(["", ""], rows)[1:])
    if entries:
        out.lines(["", f"history ({args.history_table}, oldest first)", *_history_lines(entries)])
    return 0


# -- the table -------------------------------------------------------------------------------

#: every command, in the order ``fencing --help`` lists them
COMMANDS: tuple[Command, ...] = (
    Command(
        "init",
        help="create the jobs table (idempotent; an existing table is checked, never changed)",
        description="Create the jobs table if it is missing (JobStore.create_table()); an existing "
        "one is checked against the schema and left as it is. A SQLite file is created if needed.",
        run=_init,
        creates=True,
    ),
    Command(
        "enqueue",
        help="register jobs by id (an existing id is left exactly as it is)",
        description="Register each id as a ready job (JobStore.enqueue); an id that exists is "
        "left unchanged, a lease in progress included. With no ids, or the one id '-', the ids "
        "are read from stdin, one per line (empty lines skipped). They are enqueued "
        f"{ENQUEUE_CHUNK} per transaction: after an error, the ids before it stay enqueued.",
        arguments=(
            arg("ids", nargs="*", metavar="ID", help="job ids (none or '-': from stdin)"),
            one_of(
                arg(
                    "--delay",
                    type=_at_least(0.0),
                    metavar="SECONDS",
                    help="not claimable before the database's now + SECONDS",
                ),
                arg(
                    "--ready-at",
                    type=_finite,
                    metavar="EPOCH",
                    help="not claimable before this time (seconds since 1970)",
                ),
            ),
        ),
        run=_enqueue,
    ),
    Command(
        "jobs",
        help="list jobs, longest waiting first",
        description="List jobs by until, then id (the ready index's order, so a listing costs the "
        "same at any backlog): ready jobs longest waiting first, held ones soonest expiring "
        "first. Without --state, jobs not done come first, then done ones. Times are on the "
        "database's clock. Poisoned jobs run again only when the workers' max_attempts is "
        "raised: a fence is never lowered.",
        arguments=(
            arg("--state", choices=STATES, help="only jobs in this state"),
            _limit("jobs"),
            _max_attempts("needed with --state poisoned"),
            _COUNTED_FROM_REQUEUE,
        ),
        run=_jobs,
        check=_poisoned_needs_max_attempts,
    ),
    Command(
        "show",
        help="one job: its row, its state, its lease's time left",
        description="Show one job's row, its state and its lease's time left on the database's clock.",
        arguments=(
            _JOB_ID,
            _max_attempts("to tell poisoned jobs from ready ones"),
            _COUNTED_FROM_REQUEUE,
            _history_table("(%(default)s), shown when it exists"),
        ),
        run=_show,
    ),
    Command(
        "stats",
        help="counts by state, the longest wait, leases about to end, the highest fence",
        description="Summarise the table at one instant of the database's clock (one pass over "
        "it). With --watch, again every SECONDS until Ctrl-C (or --count refreshes): in place on "
        "a terminal, one summary after another otherwise.",
        arguments=(
            arg(
                "--within",
                type=_at_least(0.0),
                default=60.0,
                metavar="SECONDS",
                help="count held leases that end within this many seconds (%(default)g)",
            ),
            _max_attempts("count poisoned jobs"),
            _COUNTED_FROM_REQUEUE,
            arg(
                "--watch",
                nargs="?",
                const=2.0,
                type=_at_least(0.1),
                metavar="SECONDS",
                help="refresh every SECONDS (2 if not given)",
            ),
            arg("--count", type=_whole(1, 10**9), metavar="N", help="with --watch: stop after N"),
        ),
        run=_stats,
        check=_count_needs_watch,
    ),
    _one_job(
        "revoke",
        help="take a held job's lease away: the fence moves on, so the holder's token is stale",
        description="End a held job's lease at once (JobStore.revoke): its fence goes up by one, so "
        "every later write with the holder's token is refused (FenceMarks.accept too); the job is "
        "claimable again. Exit code 1, nothing changed, if the job is not held.",
        held_only=True,
        change=lambda args, store, conn, job: store.revoke(job.job_id, conn=conn),
        told=_revoked,
    ),
    _one_job(
        "release",
        help="end a held job's lease without moving the fence (as the worker's own release)",
        description="End a held job's lease as its worker's JobStore.release would: no owner, "
        "claimable again (after --delay), the fence kept. The holder's writes to the jobs table "
        "are refused from now on (it is no longer the owner), but its fence stays the highest "
        "until the next claim, so a FenceMarks.accept with it still passes until then: to cut a "
        "stalled worker off everywhere, use revoke. Exit code 1, nothing changed, if the job is "
        "not held.",
        held_only=True,
        change=_release,
        told=_released,
        arguments=(
            arg(
                "--delay",
                type=_at_least(0.001),
                metavar="SECONDS",
                help="not claimable again before the database's now + SECONDS",
            ),
        ),
    ),
    _one_job(
        "delete",
        help="delete a job; its fence is kept, so the id enqueued again never reissues a token",
        description="Delete a job in any state (JobStore.delete). Its row stays as a tombstone "
        "that keeps the fence: enqueued again, the id continues above every fence it had. A "
        "holder's later writes to the jobs table are refused. Exit code 1 if there is no such job.",
        held_only=False,
        change=lambda args, store, conn, job: store.delete(job.job_id, conn=conn),
        told=_deleted,
    ),
    _one_job(
        "requeue",
        help="give a poisoned job its attempts back (its fence kept): claim_next may take it again",
        description="Requeue a job nobody holds (JobStore.requeue): claim_next(max_attempts=N) "
        "may take it N more times, counted from its fence now, which is kept (every token handed "
        "out stays stale); a deferred job is ready at once. Needs the attempts table the workers' "
        "store keeps (fencing.attempts_table). Exit code 1, nothing changed, if the job is held, "
        "done or missing.",
        held_only=False,
        change=lambda args, store, conn, job: store.requeue(job.job_id, conn=conn),
        told=_requeued,
        arguments=(_attempts_table("(%(default)s) the workers' store keeps the bases in"),),
    ),
    Command(
        "locks",
        help="named locks: who holds each, with which token, until when; revoke one",
        description="List the named locks (fencing.Locks) of the locks table: held or free, the "
        "holder, the token (it only goes up) and the time left on the database's clock. With "
        "NAME, that lock alone; with --revoke, take it from its holder: the token moves on, so "
        "every write under the holder's token is refused from now on, and the lock is free. "
        "With NAME and an ownership history table (--history-table), the lock's history "
        "follows: who took it with which token, releases, revokes, refused writes. "
        "Exit code 1, nothing changed, if there is no such lock.",
        arguments=(
            arg("name", nargs="?", metavar="NAME", help="one lock (default: list them)"),
            arg("--revoke", action="store_true", help="take NAME from its holder"),
            _limit("locks"),
            _history_table("(%(default)s): with NAME, shown when it exists; a revoke is recorded in it"),
        ),
        run=_locks,
        table="fencing_locks",
    ),
    Command(
        "leader",
        help="who leads an election: the leader, its term, its lease's time left; depose it",
        description="Show who leads the election NAME (fencing.Election): the leader, its term "
        "(the lock's token: every write under an older term is refused) and its lease's time "
        "left on the database's clock. With --revoke, depose it at once: its term is refused "
        "from now on, and the next candidate to try is elected with a higher one. With an "
        "ownership history table (--history-table), the election's history follows: each "
        "term, who held it, how it ended, and the writes refused under an old one.",
        arguments=(
            arg("name", metavar="NAME", help="the election's name"),
            arg("--revoke", action="store_true", help="depose the leader"),
            _history_table("(%(default)s), shown when it exists; a revoke is recorded in it"),
        ),
        run=_leader,
        table="fencing_locks",
    ),
    Command(
        "marks",
        help="list FenceMarks' fence marks and idempotency keys",
        description="List the highest fence accepted per resource and the recorded idempotency "
        "keys (fencing.FenceMarks), by resource and key. A missing table is said, not an error, "
        "unless both are missing (exit 1).",
        arguments=(
            arg("--marks-table", default="fence_marks", metavar="NAME", help="(%(default)s)"),
            arg("--keys-table", default="idempotency_keys", metavar="NAME", help="(%(default)s)"),
            _limit("of each"),
        ),
        run=_marks,
    ),
    Command(
        "demo",
        help="play the late-worker story on a real SQLite file with real worker processes",
        description=(
            "Worker A claims a job and stalls past its lease; worker B claims the job and "
            "completes it; A wakes up and tries to write its stale result. The store rejects "
            "A's write. Exit code 0 if the story went exactly so, 1 otherwise."
        ),
        arguments=(
            arg(
                "--ttl",
                type=_at_least(demo.MIN_TTL),
                default=demo.DEFAULT_TTL,
                metavar="SECONDS",
                help=f"lease duration in real seconds (default {demo.DEFAULT_TTL:g}, "
                f"at least {demo.MIN_TTL:g})",
            ),
        ),
        run=_demo,
        needs_database=False,
    ),
    Command(
        "serve",
        help="serve the dashboard (read-only) and, with --api-tokens, the lease API over HTTP",
        description="Run the web dashboard of the jobs table on uvicorn (the web extra: pip install "
        "'fencing[web]'): counts by state, rates, leases counting down, each job's ownership "
        "history, fence marks, locks, live. Its actions (revoke, release, delete, enqueue) need "
        "an application's authorize callable: mount fencing.web.dashboard in your own app for "
        "them. The pages are open to whoever reaches the server; only the Host names it binds "
        "(and --allowed-host) are answered. With --api-tokens FILE (one 'TOKEN OWNER [OWNER ...]' "
        "per line) the lease API is served at /api for workers in any language, each "
        "authenticated by its bearer token and acting only as the owners on its line.",
        arguments=(
            arg("--host", default="127.0.0.1", help="the address to listen on (%(default)s)"),
            arg("--port", type=_whole(1, 65535), default=8000, help="the port (%(default)s)"),
            arg(
                "--interval",
                type=_at_least(0.05),
                default=1.0,
                metavar="SECONDS",
                help="seconds between the live feed's reads of the table (%(default)g)",
            ),
            arg(
                "--allowed-host",
                action="append",
                metavar="NAME",
                help="a Host name to answer besides localhost, 127.0.0.1, [::1] and --host (repeatable; "
                "'*.example.com' for a domain's)",
            ),
            arg(
                "--api-tokens",
                metavar="FILE",
                help="serve the lease API at /api for these bearer tokens ('TOKEN OWNER [OWNER ...]' "
                "per line: the owners each may act as)",
            ),
            arg(
                "--api-max-ttl",
                type=_at_least(0.001),
                # fencing.web.api.MAX_TTL (not imported: the web extra may be missing)
                default=86400.0,
                metavar="SECONDS",
                help="the longest lease the API hands out or renews (%(default)g)",
            ),
            arg(
                "--api-max-limit",
                type=_whole(1, 1_000_000),
                # fencing.web.api.MAX_LIMIT
                default=1000,
                metavar="N",
                help="the most jobs one claim of the API takes (%(default)s)",
            ),
            _max_attempts("what the workers pass to claim_next, and what the API's claims apply"),
            _history_table("shown (timelines, refusals) when it exists"),
            _attempts_table("(%(default)s): when it exists, poisoned jobs count from their requeue"),
            arg(
                "--locks-table",
                default="fencing_locks",
                metavar="NAME",
                help="the named locks' table (%(default)s)",
            ),
        ),
        run=_serve,
    ),
    Command(
        "doctor",
        help="name the database's settings under which a fence may not survive a crash (exit 1 on a risk)",
        description="Read the settings that decide whether a commit the database acknowledged "
        "survives a crash, power loss or failover (fsync, full_page_writes, synchronous_commit "
        "and asynchronous standbys on PostgreSQL; innodb_flush_log_at_trx_commit, sync_binlog, "
        "innodb_doublewrite on MariaDB/MySQL; journal_mode, synchronous, fullfsync on SQLite), "
        "as a session of this command gets them, and say per setting what it risks and what "
        "to set. Exit code 0 if every one is safe, 1 if any is a risk, 2 if they could not be read.",
        arguments=(
            arg(
                "--url",
                metavar="URL_OR_PATH",
                help=f"a SQLite file path or a database URL (default: ${URL_VARIABLE})",
            ),
            arg("--json", action="store_true", help="one JSON object per setting, for scripts"),
        ),
        run=_doctor,
        needs_database=False,
    ),
    Command(
        "torture",
        help="run real workers under injected faults and check every guarantee (exit 1 on a violation)",
        description=(
            "Enqueue jobs and run worker processes built only from the public API (claim_next, "
            "a heartbeat, a fenced write, a write guarded by FenceMarks, complete) while a "
            "controller freezes them past their lease (SIGSTOP), kills them (SIGKILL, also inside "
            "transactions) and restarts them, and revokes leases. Every call is journaled; at the "
            "end the journals and the database are checked against the rules. Exit code 0 with no "
            "violation, 1 with any. The harness uses only tables named PREFIX..., dropped first. "
            "On a terminal, one line on stderr shows the phase, its seconds and the jobs done."
        ),
        arguments=(
            arg(
                "--url",
                help="database URL or SQLite file path (default: a new SQLite file in a temporary directory)",
            ),
            arg(
                "--workers",
                type=_whole(1, 256),
                default=_TORTURE.workers,
                help="worker processes (%(default)s)",
            ),
            arg(
                "--jobs", type=_whole(1, 10_000_000), default=_TORTURE.jobs, help="jobs to run (%(default)s)"
            ),
            arg(
                "--seconds",
                type=_at_least(0.0),
                default=_TORTURE.seconds,
                help="longest fault phase; it ends sooner when every job is done (%(default)s)",
            ),
            arg("--seed", type=_whole(0, 2**63 - 1), help="the faults' seed (default: random, printed)"),
            arg(
                "--ttl", type=_at_least(0.05), default=_TORTURE.ttl, help="lease TTL in seconds (%(default)s)"
            ),
            arg(
                "--work",
                type=_at_least(0.0),
                default=_TORTURE.work,
                help="most simulated work per job, seconds (%(default)s)",
            ),
            arg(
                "--finish",
                choices=FINISH_MODES,
                default=_TORTURE.finish,
                help="how jobs are completed: fenced block, complete(), complete_many(), or a mix "
                "(%(default)s)",
            ),
            arg(
                "--batch",
                type=_whole(1, 1000),
                default=_TORTURE.batch,
                help="largest claim_next batch (%(default)s)",
            ),
            arg(
                "--fault-every",
                type=_at_least(0.01),
                default=_TORTURE.fault_every,
                help="mean seconds between two faults (%(default)s)",
            ),
            arg(
                "--faults",
                default=",".join(_TORTURE.faults),
                help=f"fault kinds to inject, comma-separated, from {','.join(FAULT_KINDS)} (all but "
                f"{SERVER_CRASH}: it needs a server the harness may kill, run_torture(config, server=...))",
            ),
            arg(
                "--check-heartbeat",
                type=_probability,
                default=_TORTURE.check_heartbeat,
                help="how often a worker asks its heartbeat first; else the store alone refuses "
                "(%(default)s)",
            ),
            arg(
                "--release-rate",
                type=_probability,
                default=_TORTURE.release_rate,
                help="how often a worker gives a job back with a delay (%(default)s)",
            ),
            arg(
                "--drain",
                type=_at_least(1.0),
                default=_TORTURE.drain,
                help="seconds to finish every job after the faults (%(default)s)",
            ),
            arg("--prefix", default=_TORTURE.prefix, help="the harness's table name prefix (%(default)s)"),
            arg(
                "--async",
                dest="front",
                action="store_const",
                const="async",
                default=_TORTURE.front,
                help="run the workers on the async front: AsyncJobStore, AsyncFenceMarks and "
                "AsyncHeartbeat on the asyncio driver (aiosqlite, asyncpg, asyncmy) for the same database",
            ),
            arg(
                "--mixed",
                dest="front",
                action="store_const",
                const="mixed",
                help="even-numbered workers on the sync front, odd-numbered on the async one",
            ),
            arg(
                "--operations",
                type=_whole(1, 10_000_000),
                help="also end the fault phase once the workers have made this many operations "
                "(claims, renewals, completions, releases, guarded writes); the jobs are then the "
                "backlog kept open, topped up as they are done (default: no target)",
            ),
            arg(
                "--store",
                metavar="MODULE:CALLABLE",
                help="the store on trial, built from (engine, table, history=History) (default "
                f"{FRONTS['sync']}; with --async, from (AsyncEngine, table, history=History), "
                f"default {FRONTS['async']})",
            ),
            arg("--journal", metavar="DIR", help="keep the journals here (default: a temporary directory)"),
            arg("--keep-tables", action="store_true", help="leave the harness's tables behind"),
        ),
        run=_torture,
        needs_database=False,
    ),
)


# -- the command -----------------------------------------------------------------------------


def _invoke(command: Command, parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run ``command`` (``parser`` is its own): refuse arguments that do not go together
    (exit code 2, before any database work); for a database command, open the database, run
    the handler, turn the library's errors into a line on stderr and exit code 1, and close
    the engine."""
    problem = command.check(args)
    if problem is not None:
        parser.error(problem)
    if not command.needs_database:
        return command.run(Call(args, parser, _Output(sys.stdout, as_json=False)))
    out = _Output(sys.stdout, as_json=args.json)
    try:
        db = _open(args, create=command.creates)
        try:
            return command.run(Call(args, parser, out, db))
        finally:
            db.engine.dispose()
    except TableMissing:
        # `fencing init` makes a jobs table; a locks table is made by the application's Locks
        way_out = "`fencing init` creates it" if command.table == "jobs" else LOCKS_TABLE_WAY_OUT
        return _fail(parser, f"table {args.table!r} does not exist here; {way_out}")
    except OutcomeUnknown as exc:
        _fail(parser, str(exc))
        return EXIT_UNKNOWN
    except FencingError as exc:
        return _fail(parser, str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _version() -> str:
    try:
        return package_metadata.version("fencing")
    except package_metadata.PackageNotFoundError:  # run from a source tree
        from .. import __version__

        return __version__


def build_parser(prog: str = "fencing") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Leases with fencing tokens: a late worker can never overwrite a newer result.",
        epilog=f"Every database command takes --url (a SQLite file path or a database URL; default "
        f"${URL_VARIABLE}), --table (jobs) and --json. Exit codes: 0 done, 1 failed or nothing "
        "changed, 2 bad arguments, 3 a change whose outcome is unknown (the connection was lost while it "
        "was committing: read the job before doing it again).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    # one parent per default table (a parent's actions are shared by its children: a default
    # set on one child's would be every child's)
    databases = {table: _database_options(table) for table in {c.table for c in COMMANDS}}
    for command in COMMANDS:
        sub = subparsers.add_parser(
            command.name,
            parents=[databases[command.table]] if command.needs_database else [],
            help=command.help,
            description=command.description,
        )
        for argument in command.arguments:
            argument.add_to(sub)
        sub.set_defaults(run=functools.partial(_invoke, command, sub))
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "fencing") -> int:
    """The command: the ``fencing`` console script, and ``python -m fencing`` (``prog``
    names it in help and messages)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    run: Run | None = getattr(args, "run", None)  # _invoke, bound to the command and its parser
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    return run(args)
