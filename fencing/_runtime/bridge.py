"""Where the sync rules meet asyncio: waiting without blocking the loop, and who holds what.

The async store (:mod:`fencing.asyncio`) runs the very same units of work as the sync store,
through SQLAlchemy's own bridge: ``greenlet_spawn`` runs sync code on the event loop's
thread, and every driver call inside it is awaited on the loop (``await_only``). Two things
in that sync code must then behave as asyncio would:

* **Waiting.** A pause between lock races (SQLite's write lock, a server's deadlock) must
  let the loop run, or the task holding the lock (on the same loop) could never release it.
  :func:`sleep` is ``time.sleep`` on a thread and ``await asyncio.sleep`` inside the bridge.
* **Who holds a lock.** A fenced block's row lock belongs to whoever runs the block: a
  thread for sync code, the asyncio *task* inside the bridge (tasks of one loop share a
  thread, and one task's block must not refuse another task's write). :func:`holder` says
  which.

Nothing here imports greenlet unless SQLAlchemy's bridge was loaded already.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CALLER", "holder", "in_bridge", "sleep"]

#: the asyncio task that called an async front's operation: the operation itself runs in a
#: task of its own (it is run to its end even if the caller is cancelled), which holds its
#: locks for the caller
CALLER: contextvars.ContextVar[Any] = contextvars.ContextVar("fencing_caller", default=None)


def in_bridge() -> bool:
    """Whether this code runs inside SQLAlchemy's asyncio bridge (``greenlet_spawn``)."""
    if "greenlet" not in sys.modules:  # no async engine has run anything in this process
        return False
    from .private_sqlalchemy import in_greenlet

    return bool(in_greenlet())


def sleep(seconds: float, blocking: Callable[[float], None] | None = None) -> None:
    """Sleep ``seconds``: on a thread, blocking it (with ``blocking``, default
    ``time.sleep``: a caller passes its own module's, which tests may replace); inside the
    bridge, yielding to the loop."""
    if seconds < 0:
        seconds = 0.0
    if in_bridge():
        import asyncio

        from .private_sqlalchemy import await_only

        await_only(asyncio.sleep(seconds))
        return
    (blocking or time.sleep)(seconds)


def holder() -> Any:
    """Who is running this code: inside the bridge the asyncio task that called the async
    front (:data:`CALLER`) or else the current task; outside it the thread (its ident)."""
    if in_bridge():
        caller = CALLER.get()
        if caller is not None:
            return caller
        import asyncio

        task = asyncio.current_task()
        if task is not None:
            return task
    return threading.get_ident()
