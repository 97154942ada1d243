"""The torture harness: ``python -m fencing torture``.

Real worker processes built only from the public API, real faults (SIGSTOP past the
lease, SIGKILL anywhere and inside transactions, revocations, delayed releases), a journal
of every call, and a verdict that checks the guarantees against the journals and the
database. Run it against your own database with ``--url``; ``--async`` runs the workers on
the async store and heartbeat (:mod:`.fronts`).
"""

from __future__ import annotations

from .config import FAULT_KINDS, FINISH_MODES, FRONTS, TortureConfig
from .controller import Run, run_torture
from .report import summary

__all__ = ["FAULT_KINDS", "FINISH_MODES", "FRONTS", "Run", "TortureConfig", "run_torture", "summary"]
