"""What every process saw, one JSON line per event, in one append-only file per process.

A line is written with one ``os.write`` on an ``O_APPEND`` descriptor after the call it
records has returned: once written it survives a SIGKILL of the writer (the kernel holds
it), and a killed writer loses at most the events it had not recorded yet. Times are
``time.time()`` on this machine, the clock the database uses too when it runs here.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Journal", "read_journals"]


class Journal:
    """Appends events to ``path``; safe to share between the threads of one process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def record(self, event: str, /, **fields: Any) -> None:
        line = json.dumps({"k": event, **fields}, separators=(",", ":")) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_journals(directory: Path) -> Iterator[dict[str, Any]]:
    """Every complete event of every journal in ``directory`` (a line cut short by a kill is dropped)."""
    for path in sorted([*directory.glob("worker-*.jsonl"), *directory.glob("controller.jsonl")]):
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                if line.endswith("\n"):
                    yield json.loads(line)
