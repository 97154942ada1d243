"""The torture harness: ``python -m fencing torture``.

Real worker processes built only from the public API, real faults (SIGSTOP past the
lease, SIGKILL anywhere and inside transactions, revocations, delayed releases), a journal
of every call, and a verdict that checks the guarantees against the journals and the
database. Run it against your own database with ``--url``; ``--async`` runs the workers on
the async store and heartbeat (:mod:`.fronts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import FAULT_KINDS, FINISH_MODES, FRONTS, TortureConfig

if TYPE_CHECKING:
    from .controller import Run, run_torture
    from .report import summary

__all__ = ["FAULT_KINDS", "FINISH_MODES", "FRONTS", "Run", "TortureConfig", "run_torture", "summary"]


def __getattr__(name: str) -> Any:
    """The harness itself (controller, workers, verdict, report) loads on first use: the
    ``fencing`` command's parser reads only :mod:`.config`."""
    if name in ("Run", "run_torture"):
        from . import controller

        return getattr(controller, name)
    if name == "summary":
        from . import report

        return report.summary
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
