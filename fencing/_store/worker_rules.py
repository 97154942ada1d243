"""The worker runtime's rules, shared by the thread (:class:`fencing.Worker`) and the task
(:class:`fencing.asyncio.AsyncWorker`), as the heartbeat's and the election's are.

What is decided here is decided once for both fronts: the arguments and what a bad one gets;
what a function's return value is stored as; when a failed job is tried again (exponential
backoff, capped, with equal jitter) and when it is left poisoned; what a failure is stored as
(type, message and traceback); each line the worker logs, and what it counts on its store's
metrics. A front carries the steps out: threads and a :class:`threading.Event`, or tasks and an
:class:`asyncio.Event`.

**What a worker counts** (on ``store.metrics``, so :mod:`fencing.otel` exports it with the
store's own counters; the same on both fronts): ``worker.started`` (a function began a job),
then one outcome per started job: ``worker.completed`` (its result stored, or the function
completed the job in its own transaction), ``worker.retried`` (it raised; released with its
failure for a later attempt), ``worker.poisoned`` (it raised on its last attempt),
``worker.lost`` (its lease was lost or the job handed back while it ran: nothing of it
stored), ``worker.refused`` (the store refused its completion or its failure's release: the
lease had ended meanwhile), ``worker.unstored`` (its completion or release failed: the lease
runs out and the job runs again). Besides: ``worker.handed_back`` (a job released as the
worker stopped, running or not yet started) and ``worker.timed_out`` (a function ran past the
worker's ``timeout``: its job counts as a failure, ``worker.retried`` or ``worker.poisoned``,
and nothing it does after is stored or counted). The timing ``worker.run`` is each function's
run, from its start to its return or raise (to its timeout, for one that timed out).
``worker.started`` less the outcomes is the jobs running now.

**A timeout** (``timeout=`` seconds, none by default) bounds each run. Past it, nothing the
run returns is stored, ``job.completing()`` and ``job.check()`` refuse at once, the lease is
no longer renewed, and the job is released as a failed attempt (a ``TimeoutError`` with where
the function was, its stack, as the failure): retried with the same backoff, or poisoned on
its last attempt. A coroutine is cancelled first (a fenced block it is in keeps nothing), then
its job released. A thread cannot be stopped: ``job.lost`` is set for the function to stop, a
new slot takes the stuck one's place (the worker still runs ``concurrency`` jobs at once), and
the release is sent from a thread of its own, since it waits for the row while a fenced block
of the stuck function holds it. The database stays the judge: a completion of the run's own
that committed before the release is kept (nobody else could hold the job meanwhile), and
the release is then refused as ``done``.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import traceback
import uuid
from types import FrameType
from typing import Any, Generic, Protocol, TypeVar

from .._errors import InvalidArgument, InvalidArgumentType, LeaseLost
from .._runtime.metrics import StoreMetrics
from .._sql.checks import check_count
from .._sql.payloads import encode_payload
from .._sql.values import Lease
from .scheduler import Scheduler

__all__ = ["IDLE_WAIT", "Handoff", "JobRules", "WorkerRules", "logger", "stack_text"]

logger = logging.getLogger("fencing.worker")

#: the longest a slot's idle claim waits before it looks whether the worker stops (seconds)
IDLE_WAIT = 1.0

COMPLETION_FAILED = "job %r: its completion failed (its lease runs out: it runs again)"


class Handoff:
    """One slot's finished job, handed to the batch that stores it: its completion, whether
    the slot wants its next job from the same transaction (``claims``), and what the batch
    answered: ``accepted`` (``True`` or the refusal), the slot's next ``lease`` (or ``None``),
    ``claimed_at`` (``time.monotonic()`` before the batch's claim) or the ``error`` that failed
    the batch.

    A batch is what the slots finished while the previous batch was on its way (a group
    commit): with one slot busy it is that slot's job alone, one transaction per job as
    before; with N slots finishing together, one transaction stores N results and claims N
    jobs."""

    __slots__ = ("accepted", "claimed_at", "claims", "completion", "error", "lead", "lease", "ready")

    # ``lead``: the thread front's, set when this slot leads the next batch

    def __init__(self, completion: tuple[Lease, str | None], claims: bool, ready: Any) -> None:
        self.completion = completion
        self.claims = claims
        self.ready = ready  #: set when answered, or when this slot leads the next batch
        self.lead = False
        self.accepted: object = None
        self.lease: Lease | None = None
        self.claimed_at = 0.0
        self.error: BaseException | None = None

    @staticmethod
    def share(batch: list[Handoff], accepted: list[Any], leases: list[Lease], claimed_at: float) -> None:
        """The batch's answers, each to its slot: the judgements in order, the new leases to
        the slots that claim, in order (the last ones get none when fewer jobs were ready)."""
        fresh = iter(leases)
        for handoff, judged in zip(batch, accepted, strict=True):
            handoff.accepted = judged
            handoff.claimed_at = claimed_at
            if handoff.claims:
                handoff.lease = next(fresh, None)


class _Flag(Protocol):
    def is_set(self) -> bool: ...


class _Keeps(Protocol):
    """What a job reads of its heartbeat (sync or async)."""

    @property
    def lease(self) -> Lease: ...

    def check(self) -> None: ...


F = TypeVar("F", bound=_Flag)
S = TypeVar("S")  #: the store a front takes
Fn = TypeVar("Fn")  #: the function a front calls


class JobRules(Generic[F]):
    """One job as the worker's function sees it: ``job_id``, ``payload`` (its arguments),
    ``attempt`` (its fence: the how-manieth claim of the job), :attr:`lease` (the current one,
    renewed by the worker), ``lost`` (set once the lease can no longer be vouched for, the
    worker handed the job back, or the job ran past the worker's ``timeout``) and ``store``."""

    def __init__(self, store: Any, heartbeat: _Keeps, lost: F) -> None:
        lease = heartbeat.lease
        self.store = store
        self.job_id = lease.job_id
        self.payload: Any = lease.payload
        self.attempt = lease.fence
        self._heartbeat = heartbeat
        #: set once the lease is lost or handed back: stop, nothing will be stored
        self.lost = lost
        #: the function completed the job itself (``completing``)
        self.completed = False
        #: the function ran past the worker's ``timeout``: the job was released as a failure
        self.timed_out = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.job_id!r} attempt={self.attempt}>"

    @property
    def lease(self) -> Lease:
        """The job's lease as last renewed."""
        return self._heartbeat.lease

    def _refuse_if_timed_out(self) -> None:
        """A run past the worker's timeout starts no write through the job's lease: refused in
        this process at once, before the worker's release of the job reaches the database."""
        if self.timed_out:
            raise LeaseLost(f"job {self.job_id!r}: it ran past the worker's timeout")

    def check(self) -> None:
        """Raise :class:`~fencing.LeaseLost` if the lease is lost, the job handed back or its
        run past the worker's timeout."""
        if self.lost.is_set():
            why = (
                "it ran past the worker's timeout"
                if self.timed_out
                else "its lease is lost or the worker handed it back"
            )
            raise LeaseLost(f"job {self.job_id!r}: {why}")
        self._heartbeat.check()


class WorkerRules(Generic[S, Fn]):
    """The arguments and the decisions of a worker, checked here: a bad argument raises
    before anything runs. A front says which store it takes and what a function must be
    (:meth:`_check_store`, :meth:`_check_function`), and carries the steps out."""

    def __init__(
        self,
        store: S,
        function: Fn,
        *,
        concurrency: int = 1,
        ttl: float = 30.0,
        max_attempts: int = 5,
        retry_delay: float = 1.0,
        max_retry_delay: float = 300.0,
        drain: float = 30.0,
        owner: str | None = None,
        schedules: Scheduler | None = None,
        timeout: float | None = None,
    ) -> None:
        self._check_store(store)
        self._check_function(function)
        if schedules is not None and not isinstance(schedules, Scheduler):
            raise InvalidArgumentType(
                f"schedules must be a fencing.Scheduler (or None), got {type(schedules).__name__}"
            )
        #: the schedules this worker keeps while it runs (on a thread of the scheduler's own)
        self.schedules = schedules
        self.store = store
        self.function = function
        self.concurrency = check_count("concurrency", concurrency)
        self.max_attempts = check_count("max_attempts", max_attempts)
        self.ttl = _seconds("ttl", ttl, positive=True)
        self.retry_delay = _seconds("retry_delay", retry_delay)
        self.max_retry_delay = _seconds("max_retry_delay", max_retry_delay)
        self.drain = _seconds("drain", drain)
        #: how long a function may run a job before the job is released as a failed attempt
        self.timeout = None if timeout is None else _seconds("timeout", timeout, positive=True)
        owner = owner if owner is not None else f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        checks: Any = getattr(store, "sync_store", store)  # an async store's rules are its sync store's
        self.owner = checks.check_key(owner, name="owner")
        self._keeps_failures = store.failures is not None  # type: ignore[attr-defined]
        self._metrics: StoreMetrics = store.metrics  # type: ignore[attr-defined]
        self._front_state()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.owner!r} concurrency={self.concurrency} store={self.store!r}>"

    def _check_store(self, store: object) -> None:  # pragma: no cover - each front has its own
        raise NotImplementedError

    def _front_state(self) -> None:  # pragma: no cover - each front has its own
        """The front's own state (its events, slots and batches), once the arguments passed."""
        raise NotImplementedError

    def _check_function(self, function: object) -> None:
        if not callable(function):
            raise InvalidArgumentType(
                f"function must be callable, got {type(function).__name__} {function!r:.80}"
            )

    # -- decisions -----------------------------------------------------------------------------

    def _starts(self) -> float:
        """A function begins a job: counted; the ``time.perf_counter()`` its run is timed from."""
        self._metrics.add("worker.started")
        return time.perf_counter()

    def _ran(self, started: float) -> float:
        """A function's run ended (returned or raised): timed; how long it took."""
        took = time.perf_counter() - started
        self._metrics.time("worker.run", took)
        return took

    def _retry_delay(self, attempt: int) -> float:
        """Exponential, capped, with equal jitter (a random point in the upper half)."""
        span = min(self.max_retry_delay, self.retry_delay * 2.0 ** min(attempt - 1, 60))
        return random.uniform(span / 2, span)

    def _after_failure(
        self, job: JobRules[Any], exc: BaseException
    ) -> tuple[bool, float | None, str | None] | None:
        """For a function that raised: ``None`` if its lease was lost meanwhile (nothing to
        record: the job is another's now), else whether it was the job's last attempt, the
        delay of the next one (``None``: the last), and the failure to store (``None`` for a
        store without a failures table: the log only)."""
        if job.lost.is_set():
            self._metrics.add("worker.lost")
            logger.warning("job %r failed after its lease was lost: %r (not recorded)", job.job_id, exc)
            return None
        return self._failed_attempt(job, exc)

    def _failed_attempt(
        self, job: JobRules[Any], exc: BaseException, where: str = ""
    ) -> tuple[bool, float | None, str | None]:
        """A failed attempt of ``job``: whether it was the last, the next one's delay
        (``None``: the last), and the failure to store (``None`` for a store without a failures
        table), ``where`` after the exception's own text."""
        last = job.attempt >= self.max_attempts
        delay = None if last else self._retry_delay(job.attempt)
        return last, delay, _failure_text(exc, where) if self._keeps_failures else None

    def _timed_out(
        self, job: JobRules[Any], where: str
    ) -> tuple[TimeoutError, bool, float | None, str | None]:
        """A function ran past :attr:`timeout`: counted, and what its release records, as a
        failure's (:meth:`_after_failure`): the ``TimeoutError``, whether it was the last
        attempt, the next one's delay, and the failure to store, with ``where`` (the
        function's stack as it timed out)."""
        self._metrics.add("worker.timed_out")
        exc = TimeoutError(f"job {job.job_id!r} ran past the worker's timeout of {self.timeout:g} s")
        return (exc, *self._failed_attempt(job, exc, f"where it was when it timed out:\n{where}"))

    def _timeout_logged(
        self,
        job: JobRules[Any],
        exc: TimeoutError,
        took: float,
        released: object,
        last: bool,
        delay: float | None,
        reason: str | None,
    ) -> None:
        """What the release of a timed-out job came to: a failed attempt, as any failure's
        (:meth:`_failure_logged`), unless the function's own completion committed first (it
        finished as it timed out: the release is refused, the job is done). ``released`` is
        ``None`` when there was no lease left to release (``reason``: the heartbeat's)."""
        if released is None:
            self._metrics.add("worker.lost")
            logger.warning("job %r ran past its timeout, its lease lost (%s)", job.job_id, reason)
            return
        if not released and getattr(released, "reason", None) == "done":
            self._metrics.add("worker.completed")
            logger.info("job %r completed itself as it timed out (%.3f s)", job.job_id, took)
            return
        self._failure_logged(job, exc, took, released, last, delay)

    def _late(self, job: JobRules[Any], outcome: str) -> None:
        """A function that timed out ``returned`` or ``raised ...`` since: nothing of it is
        stored or counted (its job was released as a failure at the timeout)."""
        logger.warning(
            "job %r %s after its timeout: not stored (the job was released as a failed attempt then)",
            job.job_id, outcome,
        )  # fmt: skip

    def _worth_storing(self, job: JobRules[Any], took: float, reason: str | None) -> bool:
        """Whether what a function returned is to be stored; not when the function completed
        the job itself, nor when the lease was lost or handed back meanwhile (``reason``: the
        heartbeat's)."""
        if job.completed:
            self._metrics.add("worker.completed")
            logger.info(
                "job %r done in %.3f s (attempt %d), in its own transaction", job.job_id, took, job.attempt
            )
            return False
        if job.lost.is_set():
            self._metrics.add("worker.lost")
            logger.warning(
                "job %r returned after its lease was lost or handed back (%s): its result is not stored",
                job.job_id, reason or "handed back",
            )  # fmt: skip
            return False
        logger.info("job %r ran in %.3f s (attempt %d)", job.job_id, took, job.attempt)
        return True

    # -- what is logged ------------------------------------------------------------------------

    def _cancelled(self, job: JobRules[Any], took: float, reason: str | None) -> None:
        """The async front's coroutine was cancelled: its lease was lost or the job handed back."""
        self._metrics.add("worker.lost")
        logger.warning(
            "job %r cancelled after %.3f s: its lease was lost or handed back (%s)",
            job.job_id, took, reason or "handed back",
        )  # fmt: skip

    def _handed_back(self, lease: Lease, released: object, when: str) -> None:
        self._metrics.add("worker.handed_back")
        logger.warning(
            "job %r handed back %s (attempt %d): %s", lease.job_id, when, lease.fence,
            "another worker may start it now" if released else f"the release was refused: {released}",
            extra={"job_id": lease.job_id, "fence": lease.fence},
        )  # fmt: skip

    def _judged(self, handoff: Handoff) -> None:
        lease = handoff.completion[0]
        if handoff.error is not None:
            self._metrics.add("worker.unstored")
            logger.error(COMPLETION_FAILED, lease.job_id, exc_info=handoff.error)
        elif not handoff.accepted:
            self._metrics.add("worker.refused")
            logger.warning("job %r: its result was refused: %s", lease.job_id, handoff.accepted)
        else:
            self._metrics.add("worker.completed")

    def _unreleased(self, job: JobRules[Any]) -> None:
        """A failed job's release itself failed."""
        self._metrics.add("worker.unstored")
        logger.exception("job %r: could not release it after a failure (its lease runs out)", job.job_id)

    def _batch_claims(self, batch: list[Handoff]) -> int:
        """How many jobs a batch claims: one for each slot that asks for its next."""
        return sum(handoff.claims for handoff in batch)

    def _failure_logged(
        self,
        job: JobRules[Any],
        exc: BaseException,
        took: float,
        released: object,
        last: bool,
        delay: float | None,
    ) -> None:
        if not released:
            self._metrics.add("worker.refused")
            logger.warning("job %r failed (%r) and its release was refused: %s", job.job_id, exc, released)
        elif last:
            self._metrics.add("worker.poisoned")
            logger.error(
                "job %r failed in %.3f s on its last attempt (%d of %d), poisoned: %r",
                job.job_id, took, job.attempt, self.max_attempts, exc,
                extra={"job_id": job.job_id, "fence": job.attempt},
            )  # fmt: skip
        else:
            self._metrics.add("worker.retried")
            logger.warning(
                "job %r failed in %.3f s (attempt %d of %d), retried in %.1f s: %r",
                job.job_id, took, job.attempt, self.max_attempts, delay, exc,
                extra={"job_id": job.job_id, "fence": job.attempt},
            )  # fmt: skip

    def _signalled(self, signum: int, first: bool) -> None:
        import signal

        logger.warning(
            "worker %s: %s: %s", self.owner, signal.Signals(signum).name,
            f"draining (up to {self.drain:g} s; again: hand back now)" if first else "handing back now",
        )  # fmt: skip


def as_result(value: Any) -> str | None:
    """What a function returned, as the result column keeps it: a ``str`` as it is, ``None``,
    anything else as JSON (refused, as a failure of the job, if it would not read back)."""
    if value is None or isinstance(value, str):
        return value
    return encode_payload(value)


def _failure_text(exc: BaseException, after: str = "") -> str:
    """The exception's type, message and traceback, then ``after``, as every database's text
    column keeps it (a NUL or a lone surrogate written as its escape)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + after
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def stack_text(frames: list[FrameType]) -> str:
    """Where a running function is, from its frames (outermost first), as a traceback shows
    it: innermost call last."""
    if not frames:
        return "(its stack could not be read)\n"
    return "".join(traceback.StackSummary.extract((frame, frame.f_lineno) for frame in frames).format())


def _seconds(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentType(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if not (seconds > 0 if positive else seconds >= 0) or seconds == float("inf"):
        bound = "> 0" if positive else ">= 0"
        raise InvalidArgument(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds
