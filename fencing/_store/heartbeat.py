"""Keep one lease alive from a background thread, and know the moment it is gone.

A worker holding a lease for longer than one ``ttl`` must renew it, and must stop before
anything irreversible once it can no longer vouch for it. :class:`Heartbeat` renews every
``interval`` on a daemon thread and keeps a *local deadline*: ``time.monotonic()`` read
before sending the last successful renewal, plus ``ttl``, less twice the resolution of the
database's clock when it renews on that clock (SQLite's counts milliseconds, so 2 ms there;
2 µs on PostgreSQL and MariaDB). The database computed the new ``until`` from a later
instant, read at that resolution, so (clock rates being equal) the local deadline is never
later than the real one: it is early by the round trip of the renewal plus that margin.

``held`` turns ``False`` (and ``lost`` is set) the moment a renewal is refused, a
renewal fails with an error that cannot get better, database errors last past the local
deadline, or the local deadline passes, even if the thread is blocked inside a renewal.
Once ``False`` it never turns ``True`` again: a lost lease is never revived. The loss is
logged once, when the heartbeat (its thread or task, or a refused first renewal) reports it:
a WARNING on ``fencing.heartbeat`` with ``path="heartbeat"``, ``job_id``, ``owner``,
``fence``, ``reason`` and ``error`` (the exception's repr, or ``None``); a refused renewal
has also logged its line on ``fencing.refused``, with the holder and fence it met.

**With a fenced block on the same lease** (``store.fenced(heartbeat.lease)`` while the
heartbeat runs, in any thread of this process), the block holds the job's row until its
transaction ends, so the heartbeat sends no renewal meanwhile: it waits for the block
(:mod:`fencing._runtime.holds`), and :meth:`stop` inside the block returns at once. The block itself
extends the lease by the heartbeat's ``ttl`` when it begins, so it has a whole ``ttl`` to
finish, and once it commits the heartbeat counts its deadline from there. A block that
completes the job ends the heartbeat quietly (``held`` is ``False``, ``lost`` is not set).
Starting a heartbeat inside a block on its own lease is refused at once.

**One set of rules.** :class:`LeaseReckoning` holds everything above: the lease, the
deadline and its margin, when a loss is recorded, and what to send next, written as
generators of *steps* (:class:`Send` something, :class:`Wait` until some instant) that do
no waiting and no I/O of their own. :class:`Heartbeat` carries the steps out on a thread;
:class:`fencing._store.heartbeat_task.AsyncHeartbeat` carries the very same steps out in an
asyncio task, awaiting an async store.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from types import TracebackType

from .._errors import LeaseLost
from .rules import LeaseKeeper, LeaseReckoning, logger
from .steps import drive

__all__ = ["Heartbeat", "Keeper", "LeaseKeeper", "LeaseLost"]


class Keeper:
    """One daemon thread that runs heartbeats one after the other (:meth:`Heartbeat._start_kept`):
    :meth:`run` hands it the next, :meth:`join` waits until that one has ended."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._todo: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    def run(self, target: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._idle.clear()
        self._todo.put(target)

    def join(self, timeout: float | None = None) -> None:
        if threading.current_thread() is not self._thread:  # (a heartbeat's on_lost stopping it)
            self._idle.wait(timeout)

    def close(self) -> None:
        """End the thread once it is idle (the one it runs, if any, goes on to its end)."""
        if self._thread is not None:
            self._todo.put(None)

    def _loop(self) -> None:
        while (target := self._todo.get()) is not None:
            try:
                target()  # a heartbeat's _run: it reports its own failures
            finally:
                self._idle.set()


class Heartbeat(LeaseReckoning[LeaseKeeper, threading.Event]):
    """Renews ``lease`` every ``interval`` seconds (default ``ttl / 3``) on a daemon thread.

    ``clock=None`` renews on the database server's clock (``now=None``); with a ``clock``,
    every renewal passes ``now=clock()``, and ``held`` is also ``False`` once
    ``clock() >= lease.until`` (the store's own rule: ``until == now`` is expired).

    :meth:`start` (or ``with``) renews once in the caller's thread, so the local deadline
    is measured from the start, and raises :class:`LeaseLost` if that renewal is refused.
    ``on_lost(heartbeat)`` is called at most once, from the heartbeat thread, when it
    observes the loss; an exception it raises is logged, never propagated.

    On leaving a ``with`` block the thread is stopped and joined; the lease is then released
    if ``release_on_exit``, or if the block raised and ``release_on_error`` (only while still
    held; a failing release is logged, never raised over the block's outcome).

    ``store.complete(heartbeat.lease, ...)`` may be called while it runs: a renewal then
    refused because this very lease completed the job (read back from the store's
    ``state``) ends the heartbeat quietly (``held`` is ``False``, ``lost`` is not set).
    Calling :meth:`stop` first saves that read. Stopping does not shorten the lease.

    ``claimed_at``: for a lease just claimed with this ``ttl``, ``time.monotonic()`` read
    before the claim was sent: the local deadline counts from there and :meth:`start` sends no
    renewal (the worker runtime's way: one round trip per job).
    """

    _thread: threading.Thread | Keeper | None = None  # once started

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> Heartbeat:
        """Renew once now, then keep renewing on a daemon thread; a second start is an error.

        Raises :class:`LeaseLost` if this first renewal is refused, and lets a database
        error from it propagate (no thread is started then, and the heartbeat is spent).
        """
        drive(self._start_rules())
        thread = threading.Thread(
            target=self._run, name=f"fencing-heartbeat-{self._lease.job_id:.40}", daemon=True
        )
        self._thread = thread
        try:
            thread.start()
        except BaseException:
            self._forget()
            raise
        return self

    def _start_kept(self, keeper: Keeper) -> Heartbeat:
        """:meth:`start`, its renewals carried out by ``keeper``'s thread (a worker slot's,
        reused job after job: a thread started and joined per job cost 0.8 ms of each)."""
        drive(self._start_rules())
        self._thread = keeper
        keeper.run(self._run)
        return self

    def stop(self) -> None:
        """Stop renewing and join the thread (waits only for a renewal already in flight).

        Idempotent; safe before :meth:`start` and from ``on_lost``. The lease is not released.
        """
        self._stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop()
        finally:
            if self._releases_on_exit(exc_type):
                drive(self._release_rules())

    # -- the heartbeat thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            drive(self._beat_rules(), wake=self._wake)
        except BaseException as exc:  # nothing may escape a thread; the loss is the report
            self._lose(f"the heartbeat failed: {exc!r}", exc)
        finally:
            self._forget()
        if self._gone:
            self._report_lost()

    def _new_event(self) -> threading.Event:
        return threading.Event()

    def _report_lost(self) -> None:
        self._log_lost()
        try:
            self._call_on_lost()
        except Exception:
            logger.exception("on_lost raised for %r", self)
