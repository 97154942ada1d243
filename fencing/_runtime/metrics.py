"""What a store did, counted and timed in process: ``store.metrics``.

**Counters** are dotted names: ``<operation>.accepted`` for a write the guard let through,
``<operation>.refused.<reason>`` for one it refused (reasons: :data:`fencing.REASONS`),
``claim_next.calls`` and ``claim_next.jobs`` for the claims of workers, ``claim.accepted`` /
``claim.empty`` for claims of a named job (empty: not claimable), ``fenced.accepted`` for
a fenced block that passed its final check (and committed, or in the caller's transaction
released its savepoint), ``revoke.accepted``, ``delete.accepted``, ``requeue.accepted``;
``lock.retried`` for a transaction run again after it lost a lock race (deadlock,
serialization failure, SQLite busy after ``BEGIN``), ``lock.busy`` for a
:class:`~fencing.DatabaseBusy` raised. ``FenceMarks.metrics`` counts ``accept.accepted``,
``accept.refused.older fence``, ``record_once.recorded`` and ``record_once.duplicate``. A
counter appears once it is first counted.

**Named locks and elections** (:mod:`fencing.locks`) count on their store's metrics
(``locks.metrics`` is ``locks.store.metrics``), so :mod:`fencing.otel` exports them with the
rest. Their claims, renewals and refusals are the store's own counters (``claim.*``,
``renew.*``, ``release.*``); what only the locks layer sees, the same on both fronts (the
rules are shared):

* ``acquire.acquired`` and ``acquire.timeout``: an ``acquire`` (or ``hold``) that got the
  lock, or gave up at its timeout (with ``timeout=0``, one try that met a held lock); one
  that raised counts in neither. ``acquire.queued``: one that found the lock held and took
  a place in its queue (so waited). ``try_acquire`` is one claim: the store's ``claim.*``.
* ``hold.lost``: a lock held by ``hold`` that its heartbeat found lost (revoked, taken
  after it expired, renewals failing past the local deadline) before the block ended.
* ``election.elected``: a candidate began a term. A term's end, one of:
  ``election.deposed`` (lost: a renewal refused or failing past the deadline),
  ``election.resigned`` (stopped while leading, releasing the term), ``election.stopped``
  (stopped with ``resign=False``: the term runs out at its ``until``).

(Not ``lock.*``: those count the database's locks, above.)

**Workers** (:class:`fencing.Worker`, :class:`fencing.asyncio.AsyncWorker`) count on their
store's metrics: ``worker.started``, one outcome per started job (``worker.completed``,
``worker.retried``, ``worker.poisoned``, ``worker.lost``, ``worker.refused``,
``worker.unstored``), ``worker.handed_back``, ``worker.timed_out``, and the timing ``worker.run``
(:mod:`fencing._store.worker_rules` says what each means).

**Timings** (:class:`Timing`: count, sum, min, max and fixed buckets, in seconds):

* ``claim_next.latency`` and ``claim.latency``: the claim's transaction, from the store
  taking a connection to the commit (for ``complete_and_claim_next``, the whole step's);
* ``complete.held`` and ``release.held``: how long a lease was held, from the claim that
  handed it out to the accepted ``complete`` or ``release`` that ended it; measured for the
  leases this store object handed out (the last :data:`HELD_TRACKED` claims it made are
  remembered; a lease completed by ``complete_many``, a fenced block or another process is
  not timed, and is forgotten when a write of it is refused, or the job revoked or deleted);
* ``lock.wait``: a wait for a lock the store could see: SQLite's ``BEGIN IMMEDIATE`` that
  took longer than :data:`LOCK_WAIT_MIN`, and a transaction that lost lock races, from the
  first lost race to its end. (A server's row-lock waits happen inside a statement and show
  only in the latencies.)
* ``acquire.wait``: an ``acquire`` that got the lock, from its call to the lease (one that
  found the lock free: one claim's round trip; the buckets show how many had to wait);
* ``election.term``: how long a term was held, from its first renewal to the moment its
  candidate saw it end (deposed, resigned or stopped).

Counting takes a lock (threads share a store) once per operation; with its timing that
costs 1-3 µs per operation, 5-6 µs per ``claim_next -> complete`` cycle (measured in place,
``benchmarks/observability.py``: under 2% of a cycle on a server or a SQLite file with its
default fsync, up to ~8% of SQLite's fastest cycle without it); reading
(:meth:`StoreMetrics.snapshot`, :meth:`StoreMetrics.timings`) copies. :mod:`fencing.otel`
exports both through OpenTelemetry, read only when the exporter collects.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._sql.values import Lease, Refusal

__all__ = ["BUCKETS", "HELD_TRACKED", "LOCK_WAIT_MIN", "StoreMetrics", "Timing"]

#: the upper bounds (seconds, inclusive) of a timing's buckets; a last bucket counts the rest
BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
    3600.0,
)
#: how many of its claims a store remembers to time how long their leases were held
HELD_TRACKED = 10_000
#: a SQLite ``BEGIN IMMEDIATE`` that takes longer than this waited for the write lock
#: (one that gets it at once takes some microseconds)
LOCK_WAIT_MIN = 0.001


@dataclass(frozen=True)
class Timing:
    """A summary of one timing: how many, their sum, min and max (seconds), and how many
    fell in each bucket: ``buckets[i]`` counts those ``<= BUCKETS[i]`` (and above the bound
    before), the last one those above ``BUCKETS[-1]``."""

    count: int
    sum: float
    min: float
    max: float
    buckets: tuple[int, ...]

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the ``q``-quantile (``max`` in the last)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for bound, n in zip((*BUCKETS, self.max), self.buckets, strict=True):
            seen += n
            if seen >= rank and n:
                return min(bound, self.max)
        return self.max


class _Summary:
    """A timing being counted (under the metrics' lock)."""

    __slots__ = ("buckets", "count", "max", "min", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.min = float("inf")
        self.max = 0.0
        self.buckets = [0] * (len(BUCKETS) + 1)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        if seconds < self.min:
            self.min = seconds
        if seconds > self.max:
            self.max = seconds
        self.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1

    def frozen(self) -> Timing:
        return Timing(self.count, self.sum, self.min, self.max, tuple(self.buckets))


class StoreMetrics:
    """Counts and timings of one store's operations; safe to share between threads.

    Read it with :meth:`snapshot` (counters), :meth:`timings` and :meth:`refused`. The other
    methods are how the store (and its runner) report; :meth:`add` and :meth:`time` may
    also be used by an application for its own names.
    """

    __slots__ = ("_counts", "_held", "_lock", "_timings")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._timings: dict[str, _Summary] = {}
        #: job id -> (fence, perf_counter at the claim) of the leases this store handed out
        #: (the oldest first, evicted past HELD_TRACKED)
        self._held: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def __repr__(self) -> str:
        timed = {name: t.count for name, t in sorted(self.timings().items())}
        return f"<StoreMetrics {dict(sorted(self.snapshot().items()))} timed={timed}>"

    # -- reading --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        """Every counter counted so far, by name."""
        with self._lock:
            return dict(self._counts)

    def timings(self) -> dict[str, Timing]:
        """Every timing recorded so far, by name."""
        with self._lock:
            return {name: s.frozen() for name, s in self._timings.items()}

    def refused(self, path: str | None = None) -> int:
        """Writes refused, in all or on one ``path`` (``complete``, ``renew``...)."""
        prefix = "" if path is None else f"{path}."
        with self._lock:
            return sum(
                n for name, n in self._counts.items() if name.startswith(prefix) and ".refused." in name
            )

    # -- counting -------------------------------------------------------------------------------

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def time(self, name: str, seconds: float) -> None:
        """Record one duration of ``name``."""
        with self._lock:
            self._timed(name, seconds)

    def _timed(self, name: str, seconds: float) -> None:
        summary = self._timings.get(name)
        if summary is None:
            summary = self._timings[name] = _Summary()
        summary.add(seconds)

    # -- what the store reports -----------------------------------------------------------------

    def claimed(self, leases: Sequence[Lease], started: float) -> None:
        """A ``claim_next`` (or a worker's step) whose transaction began at ``started``
        (``time.perf_counter()``) handed out ``leases``."""
        now = time.perf_counter()
        with self._lock:
            counts = self._counts
            counts["claim_next.calls"] += 1
            if leases:
                counts["claim_next.jobs"] += len(leases)
                self._began(leases, now)
            self._timed("claim_next.latency", now - started)

    def claim(self, lease: Lease | None, started: float) -> None:
        """A ``claim`` of a named job, begun at ``started``, handed out ``lease`` (``None``:
        not claimable)."""
        now = time.perf_counter()
        with self._lock:
            if lease is None:
                self._counts["claim.empty"] += 1
            else:
                self._counts["claim.accepted"] += 1
                self._began((lease,), now)
            self._timed("claim.latency", now - started)

    def _began(self, leases: Iterable[Lease], now: float) -> None:
        held = self._held
        for lease in leases:
            held[lease.job_id] = (lease.fence, now)
        while len(held) > HELD_TRACKED:
            held.popitem(last=False)

    def accepted(self, path: str, lease: tuple[str, int] | None = None) -> None:
        """A guarded write on ``path`` was accepted; a ``complete`` or ``release`` of
        ``lease`` (job, fence) ends it: timed if this store handed that lease out."""
        if lease is None or path not in ("complete", "release"):
            self.add(f"{path}.accepted")
            return
        job, fence = lease
        now = time.perf_counter()
        with self._lock:
            self._counts[f"{path}.accepted"] += 1
            began = self._held.pop(job, None)  # whatever lease of the job it was, it is over
            if began is not None and began[0] == fence:
                self._timed(f"{path}.held", now - began[1])

    def refusal(self, refusal: Refusal) -> None:
        """A refused write: counted by path and reason; its lease, if this store handed it
        out, is over (a refused lease is never current again): no longer timed."""
        with self._lock:
            self._counts[f"{refusal.path}.refused.{refusal.reason}"] += 1
            began = self._held.get(refusal.job_id)
            if began is not None and began[0] == refusal.fence:
                del self._held[refusal.job_id]

    def ended(self, path: str, job_id: str) -> None:
        """``revoke`` or ``delete`` of ``job_id`` changed the job: counted; whatever lease
        on it this store handed out is over."""
        with self._lock:
            self._counts[f"{path}.accepted"] += 1
            self._held.pop(job_id, None)

    def retried(self) -> None:
        """A transaction lost a lock race and is run again."""
        self.add("lock.retried")

    def waited(self, seconds: float) -> None:
        """A wait for a lock (see the module's docstring)."""
        self.time("lock.wait", seconds)

    def busy(self) -> None:
        """:class:`~fencing.DatabaseBusy` was raised."""
        self.add("lock.busy")

    # -- what named locks and elections report (fencing.locks) --------------------------------

    def acquired(self, lease: Lease | None, started: float) -> None:
        """An ``acquire`` called at ``started`` (``time.perf_counter()``) ended with ``lease``
        (``None``: it gave up at its timeout)."""
        now = time.perf_counter()
        with self._lock:
            if lease is None:
                self._counts["acquire.timeout"] += 1
            else:
                self._counts["acquire.acquired"] += 1
                self._timed("acquire.wait", now - started)

    def term_ended(self, how: str, seconds: float) -> None:
        """A term held ``seconds`` ended ``how`` (``deposed``, ``resigned``, ``stopped``)."""
        with self._lock:
            self._counts[f"election.{how}"] += 1
            self._timed("election.term", seconds)

    def tracked(self) -> int:
        """How many leases handed out by this store are being timed now."""
        with self._lock:
            return len(self._held)
