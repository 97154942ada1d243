"""Named locks whose token every write can be checked against.

A named lock is a row of a locks table with the jobs table's columns: its ``id`` is the
lock's name, and holding the lock is holding a lease on that row. So everything the library
guarantees of a job's lease holds of a lock, by the same statements: the token (the lease's
``fence``) only ever goes up, per name, and is never handed out twice, also after the name
is deleted (its row stays as a tombstone that keeps its fence); a lock held past its
``ttl`` without renewal is free for the next owner; and every write made under a token
(:meth:`Locks.fenced`, in the application's own transaction) is refused once the lock has
moved on, in the statement that stores it.

What a PostgreSQL advisory lock or a Redis lock cannot give: an advisory lock dies with the
holder's session while the holder's process still believes it holds it; here the holder
learns it lost the lock (its :class:`HeldLock` says so) and, more to the point, a write it
makes anyway is refused by the database.

**Watched** on the store's metrics (:attr:`Locks.metrics`: ``acquire.acquired``,
``acquire.timeout``, ``acquire.queued``, the timing ``acquire.wait``, ``hold.lost``:
:mod:`fencing._runtime.metrics`), counted by the rules both fronts share, and on the logger
``fencing.locks`` (a held lock lost: :mod:`fencing._runtime.events`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, Literal

from sqlalchemy import Engine, MetaData, Table

from .._errors import InvalidArgumentType, LeaseLost, LockTimeout
from .._runtime.execution import CallerConnection
from .._runtime.metrics import StoreMetrics
from .._sql.checks import check_lock_name, check_timeout, check_ttl
from .._sql.schema import jobs_table
from .._sql.values import Lease, Refusal
from .heartbeat import Heartbeat
from .history import History
from .lock_queue import LockStore, WaitQueue, keep_for, waiters_of
from .rules import E, LeaseReckoning
from .steps import Rules, Send, Wait, drive
from .waiting import Backoff
from .wakeups import Listener, listen

__all__ = [
    "DEFAULT_POLL",
    "HeldBase",
    "HeldLock",
    "Locks",
    "locks",
    "locks_table",
    "lost_reporter",
    "report_lost",
    "timed_out",
]

logger = logging.getLogger("fencing.locks")

#: the longest pause between two tries of a waiter for a held lock (seconds)
DEFAULT_POLL = 0.5


def locks_table(metadata: MetaData, name: str = "fencing_locks", *, schema: str | None = None) -> Table:
    """The named locks' table in ``metadata`` (for Alembic, as :func:`fencing.jobs_table`):
    the jobs table's columns, one row per name that was ever taken. Its waiters' queue,
    ``<name>_waiters`` (:mod:`fencing._store.lock_queue`), is put in ``metadata`` with it."""
    table = jobs_table(metadata, name, schema=schema)
    waiters_of(table)
    return table


#: the default locks table, in a ``MetaData`` of its own (``fencing.jobs.metadata`` holds the jobs
#: table alone, so ``create_all`` there is unchanged)
locks_metadata = MetaData()
locks = locks_table(locks_metadata)


class Locks:
    """Named locks in ``table`` (default ``fencing_locks``), through ``engine``.

    The store's rules apply as they are (it is a :class:`~fencing.JobStore` on that table,
    :attr:`store`): the engine is used as a guest, every operation takes ``now=`` (your
    clock) or reads the database's, and ``conn=`` runs it in your transaction. ``poll``: the
    longest pause of a waiter between two tries (:mod:`fencing._store.waiting`).
    """

    def __init__(
        self,
        engine: Engine,
        table: Table = locks,
        *,
        history: History | None = None,
        poll: float = DEFAULT_POLL,
        _bridged: bool = False,
    ) -> None:
        # _bridged: the sync rules of fencing.asyncio.AsyncLocks (JobStore's _bridged)
        #: the store the locks are rows of
        self.store = store = LockStore(engine, table, history=history, _bridged=_bridged)
        self.engine = store.engine
        self.table = store.table
        self.poll = check_ttl(poll, name="poll")
        #: the waiters' queue (:mod:`fencing._store.lock_queue`) and how long a ticket lives unrefreshed
        self.queue = WaitQueue(store, store.waiters, bridged=_bridged)
        self.keep = keep_for(self.poll)

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<Locks table={self.table.name!r} engine={url!r}>"

    @property
    def metrics(self) -> StoreMetrics:
        """The store's metrics, with the locks' and elections' own counters
        (:mod:`fencing._runtime.metrics`); ``fencing.otel.instrument(locks)`` exports them."""
        return self.store.metrics

    def create_table(self, *, conn: CallerConnection | None = None) -> None:
        """Create the locks table and its waiters' queue if missing (idempotent); raise if
        an existing locks table differs."""
        self.store.create_table(conn=conn)

    # -- taking a lock ----------------------------------------------------------------------

    def try_acquire(
        self,
        name: str,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> Lease | None:
        """Take ``name`` for ``owner`` for ``ttl`` seconds if no live lease holds it: its
        :class:`~fencing.Lease` (``job_id`` is the name, ``fence`` the token, one above every
        token the name ever had), or ``None`` if it is held, or if owners wait for it in its
        queue (:meth:`acquire`: no one cuts in). One try, no waiting. A name never taken (or
        deleted) is created first. The same owner holding it still gets ``None``:
        a lock is not re-entrant (renew the lease you hold)."""
        store = self.store
        name = check_lock_name(name)
        lease = store.claim(name, owner, ttl=ttl, now=now, conn=conn)
        if lease is None and store.enqueue(name, ready_at=0.0, conn=conn):
            # a name never taken (or a tombstone, its fence kept): created free, take it now
            lease = store.claim(name, owner, ttl=ttl, now=now, conn=conn)
        return lease

    def acquire(
        self,
        name: str,
        owner: str,
        *,
        ttl: float,
        timeout: float | None = 0.0,
        now: Callable[[], float] | None = None,
    ) -> Lease | None:
        """:meth:`try_acquire`, tried again while the lock is held, for at most ``timeout``
        seconds (``None``: until it is free): the lease, or ``None`` if the time ran out.

        A waiter takes its place in the lock's queue (:mod:`fencing._store.lock_queue`): the lock
        goes to the waiters in the order they came, and no newcomer cuts in, so no waiter
        starves. Between tries it pauses with jittered backoff, at most :attr:`poll` seconds
        (:mod:`fencing._store.waiting`), and reads whether its turn has come: about one read
        per ``poll``, and a claim only when it can succeed. ``now``: your clock, read at each
        try (default: the database's).
        """
        return drive(self._acquire_rules(name, owner, ttl=ttl, timeout=timeout, now=now))

    def _acquire_rules(
        self,
        name: str,
        owner: str,
        *,
        ttl: float,
        timeout: float | None,
        now: Callable[[], float] | None,
    ) -> Rules[Lease | None]:
        """The rules of a wait for ``name``, shared by the sync and the async fronts: steps
        (:class:`~fencing._store.steps.Send`, :class:`~fencing._store.steps.Wait`) that do no
        I/O of their own, each call the sync rules' own (``local``); the lease, or ``None``,
        is what they return."""
        wait = check_timeout(timeout)
        name = check_lock_name(name)
        if now is not None and not callable(now):
            raise InvalidArgumentType(f"now must be a callable clock or None, got {type(now).__name__}")
        owner = self.store.check_key(owner, name="owner")
        check_ttl(ttl)
        metrics = self.store.metrics
        started = time.perf_counter()

        def read() -> float | None:
            return None if now is None else now()

        def attempt() -> Any:
            return self.try_acquire(name, owner, ttl=ttl, now=read())

        def give_back(late: Lease | None) -> None:  # taken for a task cancelled meanwhile
            if late is not None:
                self.store.release(late)

        lease = yield Send(attempt, local=True, undo=give_back)
        if lease is not None or wait == 0.0:
            metrics.acquired(lease, started)
            return lease  # type: ignore[no-any-return]
        metrics.add("acquire.queued")
        queue, keep = self.queue, self.keep
        backoff = Backoff(wait, self.poll)
        # a task cancelled while it queued leaves the queue again (the ticket is answered late)
        ticket = yield Send(
            lambda: queue.enter(name, owner, keep=keep, now=read()), local=True, undo=queue.leave
        )
        refreshed = time.monotonic()
        listener: Listener | None = None
        try:
            notifier = self.store.notifier
            if notifier is not None:  # PostgreSQL: woken when the lock is freed
                # a cancelled task's connection, answered late, is given back too
                listener = yield Send(
                    lambda: listen(self.engine, notifier.channel, name),
                    local=True,
                    undo=lambda late: late.close(),
                )
            while True:
                pause = backoff.pause()
                if pause is None:
                    lease = None
                    break
                yield Wait(time.monotonic() + pause, wake=listener)
                if time.monotonic() - refreshed > keep / 3:
                    if not (
                        yield Send(
                            functools.partial(queue.refresh, ticket, keep=keep, now=read()), local=True
                        )
                    ):
                        # stalled past keep: its place lapsed; back of the queue
                        ticket = yield Send(
                            lambda: queue.enter(name, owner, keep=keep, now=read()),
                            local=True,
                            undo=queue.leave,
                        )
                    refreshed = time.monotonic()
                if (yield Send(functools.partial(queue.look, name, owner, ticket, now=read()), local=True)):
                    lease = yield Send(attempt, local=True, undo=give_back)
                    if lease is not None:
                        break
        except GeneratorExit:
            raise
        except BaseException:
            yield from _leave(queue, ticket, listener)
            raise
        yield from _leave(queue, ticket, listener)
        metrics.acquired(lease, started)
        return lease  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def hold(
        self,
        name: str,
        owner: str,
        *,
        ttl: float,
        timeout: float | None = 0.0,
        interval: float | None = None,
        on_lost: Callable[[HeldLock], object] | None = None,
    ) -> Iterator[HeldLock]:
        """Hold ``name`` for the block: acquire it (waiting up to ``timeout``, else
        :class:`~fencing.LockTimeout`), keep it with a :class:`~fencing.Heartbeat` renewing
        every ``interval`` (default ``ttl / 3``), release it when the block ends.

        A lock lost between its claim and the heartbeat's first renewal (revoked at that
        instant) raises :class:`~fencing.LeaseLost` before the block begins.

        The block learns the moment the lock is lost (a renewal refused or failing past the
        local deadline): :attr:`HeldLock.held` turns ``False``, :attr:`HeldLock.lost` is set
        and ``on_lost`` is called once, from the heartbeat's thread. :meth:`HeldLock.check`
        raises :class:`~fencing.LeaseLost` then; :meth:`HeldLock.fenced` is the transaction
        for writes that must not happen once the lock has moved on:

            with locks.hold("nightly-billing", "host-a", ttl=30) as lock:
                for invoice in due():
                    with lock.fenced() as conn:  # refused (LeaseLost) once another holds it
                        conn.execute(bill(invoice, token=lock.token))
        """
        lease = self.acquire(name, owner, ttl=ttl, timeout=timeout)
        if lease is None:
            raise timed_out(name, timeout, self.store.holder(name))
        held = HeldLock(self, lease)
        heartbeat = Heartbeat(
            self.store,
            lease,
            ttl,
            interval=interval,
            on_lost=lost_reporter(self.store.metrics, held, on_lost),
            release_on_exit=True,
        )
        held._heartbeat = heartbeat
        try:
            heartbeat.start()  # renews once now: LeaseLost if the lock is already gone
        except BaseException as exc:
            if isinstance(exc, LeaseLost):  # lost between the claim and the first renewal
                report_lost(self.store.metrics, lease, heartbeat.reason)
            with contextlib.suppress(Exception):  # it expires at its ttl otherwise
                self.store.release(lease)
            raise
        try:
            yield held
        except BaseException as exc:
            heartbeat.__exit__(type(exc), exc, exc.__traceback__)  # stopped, then released
            raise
        heartbeat.__exit__(None, None, None)

    # -- holding one ------------------------------------------------------------------------

    def renew(
        self, lease: Lease, *, ttl: float, now: float | None = None, conn: CallerConnection | None = None
    ) -> Lease | Refusal:
        """Extend a live lease on a lock to ``now + ttl``: the new lease, or a (falsy)
        :class:`~fencing.Refusal` that says why it is lost."""
        return self.store.renew(lease, ttl=ttl, now=now, conn=conn)

    def release(self, lease: Lease, *, conn: CallerConnection | None = None) -> Literal[True] | Refusal:
        """Free the lock at once if ``lease`` still holds it (its token stays: the next
        holder gets a higher one). A (falsy) :class:`~fencing.Refusal`: it did not hold it
        any more, and why."""
        return self.store.release(lease, conn=conn)

    def check(self, lease: Lease, *, now: float | None = None, conn: CallerConnection | None = None) -> None:
        """Raise :class:`~fencing.LeaseLost` unless ``lease`` holds the lock now; with
        ``conn=`` the lock's row stays locked until your transaction ends."""
        self.store.check(lease, now=now, conn=conn)

    def fenced(
        self, lease: Lease, *, now: float | None = None, conn: CallerConnection | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """A transaction for your writes under the lock (:meth:`fencing.JobStore.fenced`):
        the lease is checked and the lock's row locked at its start, checked again at its
        end, and a lease that no longer holds the lock rolls everything back with
        :class:`~fencing.LeaseLost`. With ``conn=`` it joins your transaction."""
        return self.store.fenced(lease, now=now, conn=conn)

    # -- reading and operating --------------------------------------------------------------

    def holder(
        self, name: str, *, now: float | None = None, conn: CallerConnection | None = None
    ) -> Lease | None:
        """Who holds ``name`` now: the live lease (owner, token, ``until``), or ``None``."""
        return self.store.holder(check_lock_name(name), now=now, conn=conn)

    def revoke(self, name: str, *, conn: CallerConnection | None = None) -> bool:
        """Take ``name`` from whoever holds it (an operator's act): the token moves on, so
        the holder's writes are refused from now on, and the lock is free. ``False``: no
        such lock."""
        return self.store.revoke(check_lock_name(name), conn=conn)

    def delete(self, name: str, *, conn: CallerConnection | None = None) -> bool:
        """Forget ``name`` (a holder's token is refused from now on). Its tokens are never
        handed out again: taken anew, the name goes on above every token it ever had."""
        return self.store.delete(check_lock_name(name), conn=conn)


class HeldBase(Generic[E]):
    """What a held lock tells its block, on either front (``E``: the kind of ``lost`` event):
    the lease, its name and token, whether it is still held. :class:`HeldLock` and
    :class:`fencing.asyncio.AsyncHeldLock` add the front's ``fenced``."""

    _heartbeat: LeaseReckoning[Any, E]

    def __init__(self, lease: Lease) -> None:
        self._first = lease

    def __repr__(self) -> str:
        lease = self.lease
        return (
            f"<{type(self).__name__} {lease.job_id!r} owner={lease.owner!r} token={lease.fence} "
            f"held={self.held}>"
        )

    @property
    def lease(self) -> Lease:
        """The lease, as its last renewal left it (``until`` moves on; the token does not)."""
        heartbeat = getattr(self, "_heartbeat", None)
        return self._first if heartbeat is None else heartbeat.lease

    @property
    def name(self) -> str:
        return self._first.job_id

    @property
    def token(self) -> int:
        """The lock's fencing token: pass it to whatever you write outside the database
        (:class:`~fencing.FenceMarks`), which must refuse a lower one."""
        return self._first.fence

    @property
    def held(self) -> bool:
        """Whether the lock can still be vouched for; once ``False``, never ``True`` again."""
        return self._heartbeat.held

    @property
    def lost(self) -> E:
        """Set the moment the lock is lost (a ``threading.Event``, an ``asyncio.Event``)."""
        return self._heartbeat.lost

    def check(self) -> None:
        """Raise :class:`~fencing.LeaseLost` if the lock is lost (no round trip)."""
        if not self.held:
            raise LeaseLost(f"lock {self.name!r} (token {self.token}) is lost: {self._heartbeat.reason}")


class HeldLock(HeldBase[threading.Event]):
    """A lock held by :meth:`Locks.hold` for its block, kept by a heartbeat."""

    def __init__(self, locks: Locks, lease: Lease) -> None:
        super().__init__(lease)
        self._locks = locks

    def fenced(self, *, conn: CallerConnection | None = None) -> contextlib.AbstractContextManager[Any]:
        """:meth:`Locks.fenced` with this lock's lease."""
        return self._locks.fenced(self.lease, conn=conn)


def timed_out(name: str, timeout: float | None, holder: Lease | None) -> LockTimeout:
    """What ``hold`` raises when the lock stayed held for its whole ``timeout``."""
    busy = LockTimeout(f"lock {name!r} stayed held by another owner for the whole timeout ({timeout} s)")
    busy.holder = holder
    return busy


def lost_reporter(
    metrics: StoreMetrics, held: Any, on_lost: Callable[[Any], object] | None
) -> Callable[[Any], object]:
    """A held lock's heartbeat's ``on_lost``: counted and logged, then ``on_lost(held)``
    (what it returns too: the async heartbeat awaits a coroutine)."""

    def lost(heartbeat: Any) -> object:
        report_lost(metrics, heartbeat.lease, heartbeat.reason)
        return None if on_lost is None else on_lost(held)

    return lost


def report_lost(metrics: StoreMetrics, lease: Lease, reason: str | None) -> None:
    """A lock held by ``hold`` was lost: ``hold.lost``, and one WARNING on ``fencing.locks``."""
    metrics.add("hold.lost")
    logger.warning(
        "lock %r (token %d) held by %r was lost: %s",
        lease.job_id,
        lease.fence,
        lease.owner,
        reason,
        extra={
            "event": "lost",
            "lock": lease.job_id,
            "owner": lease.owner,
            "token": lease.fence,
            "reason": reason,
        },
    )


def _leave(queue: WaitQueue, ticket: int, listener: Listener | None) -> Rules[None]:
    """Stop listening and leave the queue; a failure only delays the others until the
    ticket lapses."""
    if listener is not None:
        try:
            yield Send(listener.close, local=True)
        except Exception:  # close() passes its own failures over; a cancelled task's lands here
            logger.debug("could not give a listening connection back", exc_info=True)
    try:
        yield Send(lambda: queue.leave(ticket), local=True)
    except Exception:
        logger.warning("could not leave the queue of a lock; the ticket lapses", exc_info=True)
