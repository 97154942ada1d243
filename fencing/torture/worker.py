"""One worker process of a torture run, built only from the public API.

The cycle: ``claim_next`` (a batch) → per lease a heartbeat → simulated work
→ sometimes a write to an "external" resource guarded by :meth:`fencing.FenceMarks.accept`
→ finish the job: a fenced block that writes the application's own row and completes
(half of them with the heartbeat still renewing, nested around the block), a plain
``complete``, ``complete_many`` over the batch, or ``complete_and_claim_next`` (whose new
lease the worker then works on). Sometimes the job is given back
with a delay instead (a retry). Every call's outcome goes to the worker's journal; a worker
that stops cleanly (asked to, not killed) journals last the counters of its store and
marks (``metrics``), which the verdict sets against the rest of its journal.

These rules are written once, for both fronts (:mod:`.fronts`): the sync store with
:class:`fencing.Heartbeat` threads, or the async store with
:class:`~fencing._store.heartbeat_task.AsyncHeartbeat` tasks (the rules then run inside asyncio's
bridge and every call is awaited).

The worker publishes where it is (idle, holding a lease, inside a write transaction) in a
shared array, so the controller can freeze or kill it at the moment that hurts most.

The database itself may crash and restart under it (the ``server-crash`` fault). The worker
rides through: a call that raised :class:`fencing.DatabaseUnavailable` changed nothing, so it
is made again after a backoff, a few times (:data:`RETRIES`), and the worker's loop backs off
longer while the database stays away (up to :data:`UNAVAILABLE_BUDGET` s in a row, then it
gives up: a crash, which the verdict reports). A call that raised
:class:`fencing.OutcomeUnknown` may or may not have committed: it is journaled as an
``unknown`` outcome and never made again, the lease it was about left to expire.
"""

from __future__ import annotations

import ctypes
import functools
import random
import signal
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Executable

from .._errors import DatabaseUnavailable, FencingError, LeaseLost, OutcomeUnknown
from .._runtime import bridge, holds
from .._sql.dberrors import wrap_database_error
from .._sql.values import Lease, Refusal
from .config import TortureConfig
from .fronts import Front, Keeper, ShowsHeartbeat, with_front
from .journal import OPERATIONS, Journal
from .tables import TortureTables

if TYPE_CHECKING:
    from multiprocessing.sharedctypes import SynchronizedArray
    from multiprocessing.synchronize import Event

__all__ = ["HOLDING", "IDLE", "IN_TRANSACTION", "STARTING", "finish_mode", "result_of", "run_worker"]

#: a worker's state, shared with the controller: STARTING until its front is open (spawning a
#: process and importing a driver takes seconds on a loaded machine), then the others
IDLE, HOLDING, IN_TRANSACTION, STARTING = 0, 1, 2, 3
#: prctl(2): the signal a process gets when its parent dies
PR_SET_PDEATHSIG = 1
#: a call that raised DatabaseUnavailable is made again at most this many times, after
#: :func:`retry_pause`; then the worker's loop takes over, backing off longer
RETRIES = 3
#: the longest pause of the loop while the database stays unavailable
LONGEST_PAUSE = 0.5
#: how long the database may stay unavailable, in a row, before a worker gives up
UNAVAILABLE_BUDGET = 120.0

T = TypeVar("T")


def retry_pause(attempt: int) -> float:
    """The pause before the ``attempt``-th try again (from 0): 20 ms doubling, at most
    :data:`LONGEST_PAUSE`."""
    return min(LONGEST_PAUSE, 0.02 * 2.0**attempt)


@contextmanager
def own_statements() -> Iterator[None]:
    """The application's own statements (its INSERTs, its transaction's BEGIN and COMMIT)
    raise SQLAlchemy's errors, not the library's: the same classification as the store's (a
    lost connection is :class:`DatabaseUnavailable`). asyncpg's connect raises the socket's
    own ``OSError`` (``ConnectionRefusedError``) through SQLAlchemy unwrapped."""
    try:
        yield
    except (DBAPIError, OSError) as exc:
        raise wrap_database_error(exc) from exc


def finish_mode(config: TortureConfig, job_id: str) -> str:
    """How ``job_id`` is finished: fixed by the seed, so the checker knows it too."""
    if config.finish != "mixed":
        return config.finish
    return ("fenced", "plain", "batch", "step")[zlib.crc32(f"{config.seed}:{job_id}".encode()) % 4]


def result_of(lease: Lease) -> str:
    """The result a lease writes: the checker compares it with the row's owner and fence."""
    return f"{lease.owner}#{lease.fence}"


#: the share of fenced blocks run with the lease's heartbeat still renewing
NESTED_RATE = 0.5


def _record(journal: Journal, event: str, lease: Lease, t0: float, **fields: object) -> None:
    """One call on ``lease`` that started at ``t0`` and has just returned."""
    journal.record(
        event, job=lease.job_id, fence=lease.fence, owner=lease.owner, t0=t0, t1=time.time(), **fields
    )


class _JournaledKeeper:
    """The store as the heartbeat sees it: every renewal and release is journaled."""

    def __init__(self, store: Keeper, journal: Journal) -> None:
        self._store = store
        self._journal = journal

    @property
    def holds_key(self) -> holds.Key:
        """The store's: the heartbeat meets the worker's fenced blocks through it."""
        return self._store.holds_key

    @property
    def clock_resolution(self) -> float:
        return self._store.clock_resolution

    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | Refusal:
        t0 = time.time()
        self._journal.record("renew-start", job=lease.job_id, fence=lease.fence, owner=lease.owner, t0=t0)
        renewed = self._store.renew(lease, ttl=ttl, now=now)
        _record(self._journal, "renew", lease, t0, until=renewed.until if renewed else None)
        return renewed

    def release(self, lease: Lease, *, delay: float | None = None) -> Literal[True] | Refusal:
        t0 = time.time()
        released = self._store.release(lease, delay=delay)
        if delay is None:
            _record(self._journal, "release", lease, t0, ok=bool(released))
        else:
            _record(self._journal, "release", lease, t0, ok=bool(released), delay=delay)
        return released


class _Worker:
    def __init__(
        self,
        config: TortureConfig,
        index: int,
        incarnation: int,
        states: SynchronizedArray[Any],
        journal: Journal,
        front: Front[Any],
    ) -> None:
        self.config = config
        self.index = index
        self.owner = f"w{index}.{incarnation}"
        self.rng = random.Random(f"{config.seed}/{index}/{incarnation}")
        self.states = states
        self.journal = journal
        self.tables = TortureTables.named(config.prefix)
        self.front = front
        self.store = front.store
        self.marks = front.marks
        self.keeper = _JournaledKeeper(self.store, self.journal)
        #: the claim_next calls that returned (those that returned leases are journaled
        #: lease by lease, the empty ones only in this count)
        self.polls = 0

    def at(self, state: int) -> None:
        self.states[self.index] = state

    # -- the cycle ----------------------------------------------------------------------------

    def run(self, stop: Event) -> None:
        away_since: float | None = None  # the database unavailable since, in a row
        failures = 0  # in a row
        while not stop.is_set():
            try:
                if not self.one_batch():
                    bridge.sleep(self.rng.uniform(0.002, 0.02))
            except DatabaseUnavailable as exc:
                # nothing changed: back off, longer while it lasts
                if not getattr(exc, "journaled", False):  # e.g. a heartbeat's first renewal
                    self.journal_unavailable(exc, "other", time.time())
                self.at(IDLE)
                now = time.monotonic()
                away_since = now if away_since is None else away_since
                if now - away_since > UNAVAILABLE_BUDGET:
                    raise DatabaseUnavailable(
                        f"the database stayed unavailable for {UNAVAILABLE_BUDGET:g} s: giving up"
                    ) from exc
                bridge.sleep(self.rng.uniform(0.5, 1.0) * retry_pause(failures))
                failures += 1
                continue
            except OutcomeUnknown as exc:
                self.journal_unknown(exc, "other", None)  # the lease is left to expire
                self.at(IDLE)
            except FencingError as exc:
                # reported (a busy database is not a violation), never fatal: go on
                self.journal.record("error", type=type(exc).__name__, message=str(exc)[:300], t=time.time())
                self.at(IDLE)
                bridge.sleep(0.01)
            away_since, failures = None, 0

    def attempt(self, op: str, call: Callable[[], T], leases: list[Lease] | None = None) -> tuple[float, T]:
        """``call()``, and again after :func:`retry_pause` while it raises
        :class:`DatabaseUnavailable` (nothing changed), at most :data:`RETRIES` more times:
        the start of the try that returned, and what it returned. Each unavailable try is
        journaled (``unavailable``); an :class:`OutcomeUnknown` is journaled (``unknown``,
        one per lease the call was about, or one for a claim) and passed up."""
        tried = 0
        while True:
            t0 = time.time()
            try:
                return t0, call()
            except DatabaseUnavailable as exc:
                self.journal_unavailable(exc, op, t0, tried)
                if tried >= RETRIES:
                    raise
                bridge.sleep(retry_pause(tried))
                tried += 1
            except OutcomeUnknown as exc:
                self.journal_unknown(exc, op, leases, t0)
                raise

    def journal_unavailable(self, exc: DatabaseUnavailable, op: str, t0: float, tried: int = 0) -> None:
        exc.journaled = True  # type: ignore[attr-defined]
        message = str(exc)[:200]
        self.journal.record(
            "unavailable", op=op, owner=self.owner, attempt=tried, t0=t0, t1=time.time(), message=message
        )

    def journal_unknown(
        self, exc: OutcomeUnknown, op: str, leases: list[Lease] | None, t0: float | None = None
    ) -> None:
        """One ``unknown`` event per lease the call was about (or one, for a claim), once."""
        if getattr(exc, "journaled", False):
            return
        exc.journaled = True  # type: ignore[attr-defined]
        t1 = time.time()
        message = str(exc)[:200]
        abouts: list[dict[str, Any]] = [{"job": lease.job_id, "fence": lease.fence} for lease in leases or []]
        for about in abouts or [{}]:
            self.journal.record(
                "unknown",
                op=op,
                owner=self.owner,
                t0=t1 if t0 is None else t0,
                t1=t1,
                message=message,
                **about,
            )

    def one_batch(self) -> bool:
        limit = self.rng.randint(1, self.config.batch)
        t0, leases = self.attempt(
            "claim", lambda: self.store.claim_next(self.owner, ttl=self.config.ttl, limit=limit)
        )
        self.polls += 1
        self.record_claims(leases, t0)
        batched: list[Lease] = []
        todo = list(leases)  # a step's completion claims the next job: it joins this list
        while todo:
            self.at(HOLDING)
            self.work_on(todo.pop(0), batched, todo)
        if batched:
            self.finish_batch(batched)
        self.at(IDLE)
        return bool(leases)

    def record_metrics(self) -> None:
        """The counters of this process's store and marks, journaled once it has stopped:
        every call it made has returned (and is journaled) by then, heartbeats included."""
        self.journal.record(
            "metrics",
            owner=self.owner,
            worker=self.index,
            polls=self.polls,
            front=self.config.front,
            store=self.front.store_metrics.snapshot(),
            marks=self.front.marks_metrics.snapshot(),
            t=time.time(),
        )

    def record_claims(self, leases: list[Lease], t0: float) -> None:
        t1 = time.time()
        for lease in leases:
            self.journal.record(
                "claim",
                job=lease.job_id,
                fence=lease.fence,
                owner=self.owner,
                until=lease.until,
                t0=t0,
                t1=t1,
            )

    def work_on(self, lease: Lease, batched: list[Lease], todo: list[Lease]) -> None:
        try:
            self.keep_and_finish(lease, batched, todo)
        except LeaseLost:  # only the heartbeat's first renewal raises it: expired while queued in the batch
            self.journal.record("lost", job=lease.job_id, fence=lease.fence, where="start", t=time.time())
        except OutcomeUnknown as exc:  # this lease's write may have committed: on to the next
            self.journal_unknown(exc, "heartbeat", [lease])

    def keep_and_finish(self, lease: Lease, batched: list[Lease], todo: list[Lease]) -> None:
        config, rng = self.config, self.rng
        with self.front.heartbeat(self.keeper, lease, config.ttl) as heartbeat:
            bridge.sleep(rng.uniform(0.0, config.work))
            if rng.random() < config.release_rate:
                self.release_later(heartbeat)
                return
            if rng.random() < 0.5 and self.checked(heartbeat, "external"):
                self.write_external(heartbeat.lease)
            mode = finish_mode(config, lease.job_id)
            # half the fenced blocks run with the heartbeat still going (the block extends the
            # lease and completes it; the heartbeat then ends quietly); before any other finish
            # it stops, as a renewal racing the completion would be refused and look like a loss
            nested = mode == "fenced" and rng.random() < NESTED_RATE
            if not nested:
                self.front.stop(heartbeat)
            if mode == "batch":
                batched.append(heartbeat.lease)
            elif not self.checked(heartbeat, mode):
                pass
            elif mode == "step":
                todo += self.step(heartbeat.lease)
            else:
                self.finish(heartbeat.lease, mode, nested=nested)

    def checked(self, heartbeat: ShowsHeartbeat, before: str) -> bool:
        """Sometimes look before writing; otherwise leave the refusal to the store."""
        if self.rng.random() >= self.config.check_heartbeat or heartbeat.held:
            return True
        lease = heartbeat.lease
        self.journal.record("skip", job=lease.job_id, fence=lease.fence, before=before, t=time.time())
        return False

    def release_later(self, heartbeat: ShowsHeartbeat) -> None:
        self.front.stop(heartbeat)
        lease = heartbeat.lease
        delay = self.rng.uniform(0.001, self.config.ttl)  # the store's least delay on the database's clock
        self.attempt("release", lambda: self.keeper.release(lease, delay=delay), [lease])

    def in_transaction(self, conn: Any, write: Executable) -> None:
        """The application's own work inside a write transaction: where a kill hurts most."""
        self.at(IN_TRANSACTION)
        with own_statements():
            conn.execute(write)
        bridge.sleep(self.rng.uniform(0.0, self.config.work / 4))

    def write_external(self, lease: Lease) -> None:
        resource = f"job:{lease.job_id}"
        row = {"resource": resource, "owner": lease.owner, "fence": lease.fence}
        insert = self.tables.external.insert().values(row)

        def once() -> None:
            # the application's own transaction: the resource's mark and its write commit
            # together, or neither; journaled once accept() returned (its counters count it),
            # with what became of the transaction (kept: True, False, or None: unknown)
            t0 = time.time()
            accepted: bool | None = None
            ended = False
            try:
                with own_statements(), self.front.begin() as conn:
                    accepted = self.marks.accept(resource, lease.fence, conn=conn)
                    if accepted:
                        self.in_transaction(conn, insert)
                    ended = True  # the body is done: what fails now is the COMMIT
            except DatabaseUnavailable as exc:
                if accepted is None:
                    raise
                kept = None if ended else False
                _record(self.journal, "external", lease, t0, ok=accepted, kept=kept)
                if ended:
                    raise OutcomeUnknown(f"the connection was lost during COMMIT: {exc}") from exc
                raise
            self.at(HOLDING)
            _record(self.journal, "external", lease, t0, ok=accepted, kept=True)

        self.attempt("external", once, [lease])
        self.at(HOLDING)

    def finish(self, lease: Lease, mode: str, *, nested: bool = False) -> None:
        if mode == "fenced":
            row = {"job_id": lease.job_id, "owner": lease.owner, "fence": lease.fence}
            insert = self.tables.results.insert().values(row)

            def fenced() -> bool:
                try:
                    with self.store.fenced(lease, complete=True, result=result_of(lease)) as conn:
                        self.in_transaction(conn, insert)
                    return True
                except LeaseLost:
                    return False

            t0, accepted = self.attempt(mode, fenced, [lease])
        else:
            completed = lambda: bool(self.store.complete(lease, result_of(lease)))  # noqa: E731
            t0, accepted = self.attempt(mode, completed, [lease])
        self.at(HOLDING)
        if nested:
            _record(self.journal, "write", lease, t0, how=mode, ok=accepted, nested=True)
        else:
            _record(self.journal, "write", lease, t0, how=mode, ok=accepted)

    def step(self, lease: Lease) -> list[Lease]:
        """Complete ``lease`` and claim the next job in one transaction: the new leases."""
        t0, ([accepted], leases) = self.attempt(
            "step",
            lambda: self.store.complete_and_claim_next(
                [(lease, result_of(lease))], self.owner, ttl=self.config.ttl, limit=1
            ),
            [lease],
        )
        self.record_claims(leases, t0)
        _record(self.journal, "write", lease, t0, how="step", ok=bool(accepted))
        return leases

    def finish_batch(self, leases: list[Lease]) -> None:
        completions: list[tuple[Lease, str | None]] = [(lease, result_of(lease)) for lease in leases]
        t0, accepted = self.attempt("batch", lambda: self.store.complete_many(completions), leases)
        for lease, ok in zip(leases, accepted, strict=True):
            _record(self.journal, "write", lease, t0, how="batch", ok=bool(ok))


def _die_with_parent() -> None:
    """On Linux, a worker is SIGKILLed if the controller dies (frozen workers included):
    an interrupted run must not leave processes holding locks in the user's database."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return


def _count_operation(counters: SynchronizedArray[Any], index: int, event: str) -> None:
    if event in OPERATIONS:  # called under the journal's lock: no increment is lost
        counters[index] += 1


def run_worker(
    config: TortureConfig,
    index: int,
    incarnation: int,
    states: SynchronizedArray[Any],
    stop: Event,
    journal_dir: str,
    operations: SynchronizedArray[Any] | None = None,
) -> None:
    """The target of a worker process. ``operations``: one counter per worker, shared with
    the controller, of the :data:`~.journal.OPERATIONS` it journaled (all its incarnations)."""
    _die_with_parent()
    config = config.for_worker(index)  # the mixed front: this worker's own
    counted = None if operations is None else functools.partial(_count_operation, operations, index)
    journal = Journal(Path(journal_dir) / f"worker-{index:03d}.{incarnation:04d}.jsonl", counted)

    def work(front: Front[Any]) -> None:
        worker = _Worker(config, index, incarnation, states, journal, front)
        worker.at(IDLE)  # up: the controller's fault clock waits for every worker to get here
        worker.run(stop)
        worker.record_metrics()  # only after a clean stop: a killed worker never gets here

    try:
        with_front(config, TortureTables.named(config.prefix), work)
    except BaseException as exc:
        # anything not in the library's family is a finding: the controller reports it
        journal.record(
            "crash", type=type(exc).__name__, message=str(exc)[:300], trace=traceback.format_exc()[-2000:]
        )
        raise
    finally:
        journal.close()
