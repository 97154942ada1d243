"""Single-lease operations: each is one compare-and-set on one job's row, its guard in the
``WHERE``; a refused write's reason is read in the same transaction.

:class:`LeaseOperations` is the part of :class:`~fencing.JobStore` that a caller who knows
the job id uses: enqueue, state, claim, renew, complete, release, revoke, delete, requeue
and the claim race of :meth:`~LeaseOperations.claim_many`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from sqlalchemy.sql import Executable

from .._errors import ConfigurationError, FencesExhausted, InvalidArgumentType
from .._runtime.execution import CallerConnection, Executor
from .._runtime.refusals import never_current
from .._sql.checks import FENCE_MAX, check_now, check_text, check_time, fence_can_match, show_value
from .._sql.payloads import encode_payload, payload_of
from .._sql.statements import Statements
from .._sql.values import JobState, Lease, Refusal
from .context import JobsContext
from .dialects import DUPLICATE_KEY
from .history import Outcome
from .ops import DATABASE, Clock, Guard

__all__ = ["CLAIM_MANY_MAX_THREADS", "LeaseOperations"]

#: a release's clock: it checks none (a holder may give back a lease that ran out), so the
#: reason of a refusal is read as of the instant 0, when no lease is expired
RELEASE = Clock(0.0)

T = TypeVar("T")

logger = logging.getLogger("fencing.store")  # the name operators filter on

#: more threads than this only queue for the same row lock
CLAIM_MANY_MAX_THREADS = 32


class LeaseOperations:
    """The operations on one job's lease (a part of :class:`~fencing.JobStore`)."""

    _ctx: JobsContext

    def enqueue(
        self,
        job_id: str,
        *,
        ready_at: float | None = None,
        payload: Any = None,
        revive: bool = True,
        conn: CallerConnection | None = None,
    ) -> bool:
        """Register ``job_id`` unclaimed; ``False`` (and nothing changed) if it exists.

        ``ready_at``: not claimable before this time on the caller's clock. The default
        ``None`` stamps the database's now, which :meth:`claim_next` (``now=None``) can
        claim at once and which makes it first-come first-served: it takes the jobs that
        have been ready longest first, and jobs ready at the same instant by id (the ready
        index is ``(done, until, id)``; SQLite's clock counts milliseconds, so enqueues within
        one millisecond tie there, the servers' count microseconds). ``ready_at=0`` is the
        contract's row (``service.enqueue``): ready at once on any clock. A
        :meth:`delete`-d id comes back with its fence kept, so it never hands out an old
        token again; ``revive=False`` leaves it deleted instead (``False``): an id that is
        registered once, ever, as a schedule's tick is (:class:`fencing.Scheduler`).

        ``payload``: the job's arguments, JSON (dicts with ``str`` keys, lists, ``str``,
        ``int``, finite ``float``, ``bool``, ``None``), written in the same transaction into the
        store's payloads table (:func:`fencing.payloads_table`) when the job is new, and handed
        out by every claim as :attr:`Lease.payload`. A value that would not read back equal
        (a tuple, a non-``str`` key, ``NaN``) is refused before anything is written;
        :class:`ConfigurationError` if the store keeps no payloads.
        """
        ctx = self._ctx
        job_id = ctx.job_key("job_id", job_id)
        params: dict[str, Any]
        if ready_at is None:
            s, params = ctx.by_database, {"job_id": job_id}
        else:
            s, params = ctx.by_caller, {"job_id": job_id, "ready_at": check_time("ready_at", ready_at)}
        if not isinstance(revive, bool):
            raise InvalidArgumentType(f"revive must be a bool, got {type(revive).__name__}")
        if payload is None:
            enqueue = ctx.enqueue if revive else ctx.enqueue_new
            single = ctx.plan.upsert != DUPLICATE_KEY  # one INSERT ... ON CONFLICT
            added = ctx.run_jobs(lambda x: enqueue(x, s, params), conn, job=job_id, single=single)
        else:
            ctx.require("enqueue(payload=)", "payloads")
            params["payload"] = encode_payload(payload)
            with_payload, single = ctx.enqueue_with_payload if revive else ctx.enqueue_new_with_payload
            added = ctx.run_jobs(lambda x: with_payload(x, s, params), conn, job=job_id, single=single)
        if added and conn is None:
            ctx.ring()  # committed: this process's waiting claims look now
        return added

    def state(self, job_id: str, *, conn: CallerConnection | None = None) -> JobState | None:
        """The stored row, read from the database now, or ``None``."""
        ctx = self._ctx
        params = {"job_id": ctx.job_key("job_id", job_id)}
        stmt = ctx.by_caller.state

        if conn is None:
            # one SELECT is its own snapshot: no transaction, no write lock
            try:
                row = ctx.runner.read_row(stmt, params)
            except ctx.errors as exc:
                ctx.fail(exc, ctx.table)
            return None if row is None else JobState.from_row(row)

        def unit(x: Executor) -> JobState | None:
            rows = x.rows(stmt, params)
            return JobState.from_row(rows[0]) if rows else None

        return ctx.run_jobs(unit, conn)  # (the caller's transaction: conn is given)

    def holder(
        self, job_id: str, *, now: float | None = None, conn: CallerConnection | None = None
    ) -> Lease | None:
        """Who holds ``job_id`` now: its live lease (owner, fence, ``until``), read from the
        database, or ``None`` when no lease on it is live at ``now`` (the database's clock by
        default): free, expired, done or missing. A read: it locks nothing, so the answer
        may be out of date the moment it arrives; a write must still present its lease."""
        ctx = self._ctx
        job_id = ctx.job_key("job_id", job_id)
        s, clock = ctx.clock(now, records=False)  # a read: nothing recorded
        params = {"job_id": job_id, **clock.binds()}
        stmt = s.live_lease

        def unit(x: Executor) -> Lease | None:
            rows = x.rows(stmt, params)
            if not rows:
                return None
            owner, fence, until = rows[0]
            return Lease(job_id, owner, int(fence), float(until))

        return ctx.run_jobs(unit, conn, write=False, single=True)

    def claim(
        self,
        job_id: str,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> Lease | None:
        """Take the lease on ``job_id`` if it is not done and not held (``until <= now``).

        The fence goes up by one and is part of the returned :class:`Lease`; ``None`` for a
        missing, done or held job. :class:`FencesExhausted` (nothing changed) for a job whose
        fence is already 2**63-1, the last one a signed 64-bit fence holds: it can never be
        claimed again, so it is said at once, even while the last lease is held.
        """
        ctx = self._ctx
        job_id = ctx.job_key("job_id", job_id)
        owner = ctx.job_key("owner", owner)
        s, clock = ctx.clock(now, ttl)
        outcome = ctx.outcome()
        unit = self._claim_unit(s, job_id, owner, clock, outcome)
        started = time.perf_counter()
        single = ctx.plan.returning  # one UPDATE ... RETURNING (then, if refused, a read)
        lease = ctx.run_jobs(unit, conn, job=job_id, outcome=outcome, single=single)
        ctx.metrics.claim(lease, started)
        return lease

    def _claim_unit(
        self, s: Statements, job_id: str, owner: str, clock: Clock, outcome: Outcome
    ) -> Callable[[Executor], Lease | None]:
        params = {"job_id": job_id, "holder": owner, **clock.binds()}
        if self._ctx.plan.returning:

            def returning(x: Executor) -> Lease | None:
                rows = x.rows(s.claim_returning, params)
                if rows:
                    lease = Lease(job_id, owner, int(rows[0][0]), float(rows[0][1]), *payload_of(rows[0], 2))
                    outcome.leases("claim", [lease], clock)
                    return lease
                _refuse_if_exhausted(x, s, job_id)
                return None

            return returning

        def counting(x: Executor) -> Lease | None:
            if x.count(s.claim_counting, params) != 1:
                _refuse_if_exhausted(x, s, job_id)
                return None
            row = x.rows(s.claimed_lease, params)[0]
            lease = Lease(job_id, owner, int(row[0]), float(row[1]), *payload_of(row, 2))
            outcome.leases("claim", [lease], clock)
            return lease

        return counting

    def renew(
        self,
        lease: Lease,
        *,
        ttl: float,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> Lease | Refusal:
        """Extend a live lease to ``now + ttl``: the new :class:`Lease`, or a (falsy)
        :class:`~fencing.Refusal` that says why not.

        Refused when the token is stale (another fence, another owner, done) or the lease
        has already expired (``until <= now``): an expired lease is never revived.
        """
        ctx = self._ctx
        guard = ctx.lease(lease)
        s, clock = ctx.clock(now, ttl)
        if not fence_can_match(guard.fence):
            return ctx.refused_one(never_current("renew", *guard))
        refused: list[Refusal] = []
        outcome = ctx.outcome()

        def renewed(x: Executor) -> Lease | None:
            renewal = self._renewal(x, s, guard, clock)
            if renewal is None:
                refused[:] = [ctx.why(x, s, "renew", guard, clock)]
                outcome.refusals(refused, clock)
            else:
                outcome.leases("renew", [renewal], clock)
            return renewal

        single = ctx.plan.returning or clock.caller  # one UPDATE (then, if refused, a read)
        renewal = ctx.run_jobs(renewed, conn, job=guard.job_id, outcome=outcome, single=single)
        if renewal is None:
            return ctx.refused_one(refused[0])
        if lease.payload is not None:  # the job's arguments go on with its lease
            renewal = Lease(renewal.job_id, renewal.owner, renewal.fence, renewal.until, lease.payload)
        return ctx.accepted("renew", renewal)

    def _renewal(self, x: Executor, s: Statements, guard: Guard, clock: Clock) -> Lease | None:
        """Renew ``guard``'s lease on ``clock``: the new :class:`Lease`, or ``None`` if refused."""
        job_id, owner, fence = guard
        params = {**guard.binds(), **clock.binds()}
        if clock.new_until is not None:
            if x.count(s.renew_counting, params) == 1:
                return Lease(job_id, owner, fence, clock.new_until)
        elif self._ctx.plan.returning:
            rows = x.rows(s.renew_returning, params)
            if rows:
                return Lease(job_id, owner, fence, float(rows[0][0]))
        elif x.count(s.renew_counting, params) == 1:
            return Lease(job_id, owner, fence, float(x.rows(s.lease_of, params)[0][1]))
        return None

    def complete(
        self,
        lease: Lease,
        result: str | None,
        *,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> Literal[True] | Refusal:
        """Store ``result`` and mark the job done, only under the current, live lease.

        ``True``; or, for a late or stale writer, a (falsy) :class:`~fencing.Refusal` that
        says why, and the stored result untouched.
        """
        ctx = self._ctx
        guard = ctx.lease(lease)
        s, clock = ctx.clock(now)
        result = ctx.result(result)
        return self._guarded("complete", s, s.complete, guard, clock, conn, new_result=result)

    def release(
        self,
        lease: Lease,
        *,
        delay: float | None = None,
        failure: str | None = None,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> Literal[True] | Refusal:
        """Give the lease back early (``owner = NULL``); the fence is kept.

        Without ``delay`` the job is claimable at once (``until = 0``); with it, not before
        ``now + delay`` (a retry with backoff). ``True``; or a (falsy)
        :class:`~fencing.Refusal` if the token is stale or done.

        ``failure``: why this attempt failed (the exception's type, message and traceback),
        kept as the job's last failure (:meth:`failure`) in the release's transaction, only if
        the release is accepted. :class:`ConfigurationError` if the store keeps no failures
        (``JobStore(engine, table, failures=fencing.failures_table(metadata))``).
        """
        ctx = self._ctx
        guard = ctx.lease(lease)
        failed: dict[str, Any] = {}
        if failure is not None:
            ctx.require("release(failure=)", "failures")
            failed = {"failure": ctx.storable("failure", check_text("failure", failure))}
        if delay is None:
            # the history's instant: the caller's now, else the database's
            ctx.recorded_on(now)
            at = DATABASE if now is None else Clock(check_now(now))
            # release checks no clock; the reason read compares with 0
            then = _failed(ctx.by_database if now is None else ctx.by_caller, {**at.binds(), **failed})
            s = ctx.by_caller
            released = self._guarded("release", s, s.release, guard, RELEASE, conn, at=at, then=then)
        else:
            s, clock = ctx.clock(now, delay, name="delay")
            then = _failed(s, {**clock.binds(), **failed})
            released = self._guarded("release", s, s.release_later, guard, clock, conn, then=then)
        if released and conn is None:
            ctx.ring()  # ready now, or due at its delay: this process's waiting claims look
        return released

    def _guarded(
        self,
        path: str,
        s: Statements,
        stmt: Executable,
        guard: Guard,
        clock: Clock,
        conn: CallerConnection | None,
        *,
        at: Clock | None = None,
        then: Callable[[Executor, dict[str, Any]], None] | None = None,
        **more: Any,
    ) -> Literal[True] | Refusal:
        """Run the guarded write ``stmt`` of one lease on ``clock`` (``more``: its other bind
        parameters): accepted, or refused with its reason (read in the same transaction,
        logged and counted after it). ``at``: the history's clock, when it is not the
        statement's; ``then``: what an accepted write also does in its transaction (given the
        guard's bind parameters)."""
        ctx = self._ctx
        if not fence_can_match(guard.fence):
            return ctx.refused_one(never_current(path, *guard))
        refused: list[Refusal] = []
        outcome = ctx.outcome()
        recorded_at = clock if at is None else at
        params = {**guard.binds(), **clock.binds(), **more}

        def unit(x: Executor) -> bool:
            if x.count(stmt, params) == 1:
                if then is not None:
                    then(x, params)
                outcome.tokens(path, [guard], recorded_at)
                return True
            refused[:] = [ctx.why(x, s, path, guard, clock)]
            outcome.refusals(refused, recorded_at)
            return False

        single = then is None  # else more writes follow the first
        if ctx.run_jobs(unit, conn, job=guard.job_id, outcome=outcome, single=single):
            return ctx.accepted(path, True, (guard.job_id, guard.fence))
        return ctx.refused_one(refused[0])

    def revoke(self, job_id: str, *, conn: CallerConnection | None = None) -> bool:
        """Take the lease away at once: the fence moves on, so the holder's token is stale
        for every later write; the job is claimable again. ``False`` if missing or done.

        :class:`FencesExhausted` if the job's fence is already 2**63-1: it cannot move on, so
        the holder of that last fence keeps it (nothing changed)."""
        ctx = self._ctx
        job_id = ctx.job_key("job_id", job_id)
        params = {"job_id": job_id}
        s = ctx.by_caller
        outcome = ctx.outcome()

        def unit(x: Executor) -> bool:
            if x.count(s.revoke, params) == 1:
                outcome.copy("revoke", job_id, DATABASE)
                return True
            _refuse_if_exhausted(x, s, job_id)
            return False

        revoked = ctx.run_jobs(unit, conn, job=job_id, outcome=outcome, single=True)
        if revoked and conn is None:
            ctx.ring()
        if revoked:
            ctx.metrics.ended("revoke", job_id)
            logger.info("revoked the lease on job %r", job_id, extra={"path": "revoke", "job_id": job_id})
        return revoked

    def delete(self, job_id: str, *, conn: CallerConnection | None = None) -> bool:
        """Delete a job. Its row stays as a tombstone that keeps the fence, so an id that
        is enqueued again continues above every fence it ever had; its payload and its last
        failure go, in the same transaction. ``False`` if missing."""
        ctx = self._ctx
        job_id = ctx.job_key("job_id", job_id)
        params = {"job_id": job_id}
        s = ctx.by_caller
        outcome = ctx.outcome()
        # its arguments and its last failure go with it
        gone = [s.forget_payload] if ctx.payloads is not None else []
        gone += [s.forget_failure] if ctx.failures is not None else []

        def unit(x: Executor) -> bool:
            if x.count(s.delete, params) != 1:
                return False
            for stmt in gone:
                x.count(stmt, params)
            outcome.copy("delete", job_id, DATABASE)
            return True

        deleted = ctx.run_jobs(unit, conn, job=job_id, outcome=outcome, single=not gone)
        if deleted:
            ctx.metrics.ended("delete", job_id)
            logger.info("deleted job %r", job_id, extra={"path": "delete", "job_id": job_id})
        return deleted

    def requeue(self, job_id: str, *, now: float | None = None, conn: CallerConnection | None = None) -> bool:
        """Give a job its attempts back: ``claim_next(max_attempts=N)`` may take it ``N`` more
        times, counted from its fence now (kept in the store's ``attempts`` table: the fence
        never goes down, so every token handed out stays stale). A deferred job is ready at
        once. ``False`` if missing, done, deleted or held by a live lease (revoke it first).

        ``now``: the caller's clock that judges whether a lease is live (``None``: the
        database's). :class:`ConfigurationError` if the store has no attempts table
        (``JobStore(engine, table, attempts=fencing.attempts_table(metadata))``)."""
        ctx = self._ctx
        if ctx.attempts is None:
            raise ConfigurationError(
                "requeue needs a table for the attempts' bases: JobStore(engine, table, "
                "attempts=fencing.attempts_table(metadata)), created by store.create_table()"
            )
        job_id = ctx.job_key("job_id", job_id)
        s, clock = ctx.clock(now)
        params = {"job_id": job_id, **clock.binds()}
        outcome = ctx.outcome()

        def unit(x: Executor) -> bool:
            if x.count(s.requeue, params) != 1:
                return False
            # under the row lock the requeue took: the base is the fence it left
            x.count(s.forget_base, params)
            x.count(s.set_base, params)
            outcome.copy("requeue", job_id, clock)
            return True

        # three writes (the job, then its base out and in): one transaction, never ``single``
        requeued = ctx.run_jobs(unit, conn, job=job_id, outcome=outcome)
        if requeued and conn is None:
            ctx.ring()
        if requeued:
            ctx.metrics.ended("requeue", job_id)
            logger.info("requeued job %r", job_id, extra={"path": "requeue", "job_id": job_id})
        return requeued

    def claim_many(
        self, job_id: str, owners: Iterable[str], *, ttl: float, now: float | None = None
    ) -> list[Lease | None]:
        """Race :meth:`claim` for every owner on a thread pool; results in input order.

        On a claimable job exactly one owner gets a lease. Every argument is checked
        before the first claim runs.
        """
        units = self._claim_units(job_id, owners, ttl, now)
        if not units:
            return []
        workers = min(len(units), CLAIM_MANY_MAX_THREADS)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fencing-claim") as pool:
            futures = [pool.submit(self._run_own, unit) for unit in units]
            return [f.result() for f in futures]

    def _claim_units(
        self, job_id: object, owners: object, ttl: object, now: object
    ) -> list[Callable[[Executor], Lease | None]]:
        """:meth:`claim_many`'s units, one per owner, every argument checked first (the
        async store races them as tasks); each records its own history."""
        ctx = self._ctx
        job_id = ctx.job_key("job_id", job_id)
        if isinstance(owners, (str, bytes)) or not isinstance(owners, Iterable):
            raise InvalidArgumentType(
                f"owners must be an iterable of str, got {type(owners).__name__} {owners!r:.80}"
            )
        owner_list = [ctx.job_key("owner", o) for o in owners]
        s, clock = ctx.clock(now, ttl)
        return [self._recorded_claim(s, job_id, o, clock) for o in owner_list]

    def _recorded_claim(
        self, s: Statements, job_id: str, owner: str, clock: Clock
    ) -> Callable[[Executor], Lease | None]:
        """A claim unit that records its own history at its end (it runs on its own)."""
        outcome = self._ctx.outcome()
        return self._ctx.recorded(self._claim_unit(s, job_id, owner, clock, outcome), outcome)

    def _run_own(self, unit: Callable[[Executor], T]) -> T:
        """Run ``unit`` in a transaction of the store's own (retried, errors mapped)."""
        return self._ctx.run_jobs(unit, None)


def _refuse_if_exhausted(x: Executor, s: Statements, job_id: str) -> None:
    """After a claim or revoke matched nothing: raise :class:`FencesExhausted` if that is
    because the job's fence is at 2**63-1 (its guard, ``fence < 2**63-1``, is in the WHERE)."""
    if x.rows(s.exhausted, {"job_id": job_id}):
        raise FencesExhausted(
            f"job {show_value(job_id)} has handed out its last fence ({FENCE_MAX}, 2**63-1): "
            "it can never be claimed or revoked again"
        )


def _failed(s: Statements, binds: dict[str, Any]) -> Callable[[Executor, dict[str, Any]], None] | None:
    """What an accepted release also does when it hands its job back with a ``failure`` (in
    ``binds``, with the clock the failure's time is read on, ``s``'s): the job's last failure
    replaced by this one. ``None`` without one."""
    if "failure" not in binds:
        return None

    def failed(x: Executor, guard: dict[str, Any]) -> None:
        params = {**guard, **binds}
        x.count(s.forget_failure, params)
        x.count(s.put_failure, params)

    return failed
