"""Run a function for each job: the worker runtime, on threads (its rules, shared with the
asyncio front, are :mod:`.worker_rules`).

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
   (``complete_and_claim_next``), together with every slot that finished meanwhile (a group
   commit, :class:`_Batches`: one transaction per job with one slot busy, one per N jobs when
   N finish together); or, if the function raised,
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

**A timeout** (``timeout=``): a watchdog thread takes a job whose function runs past it from
its slot, sets ``job.lost``, starts a new slot in the stuck one's place (a thread cannot be
stopped: it ends when its function returns, and nothing it returns is stored) and releases the
job as a failed attempt, with the function's stack as the failure (:mod:`.worker_rules`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .._errors import InvalidArgument, InvalidArgumentType, LeaseLost
from .._sql.values import Lease
from . import worker_rules as rules
from .heartbeat import Heartbeat, Keeper
from .jobstore import JobStore
from .worker_rules import Handoff, JobRules, WorkerRules, as_result, logger, stack_text

__all__ = ["Job", "Worker"]


class Job(JobRules[threading.Event]):
    """One job as the worker's function sees it: ``job_id``, ``payload`` (its arguments),
    ``attempt`` (its fence: the how-manieth claim of the job), :attr:`lease` (the current one,
    renewed by the worker), ``lost`` (a :class:`threading.Event` set once the lease can no
    longer be vouched for, or the worker handed the job back) and ``store``."""

    @contextlib.contextmanager
    def completing(self, result: Any = None, *, conn: Any = None) -> Iterator[Any]:
        """A fenced block that completes the job with ``result`` at its end, in the same
        transaction as the block's own writes (``conn``: yours, or the store's own);
        :class:`~fencing.LeaseLost` and nothing written if the lease is no longer current, or
        if the run passed the worker's ``timeout`` before the block's end.
        The worker then stores nothing more for this job."""
        self._refuse_if_timed_out()
        text = as_result(result)
        with self.store.fenced(self.lease, complete=True, result=text, conn=conn) as connection:
            yield connection
            self._refuse_if_timed_out()  # timed out inside the block: its writes roll back
        self.completed = True


class _Running:
    """A job whose function runs: what the drain and the timeout watchdog need."""

    __slots__ = ("heartbeat", "job", "since", "started", "thread")

    def __init__(self, job: Job, heartbeat: Heartbeat, started: float) -> None:
        self.job, self.heartbeat = job, heartbeat
        self.started = started  #: ``time.perf_counter()``, the run's timing starts there
        self.since = time.monotonic()  #: the timeout counts from here
        self.thread = threading.current_thread()  #: the slot's, which runs the function


class _TimedOut:
    """A slot's job timed out: the slot ends (another took its place) once its function returns."""


TIMED_OUT = _TimedOut()


class Worker(WorkerRules[JobStore, Callable[[Job], Any]]):
    """Runs ``function(job)`` for each job of ``store``, ``concurrency`` at a time.

    ``ttl``: each lease's length (renewed every ``ttl / 3`` while the function runs);
    ``max_attempts``: how many claims a job gets before it is left poisoned; ``retry_delay``
    and ``max_retry_delay``: the backoff of a failed job's next attempt (seconds); ``drain``:
    how long running jobs may take to finish once the worker stops; ``owner``: the name its
    leases carry (default: host, process id and a random part); ``schedules``: a
    :class:`~fencing.Scheduler` this worker keeps while it runs (every worker may keep the
    same ones: each tick is still one job); ``timeout``: how long a function may run a job
    before the job is released as a failed attempt (none by default).
    Everything is checked here: a bad argument raises before anything runs.
    """

    def _front_state(self) -> None:
        self._stopping = threading.Event()
        self._hand_back = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        #: the slots that claim; one whose function ran past the timeout leaves it (the drain
        #: does not wait for it), and a new one takes its place
        self._slots: list[threading.Thread] = []
        self._slot_numbers = itertools.count()
        self._watched = threading.Event()  #: set when the timeout watchdog is to end
        self._batches = _Batches(self._store_batch)

    def _check_store(self, store: object) -> None:
        if not isinstance(store, JobStore):
            hint = " (an async store: use fencing.asyncio.AsyncWorker)"
            hint = hint if hasattr(store, "sync_store") else ""
            raise InvalidArgumentType(f"store must be a fencing.JobStore, got {type(store).__name__}{hint}")

    def _check_function(self, function: object) -> None:
        super()._check_function(function)
        call = getattr(function, "__call__", None)  # noqa: B004 - an object with async __call__
        if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call):
            name = getattr(function, "__name__", type(function).__name__)
            raise InvalidArgumentType(
                f"function is an async def function ({name}): use fencing.asyncio.AsyncWorker"
            )

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
            for _ in range(self.concurrency):
                self._add_slot()
            watchdog = None
            if self.timeout is not None:
                watchdog = threading.Thread(target=self._watch, name="fencing-timeouts", daemon=True)
                watchdog.start()
            if self.schedules is not None:
                self.schedules.start()
            self._stopping.wait()
            if self.schedules is not None:
                self.schedules.stop()  # enqueue no more ticks while draining
            self._drain()
        finally:
            self._watched.set()
            if self.schedules is not None:
                self.schedules.stop()
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
            self._signalled(signum, first)
            self.stop(now=not first)

        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
        return previous

    def _add_slot(self) -> None:
        # a daemon: a function that outlives its handed-back job does not keep the process
        with self._lock:
            slot = threading.Thread(
                target=self._slot,
                args=(self.owner,),
                name=f"fencing-slot-{next(self._slot_numbers)}",
                daemon=True,
            )
            self._slots.append(slot)
        slot.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            while slot.is_alive() and not self._hand_back.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                slot.join(min(left, 0.05))
        with self._lock:
            unfinished = list(self._running.values())
        for running in unfinished:
            self._give_back(running.job, running.heartbeat)
        # an idle slot ends within its claim's wait (giving back what it claimed meanwhile);
        # one whose function still runs after its job was handed back is left to it
        ends = time.monotonic() + rules.IDLE_WAIT + 1.0
        for slot in slots:
            slot.join(max(0.0, ends - time.monotonic()))

    def _give_back(self, job: Job, heartbeat: Heartbeat) -> None:
        job.lost.set()
        heartbeat.stop()
        if heartbeat.held:
            self._handed_back(heartbeat.lease, self.store.release(heartbeat.lease), "still running")

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
                        owner, ttl=self.ttl, max_attempts=self.max_attempts, wait=rules.IDLE_WAIT
                    )
                except Exception:
                    logger.exception("worker slot %s: a claim failed; trying again", owner)
                    self._stopping.wait(rules.IDLE_WAIT)
                continue
            [lease] = leases
            completion = self._run_one(lease, claimed_at, keeper)
            leases = []
            if isinstance(completion, _TimedOut):
                return  # a new slot took this one's place when its job timed out
            if completion is None:
                continue
            # this job's completion and the slot's next claim: one transaction, shared with the
            # slots that finish meanwhile (stopping: the completion alone)
            handoff = Handoff(completion, not self._stopping.is_set(), threading.Event())
            self._batches.submit(handoff)
            self._judged(handoff)
            if handoff.lease is not None:
                leases, claimed_at = [handoff.lease], handoff.claimed_at

    def _run_one(
        self, lease: Lease, claimed_at: float, keeper: Keeper
    ) -> tuple[Lease, str | None] | _TimedOut | None:
        """Run the function for ``lease``'s job; the completion to store, or ``None`` (failed,
        lost, handed back or completed by the function itself: nothing more to store), or
        :data:`TIMED_OUT` (the watchdog released it; this slot's place is taken)."""
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
                running = self._running[lease.job_id] = _Running(job, heartbeat, self._starts())
        if stopping:
            heartbeat.stop()
            self._handed_back(lease, self.store.release(lease), "before it started")
            return None
        try:
            value = self.function(job)
            result = None if job.completed else as_result(value)
        except BaseException as exc:  # SystemExit too: a slot that died of it would be lost silently
            if not self._forget(running):
                self._late(job, f"raised {exc!r}")
                return TIMED_OUT
            took = self._ran(running.started)
            heartbeat.stop()
            self._failed(job, heartbeat, exc, took)
            return None
        if not self._forget(running):
            self._late(job, "returned")
            return TIMED_OUT
        took = self._ran(running.started)
        heartbeat.stop()
        if not self._worth_storing(job, took, heartbeat.reason):
            return None
        return heartbeat.lease, result

    def _forget(self, running: _Running) -> bool:
        """The function's run ended: whether its job is still this slot's to finish (not
        when the watchdog timed it out first)."""
        with self._lock:
            return self._running.pop(running.job.job_id, None) is not None

    # -- the timeout ---------------------------------------------------------------------------

    def _watch(self) -> None:
        """Time out each job whose function runs past :attr:`timeout`, until the worker ends."""
        timeout = self.timeout
        assert timeout is not None
        while not self._watched.is_set():
            now = time.monotonic()
            with self._lock:
                running = list(self._running.values())
            for late in [r for r in running if r.since + timeout <= now]:
                try:
                    self._time_out(late)
                except Exception:  # (a thread that could not start): the watchdog goes on
                    logger.exception("job %r: its timeout could not be carried out", late.job.job_id)
            # a job started after this look is due a whole timeout from now, or later
            soonest = min(
                (r.since + timeout for r in running if r.since + timeout > now), default=now + timeout
            )
            self._watched.wait(max(0.005, soonest - time.monotonic()))

    def _time_out(self, running: _Running) -> None:
        """The job is taken from its slot (unless it ended, or completed itself, meanwhile):
        its function is told (``job.lost``), a new slot takes the stuck one's place, and the
        job is released as a failed attempt from a thread of its own."""
        job = running.job
        with self._lock:
            if self._running.get(job.job_id) is not running or job.completed:
                return
            del self._running[job.job_id]
            job.timed_out = True  # job.completing() and job.check() refuse from here
            self._slots.remove(running.thread)
            replace = not self._stopping.is_set()
        took = self._ran(running.started)
        where = _stack_of(running.thread)
        job.lost.set()
        if replace:
            self._add_slot()  # the stuck slot's thread cannot be stopped: run beside it
        threading.Thread(
            target=self._give_up,
            args=(running, took, where),
            name=f"fencing-timeout-{job.job_id:.40}",
            daemon=True,
        ).start()

    def _give_up(self, running: _Running, took: float, where: str) -> None:
        """Stop renewing a timed-out job's lease and release it as a failed attempt (this
        waits for the row while a fenced block of the stuck function holds it)."""
        job, heartbeat = running.job, running.heartbeat
        exc, last, delay, failure = self._timed_out(job, where)
        heartbeat.stop()
        try:
            released = (
                self.store.release(heartbeat.lease, delay=delay, failure=failure) if heartbeat.held else None
            )
        except Exception:
            self._unreleased(job)
            return
        self._timeout_logged(job, exc, took, released, last, delay, heartbeat.reason)

    def _store_batch(self, batch: list[Handoff]) -> None:
        """Store a batch's completions and claim its slots' next jobs: one transaction."""
        completions = [handoff.completion for handoff in batch]
        claims = self._batch_claims(batch)
        claimed_at = time.monotonic()
        try:
            if claims:
                accepted, leases = self.store.complete_and_claim_next(
                    completions, self.owner, ttl=self.ttl, limit=claims, max_attempts=self.max_attempts
                )
            else:
                accepted, leases = list(self.store.complete_many(completions)), []
        except Exception as exc:
            for handoff in batch:
                handoff.error = exc
            return
        Handoff.share(batch, accepted, leases, claimed_at)

    def _failed(self, job: Job, heartbeat: Heartbeat, exc: BaseException, took: float) -> None:
        plan = self._after_failure(job, exc)
        if plan is None:
            return
        last, delay, failure = plan
        try:
            released = self.store.release(heartbeat.lease, delay=delay, failure=failure)
        except Exception:
            self._unreleased(job)
            return
        self._failure_logged(job, exc, took, released, last, delay)


def _stack_of(thread: threading.Thread) -> str:
    """Where ``thread`` is now: its stack, outermost call first."""
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    # (walk_stack(None) would walk this thread's own stack)
    return stack_text([] if frame is None else [f for f, _ in traceback.walk_stack(frame)][::-1])


class _Batches:
    """Group commit of the slots' finished jobs: the first slot to finish leads a batch (it
    stores what every slot finished so far, :meth:`Worker._store_batch`); a slot that finishes
    while a batch is on its way waits, and the first of them leads the next batch with all
    that came meanwhile. Each slot returns once its own job is answered."""

    def __init__(self, store_batch: Callable[[list[Handoff]], None]) -> None:
        self._store_batch = store_batch
        self._lock = threading.Lock()
        self._queued: list[Handoff] = []
        self._on_its_way = False

    def submit(self, handoff: Handoff) -> None:
        with self._lock:
            self._queued.append(handoff)
            lead = not self._on_its_way
            self._on_its_way = True
        if not lead:
            handoff.ready.wait()
            if not handoff.lead:
                return  # answered by a batch another slot led
        with self._lock:
            batch, self._queued = self._queued, []
        try:
            self._store_batch(batch)
        finally:
            with self._lock:
                following = self._queued[0] if self._queued else None
                self._on_its_way = following is not None
            for answered in batch:
                if answered is not handoff:
                    answered.ready.set()
            if following is not None:  # it leads the next batch, with all queued by then
                following.lead = True
                following.ready.set()
