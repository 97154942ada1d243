"""Fenced blocks: the application's own writes in a transaction fenced by a lease.

:class:`FencedBlocks` is the part of :class:`~fencing.JobStore` behind
:meth:`~FencedBlocks.fenced` and :meth:`~FencedBlocks.check`: the first check locks the
lease's row (on SQLite, the database's write lock), the block runs, the end check (or the
completion) is made at the moment it ends, and a lost lease rolls everything back with
:class:`~fencing.LeaseLost`. The holds of :mod:`fencing._runtime.holds` keep a block and the
heartbeats of its own process from waiting for each other.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, NoReturn

from sqlalchemy import Connection

from .._errors import ConfigurationError, DatabaseBusy, InvalidArgumentType, LeaseLost
from .._runtime import forks, holds
from .._runtime.execution import BlockExecutor, CallerConnection, CoreExecutor, Executor, forked_away
from .._runtime.refusals import never_current
from .._sql.checks import fence_can_match
from .._sql.dberrors import is_transient, is_unavailable, sqlalchemy_error
from .._sql.statements import LOST_AT_THE_END, Statements
from .._sql.values import Lease
from .context import JobsContext
from .ops import Clock, Guard

__all__ = ["LONG_BLOCK_FRACTION", "FencedBlocks"]

logger = logging.getLogger("fencing.store")  # the name operators filter on

#: SQLite: a fenced block that keeps the write lock longer than this fraction of the
#: shortest ``ttl`` the store has seen is logged (every other writer waited for it)
LONG_BLOCK_FRACTION = 0.25


class FencedBlocks:
    """Fenced blocks and checks of one lease (a part of :class:`~fencing.JobStore`)."""

    _ctx: JobsContext

    @contextmanager
    def fenced(
        self,
        lease: Lease,
        *,
        now: float | None = None,
        complete: bool = False,
        result: str | None = None,
        conn: CallerConnection | None = None,
    ) -> Iterator[Any]:
        """A transaction for the application's own writes, fenced by ``lease``.

        Checks that ``lease`` is current and live and locks its row (no one can claim or
        revoke the job until the transaction ends), runs the block, then checks again (with
        ``complete=True`` it completes the job with ``result`` instead). If the lease is not
        current at either check, :class:`LeaseLost` is raised and nothing of the block stays.

        Without ``conn`` the store opens the transaction (``BEGIN IMMEDIATE`` on SQLite),
        yields its ``Connection`` and commits everything together:

            with store.fenced(lease, complete=True, result="paid") as conn:
                conn.execute(invoices.insert().values(job=lease.job_id, total=99))

        With ``conn=`` (your ``Connection`` or ORM ``Session``) the block joins your
        transaction and yields what you passed: the block runs in a SAVEPOINT, which is rolled
        back on ``LeaseLost`` (or any error of the block) and released otherwise; a Session is
        flushed before the final check. Committing is yours, and the row lock lasts until you
        do. On SQLite the first check also takes the write lock (an ``UPDATE`` of the row), so
        the block's writes never fail for a lock race:

            with Session(engine) as session, session.begin():
                with store.fenced(lease, conn=session, complete=True, result="paid"):
                    session.add(Invoice(job=lease.job_id, total=99))

        **The clock at the end.** The final check is made at the moment the block ends on
        either clock: the database's (``now=None``) is read then; the caller's ``now`` is taken
        as the instant :meth:`fenced` was called and advanced by the time the block took
        (``time.monotonic()``). A block that runs past the lease's ``until`` is rolled back
        with :class:`LeaseLost` either way.

        **With a** :class:`~fencing.Heartbeat` **on the lease**, the block's first check also
        extends the lease by the heartbeat's ``ttl`` (in the block's transaction), so the block
        has a whole ``ttl``; the heartbeat sends nothing while the block holds the row, and
        ``heartbeat.stop()`` inside the block returns at once. Inside the block, any other
        operation of this thread that would wait for the block's lock (this job on a server;
        any write on SQLite) is refused with :class:`ConfigurationError` instead of hanging.

        **On SQLite** the block holds the database's write lock from start to end: every
        other writer (claims, renewals, completions of other workers) waits for it. Do the
        slow work before the block and keep only the writes inside it; a block that holds the
        lock longer than a quarter of the shortest ``ttl`` the store has seen is logged (a
        warning on ``fencing.store``).
        """
        ctx = self._ctx
        entered = time.monotonic()
        guard = ctx.lease(lease)
        if not isinstance(complete, bool):
            kind = type(complete).__name__
            raise InvalidArgumentType(f"complete must be a bool, got {kind} {complete!r:.80}")
        s, clock = ctx.clock(now)
        op = _Fenced(guard, clock, ctx.result(result))
        if conn is not None:
            with self._joined(conn, s, op, complete, entered) as yours:
                yield yours
            return
        runner = ctx.runner
        hold = self._take_hold(guard.job_id, None)
        generation = forks.GENERATION[0]
        ours = True  # whether an error comes from the library's statements, not the block
        ending = False
        lost: LeaseLost | None = None
        try:
            with runner.block() as (own, pipelined):
                hold.runs_on(own)  # a block nested with conn=own joins this transaction
                # with psycopg, the first check goes with BEGIN and the end with COMMIT: two
                # round trips around the block, not four (not with a history to write at the end)
                ends = pipelined if ctx.recorder is None else None
                x = CoreExecutor(own) if ends is None else ends
                block = self._begin_block(x, s, op, joined=False)
                ours = False
                yield own
                if runner.forked_since(generation):
                    raise forked_away()
                ours = ending = True  # the block ran: the end check, then COMMIT
                self._finish(x, s, op, complete, block, entered, ends)
            block.committed(complete)
            ctx.metrics.add("fenced.accepted")
        except LeaseLost as exc:
            lost = exc
            raise
        except ctx.errors as exc:
            if not ours and not is_unavailable(exc):
                raise  # the block's own statement failed: its error, as it was
            # (a block's own statement that lost the connection: its transaction never
            # committed, the COMMIT being the store's, so DatabaseUnavailable says so by name)
            if ending and is_transient(exc):
                # the server rolled the block back at its end check or at COMMIT (e.g. a
                # serialization failure): its writes are the caller's, so only the caller can
                # run them again
                raise DatabaseBusy(
                    "the database rolled the fenced block back at its end (the final check or "
                    "COMMIT lost a lock race or a serialization check): nothing of the block was "
                    "kept; run the block again"
                ) from sqlalchemy_error(exc, ctx.engine.dialect)
            ctx.fail(exc, ctx.table)
        finally:
            hold.end()
            if lost is not None and ctx.recorder is not None:
                self._record_lost(False, lost)

    def _record_lost(self, joined: bool, lost: LeaseLost) -> None:
        """Write a fenced block's refusal to the history after its rollback, in a transaction
        of the store's own: at once, or (``joined``: the block was in the caller's transaction,
        which may roll back and may hold the lock the write needs) off the caller's path once
        it can (:meth:`JobsContext.record_late`). A failure here is logged, never raised over
        the :class:`LeaseLost`."""
        ctx = self._ctx
        if ctx.recorder is None or lost._refusal is None:
            return
        why, clock = lost._refusal
        try:
            if joined:
                ctx.record_late(why, clock)
            else:
                ctx.write_refusal(why, clock)
        except Exception:  # whatever it was, the LeaseLost is the error to see
            logger.warning(
                "could not record the refused fenced block on job %r in the history",
                why.job_id,
                exc_info=True,
                extra=why.fields(),
            )

    def _take_hold(self, job_id: str, conn: Connection | None) -> holds.Hold:
        """Register a block's hold on ``job_id`` (:mod:`fencing._runtime.holds`), or refuse one this
        thread would wait for itself."""
        ctx = self._ctx
        try:
            return holds.hold(ctx.known_key(), job_id, conn, whole=ctx.plan.locks_whole_database)
        except holds.SelfWait:
            what = "the database's write lock" if ctx.plan.locks_whole_database else f"job {job_id!r}'s row"
            raise ConfigurationError(
                f"a fenced block (or a check(conn=)) of this thread already holds {what} on another "
                "connection: this block would wait for it forever; nest it with conn= (the outer "
                "block's connection) or run it after the outer block"
            ) from None

    def _begin_block(self, x: Executor, s: Statements, op: _Fenced, *, joined: bool) -> _Block:
        """The first check of a fenced block: lock the lease's row, or raise LeaseLost. With
        heartbeats keeping the lease, extend it by their ``ttl`` in the same statement."""
        ctx = self._ctx
        job_id, owner, fence = op.guard
        beats = [
            hb
            for hb in holds.beats(ctx.holds_key, job_id)
            if (hb.lease.owner, hb.lease.fence) == (owner, fence)
        ]
        sent = time.monotonic()
        renewed = None
        if beats and fence_can_match(fence):
            until = self._extend(x, s, op, max(hb.ttl for hb in beats))
            if until is None:
                self._lost(x, s, "fenced", op, f"is not current{_AT_START}")
            renewed = Lease(job_id, owner, fence, until)
        else:
            self._hold(x, s, op, _AT_START, joined=joined)
        return _Block(beats, renewed, sent)

    def _extend(self, x: Executor, s: Statements, op: _Fenced, ttl: float) -> float | None:
        """Renew the lease in the block's transaction: its new ``until``, or ``None``."""
        ctx = self._ctx
        p = {**op.guard.binds(), **op.clock.lasting(ttl).binds()}
        if ctx.plan.returning:
            rows = x.rows(s.renew_returning, p)
            return float(rows[0][0]) if rows else None
        if x.count(s.renew_counting, p) != 1:
            return None
        return float(x.rows(s.lease_of, p)[0][1])

    @contextmanager
    def _joined(
        self, conn: CallerConnection, s: Statements, op: _Fenced, complete: bool, entered: float
    ) -> Iterator[Any]:
        """:meth:`fenced` inside the caller's transaction, the block in a SAVEPOINT. The row
        stays held (:mod:`fencing._runtime.holds`) until the caller's transaction ends."""
        ctx = self._ctx
        try:
            connection = ctx.runner.caller(conn, ctx.table)
            x = CoreExecutor(connection)
            hold = self._take_hold(op.guard.job_id, connection)
            try:
                block = self._begin_block(x, s, op, joined=True)
            except LeaseLost as lost:
                self._record_lost(True, lost)
                raise
            finally:
                hold.began()  # the caller's transaction, autobegun by the first check if need be
            session = None if isinstance(conn, Connection) else conn
            savepoint = (connection if session is None else session).begin_nested()
        except ctx.errors as exc:
            ctx.fail(exc, ctx.table)
        generation = forks.GENERATION[0]
        try:
            yield conn
        except BaseException:
            if not ctx.runner.forked_since(generation):
                with contextlib.suppress(Exception):  # the block's error is the one to see
                    savepoint.rollback()
            raise
        if ctx.runner.forked_since(generation):
            raise forked_away()
        try:
            if session is not None:
                session.flush()
            self._finish(x, s, op, complete, block, entered)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                savepoint.rollback()
            if isinstance(exc, ctx.errors):
                ctx.fail(exc, ctx.table)
            if isinstance(exc, LeaseLost):
                self._record_lost(True, exc)
            raise
        try:
            savepoint.commit()
        except ctx.errors as exc:
            ctx.fail(exc, ctx.table)
        ctx.metrics.add("fenced.accepted")  # the block's part is done; the commit is the caller's

    def _hold(
        self,
        x: Executor,
        s: Statements,
        op: _Fenced,
        when: str,
        *,
        joined: bool,
        path: str = "fenced",
    ) -> None:
        """Raise :class:`LeaseLost` unless the lease is current and live; lock its row until
        the transaction ends. On SQLite, in a transaction the store did not begin IMMEDIATE,
        the check is an ``UPDATE`` that takes the database's write lock with it."""
        ctx = self._ctx
        stmt = ctx.plan.hold_statement(s, joined=joined)
        if not (fence_can_match(op.guard.fence) and x.rows(stmt, op.binds())):
            self._lost(x, s, path, op, f"is not current{when}")

    def _finish(
        self,
        x: Executor,
        s: Statements,
        op: _Fenced,
        complete: bool,
        block: _Block,
        entered: float,
        ends: BlockExecutor | None = None,
    ) -> None:
        """The end of a fenced block: complete the job, or check the lease once more, at the
        moment the block ends (the caller's ``now`` advanced by the block's duration).
        ``ends``: the block's own transaction ends here, the check sent with its COMMIT."""
        ctx = self._ctx
        # the block's history, recorded at its end in its transaction: the extension its
        # first check gave the lease (a renewal, at the block's start), then the block itself
        outcome = ctx.outcome()
        if block.renewed is not None:
            outcome.leases("renew", [block.renewed], op.clock)
        ended = time.monotonic()
        op = op.later(ended - entered)
        params = op.binds()
        if ctx.plan.locks_whole_database:
            self._warn_if_long(op.guard, ended - block.sent)
        at_end = " at the end of the fenced block; rolled back"
        if ends is not None:
            if not ends.commit_unless_lost(
                s.complete_or_fail if complete else s.still_held, params, LOST_AT_THE_END
            ):
                self._lost(
                    x,
                    s,
                    "fenced",
                    op,
                    "was lost before completing" if complete else f"is not current{at_end}",
                )
        elif not complete:
            self._hold(x, s, op, at_end, joined=False)
        elif x.count(s.complete, params) != 1:
            self._lost(x, s, "fenced", op, "was lost before completing")
        outcome.tokens("complete" if complete else "fenced", [op.guard], op.clock, path="fenced")
        ctx.record(x, outcome)

    def _lost(self, x: Executor, s: Statements, path: str, op: _Fenced, what: str) -> NoReturn:
        """Raise :class:`LeaseLost` for a fenced block (or a check), its reason logged first."""
        ctx = self._ctx
        job, owner, token = op.guard
        if fence_can_match(token):
            why = ctx.why(x, s, path, op.guard, op.clock)
        else:
            why = never_current(path, job, owner, token)
        ctx.refused_one(why)
        lost = LeaseLost(f"lease on {job!r} (fence {token}) {what}")
        # the block's transaction is rolled back: its history row is written after that
        lost.reason = why.reason
        lost._refusal = (why, op.clock)
        raise lost

    def _warn_if_long(self, guard: Guard, held: float) -> None:
        """SQLite: say so when a fenced block kept every other writer waiting too long."""
        ctx = self._ctx
        shortest = min([ctx.shortest_ttl, *(hb.ttl for hb in holds.beats(ctx.holds_key, guard.job_id))])
        if held > LONG_BLOCK_FRACTION * shortest:
            logger.warning(
                "a fenced block on job %r held SQLite's write lock for %.3f s, more than %.0f%% of "
                "the shortest ttl seen (%.3f s): every other writer waited; do the slow work "
                "before the block",
                guard.job_id,
                held,
                100 * LONG_BLOCK_FRACTION,
                shortest,
                extra={
                    "job_id": guard.job_id,
                    "owner": guard.owner,
                    "fence": guard.fence,
                    "held_seconds": held,
                    "shortest_ttl": shortest,
                },
            )

    def check(self, lease: Lease, *, now: float | None = None, conn: CallerConnection | None = None) -> None:
        """Raise :class:`LeaseLost` unless ``lease`` is current and live.

        With ``conn=`` (your ``Connection`` or ORM ``Session``) the check runs in your
        transaction and locks the job's row until it ends, so it stays true until you commit:
        ORM code can fail loud, and roll back its own objects, before writing anything:

            with Session(engine) as session, session.begin():
                store.check(lease, conn=session)   # LeaseLost: the with-block rolls back
                session.add(Invoice(job=lease.job_id, total=99))

        Without ``conn`` it only says whether the lease is current now.
        """
        ctx = self._ctx
        guard = ctx.lease(lease)
        s, clock = ctx.clock(now, records=False)  # a read: nothing recorded
        op = _Fenced(guard, clock)
        when = ""
        if conn is None:  # one locking read (then, if refused, its reason read): one round trip
            ctx.run_jobs(
                lambda x: self._hold(x, s, op, when, joined=False, path="check"),
                None,
                write=False,
                job=guard.job_id,
                single=True,
            )
            return

        def unit(x: Executor) -> None:
            self._hold(x, s, op, when, joined=True, path="check")

        try:
            connection = ctx.runner.caller(conn, ctx.table)
        except ctx.errors as exc:
            ctx.fail(exc, ctx.table)
        # the row stays locked until the caller's transaction ends
        hold = self._take_hold(guard.job_id, connection)
        try:
            ctx.run_jobs(unit, connection)
        finally:
            hold.began()  # the caller's transaction, autobegun by the check if need be


_AT_START = " at the start of the fenced block; rolled back"


class _Fenced(NamedTuple):
    """A fenced block's (or a check's) arguments, checked: the lease's guard, the clock and
    the result a completing block stores."""

    guard: Guard
    clock: Clock
    result: str | None = None

    def binds(self) -> dict[str, Any]:
        return {**self.guard.binds(), **self.clock.binds(), "new_result": self.result}

    def later(self, seconds: float) -> _Fenced:
        """The same block, its (caller's) clock ``seconds`` on: the moment it ends."""
        return self._replace(clock=self.clock.later(seconds))


class _Block:
    """What a fenced block knows between its checks: the heartbeats keeping its lease, the
    lease as its first check extended it (if it did), and when that check was sent."""

    __slots__ = ("beats", "renewed", "sent")

    def __init__(self, beats: list[Any], renewed: Lease | None, sent: float) -> None:
        self.beats = beats
        self.renewed = renewed
        self.sent = sent

    def committed(self, completed: bool) -> None:
        """The block's transaction committed: tell the heartbeats what it did to the lease."""
        for hb in self.beats:
            if completed:
                hb._completed_by_block()
            elif self.renewed is not None:
                hb._extended(self.renewed, self.sent)
