"""The ``fencing`` command (:mod:`fencing.cli.commands` builds it): the operators' commands on
the jobs table, one job and the named locks, ``doctor``, ``serve``, ``torture`` and the demo."""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
