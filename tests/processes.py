"""Worker processes of the tests: none outlives the test that started it."""

from __future__ import annotations

from collections.abc import Iterable
from multiprocessing.process import BaseProcess


def reap(procs: Iterable[BaseProcess], timeout: float) -> None:
    """Join each process, waiting up to ``timeout`` for each; kill one that is still running."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
