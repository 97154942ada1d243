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
Once ``False`` it never turns ``True`` again: a lost lease is never revived.

**With a fenced block on the same lease** (``store.fenced(heartbeat.lease)`` while the
heartbeat runs, in any thread of this process), the block holds the job's row until its
transaction ends, so the heartbeat sends no renewal meanwhile: it waits for the block
(:mod:`fencing.holds`), and :meth:`stop` inside the block returns at once. The block itself
extends the lease by the heartbeat's ``ttl`` when it begins, so it has a whole ``ttl`` to
finish, and once it commits the heartbeat counts its deadline from there. A block that
completes the job ends the heartbeat quietly (``held`` is ``False``, ``lost`` is not set).
Starting a heartbeat inside a block on its own lease is refused at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Protocol

from . import holds
from .checks import check_interval, check_time, check_ttl
from .errors import (
    ConfigurationError,
    DatabaseError,
    FencingError,
    InvalidArgumentType,
    LeaseLost,
)
from .values import Lease

__all__ = ["Heartbeat", "LeaseKeeper", "LeaseLost"]

logger = logging.getLogger(__name__)

#: after a database error, retry this many times per interval (never past the deadline)
RETRIES_PER_INTERVAL = 4
#: while a fenced block of this process holds the lease's row: how often to look again (s)
HOLD_POLL = 0.05
#: the margin for a store that does not say its clock's resolution (``clock_resolution``)
UNKNOWN_CLOCK_MARGIN = 0.002


class LeaseKeeper(Protocol):
    """What a heartbeat needs from a store (:class:`fencing.JobStore` is one)."""

    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | None: ...

    def release(self, lease: Lease) -> bool: ...


class Heartbeat:
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
    """

    def __init__(
        self,
        store: LeaseKeeper,
        lease: Lease,
        ttl: float,
        *,
        interval: float | None = None,
        clock: Callable[[], float] | None = None,
        on_lost: Callable[[Heartbeat], object] | None = None,
        release_on_exit: bool = False,
        release_on_error: bool = True,
    ) -> None:
        for method in ("renew", "release"):
            if not callable(getattr(store, method, None)):
                raise InvalidArgumentType(
                    f"store must have renew() and release() (a fencing.JobStore), got {type(store).__name__}"
                )
        if not isinstance(lease, Lease):
            raise InvalidArgumentType(
                f"lease must be a fencing.Lease, got {type(lease).__name__} {lease!r:.80}"
            )
        self._ttl = check_ttl(ttl)
        self._interval = check_interval(interval, self._ttl)
        for name, value in (("clock", clock), ("on_lost", on_lost)):
            if value is not None and not callable(value):
                raise InvalidArgumentType(f"{name} must be callable or None, got {type(value).__name__}")
        for name, flag in (("release_on_exit", release_on_exit), ("release_on_error", release_on_error)):
            if not isinstance(flag, bool):
                raise InvalidArgumentType(f"{name} must be a bool, got {type(flag).__name__} {flag!r:.80}")
        self._store = store
        self._clock = clock
        #: where this process's fenced blocks on the same table can be seen (JobStore only)
        self._key: holds.Key | None = getattr(store, "holds_key", None)
        #: taken off every deadline: the database's clock reads up to its resolution early
        resolution = getattr(store, "clock_resolution", None)
        if clock is not None:
            self._margin = 0.0  # the caller's clock is read after the send; held also checks it
        elif isinstance(resolution, float) and resolution >= 0:
            self._margin = 2 * resolution
        else:
            self._margin = UNKNOWN_CLOCK_MARGIN
        self._on_lost = on_lost
        self._release_on_exit = release_on_exit
        self._release_on_error = release_on_error

        # _lease, _deadline, _released, _reason, _error and _failure change only under _lock
        self._lock = threading.Lock()
        self._lease = lease
        self._deadline = -math.inf  # nothing is vouched for before the first renewal
        self._released = False
        self._reason: str | None = None
        self._error: BaseException | None = None
        self._failure: BaseException | None = None  # the last renewal error, while retrying
        self._completed = False  # the job was completed under this lease: nothing to keep
        self._lost = threading.Event()
        self._stopping = threading.Event()
        self._started = False
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        lease = self.lease
        state = "held" if self.held else "lost" if self._lost.is_set() else "not held"
        state = "completed" if self._completed else state
        return f"<Heartbeat job={lease.job_id!r} owner={lease.owner!r} fence={lease.fence} {state}>"

    # -- what a worker reads -----------------------------------------------------------------

    @property
    def ttl(self) -> float:
        return self._ttl

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def margin(self) -> float:
        """Seconds taken off each local deadline for the database clock's resolution."""
        return self._margin

    @property
    def lease(self) -> Lease:
        """The latest lease: its ``until`` is the one the last successful renewal returned."""
        with self._lock:
            return self._lease

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` after which the lease is not vouched for (``-inf`` before start)."""
        with self._lock:
            return self._deadline

    @property
    def lost(self) -> threading.Event:
        """Set once the lease is lost; it is never cleared."""
        return self._lost

    @property
    def reason(self) -> str | None:
        """Why the lease was lost, or ``None``."""
        with self._lock:
            return self._reason

    @property
    def error(self) -> BaseException | None:
        """The exception behind the loss, if an error (not a refusal or the clock) caused it."""
        with self._lock:
            return self._error

    @property
    def held(self) -> bool:
        """Whether the lease is still vouched for: no database round trip, safe from any thread.

        ``False`` before :meth:`start`, after a release, and forever once lost.
        """
        now = self._now()
        with self._lock:
            return self._held_locked(now)

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is held (call it before anything irreversible)."""
        if not self.held:
            raise LeaseLost(self._describe_loss())

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> Heartbeat:
        """Renew once now, then keep renewing on a daemon thread; a second start is an error.

        Raises :class:`LeaseLost` if this first renewal is refused, and lets a database
        error from it propagate (no thread is started then, and the heartbeat is spent).
        """
        job_id = self._lease.job_id
        if self._key is not None and holds.held_here(self._key, job_id) is not None:
            raise ConfigurationError(
                f"a fenced block of this thread holds job {job_id!r}: a renewal would wait for it; "
                "start the Heartbeat before the block (the block then extends the lease itself)"
            )
        with self._lock:
            if self._started:
                raise RuntimeError("a Heartbeat can only be started once")
            self._started = True
        sent = time.monotonic()
        with self._renewing() as blocked:
            # a block of another thread may hold the row: this first renewal waits for it
            del blocked
            renewed = self._store.renew(self._lease, ttl=self._ttl, now=self._now())
        if renewed is None:
            with self._lock:
                self._mark_lost_locked("the first renewal was refused (stale fence, done or expired)", None)
            raise LeaseLost(self._describe_loss())
        self._accept(renewed, sent)
        if self._key is not None:
            holds.keep(self._key, job_id, self)
        thread = threading.Thread(
            target=self._run, name=f"fencing-heartbeat-{renewed.job_id:.40}", daemon=True
        )
        self._thread = thread
        try:
            thread.start()
        except BaseException:
            self._forget()
            raise
        return self

    def stop(self) -> None:
        """Stop renewing and join the thread (waits only for a renewal already in flight).

        Idempotent; safe before :meth:`start` and from ``on_lost``. The lease is not released.
        """
        self._stopping.set()
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
            if self._release_on_exit or (exc_type is not None and self._release_on_error):
                self._release_quietly()

    # -- the heartbeat thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._beat()
        except BaseException as exc:  # nothing may escape a thread; the loss is the report
            with self._lock:
                self._mark_lost_locked(f"the heartbeat failed: {exc!r}", exc)
        finally:
            self._forget()
        if self._lost.is_set():
            self._report_lost()

    def _forget(self) -> None:
        if self._key is not None:
            holds.forget(self._key, self._lease.job_id, self)

    @contextlib.contextmanager
    def _renewing(self) -> Iterator[holds.Hold | None]:
        if self._key is None:
            yield None
            return
        with holds.renewing(self._key, self._lease.job_id) as blocking:
            yield blocking

    def _wait_for_hold(self, hold: holds.Hold) -> bool:
        """Wait (sending nothing) while a block of this process holds the lease's row;
        False once stopped or lost meanwhile."""
        while hold.live():
            if self._stopping.is_set():
                return False
            with self._lock:
                if self._lost.is_set() or self._expire_locked(self._now()):
                    return False
            holds.wait_for_change(min(HOLD_POLL, max(0.0, self.deadline - time.monotonic())))
        return not self._stopping.is_set()

    def _beat(self) -> None:
        # one interval after the first send
        next_at = self.deadline - self._ttl + self._margin + self._interval
        while not self._stopping.wait(max(0.0, next_at - time.monotonic())):
            sent = time.monotonic()  # before reading the clock: the deadline stays conservative
            now = self._now()
            with self._lock:
                if self._lost.is_set() or self._completed:
                    return
                if self._expire_locked(now):
                    return
                lease = self._lease
            try:
                with self._renewing() as blocking:
                    if blocking is None:
                        renewed = self._store.renew(lease, ttl=self._ttl, now=now)
                if blocking is not None:
                    if not self._wait_for_hold(blocking):
                        return
                    with self._lock:
                        next_at = self._deadline - self._ttl + self._margin + self._interval
                    continue
            except DatabaseError as exc:
                # maybe transient (a server restart, a network blip): retry, but not past the deadline
                with self._lock:
                    first, self._failure = self._failure is None, exc
                level = logging.WARNING if first else logging.DEBUG  # once per run of failures
                logger.log(level, "renewing %r failed, retrying until its deadline: %s", lease, exc)
                next_at = min(time.monotonic() + self._interval / RETRIES_PER_INTERVAL, self.deadline)
                continue
            if renewed is None:
                if self._completed_here(lease):
                    return
                with self._lock:
                    self._mark_lost_locked("a renewal was refused (stale fence, done or expired)", None)
                return
            if not self._accept(renewed, sent):
                return
            next_at = sent + self._interval

    def _report_lost(self) -> None:
        if self._on_lost is None:
            return
        try:
            self._on_lost(self)
        except Exception:
            logger.exception("on_lost raised for %r", self)

    # -- helpers -------------------------------------------------------------------------------

    def _now(self) -> float | None:
        # a clock that returns nan would make "now >= until" false forever: refuse it, by name
        return None if self._clock is None else check_time("clock()", self._clock())

    def _completed_here(self, lease: Lease) -> bool:
        """Whether a refused renewal met the job completed under this very lease (by a
        fenced block or ``complete`` the heartbeat was not stopped for): not a loss."""
        state = getattr(self._store, "state", None)
        if state is None:
            return False
        try:
            row = state(lease.job_id)
        except FencingError:
            return False
        done = row is not None and row.done and (row.owner, row.fence) == (lease.owner, lease.fence)
        if done:
            with self._lock:
                self._completed = True
        return done

    def _completed_by_block(self) -> None:
        """A fenced block completed the job under this lease and committed (called by the store)."""
        with self._lock:
            if not self._lost.is_set():
                self._completed = True
        self._stopping.set()  # nothing left to renew

    def _extended(self, renewed: Lease, sent: float) -> None:
        """A fenced block that extended the lease has committed (called by the store)."""
        if renewed.fence == self._lease.fence and renewed.owner == self._lease.owner:
            self._accept(renewed, sent)

    def _held_locked(self, now: float | None) -> bool:
        if self._completed or self._lost.is_set() or self._released or self._deadline == -math.inf:
            return False
        return not self._expire_locked(now)  # whoever notices first records the loss

    def _expire_locked(self, now: float | None) -> bool:
        """Record the loss if the lease is expired by local reckoning; whether it is."""
        until = self._lease.until
        if time.monotonic() >= self._deadline:
            reason = "the local deadline passed without a successful renewal"
            if self._failure is not None:
                reason = f"renewals kept failing until the local deadline passed: {self._failure!r}"
        elif now is not None and until is not None and now >= until:
            reason = f"the clock reached the lease's until ({now!r} >= {until!r})"
        else:
            return False
        self._mark_lost_locked(reason, self._failure)
        return True

    def _accept(self, renewed: Lease, sent: float) -> bool:
        """Take a successful renewal, unless the loss was already recorded (never revive)."""
        with self._lock:
            if self._lost.is_set():
                return False
            self._lease = renewed
            self._deadline = sent + self._ttl - self._margin
            self._failure = None
            return True

    def _mark_lost_locked(self, reason: str, error: BaseException | None) -> None:
        if self._lost.is_set():
            return
        self._reason = reason
        self._error = error
        self._lost.set()

    def _describe_loss(self) -> str:
        with self._lock:
            lease, reason, released = self._lease, self._reason, self._released
        if reason is None and self._completed:
            reason = "the job was completed under it"
        if reason is None:
            reason = "it was released" if released else "no renewal has succeeded yet"
        token = f"job {lease.job_id!r}, owner {lease.owner!r}, fence {lease.fence}"
        return f"the lease ({token}) is not held: {reason}"

    def _release_quietly(self) -> None:
        try:
            now = self._now()
        except FencingError:
            now = None  # a broken clock must not hide the block's outcome; the deadline still counts
        with self._lock:
            if not self._held_locked(now):
                return
            self._released = True  # once it is sent, the lease can no longer be vouched for
            lease = self._lease
        if self._key is not None and holds.held_here(self._key, lease.job_id) is not None:
            # the release would wait for this thread's own fenced block, which rolls back
            logger.warning("not releasing %r inside a fenced block on it; it expires at its until", lease)
            return
        try:
            self._store.release(lease)
        except Exception:
            logger.warning("releasing %r failed; it expires at its until instead", lease, exc_info=True)
