"""What a torture run does: one picklable value, checked once, handed to every process."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .._errors import InvalidArgument, InvalidArgumentType
from .._sql.checks import show_value

__all__ = [
    "DEFAULT_FAULTS",
    "FAULT_KINDS",
    "FINISH_MODES",
    "FRONTS",
    "MIXED",
    "SERVER_CRASH",
    "TortureConfig",
]

#: how a worker finishes a job: in a fenced block with the application's own write, by a
#: plain complete(), by complete_many() over its batch, or by complete_and_claim_next()
#: (the completion and the next claim in one transaction); "mixed" picks one per job
FINISH_MODES = ("mixed", "fenced", "plain", "batch", "step")

#: what the workers run on, and the store each front puts on trial unless told otherwise:
#: the sync store and Heartbeat threads on the sync drivers, or AsyncJobStore, AsyncFenceMarks
#: and AsyncHeartbeat tasks on the asyncio drivers (aiosqlite, asyncpg, asyncmy)
FRONTS = {"sync": "fencing:JobStore", "async": "fencing.asyncio:AsyncJobStore"}
#: both fronts in one run: even-numbered workers on the sync front, odd-numbered on the async
#: one, each with its front's own store (the verdict works from journals and the database)
MIXED = "mixed"


@dataclass(frozen=True)
class TortureConfig:
    """One run of the harness. Times are real seconds; every fault is drawn from ``seed``.

    ``url``: a SQLAlchemy URL, or a SQLite file path. The harness owns only tables named
    ``<prefix>...`` in that database and drops them first, so it never touches the
    application's own ``jobs`` table.
    """

    url: str
    workers: int = 8
    jobs: int = 2000
    seconds: float = 60.0
    seed: int = 1
    ttl: float = 0.5
    #: the longest simulated work per job, outside any transaction
    work: float = 0.01
    finish: str = "mixed"
    #: the largest claim_next batch a worker asks for
    batch: int = 8
    #: the mean time between two faults injected by the controller
    fault_every: float = 0.25
    #: a worker checks its heartbeat before writing this often (the rest of the time the
    #: store alone must refuse a late write)
    check_heartbeat: float = 0.5
    #: a worker gives a job back with a random delay (a retry with backoff) this often
    release_rate: float = 0.03
    #: after the fault phase: how long the workers get to finish every job, no faults
    drain: float = 30.0
    prefix: str = "fencing_torture_"
    #: "sync" or "async" (:data:`FRONTS`), or "mixed" (:data:`MIXED`)
    front: str = "sync"
    #: "module:callable" building the store to put on trial from (engine, table,
    #: history=History): a ``JobStore`` from an ``Engine``, or on the async front an
    #: ``AsyncJobStore`` from an ``AsyncEngine``, recording its ownership history as told
    #: (the verdict checks it); None: the front's own (:data:`FRONTS`)
    store_factory: str | None = None
    journal_dir: str | None = None
    keep_tables: bool = False
    #: the kinds of fault to inject (:data:`DEFAULT_FAULTS` by default; ``server-crash`` needs
    #: a server the harness may kill: ``run_torture(config, server=...)``)
    faults: tuple[str, ...] = field(default=("stop", "kill", "kill-in-transaction", "revoke"))
    #: with ``server-crash``: the mean time from the server's restart to its next SIGKILL (each
    #: drawn from 0.5-1.5 times it, so a phase of a few of them has at least one crash each)
    crash_every: float = 4.0
    #: the fault phase also ends once the workers have made this many operations and every
    #: kind of fault was injected at least once (None: no target, ``seconds`` alone): claims,
    #: renewals, completions (fenced blocks, complete(), each of complete_many()'s and
    #: complete_and_claim_next()'s), releases and writes guarded by FenceMarks.accept, each
    #: counted once it returned, accepted or refused
    #: (:data:`~fencing.torture.journal.OPERATIONS`). With a target, ``jobs`` is the
    #: backlog kept open: more are enqueued as the workers finish them
    operations: int | None = None

    def __post_init__(self) -> None:
        if self.operations is not None and (
            isinstance(self.operations, bool) or not isinstance(self.operations, int)
        ):
            raise InvalidArgumentType(
                f"operations must be an int or None, got {type(self.operations).__name__}"
            )
        # a job takes about four operations: ten million of them stay within the seven digits of
        # the jobs' ids, which the verdict's shards are cut along
        if self.operations is not None and not 1 <= self.operations <= 10_000_000:
            raise InvalidArgument(
                f"operations must be between 1 and 10,000,000, got {show_value(self.operations)}"
            )
        for name in ("workers", "jobs", "seed", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentType(f"{name} must be an int, got {type(value).__name__}")
        if not isinstance(self.url, str) or not self.url:
            raise InvalidArgumentType("url must be a non-empty str")
        if not 1 <= self.workers <= 256:
            raise InvalidArgument(f"workers must be between 1 and 256, got {show_value(self.workers)}")
        if not 1 <= self.jobs <= 10_000_000:
            raise InvalidArgument(f"jobs must be between 1 and 10,000,000, got {show_value(self.jobs)}")
        if not 1 <= self.batch <= 1000:
            raise InvalidArgument(f"batch must be between 1 and 1000, got {show_value(self.batch)}")
        for name, low in (
            ("seconds", 0.0),
            ("ttl", 0.05),
            ("work", 0.0),
            ("fault_every", 0.01),
            ("drain", 1.0),
            ("crash_every", 0.5),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                raise InvalidArgument(f"{name} must be a finite number of seconds, got {show_value(value)}")
            if value < low:
                raise InvalidArgument(f"{name} must be at least {low:g} s, got {value!r}")
        for name in ("check_heartbeat", "release_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise InvalidArgument(f"{name} must be a probability in [0, 1], got {show_value(value)}")
        if self.finish not in FINISH_MODES:
            raise InvalidArgument(f"finish must be one of {', '.join(FINISH_MODES)}, got {self.finish!r}")
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise InvalidArgument(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
        if not isinstance(self.front, str) or self.front not in (*FRONTS, MIXED):
            fronts = ", ".join((*FRONTS, MIXED))
            raise InvalidArgument(f"front must be one of {fronts}, got {show_value(self.front)}")
        if self.store_factory is not None and not isinstance(self.store_factory, str):
            kind = type(self.store_factory).__name__
            raise InvalidArgumentType(f"store_factory must be a str or None, got {kind}")
        if self.front == MIXED and self.store_factory is not None:
            # a factory builds a sync store or an async one, never both
            raise InvalidArgument("store_factory needs one front (sync or async), not mixed")
        if ":" not in self.store:
            raise InvalidArgument(f"store_factory must be 'module:callable', got {self.store_factory!r}")

    @property
    def store(self) -> str:
        """The store factory the workers use: ``store_factory``, or the front's own (on the
        mixed front: the sync one's, for worker 0; see :meth:`for_worker`)."""
        return self.store_factory or FRONTS[self.fronts[0]]

    @property
    def fronts(self) -> tuple[str, ...]:
        """The fronts the workers run on: one, or both (sync first) when mixed."""
        return tuple(FRONTS) if self.front == MIXED else (self.front,)

    def for_worker(self, index: int) -> TortureConfig:
        """What worker ``index`` runs: on the mixed front, sync when even, async when odd."""
        if self.front != MIXED:
            return self
        return dataclasses.replace(self, front=self.fronts[index % 2])


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the largest double: no time is that long
        return False


#: SIGKILL of the database server itself (every process of it), down a short while, then
#: started again (crash recovery): only on a server the harness was given to kill
SERVER_CRASH = "server-crash"
#: SIGSTOP past the TTL then SIGCONT (the late writer); SIGKILL anywhere, or while the
#: worker is inside a write transaction, then a restart; revoke a held lease; and
#: :data:`SERVER_CRASH`
FAULT_KINDS = ("stop", "kill", "kill-in-transaction", "revoke", SERVER_CRASH)
#: what a run injects unless told otherwise: every kind that needs nothing but the database URL
DEFAULT_FAULTS = FAULT_KINDS[:4]
