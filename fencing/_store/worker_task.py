"""Run a coroutine for each job: the worker runtime for asyncio, by the thread worker's rules
(:mod:`.worker_rules`).

:class:`AsyncWorker` keeps :class:`fencing.Worker`'s promises with tasks of one loop instead
of threads: each of its ``concurrency`` slots is a task that claims (``claim_next(...,
wait=)``, woken by an enqueue), runs ``await function(job)`` in a task of its own under an
:class:`~fencing.asyncio.AsyncHeartbeat`, then completes and claims its next job in one
transaction, or releases a failed job with its failure and a backoff delay (poisoned at
``max_attempts``).

**Loss is a cancellation.** A lease that is lost while the coroutine runs (a renewal refused,
the local deadline passed) sets ``job.lost`` and **cancels the coroutine's task**: the
``CancelledError`` arrives at its next ``await``, so a coroutine stops working on a job that is
another's without polling for it. A fenced block it is inside keeps none of its writes
(:meth:`fencing.asyncio.AsyncJobStore.fenced`); one whose ``COMMIT`` was already on its way
says so by ending normally, and the job is then completed by it.

**Stopping** (:meth:`AsyncWorker.stop`, or SIGTERM/SIGINT while :meth:`AsyncWorker.run` runs
on the main thread's loop): the slots claim nothing more; running jobs have ``drain`` seconds
to finish, their leases kept alive; then the unfinished ones are cancelled and handed back
(released, so another worker starts them at once). A second signal, ``stop(now=True)``, or
cancelling the task that awaits :meth:`~AsyncWorker.run` hands back at once.

**A timeout** (``timeout=``): a coroutine that runs past it is cancelled and given
``CANCEL_WAIT`` to end, then its job is released as a failed attempt (:mod:`.worker_rules`),
with where the coroutine was as the failure; one that ignores the cancellation runs on beside
the slot's next job, and ``job.completing()`` refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .._errors import InvalidArgument, InvalidArgumentType, LeaseLost
from .._sql.values import Lease
from . import worker_rules as rules
from .heartbeat_task import AsyncHeartbeat
from .jobstore import JobStore
from .worker_rules import Handoff, JobRules, WorkerRules, as_result, logger, stack_text

__all__ = ["AsyncJob", "AsyncWorker"]

#: how long a job's cancelled coroutine is given to end before its lease is released anyway
CANCEL_WAIT = 1.0


class AsyncJob(JobRules[asyncio.Event]):
    """One job as the worker's coroutine sees it: :class:`fencing.Job`'s ``job_id``,
    ``payload``, ``attempt``, :attr:`lease` and ``store``; ``lost`` is an
    :class:`asyncio.Event`, and the coroutine is cancelled when it is set."""

    @contextlib.asynccontextmanager
    async def completing(self, result: Any = None, *, conn: Any = None) -> AsyncIterator[Any]:
        """A fenced block that completes the job with ``result`` at its end, in the same
        transaction as the block's own writes (``conn``: your ``AsyncConnection`` or
        ``AsyncSession``, or the store's own); :class:`~fencing.LeaseLost` and nothing
        written if the lease is no longer current, or if the run passed the worker's
        ``timeout`` before the block's end. The worker then stores nothing more."""
        self._refuse_if_timed_out()
        text = as_result(result)
        async with self.store.fenced(self.lease, complete=True, result=text, conn=conn) as connection:
            yield connection
            self._refuse_if_timed_out()  # timed out inside the block: its writes roll back
        self.completed = True


class FunctionExited(Exception):
    """A job's coroutine raised ``SystemExit`` or ``KeyboardInterrupt``: a failure of the job
    (the slot goes on), which a task would otherwise raise out of the loop."""


class _Running:
    """A job whose coroutine runs: what the drain needs to hand it back."""

    __slots__ = ("heartbeat", "job", "task")

    def __init__(self, job: AsyncJob, heartbeat: AsyncHeartbeat, task: asyncio.Task[Any]) -> None:
        self.job, self.heartbeat, self.task = job, heartbeat, task


class AsyncWorker(WorkerRules[Any, Callable[[AsyncJob], Awaitable[Any]]]):
    """Runs ``await function(job)`` for each job of an
    :class:`~fencing.asyncio.AsyncJobStore`, ``concurrency`` at a time, as tasks of the loop
    that awaits :meth:`run`. The arguments and their checks are :class:`fencing.Worker`'s;
    ``function`` must be an ``async def`` function (or another callable whose call returns a
    coroutine: checked when it is called, a job failure if not). ``schedules``: a
    :class:`fencing.Scheduler`, kept on a thread of its own while the worker runs (on a sync
    :class:`fencing.JobStore` of the same database: a scheduler's passes are few);
    ``timeout``: how long a coroutine may run a job before it is cancelled and the job released
    as a failed attempt (none by default)."""

    def _front_state(self) -> None:
        self._stopping = asyncio.Event()
        self._hand_back = asyncio.Event()
        self._running: dict[str, _Running] = {}
        self._slots: list[asyncio.Task[None]] = []
        self._batches = _Batches(self._store_batch)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check_store(self, store: object) -> None:
        # the async front's store: its sync store is a JobStore and its operations coroutines
        if not (
            isinstance(getattr(store, "sync_store", None), JobStore)
            and inspect.iscoroutinefunction(getattr(store, "claim_next", None))
        ):
            hint = " (a sync store: use fencing.Worker)" if isinstance(store, JobStore) else ""
            raise InvalidArgumentType(
                f"store must be a fencing.asyncio.AsyncJobStore, got {type(store).__name__}{hint}"
            )

    def _check_function(self, function: object) -> None:
        super()._check_function(function)
        call = getattr(function, "__call__", None)  # noqa: B004 - an object with async __call__
        if not (inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)):
            raise InvalidArgumentType(
                f"function must be an async def function, got {function!r:.80}"
                " (a sync function: use fencing.Worker)"
            )

    # -- life cycle ----------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool | None = None) -> None:
        """Work until :meth:`stop` (or SIGTERM/SIGINT), then drain; returns once every job
        is completed or handed back. ``handle_signals``: install the loop's signal handlers
        (default: when the loop runs on the main thread, and the platform has them); the
        previous handlers are put back on return. Cancelling the task that awaits this hands
        every running job back at once, then the cancellation goes on."""
        if self._slots:
            raise InvalidArgument("this worker has run already: make a new one")
        self._loop = loop = asyncio.get_running_loop()
        if handle_signals is None:
            handle_signals = threading.current_thread() is threading.main_thread() and hasattr(
                loop, "add_signal_handler"
            )
        previous = self._install_signals(loop) if handle_signals else {}
        try:
            logger.info("worker %s: %d slot(s) on %r", self.owner, self.concurrency, self.store)
            self._slots = [
                loop.create_task(self._slot(self.owner), name=f"fencing-slot-{n}")
                for n in range(self.concurrency)
            ]
            if self.schedules is not None:
                self.schedules.start()  # a thread of its own, on its own sync store
            try:
                await self._stopping.wait()
            except asyncio.CancelledError:
                self.stop(now=True)
                await asyncio.shield(self._drain())
                raise
            finally:
                if self.schedules is not None:
                    self.schedules.stop(timeout=0)  # enqueue no more ticks while draining
            await self._drain()
        finally:
            for signum, handler in previous.items():
                loop.remove_signal_handler(signum)
                signal.signal(signum, handler)
        logger.info("worker %s stopped", self.owner)

    def stop(self, *, now: bool = False) -> None:
        """Claim nothing more and let running jobs finish within ``drain`` seconds (``now``:
        hand them back at once). Safe from any thread: from another than the loop's it is
        carried to the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                loop.call_soon_threadsafe(self._stop, now)
                return
        self._stop(now)

    def _stop(self, now: bool) -> None:
        if now:
            self._hand_back.set()
        self._stopping.set()

    @property
    def running(self) -> list[str]:
        """The ids of the jobs running now."""
        return list(self._running)

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> dict[int, Any]:
        def on_signal(signum: int) -> None:
            first = not self._stopping.is_set()
            self._signalled(signum, first)
            self._stop(not first)

        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.getsignal(signum)
            loop.add_signal_handler(signum, on_signal, signum)
        return previous

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain
        pending: set[asyncio.Task[Any]] = {s for s in self._slots if not s.done()}
        now = loop.create_task(self._hand_back.wait())
        try:
            while pending and not self._hand_back.is_set():
                left = deadline - loop.time()
                if left <= 0:
                    break
                done, _ = await asyncio.wait(
                    {*pending, now}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= done
        finally:
            now.cancel()
        await asyncio.gather(*(self._give_back(running) for running in list(self._running.values())))
        # an idle slot ends within its claim's wait (giving back what it claimed meanwhile)
        slots = [s for s in self._slots if not s.done()]
        if slots:
            _, late = await asyncio.wait(slots, timeout=rules.IDLE_WAIT + 1.0)
            for slot in late:
                slot.cancel()

    async def _give_back(self, running: _Running) -> None:
        """Cancel a job's coroutine and release its lease (unless the coroutine completed it
        as it was cancelled: a fenced block whose ``COMMIT`` was on its way)."""
        job, heartbeat, task = running.job, running.heartbeat, running.task
        job.lost.set()
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT)
        await heartbeat.stop()
        if heartbeat.held and not job.completed:
            self._handed_back(heartbeat.lease, await self.store.release(heartbeat.lease), "still running")

    # -- a slot --------------------------------------------------------------------------------

    async def _slot(self, owner: str) -> None:
        store = self.store
        leases: list[Lease] = []
        claimed_at = 0.0  # time.monotonic() before the claim that returned ``leases``
        while True:
            if self._stopping.is_set():
                for lease in leases:  # claimed as it stopped: back at once, never started
                    self._handed_back(lease, await store.release(lease), "before it started")
                return
            if not leases:
                claimed_at = time.monotonic()
                try:
                    leases = await store.claim_next(
                        owner, ttl=self.ttl, max_attempts=self.max_attempts, wait=rules.IDLE_WAIT
                    )
                except Exception:
                    logger.exception("worker slot %s: a claim failed; trying again", owner)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), rules.IDLE_WAIT)
                continue
            [lease] = leases
            completion = await self._run_one(lease, claimed_at)
            leases = []
            if completion is None:
                continue
            # this job's completion and the slot's next claim: one transaction, shared with the
            # slots that finish meanwhile (stopping: the completion alone)
            handoff = Handoff(completion, not self._stopping.is_set(), asyncio.Event())
            await self._batches.submit(handoff)
            self._judged(handoff)
            if handoff.lease is not None:
                leases, claimed_at = [handoff.lease], handoff.claimed_at

    async def _run_one(self, lease: Lease, claimed_at: float) -> tuple[Lease, str | None] | None:
        """Run the coroutine for ``lease``'s job; the completion to store, or ``None`` (failed,
        lost, handed back or completed by the coroutine itself: nothing more to store)."""
        lost = asyncio.Event()
        tasks: list[asyncio.Task[Any]] = []

        def on_lost(_: AsyncHeartbeat) -> None:  # the coroutine stops at its next await
            lost.set()
            for task in tasks:
                task.cancel()

        heartbeat = AsyncHeartbeat(
            self.store, lease, self.ttl, on_lost=on_lost, release_on_error=False, claimed_at=claimed_at
        )
        job = AsyncJob(self.store, heartbeat, lost)
        try:
            await heartbeat.start()
        except LeaseLost:
            logger.warning("job %r: lease lost before it started", lease.job_id)
            return None
        if self._stopping.is_set():  # what the drain does not see running it never starts
            await heartbeat.stop()
            self._handed_back(lease, await self.store.release(lease), "before it started")
            return None
        started = self._starts()
        task = asyncio.get_running_loop().create_task(self._call(job), name=f"fencing-job-{lease.job_id:.40}")
        tasks.append(task)
        self._running[lease.job_id] = _Running(job, heartbeat, task)
        try:
            await asyncio.wait({task}, timeout=self.timeout)
            if not task.done():  # past the timeout
                job.timed_out = True
                self._running.pop(lease.job_id, None)  # the drain does not hand it back as well
                await self._time_out(job, heartbeat, task, started)
                return None
        except asyncio.CancelledError:  # the slot itself is cancelled: so is its job
            task.cancel()
            raise
        finally:
            self._running.pop(lease.job_id, None)
        took = self._ran(started)
        await heartbeat.stop()
        if task.cancelled():
            self._cancelled(job, took, heartbeat.reason)
            return None
        exc = task.exception()
        if exc is not None:
            await self._failed(job, heartbeat, exc, took)
            return None
        if not self._worth_storing(job, took, heartbeat.reason):
            return None
        return heartbeat.lease, task.result()

    async def _time_out(
        self, job: AsyncJob, heartbeat: AsyncHeartbeat, task: asyncio.Task[Any], started: float
    ) -> None:
        """A job whose coroutine ran past the timeout: the coroutine cancelled first (a fenced
        block it is in keeps nothing, and frees the row the release needs), given
        ``CANCEL_WAIT`` to end, then the job released as a failed attempt. A completion of its
        own that committed first wins: the job is done."""
        took = self._ran(started)
        where = stack_text(_frames_of(task))
        job.lost.set()
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=CANCEL_WAIT)
        finally:  # the slot cancelled meanwhile (the drain's end) leaves nothing renewing it
            await heartbeat.stop()
        if not task.done():
            logger.warning(
                "job %r: its coroutine ignored its cancellation at the timeout and runs on", job.job_id
            )
            task.add_done_callback(lambda _: self._late(job, "ended"))
        elif not task.cancelled():
            task.exception()  # retrieved: what it raised or returned is not stored
        exc, last, delay, failure = self._timed_out(job, where)
        try:
            held = heartbeat.held
            released = (
                await self.store.release(heartbeat.lease, delay=delay, failure=failure) if held else None
            )
        except Exception:
            self._unreleased(job)
            return
        self._timeout_logged(job, exc, took, released, last, delay, heartbeat.reason)

    async def _call(self, job: AsyncJob) -> str | None:
        """The coroutine's run, and its value as the result column keeps it (a value that
        does not encode fails the job)."""
        coroutine = self.function(job)
        if not inspect.isawaitable(coroutine):
            raise InvalidArgumentType(
                f"the worker's function returned {type(coroutine).__name__}, not a coroutine"
                " (a sync function: use fencing.Worker)"
            )
        try:
            value = await coroutine
        except (SystemExit, KeyboardInterrupt) as exc:  # a task re-raises these out of the loop
            raise FunctionExited(f"the job's coroutine raised {exc!r}") from exc
        return None if job.completed else as_result(value)

    async def _store_batch(self, batch: list[Handoff]) -> None:
        """Store a batch's completions and claim its slots' next jobs: one transaction."""
        completions = [handoff.completion for handoff in batch]
        claims = self._batch_claims(batch)
        claimed_at = time.monotonic()
        try:
            if claims:
                accepted, leases = await self.store.complete_and_claim_next(
                    completions, self.owner, ttl=self.ttl, limit=claims, max_attempts=self.max_attempts
                )
            else:
                accepted, leases = list(await self.store.complete_many(completions)), []
        except Exception as exc:
            for handoff in batch:
                handoff.error = exc
            return
        Handoff.share(batch, accepted, leases, claimed_at)

    async def _failed(
        self, job: AsyncJob, heartbeat: AsyncHeartbeat, exc: BaseException, took: float
    ) -> None:
        plan = self._after_failure(job, exc)
        if plan is None:
            return
        last, delay, failure = plan
        try:
            released = await self.store.release(heartbeat.lease, delay=delay, failure=failure)
        except Exception:
            self._unreleased(job)
            return
        self._failure_logged(job, exc, took, released, last, delay)


def _frames_of(task: asyncio.Task[Any]) -> list[Any]:
    """Where a task's coroutine is suspended: the frame of each coroutine it awaits, outermost
    first (``Task.get_stack`` gives only the outermost one)."""
    frames = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return frames


class _Batches:
    """Group commit of the slots' finished jobs, as the thread worker's: a batch stores what
    every slot finished so far; the slots that finish while it is on its way are the next
    batch. The batches run in a task of their own (while any are queued), so a slot cancelled
    as it waits for its answer stops no other slot's batch."""

    def __init__(self, store_batch: Callable[[list[Handoff]], Awaitable[None]]) -> None:
        self._store_batch = store_batch
        self._queued: list[Handoff] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, handoff: Handoff) -> None:
        self._queued.append(handoff)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush(), name="fencing-batches")
        await handoff.ready.wait()

    async def _flush(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                try:
                    await self._store_batch(batch)
                finally:
                    for answered in batch:
                        answered.ready.set()
        finally:
            self._flusher = None
