"""The rules of keeping one lease alive, shared by the thread keeper and the task keeper.

:class:`LeaseReckoning` holds them: the lease, the local deadline and its margin, when a
loss is recorded, and what to send next, written as generators of *steps* (:class:`Send`
something, :class:`Wait` until some instant) that do no waiting and no I/O of their own.
:class:`fencing.Heartbeat` (:mod:`.thread`) carries the steps out on a thread;
:class:`fencing.asyncio.AsyncHeartbeat` (:mod:`.task`) carries the very same steps out in an
asyncio task, awaiting an async store. The promises they keep are told in :mod:`.thread`.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from .._errors import (
    ConfigurationError,
    DatabaseError,
    FencingError,
    InvalidArgument,
    InvalidArgumentType,
    LeaseLost,
)
from .._runtime import holds
from .._sql.checks import check_interval, check_time, check_ttl
from .._sql.values import Lease, Refusal
from .steps import Rules, Send, Step, Wait

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncLeaseKeeper", "Flag", "LeaseKeeper", "LeaseReckoning"]

logger = logging.getLogger("fencing.heartbeat")  # the name operators filter on

#: after a database error, retry this many times per interval (never past the deadline)
RETRIES_PER_INTERVAL = 4
#: while a fenced block of this process holds the lease's row: how often to look again (s)
HOLD_POLL = 0.05
#: the margin for a store that does not say its clock's resolution (``clock_resolution``)
UNKNOWN_CLOCK_MARGIN = 0.002


class LeaseKeeper(Protocol):
    """What a heartbeat needs from a store (:class:`fencing.JobStore` is one)."""

    def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | Refusal: ...

    def release(self, lease: Lease) -> Literal[True] | Refusal: ...


class AsyncLeaseKeeper(Protocol):
    """What an async heartbeat needs from a store (:class:`fencing.asyncio.AsyncJobStore` is one)."""

    async def renew(self, lease: Lease, *, ttl: float, now: float | None = None) -> Lease | Refusal: ...

    async def release(self, lease: Lease) -> Literal[True] | Refusal: ...


class Flag(Protocol):
    """What ``lost`` is: a ``threading.Event`` or an ``asyncio.Event``."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...


#: the store a heartbeat renews through, and the kind of event its ``lost`` is
K = TypeVar("K", bound="LeaseKeeper | AsyncLeaseKeeper")
E = TypeVar("E", bound=Flag)


# -- the rules -----------------------------------------------------------------------------------


class LeaseReckoning(Generic[K, E], abc.ABC):
    """The rules of keeping one lease, shared by :class:`Heartbeat` (a thread) and
    :class:`~fencing._store.heartbeat_task.AsyncHeartbeat` (an asyncio task).

    It checks the arguments, keeps the lease and its local deadline, records a loss once and
    never revives the lease, and says what to do next as :data:`Rules` (:meth:`_start_rules`,
    :meth:`_beat_rules`, :meth:`_release_rules`). A subclass carries the steps out, makes
    its events (:meth:`_new_event`: ``lost``, and ``_wake``, which :meth:`_stop` sets to end a
    :class:`Wait`) and may say how they are set from another thread (:meth:`_signal`). Every
    change is made under one lock: the read side is safe from any thread.
    """

    #: what renews, in messages: "thread" or "task"
    _runner = "thread"
    #: what the store must be, in messages
    _store_kind = "a fencing.JobStore"
    #: whether the store's methods are coroutine functions (awaited by the task)
    _awaits = False

    def __init__(
        self,
        store: K,
        lease: Lease,
        ttl: float,
        *,
        interval: float | None = None,
        clock: Callable[[], float] | None = None,
        on_lost: Callable[[Self], object] | None = None,
        release_on_exit: bool = False,
        release_on_error: bool = True,
        claimed_at: float | None = None,
    ) -> None:
        for method in ("renew", "release"):
            if not callable(getattr(store, method, None)):
                raise InvalidArgumentType(
                    f"store must have renew() and release() ({self._store_kind}), got {type(store).__name__}"
                )
        if inspect.iscoroutinefunction(store.renew) is not self._awaits:
            other = "a coroutine function" if not self._awaits else "not a coroutine function"
            raise InvalidArgumentType(
                f"store must have renew() and release() ({self._store_kind}), got "
                f"{type(store).__name__}, whose renew() is {other}: "
                + ("use fencing.Heartbeat" if self._awaits else "use fencing.asyncio.AsyncHeartbeat")
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
        #: taken off every deadline: the database's clock reads up to its resolution early
        resolution = getattr(store, "clock_resolution", None)
        if clock is not None:
            self._margin = 0.0  # the caller's clock is read after the send; held also checks it
        elif isinstance(resolution, float) and resolution >= 0:
            self._margin = 2 * resolution
        else:
            self._margin = UNKNOWN_CLOCK_MARGIN
        if claimed_at is not None and (
            isinstance(claimed_at, bool)
            or not isinstance(claimed_at, (int, float))
            or not -math.inf < claimed_at <= time.monotonic()
        ):
            raise InvalidArgument(
                f"claimed_at must be time.monotonic() read before the claim, got {claimed_at!r:.80}"
            )
        #: the lease was just claimed with this ttl, ``time.monotonic()`` read before the claim
        #: was sent: the deadline counts from there, and start() sends no renewal
        self._claimed_at = claimed_at
        self._on_lost = on_lost
        self._release_on_exit = release_on_exit
        self._release_on_error = release_on_error

        # _lease, _deadline, _released, _reason, _error, _failure and _gone change only under _lock
        self._lock = threading.Lock()
        self._lease = lease
        self._deadline = -math.inf  # nothing is vouched for before the first renewal
        self._released = False
        self._reason: str | None = None
        #: the store's refusal that lost the lease, if a refused renewal did
        self._refusal: Refusal | None = None
        self._error: BaseException | None = None
        self._failure: BaseException | None = None  # the last renewal error, while retrying
        self._completed = False  # the job was completed under this lease: nothing to keep
        self._gone = False  # the loss is recorded (``lost`` is set, or is being set)
        self._stopping = False
        self._started = False
        self._lost = self._new_event()
        self._wake = self._new_event()  # set by stop()

    def __repr__(self) -> str:
        lease = self.lease
        state = "held" if self.held else "lost" if self._gone else "not held"
        state = "completed" if self._completed else state
        token = f"job={lease.job_id!r} owner={lease.owner!r} fence={lease.fence}"
        return f"<{type(self).__name__} {token} {state}>"

    # -- the loop's events ----------------------------------------------------------------------

    @abc.abstractmethod
    def _new_event(self) -> E:
        """A new event of the kind the loop waits on."""

    def _signal(self, event: E) -> None:
        """Set ``event`` (``lost`` or ``_wake``), from whichever thread notices."""
        event.set()

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
    def lost(self) -> E:
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

        ``False`` before start, after a release, and forever once lost.
        """
        now = self._now()
        with self._lock:
            return self._held_locked(now)

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is held (call it before anything irreversible)."""
        if not self.held:
            raise self._lost_error()

    def _lost_error(self) -> LeaseLost:
        """The :class:`LeaseLost` of this loss: its ``reason`` the store's, where one refused."""
        lost = LeaseLost(self._describe_loss())
        with self._lock:
            lost.reason = None if self._refusal is None else self._refusal.reason
        return lost

    # -- what a fenced block tells (see JobStore.fenced) ----------------------------------------

    def _completed_by_block(self) -> None:
        """A fenced block completed the job under this lease and committed (called by the store)."""
        with self._lock:
            if not self._gone:
                self._completed = True
        self._stop()  # nothing left to renew

    @property
    def _key(self) -> holds.Key | None:
        """Where this process's fenced blocks on the same table can be seen (JobStore only),
        as the store knows its database now (it says who it is once it has connected)."""
        key: holds.Key | None = getattr(self._store, "holds_key", None)
        return key

    def _extended(self, renewed: Lease, sent: float) -> None:
        """A fenced block that extended the lease has committed (called by the store)."""
        if renewed.fence == self._lease.fence and renewed.owner == self._lease.owner:
            self._accept(renewed, sent)

    # -- the rules, as steps -------------------------------------------------------------------

    def _start_rules(self) -> Rules[None]:
        """Renew once now: refused inside a block on the lease, :class:`LeaseLost` if the
        renewal is refused (a database error from it goes through: the heartbeat is spent)."""
        job_id = self._lease.job_id
        if self._key is not None:
            here = yield Send(functools.partial(holds.held_here, self._key, job_id), local=True)
            if here is not None:
                raise ConfigurationError(
                    f"a fenced block of this {self._runner} holds job {job_id!r}: a renewal would wait "
                    f"for it; start the {type(self).__name__} before the block (the block then extends "
                    "the lease itself)"
                )
        with self._lock:
            if self._started:
                raise RuntimeError(f"a {type(self).__name__} can only be started once")
            self._started = True
        if self._claimed_at is not None:  # as good as a renewal sent at that instant
            self._accept(self._lease, self._claimed_at)
        else:
            sent = time.monotonic()
            with self._renewing() as blocked:
                # a block of another thread (or task) may hold the row: this first renewal waits for it
                del blocked
                renewed = yield self._send_renewal(self._lease, self._now())
            if not renewed:
                self._lose(f"the first renewal was refused ({_why(renewed)})", None, renewed)
                self._log_lost()
                raise self._lost_error()
            self._accept(renewed, sent)
        if self._key is not None:
            holds.keep(self._key, job_id, self)

    def _beat_rules(self) -> Rules[None]:
        """Renew every interval until stopped, lost or completed (after :meth:`_start_rules`)."""
        next_at = self._next_due()  # one interval after the first send
        while True:
            yield Wait(next_at)
            if self._stopping:
                return
            sent = time.monotonic()  # before reading the clock: the deadline stays conservative
            now = self._now()
            with self._lock:
                if self._gone or self._completed or self._expire_locked(now):
                    return
                lease = self._lease
            try:
                with self._renewing() as blocking:
                    if blocking is None:
                        renewed = yield self._send_renewal(lease, now)
                if blocking is not None:
                    if not (yield from self._wait_for_hold(blocking)):
                        return
                    next_at = self._next_due()
                    continue
            except DatabaseError as exc:
                # maybe transient (a server restart, a network blip): retry, but not past the deadline
                with self._lock:
                    first, self._failure = self._failure is None, exc
                level = logging.WARNING if first else logging.DEBUG  # once per run of failures
                logger.log(level, "renewing %r failed, retrying until its deadline: %s", lease, exc)
                next_at = min(time.monotonic() + self._interval / RETRIES_PER_INTERVAL, self.deadline)
                continue
            if not renewed:
                if not self._completed_here(lease, renewed):
                    self._lose(f"a renewal was refused ({_why(renewed)})", None, renewed)
                return
            if not self._accept(renewed, sent):
                return
            next_at = sent + self._interval

    def _release_rules(self) -> Rules[None]:
        """Release the lease if it is still held; a failure is logged, never raised."""
        try:
            now = self._now()
        except FencingError:
            now = None  # a broken clock must not hide the block's outcome; the deadline still counts
        with self._lock:
            if not self._held_locked(now):
                return
            self._released = True  # once it is sent, the lease can no longer be vouched for
            lease = self._lease
        if self._key is not None:
            here = yield Send(functools.partial(holds.held_here, self._key, lease.job_id), local=True)
            if here is not None:
                # the release would wait for this thread's own fenced block, which rolls back
                logger.warning("not releasing %r inside a fenced block on it; it expires at its until", lease)
                return
        try:
            yield Send(functools.partial(self._store.release, lease))
        except Exception:
            logger.warning("releasing %r failed; it expires at its until instead", lease, exc_info=True)

    def _wait_for_hold(self, hold: holds.Hold) -> Generator[Step, Any, bool]:
        """Wait (sending nothing) while a block of this process holds the lease's row;
        False once stopped or lost meanwhile."""
        while hold.live():
            if self._stopping:
                return False
            with self._lock:
                if self._gone or self._expire_locked(self._now()):
                    return False
            yield Wait(min(time.monotonic() + HOLD_POLL, self.deadline), hold=True)
        return not self._stopping

    def _completed_here(self, lease: Lease, refused: object) -> bool:
        """Whether a refused renewal met the job completed under this very lease (by a
        fenced block or ``complete`` the heartbeat was not stopped for): not a loss. The
        refusal says so (its row read in the renewal's transaction): nothing is read again."""
        done = (
            isinstance(refused, Refusal)
            and refused.reason == "done"
            and (refused.holder, refused.current_fence) == (lease.owner, lease.fence)
        )
        if done:
            with self._lock:
                self._completed = True
        return done

    def _send_renewal(self, lease: Lease, now: float | None) -> Send:
        return Send(functools.partial(self._store.renew, lease, ttl=self._ttl, now=now))

    # -- helpers -------------------------------------------------------------------------------

    def _stop(self) -> None:
        self._stopping = True
        self._signal(self._wake)

    def _call_on_lost(self: Self) -> object:
        """What ``on_lost(self)`` returns (``None`` without one); what it raises goes through."""
        return None if self._on_lost is None else self._on_lost(self)

    def _releases_on_exit(self, exc_type: type[BaseException] | None) -> bool:
        return self._release_on_exit or (exc_type is not None and self._release_on_error)

    def _next_due(self) -> float:
        """One interval after the send the deadline counts from."""
        with self._lock:
            return self._deadline - self._ttl + self._margin + self._interval

    def _now(self) -> float | None:
        # a clock that returns nan would make "now >= until" false forever: refuse it, by name
        return None if self._clock is None else check_time("clock()", self._clock())

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

    def _held_locked(self, now: float | None) -> bool:
        if self._completed or self._gone or self._released or self._deadline == -math.inf:
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
            if self._gone:
                return False
            self._lease = renewed
            self._deadline = sent + self._ttl - self._margin
            self._failure = None
            return True

    def _lose(self, reason: str, error: BaseException | None, refused: object = None) -> None:
        with self._lock:
            if not self._gone and isinstance(refused, Refusal):
                self._refusal = refused
            self._mark_lost_locked(reason, error)

    def _mark_lost_locked(self, reason: str, error: BaseException | None) -> None:
        if self._gone:
            return
        self._gone = True
        self._reason = reason
        self._error = error
        self._signal(self._lost)

    def _log_lost(self) -> None:
        """The one WARNING line of a loss (once it is recorded; by whoever reports it)."""
        with self._lock:
            lease, reason, error = self._lease, self._reason, self._error
        logger.warning(
            "lost the lease on job %r (owner %r, fence %d): %s",
            lease.job_id,
            lease.owner,
            lease.fence,
            reason,
            extra={
                "path": "heartbeat",
                "job_id": lease.job_id,
                "owner": lease.owner,
                "fence": lease.fence,
                "reason": reason,
                "error": None if error is None else repr(error),
            },
        )

    def _describe_loss(self) -> str:
        with self._lock:
            lease, reason, released = self._lease, self._reason, self._released
        if reason is None and self._completed:
            reason = "the job was completed under it"
        if reason is None:
            reason = "it was released" if released else "no renewal has succeeded yet"
        token = f"job {lease.job_id!r}, owner {lease.owner!r}, fence {lease.fence}"
        return f"the lease ({token}) is not held: {reason}"


# -- a refused renewal, told ---------------------------------------------------------------------


def _why(refused: object) -> str:
    """A refused renewal's reason, as the store said it (a keeper that is not a store may say
    only that it refused)."""
    if isinstance(refused, Refusal):
        return refused.reason
    return "stale fence, done or expired"
