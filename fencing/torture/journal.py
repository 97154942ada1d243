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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["OPERATIONS", "Journal", "journal_files", "read_journals"]

#: the events that are operations (what a run's ``operations`` target counts, and the soak's
#: figures): one per call on the store or the marks that returned an answer, accepted or
#: refused: a lease claimed (``claim``: by claim_next or complete_and_claim_next, one per
#: lease), a renewal (``renew``), a completion (``write``: a fenced block, complete(), and
#: each lease of complete_many() and complete_and_claim_next()), a release (``release``: given
#: back with a delay, or by a heartbeat), a write guarded by FenceMarks.accept (``external``).
#: Not counted: an empty claim_next, a call the database was unavailable for, one whose outcome
#: is unknown
OPERATIONS = frozenset({"claim", "renew", "write", "release", "external"})


class Journal:
    """Appends events to ``path``; safe to share between the threads of one process."""

    def __init__(self, path: Path, counted: Callable[[str], None] | None = None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        #: told each event's kind once it is written, under the lock (a counter needs no other)
        self._counted = counted

    def record(self, event: str, /, **fields: Any) -> None:
        line = json.dumps({"k": event, **fields}, separators=(",", ":")) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())
            if self._counted is not None:
                self._counted(event)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_journals(directory: Path) -> Iterator[dict[str, Any]]:
    """Every complete event of every journal in ``directory`` (a line cut short by a kill is
    dropped), one at a time: a run of a million operations has gigabytes of them as dicts."""
    for path in journal_files(directory):
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                if line.endswith("\n"):
                    yield json.loads(line)


def journal_files(directory: Path) -> list[Path]:
    """The harness's journals in ``directory`` (only its own file names)."""
    return sorted([*directory.glob("worker-*.jsonl"), *directory.glob("controller.jsonl")])
