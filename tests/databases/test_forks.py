"""fork() after the application used the engine, on every backend (``tests/fork_scenarios.py``).

A store, ``FenceMarks`` or ``fenced()`` used in a forked child never touches a connection (or a
SQLite WAL) the parent opened, and the parent keeps working: checked here from a process that
took part in neither, against the database itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from tests.fork_scenarios import JOBS, job_rows, table_rows

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX-only")


def scenario(name: str, target: str, *, warnings_are_errors: bool = True) -> dict[str, Any]:
    """Run one scenario in an interpreter of its own (one thread: forking is safe there)."""
    flags = ["-W", "error"] if warnings_are_errors else []
    proc = subprocess.run(
        [sys.executable, *flags, "-m", "tests.fork_scenarios", name, target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.mark.slow
def test_a_child_forked_inside_an_open_fenced_block_never_touches_the_parents_transaction(
    target: str, engine: Engine
) -> None:
    report = scenario("used_then_forked_inside_a_fenced_block", target)
    child = report["child"]
    assert "error" not in child, child.get("error")
    assert report["child status"] == 0
    # the child checked connections out of the pool, none of them one its parent had made
    assert child["checked out"] > 0
    assert child["checked out a parent's connection"] is False
    # the child's exit-time cleanup neither committed nor rolled back the parent's block
    assert report["uncommitted insert visible elsewhere"] is False
    assert report["block sees its own insert"] is True
    assert report["block committed"] is True
    assert report["parent still works"] is True
    # every (job, fence) was handed out once, across both processes
    leases = [tuple(pair) for pair in report["parent leases"] + child["leases"]]
    assert len(leases) == len(set(leases)) == JOBS + 2
    assert {job for job, _ in leases} == {"held", "c-after-dispose", *(f"job-{n:02d}" for n in range(JOBS))}
    # and the database agrees: each job done once, by the process that held its lease; the
    # child's last write, made after the parent closed every connection it had, is there
    writer = {job: "parent" for job, _ in report["parent leases"]} | {
        job: "child" for job, _ in child["leases"]
    }
    rows = job_rows(engine)
    assert {job: (owner, fence, result, done) for job, (owner, fence, result, done) in rows.items()} == {
        job: (writer[job], fence, writer[job], 1) for job, fence in leases
    }
    written = table_rows(engine)
    assert sorted(written) == sorted((job, writer[job]) for job, _ in leases if job != "c-after-dispose")
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA integrity_check").scalar_one() == "ok"


@pytest.mark.slow
def test_a_child_leaving_a_fenced_block_of_its_parent_is_refused_and_the_parent_commits(
    target: str, engine: Engine
) -> None:
    report = scenario("child_leaves_a_fenced_block_the_parent_opened", target)
    assert report["child"]["error type"] == "ConfigurationError"
    assert "forked inside it" in report["child"]["message"]
    assert report["block sees its own insert"] is True
    job_id, owner, _until, fence, result, done = report["job"]
    assert (job_id, owner, fence, result, done) == ("held", "parent", 1, "parent", True)
    assert report["rows"] == [["held", "parent"]]
    assert table_rows(engine) == [("held", "parent")]


@pytest.mark.slow
@pytest.mark.backend("sqlite")
def test_sqlite_refuses_a_child_forked_while_another_thread_was_in_a_transaction(
    target: str, engine: Engine
) -> None:
    # fork() with a thread alive is what this is about: Python 3.12 warns of it
    report = scenario("forked_while_another_thread_held_a_connection", target, warnings_are_errors=False)
    for call in ("claim", "state", "FenceMarks"):
        message = report["child"][call]
        assert message is not None and "forked while a connection" in message, (call, message)
    assert report["parent claimed"] is True
    assert report["job-00"] == ["job-00", None, 0.0, 0, None, False]  # the child changed nothing
