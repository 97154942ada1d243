"""The ``fencing`` command (also ``python -m fencing``): a thin layer over the library.

Each command is a plain argparse subcommand whose parser is declared beside the function
that runs it: the jobs table (:mod:`.jobs`), changes to one job (:mod:`.changes`), named
locks and elections (:mod:`.locks`), and ``demo``, ``serve``, ``doctor`` and ``torture`` in
modules of their own. What the database commands share (``--url``, ``--table``, ``--json``,
opening the database, turning the library's errors into exit codes) is in
:mod:`._database`, their tables and JSON lines in :mod:`._output`. Exit codes: 0 done; 1 a
failure (bad URL, server down, table missing) or, for ``revoke``, ``release``, ``delete``
and ``requeue``, nothing changed; 2 bad arguments (argparse's own); 3 a change whose outcome
is unknown (the connection was lost while it was committing: read the job before doing it
again). Errors go to stderr, never as a traceback. The torture harness (:mod:`fencing.torture`)
loads only when the ``torture`` command runs, not to build the parser or print its help.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata as package_metadata

from . import changes, demo, doctor, jobs, locks, schedules, serve, torture, worker
from ._database import URL_VARIABLE
from ._options import Commands

__all__ = ["build_parser", "main"]

#: every command's parser, in the order ``fencing --help`` lists them
PARSERS: tuple[Callable[[Commands], None], ...] = (
    jobs.add_init,
    jobs.add_enqueue,
    jobs.add_jobs,
    jobs.add_show,
    jobs.add_stats,
    changes.add_revoke,
    changes.add_release,
    changes.add_delete,
    changes.add_requeue,
    locks.add_locks,
    locks.add_leader,
    jobs.add_marks,
    demo.add_demo,
    serve.add_serve,
    worker.add_worker,
    schedules.add_schedules,
    doctor.add_doctor,
    torture.add_torture,
)


def _version() -> str:
    try:
        return package_metadata.version("fencing")
    except package_metadata.PackageNotFoundError:  # run from a source tree
        from .. import __version__

        return __version__


def build_parser(prog: str = "fencing") -> argparse.ArgumentParser:
    """The parser of every command; each sets ``run``, the function from the parsed
    arguments to the exit code."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Leases with fencing tokens: a late worker can never overwrite a newer result.",
        epilog=f"Every database command takes --url (a SQLite file path or a database URL; default "
        f"${URL_VARIABLE}), --table (jobs) and --json. Exit codes: 0 done, 1 failed or nothing "
        "changed, 2 bad arguments, 3 a change whose outcome is unknown (the connection was lost while it "
        "was committing: read the job before doing it again).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in PARSERS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "fencing") -> int:
    """The command: the ``fencing`` console script, and ``python -m fencing`` (``prog``
    names it in help and messages)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    return run(args)
