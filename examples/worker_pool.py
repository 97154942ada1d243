"""A multi-process worker pool on ``fencing``: every job done once, every stale write refused.

Run it::

    python examples/worker_pool.py                       # a SQLite file in a temp dir
    python examples/worker_pool.py --stall-one           # one worker stalls past its TTL once
    python examples/worker_pool.py --url postgresql+psycopg://postgres@127.0.0.1/test
    python examples/worker_pool.py --url jobs.db --workers 8 --jobs 1000 --ttl 5

The pattern, per worker process (see :class:`Worker`):

1. **Claim a small batch.** ``store.claim_next(owner, ttl=ttl, limit=BATCH)`` takes up to
   ``BATCH`` ready jobs in one transaction. Each comes back as a :class:`fencing.Lease`
   carrying a *fence*: a per-job number that goes up with every claim.
2. **Keep the leases alive while working.** ``fencing.Heartbeat(store, lease, ttl)``
   renews a lease every ``ttl / 3`` from a thread, so work may take longer than one TTL.
   A heartbeat starts for every lease of the batch right after the claim, so the leases
   waiting their turn stay alive too. ``heartbeat.check()`` raises ``LeaseLost`` once a
   lease can no longer be vouched for (a renewal was refused, or its deadline passed).
3. **Write the result and complete the job in ONE transaction.** Stop the heartbeat (a
   renewal of a completed job would be refused), check it once more, then::

       with store.fenced(lease, complete=True, result=...) as conn:
           conn.execute(invoices.insert().values(...))

   ``fenced`` checks (and locks) the lease at the start and completes the job at the end
   only if ``owner``, ``fence`` and a live lease still match, in the database, at that
   moment. Otherwise it raises ``LeaseLost`` and the invoice insert is rolled back with it.
   This is the one check a pause cannot slip past: a worker that froze after its last
   local check (a GC pause, swap, a suspended VM) does not know it froze; the database does.
   The last write of a batch is the worker's *step*: inside the same block it also claims
   the next batch (``store.claim_next(..., conn=conn)``), so the invoice, the completion and
   the next claim are one commit (on SQLite one fsync) instead of two, and a rejected write
   takes its claim back with it. (Without an application write of its own, the same step is
   ``store.complete_and_claim_next([(lease, result)], owner, ttl=ttl)``.)
4. **On ``LeaseLost``, just move on**: another worker owns the job now and will finish it.
   **On a failure of the work itself**, ``store.release(lease, delay=...)`` hands the job
   back, claimable again after the delay (the next claim gets a higher fence).
5. **Stop when the queue stays empty for a little longer than one TTL**: a job held by a
   worker that crashed (or stalled) becomes claimable again only when its lease expires.

All times come from the database server's clock (``now=None``, the default), so workers
on different machines agree on when a lease expires.

The application owns its data: the ``invoices`` table lives in its own ``MetaData``, next
to the library's ``jobs`` table. The parent process enqueues the jobs, starts the workers
(``multiprocessing``, ``spawn``), then checks the outcome against the database: every job
done exactly once, exactly one invoice per job, each invoice written under the lease that
completed its job. It exits 0 only if every check passes.

``--stall-one`` makes one worker (the first to reach a write) freeze for longer than the
TTL just before its fenced write (heartbeat stopped, lease in hand). Another worker takes
the job over and finishes it; the stalled write is rejected, and the totals still check
out. Without ``--url`` the jobs live in a SQLite file in a temporary directory; ``--url``
takes any SQLAlchemy URL (the tables are created in that database if missing) or a SQLite
file path.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import queue
import random
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

import fencing

# -- the application's own table, in its own MetaData ----------------------------------------

app_metadata = sa.MetaData()

invoices = sa.Table(
    "invoices",
    app_metadata,
    sa.Column("job_id", sa.String(200), primary_key=True),  # one invoice per job, at most
    sa.Column("total", sa.Numeric(12, 2), nullable=False),
    sa.Column("written_by", sa.String(100), nullable=False),  # the owner of the writing lease
    sa.Column("fence", sa.BigInteger, nullable=False),  # ... and its fence
)

#: leases taken per claim_next (each gets its own heartbeat at once)
BATCH = 5
#: how long an idle worker waits before asking for work again
POLL = 0.1
#: a job whose work failed is claimable again after this many seconds
RETRY_DELAY = 0.5
#: the simulated work fails on the first attempt of about one job in this many
FLAKY_ONE_IN = 10

# what became of one lease (the keys of a worker's report)
COMPLETED = "completed"  # invoice written and job completed, in one transaction
REJECTED = "rejected"  # the fenced write was refused: the lease was no longer current
LOST = "lost"  # the heartbeat reported the lease lost before anything was written
RELEASED = "released"  # the work failed; the job was handed back for a retry
OUTCOMES = (COMPLETED, REJECTED, LOST, RELEASED)


def open_store(target: str) -> fencing.JobStore:
    """A store on ``target``: a SQLAlchemy URL, or a SQLite file path."""
    if "://" in target:
        url = sa.make_url(target)
        if url.get_backend_name() != "sqlite":
            return fencing.JobStore(sa.create_engine(url, pool_pre_ping=True))
        if not url.database or url.database == ":memory:":
            raise SystemExit("worker processes need a SQLite file, not an in-memory database")
        target = url.database
    # SQLite needs the library's engine: BEGIN IMMEDIATE, WAL, a busy timeout
    return fencing.JobStore(fencing.create_sqlite_engine(target))


def close_store(store: fencing.JobStore) -> None:
    store.engine.dispose()
    store.engine.dispose()


def describe(target: str) -> str:
    if "://" in target:
        return sa.make_url(target).render_as_string(hide_password=True)
    return f"SQLite file {target}"


# -- the work ---------------------------------------------------------------------------------


class WorkFailed(Exception):
    """The work itself failed (say, an upstream service timed out): retry the job later."""


def compute_invoice(lease: fencing.Lease, work: float) -> Decimal:
    """The "work": a short sleep and a total derived from the job id; sometimes it fails."""
    time.sleep(random.uniform(0.25, 1.0) * work)
    digest = zlib.crc32(lease.job_id.encode())
    if digest % FLAKY_ONE_IN == 0 and lease.fence == 1:  # the fence counts the attempts
        raise WorkFailed(f"upstream timed out pricing {lease.job_id}")
    return Decimal(digest % 100_000) / 100


# -- a worker process -------------------------------------------------------------------------


class Worker:
    """One worker process: claim, work under a heartbeat, write fenced; report at the end."""

    def __init__(
        self, name: str, store: fencing.JobStore, ttl: float, work: float, stall_ticket: Any
    ) -> None:
        self.name = name
        self.store = store
        self.ttl = ttl
        self.work = work
        #: --stall-one: a semaphore of one shared by the pool; whoever takes it stalls once
        self.stall_ticket = stall_ticket
        #: outcome -> [(job_id, fence)]: what the parent checks against the database
        self.report: dict[str, Any] = {"worker": name, **{outcome: [] for outcome in OUTCOMES}}

    def run(self) -> None:
        # a lease held by a crashed or stalled worker comes back after at most one TTL:
        # wait a little longer than that before deciding the queue is drained
        idle_exit = self.ttl + 1.0
        idle_since = time.monotonic()
        leases: list[fencing.Lease] = []  # the next batch, when the last write claimed it
        while time.monotonic() - idle_since < idle_exit:
            if not leases:
                leases = self.store.claim_next(self.name, ttl=self.ttl, limit=BATCH)
            if not leases:
                time.sleep(random.uniform(0.5, 1.5) * POLL)
                continue
            # keep every lease of the batch alive from now on, not only the one being worked
            # on: release_on_error=False, as a failure is released with a delay below
            heartbeats = [
                fencing.Heartbeat(self.store, lease, self.ttl, release_on_error=False) for lease in leases
            ]
            leases = []
            try:
                for heartbeat in heartbeats:
                    with contextlib.suppress(fencing.LeaseLost):  # refused: process() skips it
                        heartbeat.start()  # renews now, then every ttl/3 on a thread
                for n, heartbeat in enumerate(heartbeats, 1):
                    # the last write of a batch also claims the next batch (the worker's step)
                    outcome, leases = self.process(heartbeat, claim_next=n == len(heartbeats))
                    self.report[outcome].append((heartbeat.lease.job_id, heartbeat.lease.fence))
            finally:
                for heartbeat in heartbeats:
                    heartbeat.stop()  # idempotent; a no-op for one never started
            idle_since = time.monotonic()

    def process(self, heartbeat: fencing.Heartbeat, *, claim_next: bool) -> tuple[str, list[fencing.Lease]]:
        """Work on one lease; its outcome, and the next batch if ``claim_next`` and the write
        committed (the claim is in the write's transaction: one commit for both)."""
        lease = heartbeat.lease
        try:
            heartbeat.check()  # LeaseLost if the lease lapsed before its turn came
            try:
                total = compute_invoice(lease, self.work)
            finally:
                # stop renewing before the write: a renewal of a completed job is refused.
                # Stopping does not shorten the lease: it stays live until its until.
                heartbeat.stop()
            heartbeat.check()  # a cheap local check: was the lease lost while working?
        except fencing.LeaseLost:
            return LOST, []  # another worker owns the job now (or will): nothing to undo
        except Exception:
            # the work failed: hand the job back, claimable again after RETRY_DELAY
            self.store.release(lease, delay=RETRY_DELAY)
            return RELEASED, []

        if self.stall_ticket.acquire(block=False):  # --stall-one: freeze after the last check
            pause = self.ttl + 1.0
            say(f"{self.name}: stalling {pause:.1f} s before writing {lease.job_id} (fence {lease.fence})")
            time.sleep(pause)

        try:
            # the invoice and the completion commit together, or not at all
            with self.store.fenced(lease, complete=True, result=f"invoiced {total}") as conn:
                conn.execute(
                    invoices.insert().values(
                        job_id=lease.job_id, total=total, written_by=lease.owner, fence=lease.fence
                    )
                )
                # the worker's step: the next batch is claimed in the same transaction, so the
                # invoice, the completion and the claim commit together (one commit, on SQLite
                # one fsync, instead of two), or none of them does
                claimed = (
                    self.store.claim_next(self.name, ttl=self.ttl, limit=BATCH, conn=conn)
                    if claim_next
                    else []
                )
        except fencing.LeaseLost as lost:
            say(f"{self.name}: stale write REJECTED, invoice rolled back: {lost}")
            return REJECTED, []  # the claim, if made, was rolled back with the invoice
        return COMPLETED, claimed


def worker_main(
    name: str,
    target: str,
    ttl: float,
    work: float,
    stall_ticket: Any,
    start_together: Any,
    reports: Any,
) -> None:
    """The entry point of a worker process (spawned: it opens its own engine)."""
    store = open_store(target)
    try:
        worker = Worker(name, store, ttl, work, stall_ticket)
        start_together.wait(timeout=120)  # so no worker drains the queue before the others start
        worker.run()
    finally:
        close_store(store)
    reports.put(worker.report)


def say(line: str) -> None:
    print(line, flush=True)


# -- the parent: enqueue, run the pool, check the outcome -------------------------------------


def run_pool(target: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[int | None]]:
    """Start the workers and wait for them; their reports and exit codes."""
    ctx = multiprocessing.get_context("spawn")
    start_together = ctx.Barrier(args.workers)
    reports_queue = ctx.Queue()
    stall_ticket = ctx.Semaphore(1 if args.stall_one else 0)  # taken once, never given back
    processes = []
    for i in range(1, args.workers + 1):
        name = f"worker-{i}"
        worker_args = (name, target, args.ttl, args.work, stall_ticket, start_together, reports_queue)
        processes.append(ctx.Process(target=worker_main, name=name, args=worker_args))
    for process in processes:
        process.start()
    reports: list[dict[str, Any]] = []
    # read the reports before joining: a process exits only once its queue is flushed
    while len(reports) < len(processes):
        try:
            reports.append(reports_queue.get(timeout=0.5))
        except queue.Empty:
            if not any(p.is_alive() for p in processes):
                with contextlib.suppress(queue.Empty):
                    while len(reports) < len(processes):
                        reports.append(reports_queue.get(timeout=0.5))
                break
    for process in processes:
        process.join()
    return reports, [p.exitcode for p in processes]


def check_outcome(
    store: fencing.JobStore,
    job_ids: list[str],
    prefix: str,
    reports: list[dict[str, Any]],
    exit_codes: list[int | None],
    stall: bool,
) -> tuple[list[tuple[bool, str]], list[Any]]:
    """Compare what the workers report with what the database holds: (checks, invoices)."""
    ours = set(job_ids)
    states = {job_id: store.state(job_id) for job_id in job_ids}
    with store.engine.connect() as conn:
        mine = invoices.c.job_id.startswith(prefix, autoescape=True)
        rows = list(conn.execute(sa.select(invoices).where(mine)))

    def reported(outcome: str) -> list[tuple[str, str, int]]:
        return [(r["worker"], job, fence) for r in reports for job, fence in r[outcome] if job in ours]

    completions = Counter(job for _, job, _ in reported(COMPLETED))
    completed_by = {job: (worker, fence) for worker, job, fence in reported(COMPLETED)}
    invoice_of = {row.job_id: row for row in rows}
    superseded = reported(REJECTED) + reported(LOST) + reported(RELEASED)
    final_fence = {job: state.fence for job, state in states.items() if state is not None}

    def final_state_matches(job: str) -> bool:
        state, row = states[job], invoice_of.get(job)
        return (
            state is not None
            and row is not None
            and (row.written_by, row.fence) == (state.owner, state.fence) == completed_by.get(job)
        )

    checks = [
        (
            len(reports) == len(exit_codes) and all(code == 0 for code in exit_codes),
            f"every worker exited cleanly and reported (exit codes {exit_codes})",
        ),
        (
            all(s is not None and s.done for s in states.values()),
            f"every job is done ({sum(bool(s and s.done) for s in states.values())}/{len(job_ids)})",
        ),
        (
            completions == Counter(job_ids),
            f"every job was completed exactly once ({sum(completions.values())} completions)",
        ),
        (
            len(rows) == len(job_ids) and set(invoice_of) == ours,
            f"exactly one invoice per job ({len(rows)} invoices)",
        ),
        (
            all(final_state_matches(job) for job in job_ids),
            "each invoice was written under the lease that completed its job (owner and fence match)",
        ),
        (
            all(final_fence.get(job, 0) > fence for _, job, fence in superseded),
            f"every rejected, lost or released lease was superseded by a later one ({len(superseded)})",
        ),
    ]
    if stall:
        checks.append((len(reported(REJECTED)) >= 1, "the stalled worker's stale write was rejected"))
    return checks, rows


def print_table(reports: list[dict[str, Any]], rows: list[Any]) -> None:
    written = Counter(row.written_by for row in rows)
    columns = ("invoices", REJECTED, LOST, RELEASED)
    say(f"\n{'worker':<10}" + "".join(f"{c:>10}" for c in columns))
    totals = Counter[str]()
    for report in sorted(reports, key=lambda r: int(r["worker"].rsplit("-", 1)[1])):
        counts = {"invoices": written[report["worker"]], **{o: len(report[o]) for o in columns[1:]}}
        totals.update(counts)
        say(f"{report['worker']:<10}" + "".join(f"{counts[c]:>10}" for c in columns))
    say(f"{'total':<10}" + "".join(f"{totals[c]:>10}" for c in columns))


def run(target: str, args: argparse.Namespace) -> int:
    store = open_store(target)
    try:
        store.create_table()  # the library's jobs table (idempotent)
        app_metadata.create_all(store.engine)  # the application's invoices table

        # ids unique to this run, so runs against the same database do not mix
        prefix = f"invoice-{uuid.uuid4().hex[:8]}-"
        job_ids = [f"{prefix}{i:05d}" for i in range(args.jobs)]
        with store.engine.begin() as conn:  # one transaction for all of them
            for job_id in job_ids:
                store.enqueue(job_id, conn=conn)

        say(
            f"worker pool: {args.workers} workers, {args.jobs} jobs, ttl {args.ttl:g} s, "
            f"batch {BATCH}, on {describe(target)}"
        )
        started = time.monotonic()
        reports, exit_codes = run_pool(target, args)
        say(f"workers finished in {time.monotonic() - started:.1f} s")

        checks, rows = check_outcome(store, job_ids, prefix, reports, exit_codes, args.stall_one)
        for report in reports:  # who finished the jobs whose writes were rejected
            for job_id, fence in report[REJECTED]:
                state = store.state(job_id)
                if state is not None:
                    say(
                        f"{job_id}: {report['worker']}'s write under fence {fence} was rejected; "
                        f"{state.owner} completed it under fence {state.fence}"
                    )
    finally:
        close_store(store)

    print_table(reports, rows)
    say("\nchecks:")
    for ok, text in checks:
        say(f"  [{'ok' if ok else 'FAILED'}] {text}")
    rejected = sum(len(r[REJECTED]) for r in reports)
    retries = sum(len(r[RELEASED]) for r in reports)
    failed = sum(not ok for ok, _ in checks)
    if failed:
        say(f"\nFAIL: {failed} of {len(checks)} checks failed")
        return 1
    say(
        f"\nPASS: {args.jobs}/{args.jobs} jobs done exactly once, {len(rows)} invoices, "
        f"each by the completing lease; stale writes rejected: {rejected}, retries: {retries}"
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", help="a SQLAlchemy URL or a SQLite file path (default: a temp SQLite file)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--jobs", type=int, default=200, help="jobs to enqueue (default 200)")
    parser.add_argument("--ttl", type=float, default=5.0, help="lease TTL in seconds (default 5)")
    parser.add_argument("--work", type=float, default=0.02, help="max seconds of work per job (default 0.02)")
    parser.add_argument("--stall-one", action="store_true", help="one worker stalls past its TTL once")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.jobs < 1:
        parser.error("--workers and --jobs must be at least 1")
    if not 0.5 <= args.ttl <= 3600:
        parser.error("--ttl must be between 0.5 and 3600 seconds")
    if not 0 <= args.work <= 3600:
        parser.error("--work must be between 0 and 3600 seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url is not None:
        return run(args.url, args)
    with tempfile.TemporaryDirectory(prefix="worker-pool-") as tmp:
        return run(os.path.join(tmp, "jobs.db"), args)


if __name__ == "__main__":
    sys.exit(main())
