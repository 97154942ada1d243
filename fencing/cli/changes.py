"""Changing one job: ``revoke``, ``release``, ``delete`` and ``requeue``, each parser beside
the function that runs it.

The job is read with its row locked, judged and changed by the store in one transaction, so
what is judged is what is changed (:func:`fencing._admin.locked_change`), and the change is
recorded in the ownership history, in that transaction, when there is one. Exit code 1 when
nothing changed (no such job, or for ``revoke`` and ``release`` a job nobody holds),
:data:`~fencing.cli._database.EXIT_UNKNOWN` when the connection was lost while the change was
committing.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable

from sqlalchemy import Connection

from .._admin import locked_change
from .._errors import DatabaseBusy, OutcomeUnknown
from .._format import duration, when
from .._sql.values import Lease
from .._store.jobstore import JobStore
from ..overview import JobView
from ._database import Database, Failed, Handler, add_command
from ._options import Commands, add_attempts_table, add_history_table, at_least
from ._output import Output

__all__ = ["add_delete", "add_release", "add_requeue", "add_revoke"]


def add_revoke(commands: Commands) -> None:
    parser = _job_command(
        commands,
        "revoke",
        revoke,
        help="take a held job's lease away: the fence moves on, so the holder's token is stale",
        description="End a held job's lease at once (JobStore.revoke): its fence goes up by one, so "
        "every later write with the holder's token is refused (FenceMarks.accept too); the job is "
        "claimable again. Exit code 1, nothing changed, if the job is not held.",
    )
    _add_wait_and_record(parser)


def revoke(args: argparse.Namespace, db: Database, out: Output) -> int:
    job = _change(args, db, out, "revoke", lambda store, conn, job: store.revoke(job.job_id, conn=conn))
    fence, new = job.fence, job.fence + 1
    out.result(
        {"id": job.job_id, "revoked": True, "owner": job.owner, "fence": fence, "new_fence": new},
        [
            f"revoked job {job.job_id!r}: the lease of {job.owner!r} (fence {fence}, {when(job)}) "
            f"ended; the fence is now {new}, so fence {fence} is stale"
        ],
    )
    return 0


def add_release(commands: Commands) -> None:
    parser = _job_command(
        commands,
        "release",
        release,
        help="end a held job's lease without moving the fence (as the worker's own release)",
        description="End a held job's lease as its worker's JobStore.release would: no owner, "
        "claimable again (after --delay), the fence kept. The holder's writes to the jobs table "
        "are refused from now on (it is no longer the owner), but its fence stays the highest "
        "until the next claim, so a FenceMarks.accept with it still passes until then: to cut a "
        "stalled worker off everywhere, use revoke. Exit code 1, nothing changed, if the job is "
        "not held.",
    )
    parser.add_argument(
        "--delay",
        type=at_least(0.001),
        metavar="SECONDS",
        help="not claimable again before the database's now + SECONDS",
    )
    _add_wait_and_record(parser)


def release(args: argparse.Namespace, db: Database, out: Output) -> int:
    def released(store: JobStore, conn: Connection, job: JobView) -> bool:
        if job.owner is None:
            return False
        return bool(store.release(Lease(job.job_id, job.owner, job.fence), delay=args.delay, conn=conn))

    job = _change(args, db, out, "release", released)
    again = "now" if args.delay is None else f"in {duration(args.delay)}"
    out.result(
        {"id": job.job_id, "released": True, "owner": job.owner, "fence": job.fence, "delay": args.delay},
        [
            f"released job {job.job_id!r} from {job.owner!r} (fence {job.fence} kept, {when(job)}); "
            f"claimable again {again}"
        ],
    )
    return 0


def add_delete(commands: Commands) -> None:
    parser = _job_command(
        commands,
        "delete",
        delete,
        help="delete a job; its fence is kept, so the id enqueued again never reissues a token",
        description="Delete a job in any state (JobStore.delete). Its row stays as a tombstone "
        "that keeps the fence: enqueued again, the id continues above every fence it had. A "
        "holder's later writes to the jobs table are refused. Exit code 1 if there is no such job.",
    )
    _add_wait_and_record(parser)


def delete(args: argparse.Namespace, db: Database, out: Output) -> int:
    job = _change(
        args, db, out, "delete", lambda store, conn, job: store.delete(job.job_id, conn=conn), held_only=False
    )
    holder = f" by {job.owner!r}" if job.state == "held" else ""
    out.result(
        {"id": job.job_id, "deleted": True, "state": job.state, "owner": job.owner, "fence": job.fence},
        [f"deleted job {job.job_id!r} (it was {job.state}{holder}; fence {job.fence} kept)"],
    )
    return 0


def add_requeue(commands: Commands) -> None:
    parser = _job_command(
        commands,
        "requeue",
        requeue,
        help="give a poisoned job its attempts back (its fence kept): claim_next may take it again",
        description="Requeue a job nobody holds (JobStore.requeue): claim_next(max_attempts=N) "
        "may take it N more times, counted from its fence now, which is kept (every token handed "
        "out stays stale); a deferred job is ready at once. Needs the attempts table the workers' "
        "store keeps (fencing.attempts_table). Exit code 1, nothing changed, if the job is held, "
        "done or missing.",
    )
    add_attempts_table(parser, "(%(default)s) the workers' store keeps the bases in")
    _add_wait_and_record(parser)


def requeue(args: argparse.Namespace, db: Database, out: Output) -> int:
    recording = db.recording(args.history_table) or db.store
    attempts = db.attempts(args.attempts_table)
    if attempts is None:
        raise Failed(
            f"no attempts table {args.attempts_table!r}: requeue needs the one the workers' "
            "store keeps (JobStore(..., attempts=fencing.attempts_table(metadata)), or "
            "--attempts-table NAME); nothing changed"
        )
    store = JobStore(db.engine, db.table, history=recording.history_config, attempts=attempts)
    job = _change(
        args,
        db,
        out,
        "requeue",
        lambda store, conn, job: store.requeue(job.job_id, conn=conn),
        held_only=False,
        store=store,
    )
    out.result(
        {"id": job.job_id, "requeued": True, "state": job.state, "fence": job.fence, "base": job.fence},
        [
            f"requeued job {job.job_id!r} (it was {job.state}; fence {job.fence} kept): its attempts "
            f"count again from fence {job.fence}, and it is ready"
        ],
    )
    return 0


# -- what the four share ---------------------------------------------------------------------


def _job_command(
    commands: Commands, name: str, handler: Handler, *, help: str, description: str
) -> argparse.ArgumentParser:
    """The command's parser, its first argument the job's id."""
    parser = add_command(commands, name, handler, help=help, description=description)
    parser.add_argument("id", metavar="ID", help="the job's id")
    return parser


def _add_wait_and_record(parser: argparse.ArgumentParser) -> None:
    """The last options: how long to wait for the job's row (a worker's open fenced block holds
    it), and the history table the change is recorded in."""
    parser.add_argument(
        "--wait",
        type=at_least(0.001),
        default=10.0,
        metavar="SECONDS",
        help="wait at most this long for the job's row, which a worker's fenced block may hold (%(default)g)",
    )
    add_history_table(parser, "(%(default)s): the change is recorded in it when it exists")


def _change(
    args: argparse.Namespace,
    db: Database,
    out: Output,
    name: str,
    change: Callable[[JobStore, Connection, JobView], bool],
    *,
    held_only: bool = True,
    store: JobStore | None = None,
) -> JobView:
    """The job ``args.id`` as it was before ``change`` changed it (with ``held_only``, only if
    it is held), the job's row locked in between. ``store`` (default: the command's, recording
    in the history table when there is one) makes the change; :class:`Failed` if nothing changed."""
    did = f"{name}d"  # revoked, released, deleted, requeued
    if store is None:
        store = db.recording(args.history_table) or db.store

    def judged(conn: Connection, job: JobView) -> bool:
        return (not held_only or job.state == "held") and change(store, conn, job)

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
        command = out.prog.rsplit(" ", 1)[0]
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
        raise Failed(f"job {args.id!r}: {why}; nothing changed")
    return job
