"""Worker batches: claims of workers that do not know job ids, and completions many at once.

:class:`WorkerBatches` is the part of :class:`~fencing.JobStore` a worker loop uses:
:meth:`~WorkerBatches.claim_next`, :meth:`~WorkerBatches.complete_many`, the worker's step
:meth:`~WorkerBatches.complete_and_claim_next` (both in one transaction) and the jobs a
``max_attempts`` skips (:meth:`~WorkerBatches.poisoned`). How a batch of completions
reaches the database is the dialect plan's (:mod:`.dialects`): one ``UPDATE`` each on
SQLite, one ``UPDATE ... FROM unnest(arrays)`` per chunk on PostgreSQL, a locking read and one
joined ``UPDATE`` per chunk on MariaDB/MySQL.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Literal, NamedTuple

from sqlalchemy.sql import Executable

from .._errors import DatabaseError, InvalidArgument, InvalidArgumentType
from .._runtime import events
from .._runtime.execution import CallerConnection, Executor
from .._runtime.refusals import judge, never_current
from .._sql.checks import FENCE_MAX, check_count, check_until, check_wait, fence_can_match
from .._sql.payloads import decode_payload, payload_of
from .._sql.statements import COMPLETE_CHUNK, Statements, batch_size
from .._sql.values import JobState, Lease, Refusal
from . import bell, wakeups
from .context import JobsContext
from .dialects import ARRAYS, EACH, LOCKING
from .history import Outcome
from .ops import Clock, Guard
from .steps import Rules, Send, Wait, drive
from .waiting import Backoff

__all__ = ["COMPLETE_CHUNK_CHARS", "WAIT_POLL", "WorkerBatches"]

logger = logging.getLogger("fencing.store")

#: job_id, owner, fence, result: one checked item of complete_many
_Completion = tuple[str, str, int, "str | None"]
#: how a batch's completions are stored: a unit made of the statements, the clock, the batch
#: and the positions to store, returning those accepted
_StoredBy = Callable[[Statements, Clock, list[_Completion], list[int]], Callable[[Executor], set[int]]]
#: result characters per batch statement: a statement stays far below MariaDB's packet limit
COMPLETE_CHUNK_CHARS = 1 << 20
#: the longest pause between two looks of a claim that waits for work (seconds): what a job
#: another process makes ready may wait to be seen
WAIT_POLL = 0.5


class _Claim(NamedTuple):
    """A claim of the next jobs, its arguments checked: its clock's statements, the owner,
    how many jobs at most, the fence a job must be below (``max_attempts``), and the clock."""

    s: Statements
    owner: str
    limit: int
    max_fence: int
    clock: Clock

    def binds(self) -> dict[str, Any]:
        return {"holder": self.owner, "limit": self.limit, "max_fence": self.max_fence, **self.clock.binds()}


class WorkerBatches:
    """Claims and completions of workers, many at once (a part of :class:`~fencing.JobStore`)."""

    _ctx: JobsContext

    def claim_next(
        self,
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        limit: int = 1,
        max_attempts: int | None = None,
        wait: float = 0.0,
        conn: CallerConnection | None = None,
    ) -> list[Lease]:
        """Claim up to ``limit`` ready jobs in one transaction; their leases (maybe none).

        Ready: not done, lease expired or never taken, not deferred, and (with
        ``max_attempts``) claimed fewer than that many times, the fence being the attempt
        count (since the job's last :meth:`requeue`, with the store's ``attempts`` table).
        The jobs that have been ready longest come first (by ``until``: enqueue time, lease
        expiry or retry time; with :meth:`enqueue`'s default that is first-come
        first-served), ties by id (the order of the ready index, so the pick walks it from
        its start and stops at ``limit``, at any backlog); the order of the returned list
        is the database's. On PostgreSQL and MariaDB workers skip rows another worker is
        claiming (``FOR UPDATE SKIP LOCKED``); on SQLite ``BEGIN IMMEDIATE`` serializes
        claims.

        ``wait``: when nothing is ready, wait up to this many seconds for a job to become
        ready, and claim it then (``[]`` if none did). A job made ready by this process (an
        enqueue, a release, a revoke or a requeue in a transaction of a store's own) wakes
        the waiter at once; on PostgreSQL so does an enqueue of any process, at its commit
        (``LISTEN``/``NOTIFY``, with psycopg 3.2+, asyncpg or psycopg's async mode; one
        listening connection per process and engine, outside the engine's pool); a deferred
        job, or a lease that runs out, at its time. On SQLite (a file) any other connection's
        commit wakes it within milliseconds (a thread per process reads ``PRAGMA
        data_version``), and it reads whether a job is due before it takes the write lock to
        claim. Anything else (a release by another process on PostgreSQL, any other process on
        MariaDB, PostgreSQL behind PgBouncer in transaction mode) is seen at the next look, the
        looks backing off from 10 ms to :data:`WAIT_POLL` seconds apart. No pooled connection
        is held while it waits. It waits on the database's clock and in a
        transaction of the store's own: with ``now=`` or ``conn=`` it is refused.
        """
        if wait != 0.0:
            return drive(self._claim_next_rules(owner, ttl=ttl, now=now, limit=limit,
                                                max_attempts=max_attempts, wait=wait, conn=conn))  # fmt: skip
        claim = self._claim(owner, ttl, now, limit, max_attempts)
        return self._claim_now(claim, max_attempts, conn)

    def _claim_now(
        self, claim: _Claim, max_attempts: int | None, conn: CallerConnection | None
    ) -> list[Lease]:
        """:meth:`claim_next` once, its arguments checked (``claim``)."""
        ctx = self._ctx
        outcome = ctx.outcome()
        unit = self._claim_next_unit(claim, outcome)
        started = time.perf_counter()
        # one UPDATE ... RETURNING (a batch's after the claim order is set: one round trip
        # still where the driver pipelines)
        leases = ctx.run_jobs(
            unit, conn, outcome=outcome, single=ctx.plan.returning, prelude=self._claim_order(claim)
        )
        self._claimed(leases, max_attempts, started)
        return leases

    def _claim_next_rules(
        self,
        owner: object,
        *,
        ttl: object,
        now: object,
        limit: object,
        max_attempts: int | None,
        wait: object,
        conn: object,
    ) -> Rules[list[Lease]]:
        """The rules of a claim that waits for work (:meth:`claim_next` with ``wait``), for
        both fronts: claim; if nothing came, look when the next job comes due, wait for this
        process's bell (:mod:`.bell`) until then or the next look of the backoff, and claim
        again, until the time is up."""
        seconds = check_wait(wait)
        if now is not None:
            raise InvalidArgument(
                "wait= waits on the database's clock: claim with now=None, or without wait="
            )
        if conn is not None:
            raise InvalidArgument(
                "wait= cannot wait in your transaction (conn=): it would hold it open; "
                "claim in it without wait=, or wait in a transaction of the store's own"
            )
        claim = self._claim(owner, ttl, None, limit, max_attempts)
        ctx = self._ctx
        s = ctx.by_database
        backoff = Backoff(seconds, WAIT_POLL)

        def give_back(late: list[Lease]) -> None:  # taken for a task cancelled meanwhile
            for lease in late:
                self.release(lease)  # type: ignore[attr-defined]  # (the store's own)

        def due_in() -> float | None:
            row = ctx.runner.read_row(s.due_in, {})
            return None if row is None else float(row[0])

        key = yield Send(ctx.bell_key, local=True)
        leases = yield Send(lambda: self._claim_now(claim, max_attempts, None), local=True, undo=give_back)
        if leases:  # a busy worker claims without listening (no one notifies it meanwhile)
            return leases  # type: ignore[no-any-return]

        def subscribe() -> bell.Subscription:  # and claim again, for a job made ready meanwhile
            return bell.listen(key, wakeups.listen(ctx.engine, ctx.channel, ""))

        listener = yield Send(subscribe, local=True, undo=lambda late: late.close())
        # SQLite: a claim takes the database's write lock, and every other connection's commit
        # wakes the waiter (the file's watcher): it reads whether a job is due before it claims
        look_first = ctx.plan.locks_whole_database
        try:
            due: float | None = 0.0  # seconds until the first job comes due, as last read
            while True:
                if due is not None and due <= 0:
                    leases = yield Send(
                        lambda: self._claim_now(claim, max_attempts, None), local=True, undo=give_back
                    )
                    if leases:
                        break
                    due = yield Send(due_in, local=True)
                pause = backoff.pause()
                if pause is None:
                    leases = []
                    break
                if due is not None and due > 0:  # the next job's time, if it comes first
                    pause = min(pause, due + ctx.plan.clock_resolution)
                yield Wait(time.monotonic() + pause, wake=listener)
                due = (yield Send(due_in, local=True)) if look_first else 0.0
        except GeneratorExit:
            raise
        except BaseException:
            yield from _stop_listening(listener)
            raise
        yield from _stop_listening(listener)
        return leases  # type: ignore[no-any-return]

    def _claimed(self, leases: list[Lease], max_attempts: int | None, started: float) -> None:
        """Count and time a claim of workers that began at ``started`` (``perf_counter``)."""
        self._ctx.metrics.claimed(leases, started)
        if max_attempts is not None and leases:
            events.last_attempts(leases, max_attempts)

    def _claim(self, owner: object, ttl: object, now: object, limit: object, max_attempts: object) -> _Claim:
        """A claim of the next jobs, its arguments checked."""
        ctx = self._ctx
        owner = ctx.job_key("owner", owner)
        limit = check_count("limit", limit)
        max_fence = FENCE_MAX if max_attempts is None else check_count("max_attempts", max_attempts)
        s, clock = ctx.clock(now, ttl)
        return _Claim(s, owner, limit, max_fence, clock)

    def _claim_order(self, claim: _Claim) -> tuple[Executable, ...]:
        """What a transaction of the store's own that claims more than one job runs first, so
        the pick walks the ready index in claim order (PostgreSQL)."""
        if claim.limit > 1 and self._ctx.plan.walks_claim_order:
            return (claim.s.walk_in_claim_order,)
        return ()

    def _claim_next_unit(self, claim: _Claim, outcome: Outcome) -> Callable[[Executor], list[Lease]]:
        """The unit of :meth:`claim_next`, its claims noted in ``outcome``."""
        ctx = self._ctx
        s, owner, clock, params = claim.s, claim.owner, claim.clock, claim.binds()

        def returning(x: Executor) -> list[Lease]:
            rows = x.rows(s.claim_next_returning, params)
            leases = [Lease(row[0], owner, int(row[1]), float(row[2]), *payload_of(row, 3)) for row in rows]
            outcome.leases("claim", leases, clock)
            return leases

        by_caller = ctx.by_caller

        def picking(x: Executor) -> list[Lease]:
            rows = x.rows(s.pick_ready, params)
            if not rows:
                return []
            picked = {job_id: int(fence) for job_id, fence, _ in rows}
            # the claim is stored at the instant the pick judged its rows ready (on the
            # database's clock: the pick's own reading), so its leases are known here
            at, ttl, new_until = clock
            if at is None or new_until is None:  # the database's clock, as the pick read it
                assert ttl is not None  # a claim's clock always has its ttl
                at = float(rows[0][2])
                new_until = check_until(at, ttl)
            claim, read = by_caller.claim_ids(len(picked))
            ids = {f"id_{i}": job_id for i, job_id in enumerate(picked)}
            both = {**params, **ids, "now": at, "new_until": new_until}
            if x.count(claim, both) == len(picked):
                # the pick locked these rows, ready at ``at``: each is claimed one fence above
                leases = [Lease(job_id, owner, fence + 1, new_until) for job_id, fence in picked.items()]
            else:  # (not seen: rows locked since the pick and judged at the same instant)
                # one no longer ready may still carry this owner from an earlier, expired
                # lease: its old fence must not be handed out a second time
                leases = [
                    Lease(job_id, owner, int(fence), float(until))
                    for job_id, fence, until in x.rows(read, both)
                    if int(fence) == picked[job_id] + 1
                ]
            if leases and s.payloads is not None:  # their arguments, in the claim's transaction
                ids = {f"id_{i}": lease.job_id for i, lease in enumerate(leases)}
                rows = x.rows(s.payloads_of(len(leases)), ids)
                found: dict[str, str | None] = {str(row[0]): row[1] for row in rows}
                leases = [replace(lease, payload=decode_payload(found.get(lease.job_id))) for lease in leases]
            outcome.leases("claim", leases, clock)
            return leases

        return returning if ctx.plan.returning else picking

    def complete_many(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        *,
        now: float | None = None,
        conn: CallerConnection | None = None,
    ) -> list[Literal[True] | Refusal]:
        """:meth:`complete` for each ``(lease, result)``, all in one transaction.

        Each completion is checked on its own (owner, fence, not done, lease live at
        ``now``): a stale one is refused, the others stored; the list answers each in input
        order, ``True`` or the item's (falsy) :class:`~fencing.Refusal`. The same lease
        twice: only the first can be accepted (it makes the job done). Every item is checked
        before anything runs, so a bad one raises and changes nothing. On PostgreSQL a batch
        is one ``UPDATE`` (per :data:`~fencing._sql.statements.COMPLETE_CHUNK` completions),
        on MariaDB/MySQL a read that locks the batch's rows and one ``UPDATE``, on SQLite one
        ``UPDATE`` each (no round trips there). With ``now=None`` the servers judge a whole chunk at one
        instant of their clock, SQLite each completion at its own statement's.
        """
        _check_completions(completions)
        outcome = self._ctx.outcome()
        size, unit, refused, single = self._completions_unit(completions, now, outcome)
        if unit is None:
            return self._judged(size, set(), refused)
        accepted = self._ctx.run_jobs(unit, conn, outcome=outcome, single=single)
        return self._judged(size, accepted, refused)

    def _judged(self, size: int, accepted: set[int], refused: list[Refusal]) -> list[Literal[True] | Refusal]:
        """complete_many's answer, its accepted completions counted and refused ones reported:
        ``True`` where accepted, else the item's refusal (``refused`` holds one per refused
        position, in order)."""
        if accepted:
            self._ctx.metrics.add("complete_many.accepted", len(accepted))
        why = iter(refused)
        return self._ctx.refused(refused, [True if i in accepted else next(why) for i in range(size)])

    def _completions_unit(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        now: object,
        outcome: Outcome,
        stored_by: _StoredBy | None = None,
    ) -> tuple[int, Callable[[Executor], set[int]] | None, list[Refusal], bool]:
        """The unit of :meth:`complete_many`, every item checked: how many items there are,
        the unit returning the positions accepted (``None``: none can be), the list the unit
        fills with the refused ones' reasons (read in its transaction), and whether it writes
        with one statement (one chunk of arrays: :meth:`Runner.run`'s ``single``)."""
        ctx = self._ctx
        s, clock = ctx.clock(now)
        batch: list[_Completion] = []
        for item in completions:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise InvalidArgumentType(f"completions must hold (lease, result) pairs, got {item!r:.80}")
            lease, result = item
            job_id, owner, fence = ctx.lease(lease)
            batch.append((job_id, owner, fence, ctx.result(result)))
        # what goes to the database: the first of identical leases, with a fence that can match
        first: dict[tuple[str, str, int], int] = {}
        todo = [
            i
            for i, (job_id, owner, fence, _) in enumerate(batch)
            if fence_can_match(fence) and first.setdefault((job_id, owner, fence), i) == i
        ]
        refused: list[Refusal] = []
        if not todo:
            refused += [never_current("complete_many", j, o, f) for j, o, f, _ in batch]
            return len(batch), None, refused, False
        complete = (stored_by or self._complete_many)(s, clock, batch, todo)

        def unit(x: Executor) -> set[int]:
            accepted = complete(x)
            # each refused item is judged as the guard met it: before the item of this batch
            # that completed its job, that item's lease was the current, live one
            completed_by = {batch[i][0]: i for i in accepted}
            refused[:] = [
                _refusal(ctx, x, s, clock, batch, i, completed_by.get(batch[i][0]))
                for i in range(len(batch))
                if i not in accepted
            ]
            tokens = [batch[i][:3] for i in sorted(accepted)]
            outcome.tokens("complete", tokens, clock, path="complete_many")
            outcome.refusals([r for r in refused if fence_can_match(r.fence)], clock)
            return accepted

        single = ctx.plan.batch_completion == ARRAYS and len(_chunks(batch, todo)) == 1
        return len(batch), unit, refused, single

    def complete_and_claim_next(
        self,
        completions: Iterable[tuple[Lease, str | None]],
        owner: str,
        *,
        ttl: float,
        now: float | None = None,
        limit: int = 1,
        max_attempts: int | None = None,
        conn: CallerConnection | None = None,
    ) -> tuple[list[Literal[True] | Refusal], list[Lease]]:
        """A worker's step: :meth:`complete_many` of ``completions``, then :meth:`claim_next`
        for ``owner``, in **one** transaction (one commit, so on SQLite one fsync, where the
        two calls take two).

        Returns ``(accepted, leases)``: which completions were accepted, in input order (each
        judged on its own, exactly as :meth:`complete_many` does; a refused one does not stop
        the claim), and the new leases. All arguments are checked before anything runs. A
        worker's loop:

            [lease] = store.claim_next("w", ttl=30) or [None]
            while lease is not None:
                result = work(lease.job_id)
                _, leases = store.complete_and_claim_next([(lease, result)], "w", ttl=30)
                lease = leases[0] if leases else None
        """
        _check_completions(completions)
        ctx = self._ctx
        outcome = ctx.outcome()
        claim = self._claim(owner, ttl, now, limit, max_attempts)
        claim_unit = self._claim_next_unit(claim, outcome)
        claimed: list[Lease] = []
        stored_by = None
        if ctx.plan.batch_completion == ARRAYS and ctx.plan.returning:
            # PostgreSQL: the completions and the claim in one statement, one round trip
            stored_by = self._step_in_one(claim, outcome, claimed)
        size, complete, refused, single = self._completions_unit(completions, now, outcome, stored_by)

        def step(x: Executor) -> tuple[set[int], list[Lease]]:
            if complete is None:  # no completion can be accepted: the claim alone
                return set(), claim_unit(x)
            accepted = complete(x)
            return accepted, (list(claimed) if stored_by is not None else claim_unit(x))

        # one statement: the step's own, or (nothing to complete) the claim's
        single = stored_by is not None and (single or complete is None)
        started = time.perf_counter()
        prelude = self._claim_order(claim)
        accepted, leases = ctx.run_jobs(step, conn, outcome=outcome, single=single, prelude=prelude)
        self._claimed(leases, max_attempts, started)
        return self._judged(size, accepted, refused), leases

    def _step_in_one(self, claim: _Claim, outcome: Outcome, claimed: list[Lease]) -> _StoredBy:
        """How a step stores its completions on PostgreSQL: in one statement with its claim
        (:meth:`Statements.step_arrays`), whose leases go to ``claimed`` (noted in ``outcome``).
        More completions than one chunk take the chunks first, the last with the claim."""
        owner, params = claim.owner, claim.binds()

        def stored_by(
            s: Statements, clock: Clock, batch: list[_Completion], todo: list[int]
        ) -> Callable[[Executor], set[int]]:
            at = clock.binds()
            chunks = _chunks(batch, todo)
            first = s.complete_batch_arrays()
            both = s.step_arrays()

            def unit(x: Executor) -> set[int]:
                accepted: set[int] = set()
                for chunk in chunks[:-1]:
                    rows = x.rows(first, {**_completion_arrays(batch, chunk), **at})
                    accepted.update(int(row[0]) for row in rows)
                rows = x.rows(both, {**_completion_arrays(batch, chunks[-1]), **at, **params})
                accepted.update(int(row[0]) for row in rows if row[0] is not None)
                leases = [
                    Lease(row[1], owner, int(row[2]), float(row[3]), *payload_of(row, 4))
                    for row in rows
                    if row[1] is not None
                ]
                outcome.leases("claim", leases, claim.clock)
                claimed[:] = leases
                return accepted

            return unit

        return stored_by

    def _complete_many(
        self, s: Statements, clock: Clock, batch: list[_Completion], todo: list[int]
    ) -> Callable[[Executor], set[int]]:
        """The unit that stores the completions at positions ``todo``: the accepted ones, the
        way the dialect's plan says."""
        how = self._ctx.plan.batch_completion
        at = clock.binds()
        # one completion (a worker's step): its guarded UPDATE alone, one statement where a
        # locking read and a joined UPDATE take two
        if how == EACH or (how == LOCKING and len(todo) == 1):

            def each(x: Executor) -> set[int]:
                stmt = s.complete
                accepted = set()
                for i in todo:
                    job_id, owner, fence, result = batch[i]
                    params = {"job_id": job_id, "holder": owner, "token": fence, "new_result": result}
                    if x.count(stmt, {**params, **at}) == 1:
                        accepted.add(i)
                return accepted

            return each

        chunks = _chunks(batch, todo)
        if how == ARRAYS:
            stmt = s.complete_batch_arrays()

            def returning(x: Executor) -> set[int]:
                accepted: set[int] = set()
                for chunk in chunks:
                    rows = x.rows(stmt, {**_completion_arrays(batch, chunk), **at})
                    accepted.update(int(row[0]) for row in rows)
                return accepted

            return returning

        by_caller = self._ctx.by_caller

        def locking(x: Executor) -> set[int]:
            accepted: set[int] = set()
            for chunk in chunks:
                job_ids = list(dict.fromkeys(batch[i][0] for i in chunk))
                size = batch_size(len(job_ids))
                ids = {f"id_{k}": job_ids[k] if k < len(job_ids) else None for k in range(size)}
                rows = x.rows(s.lock_live(size), {**ids, **at})
                # the rows stay locked until commit: what is current now is current at the UPDATE
                live = {(job_id, owner, int(fence)) for job_id, owner, fence, ok, _ in rows if ok}
                current = [i for i in chunk if batch[i][:3] in live]
                if not current:
                    continue
                size = batch_size(len(current))
                judged_at = float(rows[0][4]) if clock.now is None else clock.now
                stored = x.count(
                    by_caller.complete_batch_joined(size),
                    {**_completion_params(batch, current, size), "now": judged_at},
                )
                if stored != len(current):
                    raise DatabaseError(
                        f"complete_many: {stored} of {len(current)} locked, current leases were "
                        "stored; the transaction is rolled back"
                    )
                accepted.update(current)
            return accepted

        return locking

    def poisoned(
        self, max_attempts: int, *, now: float | None = None, conn: CallerConnection | None = None
    ) -> list[JobState]:
        """Jobs that :meth:`claim_next` with this ``max_attempts`` skips: not done, not
        held, claimed ``max_attempts`` times or more (since the last :meth:`requeue`, with
        the store's ``attempts`` table). Longest ready first."""
        ctx = self._ctx
        s, clock = ctx.clock(now, records=False)  # a read: nothing recorded
        params = {"max_fence": check_count("max_attempts", max_attempts), **clock.binds()}
        stmt = s.poisoned
        return ctx.run_jobs(lambda x: [JobState.from_row(r) for r in x.rows(stmt, params)], conn, write=False)


def _stop_listening(listener: bell.Subscription) -> Rules[None]:
    """Leave the bell and the listening connection (on the async front, inside asyncio's
    bridge); a failure costs nothing but a log line (the connection is closed later)."""
    try:
        yield Send(listener.close, local=True)
    except Exception:  # close() passes its own failures over; a cancelled task's lands here
        logger.debug("could not stop listening for jobs", exc_info=True)


def _refusal(
    ctx: JobsContext,
    x: Executor,
    s: Statements,
    clock: Clock,
    batch: list[_Completion],
    i: int,
    by: int | None,
) -> Refusal:
    """Why item ``i`` of a batch was refused. ``by``: the item of the same batch that
    completed its job, if one did. An item before it met that item's lease, current and
    live (judged against it, not against the job the batch left done); an item after it
    met the job done; an item of a job no item completed meets its row as it is."""
    job_id, owner, fence, _ = batch[i]
    if not fence_can_match(fence):
        return never_current("complete_many", job_id, owner, fence)
    if by is not None and i < by:
        holder, current = batch[by][1], batch[by][2]
        return judge("complete_many", job_id, owner, fence, (holder, current, 0, False))
    return ctx.why(x, s, "complete_many", Guard(job_id, owner, fence), clock)


def _check_completions(completions: object) -> None:
    if isinstance(completions, (str, bytes)) or not isinstance(completions, Iterable):
        raise InvalidArgumentType(
            "completions must be an iterable of (lease, result) pairs, "
            f"got {type(completions).__name__} {completions!r:.80}"
        )


def _chunks(batch: list[_Completion], todo: list[int]) -> list[list[int]]:
    """``todo`` cut into chunks of at most COMPLETE_CHUNK completions and (past the first
    completion) COMPLETE_CHUNK_CHARS result characters."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    chars = 0
    for i in todo:
        size = len(batch[i][3] or "")
        if chunk and (len(chunk) == COMPLETE_CHUNK or chars + size > COMPLETE_CHUNK_CHARS):
            chunks.append(chunk)
            chunk, chars = [], 0
        chunk.append(i)
        chars += size
    chunks.append(chunk)
    return chunks


def _completion_params(batch: list[_Completion], chunk: list[int], size: int) -> dict[str, Any]:
    """The bind parameters of a batch statement of ``size`` for the completions at ``chunk``;
    the rows past them are NULLs, which match no job."""
    params: dict[str, Any] = {}
    padding = (None, None, None, None, None)
    for k, names in enumerate(_completion_binds(size)):
        row = (chunk[k], *batch[chunk[k]]) if k < len(chunk) else padding
        params.update(zip(names, row, strict=True))
    return params


def _completion_arrays(batch: list[_Completion], chunk: list[int]) -> dict[str, Any]:
    """The five arrays :meth:`Statements.complete_batch_arrays` binds, for ``chunk``."""
    rows = [batch[i] for i in chunk]
    return {
        "ns": chunk,
        "ids": [r[0] for r in rows],
        "holders": [r[1] for r in rows],
        "tokens": [r[2] for r in rows],
        "results": [r[3] for r in rows],
    }


@functools.lru_cache(maxsize=16)
def _completion_binds(size: int) -> tuple[tuple[str, str, str, str, str], ...]:
    """The names :meth:`Statements.complete_batch_joined` and :meth:`Statements.lock_live`
    bind, per row."""
    return tuple((f"n_{k}", f"id_{k}", f"holder_{k}", f"token_{k}", f"result_{k}") for k in range(size))
