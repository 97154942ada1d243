"""Waking a waiting claim the moment a job is made ready: by this process at once, by
another through the database's notifications where it has them.

A claim that waits for work (``claim_next(..., wait=seconds)``) and finds none ready looks
again with backoff, at most :data:`fencing._store.batches.WAIT_POLL` seconds apart, and at
the instant the next deferred job (or the next lease to run out) comes due. Between looks it
listens to its jobs table's *bell* in this process: every store of this process that makes a
job of that table ready in a transaction of its own (an enqueue, a release without delay, a
revoke, a requeue) rings it after the commit, and each waiter looks at once.

On PostgreSQL (with a driver that hears notifications, :func:`fencing._store.wakeups.listen`)
the same waiter also listens on the table's channel through its process's one listening
connection, and an enqueue of any process (in a transaction of its own or the caller's, at its
commit) notifies it (:mod:`.announcer` says when an enqueue does). On SQLite every commit of
another connection to the file wakes it (:class:`fencing._store.wakeups._FileWatch`), and it
reads whether a job is due before it claims. Anything else (MariaDB, a release by another
process on PostgreSQL) is seen at the next look.

What it costs an enqueue: one dictionary lookup when nobody waits in this process, a set's
walk when someone does. A bell is keyed by the database's identity and the table (as the
fenced blocks' holds are, :mod:`fencing._runtime.holds`), so two engines on one database share
it.
"""

from __future__ import annotations

import threading
from typing import Any

from .._runtime.holds import Key
from .wakeups import Listener, listener_here

__all__ = ["Subscription", "ever_waited", "listen", "ring"]


class Subscription:
    """One waiting claim's ear: its listener (its own, or its process's listening
    connection's), which the bell of its table also rings. :meth:`wait` (a thread) and
    :meth:`wait_async` (a task) as :class:`~fencing._store.wakeups.Listener`'s; :meth:`close`
    leaves both (idempotent)."""

    def __init__(self, bell: _Bell, listener: Listener) -> None:
        self._bell = bell
        self.listener = listener

    def wait(self, seconds: float) -> bool:
        return self.listener.wait(seconds)

    async def wait_async(self, seconds: float) -> bool:
        return await self.listener.wait_async(seconds)

    def rung(self) -> None:
        self.listener._freed()  # from any thread: a task's listener sets its event on its loop

    def close(self) -> None:
        self._bell.leave(self)
        self.listener.close()


class _Bell:
    """The waiting claims of one jobs table in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[Subscription] = set()

    def join(self, listener: Listener) -> Subscription:
        subscription = Subscription(self, listener)
        with self._lock:
            self._waiting.add(subscription)
        return subscription

    def leave(self, subscription: Subscription) -> None:
        with self._lock:
            self._waiting.discard(subscription)

    def ring(self) -> None:
        with self._lock:
            found = list(self._waiting)
        for subscription in found:
            subscription.rung()


class _OwnListener:
    """What a waiter that hears no notifications listens with: its own event only."""

    def unsubscribe(self, listener: Any) -> None:
        pass


_lock = threading.Lock()
_BELLS: dict[Key, _Bell] = {}
_OWN = _OwnListener()


def listen(key: Key, heard: Listener | None = None) -> Subscription:
    """A subscription to the bell of ``key`` (a database and a jobs table): through
    ``heard`` (a listener of the process's listening connection) if given, else a
    listener of its own (a thread's, or on the async front, inside asyncio's bridge, a
    task's on the running loop)."""
    with _lock:
        bell = _BELLS.get(key)
        if bell is None:
            bell = _BELLS[key] = _Bell()
    return bell.join(heard or listener_here(_OWN, "", ""))


def ever_waited() -> bool:
    """Whether a claim of this process has ever waited (a bell exists to ring)."""
    return bool(_BELLS)


def ring(key: Key) -> None:
    """Wake every claim of this process waiting on ``key``'s jobs: one may be ready now."""
    bell = _BELLS.get(key)
    if bell is not None:
        bell.ring()
