"""The story the library exists for, played for real: ``python -m fencing demo``.

Worker A takes a job and stalls. Its lease expires, worker B takes the same job and
completes it. A wakes up late and tries to write its stale result over B's; the store
rejects the write, because the ``UPDATE`` checks owner, fence and a live lease in its
``WHERE`` clause at the moment of writing.

Nothing is simulated: a SQLite file in a temporary directory, two worker processes
(``spawn``), each with its own engine and store, a real TTL and the wall clock as ``now``.
The processes are sequenced with a queue and an event, never with sleeps that guess.
Every outcome printed comes from a store call, and :func:`verdict` decides the exit code.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO, TypeAlias, TypeVar

from .._errors import FencingError, InvalidArgument
from .._runtime.sqlite import create_engine
from .._sql.checks import check_ttl
from .._sql.values import JobState, Refusal
from .._store.jobstore import JobStore
from ._options import Commands, at_least

if TYPE_CHECKING:
    from multiprocessing.context import SpawnContext, SpawnProcess
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event

__all__ = ["DEFAULT_TTL", "JOB_ID", "MIN_TTL", "RESULT_A", "RESULT_B", "add_demo", "run_demo", "verdict"]

JOB_ID = "invoice-42"
RESULT_A = "total=99.00 (computed by A)"
RESULT_B = "total=120.00 (computed by B)"
DEFAULT_TTL = 0.5
#: B claims and completes within one TTL; below this a slow machine could expire B too
MIN_TTL = 0.1
#: the longest any single step may take (a spawn start-up on a loaded machine included)
STEP_TIMEOUT = 60.0


class StoryFailed(Exception):
    """A step of the story did not happen; the message says which."""


# -- what the workers report (plain picklable values, sent through one queue) --------------


@dataclass(frozen=True)
class Claimed:
    worker: str
    at: float
    fence: int | None
    until: float | None


@dataclass(frozen=True)
class Stalled:
    worker: str
    at: float


@dataclass(frozen=True)
class Woke:
    worker: str
    at: float


@dataclass(frozen=True)
class Wrote:
    worker: str
    at: float
    result: str
    fence: int
    #: why the store refused the write (``None``: accepted), as it said it
    refusal: Refusal | None

    @property
    def accepted(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True)
class Crashed:
    worker: str
    at: float
    error: str


Report: TypeAlias = Claimed | Stalled | Woke | Wrote | Crashed
R = TypeVar("R", Claimed, Stalled, Woke, Wrote)


# -- the verdict ---------------------------------------------------------------------------


def verdict(a_late_write_accepted: bool, b_write_accepted: bool, final_state: JobState | None) -> list[str]:
    """What went wrong in the story, or ``[]`` when it went as it must."""
    problems = []
    if a_late_write_accepted:
        problems.append("A's late write under its expired, stale lease was ACCEPTED")
    if not b_write_accepted:
        problems.append("B's write under the current lease was rejected")
    if final_state is None:
        problems.append(f"the job {JOB_ID!r} is missing from the store")
        return problems
    if final_state.result != RESULT_B:
        problems.append(f"the stored result is {final_state.result!r}, not B's {RESULT_B!r}")
    if final_state.fence != 2:
        problems.append(f"the stored fence is {final_state.fence}, not 2 (one claim by A, one by B)")
    if not final_state.done:
        problems.append("the job is not marked done")
    if final_state.owner != "B":
        problems.append(f"the stored owner is {final_state.owner!r}, not 'B'")
    return problems


# -- the workers (each runs in its own spawned process) ------------------------------------


@contextmanager
def _opened_store(db_path: str) -> Iterator[JobStore]:
    engine = create_engine(db_path)
    store = JobStore(engine)
    try:
        yield store
    finally:
        engine.dispose()


def worker_a(db_path: str, ttl: float, reports: Queue[Report], wake: Event, stall_limit: float) -> None:
    """Claim, stall past the lease until woken, then write with the old lease."""
    try:
        with _opened_store(db_path) as store:
            now = time.time()
            lease = store.claim(JOB_ID, "A", now=now, ttl=ttl)
            if lease is None:
                reports.put(Claimed("A", now, None, None))
                return
            reports.put(Claimed("A", now, lease.fence, lease.until))
            reports.put(Stalled("A", time.time()))
            if not wake.wait(stall_limit):
                reports.put(Crashed("A", time.time(), f"was never woken within {stall_limit:.0f} s"))
                return
            reports.put(Woke("A", time.time()))
            now = time.time()
            answer = store.complete(lease, RESULT_A, now=now)
            reports.put(Wrote("A", now, RESULT_A, lease.fence, None if answer else answer))
    except Exception as exc:  # the parent tells the story, failures included
        reports.put(Crashed("A", time.time(), f"{type(exc).__name__}: {exc}"))
        raise


def worker_b(db_path: str, ttl: float, reports: Queue[Report]) -> None:
    """Claim the (expired) job and complete it at once."""
    try:
        with _opened_store(db_path) as store:
            now = time.time()
            lease = store.claim(JOB_ID, "B", now=now, ttl=ttl)
            if lease is None:
                reports.put(Claimed("B", now, None, None))
                return
            reports.put(Claimed("B", now, lease.fence, lease.until))
            now = time.time()
            answer = store.complete(lease, RESULT_B, now=now)
            reports.put(Wrote("B", now, RESULT_B, lease.fence, None if answer else answer))
    except Exception as exc:
        reports.put(Crashed("B", time.time(), f"{type(exc).__name__}: {exc}"))
        raise


# -- the parent: starts the workers, sequences them, prints the timeline -------------------


class _Timeline:
    def __init__(self, out: TextIO, start: float) -> None:
        self.out = out
        self.start = start

    def rel(self, t: float) -> str:
        return f"{t - self.start:+.3f}s"

    def line(self, at: float, who: str, text: str) -> None:
        print(f"{self.rel(at)}  {who:<4}  {text}", file=self.out, flush=True)


def _next_report(reports: Queue[Report], proc: SpawnProcess) -> Report:
    deadline = time.monotonic() + STEP_TIMEOUT
    while True:
        try:
            report: Report = reports.get(timeout=0.05)
            return report
        except queue.Empty:
            pass
        if not proc.is_alive():
            try:  # it may have reported just before exiting
                late: Report = reports.get(timeout=1.0)
                return late
            except queue.Empty:
                raise StoryFailed(
                    f"worker {proc.name} exited (code {proc.exitcode}) without reporting"
                ) from None
        if time.monotonic() > deadline:
            raise StoryFailed(f"worker {proc.name} reported nothing for {STEP_TIMEOUT:.0f} s")


def _expect(kind: type[R], worker: str, reports: Queue[Report], proc: SpawnProcess) -> R:
    report = _next_report(reports, proc)
    if isinstance(report, Crashed):
        raise StoryFailed(f"worker {report.worker} failed: {report.error}")
    if not isinstance(report, kind) or report.worker != worker:
        raise StoryFailed(f"expected {kind.__name__} from worker {worker}, got {report!r}")
    return report


def _said(refusal: Refusal | None) -> str:
    """The store's reason for a refused write, as the demo tells it."""
    assert refusal is not None  # only a refused write is told
    r = refusal
    return f"{r.reason}: fence {r.fence}, current fence {r.current_fence}, holder {r.holder!r}"


def _wait_until_expired(until: float) -> None:
    # the store calls a lease expired from until <= now on
    while (left := until - time.time()) > 0:
        time.sleep(left + 0.001)


def add_demo(commands: Commands) -> None:
    parser = commands.add_parser(
        "demo",
        help="play the late-worker story on a real SQLite file with real worker processes",
        description="Worker A claims a job and stalls past its lease; worker B claims the job and "
        "completes it; A wakes up and tries to write its stale result. The store rejects "
        "A's write. Exit code 0 if the story went exactly so, 1 otherwise.",
    )
    parser.add_argument(
        "--ttl",
        type=at_least(MIN_TTL),
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help=f"lease duration in real seconds (default {DEFAULT_TTL:g}, at least {MIN_TTL:g})",
    )
    parser.set_defaults(run=lambda args: run_demo(args.ttl))


def run_demo(ttl: float = DEFAULT_TTL, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Play the story; 0 if it went as it must, 1 (with the reasons on ``err``) otherwise."""
    ttl = check_ttl(ttl)  # a number too large for a float is refused here, by name
    if not ttl >= MIN_TTL:
        raise InvalidArgument(f"ttl must be at least {MIN_TTL} s, got {ttl!r}")
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    tl = _Timeline(out, time.time())
    print(
        f"fencing demo: one job, two worker processes, a lease TTL of {ttl:g} s, the wall clock as now",
        file=out,
        flush=True,
    )
    try:
        problems = _play(ttl, tl)
    except (StoryFailed, FencingError) as exc:
        problems = [f"{type(exc).__name__}: {exc}" if isinstance(exc, FencingError) else str(exc)]
    if problems:
        print("demo FAILED: the story did not go as it must:", file=err, flush=True)
        for problem in problems:
            print(f"  - {problem}", file=err, flush=True)
        return 1
    print(
        "conclusion: the lease alone did not stop A (it woke after expiry and still wrote); "
        "the fenced write did, so B's result stands.",
        file=out,
        flush=True,
    )
    return 0


def _play(ttl: float, tl: _Timeline) -> list[str]:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fencing-demo-") as tmp:
        db_path = os.path.join(tmp, "jobs.db")
        with _opened_store(db_path) as store:
            store.create_table()
            if not store.enqueue(JOB_ID):
                raise StoryFailed(f"{JOB_ID} already existed in a fresh database file")
            tl.line(time.time(), "main", f"enqueued {JOB_ID} in a fresh SQLite file ({db_path})")
            reports: Queue[Report] = ctx.Queue()
            wake = ctx.Event()
            procs: list[SpawnProcess] = []
            try:
                return _sequence(ctx, store, db_path, ttl, reports, wake, procs, tl)
            finally:
                wake.set()  # never leave A stalled behind us
                for proc in procs:
                    proc.join(STEP_TIMEOUT)
                    if proc.is_alive():
                        proc.terminate()
                        proc.join()
                reports.close()
                reports.join_thread()


def _sequence(
    ctx: SpawnContext,
    store: JobStore,
    db_path: str,
    ttl: float,
    reports: Queue[Report],
    wake: Event,
    procs: list[SpawnProcess],
    tl: _Timeline,
) -> list[str]:
    # A claims, then stalls while holding its lease
    stall_limit = ttl + 3 * STEP_TIMEOUT
    a = ctx.Process(target=worker_a, args=(db_path, ttl, reports, wake, stall_limit), name="A")
    procs.append(a)
    a.start()
    a_claim = _expect(Claimed, "A", reports, a)
    if a_claim.fence is None or a_claim.until is None:
        raise StoryFailed(f"A could not claim the freshly enqueued {JOB_ID}")
    tl.line(a_claim.at, "A", f"claimed {JOB_ID}  fence={a_claim.fence} until={tl.rel(a_claim.until)}")
    stalled = _expect(Stalled, "A", reports, a)
    tl.line(stalled.at, "A", f"stalls (GC pause, swapped-out VM, lost network) holding fence {a_claim.fence}")

    # the lease runs out; the row still names A, but anyone may claim it now
    held = store.state(JOB_ID)
    if held is None:
        raise StoryFailed(f"{JOB_ID} vanished from the store")
    _wait_until_expired(held.until)
    tl.line(
        time.time(), "main", f"A's lease expired (until={tl.rel(held.until)}); A is stalled and does not know"
    )

    # B claims the expired job and completes it
    b = ctx.Process(target=worker_b, args=(db_path, ttl, reports), name="B")
    procs.append(b)
    b.start()
    b_claim = _expect(Claimed, "B", reports, b)
    if b_claim.fence is None or b_claim.until is None:
        raise StoryFailed(f"B could not claim {JOB_ID} although A's lease had expired")
    tl.line(b_claim.at, "B", f"claimed {JOB_ID}  fence={b_claim.fence} until={tl.rel(b_claim.until)}")
    b_wrote = _expect(Wrote, "B", reports, b)
    tl.line(
        b_wrote.at,
        "B",
        f"completed {JOB_ID} with {b_wrote.result!r}: " + ("accepted" if b_wrote.accepted else "REJECTED"),
    )
    b.join(STEP_TIMEOUT)

    # A wakes up late and writes with its old lease
    wake.set()
    woke = _expect(Woke, "A", reports, a)
    tl.line(woke.at, "A", f"wakes up late and writes {RESULT_A!r} with its old lease (fence {a_claim.fence})")
    a_wrote = _expect(Wrote, "A", reports, a)
    a.join(STEP_TIMEOUT)
    final = store.state(JOB_ID)
    if a_wrote.accepted:
        tl.line(a_wrote.at, "A", "A's write ACCEPTED: the stale worker overwrote the result")
    else:
        tl.line(a_wrote.at, "A", f"A's write REJECTED ({_said(a_wrote.refusal)})")
    if final is not None:
        kept = "B's result kept" if final.result == RESULT_B else "stored result"
        tl.line(time.time(), "main", f"{kept}: {final.result!r}")
    print(f"final row (store.state): {final.as_dict() if final else None}", file=tl.out, flush=True)
    return verdict(a_wrote.accepted, b_wrote.accepted, final)
