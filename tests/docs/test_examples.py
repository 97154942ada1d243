"""The examples run for real, against the tested database, and their checks can fail."""

from __future__ import annotations

import collections
import importlib.util
import multiprocessing
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import sqlalchemy as sa

import fencing

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "worker_pool.py"
#: a run takes well under 20 s (spawn, about two TTLs of stall and idle); this is the backstop
TIMEOUT = 90
SMALL_RUN = ("--workers", "3", "--jobs", "40", "--ttl", "2")
SUMMARY = re.compile(
    r"^PASS: 40/40 jobs done exactly once, 40 invoices, each by the completing lease; "
    r"stale writes rejected: (?P<rejected>\d+), retries: (?P<retries>\d+)$",
    re.MULTILINE,
)


def run_example(target: str, *extra: str) -> str:
    """Run the worker pool on ``target`` (the example takes a URL or a SQLite path as --url)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", target, *SMALL_RUN, *extra],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    if "://" not in target:
        assert Path(target).exists()  # it used the test's SQLite file, not a temp one
    return proc.stdout


def load_example(path: Path = EXAMPLE, name: str = "worker_pool_example") -> ModuleType:
    """An example's module, imported from its file."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_worker_pool_does_every_job_exactly_once(target: str) -> None:
    out = run_example(target)
    summary = SUMMARY.search(out)
    assert summary is not None, out
    assert summary["rejected"] == "0"
    assert "[FAILED]" not in out


@pytest.mark.slow
def test_worker_pool_rejects_the_stalled_workers_write(target: str) -> None:
    out = run_example(target, "--stall-one")
    summary = SUMMARY.search(out)
    assert summary is not None, out
    assert int(summary["rejected"]) >= 1
    stalled = re.search(r"^(worker-\d+): stalling [\d.]+ s before writing (\S+) \(fence (\d+)\)$", out, re.M)
    assert stalled is not None, out
    worker, job_id, fence = stalled.groups()
    assert f"{worker}: stale write REJECTED" in out
    assert "[ok] the stalled worker's stale write was rejected" in out
    # the job was finished under a later lease: a higher fence
    takeover = re.search(
        rf"^{re.escape(job_id)}: {worker}'s write under fence {fence} was rejected; "
        r"\S+ completed it under fence (\d+)$",
        out,
        re.M,
    )
    assert takeover is not None, out
    assert int(takeover[1]) > int(fence)


def test_worker_pool_checks_catch_an_invoice_from_a_stale_lease(target: str) -> None:
    example = load_example()
    store = example.open_store(target)
    try:
        store.create_table()
        example.app_metadata.create_all(store.engine)
        for job_id in ("p-0", "p-1"):
            store.enqueue(job_id)

        good = store.claim("p-0", "worker-1", ttl=30)
        with store.fenced(good, complete=True, result="ok") as conn:
            conn.execute(
                example.invoices.insert().values(job_id="p-0", total=1, written_by="worker-1", fence=1)
            )
        stale = store.claim("p-1", "worker-1", ttl=30)
        store.revoke("p-1")  # moves the fence on: the stale lease can no longer write
        current = store.claim("p-1", "worker-2", ttl=30)
        assert current.fence > stale.fence == 1
        # a broken application: the current lease commits the stale lease's invoice
        with store.fenced(current, complete=True, result="ok") as conn:
            conn.execute(
                example.invoices.insert().values(job_id="p-1", total=2, written_by="worker-1", fence=1)
            )

        reports = [
            {
                "worker": "worker-1",
                "completed": [("p-0", 1)],
                "rejected": [("p-1", 1)],
                "lost": [],
                "released": [],
            },
            {
                "worker": "worker-2",
                "completed": [("p-1", current.fence)],
                "rejected": [],
                "lost": [],
                "released": [],
            },
        ]
        checks, rows = example.check_outcome(store, ["p-0", "p-1"], "p-", reports, [0, 0], True)
    finally:
        example.close_store(store)

    assert len(rows) == 2
    failed = [text for ok, text in checks if not ok]
    assert failed == [
        "each invoice was written under the lease that completed its job (owner and fence match)"
    ]


def test_worker_pool_step_claims_the_next_batch_with_the_write_or_not_at_all(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last write of a batch claims the next batch in its own transaction: both commit, or
    a write refused at its final check takes its claim back with it."""
    example = load_example()
    store = example.open_store(target)
    # job ids whose simulated work never fails (it fails on the first attempt of some ids)
    ids = [f"s-{n:02d}" for n in range(60) if zlib.crc32(f"s-{n:02d}".encode()) % example.FLAKY_ONE_IN]
    ids = ids[: 2 + 2 * example.BATCH]
    try:
        store.create_table()
        example.app_metadata.create_all(store.engine)
        for job_id in ids:
            store.enqueue(job_id)

        def process(job_id: str, ttl: float) -> tuple[str, list[fencing.Lease]]:
            lease = store.claim(job_id, "worker-1", ttl=ttl)
            beat = fencing.Heartbeat(store, lease, ttl, release_on_error=False).start()
            worker = example.Worker("worker-1", store, ttl, 0.0, multiprocessing.Semaphore(0))
            outcome, claimed = worker.process(beat, claim_next=True)
            assert (outcome == example.COMPLETED) == (store.state(job_id).result is not None)
            return outcome, claimed

        # the write and the claim of the next batch commit together
        outcome, claimed = process(ids[0], 30.0)
        assert outcome == example.COMPLETED
        assert [lease.job_id for lease in claimed] == ids[1 : 1 + example.BATCH]
        assert {store.state(lease.job_id).owner for lease in claimed} == {"worker-1"}

        # the lease runs out inside the block, after its claim: the final check refuses the
        # write, and the claim is rolled back with the invoice
        claim_next = store.claim_next
        claimed_in_block: list[fencing.Lease] = []

        def slow_claim_next(*args: object, **kwargs: object) -> list[fencing.Lease]:
            claimed_in_block.extend(claim_next(*args, **kwargs))  # type: ignore[arg-type]
            time.sleep(1.5)  # past the 1 s lease, before the block's final check
            return claimed_in_block

        monkeypatch.setattr(store, "claim_next", slow_claim_next)
        outcome, claimed = process(ids[1 + example.BATCH], 1.0)
        monkeypatch.undo()
        rolled_back = ids[2 + example.BATCH :]
        assert [lease.job_id for lease in claimed_in_block] == rolled_back
        assert (outcome, claimed) == (example.REJECTED, [])
        assert [store.state(job_id).owner for job_id in rolled_back] == [None] * len(rolled_back)
        with store.engine.connect() as conn:
            invoiced = conn.execute(sa.select(example.invoices.c.job_id)).scalars().all()
        assert invoiced == [ids[0]]
    finally:
        example.close_store(store)


# -- the ORM application (examples/orm_app) ---------------------------------------------------

ORM_APP = Path(__file__).resolve().parents[2] / "examples" / "orm_app" / "app.py"
ORM_SUMMARY = re.compile(
    r"^PASS: 20 orders, 20 invoices written, (?P<refused>\d+) stale writes refused$", re.MULTILINE
)


@pytest.mark.slow
@pytest.mark.parametrize("stall", [False, True], ids=["plain", "stall-one"])
def test_orm_app_bills_every_order_exactly_once(target: str, stall: bool) -> None:
    proc = subprocess.run(
        [sys.executable, str(ORM_APP), "--url", target, "demo", "--orders", "20", "--ttl", "2"]
        + (["--stall-one"] if stall else []),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = ORM_SUMMARY.search(proc.stdout)
    assert summary is not None, proc.stdout
    assert int(summary["refused"]) >= (1 if stall else 0)
    assert "[FAILED]" not in proc.stdout


@pytest.mark.usefixtures("logging_kept", "imports_kept")
def test_orm_app_migrations_are_its_models_and_its_report_can_fail(target: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy.orm import Session

    app = load_example(ORM_APP, "orm_app_example")
    models = sys.modules["models"]
    app.migrate(target)
    engine = app.make_engine(target)
    try:
        with engine.connect() as conn:
            # the committed migration creates exactly what the models (and fencing) declare
            assert compare_metadata(MigrationContext.configure(conn), models.Base.metadata) == []
        first, second = app.place_orders(target, 2)
        store = fencing.JobStore(engine, models.jobs)
        lease = store.claim(f"bill-order-{first}", "w", ttl=60)
        assert lease is not None and store.complete(lease, "invoiced")
        with Session(engine) as session, session.begin():  # a broken biller: not the lease's invoice
            session.add(models.Invoice(order_id=first, total=1, worker="w", fence=lease.fence + 1))
    finally:
        engine.dispose()
    assert app.report(target) == [
        f"order {first}: invoiced by w (fence {lease.fence + 1}), completed by w (fence {lease.fence})",
        f"order {second}: 0 invoices",
    ]


LEADER = Path(__file__).resolve().parents[2] / "examples" / "leader.py"


@pytest.mark.slow
def test_leader_example_refuses_the_woken_ex_leaders_write(target: str) -> None:
    # the first leader freezes (SIGSTOP) past its ttl; another takes over with the next term;
    # the woken one writes with its old lease and the database refuses it. The run's clock
    # starts as the candidates are spawned: 10 s, not the default 4, so that a loaded machine's
    # slow imports and connects (CI's PostgreSQL run saw no write within 4 s) leave time to act
    proc = subprocess.run(
        [sys.executable, str(LEADER), "--url", target, "--stall-leader", "--seconds", "10"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    frozen = re.search(r"^(candidate-\d+): frozen \(SIGSTOP\) with term (\d+)", proc.stdout, re.M)
    assert frozen is not None, proc.stdout
    who, term = frozen.groups()
    assert f"{who}: write under term {term} REFUSED (stale fence)" in proc.stdout
    assert re.search(r"^PASS: \d+ ticks under [2-9]\d* terms", proc.stdout, re.M), proc.stdout


def test_leader_example_checks_can_fail() -> None:
    leader = load_example(LEADER, "leader_example")
    Tick = collections.namedtuple("Tick", "term candidate")  # a row as the example reads it
    good = [Tick(1, "a"), Tick(1, "a"), Tick(2, "b")]
    assert leader.check(good, [], stalled=False) == 0
    assert leader.check([Tick(2, "b"), Tick(1, "a")], [], stalled=False) == 1  # a term went back
    assert leader.check([Tick(1, "a"), Tick(1, "b")], [], stalled=False) == 1  # two leaders, one term
    stall = [("stalling", "a", 1)]
    assert leader.check(good, stall, stalled=True) == 1  # its write was not refused
    assert leader.check(good, [*stall, ("refused", "a", 1)], stalled=True) == 0
