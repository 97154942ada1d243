"""What the command line accepts: the argument types (seconds, a whole number in a range, a
probability) and the options several commands share, each added with its help text."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from typing import TypeAlias

from .._sql.checks import FENCE_MAX

#: what each command's parser is added to (``fencing``'s subparsers)
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _number(text: str, what: str = "a number") -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def at_least(minimum: float) -> Callable[[str], float]:
    def seconds(text: str) -> float:
        value = _number(text, "a number of seconds")
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g} seconds, got {text!r}")
        return value

    return seconds


def whole(minimum: int, maximum: int) -> Callable[[str], int]:
    def number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be between {minimum} and {maximum}, got {value}")
        return value

    return number


def probability(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def json_value(text: str) -> object:
    """A JSON document (``--payload``): what it says, or why it is not JSON."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text[:80]!r}") from None


def _not_json(constant: str) -> object:
    """``NaN`` and ``Infinity``, which Python's reader takes and JSON does not."""
    raise ValueError(f"{constant} is not a JSON value")


def finite(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


#: the workers' max_attempts, for every command that tells poisoned jobs, for `fencing serve`
#: and for `fencing worker`, where --max-attempts is not given: one setting they all read
MAX_ATTEMPTS_VARIABLE = "FENCING_MAX_ATTEMPTS"
_MAX_ATTEMPTS = whole(1, FENCE_MAX)


def add_max_attempts(parser: argparse.ArgumentParser, what: str, *, fallback: int | None = None) -> None:
    """``--max-attempts``; its default is ``$FENCING_MAX_ATTEMPTS``, else ``fallback``
    (:func:`resolve_max_attempts` reads it when the command runs)."""
    otherwise = f", else {fallback}" if fallback is not None else ""
    parser.add_argument(
        "--max-attempts",
        type=_MAX_ATTEMPTS,
        metavar="N",
        help=f"{what}: jobs claimed N times or more are poisoned, as claim_next(max_attempts=N) "
        f"skips them (the fence counts claims) (default: ${MAX_ATTEMPTS_VARIABLE}{otherwise})",
    )
    parser.set_defaults(max_attempts_fallback=fallback)


def resolve_max_attempts(args: argparse.Namespace) -> str | None:
    """Set ``args.max_attempts`` from ``$FENCING_MAX_ATTEMPTS`` (else the command's fallback)
    when the command takes ``--max-attempts`` and it was not given; what is wrong with the
    variable, or ``None``."""
    if getattr(args, "max_attempts", True) is not None:
        return None
    text = os.environ.get(MAX_ATTEMPTS_VARIABLE, "").strip()
    if not text:
        args.max_attempts = args.max_attempts_fallback
        return None
    try:
        args.max_attempts = _MAX_ATTEMPTS(text)
    except argparse.ArgumentTypeError as exc:
        return f"${MAX_ATTEMPTS_VARIABLE} (the workers' max_attempts) {exc}"
    return None


def add_limit(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--limit", type=whole(1, 1_000_000), default=50, help=f"at most this many {what} (%(default)s)"
    )


def add_history_table(parser: argparse.ArgumentParser, use: str) -> None:
    """``--history-table``: the ownership history's table, used (``use``) when it exists."""
    parser.add_argument(
        "--history-table",
        default="fencing_history",
        metavar="NAME",
        help=f"the ownership history table {use}",
    )


def add_side_tables(parser: argparse.ArgumentParser) -> None:
    """``--payloads-table`` and ``--failures-table``: where the workers' store keeps each
    job's payload and its last failure, shown when they exist."""
    parser.add_argument(
        "--payloads-table",
        default="fencing_payloads",
        metavar="NAME",
        help="the payloads table (fencing.payloads_table) (%(default)s): the job's payload, "
        "shown when it exists",
    )
    parser.add_argument(
        "--failures-table",
        default="fencing_failures",
        metavar="NAME",
        help="the failures table (fencing.failures_table) (%(default)s): the job's last failure, "
        "shown when it exists",
    )


def add_attempts_table(
    parser: argparse.ArgumentParser,
    use: str = "(%(default)s): when it exists, poisoned jobs count from their requeue",
) -> None:
    """``--attempts-table``: the table of the workers' requeued jobs' attempts bases (by
    default for the commands that tell poisoned jobs, with ``--max-attempts``)."""
    parser.add_argument(
        "--attempts-table",
        default="fencing_attempts",
        metavar="NAME",
        help=f"the attempts table (fencing.attempts_table) {use}",
    )
