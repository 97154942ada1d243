"""``fencing doctor``: whether a database keeps the commits it acknowledges, setting by setting.

The rules are :mod:`fencing.durability`'s, the ones the store logs (or, with
``require_durable``, refuses by); this module only opens the database, reads them on one of
its connections and prints them: a line per setting for people (``ok``, ``RISK`` or
``n/a``, the value, what it risks, what to set), ``--json`` for scripts (one object per
setting: ``database``, ``setting``, ``value``, ``status``, ``risk``, ``advice``, ``note``).
Exit codes: 0 every setting is safe, 1 at least one is a risk, 2 the settings could not be
read (a bad URL, a server that does not answer, a dialect with no rules): 1 is the
verdict, so a failure to reach one must not look like it (``torture``'s habit too).

What is read is what a session of the command gets: settings per role, per database or in
the URL (``?options=-c synchronous_commit=off``) are seen; a ``connect`` listener of the
application's own is not. For SQLite the file is opened as :func:`fencing.create_sqlite_engine`
opens it (``journal_mode`` is the file's; ``synchronous`` is per connection, so an
application's engine made otherwise is checked with :func:`fencing.durability.check_durability`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from sqlalchemy import Engine

from .._dialects import of
from .._errors import FencingError
from .._sql.dberrors import DB_ERRORS
from ..durability import Finding, check_durability, dialect_family
from ._database import URL_VARIABLE, open_engine
from ._options import Commands

__all__ = ["SAFE", "UNREADABLE", "UNSAFE", "add_doctor", "lines", "run"]

#: exit codes
SAFE, UNSAFE, UNREADABLE = 0, 1, 2

_MARK = {"ok": "ok", "risk": "RISK", "not applicable": "n/a"}


def add_doctor(commands: Commands) -> None:
    parser = commands.add_parser(
        "doctor",
        help="name the database's settings under which a fence may not survive a crash (exit 1 on a risk)",
        description="Read the settings that decide whether a commit the database acknowledged "
        "survives a crash, power loss or failover (fsync, full_page_writes, synchronous_commit "
        "and asynchronous standbys on PostgreSQL; innodb_flush_log_at_trx_commit, sync_binlog, "
        "innodb_doublewrite on MariaDB/MySQL; journal_mode, synchronous, fullfsync on SQLite), "
        "as a session of this command gets them, and say per setting what it risks and what "
        "to set. Exit code 0 if every one is safe, 1 if any is a risk, 2 if they could not be read.",
    )
    parser.add_argument(
        "--url",
        metavar="URL_OR_PATH",
        help=f"a SQLite file path or a database URL (default: ${URL_VARIABLE})",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per setting, for scripts")
    parser.set_defaults(run=functools.partial(_command, parser))


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    url = args.url or os.environ.get(URL_VARIABLE)
    if url is None:
        parser.error(f"--url is required (or ${URL_VARIABLE})")
    opened = functools.partial(open_engine, create=False)
    return run(url, opened, prog=parser.prog, as_json=args.json, out=sys.stdout, err=sys.stderr)


def lines(found: Sequence[Finding], where: str) -> list[str]:
    """The database (``where``), a line per setting: its mark, ``setting = value``, and for a
    risk what it risks and what to set; then one line that sums up."""
    out = [f"{found[0].database} at {where}, as a session of this command gets its settings:"]
    for f in found:
        line = f"{_MARK[f.status]:<4}  {f.setting} = {f.value}"
        if f.status == "risk":
            line += f": {f.risk}; set {f.advice}"
        elif f.note:
            line += f": {f.note}"
        out.append(line)
    risks = [f.setting for f in found if f.status == "risk"]
    if risks:
        out.append(f"{len(risks)} setting(s) at risk ({', '.join(risks)}): exit code {UNSAFE}")
    else:
        out.append("every setting keeps what the database acknowledged")
    return out


def run(
    url: str,
    open_engine: Callable[[str], Engine],
    *,
    prog: str,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """Check the database at ``url`` (opened by ``open_engine``, the command's own way of
    opening ``--url``); print to ``out``, errors to ``err`` after ``prog``; the exit code."""
    try:
        engine = open_engine(url)
    except FencingError as exc:
        print(f"{prog}: {exc}", file=err)
        return UNREADABLE
    where = (
        (engine.url.database or "")
        if of(engine.dialect).is_file
        else engine.url.render_as_string(hide_password=True)
    )
    try:
        if dialect_family(engine.dialect.name) is None:
            print(f"{prog}: no durability rules for the {engine.dialect.name} dialect", file=err)
            return UNREADABLE
        try:
            found = check_durability(engine)
        except (*DB_ERRORS, TypeError) as exc:  # TypeError: a driver refusing a URL's option
            orig = getattr(exc, "orig", None) or exc
            first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
            print(f"{prog}: cannot read the settings of {where}: {first}", file=err)
            return UNREADABLE
    finally:
        engine.dispose()
    verdict = UNSAFE if any(f.status == "risk" for f in found) else SAFE
    if as_json:
        for f in found:
            print(json.dumps(f.as_dict()), file=out)
    else:
        for line in lines(found, where):
            print(line, file=out)
    return verdict
