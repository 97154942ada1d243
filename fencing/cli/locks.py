"""Named locks and elections: ``locks`` and ``leader``, each parser beside the function that
runs it. They read the locks table (:class:`fencing.Locks`: it has the jobs table's columns),
``fencing_locks`` unless ``--table`` names another."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

from .._format import instant, when
from .._sql.checks import check_lock_name
from .._store.locks import Locks
from ..overview import JobView
from ._database import Database, Failed, add_command
from ._options import Commands, add_history_table, add_limit
from ._output import Output, history_lines, shown, table

__all__ = ["add_leader", "add_locks"]


def add_locks(commands: Commands) -> None:
    parser = add_command(
        commands,
        "locks",
        locks,
        table="fencing_locks",
        help="named locks: who holds each, with which token, until when; revoke one",
        description="List the named locks (fencing.Locks) of the locks table: held or free, the "
        "holder, the token (it only goes up) and the time left on the database's clock. With "
        "NAME, that lock alone; with --revoke, take it from its holder: the token moves on, so "
        "every write under the holder's token is refused from now on, and the lock is free. "
        "With NAME and an ownership history table (--history-table), the lock's history "
        "follows: who took it with which token, releases, revokes, refused writes. "
        "Exit code 1, nothing changed, if there is no such lock.",
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="one lock (default: list them)")
    parser.add_argument("--revoke", action="store_true", help="take NAME from its holder")
    add_limit(parser, "locks")
    add_history_table(parser, "(%(default)s): with NAME, shown when it exists; a revoke is recorded in it")


def locks(args: argparse.Namespace, db: Database, out: Output) -> int:
    if args.name is not None:
        return _one_lock(args, db, out, "lock")
    if args.revoke:
        raise Failed("--revoke needs the NAME of the lock")
    found = db.overview.jobs(None, limit=args.limit + 1)
    listed = [job for job in found[: args.limit] if job.state != "done"]
    if out.json:
        for job in listed:
            out.record(**_lock_record(job))
        return 0
    if not listed:
        out.lines([f"no locks in table {db.table.name!r}"])
        return 0
    rows = []
    for job in listed:
        lock = _lock_record(job)
        left = when(job) if lock["state"] == "held" else "-"
        rows.append([shown(job.job_id), lock["state"], shown(lock["holder"]), str(job.fence), left])
    out.lines(table(["NAME", "STATE", "HOLDER", "TOKEN", "LEFT"], rows, numeric=[3]))
    if len(found) > args.limit:
        print(f"(more not shown: --limit {args.limit})", file=sys.stderr)
    return 0


def add_leader(commands: Commands) -> None:
    parser = add_command(
        commands,
        "leader",
        leader,
        table="fencing_locks",
        help="who leads an election: the leader, its term, its lease's time left; depose it",
        description="Show who leads the election NAME (fencing.Election): the leader, its term "
        "(the lock's token: every write under an older term is refused) and its lease's time "
        "left on the database's clock. With --revoke, depose it at once: its term is refused "
        "from now on, and the next candidate to try is elected with a higher one. With an "
        "ownership history table (--history-table), the election's history follows: each "
        "term, who held it, how it ended, and the writes refused under an old one.",
    )
    parser.add_argument("name", metavar="NAME", help="the election's name")
    parser.add_argument("--revoke", action="store_true", help="depose the leader")
    add_history_table(parser, "(%(default)s), shown when it exists; a revoke is recorded in it")


def leader(args: argparse.Namespace, db: Database, out: Output) -> int:
    return _one_lock(args, db, out, "leader")


def _one_lock(args: argparse.Namespace, db: Database, out: Output, kind: str) -> int:
    """One lock (``kind`` "lock") or election ("leader"): who holds it, with which token
    (term), until when; with ``--revoke``, taken from its holder (the token moves on)."""
    name = check_lock_name(args.name)
    # a revoke is recorded in the ownership history, in its transaction, when there is one
    history = db.history(args.history_table)
    named = Locks(db.store.engine, db.store.table, history=history)
    if args.revoke:
        holder = named.holder(name)
        if not named.revoke(name):
            raise Failed(f"no lock {name!r} in table {db.table.name!r}; nothing changed")
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
        raise Failed(f"no lock {name!r} in table {db.table.name!r}")
    lock = _lock_record(job)
    entries = None if history is None else named.store.history(name)
    if out.json:
        out.record(**lock, history=None if entries is None else [asdict(e) for e in entries])
        return 0
    word = "term" if kind == "leader" else "token"
    if lock["state"] == "held":
        who = "leader" if kind == "leader" else "holder"
        until = f"{instant(job.until)} ({when(job)})"
        rows = [["name", shown(name)], [who, shown(job.owner)], [word, str(job.fence)], ["until", until]]
    else:
        free = "nobody leads" if kind == "leader" else "free"
        rows = [["name", shown(name)], ["state", free], [f"last {word}", str(job.fence)]]
    rows.append(["now", f"{instant(job.now)} (the database's clock)"])
    out.lines(table(["", ""], rows)[1:])
    if entries:
        out.lines(["", f"history ({args.history_table}, oldest first)", *history_lines(entries)])
    return 0


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
