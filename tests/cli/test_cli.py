"""The ``fencing`` command: every subcommand, its exit codes, its JSON and its tables.

Most tests call ``main(argv)`` in this process (fast) for the details. Every subcommand also
runs at least once through the installed console script in a subprocess, as an operator
runs it, on the database under test (``target``): exit codes, JSON parsed, a table snapshot,
bad URLs, a missing table, odd ids through stdin and argv; ``stats --watch`` and
``torture``'s progress line run on a pseudo-terminal. ``demo``, which makes its own SQLite
file whatever the database under test, and the checks of arguments alone run on SQLite only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, bindparam, event, insert, inspect, make_url

import fencing
import fencing.cli.jobs
from fencing import (
    FenceMarks,
    History,
    JobStore,
    attempts_table,
    failures_table,
    history_table,
    holder_at,
    payloads_table,
)
from fencing._sql.schema import KEY_TYPE
from fencing.cli import main
from fencing.cli._options import resolve_max_attempts
from fencing.cli.commands import build_parser
from fencing.overview import Overview

#: ids that must come back exactly: quotes, non-ASCII, a wide script, a newline
ODD_IDS = ['it\'s "q"', "ünï 日本", "two\nlines", "back\\slash `tick` ; DROP TABLE jobs; --"]
SCRIPT = Path(sys.executable).with_name("fencing")
TIMEOUT = 60
#: the database commands
COMMANDS = ("init", "enqueue", "jobs", "show", "stats", "revoke", "release", "delete", "requeue", "marks")


@dataclass
class Ran:
    code: int | str | None
    out: str
    err: str

    @property
    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.splitlines()]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], target: str) -> Any:
    """``cli("jobs", "--state", "ready")``: ``main`` on the test's database, what it printed."""

    def run(command: str, *args: str, url: str | None = target) -> Ran:
        argv = [command, *(["--url", url] if url is not None else []), *args]
        try:
            code: int | str | None = main(argv)
        except SystemExit as exc:  # argparse's own exits: --help, bad arguments
            code = exc.code
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return Ran(code, out, err)

    return run


@pytest.fixture
def queue(engine: Engine) -> JobStore:
    """A store on the test's database with its jobs table, to set up and check what the
    command does (the command opens its own engine)."""
    s = JobStore(engine)
    s.create_table()
    return s


def db_now(engine: Engine) -> float:
    return Overview(engine).now()


def script(
    *args: str, stdin: str | None = None, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """The installed console script, as an operator runs it (stdin, stdout and stderr pipes)."""
    assert SCRIPT.exists(), f"no console script at {SCRIPT}: pip install -e ."
    done = subprocess.run(
        [str(SCRIPT), *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


# -- a table every state is in, and its snapshot ---------------------------------------------


def every_state(queue: JobStore, engine: Engine) -> None:
    """One job per state, with times that print the same for a minute."""
    now = db_now(engine)
    queue.enqueue("zero", ready_at=0.0)  # the contract's row: until = 0, no point in time
    queue.enqueue("waiting", ready_at=now - 2 * 86400 - 1800)
    queue.enqueue("expired", ready_at=0.0)
    assert queue.claim("expired", "w-old", ttl=1800, now=now - 9000) is not None  # ended 2 h ago
    queue.enqueue(ODD_IDS[0])
    assert queue.claim(ODD_IDS[0], "wörker-1", ttl=9030) is not None  # 2 h 30 m left
    queue.enqueue(ODD_IDS[1], ready_at=now + 10 * 86400 + 1800)
    queue.enqueue(ODD_IDS[2])
    lease = queue.claim(ODD_IDS[2], "w", ttl=60)
    assert lease is not None and queue.complete(lease, "done")
    queue.enqueue("gone")
    assert queue.delete("gone")  # a tombstone: never listed


SNAPSHOT = """\
ID          STATE     OWNER     FENCE  WHEN
zero        ready     -             0  -
waiting     ready     -             0  waiting 2d 00h
expired     ready     w-old         1  lease expired 2h 00m ago
it's "q"    held      wörker-1      1  2h 30m left
ünï 日本    deferred  -             0  ready in 10d 00h
two\\nlines  done      w             1  -
"""


def test_jobs_prints_an_aligned_table_in_claim_order(
    cli: Any, target: str, queue: JobStore, engine: Engine
) -> None:
    every_state(queue, engine)
    ran = cli("jobs")
    assert (ran.code, ran.out, ran.err) == (0, SNAPSHOT, "")
    done = script("jobs", "--url", target)  # and the console script prints the same
    assert (done.returncode, done.stdout, done.stderr) == (0, SNAPSHOT, "")


# -- init and enqueue ----------------------------------------------------------------------------


def test_init_creates_the_table_once_and_says_so(cli: Any, engine: Engine) -> None:
    first = cli("init")
    assert first.code == 0 and "created table 'jobs'" in first.out
    again = cli("init", "--json")
    assert again.code == 0 and again.records == [{"table": "jobs", "created": False}]
    assert JobStore(engine).enqueue("works")
    assert cli("init", "--table", "queue_2").code == 0
    assert cli("enqueue", "--table", "queue_2", "a").code == 0
    assert [r["id"] for r in cli("jobs", "--table", "queue_2", "--json").records] == ["a"]
    assert [r["id"] for r in cli("jobs", "--json").records] == ["works"]


def test_enqueue_says_how_many_were_new_and_changes_no_existing_job(cli: Any, queue: JobStore) -> None:
    queue.enqueue("held")
    lease = queue.claim("held", "w", ttl=60)
    ran = cli("enqueue", "a", "b", "held")
    assert (ran.code, ran.out) == (0, "enqueued 2 new jobs; 1 already existed, unchanged\n")
    held = queue.state("held")
    assert held is not None and (held.owner, held.fence) == ("w", 1)
    assert lease is not None and queue.complete(lease, "r")  # the lease survived
    ran = cli("enqueue", "--json", "b", "c")
    assert ran.records == [{"id": "b", "new": False}, {"id": "c", "new": True}]


def test_enqueue_reads_ids_from_stdin_one_per_line(
    cli: Any, queue: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fencing.cli.jobs, "ENQUEUE_CHUNK", 2)  # three transactions
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\nb\n\nc\nd\r\n spaced \r\n"))
    ran = cli("enqueue", "-")
    assert (ran.code, ran.out) == (0, "enqueued 5 new jobs\n")
    # sorted: jobs enqueued within one tick of the database's clock are listed by id
    assert sorted(r["id"] for r in cli("jobs", "--json").records) == [" spaced ", "a", "b", "c", "d"]
    assert queue.state(" spaced ") is not None  # only the line ending is removed
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    ran = cli("enqueue")
    assert ran.code == 1 and "stdin is not UTF-8 text (line 2)" in ran.err
    assert queue.state("ok") is None  # read whole before anything was enqueued


def test_enqueue_with_a_payload_needs_the_payloads_table_and_json(
    cli: Any, queue: JobStore, engine: Engine
) -> None:
    missing = cli("enqueue", "p1", "--payload", '{"order": 1}')
    assert missing.code == 1 and "--payload needs the payloads table 'fencing_payloads'" in missing.err
    assert queue.state("p1") is None  # nothing enqueued
    workers = JobStore(engine, payloads=payloads_table(MetaData()))
    workers.create_table()
    for bad in ("{order: 1}", "[1, NaN]", "Infinity"):
        refused = cli("enqueue", "p1", "--payload", bad)
        assert refused.code == 2 and "argument --payload: not JSON" in refused.err, bad
    assert queue.state("p1") is None
    ran = cli("enqueue", "p1", "p2", "--payload", '{"order": 1, "to": "wörker"}')
    assert ran.code == 0 and ran.out == "enqueued 2 new jobs\n"
    assert workers.payload("p2") == {"order": 1, "to": "wörker"}
    again = cli("enqueue", "p1", "--payload", '{"order": 2}')
    assert again.code == 0 and "1 already existed, unchanged" in again.out
    assert workers.payload("p1") == {"order": 1, "to": "wörker"}  # an existing job keeps its own


def test_enqueue_defers_with_delay_or_ready_at(cli: Any, queue: JobStore, engine: Engine) -> None:
    assert cli("enqueue", "--delay", "3600", "later").code == 0
    assert cli("enqueue", "--ready-at", str(db_now(engine) + 7200), "much-later").code == 0
    assert cli("enqueue", "--ready-at", "0", "now").code == 0
    shown = {r["id"]: r for r in cli("jobs", "--json").records}
    assert shown["later"]["state"] == shown["much-later"]["state"] == "deferred"
    assert 3590 < shown["later"]["until_in"] <= 3600
    assert shown["now"]["state"] == "ready" and shown["now"]["until_in"] is None
    assert cli("enqueue", "--delay", "-1", "x").code == 2


# -- reading: jobs, show, stats, marks -----------------------------------------------------------


def test_jobs_filters_each_state(cli: Any, queue: JobStore, engine: Engine) -> None:
    every_state(queue, engine)
    queue.enqueue("poisoned", ready_at=0.0)
    for _ in range(2):
        lease = queue.claim("poisoned", "w", ttl=60)
        assert lease is not None and queue.release(lease)
    wanted = {
        "ready": ["poisoned", "zero", "waiting", "expired"],  # until 0 for both: by id
        "held": [ODD_IDS[0]],
        "deferred": [ODD_IDS[1]],
        "done": [ODD_IDS[2]],
    }
    for state, ids in wanted.items():
        records = cli("jobs", "--state", state, "--json").records
        assert [r["id"] for r in records] == ids, state
        assert {r["state"] for r in records} == {state}
    ran = cli("jobs", "--state", "poisoned", "--max-attempts", "2", "--json")
    assert [(r["id"], r["fence"]) for r in ran.records] == [("poisoned", 2)]
    ready = cli("jobs", "--state", "ready", "--max-attempts", "2", "--json").records
    assert "poisoned" not in [r["id"] for r in ready]  # what claim_next(max_attempts=2) skips
    held = cli("jobs", "--state", "held", "--json").records[0]
    assert held["owner"] == "wörker-1" and 9000 < held["until_in"] <= 9030
    assert held["until"] == pytest.approx(held["now"] + held["until_in"])


@pytest.mark.backend("sqlite")
def test_poisoned_jobs_are_told_by_the_shared_setting_without_a_flag(
    cli: Any, queue: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue.enqueue("tried", ready_at=0.0)
    queue.enqueue("fresh", ready_at=0.0)
    for _ in range(2):
        lease = queue.claim("tried", "w", ttl=60)
        assert lease is not None and queue.release(lease)
    monkeypatch.delenv("FENCING_MAX_ATTEMPTS", raising=False)
    assert cli("stats", "--json").records[0]["poisoned"] is None  # not known: not counted
    monkeypatch.setenv("FENCING_MAX_ATTEMPTS", "2")
    assert [r["id"] for r in cli("jobs", "--state", "poisoned", "--json").records] == ["tried"]
    assert [r["id"] for r in cli("jobs", "--state", "ready", "--json").records] == ["fresh"]
    assert cli("show", "tried", "--json").records[0]["state"] == "poisoned"
    assert cli("stats", "--json").records[0]["poisoned"] == 1
    # the flag wins over the setting
    assert cli("stats", "--max-attempts", "3", "--json").records[0]["poisoned"] == 0
    # `fencing worker` and `fencing serve` read the same setting (the worker: 5 without it)
    parser = build_parser()
    for argv, expected in ((["worker", "m:f"], 2), (["serve"], 2)):
        args = parser.parse_args([*argv, "--url", "x.db"])
        assert resolve_max_attempts(args) is None and args.max_attempts == expected, argv
    monkeypatch.delenv("FENCING_MAX_ATTEMPTS")
    args = parser.parse_args(["worker", "m:f", "--url", "x.db"])
    assert resolve_max_attempts(args) is None and args.max_attempts == 5
    # a setting that is not a count is said, before any database work
    monkeypatch.setenv("FENCING_MAX_ATTEMPTS", "two")
    bad = cli("stats")
    assert bad.code == 2
    assert "$FENCING_MAX_ATTEMPTS (the workers' max_attempts) not a whole number: 'two'" in bad.err


def test_jobs_limit_and_what_it_leaves_out(cli: Any, queue: JobStore) -> None:
    for n in range(5):
        queue.enqueue(f"j{n}", ready_at=float(n))
    ran = cli("jobs", "--limit", "2")
    assert ran.code == 0 and len(ran.out.splitlines()) == 3
    assert "(more not shown: --limit 2)" in ran.err
    assert [r["id"] for r in cli("jobs", "--limit", "3", "--json").records] == ["j0", "j1", "j2"]
    assert cli("jobs", "--state", "held").out == "no held jobs in table 'jobs'\n"


def test_show_a_job_with_its_time_left(cli: Any, queue: JobStore) -> None:
    queue.enqueue(ODD_IDS[1])
    queue.claim(ODD_IDS[1], "w", ttl=300)
    ran = cli("show", ODD_IDS[1])
    assert ran.code == 0
    lines = dict(line.split(None, 1) for line in ran.out.splitlines())
    assert lines["id"] == ODD_IDS[1] and lines["state"] == "held" and lines["fence"] == "1"
    assert re.search(r" UTC \(4m [45]\ds left\)$", lines["until"]), lines["until"]
    [record] = cli("show", ODD_IDS[1], "--json").records
    assert (record["id"], record["owner"], record["result"]) == (ODD_IDS[1], "w", None)
    assert 290 < record["until_in"] <= 300
    missing = cli("show", "nobody")
    assert (missing.code, missing.out) == (1, "")
    assert "no job 'nobody' in table 'jobs'" in missing.err


def test_show_prints_the_ownership_history_when_the_table_exists(
    cli: Any, queue: JobStore, engine: Engine
) -> None:
    job = ODD_IDS[1]
    queue.enqueue(job)
    assert "history" not in cli("show", job).out  # no history table: the job alone
    assert cli("show", job, "--json").records[0]["history"] is None
    recorded = JobStore(engine, history=History(history_table(MetaData()), retention=None))
    recorded.create_table()
    old = recorded.claim(job, "wörker-1", ttl=300)
    assert old is not None and recorded.revoke(job)
    assert not recorded.complete(old, "late")
    ran = cli("show", job)
    assert ran.code == 0, ran.err
    lines = ran.out.splitlines()
    start = lines.index("history (fencing_history, oldest first)")
    header, *rows = lines[start + 1 :]
    assert header.split() == ["SEQ", "AT", "EVENT", "OWNER", "FENCE", "DETAIL"]
    assert [row.split()[4:7] for row in rows] == [
        ["claim", "wörker-1", "1"],
        ["revoke", "-", "2"],
        ["refused", "wörker-1", "1"],
    ]
    assert rows[2].endswith("complete: stale fence; holder -, fence 2")
    [record] = cli("show", job, "--json").records
    assert [(e["event"], e["owner"], e["fence"], e["reason"]) for e in record["history"]] == [
        ("claim", "wörker-1", 1, None),
        ("revoke", None, 2, None),
        ("refused", "wörker-1", 1, "stale fence"),
    ]
    assert cli("show", job, "--history-table", "elsewhere", "--json").records[0]["history"] is None


def test_show_prints_the_payload_and_the_last_failure_when_their_tables_exist(
    cli: Any, queue: JobStore, engine: Engine
) -> None:
    job = ODD_IDS[1]
    queue.enqueue(job)
    plain = cli("show", job)
    assert "payload" not in plain.out and "failure" not in plain.out  # no such tables: the job alone
    assert cli("show", job, "--json").records[0]["payload"] is None
    metadata = MetaData()
    workers = JobStore(engine, payloads=payloads_table(metadata), failures=failures_table(metadata))
    workers.create_table()
    workers.enqueue("order-7", payload={"order": 7, "to": "wörker"})
    [lease] = workers.claim_next("w", ttl=300)
    assert lease.job_id == job  # the older job first: it has no payload
    failure = "Traceback (most recent call last):\nValueError: no stock"
    assert workers.release(lease, delay=60, failure=failure)
    ran = cli("show", job)
    assert ran.code == 0, ran.err
    lines = ran.out.splitlines()
    assert dict(line.split(None, 1) for line in lines[:7])["payload"] == "-"
    at = lines.index("last failure (fence 1, at " + lines[lines.index("") + 1].split(", at ")[1])
    assert lines[at + 1 :] == ["  Traceback (most recent call last):", "  ValueError: no stock"]
    [record] = cli("show", job, "--json").records
    assert record["failure"]["fence"] == 1 and record["failure"]["text"].endswith("ValueError: no stock")
    shown = dict(line.split(None, 1) for line in cli("show", "order-7").out.splitlines() if line)
    assert shown["payload"] == '{"order": 7, "to": "wörker"}'
    [record] = cli("show", "order-7", "--json").records
    assert (record["payload"], record["failure"]) == ({"order": 7, "to": "wörker"}, None)
    elsewhere = cli("show", "order-7", "--payloads-table", "elsewhere", "--json").records[0]
    assert elsewhere["payload"] is None


def test_revoke_release_and_delete_are_recorded_in_the_history_when_the_table_exists(
    cli: Any, engine: Engine
) -> None:
    recorded = JobStore(engine, history=History(history_table(MetaData()), retention=None))
    recorded.create_table()
    for job in ("a", "b", "c"):
        recorded.enqueue(job)
        assert recorded.claim(job, "w", ttl=300) is not None
    for command, job in (("revoke", "a"), ("release", "b"), ("delete", "c")):
        ran = cli(command, job)
        assert ran.code == 0, ran.err
    events = {job: [(e.event, e.owner, e.fence) for e in recorded.history(job)] for job in "abc"}
    assert events == {
        "a": [("claim", "w", 1), ("revoke", None, 2)],
        "b": [("claim", "w", 1), ("release", "w", 1)],
        "c": [("claim", "w", 1), ("delete", None, 1)],
    }
    # nobody holds them, and the history says so
    assert all(holder_at(recorded.history(job), time.time() + 1.0) is None for job in "abc")
    # another table's name: the change is made, nothing is recorded where it is not asked
    recorded.enqueue("d")
    assert recorded.claim("d", "w", ttl=300) is not None
    assert cli("revoke", "d", "--history-table", "elsewhere").code == 0
    assert [e.event for e in recorded.history("d")] == ["claim"]


@pytest.mark.parametrize("command", ["revoke", "release", "delete"])
def test_a_change_waits_for_a_workers_open_block_at_most_wait_seconds_and_says_so(
    cli: Any, queue: JobStore, command: str
) -> None:
    queue.enqueue("j")
    lease = queue.claim("j", "w", ttl=300)
    assert lease is not None
    inside, leave = threading.Event(), threading.Event()

    def worker() -> None:  # a fenced block that holds the job's row (SQLite: the write lock)
        with queue.fenced(lease):
            inside.set()
            leave.wait(60)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        assert inside.wait(30)
        started = time.monotonic()
        ran = cli(command, "j", "--wait", "0.5")
        waited = time.monotonic() - started
    finally:
        leave.set()
        thread.join(30)
    assert ran.code == 1, ran.out + ran.err
    assert "stayed locked by another transaction for more than 0.5 s (--wait)" in ran.err
    assert "nothing changed" in ran.err
    assert waited < 10.0, f"waited {waited:.1f} s for a 0.5 s --wait"
    state = queue.state("j")
    assert state is not None and (state.owner, state.fence, state.done) == ("w", lease.fence, False)


def test_stats_counts_every_state(cli: Any, queue: JobStore, engine: Engine) -> None:
    [empty] = cli("stats", "--json").records
    assert (empty["ready"], empty["oldest_ready_age"], empty["highest_fence"]) == (0, None, None)
    assert empty["poisoned"] is None  # not counted without --max-attempts
    every_state(queue, engine)
    queue.enqueue("soon")
    queue.claim("soon", "w", ttl=30)
    [s] = cli("stats", "--json", "--max-attempts", "1", "--within", "60").records
    assert {k: s[k] for k in ("ready", "held", "deferred", "done", "deleted", "poisoned")} == {
        "ready": 2,  # expired (fence 1) is poisoned at max_attempts 1
        "held": 2,
        "deferred": 1,
        "done": 1,
        "deleted": 1,
        "poisoned": 1,
    }
    assert s["expiring"] == 1 and s["highest_fence"] == 1 and s["max_attempts"] == 1
    assert 2 * 86400 + 1800 <= s["oldest_ready_age"] < 2 * 86400 + 1860  # "waiting"; "zero" has no time
    text = cli("stats").out
    assert "poisoned" not in text  # only with --max-attempts
    assert text.splitlines()[0].split()[:2] == ["ready", "3"]
    assert ["oldest", "ready", "2d", "00h"] in [line.split()[:4] for line in text.splitlines()]


def test_stats_watch_repeats_plainly_when_not_on_a_terminal(cli: Any, queue: JobStore) -> None:
    queue.enqueue("a")
    ran = cli("stats", "--watch", "0.1", "--count", "2")
    assert ran.code == 0 and "\x1b" not in ran.out
    assert ran.out.count("claimable now") == 2 and ran.out.count("every 0.1s") == 2
    assert len(cli("stats", "--json", "--watch", "0.1", "--count", "3").records) == 3
    assert cli("stats", "--count", "2").code == 2  # --count goes with --watch


def test_marks_lists_fence_marks_and_idempotency_keys(cli: Any, engine: Engine) -> None:
    touch(engine)
    missing = cli("marks")
    assert missing.code == 1 and "nothing uses FenceMarks" in missing.err
    marks = FenceMarks(engine)
    marks.create_tables()
    empty = "fence marks (fence_marks): none\n\nidempotency keys (idempotency_keys): none\n"
    assert cli("marks").out == empty
    one = cli("marks", "--keys-table", "other_keys")  # one of the two is enough
    assert one.code == 0 and one.out.endswith("\n\nidempotency keys: no table 'other_keys'\n")
    assert marks.accept(ODD_IDS[1], 3) and marks.accept("b", 7)
    assert marks.record_once(ODD_IDS[0], fence=3)
    ran = cli("marks", "--json")
    assert ran.code == 0
    [m1, m2, k] = ran.records
    assert (m1["resource"], m1["fence"], m2["resource"]) == ("b", 7, ODD_IDS[1])
    assert (k["table"], k["key"], k["fence"]) == ("idempotency_keys", ODD_IDS[0], 3)
    assert isinstance(k["recorded_at"], float)
    text = cli("marks").out.splitlines()
    assert text[:4] == ["fence marks (fence_marks):", "RESOURCE  FENCE", "b             7", "ünï 日本      3"]


# -- changing one job ----------------------------------------------------------------------------


def test_revoke_moves_the_fence_of_a_held_job_only(cli: Any, queue: JobStore) -> None:
    queue.enqueue(ODD_IDS[0])
    lease = queue.claim(ODD_IDS[0], "w", ttl=300)
    ran = cli("revoke", ODD_IDS[0])
    assert ran.code == 0 and "fence is now 2, so fence 1 is stale" in ran.out
    assert lease is not None and not queue.complete(lease, "late")  # the holder's token is stale
    state = queue.state(ODD_IDS[0])
    assert state is not None and (state.owner, state.fence) == (None, 2)
    again = cli("revoke", ODD_IDS[0], "--json")
    assert again.code == 1 and again.records == [{"id": ODD_IDS[0], "revoked": False, "state": "ready"}]
    assert "it is ready, not held; nothing changed" in again.err
    assert queue.state(ODD_IDS[0]) == state  # nothing moved
    missing = cli("revoke", "nobody")
    assert missing.code == 1 and "job 'nobody': no such job; nothing changed" in missing.err


def test_release_ends_the_lease_and_keeps_the_fence(cli: Any, queue: JobStore) -> None:
    queue.enqueue("r")
    lease = queue.claim("r", "w", ttl=300)
    ran = cli("release", "r", "--delay", "600", "--json")
    assert ran.code == 0
    assert ran.records == [{"id": "r", "released": True, "owner": "w", "fence": 1, "delay": 600.0}]
    assert lease is not None and not queue.complete(lease, "late")  # no longer the owner
    [job] = cli("jobs", "--json").records
    assert (job["state"], job["owner"], job["fence"]) == ("deferred", None, 1)
    assert cli("release", "r").code == 1  # deferred: nobody holds it
    queue.enqueue("s")
    queue.claim("s", "w", ttl=300)
    assert "claimable again now" in cli("release", "s").out
    assert queue.claim("s", "w2", ttl=300) is not None


def test_delete_leaves_a_tombstone_that_keeps_the_fence(cli: Any, queue: JobStore) -> None:
    queue.enqueue("d")
    queue.claim("d", "w", ttl=300)
    ran = cli("delete", "d")
    assert (ran.code, ran.out) == (0, "deleted job 'd' (it was held by 'w'; fence 1 kept)\n")
    assert cli("show", "d").code == 1
    assert cli("delete", "d").code == 1
    assert cli("enqueue", "d", "--json").records == [{"id": "d", "new": True}]
    lease = queue.claim("d", "w", ttl=300)
    assert lease is not None and lease.fence == 2  # above every fence it had


def test_requeue_gives_a_poisoned_job_its_attempts_back_with_the_workers_attempts_table(
    cli: Any, engine: Engine
) -> None:
    recorded = History(history_table(MetaData()), retention=None)
    workers = JobStore(engine, history=recorded, attempts=attempts_table(MetaData()))
    workers.create_table()
    workers.enqueue("p", ready_at=0.0)
    workers.enqueue("h", ready_at=0.0)
    [first] = workers.claim_next("w", ttl=1.0, now=1.0, max_attempts=1)
    [held] = workers.claim_next("w", ttl=300.0, max_attempts=1)
    assert (first.job_id, held.job_id) == ("h", "p")  # by id: both ready since 0

    def poisoned(*more: str) -> tuple[list[str], str, int]:
        """What jobs, show and stats tell of "h" with --max-attempts 1."""
        at_most = ("--max-attempts", "1", "--json", *more)
        listed = [r["id"] for r in cli("jobs", "--state", "poisoned", *at_most).records]
        [shown] = cli("show", "h", *at_most).records
        [summary] = cli("stats", *at_most).records
        return listed, shown["state"], summary["poisoned"]

    assert poisoned() == (["h"], "poisoned", 1)  # its lease expired at 1.0 after its one attempt
    ran = cli("requeue", "h")
    assert ran.code == 0, ran.err
    said = "requeued job 'h' (it was ready; fence 1 kept): its attempts count again from fence 1"
    assert ran.out == said + ", and it is ready\n"
    # counted from the requeue, as the workers' claim_next counts it (the fence is still 1)
    assert poisoned() == ([], "ready", 0)
    assert poisoned("--attempts-table", "elsewhere") == (["h"], "poisoned", 1)  # no such table: by fence
    [again] = workers.claim_next("w2", ttl=300.0, max_attempts=1)
    assert (again.job_id, again.fence) == (first.job_id, 2)
    assert [e.event for e in workers.history(first.job_id)] == ["claim", "requeue", "claim"]
    # a held job: nothing changed, and the reason
    refused = cli("requeue", held.job_id, "--json")
    assert refused.code == 1 and refused.records == [{"id": held.job_id, "requeued": False, "state": "held"}]
    assert "it is held; nothing changed" in refused.err and workers.holder(held.job_id) == held
    # another attempts table's name: it does not exist, nothing changed
    missing = cli("requeue", held.job_id, "--attempts-table", "elsewhere")
    assert missing.code == 1 and "no attempts table 'elsewhere'" in missing.err


def test_odd_ids_round_trip_through_every_command(
    cli: Any, queue: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(ODD_IDS[:2] + ODD_IDS[3:]) + "\n"))
    assert cli("enqueue", "--json").records == [{"id": i, "new": True} for i in ODD_IDS if "\n" not in i]
    assert cli("enqueue", ODD_IDS[2]).code == 0  # a newline in an id: as an argument
    assert sorted(r["id"] for r in cli("jobs", "--json").records) == sorted(ODD_IDS)
    for job_id in ODD_IDS:
        assert cli("show", job_id, "--json").records[0]["id"] == job_id
        queue.claim(job_id, 'ōwner "x"', ttl=300)
        assert cli("revoke", job_id, "--json").records[0]["owner"] == 'ōwner "x"'
    assert cli("delete", ODD_IDS[1]).out == f"deleted job {ODD_IDS[1]!r} (it was ready; fence 2 kept)\n"
    assert sorted(r["fence"] for r in cli("jobs", "--json").records) == [2, 2, 2]


# -- failures and arguments ----------------------------------------------------------------------


MISSING = "table 'jobs' does not exist here; `fencing init` creates it"


def touch(engine: Engine) -> None:
    """Make the SQLite database file exist, with no table in it (a server's database exists)."""
    with engine.connect():
        pass


def test_a_missing_table_is_said_with_the_way_out(cli: Any, engine: Engine) -> None:
    touch(engine)
    for command in (["jobs"], ["show", "x"], ["stats"], ["revoke", "x"], ["enqueue", "x"]):
        ran = cli(*command)
        assert ran.code == 1, command
        assert ran.err == f"fencing {command[0]}: {MISSING}\n"
    # a locks table is the application's Locks' to make, not `fencing init`'s
    for command in (["locks"], ["leader", "scheduler"]):
        ran = cli(*command)
        assert (ran.code, ran.err) == (
            1,
            f"fencing {command[0]}: table 'fencing_locks' does not exist here; "
            "the application's fencing.Locks(engine).create_table() creates it\n",
        ), command


def unreachable(target: str) -> str:
    """The test's database as a URL that cannot work: a server on a closed port, a SQLite
    file in a directory that does not exist."""
    if "://" in target:
        return make_url(target).set(port=1, password="s3cret").render_as_string(hide_password=False)
    return str(Path(target).parent / "missing" / "jobs.db")


def test_bad_urls_fail_with_a_message(cli: Any, target: str) -> None:
    down = cli("jobs", url=unreachable(target))
    assert down.code == 1 and down.err.startswith("fencing jobs: ") and down.out == ""
    assert "s3cret" not in down.err
    port = cli("jobs", url="postgresql://user:s3cret@host:port/db")
    assert port.code == 1 and "not a database URL" in port.err and "s3cret" not in port.err
    if "://" in target:  # an option the driver does not know
        option = cli("jobs", url=target + "?no_such_option=1")
        assert option.code == 1 and option.err.startswith("fencing jobs: ")
    unknown = cli("stats", url="nosuchdb://host/db")
    assert unknown.code == 1 and "cannot use database URL 'nosuchdb://host/db'" in unknown.err
    directory = cli("jobs", url=str(Path(__file__).parent))
    assert directory.code == 1 and "is a directory" in directory.err


@pytest.mark.backend("sqlite")
def test_a_url_that_cannot_work_names_the_url_and_the_extra_to_use(
    cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the scheme Heroku and libpq write, which SQLAlchemy does not know
    scheme = cli("stats", url="postgres://user:s3cret@db.example/app")
    assert scheme.code == 1 and "s3cret" not in scheme.err
    instead = "use 'postgresql+psycopg://user:***@db.example/app' (pip install 'fencing[postgresql]')"
    assert instead in scheme.err
    # an asyncio driver: the commands connect with a sync one
    loop = cli("jobs", url="mariadb+asyncmy://root@db.example/app")
    assert loop.code == 1 and "asyncmy is an asyncio driver" in loop.err
    assert "use 'mariadb+pymysql://root@db.example/app' (pip install 'fencing[mysql]')" in loop.err
    # a driver of fencing's extras that is not installed: the extra that installs it
    monkeypatch.setitem(sys.modules, "psycopg", None)
    extra = cli("stats", url="postgresql+psycopg://user@db.example/app")
    assert extra.code == 1
    assert "its driver psycopg is not installed: pip install 'fencing[postgresql]'" in extra.err
    # SQLAlchemy's default driver for the scheme (MySQLdb), not one of fencing's: the URL of one that is
    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    default = cli("stats", url="mysql://root@db.example/app")
    assert default.code == 1 and "its driver MySQLdb is not installed: use 'mysql+pymysql://" in default.err
    assert "root@db.example/app' (pip install 'fencing[mysql]'), or install MySQLdb yourself" in default.err
    # nothing was made or touched: no connection was tried
    assert all(r.out == "" for r in (scheme, loop, extra, default))


def test_a_table_of_that_name_that_is_not_a_jobs_table_names_the_table_option(
    cli: Any, engine: Engine
) -> None:
    name = f"orders_{os.getpid()}"
    other = Table(name, MetaData(), Column("order_id", Integer, primary_key=True), Column("total", Integer))
    other.create(engine)
    try:
        for command in (["stats"], ["jobs"], ["show", "x"], ["enqueue", "x"], ["init"]):
            ran = cli(*command, "--table", name)
            assert ran.code == 1 and ran.out == "", command
            said = f"fencing {command[0]}: table {name!r} here is not a fencing jobs table"
            assert f"{said} (its columns: order_id, total;" in ran.err, command
            assert "--table NAME names yours; `fencing init --table NAME` creates one" in ran.err, command
        locks = cli("locks", "--table", name)
        assert locks.code == 1 and "is not a fencing locks table" in locks.err
        assert "fencing init" not in locks.err
        with engine.connect() as conn:  # the table was left as it was
            assert conn.execute(other.select()).all() == []
            assert [c["name"] for c in inspect(conn).get_columns(name)] == ["order_id", "total"]
    finally:
        other.drop(engine)


# the arguments are checked before any database work: these run once, on SQLite


@pytest.mark.backend("sqlite")
def test_bad_arguments_exit_2_before_any_database_work(cli: Any, target: str) -> None:
    for argv in (
        ["jobs", "--state", "stuck"],
        ["jobs", "--state", "poisoned"],
        ["jobs", "--limit", "0"],
        ["stats", "--watch", "0"],
        ["stats", "--within", "nan"],
        ["stats", "--count", "2"],
        ["release", "x", "--delay", "0"],
        ["enqueue", "--delay", "1", "--ready-at", "5", "x"],
        ["show"],
        ["nosuchcommand"],
    ):
        ran = cli(*argv)
        assert ran.code == 2 and "error:" in ran.err and ran.out == "", argv
    assert not os.path.exists(target)  # not even a SQLite file was made


@pytest.mark.backend("sqlite")
def test_url_comes_from_the_environment_or_is_required(
    cli: Any, queue: JobStore, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FENCING_URL", raising=False)
    missing = cli("jobs", url=None)
    assert missing.code == 2 and "--url" in missing.err
    monkeypatch.setenv("FENCING_URL", target)
    queue.enqueue("a")
    assert cli("jobs", "--json", url=None).records[0]["id"] == "a"


@pytest.mark.backend("sqlite")
def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exited:
            main([command, "--help"])
        assert exited.value.code == 0
        assert "--url" in capsys.readouterr().out


# -- the listing costs the same at any backlog ---------------------------------------------------


def test_listing_ready_jobs_walks_the_ready_index_to_its_limit(queue: JobStore, engine: Engine) -> None:
    """``jobs --state ready --limit 50`` on 10,000 ready jobs in a never-analyzed table: the
    ready index in its order, no sort, and (where the database says) 51 rows read."""
    stmt = insert(queue.table).values(id=bindparam("k", type_=KEY_TYPE), until=bindparam("u"))
    with engine.begin() as conn:
        conn.execute(stmt, [{"k": f"job-{n:05d}", "u": 1000.0 + n} for n in range(10_000)])
    sent: list[tuple[str, Any]] = []
    overview = Overview(engine)

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        assert len(overview.jobs("ready", limit=51)) == 51
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    *before, (listing, params) = sent
    dialect = engine.dialect.name
    with engine.connect() as conn:
        for sql, args in before:  # what the overview set first in its read (PostgreSQL: sorts off)
            if sql.startswith("SET"):
                conn.exec_driver_sql(sql, args)
        if dialect == "sqlite":
            plan = [row[-1] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + listing, params)]
            assert plan == ["SEARCH jobs USING INDEX ix_jobs_ready (done=? AND until<?)"]
        elif dialect == "postgresql":
            [[explained]] = conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + listing, params
            ).fetchall()
            node, nodes = explained[0]["Plan"], []
            while node:
                nodes.append(node)
                node = (node.get("Plans") or [None])[0]
            assert [n["Node Type"] for n in nodes] == ["Limit", "Index Scan"], nodes
            assert nodes[1]["Index Name"] == "ix_jobs_ready" and nodes[1]["Actual Rows"] == 51
        else:
            [row] = [r._mapping for r in conn.exec_driver_sql("ANALYZE " + listing, params)]
            assert row["key"] == "ix_jobs_ready" and "filesort" not in str(row["Extra"]), dict(row)
            assert float(row["r_rows"]) == 51
        conn.rollback()


# -- the console script, as an operator runs it ----------------------------------------------------

OWNER = 'ōwner "x"'


def records(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_console_script_runs_every_database_command(target: str, engine: Engine) -> None:
    """init, enqueue, jobs, show, revoke, release, delete, stats and marks in a row, each in
    its own process: exit codes, JSON, odd ids through stdin and argv, and exit code 1 for a
    command that changed nothing."""
    url = ["--url", target]
    touch(engine)
    missing = script("stats", *url)
    assert (missing.returncode, missing.stdout, missing.stderr) == (1, "", f"fencing stats: {MISSING}\n")
    created = script("init", *url, "--json")
    assert (created.returncode, records(created)) == (0, [{"table": "jobs", "created": True}])
    piped = [i for i in ODD_IDS if "\n" not in i]
    enqueued = script("enqueue", *url, "--json", stdin="\n".join(piped) + "\n")
    assert (enqueued.returncode, records(enqueued)) == (0, [{"id": i, "new": True} for i in piped])
    given = script("enqueue", *url, ODD_IDS[2], ODD_IDS[0])  # a newline in an id: as an argument
    assert (given.returncode, given.stdout) == (0, "enqueued 1 new job; 1 already existed, unchanged\n")
    listed = script("jobs", *url, "--json")
    assert listed.returncode == 0 and sorted(r["id"] for r in records(listed)) == sorted(ODD_IDS)

    store = JobStore(engine)
    for job_id in ODD_IDS[:2]:
        assert store.claim(job_id, OWNER, ttl=300) is not None
    shown = script("show", *url, ODD_IDS[1])  # non-ASCII text on stdout, not JSON's escapes
    assert shown.returncode == 0
    rows = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert (rows["id"], rows["state"], rows["owner"], rows["fence"]) == (ODD_IDS[1], "held", OWNER, "1")
    revoked = script("revoke", *url, ODD_IDS[0], "--json")
    assert (revoked.returncode, records(revoked)) == (
        0,
        [{"id": ODD_IDS[0], "revoked": True, "owner": OWNER, "fence": 1, "new_fence": 2}],
    )
    again = script("revoke", *url, ODD_IDS[0], "--json")  # changed nothing: exit code 1
    assert (again.returncode, records(again)) == (1, [{"id": ODD_IDS[0], "revoked": False, "state": "ready"}])
    assert again.stderr == f"fencing revoke: job {ODD_IDS[0]!r}: it is ready, not held; nothing changed\n"
    released = script("release", *url, ODD_IDS[1], "--delay", "600", "--json")
    assert (released.returncode, records(released)) == (
        0,
        [{"id": ODD_IDS[1], "released": True, "owner": OWNER, "fence": 1, "delay": 600.0}],
    )
    deleted = script("delete", *url, ODD_IDS[3])
    assert (deleted.returncode, deleted.stdout) == (
        0,
        f"deleted job {ODD_IDS[3]!r} (it was ready; fence 0 kept)\n",
    )
    [stats] = records(script("stats", *url, "--json"))
    counts = {k: stats[k] for k in ("ready", "held", "deferred", "done", "deleted", "highest_fence")}
    assert counts == {"ready": 2, "held": 0, "deferred": 1, "done": 0, "deleted": 1, "highest_fence": 2}

    marks = FenceMarks(engine)
    marks.create_tables()
    assert marks.accept(ODD_IDS[1], 3) and marks.record_once(ODD_IDS[0], fence=3)
    listed_marks = script("marks", *url, "--json")
    assert listed_marks.returncode == 0
    [mark, key] = records(listed_marks)
    assert (mark["table"], mark["resource"], mark["fence"]) == ("fence_marks", ODD_IDS[1], 3)
    assert (key["table"], key["key"], key["fence"]) == ("idempotency_keys", ODD_IDS[0], 3)


def test_console_script_fails_cleanly_on_a_bad_url(target: str) -> None:
    down = script("stats", "--url", unreachable(target))
    assert (down.returncode, down.stdout) == (1, "")
    assert down.stderr.startswith("fencing stats: ") and len(down.stderr.splitlines()) <= 3
    assert "s3cret" not in down.stderr
    malformed = script("jobs", "--url", "postgresql://user:s3cret@host:port/db")
    assert (malformed.returncode, malformed.stdout) == (1, "")
    shown = "fencing jobs: not a database URL: 'postgresql://user:***@host:port/db' ("
    assert malformed.stderr.startswith(shown)
    assert "s3cret" not in malformed.stderr


def test_console_script_version_help_and_bad_arguments(target: str) -> None:
    done = script("--version")
    assert (done.returncode, done.stdout) == (0, f"fencing {fencing.__version__}\n")
    helped = script("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: fencing ")
    commands = {line.split()[0] for line in helped.stdout.splitlines() if line.startswith("    ")}
    assert commands >= {*COMMANDS, "demo", "torture"}
    bad = script("jobs", "--url", target, "--limit", "many")
    assert (bad.returncode, bad.stdout) == (2, "")
    assert "fencing jobs: error: argument --limit: not a whole number: 'many'" in bad.stderr


@pytest.mark.backend("sqlite")  # the demo makes its own SQLite file, whatever the database under test
def test_console_script_demo_plays_the_story() -> None:
    done = script("demo", "--ttl", "0.2")
    assert (done.returncode, done.stderr) == (0, "")
    assert "A's write REJECTED (done: fence 1, current fence 2, holder 'B')" in done.stdout


#: a torture run small enough for a test: two workers, twenty jobs, one second of faults
TINY_TORTURE = ["--workers", "2", "--jobs", "20", "--seconds", "1", "--drain", "30", "--seed", "7"]


def test_console_script_torture_tiny_run_prints_its_summary_and_nothing_else(target: str) -> None:
    url = ["--url", target] if "://" in target else []  # SQLite: its own file in a temporary directory
    done = script("torture", *url, *TINY_TORTURE, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")  # not on a terminal: no progress line
    first, front, tally, *_, last = done.stdout.splitlines()
    if url:
        assert first == f"fencing torture: {target}"
    else:
        assert re.fullmatch(r"fencing torture: SQLite file \S+/torture\.db", first), first
    assert front.startswith("sync front: fencing:JobStore, Heartbeat threads, on ")
    assert tally.startswith("2 workers, 20 jobs, ttl 0.5 s, seed 7; ")
    assert tally.endswith("; 20/20 jobs done")
    assert last.split() == ["violations", "0"]
    assert "\r" not in done.stdout and "\x1b" not in done.stdout


def read_terminal(master: int, proc: subprocess.Popen[Any], enough: bytes = b"", times: int = 0) -> bytes:
    """What the process wrote to the pseudo-terminal: until ``enough`` was seen ``times`` times
    (then Ctrl-C), or until the process ended; then the rest, up to the terminal's closing."""
    seen = b""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and (seen.count(enough) < times if times else proc.poll() is None):
        if select.select([master], [], [], 0.2)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side is closed
                break
    if times:
        proc.send_signal(signal.SIGINT)
    # read on while it ends, as a terminal does: a process writing to a full terminal buffer
    # blocks there (its last flush at exit too) until someone reads
    deadline = time.monotonic() + TIMEOUT
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.2)[0]:
                seen += os.read(master, 65536)
    try:  # the terminal closes (EIO) as it exits: give it the rest of the time to end
        proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        stuck = False
    except subprocess.TimeoutExpired:
        stuck = True
    if stuck:  # its threads' stacks onto the terminal (faulthandler, PYTHONFAULTHANDLER=1)
        proc.send_signal(signal.SIGABRT)
    with contextlib.suppress(OSError):
        while select.select([master], [], [], 5)[0] and (chunk := os.read(master, 65536)):
            seen += chunk
    assert not stuck, f"still running {TIMEOUT} s after Ctrl-C: {seen[-6000:].decode(errors='replace')}"
    assert proc.wait(timeout=5) == 0
    return seen


def test_stats_watch_refreshes_in_place_on_a_terminal_until_ctrl_c(target: str, queue: JobStore) -> None:
    queue.enqueue("a")
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(SCRIPT), "stats", "--url", target, "--watch", "0.1"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    os.close(slave)
    try:
        seen = read_terminal(master, proc, b"\x1b[H", 3)
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    text = seen.decode()
    assert text.startswith("\x1b[2J\x1b[H")  # cleared once, then each refresh from the top
    frames = text.split("\x1b[H")[1:]
    assert len(frames) >= 3
    for frame in frames[:3]:
        assert "every 0.1s (Ctrl-C to stop)\x1b[K\r\n" in frame  # the terminal ends lines with \r\n
        assert "1  claimable now\x1b[K\r\n" in frame
    assert "Traceback" not in text


@pytest.mark.backend("sqlite")  # the progress line is the command's, the same on every database
def test_torture_shows_one_progress_line_on_a_terminal_then_clears_it() -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(SCRIPT), "torture", *TINY_TORTURE],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
        encoding="utf-8",
    )
    os.close(slave)
    try:
        seen = read_terminal(master, proc)
        assert proc.stdout is not None
        summary = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
        if proc.stdout is not None:
            proc.stdout.close()
    text = seen.decode()
    assert text.startswith("\r") and "\n" not in text  # one line, rewritten in place
    updates = text.split("\r")[1:]
    assert all(u.endswith("\x1b[K") for u in updates), updates
    shown = [u.removesuffix("\x1b[K") for u in updates]
    assert shown[0] == "fencing torture: setting up: enqueuing 20 jobs"
    faults = [s for s in shown if s.startswith("fencing torture: faults ")]
    assert faults, shown
    for line in faults:
        assert re.fullmatch(r"fencing torture: faults \d+\.\d/1s, \d+/20 jobs done", line), line
    assert shown[-3:] == [
        "fencing torture: stopping the workers",
        "fencing torture: checking the journals and the database",
        "",  # cleared before the summary
    ]
    assert summary.splitlines()[-1].split() == ["violations", "0"]
    assert "\r" not in summary and "\x1b" not in summary


@pytest.fixture
def named_locks(engine: Engine) -> fencing.Locks:
    made = fencing.Locks(engine)
    made.create_table()
    return made


def test_locks_lists_holders_tokens_and_time_left(cli: Any, named_locks: fencing.Locks) -> None:
    assert named_locks.try_acquire("nightly-billing", "host-a", ttl=300) is not None
    first = named_locks.try_acquire("scheduler", "pod-1", ttl=300)
    assert first is not None and named_locks.release(first)
    ran = cli("locks")
    assert ran.code == 0, ran.err
    lines = ran.out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "HOLDER", "TOKEN", "LEFT"]
    assert "scheduler" in lines[1] and "free" in lines[1]  # free first: the claim order
    assert re.match(r"nightly-billing\s+held\s+host-a\s+1\s+4m \d\ds left$", lines[2]), lines[2]
    records = cli("locks", "--json").records
    assert [(r["name"], r["state"], r["holder"], r["token"]) for r in records] == [
        ("scheduler", "free", None, 1),
        ("nightly-billing", "held", "host-a", 1),
    ]
    one = cli("locks", "nightly-billing")
    assert (
        one.code == 0
        and re.search(r"^holder\s+host-a$", one.out, re.M)
        and re.search(r"^token\s+1$", one.out, re.M)
    )
    assert cli("locks", "--revoke").code == 1  # which one?
    missing = cli("locks", "nope")
    assert missing.code == 1 and "no lock 'nope' in table 'fencing_locks'" in missing.err
    bad = cli("locks", "")
    assert bad.code == 1 and "name must not be empty" in bad.err


def test_leader_shows_the_term_and_revoke_deposes_it(cli: Any, named_locks: fencing.Locks) -> None:
    term = named_locks.try_acquire("scheduler", "pod-2", ttl=300)
    assert term is not None
    ran = cli("leader", "scheduler")
    assert (
        ran.code == 0
        and re.search(r"^leader\s+pod-2$", ran.out, re.M)
        and re.search(r"^term\s+1$", ran.out, re.M)
    )
    deposed = cli("leader", "scheduler", "--revoke", "--json")
    assert deposed.code == 0 and deposed.records == [
        {"name": "scheduler", "revoked": True, "holder": "pod-2", "token": 2}
    ]
    with pytest.raises(fencing.LeaseLost):
        named_locks.check(term)  # the deposed leader's term is refused
    after = cli("leader", "scheduler")
    assert after.code == 0 and re.search(r"^state\s+nobody leads$", after.out, re.M)
    assert cli("leader", "nobody-ran-this", "--revoke").code == 1


def test_locks_and_leader_show_the_history_when_the_table_exists(
    cli: Any, named_locks: fencing.Locks, engine: Engine
) -> None:
    assert named_locks.try_acquire("scheduler", "pod-1", ttl=300) is not None
    assert "history" not in cli("leader", "scheduler").out  # no history table: the holder alone
    assert cli("locks", "scheduler", "--json").records[0]["history"] is None
    recorded = fencing.Locks(engine, history=History(history_table(MetaData()), retention=None))
    recorded.create_table()  # the history table too
    first = recorded.try_acquire("other", "pod-1", ttl=300)
    assert first is not None
    revoked = cli("leader", "other", "--revoke")  # recorded in the history, in its transaction
    assert revoked.code == 0, revoked.err
    assert not recorded.renew(first, ttl=300)  # the deposed leader's renewal: refused
    assert recorded.try_acquire("other", "pod-2", ttl=300) is not None
    expected = [
        ["claim", "pod-1", "1"],
        ["revoke", "-", "2"],
        ["refused", "pod-1", "1"],
        ["claim", "pod-2", "3"],
    ]
    for command in ("leader", "locks"):
        ran = cli(command, "other")
        assert ran.code == 0, ran.err
        lines = ran.out.splitlines()
        who = "leader" if command == "leader" else "holder"
        assert re.search(rf"^{who}\s+pod-2$", ran.out, re.M)  # the holder first, as before
        start = lines.index("history (fencing_history, oldest first)")
        assert lines[start - 1] == "" and lines[start - 2].startswith("now ")
        header, *rows = lines[start + 1 :]
        assert header.split() == ["SEQ", "AT", "EVENT", "OWNER", "FENCE", "DETAIL"]
        assert [row.split()[4:7] for row in rows] == expected
        assert rows[2].endswith("renew: stale fence; holder -, fence 2")
    [record] = cli("leader", "other", "--json").records
    assert (record["holder"], record["token"]) == ("pod-2", 3)
    assert [(e["event"], e["owner"], e["fence"], e["reason"]) for e in record["history"]] == [
        ("claim", "pod-1", 1, None),
        ("revoke", None, 2, None),
        ("refused", "pod-1", 1, "stale fence"),
        ("claim", "pod-2", 3, None),
    ]
    elsewhere = cli("locks", "other", "--history-table", "elsewhere")
    assert elsewhere.code == 0 and "history" not in elsewhere.out
    assert cli("leader", "other", "--history-table", "elsewhere", "--json").records[0]["history"] is None
    # a revoke with another table's name is made, and recorded nowhere
    assert cli("locks", "other", "--revoke", "--history-table", "elsewhere").code == 0
    assert [e.event for e in recorded.store.history("other")][-1] == "claim"


def test_serve_without_the_web_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    db = tmp_path / "jobs.db"
    assert main(["init", "--url", str(db)]) == 0
    # as where it is not installed: starlette and uvicorn unimportable, also when an earlier test
    # of this process imported them (a cached submodule would be found without its package),
    # and fencing's web modules imported afresh
    for name in [n for n in sys.modules if n.partition(".")[0] in ("starlette", "uvicorn")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "starlette", None)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    for name in [n for n in sys.modules if n.startswith(("fencing.web", "fencing.cli.serve"))]:
        monkeypatch.delitem(sys.modules, name)
    # and off its package: `from . import serve` takes an attribute an earlier import left
    monkeypatch.delattr("fencing.cli.serve", raising=False)
    assert main(["serve", "--url", str(db)]) == 1
    assert "pip install 'fencing[web]'" in capsys.readouterr().err


def test_serve_without_uvicorn_alone_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """starlette and jinja2 there, the server missing: said before anything starts, not a
    traceback from the last line."""
    db = tmp_path / "jobs.db"
    assert main(["init", "--url", str(db)]) == 0
    for name in [n for n in sys.modules if n.partition(".")[0] == "uvicorn"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", "--url", str(db)]) == 1
    err = capsys.readouterr().err
    assert "uvicorn is missing" in err and "pip install 'fencing[web]'" in err
    assert "Traceback" not in err


def test_instants_and_durations_have_one_form_for_the_cli_and_the_pages() -> None:
    from fencing._format import duration, instant, when
    from fencing.overview import JobView

    assert instant(1796232294.2119) == "2026-12-02 17:24:54.211 UTC"
    assert (instant(None), instant(None, "—"), instant(1e20)) == ("-", "—", "100000000000000000000.000")
    assert [duration(s) for s in (-1.0, 3.29, 42.9, 302.0, 7500.0, 273600.0)] == [
        "0.0s",
        "3.2s",
        "42s",
        "5m 02s",
        "2h 05m",
        "3d 04h",
    ]
    # a poisoned job whose until is still ahead (released with a delay at its last claim)
    poisoned = JobView("p", "poisoned", None, 5, 1060.0, None, 1000.0)
    assert when(poisoned) == "waiting 0.0s"
    expired = JobView("e", "ready", "w", 1, 700.0, None, 1000.0)
    assert when(expired) == "lease expired 5m 00s ago"
