"""The jobs table and what is written beside it: ``init``, ``enqueue``, ``jobs``, ``show``,
``stats`` and ``marks``, each parser beside the function that runs it. Times are on the
database's clock."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import Any

from .._admin import transaction
from .._errors import FencingError, InvalidArgument
from .._format import duration, instant, when
from ..overview import STATES, Summary
from ._database import Database, Failed, add_command
from ._options import (
    MAX_ATTEMPTS_VARIABLE,
    Commands,
    add_attempts_table,
    add_history_table,
    add_limit,
    add_max_attempts,
    add_side_tables,
    at_least,
    finite,
    json_value,
    whole,
)
from ._output import Output, cell, history_lines, job_record, shown, table

__all__ = ["ENQUEUE_CHUNK", "add_enqueue", "add_init", "add_jobs", "add_marks", "add_show", "add_stats"]

#: ids enqueued per transaction: one commit (one fsync on SQLite) each, and a write lock
#: held for milliseconds, so workers on the same database are not kept waiting
ENQUEUE_CHUNK = 500


def add_init(commands: Commands) -> None:
    add_command(
        commands,
        "init",
        init,
        creates=True,
        help="create the jobs table (idempotent; an existing table is checked, never changed)",
        description="Create the jobs table if it is missing (JobStore.create_table()); an existing "
        "one is checked against the schema and left as it is. A SQLite file is created if needed.",
    )


def init(args: argparse.Namespace, db: Database, out: Output) -> int:
    existed = db.overview.has_table(db.table)
    db.store.create_table()
    if existed:
        line = f"table {db.table.name!r} already exists in {db.where()} and matches: unchanged"
    else:
        line = f"created table {db.table.name!r} in {db.where()}"
    out.result({"table": db.table.name, "created": not existed}, [line])
    return 0


def add_enqueue(commands: Commands) -> None:
    parser = add_command(
        commands,
        "enqueue",
        enqueue,
        help="register jobs by id (an existing id is left exactly as it is)",
        description="Register each id as a ready job (JobStore.enqueue); an id that exists is "
        "left unchanged, a lease in progress included. With no ids, or the one id '-', the ids "
        "are read from stdin, one per line (empty lines skipped). They are enqueued "
        f"{ENQUEUE_CHUNK} per transaction: after an error, the ids before it stay enqueued.",
    )
    parser.add_argument("ids", nargs="*", metavar="ID", help="job ids (none or '-': from stdin)")
    ready = parser.add_mutually_exclusive_group()
    ready.add_argument(
        "--delay",
        type=at_least(0.0),
        metavar="SECONDS",
        help="not claimable before the database's now + SECONDS",
    )
    ready.add_argument(
        "--ready-at", type=finite, metavar="EPOCH", help="not claimable before this time (seconds since 1970)"
    )
    parser.add_argument(
        "--payload",
        type=json_value,
        metavar="JSON",
        help="each new job's arguments (JobStore.enqueue(payload=)), kept in the payloads table",
    )
    parser.add_argument(
        "--payloads-table",
        default="fencing_payloads",
        metavar="NAME",
        help="the payloads table (fencing.payloads_table) (%(default)s), which --payload needs",
    )


def enqueue(args: argparse.Namespace, db: Database, out: Output) -> int:
    ids = _stdin_ids() if args.ids in ([], ["-"]) else list(args.ids)
    ready_at = args.ready_at
    store, payload = db.store, args.payload
    if payload is not None:
        store = db.beside(args.payloads_table)
        if store.payloads is None:
            raise Failed(
                f"--payload needs the payloads table {args.payloads_table!r} beside {db.table.name!r}: "
                "the workers' store creates it (JobStore(..., payloads=fencing.payloads_table(metadata))"
                ".create_table())"
            )
    if args.delay is not None:
        ready_at = db.overview.now() + args.delay
    answers: list[bool] = []
    try:
        for start in range(0, len(ids), ENQUEUE_CHUNK):
            chunk = ids[start : start + ENQUEUE_CHUNK]
            with transaction(store) as conn:  # on SQLite, the write lock taken first
                done = [
                    store.enqueue(job_id, ready_at=ready_at, payload=payload, conn=conn) for job_id in chunk
                ]
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


def add_jobs(commands: Commands) -> None:
    parser = add_command(
        commands,
        "jobs",
        list_jobs,
        check=_poisoned_needs_max_attempts,
        help="list jobs, longest waiting first",
        description="List jobs by until, then id (the ready index's order, so a listing costs the "
        "same at any backlog): ready jobs longest waiting first, held ones soonest expiring "
        "first. Without --state, jobs not done come first, then done ones. Times are on the "
        "database's clock. Poisoned jobs run again only when the workers' max_attempts is "
        "raised: a fence is never lowered.",
    )
    parser.add_argument("--state", choices=STATES, help="only jobs in this state")
    add_limit(parser, "jobs")
    add_max_attempts(parser, "needed with --state poisoned")
    add_attempts_table(parser)


def _poisoned_needs_max_attempts(args: argparse.Namespace) -> str | None:
    if args.state == "poisoned" and args.max_attempts is None:
        return f"--state poisoned needs --max-attempts N or ${MAX_ATTEMPTS_VARIABLE} (the workers' setting)"
    return None


def list_jobs(args: argparse.Namespace, db: Database, out: Output) -> int:
    found = db.overview.jobs(args.state, limit=args.limit + 1, max_attempts=args.max_attempts)
    listed = found[: args.limit]
    if out.json:
        for job in listed:
            out.record(**job_record(job))
        return 0
    if not listed:
        out.lines([f"no {args.state + ' ' if args.state else ''}jobs in table {db.table.name!r}"])
        return 0
    rows = [[shown(j.job_id), j.state, shown(j.owner), str(j.fence), when(j)] for j in listed]
    out.lines(table(["ID", "STATE", "OWNER", "FENCE", "WHEN"], rows, numeric=[3]))
    if len(found) > args.limit:
        print(f"(more not shown: --limit {args.limit})", file=sys.stderr)
    return 0


def add_show(commands: Commands) -> None:
    parser = add_command(
        commands,
        "show",
        show,
        help="one job: its row, its state, its lease's time left",
        description="Show one job's row, its state and its lease's time left on the database's clock.",
    )
    parser.add_argument("id", metavar="ID", help="the job's id")
    add_max_attempts(parser, "to tell poisoned jobs from ready ones")
    add_attempts_table(parser)
    add_history_table(parser, "(%(default)s), shown when it exists")
    add_side_tables(parser)


def show(args: argparse.Namespace, db: Database, out: Output) -> int:
    job = db.overview.job(args.id, max_attempts=args.max_attempts)
    if job is None:
        raise Failed(f"no job {args.id!r} in table {db.table.name!r}")
    store = db.recording(args.history_table)
    history = None if store is None else store.history(job.job_id)
    sides = db.beside(args.payloads_table, args.failures_table)
    payload = None if sides.payloads is None else sides.payload(job.job_id)
    failure = None if sides.failures is None else sides.failure(job.job_id)
    if out.json:
        recorded = None if history is None else [asdict(e) for e in history]
        failed = None if failure is None else {"fence": failure.fence, "at": failure.at, "text": failure.text}
        out.record(**job_record(job), history=recorded, payload=payload, failure=failed)
        return 0
    until = "-" if job.until == 0 else f"{instant(job.until)} ({when(job)})"
    rows = [
        ["id", shown(job.job_id)],
        ["state", job.state],
        ["owner", shown(job.owner)],
        ["fence", str(job.fence)],
        ["until", until],
        ["result", shown(job.result)],
        ["now", f"{instant(job.now)} (the database's clock)"],
    ]
    if sides.payloads is not None:
        said = "-" if payload is None else shown(json.dumps(payload, ensure_ascii=False))
        rows.insert(-1, ["payload", said])
    out.lines(table(["", ""], rows)[1:])
    if failure is not None:
        text = [f"  {line}" for line in failure.text.splitlines()]
        out.lines(["", f"last failure (fence {failure.fence}, at {instant(failure.at)})", *text])
    if history:
        out.lines(["", f"history ({args.history_table}, oldest first)", *history_lines(history)])
    return 0


def add_stats(commands: Commands) -> None:
    parser = add_command(
        commands,
        "stats",
        stats,
        check=_count_needs_watch,
        help="counts by state, the longest wait, leases about to end, the highest fence",
        description="Summarise the table at one instant of the database's clock (one pass over "
        "it). With --watch, again every SECONDS until Ctrl-C (or --count refreshes): in place on "
        "a terminal, one summary after another otherwise.",
    )
    parser.add_argument(
        "--within",
        type=at_least(0.0),
        default=60.0,
        metavar="SECONDS",
        help="count held leases that end within this many seconds (%(default)g)",
    )
    add_max_attempts(parser, "count poisoned jobs")
    add_attempts_table(parser)
    parser.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=at_least(0.1),
        metavar="SECONDS",
        help="refresh every SECONDS (2 if not given)",
    )
    parser.add_argument("--count", type=whole(1, 10**9), metavar="N", help="with --watch: stop after N")


def _count_needs_watch(args: argparse.Namespace) -> str | None:
    return "--count goes with --watch" if args.count and not args.watch else None


def stats(args: argparse.Namespace, db: Database, out: Output) -> int:
    def summary() -> Summary:
        return db.overview.summary(within=args.within, max_attempts=args.max_attempts)

    if args.watch is None:
        s = summary()
        out.result(_stats_record(s), _stats_lines(s))
        return 0
    in_place = not out.json and out.stream.isatty()
    title = f"table {db.table.name!r} in {db.where()}, every {args.watch:g}s (Ctrl-C to stop)"
    if in_place:
        out.stream.write("\x1b[2J")  # clear the screen once; each refresh overwrites
    refreshes = 0
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
            refreshes += 1
            if args.count is not None and refreshes >= args.count:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


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
    return table(["", "", ""], rows, numeric=[1])[1:]


def _stats_record(s: Summary) -> dict[str, Any]:
    # null, not 0, for poisoned jobs no --max-attempts counted (as the table leaves the row out)
    return {**s.as_json(), "poisoned": s.poisoned if s.max_attempts is not None or s.poisoned else None}


def add_marks(commands: Commands) -> None:
    parser = add_command(
        commands,
        "marks",
        marks,
        help="list FenceMarks' fence marks and idempotency keys",
        description="List the highest fence accepted per resource and the recorded idempotency "
        "keys (fencing.FenceMarks), by resource and key. A missing table is said, not an error, "
        "unless both are missing (exit 1).",
    )
    parser.add_argument("--marks-table", default="fence_marks", metavar="NAME", help="(%(default)s)")
    parser.add_argument("--keys-table", default="idempotency_keys", metavar="NAME", help="(%(default)s)")
    add_limit(parser, "of each")


def marks(args: argparse.Namespace, db: Database, out: Output) -> int:
    o = db.overview
    kinds = (("fence marks", o.marks, o.fence_marks), ("idempotency keys", o.keys, o.idempotency_keys))
    found = {
        t.name: [asdict(row) for row in read(limit=args.limit + 1)] if o.has_table(t) else None
        for _, t, read in kinds
    }
    if all(rows is None for rows in found.values()):
        raise Failed(
            f"neither {o.marks.name!r} nor {o.keys.name!r} exists here: nothing uses FenceMarks "
            "on this database yet (FenceMarks.create_tables() makes them)"
        )
    lines: list[str] = []
    for what, t, _ in kinds:
        rows = found[t.name]
        if rows is None:
            if out.json:
                print(f"{out.prog}: no table {t.name!r}", file=sys.stderr)
            lines += ["", f"{what}: no table {t.name!r}"]
            continue
        if len(rows) > args.limit:
            print(f"(more in {t.name} than shown: --limit {args.limit})", file=sys.stderr)
        rows = rows[: args.limit]
        for row in rows if out.json else ():
            out.record(table=t.name, **row)
        lines += ["", f"{what} ({t.name}):{'' if rows else ' none'}"]
        if rows:
            headers = [name.split("_")[0].upper() for name in rows[0]]  # RECORDED for recorded_at
            cells = [[cell(value) for value in row.values()] for row in rows]
            lines += table(headers, cells, numeric=[headers.index("FENCE")])
    if not out.json:
        out.lines(lines[1:])
    return 0
