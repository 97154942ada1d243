"""Steps, and the two drivers that carry them out: one on a thread, one in an asyncio task.

The library's waiting loops (a heartbeat's renewals, an election's campaign, a lock's wait)
are written once, as *rules*: generators of steps (:class:`Send` a call, :class:`Wait` until
an instant) that do no waiting and no I/O of their own. Each step is sent its answer, or
thrown what it raised; what the rules return is the driver's answer. :func:`drive` carries
rules out on this thread, :func:`adrive` in the running task; nothing else steps them.

:func:`run` is how a task runs the sync rules' own code (SQLAlchemy's bridge,
``greenlet_spawn``) to its end: the async fronts' every operation, and :func:`adrive`'s
``local`` calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from .._runtime import bridge, holds
from .._runtime.private_sqlalchemy import greenlet_spawn

__all__ = ["Rules", "Send", "Step", "Wait", "adrive", "drive", "run", "to_its_end"]

#: a listener's failure is told where a lock's waiter would look for it
logger = logging.getLogger("fencing.locks")

T = TypeVar("T")


@dataclass(frozen=True)
class Send:
    """Call ``call`` and answer what it returns (or throw what it raises back into the rules).

    ``local=False``: on a thread a plain call; in a task ``call()`` is awaited if it returns an
    awaitable (an async store's method returns a coroutine). ``local=True``: the call is the
    sync rules' own code (a store's statements, a look into :mod:`fencing._runtime.holds`),
    which a task runs inside SQLAlchemy's bridge (:func:`run`), where its holds are told apart.
    ``undo``: what gives back what a local call made (its answer passed) when the task that
    asked was cancelled while it ran: the call goes on to its end, so its answer, a waiter's
    ticket or a lock's lease say, would otherwise be lost."""

    call: Callable[[], object]
    local: bool = False
    undo: Callable[[Any], object] | None = None


@dataclass(frozen=True)
class Wait:
    """Wait until ``until`` (``time.monotonic()``); answered ``None`` (the rules read their own
    flags for why it ended).

    ``hold``: a fenced block of this process holds the lease's row; a change in
    :mod:`fencing._runtime.holds` may end the wait early (the rules look again). ``wake``: a
    :class:`fencing._store.wakeups.Listener` whose notification may end it early too."""

    until: float
    hold: bool = False
    wake: Any = None


Step = Send | Wait
#: rules: a generator of steps, each sent its answer (or thrown its exception)
Rules = Generator[Step, Any, T]


def drive(rules: Rules[T], *, wake: threading.Event | None = None) -> T:
    """Carry out ``rules`` on this thread; what they return.

    Guarantees: every :class:`Send` is called here, in order, and its answer sent back; what
    it raises (any ``BaseException``) is thrown into the rules, which decide (retry, clean up,
    or let it go on up out of this call). A :class:`Wait` sleeps until its instant, and ends
    early when ``wake`` is set (it is cleared as every wait ends, so set it after the flag the
    rules read), when a hold of this process changes (``hold``: these waits do not watch
    ``wake``) or when its listener hears the lock freed; a listener that fails is logged and
    the wait goes on asleep."""
    try:
        step = next(rules)
        while True:
            try:
                answer = step.call() if isinstance(step, Send) else _sleep(step, wake)
            except BaseException as exc:  # the rules decide: retry, or let it through
                step = rules.throw(exc)
            else:
                step = rules.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _sleep(step: Wait, wake: threading.Event | None) -> object:
    """Wait out ``step`` on this thread: its answer (``None``)."""
    left = max(0.0, step.until - time.monotonic())
    if step.hold:
        holds.wait_for_change(left)
    elif step.wake is not None:
        try:
            step.wake.wait(left)
        except Exception:
            logger.debug("a listening connection failed; waiting by backoff", exc_info=True)
            time.sleep(max(0.0, step.until - time.monotonic()))
    elif wake is not None:
        wake.wait(left)
    else:
        time.sleep(left)
    if wake is not None:
        wake.clear()
    return None


async def adrive(rules: Rules[T], *, wake: asyncio.Event | None = None) -> T:
    """Carry out ``rules`` in the running task; what they return.

    Guarantees: a :class:`Send` is awaited in order, and its answer sent back; a local one
    runs inside the bridge to its end (:func:`run`): a cancellation of this task meanwhile
    waits for it, gives its answer to ``undo``, then is thrown into the rules, as is anything
    a call raises (the rules decide). A :class:`Wait` sleeps on the loop until its instant,
    and ends early when ``wake`` is set (cleared as every wait ends, so set it after the flag
    the rules read) or when its listener hears the lock freed (a listener that fails is
    logged and the wait goes on asleep); a ``hold`` is polled, as a block's end does not
    tell the loop. The loop is never blocked."""
    try:
        step = next(rules)
        while True:
            try:
                answer = await (_call(step) if isinstance(step, Send) else _nap(step, wake))
            except BaseException as exc:  # the rules decide (a cancellation among them)
                step = rules.throw(exc)
            else:
                step = rules.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def _call(step: Send) -> object:
    if step.local:
        undo = step.undo
        return await run(step.call, give_back=None if undo is None else lambda made: run(undo, made))
    answer = step.call()
    return await answer if inspect.isawaitable(answer) else answer


async def _nap(step: Wait, wake: asyncio.Event | None) -> object:
    """Wait out ``step`` in this task: its answer (``None``)."""
    left = max(0.0, step.until - time.monotonic())
    if step.wake is not None:
        try:
            await step.wake.wait_async(left)
        except Exception:
            logger.debug("a listening connection failed; waiting by backoff", exc_info=True)
            await asyncio.sleep(max(0.0, step.until - time.monotonic()))
    elif wake is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), left)
        wake.clear()
    else:
        await asyncio.sleep(left)
    return None


# -- the sync rules' code, from a task ----------------------------------------------------------


async def run(
    fn: Callable[..., T],
    *args: Any,
    give_back: Callable[[T], Awaitable[object]] | None = None,
    **kwargs: Any,
) -> T:
    """``fn(*args, **kwargs)``: the sync rules on the async driver (SQLAlchemy's bridge),
    always run to their end (committed or rolled back).

    A cancellation of the caller (``task.cancel()``, ``asyncio.timeout``) waits for the
    operation to end, then goes on as ``CancelledError``; what the operation took for a caller
    who is no longer there (``give_back``: the leases of a claim) is given back first. Why:
    a cancellation delivered inside a driver call makes SQLAlchemy invalidate the connection
    mid-transaction, and aiosqlite's thread then keeps that transaction, and SQLite's write
    lock, open. An operation is short (its lock waits are bounded by the engine's), so the
    cancellation takes effect at its boundary instead."""
    task, cancelled = await to_its_end(fn, *args, **kwargs)
    result = task.result()
    if cancelled:
        if give_back is not None:
            with contextlib.suppress(Exception):  # it expires at its ttl otherwise
                await asyncio.shield(give_back(result))
        raise asyncio.CancelledError
    return result


async def to_its_end(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[asyncio.Future[T], bool]:
    """Run ``fn`` in the bridge to its end whatever happens to the caller meanwhile: its
    finished task, and whether the caller was cancelled while it ran."""
    token = bridge.CALLER.set(bridge.CALLER.get() or asyncio.current_task())
    try:  # the task copies the context: its locks are the caller's (fencing._runtime.bridge)
        task = _start(greenlet_spawn(fn, *args, **kwargs))
    finally:
        bridge.CALLER.reset(token)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True  # the caller's: the operation goes on to its end
        except BaseException:
            break  # the operation's own error: the caller reads it from the task
    return task, cancelled


def _start(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """The operation's task. On Python 3.12+, on a loop that makes its tasks the default
    way, it starts eagerly: its first step runs now, inside the caller's step, up to its
    first wait on the database, instead of a turn of the loop later (nothing can cancel
    the caller in between)."""
    loop = asyncio.get_running_loop()
    if _EAGER is not None and loop.get_task_factory() is None:
        return _EAGER(loop, coro)  # type: ignore[no-any-return]
    return asyncio.ensure_future(coro)


#: asyncio's documented eager task factory (Python 3.12+)
_EAGER: Any = None
if sys.version_info >= (3, 12):
    _EAGER = asyncio.create_eager_task_factory(asyncio.Task)
