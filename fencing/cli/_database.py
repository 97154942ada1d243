"""What every database command shares: ``--url``, ``--table`` and ``--json``, the database
they name (:class:`Database`), and :func:`add_command`, which runs a command's handler on it.

The handler only parses, calls the library (:class:`fencing.JobStore` for changes,
:class:`fencing.overview.Overview` for reads) and prints. The library's errors, and a
handler's :class:`Failed`, become one line on stderr after the command's name, never a
traceback: exit code 1, or :data:`EXIT_UNKNOWN` for a change whose outcome is unknown.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import sqlalchemy
from sqlalchemy import Engine, MetaData, Table

from .. import _engines as cache
from .._dialects import by_name
from .._dialects.urls import parse_url, server_engine
from .._errors import (
    DatabaseMissing,
    FencingError,
    InvalidArgument,
    OutcomeUnknown,
    SchemaMismatch,
    TableMissing,
)
from .._runtime.sqlite import create_engine as create_sqlite_engine
from .._sql.attempts import attempts_table
from .._sql.dberrors import DB_ERRORS, database_errors, wrap_database_error
from .._sql.failures import failures_table
from .._sql.payloads import payloads_table
from .._sql.schema import jobs, jobs_table
from .._store.history import History, history_table
from .._store.jobstore import JobStore
from .._store.locks import locks_table
from .._store.marks import fence_marks_table, idempotency_keys_table
from ..overview import Overview
from ._options import Commands, resolve_max_attempts
from ._output import Output

#: where ``--url`` comes from when it is not given
URL_VARIABLE = "FENCING_URL"
#: the exit code of a change whose outcome is unknown: the connection was lost while it was
#: committing (:class:`fencing.OutcomeUnknown`), so it may or may not have been made
EXIT_UNKNOWN = 3
#: how a missing locks table comes to be (``fencing init`` makes a jobs table)
LOCKS_TABLE_WAY_OUT = "the application's fencing.Locks(engine).create_table() creates it"


class Failed(Exception):
    """What a command could not do (no such job, nothing changed): its message goes to stderr
    after the command's name, and the exit code is 1."""


def _exists(engine: Engine, name: str, schema: str | None) -> bool:
    with database_errors(name):
        return sqlalchemy.inspect(engine).has_table(name, schema=schema)


def _attempts_beside(engine: Engine, table: Table, name: str) -> Table | None:
    """The attempts table ``name`` beside ``table`` (:func:`fencing.attempts_table`), or
    ``None`` if there is no such table."""
    if not _exists(engine, name, table.schema):
        return None
    return attempts_table(MetaData(), name, schema=table.schema)


@dataclass
class Database:
    """What a database command works on: the library's objects for one table."""

    engine: Engine
    table: Table
    store: JobStore
    overview: Overview

    def where(self) -> str:
        """The database as messages show it: a SQLite file's path, a URL without its password."""
        url = self.engine.url
        if by_name(url.get_backend_name()).is_file:
            return url.database or ""
        return url.render_as_string(hide_password=True)

    def has(self, name: str) -> bool:
        """Whether there is a table ``name`` beside the command's table."""
        return _exists(self.engine, name, self.table.schema)

    def history(self, name: str) -> History | None:
        """The ownership history in table ``name`` beside the command's table, or ``None`` if
        there is no such table. It never prunes: retention is the application's."""
        if not self.has(name):
            return None
        return History(history_table(MetaData(), name, schema=self.table.schema), retention=None)

    def attempts(self, name: str) -> Table | None:
        """The attempts table ``name`` beside the command's table, or ``None``."""
        return _attempts_beside(self.engine, self.table, name)

    def beside(self, payloads: str, failures: str | None = None) -> JobStore:
        """A store on the command's table with the payloads and failures tables of those
        names, each only if it exists beside the command's table."""
        schema = self.table.schema
        kept = None
        if failures is not None and self.has(failures):
            kept = failures_table(MetaData(), failures, schema=schema)
        return JobStore(
            self.engine,
            self.table,
            payloads=payloads_table(MetaData(), payloads, schema=schema) if self.has(payloads) else None,
            failures=kept,
        )

    def recording(self, name: str) -> JobStore | None:
        """A store on the command's table that records the ownership history in table
        ``name``, or ``None`` if there is no such table."""
        history = self.history(name)
        return None if history is None else JobStore(self.engine, self.table, history=history)


def open_engine(url: str, *, create: bool, wait: float | None = None) -> Engine:
    """The engine for ``--url``: a SQLite file (a path or a ``sqlite:`` URL; it must exist
    unless ``create``) through :func:`fencing.create_sqlite_engine` (``wait``: its busy
    timeout), any other URL through ``sqlalchemy.create_engine``. Messages never show the
    URL's password."""
    if "://" in url:
        parsed = parse_url(url)
        if not by_name(parsed.get_backend_name()).is_file:
            # pre-ping: a --watch outlives a server restart
            return server_engine(parsed, pool_pre_ping=True)
    path = cache.normalize_target(url)[1]
    if not create and not os.path.exists(path):
        raise DatabaseMissing(f"no database file at {path!r} (`fencing init` creates one)")
    return create_sqlite_engine(path) if wait is None else create_sqlite_engine(path, busy_timeout=wait)


def _open(args: argparse.Namespace, *, create: bool) -> Database:
    """The library's objects for ``--url`` and ``--table``, on a connection that works."""
    # the contract's own table for the default name (on SQLite its exact DDL, as init_db makes it)
    table = jobs if args.table == "jobs" else jobs_table(MetaData(), args.table)
    meta = MetaData()
    marks = fence_marks_table(meta, getattr(args, "marks_table", "fence_marks"))
    keys = idempotency_keys_table(meta, getattr(args, "keys_table", "idempotency_keys"))
    engine = open_engine(args.url, create=create, wait=getattr(args, "wait", None))
    try:
        try:
            with engine.connect():  # a bad host, password or option is said here, once
                pass
        except TypeError as exc:  # a driver refusing an option of the URL's query string
            shown = engine.url.render_as_string(hide_password=True)
            raise InvalidArgument(f"cannot use database URL {shown!r}: {exc}") from None
        except DB_ERRORS as exc:
            raise wrap_database_error(exc, table.name) from exc
        # with --max-attempts, poisoned jobs count from their last requeue when the workers'
        # attempts table exists, as their claim_next counts them (not looked for otherwise)
        attempts = None
        name = getattr(args, "attempts_table", None)
        if name is not None and getattr(args, "max_attempts", None) is not None:
            attempts = _attempts_beside(engine, table, name)
        overview = Overview(engine, table, marks=marks, keys=keys, attempts=attempts)
        return Database(engine, table, JobStore(engine, table), overview)
    except BaseException:
        engine.dispose()
        raise


#: a database command's handler: its arguments, its database, its output; the exit code
Handler: TypeAlias = "Callable[[argparse.Namespace, Database, Output], int]"
#: why the parsed arguments do not go together (exit code 2, before any database work), or None
Check: TypeAlias = "Callable[[argparse.Namespace], str | None]"


def add_command(
    commands: Commands,
    name: str,
    handler: Handler,
    *,
    help: str,
    description: str,
    table: str = "jobs",
    creates: bool = False,
    check: Check | None = None,
) -> argparse.ArgumentParser:
    """The parser of the database command ``name``, with ``--url``, ``--table`` (its default
    ``table``: the jobs table, or the named locks' one) and ``--json``, set to run ``handler``
    on the database (a SQLite file is created if it is missing with ``creates``, else it is
    an error) once ``check`` found nothing wrong with the arguments."""
    parser = commands.add_parser(name, help=help, description=description)
    where = parser.add_argument_group("database")
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
    parser.add_argument("--json", action="store_true", help="one JSON object per line, for scripts")
    run = functools.partial(_run, handler, parser, creates=creates, check=check, locks=table != "jobs")
    parser.set_defaults(run=run)
    return parser


def _run(
    handler: Handler,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    creates: bool,
    check: Check | None,
    locks: bool,
) -> int:
    problem = resolve_max_attempts(args) or (None if check is None else check(args))
    if problem is not None:
        parser.error(problem)
    try:
        db = _open(args, create=creates)
        try:
            return handler(args, db, Output(sys.stdout, as_json=args.json, prog=parser.prog))
        except SchemaMismatch as exc:
            raise Failed(_not_ours(db, exc, locks=locks)) from None
        finally:
            db.engine.dispose()
    except TableMissing:
        # `fencing init` makes a jobs table; a locks table is made by the application's Locks
        way_out = LOCKS_TABLE_WAY_OUT if locks else "`fencing init` creates it"
        return _fail(parser, f"table {args.table!r} does not exist here; {way_out}")
    except OutcomeUnknown as exc:
        _fail(parser, str(exc))
        return EXIT_UNKNOWN
    except (Failed, FencingError) as exc:
        return _fail(parser, str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _not_ours(db: Database, error: SchemaMismatch, *, locks: bool) -> str:
    """What to do when the command's table is someone else's table of the same name (it
    lacks the library's columns), else ``error``'s own message (a table beside it is)."""
    table = db.table
    kind, expected = ("locks", locks_table(MetaData(), table.name)) if locks else ("jobs", table)
    with database_errors(table.name):
        columns = sqlalchemy.inspect(db.engine).get_columns(table.name, schema=table.schema)
    found = [c["name"] for c in columns]
    wanted = [c.name for c in expected.columns]
    if set(wanted) <= {name.lower() for name in found}:
        return str(error)
    create = "" if locks else "; `fencing init --table NAME` creates one"
    return (
        f"table {table.name!r} here is not a fencing {kind} table (its columns: {', '.join(found)}; "
        f"a {kind} table has {', '.join(wanted)}): --table NAME names yours{create}"
    )


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    print(f"{parser.prog}: {message}", file=sys.stderr)
    return 1
