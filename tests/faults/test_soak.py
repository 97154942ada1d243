"""A soak of operations (issue 25, "a million operations"): the torture run until the workers
have made ``FENCING_SOAK_OPERATIONS`` operations (claims, renewals, completions with fenced
blocks among them, releases, writes guarded by FenceMarks: :data:`OPERATIONS`), on a backlog of
jobs the controller tops up as they are done, with sync and async workers in one run (even-
numbered on the sync front, odd on the async one), no simulated work (the rate is the
store's), every fault kind: workers frozen past their lease, killed, killed inside their
transaction, leases revoked; and on PostgreSQL and MariaDB the server itself crashed (SIGKILL,
crash recovery) on a private server of the test's own, never the shared one. SQLite has no
server to crash: its "server" is the file, which a killed worker (inside its transaction
too) leaves to SQLite's own recovery.

CI runs a short version (:data:`SHORT` operations per database); ``nox -s soak -- OPERATIONS``
runs the long one (default 1,000,000), outside CI, and prints the figures docs/explanation/proof.md shows.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fencing.torture import TortureConfig, run_torture, summary
from fencing.torture.config import DEFAULT_FAULTS, SERVER_CRASH
from fencing.torture.journal import OPERATIONS, read_journals
from fencing.torture.verdict import judge, judge_journals
from tests.faults.test_server_crash import crashing_server

#: CI's run: long enough for every fault kind and a few backlogs' worth of jobs
SHORT = 3000
#: the operations a run makes before its faults stop (then the backlog is drained)
TARGET = int(os.environ.get("FENCING_SOAK_OPERATIONS", str(SHORT)))
#: the open jobs kept: more are enqueued once fewer than half are left
BACKLOG = 200
#: from the server's restart to its next SIGKILL (0.5-1.5 times it): in CI's run, at least one
#: crash; in a soak, about one every 10 s (a million operations: about a hundred)
CRASH_EVERY = 1.5 if TARGET <= SHORT else 10.0
#: the mean time between two worker faults: in CI's run every kind within seconds; in a soak
#: one every 2 s, as each kill costs a new worker process (a second of CPU to start on a
#: loaded 2-core machine), which would otherwise take the time the rate is meant to measure
FAULT_EVERY = 0.25 if TARGET <= SHORT else 2.0
#: the fault phase ends at the target; this only bounds a run that stopped making progress
LONGEST = 6 * 3600.0


def soak_config(url: str, faults: tuple[str, ...], journal_dir: Path | None = None) -> TortureConfig:
    return TortureConfig(
        url=url,
        workers=8,
        jobs=BACKLOG,
        operations=TARGET,
        seconds=LONGEST,
        front="mixed",
        work=0.0,
        seed=25,
        fault_every=FAULT_EVERY,
        crash_every=CRASH_EVERY,
        drain=120.0,
        faults=faults,
        journal_dir=None if journal_dir is None else str(journal_dir),
        keep_tables=journal_dir is not None,
    )


def figures(run: Any) -> dict[str, Any]:
    """The row of docs/explanation/proof.md: operations, faults of each kind, stale writes
    refused, violations,
    duration, and the controller's peak memory (the verdict's, mostly)."""
    tally = run.verdict.tallies
    refused = sum(n for key, n in tally.items() if key[:2] == ("write", "refused"))
    return {
        "operations": run.operations,
        "per_second": round(run.operations / run.elapsed),
        "seconds": round(run.elapsed, 1),
        "fault_phase": round(run.fault_phase, 1),
        # the store's rate under faults: the target over the phase that made it
        "per_second_in_faults": round(run.config.operations / run.fault_phase),
        "jobs": run.jobs_enqueued,
        "faults": {kind: tally[("fault", kind)] for kind in run.config.faults},
        "stale_refused": {
            "completions": refused,
            "external": tally[("external", "refused")],
            "renewals": tally[("renew", "refused")],
        },
        "unavailable": tally[("unavailable",)],
        "unknown": tally[("unknown",)],
        "violations": run.violations,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def assert_soaked(run: Any) -> None:
    report = summary(run)
    print(report)
    print("soak figures:", json.dumps(figures(run)))
    tally = run.verdict.tallies
    assert run.violations == 0, report
    assert run.operations >= TARGET, report
    # the backlog was topped up as it ran out, and every job enqueued was done once
    assert run.jobs_enqueued > BACKLOG, report
    assert run.jobs_done == run.jobs_enqueued, report
    for kind in run.config.faults:
        assert tally[("fault", kind)] >= 1, f"no {kind} fault was injected\n{report}"
    # both fronts ran, and each worker that stopped cleanly had counters agreeing with its journal
    assert tally[("metrics", "front", "sync")] >= 1, report
    assert tally[("metrics", "front", "async")] >= 1, report
    assert tally[("metrics", "checked")] == tally[("metrics", "agreed")] >= run.config.workers, report
    if SERVER_CRASH in run.config.faults:
        assert tally[(SERVER_CRASH, "recovered")] == tally[("fault", SERVER_CRASH)], report
        assert tally[("unavailable",)] >= 1, report


@pytest.mark.slow
@pytest.mark.backend("sqlite")
def test_soak_of_operations_on_sqlite_with_every_worker_fault(tmp_path: Path) -> None:
    journals = tmp_path / "journals" if TARGET <= SHORT else None  # a soak's are gigabytes
    run = run_torture(soak_config(str(tmp_path / "soak.db"), DEFAULT_FAULTS, journals))
    assert_soaked(run)
    if journals is not None:
        assert_sharded_verdict_is_the_whole_one(run, journals)


@pytest.mark.slow
@pytest.mark.backend("postgresql")
def test_soak_of_operations_on_postgresql_with_server_crashes() -> None:
    with crashing_server("postgresql") as (server, url):
        assert_soaked(run_torture(soak_config(url, (*DEFAULT_FAULTS, SERVER_CRASH)), server=server))


@pytest.mark.slow
@pytest.mark.backend("mysql", "mariadb")
def test_soak_of_operations_on_mariadb_with_server_crashes() -> None:
    with crashing_server("mariadb") as (server, url):
        assert_soaked(run_torture(soak_config(url, (*DEFAULT_FAULTS, SERVER_CRASH)), server=server))


def assert_sharded_verdict_is_the_whole_one(run: Any, journals: Path) -> None:
    """The verdict a shard of jobs at a time (as a run takes it, in bounded memory) finds what
    the whole one, in memory, finds: the same tallies, the same count per rule; also with
    shards of a few jobs each, so the run's jobs span many of them."""
    from fencing.torture.connect import open_engine
    from fencing.torture.controller import _database_state, _database_totals
    from fencing.torture.tables import TortureTables

    config = run.config
    tables = TortureTables.named(config.prefix)
    engine = open_engine(config.url)
    try:
        jobs, _done, _integrity = _database_totals(engine, tables)
        assert jobs == run.jobs_enqueued

        def state_of(first: str, end: str) -> Any:
            return _database_state(engine, tables, first, end)

        whole = judge(config, read_journals(journals), state_of("job-0000000", "job-9999999"), enqueued=jobs)
        sharded = judge_journals(config, journals, state_of, jobs=jobs, enqueued=jobs, shard_jobs=37)
        tables.drop(engine)
    finally:
        engine.dispose()
    assert whole.tallies == sharded.tallies == run.verdict.tallies
    assert whole.counts == sharded.counts == run.verdict.counts
    operations = sum(1 for event in read_journals(journals) if event["k"] in OPERATIONS)
    assert whole.tallies[("operations",)] == operations == run.operations


def _event(kind: str, job: str, **fields: Any) -> dict[str, Any]:
    return {"k": kind, "job": job, "owner": "a", "t0": 1.0, "t1": 1.1, **fields}


def test_sharded_verdict_finds_a_violation_in_any_shard(tmp_path: Path) -> None:
    # two jobs in two shards; the second's fence went out twice: its shard must say so, and
    # the job rows the database has must be asked for by shard
    from fencing.torture.verdict import DatabaseState, job_id

    lines = [
        _event("claim", job_id(0), fence=1, until=9.0),
        _event("claim", job_id(5), fence=1, until=9.0),
        {**_event("claim", job_id(5), fence=1, until=9.0), "owner": "b"},
    ]
    (tmp_path / "worker-000.0000.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    asked: list[tuple[str, str]] = []

    def state_of(first: str, end: str) -> DatabaseState:
        asked.append((first, end))
        rows = [(j, None, 0.0, 1, None, 0) for j in (job_id(0), job_id(5)) if first <= j < end]
        return DatabaseState(jobs=rows, results=[], external=[], marks={})

    config = TortureConfig(url="unused.db", jobs=2, finish="plain")
    verdict = judge_journals(config, tmp_path, state_of, jobs=2, enqueued=6, shard_jobs=3)
    assert asked == [(job_id(0), job_id(3)), (job_id(3), job_id(6))]
    assert verdict.counts["fence issued twice"] == 1
    assert verdict.counts["job not done"] == 2
    assert verdict.counts["job lost"] == 1  # 2 rows, 6 enqueued
    assert verdict.tallies[("operations",)] == 3


@pytest.mark.slow
@pytest.mark.backend("sqlite")
def test_command_line_runs_to_an_operations_target_on_both_fronts(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "fencing", "torture", "--url", str(tmp_path / "t.db"), "--seed", "7"]
    args = [
        "--mixed",
        "--operations",
        "400",
        "--jobs",
        "40",
        "--work",
        "0",
        "--workers",
        "4",
        "--seconds",
        "120",
    ]
    done = subprocess.run(argv + args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "until 400 operations" in done.stdout
    assert "sync front (even-numbered workers): fencing:JobStore" in done.stdout
    assert "async front (odd-numbered workers): fencing.asyncio:AsyncJobStore" in done.stdout
    operations = re.search(r"^operations: (\d+),", done.stdout, re.MULTILINE)
    assert operations is not None and int(operations[1]) >= 400, done.stdout
    jobs = re.search(r"(\d+)/(\d+) jobs done", done.stdout)
    assert jobs is not None and jobs[1] == jobs[2] and int(jobs[2]) > 40, done.stdout  # topped up
