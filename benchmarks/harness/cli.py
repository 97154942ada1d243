"""The command-line options the benchmarks share, each with its script's default and help.

Every ``add_*`` adds one option to the script's parser where the script calls it, so a
script's ``--help`` lists its options in the order it adds them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from harness.db import URLS

#: ``--dir`` of the scripts that put their SQLite files under the working directory
DIR_HELP = "where the SQLite files go (default: a temporary dir under the cwd)"


def parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """The script's parser, described by the first line of its docstring."""
    return argparse.ArgumentParser(description=doc.split("\n", 1)[0] if doc else None, **kwargs)


def comma_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """``a,b,c`` as a list of ``kind`` (empty items dropped)."""
    return lambda s: [kind(x.strip()) for x in s.split(",") if x.strip()]


def int_set(s: str) -> list[int]:
    """``4,1,4`` as ``[1, 4]``: sorted, each once (empty items dropped)."""
    return sorted({int(x) for x in s.split(",") if x.strip()})


def add_processes(
    parser: argparse.ArgumentParser, help: str = "comma-separated worker process counts (default 1,4)"
) -> None:
    parser.add_argument("--processes", default="1,4", type=int_set, help=help)


def add_repeat(
    parser: argparse.ArgumentParser,
    default: int = 3,
    help: str | None = "repetitions; medians reported (default {default})",
) -> None:
    parser.add_argument(
        "--repeat", type=int, default=default, help=help.format(default=default) if help else None
    )


def add_rounds(parser: argparse.ArgumentParser, default: int, help: str | None = None) -> None:
    parser.add_argument("--rounds", type=int, default=default, help=help)


def add_durability(
    parser: argparse.ArgumentParser, default: str, *, both: bool = False, help: str | None = None
) -> None:
    """SQLite's durability: ``full`` (fsync per commit, the library's default) or ``normal``;
    ``both``: either, or each in turn."""
    choices = ("full", "normal", "both") if both else ("full", "normal")
    parser.add_argument("--durability", choices=choices, default=default, help=help)


def add_dir(
    parser: argparse.ArgumentParser, default: str | None = None, help: str = DIR_HELP, **kwargs: Any
) -> None:
    parser.add_argument("--dir", default=default, help=help, **kwargs)


def add_server_urls(parser: argparse.ArgumentParser) -> None:
    """``--postgresql-url`` and ``--mariadb-url``, defaulting to the local test servers."""
    parser.add_argument("--postgresql-url", default=URLS["postgresql"])
    parser.add_argument("--mariadb-url", default=URLS["mariadb"])


def server_urls(args: argparse.Namespace) -> dict[str, str]:
    """The servers' URLs the run was given (:func:`add_server_urls`), by backend name."""
    return {"postgresql": args.postgresql_url, "mariadb": args.mariadb_url}


def add_json(parser: argparse.ArgumentParser, help: str = "write the figures here") -> None:
    parser.add_argument("--json", metavar="FILE", help=help)


def add_check(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--check", action="store_true", help=help)
