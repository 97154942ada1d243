"""Work a store does off its callers' path: the history's prune, and the refusals of blocks
that joined a caller's transaction.

Neither belongs inside the operation that finds it to do:

* **The prune.** With millions of old history rows, a prune run inside the write that found it
  due made a ``claim(ttl=1)`` return a lease already expired, and on SQLite held the write lock
  over every other writer meanwhile.
* **A joined block's refusal.** A block that joined the caller's transaction and lost its lease
  raises :class:`~fencing.LeaseLost`, and the caller then rolls its transaction back (the
  documented ORM pattern does): a history row written into that transaction would go with it.
  Written at once in a transaction of the store's own, it would wait for the caller's own lock
  (SQLite's write lock), on the caller's thread: a wait on itself.

So the operation only starts the work, which then runs on its own:

* on a thread of its own (a daemon: it never keeps the process alive), for the sync store;
* in a task of the event loop, for the async store (found running inside SQLAlchemy's asyncio
  bridge), through the same bridge;

each piece in short transactions of the store's own, waiting for locks like any other writer
(the caller's transaction, once it ends, included). One run per store and kind at a time; a
forked child starts its own when there is work (the parent's thread does not exist there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .._runtime import bridge

__all__ = ["Background"]

logger = logging.getLogger("fencing.store")


class Background:
    """Runs ``work`` in the background, once at a time; ``name`` says what it is in logs.
    ``work`` reports its own failures: anything it raises is logged here, never anyone's."""

    def __init__(self, work: Callable[[], None], name: str) -> None:
        self._work = work
        self.name = name
        self._lock = threading.Lock()
        self._running: threading.Thread | Any = None
        #: asked to run again while running: it does, once it ends
        self._again = False

    def start(self) -> None:
        """Run the work, unless it is running (then once more after it); from the async
        store's bridge, as a task of its loop."""
        with self._lock:
            if self.running():
                self._again = True
                return
            self._again = False
            if bridge.in_bridge():
                import asyncio

                from .._runtime.private_sqlalchemy import greenlet_spawn

                async def run() -> None:
                    # a task copies its creator's context, whose caller (a fenced block's task,
                    # :data:`fencing._runtime.bridge.CALLER`) this work is not: its writes wait for
                    # the caller's locks like anyone's, and are not refused as the caller's own
                    bridge.CALLER.set(None)
                    await greenlet_spawn(self._run)

                self._running = asyncio.get_running_loop().create_task(run())
            else:
                thread = threading.Thread(target=self._run, name=f"fencing-{self.name}", daemon=True)
                self._running = thread
                thread.start()

    def running(self) -> bool:
        """Whether a run started here is still on its way."""
        running = self._running
        if running is None:
            return False
        if isinstance(running, threading.Thread):
            return running.is_alive()  # False in a forked child: the thread is the parent's
        return not running.done()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the sync store's run (tests, shutdown); the async store's is :meth:`task`."""
        running = self._running
        if isinstance(running, threading.Thread):
            running.join(timeout)

    def task(self) -> Any:
        """The async store's running task, or ``None``."""
        running = self._running
        return None if running is None or isinstance(running, threading.Thread) else running

    def _run(self) -> None:
        while True:
            try:
                self._work()
            except Exception:  # a bug, or the engine disposed under it: said, never a traceback
                logger.exception("the store's background %s failed", self.name)
            with self._lock:
                if not self._again:
                    return
                self._again = False
