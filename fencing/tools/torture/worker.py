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
:class:`~fencing.lease.task.AsyncHeartbeat` tasks (the rules then run inside asyncio's
bridge and every call is awaited).

The worker publishes where it is (idle, holding a lease, inside a write transaction) in a
shared array, so the controller can freeze or kill it at the moment that hurts most.
"""

from __future__ import annotations

import ctypes
import random
import signal
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.sql import Executable

from ...core import bridge
from ...core.errors import FencingError, LeaseLost
from ...core.values import Lease
from ...runtime import holds
from .config import TortureConfig
from .fronts import Front, Keeper, ShowsHeartbeat, with_front
from .journal import Journal
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

    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | None:
        t0 = time.time()
        self._journal.record("renew-start", job=lease.job_id, fence=lease.fence, owner=lease.owner, t0=t0)
        renewed = self._store.renew(lease, ttl=ttl, now=now)
        _record(self._journal, "renew", lease, t0, until=None if renewed is None else renewed.until)
        return renewed

    def release(self, lease: Lease, *, delay: float | None = None) -> bool:
        t0 = time.time()
        released = self._store.release(lease, delay=delay)
        if delay is None:
            _record(self._journal, "release", lease, t0, ok=released)
        else:
            _record(self._journal, "release", lease, t0, ok=released, delay=delay)
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
        while not stop.is_set():
            try:
                if not self.one_batch():
                    bridge.sleep(self.rng.uniform(0.002, 0.02))
            except FencingError as exc:
                # reported (a busy database is not a violation), never fatal: go on
                self.journal.record("error", type=type(exc).__name__, message=str(exc)[:300], t=time.time())
                self.at(IDLE)
                bridge.sleep(0.01)

    def one_batch(self) -> bool:
        t0 = time.time()
        leases = self.store.claim_next(
            self.owner, ttl=self.config.ttl, limit=self.rng.randint(1, self.config.batch)
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
        delay = self.rng.uniform(0.0, self.config.ttl)
        self.keeper.release(lease, delay=delay)

    def in_transaction(self, conn: Any, write: Executable) -> None:
        """The application's own work inside a write transaction: where a kill hurts most."""
        self.at(IN_TRANSACTION)
        conn.execute(write)
        bridge.sleep(self.rng.uniform(0.0, self.config.work / 4))

    def write_external(self, lease: Lease) -> None:
        resource = f"job:{lease.job_id}"
        external = self.tables.external
        t0 = time.time()
        with self.front.begin() as conn:
            accepted = self.marks.accept(resource, lease.fence, conn=conn)
            if accepted:
                row = {"resource": resource, "owner": lease.owner, "fence": lease.fence}
                self.in_transaction(conn, external.insert().values(row))
        self.at(HOLDING)
        _record(self.journal, "external", lease, t0, ok=accepted)

    def finish(self, lease: Lease, mode: str, *, nested: bool = False) -> None:
        t0 = time.time()
        if mode == "fenced":
            row = {"job_id": lease.job_id, "owner": lease.owner, "fence": lease.fence}
            results = self.tables.results
            try:
                with self.store.fenced(lease, complete=True, result=result_of(lease)) as conn:
                    self.in_transaction(conn, results.insert().values(row))
                accepted = True
            except LeaseLost:
                accepted = False
        else:
            accepted = self.store.complete(lease, result_of(lease))
        self.at(HOLDING)
        if nested:
            _record(self.journal, "write", lease, t0, how=mode, ok=accepted, nested=True)
        else:
            _record(self.journal, "write", lease, t0, how=mode, ok=accepted)

    def step(self, lease: Lease) -> list[Lease]:
        """Complete ``lease`` and claim the next job in one transaction: the new leases."""
        t0 = time.time()
        [accepted], leases = self.store.complete_and_claim_next(
            [(lease, result_of(lease))], self.owner, ttl=self.config.ttl, limit=1
        )
        self.record_claims(leases, t0)
        _record(self.journal, "write", lease, t0, how="step", ok=accepted)
        return leases

    def finish_batch(self, leases: list[Lease]) -> None:
        t0 = time.time()
        accepted = self.store.complete_many([(lease, result_of(lease)) for lease in leases])
        for lease, ok in zip(leases, accepted, strict=True):
            _record(self.journal, "write", lease, t0, how="batch", ok=ok)


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


def run_worker(
    config: TortureConfig,
    index: int,
    incarnation: int,
    states: SynchronizedArray[Any],
    stop: Event,
    journal_dir: str,
) -> None:
    """The target of a worker process."""
    _die_with_parent()
    journal = Journal(Path(journal_dir) / f"worker-{index:03d}.{incarnation:04d}.jsonl")

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
