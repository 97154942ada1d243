"""The history's automatic prune, off the callers' path.

A store with a retention deletes its old history rows now and then. Not inside the operation
that found a prune due: with millions of old rows that made a ``claim(ttl=1)`` return a lease
already expired, and on SQLite held the write lock over every other writer meanwhile. The
operation only starts the prune, which then runs on its own:

* on a thread of its own (a daemon: it never keeps the process alive), for the sync store;
* in a task of the event loop, for the async store (found running inside SQLAlchemy's asyncio
  bridge), through the same bridge;

in batches of at most :data:`PRUNE_BATCH` rows, each a short transaction of its own, so a
writer waits at most one batch behind it. One prune runs per store at a time; a forked child
starts its own when one is due (the parent's thread does not exist there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..core import bridge
from ..core.errors import FencingError

__all__ = ["PRUNE_BATCH", "Pruner"]

logger = logging.getLogger("fencing.store")

#: history rows deleted per transaction by a prune
PRUNE_BATCH = 1000


class Pruner:
    """Runs ``prune`` (every old row, in batches; how many) in the background, once at a time."""

    def __init__(self, prune: Callable[[], int]) -> None:
        self._prune = prune
        self._lock = threading.Lock()
        self._running: threading.Thread | Any = None

    def start(self) -> None:
        """Start a prune, unless one is running (from the async store's bridge: a task)."""
        with self._lock:
            if self.running():
                return
            if bridge.in_bridge():
                import asyncio

                from sqlalchemy.util.concurrency import greenlet_spawn

                self._running = asyncio.get_running_loop().create_task(greenlet_spawn(self._run))
            else:
                thread = threading.Thread(target=self._run, name="fencing-history-prune", daemon=True)
                self._running = thread
                thread.start()

    def running(self) -> bool:
        """Whether a prune started here is still on its way."""
        running = self._running
        if running is None:
            return False
        if isinstance(running, threading.Thread):
            return running.is_alive()  # False in a forked child: the thread is the parent's
        return not running.done()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the sync store's prune (tests, shutdown); the async store's task is awaited
        by awaiting it: :meth:`task`."""
        running = self._running
        if isinstance(running, threading.Thread):
            running.join(timeout)

    def task(self) -> Any:
        """The async store's running prune task, or ``None``."""
        running = self._running
        return None if running is None or isinstance(running, threading.Thread) else running

    def _run(self) -> None:
        try:
            pruned = self._prune()
        except FencingError:
            # the next due prune tries again; a failure is never raised over anyone's operation
            logger.warning("pruning the ownership history failed; it is tried again later", exc_info=True)
            return
        except Exception:  # a bug or the engine disposed under it: said, never a thread's traceback
            logger.exception("pruning the ownership history failed")
            return
        if pruned:
            logger.debug("pruned %d history rows", pruned, extra={"path": "prune", "rows": pruned})
