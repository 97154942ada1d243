"""``fencing worker MODULE:FUNCTION``, as an operator runs it: a process of its own, stopped
by SIGTERM, on the database under test."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, MetaData

from fencing import JobStore, failures_table, jobs_table, payloads_table
from fencing.overview import Overview

pytestmark = pytest.mark.slow  # worker processes: once per database

TASKS = """
import asyncio
import time

def double(job):
    return {"twice": job.payload["n"] * 2}

def slow(job):
    open("started", "w").close()  # the test signals only a running job
    time.sleep(float(job.payload))
    return "finished"

def stuck(job):
    job.lost.wait(120)
    return "too late"

def fails(job):
    raise RuntimeError("the printer is on fire")

async def double_async(job):
    await asyncio.sleep(0)
    return {"twice": job.payload["n"] * 2}

async def stuck_async(job):
    await asyncio.sleep(120)  # cancelled when the job is handed back
    return "too late"

def tick(job):
    return job.payload["tick"]

import fencing
SCHEDULES = [fencing.Schedule("every-second", every=1, missed="all")]
NOT_SCHEDULES = [1, 2]
"""


@pytest.fixture
def store(engine: Engine) -> JobStore:
    metadata = MetaData()
    store = JobStore(
        engine,
        jobs_table(metadata),
        payloads=payloads_table(metadata),
        failures=failures_table(metadata),
    )
    store.create_table()
    return store


def _worker(tmp_path: Path, target: str, function: str, *args: str) -> subprocess.Popen[str]:
    """A worker process; its stderr goes to a file of its own (``_log``), read as it runs."""
    (tmp_path / "tasks.py").write_text(textwrap.dedent(TASKS))
    log = tmp_path / f"worker-{len(list(tmp_path.glob('worker-*.log')))}.log"
    with log.open("w") as err:  # the child has its own descriptor of it
        process = subprocess.Popen(
            [sys.executable, "-m", "fencing", "worker", f"tasks:{function}", "--url", target, *args],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    process.log = log  # type: ignore[attr-defined]
    return process


def _log(process: subprocess.Popen[str]) -> str:
    return Path(process.log).read_text(errors="replace")  # type: ignore[attr-defined]


def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    ends = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < ends, "timed out"
        time.sleep(0.05)


def _stopped(process: subprocess.Popen[str], *signals: int) -> tuple[int, str]:
    """Each signal once the worker said it took the one before (two signals close together
    are one to a process that was not scheduled in between: on a loaded machine the second
    SIGTERM of a pair was lost, and the worker drained instead of handing back)."""
    for n, signum in enumerate(signals, 1):
        process.send_signal(signum)
        _until(lambda n=n: process.poll() is not None or _log(process).count(": SIGTERM: ") >= n)  # type: ignore[misc]
    process.wait(60)
    return process.returncode, _log(process)


@pytest.mark.parametrize("function", ["double", "double_async"])
def test_it_runs_each_job_and_stops_on_sigterm(
    tmp_path: Path, target: str, store: JobStore, function: str
) -> None:
    for i in range(6):
        store.enqueue(f"j{i}", payload={"n": i})
    process = _worker(tmp_path, target, function, "--concurrency", "2")
    try:
        _until(lambda: all(store.state(f"j{i}").done for i in range(6)))
    finally:
        code, err = _stopped(process, signal.SIGTERM)
    assert code == 0, err
    assert json.loads(store.state("j5").result) == {"twice": 10}
    assert err.count("ran in") == 6  # a line per job at INFO
    assert "SIGTERM: draining" in err and "stopped" in err


def test_sigterm_lets_the_running_job_finish(tmp_path: Path, target: str, store: JobStore) -> None:
    store.enqueue("long", payload=2.0)
    process = _worker(tmp_path, target, "slow", "--drain", "30")
    _until((tmp_path / "started").exists)  # running: claimed is not enough (a job claimed as
    # the worker stops is handed back before it starts)
    code, err = _stopped(process, signal.SIGTERM)
    assert code == 0, err
    assert store.state("long").result == "finished"


@pytest.mark.parametrize("function", ["stuck", "stuck_async"])
def test_a_second_sigterm_hands_the_job_back_at_once(
    tmp_path: Path, target: str, store: JobStore, function: str
) -> None:
    store.enqueue("stuck")
    process = _worker(tmp_path, target, function, "--drain", "60", "--ttl", "60")
    _until(lambda: store.holder("stuck") is not None)
    started = time.monotonic()
    code, err = _stopped(process, signal.SIGTERM, signal.SIGTERM)
    assert code == 0, err
    assert time.monotonic() - started < 30.0, err  # not the drain's 60 s, nor the lease's
    assert store.holder("stuck") is None and not store.state("stuck").done
    assert "handed back" in err


@pytest.mark.parametrize("function", ["stuck", "stuck_async"])
def test_a_run_past_timeout_is_a_failed_attempt_with_its_stack(
    tmp_path: Path, target: str, store: JobStore, function: str
) -> None:
    store.enqueue("hung")
    process = _worker(tmp_path, target, function, "--timeout", "0.5", "--max-attempts", "1", "--ttl", "60")
    try:
        _until(lambda: store.failure("hung") is not None)
    finally:
        code, err = _stopped(process, signal.SIGTERM)
    failure = store.failure("hung")
    assert (
        failure is not None
        and "TimeoutError: job 'hung' ran past the worker's timeout of 0.5 s" in failure.text
    )
    assert f"in {function}" in failure.text  # where it was: the function's own frame
    assert store.holder("hung") is None and not store.state("hung").done  # poisoned, not done
    assert "poisoned" in err and code == 0, err
    bad = subprocess.run(
        [sys.executable, "-m", "fencing", "worker", "tasks:stuck", "--url", target, "--timeout", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--timeout: must be at least 0.05 seconds, got '0'" in bad.stderr


@pytest.mark.parametrize("function", ["double", "double_async"])
def test_signals_as_it_stops_and_exits_never_kill_it(
    tmp_path: Path, target: str, store: JobStore, function: str
) -> None:
    # a SIGTERM after run() returned met the default action (exit -15) until the command kept
    # a handler of its own for its whole life: one every 5 ms from the first to the exit
    (tmp_path / "tasks.py").write_text(textwrap.dedent(TASKS))
    log = tmp_path / "worker.log"
    with log.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "fencing", "worker", f"tasks:{function}", "--url", target],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    _until(lambda: "slot(s) on" in log.read_text(), 120.0)
    sent = 0
    while process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
            sent += 1
        time.sleep(0.005)
    assert process.wait(60) == 0, (sent, log.read_text())
    assert sent >= 2 and "stopped" in log.read_text()


def test_a_failure_is_kept_with_its_traceback(tmp_path: Path, target: str, store: JobStore) -> None:
    store.enqueue("print")
    process = _worker(tmp_path, target, "fails", "--max-attempts", "1")
    try:
        _until(lambda: store.failure("print") is not None)
    finally:
        code, err = _stopped(process, signal.SIGTERM)
    failure = store.failure("print")
    assert failure is not None and "RuntimeError: the printer is on fire" in failure.text
    assert 'tasks.py", line' in failure.text
    assert "poisoned" in err and code == 0


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("tasks", "the function must be given as MODULE:FUNCTION (tasks:send_email), got 'tasks'"),
        ("no_such_module:f", "cannot import module 'no_such_module'"),
        ("tasks:nothing", "module 'tasks' has no 'nothing'"),
        ("tasks:time", "tasks:time is a module, not a function"),
    ],
)
def test_a_function_it_cannot_find_is_an_error(
    tmp_path: Path, target: str, store: JobStore, spec: str, says: str
) -> None:
    store.enqueue("untouched")
    (tmp_path / "tasks.py").write_text(textwrap.dedent(TASKS))
    ran = subprocess.run(
        [sys.executable, "-m", "fencing", "worker", spec, "--url", target],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 1 and says in ran.stderr and "Traceback" not in ran.stderr
    assert store.holder("untouched") is None and store.state("untouched").fence == 0


def test_workers_keep_a_schedule_each_tick_run_once_and_listed(
    tmp_path: Path, target: str, store: JobStore
) -> None:
    started = time.monotonic()
    workers = [_worker(tmp_path, target, "tick", "--schedules", "tasks:SCHEDULES") for _ in range(2)]
    try:
        # until two ticks ran (a loaded machine takes seconds to start a python): not a fixed sleep
        deadline = started + 60
        while Overview(store.engine, store.table).summary().done < 2:
            assert time.monotonic() < deadline, "no two ticks done in 60 s"
            time.sleep(0.2)
    finally:
        results = [_stopped(w, signal.SIGTERM) for w in workers]
    ran_for = time.monotonic() - started
    assert all(code == 0 for code, _ in results), results
    listed = subprocess.run(
        [sys.executable, "-m", "fencing", "schedules", "--url", target, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["name"] == "every-second" and row["spec"] == "every 1 s"
    # one job per tick of a 1 s schedule: no more than the seconds the workers ran (and the first)
    assert 2 <= row["done"] <= ran_for + 1 and row["running"] == 0 and row["deleted"] == 0
    assert row["waiting"] <= 1 and row["next_tick"] == row["decided_through"] + 1
    text = subprocess.run(
        [sys.executable, "-m", "fencing", "schedules", "--url", target],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert text[0].split() == [
        "schedule",
        "every",
        "last",
        "tick",
        "next",
        "tick",
        "waiting",
        "running",
        "done",
        "deleted",
    ]
    assert text[1].startswith("every-second  every 1 s  ")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("tasks:NOT_SCHEDULES", "tasks:NOT_SCHEDULES holds an int: it must be a list of fencing.Schedule"),
        ("tasks:nothing", "module 'tasks' has no 'nothing'"),
        ("tasks", "the schedules must be given as MODULE:NAME"),
    ],
)
def test_schedules_it_cannot_use_are_an_error(
    tmp_path: Path, target: str, store: JobStore, spec: str, says: str
) -> None:
    (tmp_path / "tasks.py").write_text(textwrap.dedent(TASKS))
    ran = subprocess.run(
        [sys.executable, "-m", "fencing", "worker", "tasks:tick", "--url", target, "--schedules", spec],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 1 and says in ran.stderr and "Traceback" not in ran.stderr
