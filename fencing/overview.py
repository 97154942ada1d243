"""What an operator reads: jobs by state, one job, a summary, the fence marks.

Read-only: every method runs one ``SELECT`` (its own snapshot, no write lock), built once,
when first used, by :mod:`fencing._sql.views`, and reads the database's clock
(:class:`fencing._sql.clock.database_now`) in the same statement, so "time left" is what the
store itself would judge.

A job's state is decided in SQL, exactly as the store's guards decide it:

* ``done``: completed (``done = 1``); a deleted job (a tombstone, ``done = 2``) is never shown;
* ``held``: a live lease (``until > now``, an owner);
* ``deferred``: not claimable yet (``until > now``, no owner: enqueued with a later
  ``ready_at`` or released with a ``delay``);
* ``ready``: what :meth:`JobStore.claim_next` with the same ``max_attempts`` may take;
* ``poisoned``: not done, not held, claimed ``max_attempts`` times or more (the fence counts
  claims; since its last requeue, with the store's ``attempts`` table), so
  ``claim_next(max_attempts=...)`` skips it. Without ``max_attempts`` only a job at the last
  fence (2**63-1, never claimable again) is poisoned.

Listing a state walks the ready index ``(done, until, id)`` in its order and stops at the
limit, as ``claim_next`` does, so it costs the same at any backlog (``poisoned`` filters the
ready range by fence, like :meth:`JobStore.poisoned`). :meth:`Overview.summary` counts every
state in one pass over the table.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, Table, inspect
from sqlalchemy.sql import Executable

from ._dialects import of
from ._errors import InvalidArgument, InvalidArgumentType
from ._sql.attempts import check_attempts_table
from ._sql.checks import FENCE_MAX, check_count, check_text, check_time, show_value
from ._sql.dberrors import DB_ERRORS, wrap_database_error
from ._sql.schema import jobs
from ._sql.statements import Statements
from ._sql.views import JobViews
from ._store.marks import fence_marks, idempotency_keys

__all__ = ["STATES", "Cursor", "FenceMark", "Holder", "IdempotencyKey", "JobView", "Overview", "Summary"]

#: every state a job can be in, as :class:`Overview` names them
STATES = ("ready", "held", "deferred", "done", "poisoned")


class Cursor(NamedTuple):
    """Where a page of :meth:`Overview.jobs` ended: the last job's place in the walk.

    Pass it back as ``after=`` for the next page: the listing goes on from that place in the
    index (a keyset page, never an ``OFFSET`` scan), so a page costs the same however deep it
    is, and jobs that change state between pages are neither shown twice in one state nor
    skipped because others moved. :meth:`text` and :meth:`parse` carry it through a URL.
    A named tuple: ``(done, until, job_id)``.
    """

    done: int
    until: float
    job_id: str

    def text(self) -> str:
        """The cursor as URL-safe text (``repr`` of the float: it reads back exactly)."""
        raw = json.dumps([self.done, self.until, self.job_id], ensure_ascii=False).encode("utf-8")
        return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")

    @classmethod
    def parse(cls, text: object) -> Cursor:
        """The cursor :meth:`text` wrote; :class:`~fencing.InvalidArgument` for anything else."""
        if not isinstance(text, str):
            raise InvalidArgumentType(f"a cursor must be a str, got {type(text).__name__}")
        if len(text) > _CURSOR_MAX:
            raise InvalidArgument(f"a cursor is at most {_CURSOR_MAX} characters, got {len(text)}")
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            done, until, job_id = json.loads(raw.decode("utf-8"))
        except (ValueError, TypeError, binascii.Error):
            raise InvalidArgument(f"not a cursor of this listing: {show_value(text)}") from None
        bad_done = isinstance(done, bool) or done not in (0, 1)
        bad_until = isinstance(until, bool) or not isinstance(until, (int, float))
        # compared, not converted: an int past a double's range raises OverflowError in isfinite
        bad_until = bad_until or not abs(until) <= _FLOAT_MAX
        if bad_done or bad_until or not isinstance(job_id, str):
            raise InvalidArgument(f"not a cursor of this listing: {show_value(text)}")
        return cls(done, float(until), check_text("job_id", job_id))


#: a cursor's text: an id of the largest size a server stores (2,000 bytes, in base64) and more
_CURSOR_MAX = 4096
#: the largest finite double (false for nan and inf too: ``not abs(x) <= _FLOAT_MAX``)
_FLOAT_MAX = math.nextafter(math.inf, 0.0)


@dataclass(frozen=True)
class JobView:
    """One job as an operator sees it, read with the database's ``now``."""

    job_id: str
    state: str
    owner: str | None
    fence: int
    until: float
    result: str | None
    #: the database's clock when the row was read (seconds since the epoch)
    now: float

    @property
    def until_in(self) -> float | None:
        """Seconds from ``now`` to ``until`` (negative: past); ``None`` for a done job and
        for ``until = 0`` (enqueued ready at once by the contract, or released without delay:
        no point in time)."""
        if self.state == "done" or self.until == 0:
            return None
        return self.until - self.now

    @property
    def cursor(self) -> Cursor:
        """This job's place in :meth:`Overview.jobs`' walk: ``after=`` for the next page."""
        return Cursor(1 if self.state == "done" else 0, self.until, self.job_id)

    def as_json(self) -> dict[str, Any]:
        """The job as JSON, the same on every face: the CLI's ``--json`` (which names the id
        ``id``), the lease API and the dashboard's event stream."""
        return {
            "job_id": self.job_id,
            "state": self.state,
            "owner": self.owner,
            "fence": self.fence,
            "until": self.until,
            "until_in": self.until_in,
            "result": self.result,
            "now": self.now,
        }

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> JobView:
        job_id, state, owner, fence, until, result, now = row
        return cls(job_id, state, owner, int(fence), float(until), result, float(now))


@dataclass(frozen=True)
class Summary:
    """The table at one instant of the database's clock: counts by state and more."""

    now: float
    ready: int
    held: int
    deferred: int
    done: int
    #: tombstones: deleted jobs, kept for their fence
    deleted: int
    poisoned: int
    #: the ``max_attempts`` ``ready`` and ``poisoned`` were counted with (``None``: no limit)
    max_attempts: int | None
    #: the earliest ``until`` of a ready job, leaving out ``until = 0`` (no point in time)
    oldest_ready_until: float | None
    #: held leases that end within ``within`` seconds
    expiring: int
    within: float
    #: the highest fence in the table, deleted jobs included: the most claims of any job
    highest_fence: int | None
    #: the sum of every fence, deleted jobs included: the claims (and revokes) ever made, so
    #: two summaries' difference is the claims made between them
    claims: int = 0

    @property
    def oldest_ready_age(self) -> float | None:
        """How long the longest-waiting ready job has been ready (seconds)."""
        return None if self.oldest_ready_until is None else self.now - self.oldest_ready_until

    def as_json(self) -> dict[str, Any]:
        """The summary as JSON, for the CLI's ``stats --json`` and the dashboard's stream."""
        return {**asdict(self), "oldest_ready_age": self.oldest_ready_age}


@dataclass(frozen=True)
class Holder:
    """An owner holding live leases (a worker, by the owner name its leases carry), at one
    instant of the database's clock."""

    owner: str
    #: how many jobs it holds
    jobs: int
    #: the earliest and the latest end of its leases (seconds since the epoch)
    first_until: float
    last_until: float
    now: float

    @property
    def first_until_in(self) -> float:
        """Seconds until its first lease ends, unless renewed."""
        return self.first_until - self.now

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "first_until_in": self.first_until_in}


@dataclass(frozen=True)
class FenceMark:
    resource: str
    fence: int


@dataclass(frozen=True)
class IdempotencyKey:
    key: str
    fence: int | None
    #: seconds since the epoch on the database's clock
    recorded_at: float | None


class Overview:
    """Read-only queries on one jobs ``table`` (and the :class:`fencing.FenceMarks` tables)
    through ``engine``, on the database's clock.

    Database errors arrive as the library's: :class:`fencing.TableMissing`,
    :class:`fencing.DatabaseError` and its kind. Pass ``conn=`` to read inside your own
    transaction (``lock=True`` in :meth:`job` then locks the row until it ends).
    """

    def __init__(
        self,
        engine: Engine,
        table: Table = jobs,
        *,
        marks: Table = fence_marks,
        keys: Table = idempotency_keys,
        attempts: Table | None = None,
    ) -> None:
        if not isinstance(engine, Engine):
            raise InvalidArgumentType(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
        for name, value in (("table", table), ("marks", marks), ("keys", keys)):
            if not isinstance(value, Table):
                raise InvalidArgumentType(f"{name} must be a sqlalchemy Table, got {type(value).__name__}")
        self.engine = engine
        self.table = table
        self.marks = marks
        self.keys = keys
        #: the store's attempts table (a requeued job's attempts count from its base), if any
        self.attempts = attempts = check_attempts_table(attempts)
        #: what differs on this database (fencing._dialects)
        self._database = of(engine.dialect)
        #: every read, built when first used (fencing._sql.views)
        self._sql = JobViews(table, marks, keys, attempts, self._database)

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"<Overview table={self.table.name!r} engine={url!r}>"

    def _rows(
        self, stmt: Executable, params: Mapping[str, Any], conn: Connection | None, table: Table
    ) -> Sequence[Sequence[Any]]:
        try:
            if conn is not None:
                return conn.execute(stmt, params).all()
            with self.reading() as own:
                return own.execute(stmt, params).all()
        except DB_ERRORS as exc:
            raise wrap_database_error(exc, table.name) from exc

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for several reads in one transaction (``conn=`` of each method), as
        the methods read on their own: on PostgreSQL with sorts off, so that a table never
        analyzed is walked by its index, not scanned and sorted."""
        try:
            own = self.engine.connect()
        except DB_ERRORS as exc:
            raise wrap_database_error(exc, self.table.name) from exc
        with own:
            if self._database.walks_claim_order:
                try:
                    own.execute(Statements.walk_in_claim_order)
                except DB_ERRORS as exc:
                    raise wrap_database_error(exc, self.table.name) from exc
            yield own

    def now(self, *, conn: Connection | None = None) -> float:
        """The database's clock, in seconds since the epoch."""
        return float(self._rows(self._sql.now, {}, conn, self.table)[0][0])

    def jobs(
        self,
        state: str | None = None,
        *,
        limit: int = 50,
        max_attempts: int | None = None,
        after: Cursor | None = None,
        before: Cursor | None = None,
        prefix: str | None = None,
        conn: Connection | None = None,
    ) -> list[JobView]:
        """Up to ``limit`` jobs in ``state`` (``None``: every state, jobs not done first),
        longest waiting (or soonest expiring) first: by ``until``, then id.

        ``after``: the :attr:`JobView.cursor` of the last job of the previous page; the walk
        goes on from there. ``before``: the cursor of the first job of a page: the ``limit``
        jobs before it, in the same order (the page before; the index walked backwards).
        ``prefix``: only ids that start with it (matched exactly, case and all: ``%`` and
        ``_`` are characters), listed **by id**: the prefix is a range of the primary key,
        walked in its order, so a rare prefix costs its own rows, not a walk of the whole
        table.
        """
        if state is not None and state not in STATES:
            raise InvalidArgument(f"state must be one of {', '.join(STATES)} or None, got {state!r}")
        if state == "poisoned" and max_attempts is None:
            raise InvalidArgument("poisoned needs max_attempts: the claims a job may have")
        for name, cursor in (("after", after), ("before", before)):
            if cursor is not None and not isinstance(cursor, Cursor):
                raise InvalidArgumentType(
                    f"{name} must be a fencing.overview.Cursor, got {type(cursor).__name__}"
                )
        if after is not None and before is not None:
            raise InvalidArgument("give after= or before=, not both")
        params: dict[str, Any] = {"limit": check_count("limit", limit), "max_fence": _max_fence(max_attempts)}
        if prefix is not None:
            prefix = check_text("prefix", prefix)
            if not prefix:
                prefix = None  # every id starts with the empty prefix
            elif not self._storable(prefix):
                return []  # no stored id starts with what this backend cannot store
            else:
                params["prefix"] = self._database.prefix_pattern(prefix)
                params["prefix_low"] = prefix
        cursor = after if after is not None else before
        if cursor is not None:
            params.update(after_done=cursor.done, after_until=cursor.until, after_id=cursor.job_id)
        backward = before is not None
        stmt = self._sql.listing(
            state, paged=cursor is not None, prefixed=prefix is not None, backward=backward
        )
        views = [JobView.from_row(r) for r in self._rows(stmt, params, conn, self.table)]
        return views[::-1] if backward else views

    def job(
        self,
        job_id: str,
        *,
        max_attempts: int | None = None,
        conn: Connection | None = None,
        lock: bool = False,
    ) -> JobView | None:
        """The job ``job_id`` (``None`` if there is none, or it was deleted). ``lock=True``
        (with ``conn=``): ``SELECT ... FOR UPDATE``, the row locked until your transaction ends."""
        key = check_text("job_id", job_id)
        if not self._storable(key):
            return None  # an id this backend cannot store names no job
        if lock and conn is None:
            raise InvalidArgument("lock=True needs conn=: a lock ends with its transaction")
        stmt = self._sql.job_locked if lock else self._sql.job
        rows = self._rows(stmt, {"job_id": key, "max_fence": _max_fence(max_attempts)}, conn, self.table)
        return JobView.from_row(rows[0]) if rows else None

    def summary(
        self, *, within: float = 60.0, max_attempts: int | None = None, conn: Connection | None = None
    ) -> Summary:
        """Counts by state, the longest wait, leases ending within ``within`` seconds and the
        highest fence: one pass over the table, at one instant of the database's clock."""
        within = check_time("within", within)
        if within < 0:
            raise InvalidArgument(f"within must be >= 0 seconds, got {within!r}")
        params = {"within": within, "max_fence": _max_fence(max_attempts)}
        [row] = self._rows(self._sql.summary, params, conn, self.table)
        now, ready, held, deferred, done, deleted, poisoned, oldest, expiring, highest, claims = row
        return Summary(
            now=float(now),
            ready=int(ready),
            held=int(held),
            deferred=int(deferred),
            done=int(done),
            deleted=int(deleted),
            poisoned=int(poisoned),
            max_attempts=max_attempts,
            oldest_ready_until=None if oldest is None else float(oldest),
            expiring=int(expiring),
            within=within,
            highest_fence=None if highest is None else int(highest),
            claims=int(claims),
        )

    def attempts_used(self, job: JobView, *, conn: Connection | None = None) -> int:
        """The attempts ``job`` has used, as ``claim_next(max_attempts=...)`` counts them:
        its fence, less its fence at its last requeue where the attempts table (``attempts=``)
        has one."""
        if not isinstance(job, JobView):
            raise InvalidArgumentType(f"job must be a fencing.overview.JobView, got {type(job).__name__}")
        if self.attempts is None:
            return job.fence
        rows = self._rows(self._sql.attempts_base, {"job_id": job.job_id}, conn, self.attempts)
        return job.fence - (int(rows[0][0]) if rows else 0)

    def holders(self, *, limit: int = 20, conn: Connection | None = None) -> list[Holder]:
        """Who holds live leases now: up to ``limit`` owners, the most jobs first, each with
        the number of jobs it holds and when its leases end. A worker's leases carry its
        owner name (host, process id and a random part unless given): this is the workers
        that are busy, as the database sees them (an idle worker holds nothing)."""
        rows = self._rows(self._sql.holders, {"limit": check_count("limit", limit)}, conn, self.table)
        return [Holder(str(owner), int(n), float(a), float(b), float(now)) for owner, n, a, b, now in rows]

    def has_table(self, table: Table, *, conn: Connection | None = None) -> bool:
        """Whether ``table`` exists in the database."""
        try:
            if conn is not None:
                return inspect(conn).has_table(table.name, schema=table.schema)
            with self.engine.connect() as own:
                return inspect(own).has_table(table.name, schema=table.schema)
        except DB_ERRORS as exc:
            raise wrap_database_error(exc, table.name) from exc

    def fence_marks(self, *, limit: int = 50, conn: Connection | None = None) -> list[FenceMark]:
        """Up to ``limit`` fence marks (the highest fence accepted per resource), by resource."""
        rows = self._rows(self._sql.fence_marks, {"limit": check_count("limit", limit)}, conn, self.marks)
        return [FenceMark(resource, int(fence)) for resource, fence in rows]

    def idempotency_keys(self, *, limit: int = 50, conn: Connection | None = None) -> list[IdempotencyKey]:
        """Up to ``limit`` recorded idempotency keys, by key."""
        rows = self._rows(self._sql.idempotency_keys, {"limit": check_count("limit", limit)}, conn, self.keys)
        return [
            IdempotencyKey(key, None if fence is None else int(fence), None if at is None else float(at))
            for key, fence, at in rows
        ]

    def _storable(self, key: str) -> bool:
        if not self._database.text_holds_nul and "\x00" in key:
            return False
        limit = self._database.id_max_bytes
        return limit is None or len(key.encode("utf-8")) <= limit


def _max_fence(max_attempts: int | None) -> int:
    """The fence a ready job stays below: ``max_attempts``, or the last fence there is."""
    return FENCE_MAX if max_attempts is None else check_count("max_attempts", max_attempts)
