"""Waking a waiting claim the moment this process makes a job ready.

A claim that waits for work (``claim_next(..., wait=seconds)``) and finds none ready looks
again with backoff, at most :data:`fencing._store.batches.WAIT_POLL` seconds apart, and at
the instant the next deferred job (or the next lease to run out) comes due. Between looks it
listens to its jobs table's *bell* in this process: every store of this process that makes a
job of that table ready in a transaction of its own (an enqueue, a release without delay, a
revoke, a requeue) rings it after the commit, and each waiter looks at once. So a worker
woken by an enqueue of the same process starts within a claim's time; a job enqueued by
another process, or in a caller's own transaction, is seen at the next look.

What it costs an enqueue: one dictionary lookup when nobody waits, a set's walk when someone
does. A bell is keyed by the database's identity and the table (as the fenced blocks' holds
are, :mod:`fencing._runtime.holds`), so two engines on one database share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref

from .._runtime import bridge
from .._runtime.holds import Key
from .wakeups import Listener, _TaskListener, _ThreadListener

__all__ = ["ever_waited", "listen", "ring"]


class _Bell:
    """The waiting claims of one jobs table in this process. Held weakly: a waiter dropped
    without :meth:`Listener.close` waits no more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: weakref.WeakSet[Listener] = weakref.WeakSet()

    def subscribe(self) -> Listener:
        listener: Listener = _LoopListener(self) if bridge.in_bridge() else _ThreadListener(self, "", "")
        with self._lock:
            self._listeners.add(listener)
        return listener

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def ring(self) -> None:
        with self._lock:
            found = list(self._listeners)
        for listener in found:
            listener._freed()


class _LoopListener(_TaskListener):
    """A waiting task's subscription, rung from any thread: the event is set on its loop."""

    def __init__(self, bell: _Bell) -> None:
        super().__init__(bell, "", "")
        self._loop = asyncio.get_running_loop()

    def _freed(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits there any more
            self._loop.call_soon_threadsafe(self._event.set)


_lock = threading.Lock()
_BELLS: dict[Key, _Bell] = {}


def listen(key: Key) -> Listener:
    """A subscription to the bell of ``key`` (a database and a jobs table): a thread's, or
    on the async front (inside asyncio's bridge) a task's on the running loop."""
    with _lock:
        bell = _BELLS.get(key)
        if bell is None:
            bell = _BELLS[key] = _Bell()
    return bell.subscribe()


def ever_waited() -> bool:
    """Whether a claim of this process has ever waited (a bell exists to ring)."""
    return bool(_BELLS)


def ring(key: Key) -> None:
    """Wake every claim of this process waiting on ``key``'s jobs: one may be ready now."""
    bell = _BELLS.get(key)
    if bell is not None:
        bell.ring()
