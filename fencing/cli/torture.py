"""``fencing torture``: real workers under injected faults, every guarantee checked.

The parser reads only the harness's config module (its defaults are the command's); the
harness itself (workers, controller, verdict) loads when the command runs, not to build the
parser or print its help.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from typing import TextIO

from .._errors import FencingError
from ..torture.config import FAULT_KINDS, FINISH_MODES, FRONTS, SERVER_CRASH, TortureConfig
from ._options import Commands, at_least, probability, whole

__all__ = ["add_torture"]


def add_torture(commands: Commands) -> None:
    defaults = TortureConfig(url="-")
    parser = commands.add_parser(
        "torture",
        help="run real workers under injected faults and check every guarantee (exit 1 on a violation)",
        description="Enqueue jobs and run worker processes built only from the public API (claim_next, "
        "a heartbeat, a fenced write, a write guarded by FenceMarks, complete) while a "
        "controller freezes them past their lease (SIGSTOP), kills them (SIGKILL, also inside "
        "transactions) and restarts them, and revokes leases. Every call is journaled; at the "
        "end the journals and the database are checked against the rules. Exit code 0 with no "
        "violation, 1 with any. The harness uses only tables named PREFIX..., dropped first. "
        "On a terminal, one line on stderr shows the phase, its seconds and the jobs done.",
    )
    parser.add_argument(
        "--url", help="database URL or SQLite file path (default: a new SQLite file in a temporary directory)"
    )
    parser.add_argument(
        "--workers", type=whole(1, 256), default=defaults.workers, help="worker processes (%(default)s)"
    )
    parser.add_argument(
        "--jobs", type=whole(1, 10_000_000), default=defaults.jobs, help="jobs to run (%(default)s)"
    )
    parser.add_argument(
        "--seconds",
        type=at_least(0.0),
        default=defaults.seconds,
        help="longest fault phase; it ends sooner when every job is done (%(default)s)",
    )
    parser.add_argument(
        "--seed", type=whole(0, 2**63 - 1), help="the faults' seed (default: random, printed)"
    )
    parser.add_argument(
        "--ttl", type=at_least(0.05), default=defaults.ttl, help="lease TTL in seconds (%(default)s)"
    )
    parser.add_argument(
        "--work",
        type=at_least(0.0),
        default=defaults.work,
        help="most simulated work per job, seconds (%(default)s)",
    )
    parser.add_argument(
        "--finish",
        choices=FINISH_MODES,
        default=defaults.finish,
        help="how jobs are completed: fenced block, complete(), complete_many(), or a mix (%(default)s)",
    )
    parser.add_argument(
        "--batch", type=whole(1, 1000), default=defaults.batch, help="largest claim_next batch (%(default)s)"
    )
    parser.add_argument(
        "--fault-every",
        type=at_least(0.01),
        default=defaults.fault_every,
        help="mean seconds between two faults (%(default)s)",
    )
    parser.add_argument(
        "--faults",
        default=",".join(defaults.faults),
        help=f"fault kinds to inject, comma-separated, from {','.join(FAULT_KINDS)} (all but "
        f"{SERVER_CRASH}: it needs a server the harness may kill, run_torture(config, server=...))",
    )
    parser.add_argument(
        "--check-heartbeat",
        type=probability,
        default=defaults.check_heartbeat,
        help="how often a worker asks its heartbeat first; else the store alone refuses (%(default)s)",
    )
    parser.add_argument(
        "--release-rate",
        type=probability,
        default=defaults.release_rate,
        help="how often a worker gives a job back with a delay (%(default)s)",
    )
    parser.add_argument(
        "--drain",
        type=at_least(1.0),
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
        help="run the workers on the async front: AsyncJobStore, AsyncFenceMarks and "
        "AsyncHeartbeat on the asyncio driver (aiosqlite, asyncpg, asyncmy) for the same database",
    )
    parser.add_argument(
        "--mixed",
        dest="front",
        action="store_const",
        const="mixed",
        help="even-numbered workers on the sync front, odd-numbered on the async one",
    )
    parser.add_argument(
        "--operations",
        type=whole(1, 10_000_000),
        help="also end the fault phase once the workers have made this many operations "
        "(claims, renewals, completions, releases, guarded writes); the jobs are then the "
        "backlog kept open, topped up as they are done (default: no target)",
    )
    parser.add_argument(
        "--store",
        metavar="MODULE:CALLABLE",
        help="the store on trial, built from (engine, table, history=History) (default "
        f"{FRONTS['sync']}; with --async, from (AsyncEngine, table, history=History), "
        f"default {FRONTS['async']})",
    )
    parser.add_argument(
        "--journal", metavar="DIR", help="keep the journals here (default: a temporary directory)"
    )
    parser.add_argument("--keep-tables", action="store_true", help="leave the harness's tables behind")
    parser.set_defaults(run=functools.partial(torture, parser))


def torture(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Exit code 0 with no violation, 1 with any, 2 when the run could not be set up."""
    from .. import torture as harness

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    faults = tuple(kind for kind in args.faults.split(",") if kind)
    progress = _ProgressLine(sys.stderr, parser.prog, args.jobs) if sys.stderr.isatty() else None
    with tempfile.TemporaryDirectory(prefix="fencing-torture-db-") as scratch, _cleared(progress):
        try:
            config = harness.TortureConfig(
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
            outcome = harness.run_torture(config, progress=progress)
        except (FencingError, ValueError, TypeError) as exc:
            if progress is not None:
                progress.clear()
            print(f"fencing torture: {exc}", file=sys.stderr)
            return 2
    print(harness.summary(outcome))
    return 1 if outcome.violations else 0


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
