"""The command line: ``python -m fencing COMMAND``, a thin layer over the library.

Each command is one ``_add_*`` function that declares its arguments and sets ``run``,
a function from the parsed arguments to an exit code.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence

from . import demo

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fencing",
        description="Leases with fencing tokens: a late worker can never overwrite a newer result.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_demo(commands)
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
