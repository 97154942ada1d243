"""``python -m fencing COMMAND``: the same command as the ``fencing`` console script
(:mod:`fencing.cli`)."""

from __future__ import annotations

import sys

from .cli.commands import build_parser, main

__all__ = ["build_parser", "main"]

# spawned worker processes import this module as __mp_main__: they must not run main()
if __name__ == "__main__":
    sys.exit(main(prog="python -m fencing"))
