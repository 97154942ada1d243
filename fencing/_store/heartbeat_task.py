"""Keep one lease alive from an asyncio task: :class:`fencing.Heartbeat` for async code.

:class:`AsyncHeartbeat` keeps the same promises as :class:`~fencing.Heartbeat`, by the very
same rules (:class:`fencing._store.heartbeat.LeaseReckoning`): it renews every ``interval``
(default ``ttl / 3``) in a task of the running loop, keeps the same conservative local
deadline (``time.monotonic()`` read before sending the last successful renewal, plus
``ttl``, less the margin for the database clock's resolution), never revives a lost lease,
and says the moment the lease is gone: ``held`` turns ``False``, ``lost`` (an
``asyncio.Event``) is set, ``reason`` and ``error`` say why and :meth:`check` raises
:class:`~fencing.LeaseLost`. Only the waiting differs: the task waits with
``asyncio.wait_for`` and awaits the store, so the loop is never blocked.

The store is a :class:`fencing.asyncio.AsyncJobStore` (or any object with coroutine methods
``renew(lease, *, ttl, now)`` and ``release(lease)``)::

    async with AsyncHeartbeat(store, lease, ttl=30) as hb:
        await do_the_work()
        hb.check()  # LeaseLost once the lease can no longer be vouched for
        async with store.fenced(hb.lease, complete=True, result="done") as conn:
            await conn.execute(...)

**Fenced blocks.** Inside ``async with store.fenced(hb.lease)`` (in any task of this process)
the block extends the lease by the heartbeat's ``ttl`` when it begins and the heartbeat sends
nothing while the block holds the row; :meth:`stop` inside the block returns at once, and a
block that completes the job ends the heartbeat quietly (``held`` is ``False``, ``lost`` is
not set). Starting a heartbeat inside a block of the same task on its own lease is refused.

**Cancellation.** Cancelling the task that uses the heartbeat (inside ``async with``) stops
the heartbeat's task before the cancellation goes on (and releases the lease if
``release_on_error``, as any other error of the block would). Cancelling the heartbeat's own
task without :meth:`stop` ends the renewals, so the lease is recorded as lost at once (reason:
the task was cancelled). No task is left behind either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect

from .rules import AsyncLeaseKeeper, LeaseReckoning, logger
from .steps import adrive

__all__ = ["AsyncHeartbeat", "AsyncLeaseKeeper"]  # the keeper protocol is defined with the rules


class AsyncHeartbeat(LeaseReckoning[AsyncLeaseKeeper, asyncio.Event]):
    """Renews ``lease`` every ``interval`` seconds (default ``ttl / 3``) in an asyncio task.

    The arguments, ``clock`` and the flags are :class:`~fencing.Heartbeat`'s. :meth:`start`
    (or ``async with``) renews once in the calling task and raises :class:`LeaseLost` if that
    renewal is refused; then a task of the running loop renews. ``on_lost(heartbeat)`` is
    called at most once, from that task, when it observes the loss; if it returns an
    awaitable, that is awaited there; an exception it raises is logged, never propagated.

    Leaving ``async with`` stops the task (:meth:`stop`); the lease is then released if
    ``release_on_exit``, or if the block raised (or was cancelled) and ``release_on_error``.
    ``held``, ``lease``, ``reason`` and :meth:`check` may be read from any thread; ``lost``
    is set on the loop.
    """

    _runner = "task"
    _store_kind = "a fencing.asyncio.AsyncJobStore"
    _awaits = True

    _loop: asyncio.AbstractEventLoop | None = None  # the running loop, from start() on
    _task: asyncio.Task[None] | None = None  # once started

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task that renews (``None`` before :meth:`start`)."""
        return self._task

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> AsyncHeartbeat:
        """Renew once now, then keep renewing in a task of the running loop; a second start
        is an error.

        Raises :class:`LeaseLost` if this first renewal is refused, and lets a database error
        from it propagate (no task is started then, and the heartbeat is spent).
        """
        self._loop = asyncio.get_running_loop()
        await adrive(self._start_rules())
        self._task = self._loop.create_task(self._run(), name=f"fencing-heartbeat-{self._lease.job_id:.40}")
        return self

    async def stop(self) -> None:
        """Stop renewing and wait for the task to end (only a renewal already in flight delays it).

        Idempotent; safe before :meth:`start` and from ``on_lost``. The lease is not released.
        If the caller is cancelled while it waits, the task is cancelled too.
        """
        self._stop()
        task = self._task
        if task is None or task is asyncio.current_task():
            return
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()  # never leave the heartbeat's task behind its user
            raise

    async def __aenter__(self) -> AsyncHeartbeat:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        try:
            await self.stop()
        finally:
            if self._releases_on_exit(exc_type):
                await adrive(self._release_rules())

    # -- the heartbeat task -------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await adrive(self._beat_rules(), wake=self._wake)
        except asyncio.CancelledError:
            if not self._stopping:  # nothing renews any more: the lease cannot be vouched for
                self._lose("the heartbeat's task was cancelled", None)
            raise
        except Exception as exc:  # the loss is the report
            self._lose(f"the heartbeat failed: {exc!r}", exc)
        finally:
            self._forget()
            if self._gone:
                await self._report_lost()

    def _new_event(self) -> asyncio.Event:
        return asyncio.Event()

    def _signal(self, event: asyncio.Event) -> None:
        """``event.set()`` on the heartbeat's loop, whichever thread notices."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is not None and here is not loop:
            with contextlib.suppress(RuntimeError):  # a closed loop has no waiters left
                loop.call_soon_threadsafe(event.set)
                return
        event.set()

    async def _report_lost(self) -> None:
        self._log_lost()
        try:
            reported = self._call_on_lost()
            if inspect.isawaitable(reported):
                await reported
        except Exception:
            logger.exception("on_lost raised for %r", self)
