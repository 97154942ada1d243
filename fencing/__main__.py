"""The command line: ``python -m fencing COMMAND``, a thin layer over the library.

Each command is one ``_add_*`` function that declares its arguments and sets ``run``,
a function from the parsed arguments to an exit code.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
from collections.abc import Callable, Sequence

from . import demo
from .errors import FencingError

__all__ = ["build_parser", "main"]

Run = Callable[[argparse.Namespace], int]


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


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "demo",
        help="play the late-worker story on a real SQLite file with real worker processes",
        description=(
            "Worker A claims a job and stalls past its lease; worker B claims the job and "
            "completes it; A wakes up and tries to write its stale result. The store rejects "
            "A's write. Exit code 0 if the story went exactly so, 1 otherwise."
        ),
    )
    parser.add_argument(
        "--ttl",
        type=_at_least(demo.MIN_TTL),
        default=demo.DEFAULT_TTL,
        metavar="SECONDS",
        help=f"lease duration in real seconds (default {demo.DEFAULT_TTL:g}, at least {demo.MIN_TTL:g})",
    )

    def run(args: argparse.Namespace) -> int:
        return demo.run_demo(args.ttl)

    parser.set_defaults(run=run)


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


def _add_torture(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from . import torture  # the harness loads only when asked for

    defaults = torture.TortureConfig(url="-")
    parser = commands.add_parser(
        "torture",
        help="run real workers under injected faults and check every guarantee (exit 1 on a violation)",
        description=(
            "Enqueue jobs and run worker processes built only from the public API (claim_next, "
            "a heartbeat, a fenced write, a write guarded by FenceMarks, complete) while a "
            "controller freezes them past their lease (SIGSTOP), kills them (SIGKILL, also inside "
            "transactions) and restarts them, and revokes leases. Every call is journaled; at the "
            "end the journals and the database are checked against the rules. Exit code 0 with no "
            "violation, 1 with any. The harness uses only tables named PREFIX..., dropped first."
        ),
    )
    parser.add_argument(
        "--url",
        help="database URL or SQLite file path (default: a new SQLite file in a temporary directory)",
    )
    parser.add_argument(
        "--workers", type=_whole(1, 256), default=defaults.workers, help="worker processes (%(default)s)"
    )
    parser.add_argument(
        "--jobs", type=_whole(1, 10_000_000), default=defaults.jobs, help="jobs to run (%(default)s)"
    )
    parser.add_argument(
        "--seconds",
        type=_at_least(0.0),
        default=defaults.seconds,
        help="longest fault phase; it ends sooner when every job is done (%(default)s)",
    )
    parser.add_argument(
        "--seed", type=_whole(0, 2**63 - 1), help="the faults' seed (default: random, printed)"
    )
    parser.add_argument(
        "--ttl", type=_at_least(0.05), default=defaults.ttl, help="lease TTL in seconds (%(default)s)"
    )
    parser.add_argument(
        "--work",
        type=_at_least(0.0),
        default=defaults.work,
        help="most simulated work per job, seconds (%(default)s)",
    )
    parser.add_argument(
        "--finish",
        choices=torture.FINISH_MODES,
        default=defaults.finish,
        help="how jobs are completed: fenced block, complete(), complete_many(), or a mix (%(default)s)",
    )
    parser.add_argument(
        "--batch", type=_whole(1, 1000), default=defaults.batch, help="largest claim_next batch (%(default)s)"
    )
    parser.add_argument(
        "--fault-every",
        type=_at_least(0.01),
        default=defaults.fault_every,
        help="mean seconds between two faults (%(default)s)",
    )
    parser.add_argument(
        "--faults",
        default=",".join(defaults.faults),
        help=f"fault kinds to inject, comma-separated, from {','.join(torture.FAULT_KINDS)} (all)",
    )
    parser.add_argument(
        "--check-heartbeat",
        type=_probability,
        default=defaults.check_heartbeat,
        help="how often a worker asks its heartbeat first; else the store alone refuses (%(default)s)",
    )
    parser.add_argument(
        "--release-rate",
        type=_probability,
        default=defaults.release_rate,
        help="how often a worker gives a job back with a delay (%(default)s)",
    )
    parser.add_argument(
        "--drain",
        type=_at_least(1.0),
        default=defaults.drain,
        help="seconds to finish every job after the faults (%(default)s)",
    )
    parser.add_argument(
        "--prefix", default=defaults.prefix, help="the harness's table name prefix (%(default)s)"
    )
    parser.add_argument(
        "--async",
        dest="front",
        action="store_const",
        const="async",
        default=defaults.front,
        help="run the workers on the async front: AsyncJobStore, AsyncFenceMarks and AsyncHeartbeat "
        "on the asyncio driver (aiosqlite, asyncpg, asyncmy) for the same database",
    )
    parser.add_argument(
        "--store",
        metavar="MODULE:CALLABLE",
        help=f"the store on trial, built from (engine, table) (default {torture.FRONTS['sync']}; "
        f"with --async, from (AsyncEngine, table), default {torture.FRONTS['async']})",
    )
    parser.add_argument(
        "--journal", metavar="DIR", help="keep the journals here (default: a temporary directory)"
    )
    parser.add_argument("--keep-tables", action="store_true", help="leave the harness's tables behind")

    def run(args: argparse.Namespace) -> int:
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
        faults = tuple(kind for kind in args.faults.split(",") if kind)
        with tempfile.TemporaryDirectory(prefix="fencing-torture-db-") as scratch:
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
                )
                outcome = torture.run_torture(config)
            except (FencingError, ValueError, TypeError) as exc:
                print(f"fencing torture: {exc}", file=sys.stderr)
                return 2
        print(torture.summary(outcome))
        return 1 if outcome.violations else 0

    parser.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fencing",
        description="Leases with fencing tokens: a late worker can never overwrite a newer result.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_demo(commands)
    _add_torture(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Run | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    return run(args)


# spawned worker processes import this module as __mp_main__: they must not run main()
if __name__ == "__main__":
    sys.exit(main())
