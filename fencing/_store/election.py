"""Leader election on a named lock: the leader holds a term, and every write under it is fenced.

Each candidate runs an :class:`Election` on the same name. A background thread campaigns:
while another candidate leads, it reads who leads once per ``retry`` seconds (the only load
a follower puts on the database); when no live lease holds the name it tries to take it.
The candidate that takes it is the leader, for a **term**: the lock's token, one above every
term the name ever had. A heartbeat renews the lease every ``interval``; the leader is told
it lost the term the moment a renewal is refused or fails past its local deadline, and then
campaigns again (a new term, if it wins).

Why a term and not only a lease: a leader that stalls (a GC pause, ``SIGSTOP``, a network
partition) past its ``ttl`` is replaced, and when it wakes it still believes it leads until
its next renewal fails. Every write it makes through :meth:`Election.fenced` checks the term
in the database, in the transaction that stores it, so those writes are refused: two leaders
may exist in their own minds for a moment, never in the data. (An advisory-lock election has
no such check: a leader whose session the server ended keeps writing.)

**Watched** on the locks' metrics (``election.elected``, ``election.deposed``,
``election.resigned``, ``election.stopped``, the timing ``election.term``:
:mod:`fencing._runtime.metrics`) and on the logger ``fencing.election`` (elected, stepped
down, deposed and why: :mod:`fencing._runtime.events`), counted by the shared rules, so both
fronts alike.

**One set of rules.** :class:`ElectionRules` holds the campaign as a generator of steps
(:class:`~fencing._store.steps.Send` a call, :class:`~fencing._store.steps.Wait` a while), as
the heartbeat's rules are written: :class:`Election` carries them out on a thread with a
:class:`~fencing.Heartbeat`, :class:`fencing.asyncio.AsyncElection` in an asyncio task with an
:class:`~fencing.asyncio.AsyncHeartbeat`.

Anchors: client-go's ``leaderelection`` (lease duration, retry period, started/stopped
leading, new leader, release on cancel), etcd's ``concurrency.Election`` (campaign, resign,
leader, observe).
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .._errors import InvalidArgumentType, LeaseLost
from .._runtime import holds
from .._runtime.execution import CallerConnection
from .._sql.checks import check_interval, check_lock_name, check_ttl
from .._sql.values import Lease
from .heartbeat import Heartbeat
from .jobstore import JobStore
from .locks import Locks
from .rules import HOLD_POLL
from .steps import Rules, Send, Wait, drive

__all__ = ["DEFAULT_RETRY", "DEFAULT_TTL", "Election", "ElectionRules"]

logger = logging.getLogger("fencing.election")

#: a term's lease (seconds): how long a stalled leader keeps the others waiting
DEFAULT_TTL = 15.0
#: how often a follower reads who leads, and tries when no one does (seconds; at most ttl / 3)
DEFAULT_RETRY = 2.0


class ElectionRules(abc.ABC):
    """The campaign of ``candidate`` for ``name``, shared by the thread and the task.

    A subclass says what its locks are (:meth:`_sync_store`), makes the heartbeat that keeps
    a term (:meth:`_new_heartbeat`) and carries the steps out."""

    _locks_kind = "a fencing.Locks"

    def __init__(
        self,
        locks: Any,
        name: str,
        candidate: str,
        *,
        ttl: float = DEFAULT_TTL,
        interval: float | None = None,
        retry: float | None = None,
        on_elected: Callable[[Lease], object] | None = None,
        on_deposed: Callable[[Lease, str | None], object] | None = None,
        on_new_leader: Callable[[Lease | None], object] | None = None,
    ) -> None:
        store = self._sync_store(locks)
        self._ttl = check_ttl(ttl)
        self._interval = check_interval(interval, self._ttl)
        if retry is None:
            self._retry = min(DEFAULT_RETRY, self._ttl / 3)
        else:
            self._retry = check_interval(retry, self._ttl, name="retry")
        self.name = check_lock_name(name)
        self.candidate = store.check_key(candidate, name="candidate")
        callbacks = {"on_elected": on_elected, "on_deposed": on_deposed, "on_new_leader": on_new_leader}
        for what, callback in callbacks.items():
            if callback is not None and not callable(callback):
                raise InvalidArgumentType(f"{what} must be callable or None, got {type(callback).__name__}")
        self.locks = locks
        #: where the campaign counts (the store's metrics: ``locks.metrics``)
        self._metrics = store.metrics
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._on_new_leader = on_new_leader
        #: the campaign ends at its next step; ``_resign``: releasing the term as it does
        self._stopping = False
        self._resign = True
        self._heartbeat: Any = None
        self._leader: Lease | None = None
        self._make_events()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} candidate={self.candidate!r} leading={self.is_leader}>"

    @abc.abstractmethod
    def _sync_store(self, locks: Any) -> JobStore:
        """The sync store behind ``locks``, or the error for what ``locks`` may not be."""

    @abc.abstractmethod
    def _make_events(self) -> None:
        """Make the events of the thread or task that carries the campaign out: ``_wake``
        (set by stop() and by the heartbeat's loss: a wait of the campaign ends at once) and
        ``elected`` (set while this candidate leads)."""

    @abc.abstractmethod
    def _new_heartbeat(self, lease: Lease) -> Any:
        """What keeps a term: a heartbeat on ``lease`` that wakes the campaign when lost."""

    @abc.abstractmethod
    def _set_elected(self, elected: bool) -> None:
        """Set or clear the ``elected`` event."""

    # -- what the application reads --------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Whether this candidate leads and can still vouch for its term (no round trip)."""
        heartbeat = self._heartbeat
        return heartbeat is not None and bool(heartbeat.held)

    @property
    def lease(self) -> Lease | None:
        """This candidate's lease while it leads (``fence`` is the term), else ``None``."""
        heartbeat = self._heartbeat
        return heartbeat.lease if heartbeat is not None and heartbeat.held else None

    @property
    def term(self) -> int | None:
        lease = self.lease
        return None if lease is None else lease.fence

    @property
    def leader(self) -> Lease | None:
        """The leader as this candidate last knew it (itself while it leads; else read at
        most once per ``retry``), or ``None`` when no one led then."""
        own = self.lease
        return own if own is not None else self._leader

    def _leading(self) -> Lease:
        lease = self.lease
        if lease is None:
            raise LeaseLost(f"{self.candidate!r} does not lead {self.name!r}")
        return lease

    def _holds_key(self) -> holds.Key | None:
        """Where this process's fenced blocks on the locks' rows are seen
        (:mod:`fencing._runtime.holds`)."""
        key: holds.Key | None = getattr(self.locks.store, "holds_key", None)
        return key

    def _caller_holds_the_name(self) -> bool:
        """Whether the caller (this thread; inside asyncio's bridge, its task) holds, in a
        fenced block or a ``check(conn=)``, what the campaign's writes on the name wait for:
        the name's row (SQLite: the database's write lock)."""
        key = self._holds_key()
        return key is not None and holds.held_here(key, self.name) is not None

    # -- the rules ---------------------------------------------------------------------------

    def _campaign_rules(self) -> Rules[None]:
        locks, name, candidate = self.locks, self.name, self.candidate
        while not self._stopping:
            lease = current = None
            try:
                current = yield Send(functools.partial(locks.holder, name))
                if current is None:
                    lease = yield Send(functools.partial(locks.try_acquire, name, candidate, ttl=self._ttl))
            except Exception:
                logger.warning("election %r: could not read or take the lock", name, exc_info=True)
            if lease is not None:
                yield from self._lead_rules(lease)
                continue
            yield from self._saw(current)
            yield Wait(time.monotonic() + self._retry)

    def _lead_rules(self, lease: Lease) -> Rules[None]:
        """Hold the term until it is lost or the campaign stops."""
        heartbeat = self._new_heartbeat(lease)
        try:
            yield Send(heartbeat.start)  # renews once now
        except Exception as exc:  # lost before it began, or the database failed: campaign on
            logger.warning(
                "election %r: %r took term %d but could not begin it: %s",
                self.name,
                self.candidate,
                lease.fence,
                exc,
                extra=self._fields("not begun", lease.fence, reason=str(exc)),
            )
            yield from self._notify(self._on_deposed, lease, getattr(exc, "reason", None))
            return
        began = time.perf_counter()
        self._heartbeat = heartbeat
        self._set_elected(True)
        self._metrics.add("election.elected")
        logger.info(
            "election %r: %r elected, term %d",
            self.name,
            self.candidate,
            lease.fence,
            extra=self._fields("elected", lease.fence),
        )
        yield from self._saw(lease)
        yield from self._notify(self._on_elected, lease)
        while not self._stopping and heartbeat.held:
            # woken by the heartbeat's loss or a stop; the local deadline may pass unreported
            yield Wait(time.monotonic() + self._retry)
        if self._stopping and self._resign:
            kept = yield from self._resign_rules(heartbeat)
        else:
            kept = yield from self._step_down(heartbeat)
        held = time.perf_counter() - began
        if kept:  # stopped while leading
            how = "resigned" if self._resign else "stopped"
            self._metrics.term_ended(how, held)
            logger.info(
                "election %r: %r stepped down from term %d after %.3f s (%s)",
                self.name,
                self.candidate,
                lease.fence,
                held,
                "resigned" if self._resign else "stopped without resigning: the term runs out at its until",
                extra=self._fields(how, lease.fence, held=held),
            )
        else:
            self._metrics.term_ended("deposed", held)
            yield from self._log_deposed(lease.fence, heartbeat.reason, held)
            yield from self._notify(self._on_deposed, heartbeat.lease, heartbeat.reason)
        self._heartbeat = None

    def _step_down(self, heartbeat: Any) -> Rules[bool]:
        """Stop leading: whether the term was still held when its heartbeat stopped."""
        self._set_elected(False)
        kept = bool(heartbeat.held)
        yield Send(heartbeat.stop)
        return kept

    def _resign_rules(self, heartbeat: Any) -> Rules[bool]:
        """Step down and release the term once no fenced block of this process holds its row
        (the stopping caller's own, maybe: :meth:`Election.stop` inside ``fenced()``): the
        release would wait for that block's lock, and the block may be waiting for this stop.
        The block ends under the term; the release follows it, and a block that begins
        meanwhile waits for the release (:func:`fencing._runtime.holds.renewing`)."""
        key = self._holds_key()
        while heartbeat.held:
            kept = False
            with contextlib.nullcontext() if key is None else holds.renewing(key, self.name) as blocking:
                if blocking is None:
                    kept = yield from self._step_down(heartbeat)
                    if kept:
                        try:
                            yield Send(functools.partial(self.locks.release, heartbeat.lease))
                        except Exception:
                            logger.warning(
                                "election %r: could not resign; the term runs out", self.name, exc_info=True
                            )
            if blocking is None:
                return kept
            while blocking.live() and heartbeat.held:
                yield Wait(time.monotonic() + HOLD_POLL)
        return (yield from self._step_down(heartbeat))  # lost meanwhile: nothing to release

    def _fields(self, event: str, term: int, **more: Any) -> dict[str, Any]:
        """A ``fencing.election`` line's structured fields."""
        return {"event": event, "lock": self.name, "owner": self.candidate, "term": term, **more}

    def _log_deposed(self, term: int, reason: str | None, held: float) -> Rules[None]:
        """The WARNING of a lost term, with the lock's row as it is now (one read): a revoke
        shows as no holder and a term above the lost one, a takeover as another holder."""
        holder = current = None
        try:
            row = yield Send(functools.partial(self.locks.store.state, self.name))
        except Exception:
            row = None  # the line goes out all the same, without the row
        if row is not None:
            holder, current = row.owner, row.fence
        logger.warning(
            "election %r: %r deposed from term %d after %.3f s: %s (the lock now: holder %r, term %s)",
            self.name,
            self.candidate,
            term,
            held,
            reason,
            holder,
            current,
            extra=self._fields(
                "deposed", term, held=held, reason=reason, holder=holder, current_term=current
            ),
        )

    def _saw(self, leader: Lease | None) -> Rules[None]:
        last = self._leader
        self._leader = leader
        before = None if last is None else (last.owner, last.fence)
        now = None if leader is None else (leader.owner, leader.fence)
        if before != now:
            yield from self._notify(self._on_new_leader, leader)

    def _notify(self, callback: Callable[..., object] | None, *args: Any) -> Rules[None]:
        if callback is None:
            return
        try:
            yield Send(functools.partial(callback, *args))  # in a task, awaited if it is a coroutine
        except Exception:
            logger.exception("election %r: a callback raised", self.name)


class Election(ElectionRules):
    """``candidate``'s part in the election of a leader for ``name`` among the holders of
    ``locks`` (:class:`~fencing.Locks`).

    :meth:`start` (or ``with``) runs the campaign on a daemon thread; :meth:`stop` ends it
    and, if leading, steps down at once (``resign=True``) so the next leader does not wait a
    ``ttl``; so does interpreter exit. Callbacks, each called on the election's thread (an
    exception is logged, never raised): ``on_elected(lease)`` when this candidate becomes
    leader (``lease.fence`` is the term), ``on_deposed(lease, reason)`` when it stops being
    leader for any reason but :meth:`stop` (a refused or failed renewal: another term may
    have begun), ``on_new_leader(lease_or_none)`` whenever the leader it last read changes.

    ``ttl``: a term's lease; ``interval``: how often the leader renews it (default
    ``ttl / 3``); ``retry``: how often a follower reads and tries (default 2 s or ``ttl /
    3``, whichever is shorter; less than ``ttl``). A stalled leader is replaced ``ttl``
    after its last renewal, plus at most one ``retry``.
    """

    locks: Locks

    def _make_events(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: set while this candidate leads
        self.elected = threading.Event()

    def _sync_store(self, locks: Any) -> JobStore:
        if not isinstance(locks, Locks):
            raise InvalidArgumentType(f"locks must be a fencing.Locks, got {type(locks).__name__}")
        return locks.store

    def _new_heartbeat(self, lease: Lease) -> Heartbeat:
        return Heartbeat(
            self.locks.store, lease, self._ttl, interval=self._interval, on_lost=lambda _: self._wake.set()
        )

    def _set_elected(self, elected: bool) -> None:
        if elected:
            self.elected.set()
        else:
            self.elected.clear()

    def fenced(self, *, conn: CallerConnection | None = None) -> contextlib.AbstractContextManager[Any]:
        """A transaction for writes under this candidate's term (:meth:`Locks.fenced`):
        :class:`~fencing.LeaseLost` at once if it does not lead, and the block rolled back
        if its term ended meanwhile (a newer term exists, or the lease expired)."""
        return self.locks.fenced(self._leading(), conn=conn)

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> Election:
        """Campaign on a daemon thread; a second start is an error."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("this election was started already")
            self._thread = threading.Thread(
                target=self._run, name=f"fencing-election-{self.name:.40}", daemon=True
            )
        _RUNNING.add(self)
        self._thread.start()
        return self

    def stop(self, *, resign: bool = True) -> None:
        """Stop campaigning and join the thread; if leading, step down now (``resign``:
        release the term's lease, so another candidate takes over at its next try) or let
        the lease run out. Idempotent.

        Called inside a fenced block on the term (a leader stepping down from inside its
        work: ``with election.fenced(): ... election.stop()``), it returns at once without
        joining: the release would wait for the block's own row lock. The candidate leads
        until the block ends (its writes commit under the term, or roll back as usual), then
        steps down and releases the term; the thread ends then. The same for any block or
        ``check(conn=)`` of the calling thread on the name's row (SQLite: holding the
        database's write lock)."""
        self._resign = resign
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            if self._caller_holds_the_name():
                return  # the campaign ends after the caller's block (and is joined at exit)
            thread.join()
        _RUNNING.discard(self)

    def resign(self) -> None:
        """Step down now and stop campaigning (:meth:`stop` with ``resign=True``)."""
        self.stop(resign=True)

    def __enter__(self) -> Election:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the campaign thread -----------------------------------------------------------------

    def _run(self) -> None:
        drive(self._campaign_rules(), wake=self._wake)


#: elections whose thread runs: stepped down at interpreter exit
_RUNNING: weakref.WeakSet[Election] = weakref.WeakSet()


@atexit.register
def _resign_all() -> None:
    for election in list(_RUNNING):
        with contextlib.suppress(Exception):
            election.stop(resign=True)
