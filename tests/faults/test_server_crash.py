"""The database server itself crashes under the torture (issue 25): SIGKILL of PostgreSQL's
postmaster and of ``mariadbd`` (every process of it) mid-run, down 0.2-2 s, started again
(crash recovery), several times in one run, on a private server of the test's own
(:mod:`tests.private_servers`): never the shared one.

The workers ride through (pre-pinging pools, calls that found the database unavailable made
again after a backoff, calls whose outcome is unknown journaled so) and the verdict, with the
settings safe, finds nothing: no fence issued twice (also among claims no worker saw return),
no accepted write lost, every job done once. A server whose settings lose acknowledged
commits on a crash (PostgreSQL's ``synchronous_commit=off``) is caught by the same verdict;
and each new rule is shown to fire on a made-up journal.

``FENCING_CRASH_TORTURE_SECONDS`` lengthens the fault phase (the ``crash_soak`` nox session,
outside CI, which also injects every other fault, on both fronts); CI runs it for 10 s per
database, on the sync front (the async one with ``pytest --long``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import make_url
from sqlalchemy.pool import NullPool

from fencing import ConfigurationError
from fencing.torture import TortureConfig, run_torture, summary
from fencing.torture.config import DEFAULT_FAULTS, SERVER_CRASH
from fencing.torture.verdict import DatabaseState, judge
from tests import private_servers

#: the fault phase; the crash_soak nox session runs it longer
SECONDS = float(os.environ.get("FENCING_CRASH_TORTURE_SECONDS", "10"))
#: a soak (longer than CI's run) injects every other fault too: frozen, killed workers
SOAK = SECONDS > 10
#: from the server's restart to its next SIGKILL, drawn from 0.75-2.25 s: with at most 2 s down
#: and a restart of about a second, the second crash comes within 7.5 s of the phase's start
CRASH_EVERY = 1.5
#: each job's simulated work is up to this long (0.15 s on average): 4 workers finish at most
#: about 27 jobs a second whatever the machine, so the jobs (30 a second of the phase) last the
#: whole phase (which ends early once every job is done), and some are left to do after the
#: last crash
WORK = 0.3
JOBS_PER_SECOND = 30
FAULTS = (*DEFAULT_FAULTS, SERVER_CRASH) if SOAK else ("stop", "revoke", SERVER_CRASH)
#: the sync front in CI (about 25 s a database); the async one too with ``pytest --long`` (the
#: crash_soak session): both together take twice CI's budget for this module
FRONTS = pytest.mark.parametrize("front", ["sync", pytest.param("async", marks=pytest.mark.long)])
#: the verdict's rules about what a crash may lose, and what it must not
LOSS_RULES = {
    "accepted write lost",
    "accepted external write lost",
    "history: claim missing",
    "history: fence issued twice",
}


@contextlib.contextmanager
def crashing_server(kind: str, settings: dict[str, str] | None = None) -> Iterator[tuple[Any, str]]:
    """A started private ``kind`` server and the URL of a database of the run's own on it."""
    with private_servers.private_server(kind, settings) as server:
        url = server.url
        if kind == "mariadb":  # not MariaDB's own ``mysql`` schema
            engine = sqlalchemy.create_engine(url, poolclass=NullPool)
            try:
                with engine.begin() as conn:
                    conn.exec_driver_sql("CREATE DATABASE fencing_crash")
            finally:
                engine.dispose()
            url = make_url(url).set(database="fencing_crash").render_as_string(hide_password=False)
        yield server, url


def crash_run(server: Any, url: str, front: str, *, seed: int, seconds: float = SECONDS) -> Any:
    config = TortureConfig(
        url=url,
        workers=4,
        jobs=int(JOBS_PER_SECOND * seconds),
        seconds=seconds,
        seed=seed,
        front=front,
        work=WORK,
        fault_every=0.5,
        crash_every=CRASH_EVERY,
        drain=max(60.0, 1.5 * seconds),
        faults=FAULTS,
    )
    return run_torture(config, server=server)


def assert_rode_through(run: Any) -> None:
    report = summary(run)
    print(report)  # the figures of a soak (nox -s crash_soak runs pytest -s)
    tally = run.verdict.tallies
    crashes = tally[("fault", SERVER_CRASH)]
    assert run.violations == 0, report
    assert run.jobs_done == run.config.jobs, report
    assert crashes >= 2, f"the server crashed {crashes} time(s), not at least 2\n{report}"
    # after every crash, once the server answered again, the workers wrote again; and after
    # the last one the rest of the jobs were done
    assert tally[(SERVER_CRASH, "recovered")] == crashes, report
    assert tally[("write", "accepted after the last crash")] >= 1, report
    # the crashes were felt: calls found the database away, and were made again
    assert tally[("unavailable",)] >= 1, report
    assert "SIGKILL of the database server, then restart" in report


@pytest.mark.slow
@pytest.mark.backend("postgresql")
@FRONTS
def test_workers_ride_through_postgresql_crashes_and_lose_nothing(front: str) -> None:
    with crashing_server("postgresql") as (server, url):
        assert_rode_through(crash_run(server, url, front, seed=25))


@pytest.mark.slow
@pytest.mark.backend("mysql", "mariadb")
@FRONTS
def test_workers_ride_through_mariadb_crashes_and_lose_nothing(front: str) -> None:
    with crashing_server("mariadb") as (server, url):
        assert_rode_through(crash_run(server, url, front, seed=25))


@pytest.mark.slow
@pytest.mark.backend("postgresql")
def test_verdict_catches_a_server_that_loses_acknowledged_commits_in_a_crash() -> None:
    # synchronous_commit=off acknowledges a COMMIT before its WAL is on disk, or even handed to
    # the OS: a SIGKILL of the server loses the last ones (the WAL writer passes them on at most
    # every 10 s here, or once a WAL page fills). What a worker saw acknowledged is then gone:
    # the verdict must say so. Up to three runs, each with several crashes, until one loses one
    lossy = {"synchronous_commit": "off", "wal_writer_delay": "10s"}
    found: set[str] = set()
    with crashing_server("postgresql", lossy) as (server, url):
        for seed in (1, 2, 3):
            run = crash_run(server, url, "sync", seed=seed, seconds=6.0)
            found = LOSS_RULES & set(run.verdict.counts)
            if found:
                break
    assert found, f"three runs with crashes of a non-durable server lost nothing\n{summary(run)}"
    assert "VIOLATION" in summary(run)


def test_server_crash_needs_a_server_to_kill_and_is_not_a_default() -> None:
    assert SERVER_CRASH not in TortureConfig(url="x.db").faults
    config = TortureConfig(url="x.db", faults=(SERVER_CRASH,))
    with pytest.raises(ConfigurationError, match=r"needs a server of the run's own .* never a shared one"):
        run_torture(config)


@pytest.mark.backend("sqlite")
def test_command_line_refuses_the_server_crash_fault(tmp_path: Any) -> None:
    argv = [sys.executable, "-m", "fencing", "torture", "--url", str(tmp_path / "t.db")]
    done = subprocess.run(
        [*argv, "--faults", f"stop,{SERVER_CRASH}"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the server-crash fault kills the database server" in done.stderr


# -- the verdict's rules about crashes, each shown to fire on a made-up journal ---------------

CONFIG = TortureConfig(url="unused.db", jobs=1, finish="plain")
CRASH = {"k": "fault", "kind": SERVER_CRASH, "down": 1.0, "t0": 3.0, "killed": 3.01, "t1": 4.5}


def _claim(fence: int, owner: str, t0: float) -> dict[str, Any]:
    return {
        "k": "claim",
        "job": "j",
        "fence": fence,
        "owner": owner,
        "until": t0 + 9,
        "t0": t0,
        "t1": t0 + 0.01,
    }


def _write(fence: int, owner: str, t0: float, ok: bool = True, how: str = "plain") -> dict[str, Any]:
    return {
        "k": "write",
        "how": how,
        "job": "j",
        "fence": fence,
        "owner": owner,
        "ok": ok,
        "t0": t0,
        "t1": t0 + 0.01,
    }


def _unknown(op: str, t0: float, **about: Any) -> dict[str, Any]:
    return {"k": "unknown", "op": op, "owner": "a", "t0": t0, "t1": t0 + 0.01, "message": "lost", **about}


def _row(seq: int, event: str, owner: str, fence: int, *refusal: Any) -> tuple[Any, ...]:
    return (seq, "j", event, owner, fence, *(refusal or (None, None, None, None)))


def _db(owner: str = "b", fence: int = 2, done: int = 1, **kw: Any) -> DatabaseState:
    result = f"{owner}#{fence}" if done else None
    return DatabaseState(
        jobs=kw.pop("jobs", [("j", owner, 0.0, fence, result, done)]),
        results=kw.pop("results", []),
        external=kw.pop("external", []),
        marks=kw.pop("marks", {}),
        **kw,
    )


def test_verdict_passes_a_crash_with_unknown_outcomes_either_way() -> None:
    # a's claim of fence 1 never returned (unknown: it committed, the history has it); b claimed
    # fence 2 after a's lease expired; b's completion was lost during COMMIT but kept; a's
    # external write's COMMIT was lost too, and not kept: neither is held to either outcome
    history = [_row(1, "claim", "a", 1), _row(2, "claim", "b", 2), _row(3, "complete", "b", 2)]
    external = {"k": "external", "job": "j", "fence": 2, "owner": "b", "ok": True, "kept": None}
    events = [
        CRASH,
        _unknown("claim", 2.9),
        _claim(2, "b", 5.0),
        {**external, "t0": 5.1, "t1": 5.2},
        _unknown("plain", 5.3, job="j", fence=2),
    ]
    verdict = judge(CONFIG, events, _db(history=history))
    assert verdict.total == 0, verdict.violations
    assert verdict.tallies[("unknown", "claim")] == verdict.tallies[("unknown", "plain")] == 1
    assert verdict.tallies[("fault", SERVER_CRASH)] == 1


@pytest.mark.parametrize(
    ("events", "db", "rule"),
    [
        # b saw its completion accepted; after the crash the job is b's, not done
        ([CRASH, _claim(2, "b", 1.0), _write(2, "b", 2.0)], _db(done=0), "accepted write lost"),
        # ... or another lease's: b's accepted completion gone, the job done again
        ([CRASH, _claim(2, "b", 1.0), _write(2, "b", 2.0)], _db(owner="c", fence=3), "accepted write lost"),
        (
            [
                CRASH,
                _claim(2, "b", 1.0),
                {"k": "external", "job": "j", "fence": 2, "owner": "b", "ok": True, "kept": True},
            ],
            _db(external=[], marks={}),
            "accepted external write lost",
        ),
        (
            [CRASH, _claim(1, "a", 1.0), _claim(2, "b", 5.0), _write(2, "b", 6.0)],
            _db(history=[_row(1, "claim", "b", 2), _row(2, "complete", "b", 2)]),
            "history: claim missing",
        ),
        (
            # a claim nobody saw return (unknown) took fence 2; the crash lost it, and fence 2
            # went to b as well: no journal has fence 2 twice, the history does
            [CRASH, _unknown("claim", 2.9), _claim(2, "b", 5.0), _write(2, "b", 6.0)],
            _db(history=[_row(1, "claim", "a", 2), _row(2, "claim", "b", 2), _row(3, "complete", "b", 2)]),
            "history: fence issued twice",
        ),
        (
            # a refused fenced block well after the crash: its refusal must be in the history
            [CRASH, _claim(1, "a", 1.0), _claim(2, "b", 5.0), _write(1, "a", 6.0, False, "fenced")],
            _db(done=0, history=[_row(1, "claim", "a", 1), _row(2, "claim", "b", 2)]),
            "history: refused write missing",
        ),
    ],
)
def test_verdict_rule_about_a_crash_fires(events: list[dict[str, Any]], db: DatabaseState, rule: str) -> None:
    verdict = judge(CONFIG, events, db)
    assert rule in verdict.counts, verdict.violations


def test_verdict_excuses_a_fenced_refusal_unrecorded_while_the_server_was_down() -> None:
    # its refusal is written after the rollback, in a transaction of its own, which the
    # crash may stop (logged, never raised over the LeaseLost): not a finding then
    events = [CRASH, _claim(1, "a", 1.0), _claim(2, "b", 2.0), _write(1, "a", 3.5, False, "fenced")]
    history = [_row(1, "claim", "a", 1), _row(2, "claim", "b", 2)]
    verdict = judge(CONFIG, events, _db(done=0, history=history))
    assert "history: refused write missing" not in verdict.counts, verdict.violations


def test_verdict_counts_the_crashes_ridden_through() -> None:
    second = {**CRASH, "t0": 8.0, "killed": 8.01, "t1": 9.0}
    events = [CRASH, second, _claim(2, "b", 5.0), _write(2, "b", 6.0)]
    tally = judge(CONFIG, events, _db()).tallies
    assert tally[("fault", SERVER_CRASH)] == 2
    # a write between the first crash and the second; none after the second
    assert tally[(SERVER_CRASH, "recovered")] == 1
    assert tally[("write", "accepted after the last crash")] == 0
