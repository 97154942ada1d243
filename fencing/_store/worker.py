"""Run a function for each job: the worker runtime, on threads.

:class:`Worker` is the loop every user of a lease library otherwise writes, and where the
duplicate-execution bugs of job queues live: claim, keep the lease alive, run, store the
result fenced, retry or give up, stop cleanly. Each of its ``concurrency`` slots is a thread
that does, job after job:

1. **claim** (``claim_next(..., wait=)``: woken by an enqueue, :mod:`.bell`), with the job's
   payload in the same round trip;
2. **run** ``function(job)`` under a :class:`~fencing.Heartbeat` that renews the lease every
   ``ttl / 3``; a lease that is lost meanwhile sets ``job.lost`` (which the function may poll,
   or :meth:`Job.check`), and its completion is refused by the store anyway;
3. **complete** with what the function returned (a ``str`` as it is, ``None``, or anything
   else JSON-encoded), and claim the slot's next job in the same transaction
   (``complete_and_claim_next``: one round trip per job); or, if the function raised,
   **release** the job with the failure (the exception's type, message and traceback, kept
   if the store has a failures table) and a delay of ``retry_delay * 2**(attempt-1)``, capped
   at ``max_retry_delay``, each with equal jitter; the attempt that reaches
   ``max_attempts`` leaves the job poisoned (``claim_next`` skips it from then on).

A function may instead write into the application's own tables in the completion's own
transaction: ``with job.completing(result) as conn:`` (a fenced block that completes the job,
:meth:`~fencing.JobStore.fenced`); the worker then stores nothing more.

**Stopping** (:meth:`Worker.stop`, or SIGTERM/SIGINT while :meth:`Worker.run` runs on the
main thread): the slots claim nothing more; running jobs have ``drain`` seconds to finish,
their leases kept alive meanwhile; then the unfinished ones are handed back (released, so
another worker starts them at once) and their ``job.lost`` is set. A second signal (or
``stop(now=True)``) hands back at once. :meth:`run` returns once every job is completed or
handed back; a function still running then finishes in its (daemon) thread, and whatever it
stores is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .._errors import InvalidArgument, InvalidArgumentType, LeaseLost
from .._sql.checks import check_count
from .._sql.payloads import encode_payload
from .._sql.values import Lease
from .heartbeat import Heartbeat, Keeper
from .jobstore import JobStore

__all__ = ["Job", "Worker"]

logger = logging.getLogger("fencing.worker")

_COMPLETION_FAILED = "job %r: its completion failed (its lease runs out: it runs again)"
#: the longest a slot's idle claim waits before it looks whether the worker stops (seconds)
IDLE_WAIT = 1.0


class Job:
    """One job as the worker's function sees it: ``job_id``, ``payload`` (its arguments),
    ``attempt`` (its fence: the how-manieth claim of the job), :attr:`lease` (the current one,
    renewed by the worker), ``lost`` (a :class:`threading.Event` set once the lease can no
    longer be vouched for, or the worker handed the job back) and ``store``."""

    def __init__(self, store: JobStore, heartbeat: Heartbeat, lost: threading.Event) -> None:
        lease = heartbeat.lease
        self.store = store
        self.job_id = lease.job_id
        self.payload: Any = lease.payload
        self.attempt = lease.fence
        self._heartbeat = heartbeat
        #: set once the lease is lost or handed back: stop, nothing will be stored
        self.lost = lost
        #: the function completed the job itself (:meth:`completing`)
        self.completed = False

    @property
    def lease(self) -> Lease:
        """The job's lease as last renewed."""
        return self._heartbeat.lease

    def check(self) -> None:
        """Raise :class:`~fencing.LeaseLost` if the lease is lost or the job handed back."""
        if self.lost.is_set():
            raise LeaseLost(f"job {self.job_id!r}: its lease is lost or the worker handed it back")
        self._heartbeat.check()

    @contextlib.contextmanager
    def completing(self, result: Any = None, *, conn: Any = None) -> Iterator[Any]:
        """A fenced block that completes the job with ``result`` at its end, in the same
        transaction as the block's own writes (``conn``: yours, or the store's own);
        :class:`~fencing.LeaseLost` and nothing written if the lease is no longer current.
        The worker then stores nothing more for this job."""
        text = _as_result(result)
        with self.store.fenced(self.lease, complete=True, result=text, conn=conn) as connection:
            yield connection
        self.completed = True


class Worker:
    """Runs ``function(job)`` for each job of ``store``, ``concurrency`` at a time.

    ``ttl``: each lease's length (renewed every ``ttl / 3`` while the function runs);
    ``max_attempts``: how many claims a job gets before it is left poisoned; ``retry_delay``
    and ``max_retry_delay``: the backoff of a failed job's next attempt (seconds); ``drain``:
    how long running jobs may take to finish once the worker stops; ``owner``: the name its
    leases carry (default: host, process id and a random part), each slot's ``owner-N``.
    Everything is checked here: a bad argument raises before anything runs.
    """

    def __init__(
        self,
        store: JobStore,
        function: Callable[[Job], Any],
        *,
        concurrency: int = 1,
        ttl: float = 30.0,
        max_attempts: int = 5,
        retry_delay: float = 1.0,
        max_retry_delay: float = 300.0,
        drain: float = 30.0,
        owner: str | None = None,
    ) -> None:
        if not isinstance(store, JobStore):
            raise InvalidArgumentType(f"store must be a fencing.JobStore, got {type(store).__name__}")
        if not callable(function):
            raise InvalidArgumentType(
                f"function must be callable, got {type(function).__name__} {function!r}"
            )
        self.store = store
        self.function = function
        self.concurrency = check_count("concurrency", concurrency)
        self.max_attempts = check_count("max_attempts", max_attempts)
        self.ttl = _seconds("ttl", ttl, positive=True)
        self.retry_delay = _seconds("retry_delay", retry_delay)
        self.max_retry_delay = _seconds("max_retry_delay", max_retry_delay)
        self.drain = _seconds("drain", drain)
        owner = owner if owner is not None else f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.owner = store.check_key(owner, name="owner")
        self._keeps_failures = store._ctx.failures is not None
        self._stopping = threading.Event()
        self._hand_back = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[str, tuple[Job, Heartbeat]] = {}
        self._slots: list[threading.Thread] = []

    # -- life cycle ----------------------------------------------------------------------------

    def run(self, *, handle_signals: bool | None = None) -> None:
        """Work until :meth:`stop` (or SIGTERM/SIGINT), then drain; returns once every job
        is completed or handed back. ``handle_signals``: install the signal handlers (default:
        when called on the main thread); the previous handlers are put back on return."""
        if self._slots:
            raise InvalidArgument("this worker has run already: make a new one")
        if handle_signals is None:
            handle_signals = threading.current_thread() is threading.main_thread()
        previous = self._install_signals() if handle_signals else {}
        try:
            logger.info("worker %s: %d slot(s) on %r", self.owner, self.concurrency, self.store)
            self._slots = [
                threading.Thread(
                    # a daemon: a function that outlives its handed-back job does not keep the process
                    target=self._slot,
                    args=(f"{self.owner}-{n}",),
                    name=f"fencing-slot-{n}",
                    daemon=True,
                )
                for n in range(self.concurrency)
            ]
            for slot in self._slots:
                slot.start()
            self._stopping.wait()
            self._drain()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        logger.info("worker %s stopped", self.owner)

    def stop(self, *, now: bool = False) -> None:
        """Claim nothing more and let running jobs finish within ``drain`` seconds (``now``:
        hand them back at once). Safe from any thread and from a signal handler."""
        if now:
            self._hand_back.set()
        self._stopping.set()

    @property
    def running(self) -> list[str]:
        """The ids of the jobs running now."""
        with self._lock:
            return list(self._running)

    def _install_signals(self) -> dict[int, Any]:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            first = not self._stopping.is_set()
            logger.warning(
                "worker %s: %s: %s", self.owner, signal.Signals(signum).name,
                f"draining (up to {self.drain:g} s; again: hand back now)" if first else "handing back now",
            )  # fmt: skip
            self.stop(now=not first)

        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
        return previous

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain
        for slot in self._slots:
            while slot.is_alive() and not self._hand_back.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                slot.join(min(left, 0.05))
        with self._lock:
            unfinished = list(self._running.values())
        for job, heartbeat in unfinished:
            self._give_back(job, heartbeat)
        # an idle slot ends within its claim's wait (giving back what it claimed meanwhile);
        # one whose function still runs after its job was handed back is left to it
        ends = time.monotonic() + IDLE_WAIT + 1.0
        for slot in self._slots:
            slot.join(max(0.0, ends - time.monotonic()))

    def _give_back(self, job: Job, heartbeat: Heartbeat) -> None:
        job.lost.set()
        heartbeat.stop()
        if heartbeat.held:
            self._handed_back(heartbeat.lease, self.store.release(heartbeat.lease), "still running")

    def _handed_back(self, lease: Lease, released: object, when: str) -> None:
        logger.warning(
            "job %r handed back %s (attempt %d): %s", lease.job_id, when, lease.fence,
            "another worker may start it now" if released else f"the release was refused: {released}",
            extra={"job_id": lease.job_id, "fence": lease.fence},
        )  # fmt: skip

    # -- a slot --------------------------------------------------------------------------------

    def _slot(self, owner: str) -> None:
        keeper = Keeper(f"fencing-heartbeat-{owner:.40}")
        try:
            self._work(owner, keeper)
        finally:
            keeper.close()

    def _work(self, owner: str, keeper: Keeper) -> None:
        store = self.store
        leases: list[Lease] = []
        claimed_at = 0.0  # time.monotonic() before the claim that returned ``leases``
        while True:
            if self._stopping.is_set():
                for lease in leases:  # claimed as it stopped: back at once, never started
                    self._handed_back(lease, store.release(lease), "before it started")
                return
            if not leases:
                claimed_at = time.monotonic()
                try:
                    leases = store.claim_next(
                        owner, ttl=self.ttl, max_attempts=self.max_attempts, wait=IDLE_WAIT
                    )
                except Exception:
                    logger.exception("worker slot %s: a claim failed; trying again", owner)
                    self._stopping.wait(IDLE_WAIT)
                continue
            [lease] = leases
            completion = self._run_one(lease, claimed_at, keeper)
            leases = []
            if completion is None:
                continue
            if self._stopping.is_set():
                self._complete(completion)
                continue
            claimed_at = time.monotonic()
            try:  # this job's completion and the slot's next claim: one transaction
                accepted, leases = store.complete_and_claim_next(
                    [completion], owner, ttl=self.ttl, max_attempts=self.max_attempts
                )
            except Exception:
                logger.exception(_COMPLETION_FAILED, lease.job_id)
                continue
            self._judged(completion[0], accepted[0])

    def _run_one(self, lease: Lease, claimed_at: float, keeper: Keeper) -> tuple[Lease, str | None] | None:
        """Run the function for ``lease``'s job; the completion to store, or ``None`` (failed,
        lost, handed back or completed by the function itself: nothing more to store)."""
        lost = threading.Event()
        heartbeat = Heartbeat(
            self.store,
            lease,
            self.ttl,
            on_lost=lambda _: lost.set(),
            release_on_error=False,
            claimed_at=claimed_at,
        )
        job = Job(self.store, heartbeat, lost)
        try:
            heartbeat._start_kept(keeper)
        except LeaseLost:
            logger.warning("job %r: lease lost before it started", lease.job_id)
            return None
        with self._lock:  # stopping: what the drain does not see running it never starts
            stopping = self._stopping.is_set()
            if not stopping:
                self._running[lease.job_id] = (job, heartbeat)
        if stopping:
            heartbeat.stop()
            self._handed_back(lease, self.store.release(lease), "before it started")
            return None
        started = time.perf_counter()
        try:
            value = self.function(job)
            result = None if job.completed else _as_result(value)
        except BaseException as exc:  # SystemExit too: a slot that died of it would be lost silently
            heartbeat.stop()
            self._forget(job)
            self._failed(job, heartbeat, exc, time.perf_counter() - started)
            return None
        heartbeat.stop()
        self._forget(job)
        took = time.perf_counter() - started
        if job.completed:
            logger.info(
                "job %r done in %.3f s (attempt %d), in its own transaction", job.job_id, took, job.attempt
            )
            return None
        if job.lost.is_set():
            logger.warning(
                "job %r returned after its lease was lost or handed back (%s): its result is not stored",
                job.job_id, heartbeat.reason or "handed back",
            )  # fmt: skip
            return None
        logger.info("job %r ran in %.3f s (attempt %d)", job.job_id, took, job.attempt)
        return heartbeat.lease, result

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._running.pop(job.job_id, None)

    def _complete(self, completion: tuple[Lease, str | None]) -> None:
        try:
            self._judged(completion[0], self.store.complete(*completion))
        except Exception:
            logger.exception(_COMPLETION_FAILED, completion[0].job_id)

    def _judged(self, lease: Lease, accepted: object) -> None:
        if not accepted:
            logger.warning("job %r: its result was refused: %s", lease.job_id, accepted)

    def _failed(self, job: Job, heartbeat: Heartbeat, exc: BaseException, took: float) -> None:
        if job.lost.is_set():
            logger.warning("job %r failed after its lease was lost: %r (not recorded)", job.job_id, exc)
            return
        last = job.attempt >= self.max_attempts
        delay = None if last else self._retry_delay(job.attempt)
        try:
            failure = _failure_text(exc) if self._keeps_failures else None  # (a store without: the log only)
            released = self.store.release(heartbeat.lease, delay=delay, failure=failure)
        except Exception:
            logger.exception("job %r: could not release it after a failure (its lease runs out)", job.job_id)
            return
        if not released:
            logger.warning("job %r failed (%r) and its release was refused: %s", job.job_id, exc, released)
        elif last:
            logger.error(
                "job %r failed in %.3f s on its last attempt (%d of %d), poisoned: %r",
                job.job_id, took, job.attempt, self.max_attempts, exc,
                extra={"job_id": job.job_id, "fence": job.attempt},
            )  # fmt: skip
        else:
            logger.warning(
                "job %r failed in %.3f s (attempt %d of %d), retried in %.1f s: %r",
                job.job_id, took, job.attempt, self.max_attempts, delay, exc,
                extra={"job_id": job.job_id, "fence": job.attempt},
            )  # fmt: skip

    def _retry_delay(self, attempt: int) -> float:
        """Exponential, capped, with equal jitter (a random point in the upper half)."""
        span = min(self.max_retry_delay, self.retry_delay * 2.0 ** min(attempt - 1, 60))
        return random.uniform(span / 2, span)


def _as_result(value: Any) -> str | None:
    """What a function returned, as the result column keeps it: a ``str`` as it is, ``None``,
    anything else as JSON (refused, as a failure of the job, if it would not read back)."""
    if value is None or isinstance(value, str):
        return value
    return encode_payload(value)


def _failure_text(exc: BaseException) -> str:
    """The exception's type, message and traceback, as every database's text column keeps it
    (a NUL or a lone surrogate written as its escape)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def _seconds(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentType(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if not (seconds > 0 if positive else seconds >= 0) or seconds == float("inf"):
        bound = "> 0" if positive else ">= 0"
        raise InvalidArgument(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds
