"""The ``fencing`` command (also ``python -m fencing``).

The public import path; the code lives in :mod:`fencing.tools.cli`.
"""

from __future__ import annotations

from .tools.cli import (
    build_parser,
    main,
)

__all__ = [
    "build_parser",
    "main",
]
