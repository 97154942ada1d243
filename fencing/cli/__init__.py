"""The ``fencing`` command: operators' commands (:mod:`fencing.cli.commands`), ``doctor``,
``serve`` and the demo."""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
