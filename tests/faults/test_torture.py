"""The torture harness: real workers under real faults find no violation in the real store,
and do find them in stores broken on purpose; every rule of the verdict can fire."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from fencing._errors import InvalidArgument
from fencing.torture import TortureConfig, run_torture, summary
from fencing.torture.verdict import METRICS_DISAGREE, DatabaseState, judge

#: a short run that still injects every kind of fault several times
SHORT = {"workers": 4, "jobs": 250, "seconds": 8.0, "fault_every": 0.1, "drain": 60.0}
#: the workers on the sync store and Heartbeat threads, or on the async store and
#: AsyncHeartbeat tasks (the asyncio driver for the same database)
FRONTS = pytest.mark.parametrize("front", ["sync", "async"])


@pytest.mark.slow
@FRONTS
def test_real_store_survives_every_fault(target: str, front: str) -> None:
    run = run_torture(TortureConfig(url=target, seed=11, front=front, **SHORT))  # type: ignore[arg-type]
    report = summary(run)
    assert f"{front} front: " in report
    assert run.violations == 0, report
    assert run.jobs_done == SHORT["jobs"], report
    tally = run.verdict.tallies
    for kind in ("stop", "kill", "revoke"):
        assert tally[("fault", kind)] >= 1, f"no {kind} fault was injected\n{report}"
    assert tally[("claim",)] >= SHORT["jobs"], report
    # fenced blocks ran with their heartbeat renewing around them, and none hung
    assert tally[("write", "nested")] >= 1, report
    # every way of finishing a job was taken, the one-transaction step included
    for how in ("fenced", "plain", "batch", "step"):
        assert tally[("write", "how", how)] >= 1, f"no {how} write\n{report}"
    # the late writers were there, and were refused (by the store or their heartbeat)
    refused = sum(n for key, n in tally.items() if "refused" in key) + tally[("skip",)]
    assert refused >= 1, report
    # the ownership history was checked against all of that: claims, completions, refusals
    for event in ("claim", "complete", "revoke", "refused"):
        assert tally[("history", event)] >= 1, f"no {event} in the history\n{report}"
    # the workers that stopped cleanly journaled their store's and marks' counters, and each
    # agreed with that worker's own journal, call by call
    checked = tally[("metrics", "checked")]
    assert checked >= 1, f"no worker's metrics were cross-checked\n{report}"
    assert tally[("metrics", "agreed")] == checked, report
    assert "metrics cross-checked (workers that stopped cleanly)" in report


@pytest.mark.slow
@FRONTS
@pytest.mark.parametrize(
    ("broken", "finish", "rules"),
    [
        (
            "AckById",
            "plain",
            {
                "result from a stale lease",
                "stale fence accepted",
                "expired lease accepted",
                "revoked lease accepted",
            },
        ),
        ("ReadThenClaim", "mixed", {"fence issued twice"}),
    ],
)
def test_harness_finds_the_violations_of_a_broken_store(
    target: str, front: str, broken: str, finish: str, rules: set[str]
) -> None:
    # A late writer becomes a violation only when someone else took its job over first, which
    # the faults make likely but not certain in one short run (PostgreSQL's backlog order can
    # leave a frozen worker's job unclaimed until it wakes): up to three seeds, each a new run,
    # until one of the rules this store breaks fires (its overrides record no history and count
    # no metrics, so the history and metrics rules fire in every run and prove nothing here)
    for seed in (5, 6, 7):
        config = TortureConfig(
            url=target,
            seed=seed,
            front=front,
            # the same broken rules behind AsyncJobStore on the async front
            store_factory=f"tests.torture_broken:{'Async' if front == 'async' else ''}{broken}",
            finish=finish,
            check_heartbeat=0.0,  # leave the late writes to the store: this one lets them in
            faults=("stop", "revoke"),
            work=0.05,  # leases held long enough that revokes and freezes find holders
            **{**SHORT, "jobs": 400},  # type: ignore[arg-type]
        )
        run = run_torture(config)
        report = summary(run)
        if rules & set(run.verdict.counts):
            break
    assert rules & set(run.verdict.counts), (
        f"the harness missed a broken store ({broken}) in three runs\n{report}"
    )
    assert "VIOLATION" in report


@pytest.mark.slow
@pytest.mark.backend("sqlite")
def test_command_line_runs_and_reports(tmp_path: Any) -> None:
    argv = [sys.executable, "-m", "fencing", "torture", "--url", str(tmp_path / "t.db")]
    args = [
        "--workers",
        "2",
        "--jobs",
        "60",
        "--seconds",
        "3",
        "--seed",
        "3",
        "--journal",
        str(tmp_path / "j"),
    ]
    done = subprocess.run(argv + args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "seed 3" in done.stdout
    assert done.stdout.rstrip().endswith("violations" + " " * (len(done.stdout.splitlines()[-1]) - 11) + "0")
    assert list((tmp_path / "j").glob("worker-*.jsonl")), "the journals were not kept"


@pytest.mark.slow
@pytest.mark.backend("sqlite")
def test_command_line_exits_1_on_a_violation(tmp_path: Any) -> None:
    argv = [sys.executable, "-m", "fencing", "torture", "--url", str(tmp_path / "t.db"), "--seed", "5"]
    args = ["--workers", "4", "--jobs", "150", "--seconds", "6", "--faults", "stop,revoke"]
    args += ["--store", "tests.torture_broken:ReadThenClaim", "--check-heartbeat", "0"]
    done = subprocess.run(argv + args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VIOLATION fence issued twice" in done.stdout


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "must be between 1 and 256, got 0"),
        (["--seconds", "nan"], "must be at least 0 seconds, got 'nan'"),
        (["--ttl", "0.01"], "must be at least 0.05 seconds"),
        (["--faults", "stop,flood"], "unknown fault kinds ['flood']"),
        (["--store", "no.such.module:Store"], "cannot load the store factory 'no.such.module:Store'"),
        (["--check-heartbeat", "2"], "must be between 0 and 1"),
        (
            ["--async", "--store", "tests.torture_broken:AckById"],
            "cannot build a fencing.asyncio.AsyncJobStore from (AsyncEngine, Table, history=History)",
        ),
    ],
)
def test_command_line_refuses_bad_arguments(tmp_path: Any, args: list[str], message: str) -> None:
    argv = [sys.executable, "-m", "fencing", "torture", "--url", str(tmp_path / "t.db"), "--seconds", "1"]
    done = subprocess.run(argv + args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


def test_front_is_sync_unless_asked_and_refused_by_name_when_unknown() -> None:
    from fencing.__main__ import build_parser

    assert build_parser().parse_args(["torture"]).front == "sync"
    assert build_parser().parse_args(["torture", "--async"]).front == "async"
    assert TortureConfig(url="x.db", front="async").store == "fencing.asyncio:AsyncJobStore"
    with pytest.raises(InvalidArgument, match=r"front must be one of sync, async, mixed, got 'asyncio'"):
        TortureConfig(url="x.db", front="asyncio")


def test_mixed_front_puts_even_workers_on_sync_and_odd_on_async() -> None:
    mixed = TortureConfig(url="x.db", front="mixed")
    assert [mixed.for_worker(i).front for i in range(4)] == ["sync", "async", "sync", "async"]
    assert mixed.for_worker(1).store == "fencing.asyncio:AsyncJobStore"
    assert TortureConfig(url="x.db").for_worker(1).front == "sync"
    # a factory builds one front's store, never both
    with pytest.raises(InvalidArgument, match="needs one front"):
        TortureConfig(url="x.db", front="mixed", store_factory="fencing:JobStore")


# -- the verdict's rules, each shown to fire on a made-up history --------------------------

CONFIG = TortureConfig(url="unused.db", jobs=1, finish="plain")


def _claim(fence: int, owner: str, t0: float, until: float) -> dict[str, Any]:
    return {
        "k": "claim",
        "job": "j",
        "fence": fence,
        "owner": owner,
        "until": until,
        "t0": t0,
        "t1": t0 + 0.001,
    }


def _write(fence: int, owner: str, t0: float, ok: bool = True) -> dict[str, Any]:
    return {
        "k": "write",
        "how": "plain",
        "job": "j",
        "fence": fence,
        "owner": owner,
        "ok": ok,
        "t0": t0,
        "t1": t0 + 0.001,
    }


def _db(owner: str = "b", fence: int = 2, **kw: Any) -> DatabaseState:
    jobs = kw.pop("jobs", [("j", owner, 0.0, fence, f"{owner}#{fence}", 1)])
    return DatabaseState(
        jobs=jobs,
        results=kw.pop("results", []),
        external=kw.pop("external", []),
        marks=kw.pop("marks", {}),
        **kw,
    )


def test_verdict_passes_an_honest_history() -> None:
    events = [
        _claim(1, "a", 0.0, 1.0),
        _write(1, "a", 2.0, ok=False),
        _claim(2, "b", 1.5, 2.5),
        _write(2, "b", 2.1),
    ]
    verdict = judge(CONFIG, events, _db())
    assert verdict.total == 0, verdict.violations


@pytest.mark.parametrize(
    ("events", "db", "rule"),
    [
        ([_claim(2, "a", 0.0, 1.0), _claim(2, "b", 0.5, 1.5)], _db(), "fence issued twice"),
        ([_claim(3, "a", 0.0, 1.0), _claim(2, "b", 0.5, 1.5)], _db(), "fence went backwards"),
        (
            [_claim(1, "a", 0.0, 9.0), _claim(2, "b", 1.0, 9.0), _write(1, "a", 2.0)],
            _db(),
            "stale fence accepted",
        ),
        ([_claim(2, "b", 0.0, 1.0), _write(2, "b", 1.5)], _db(), "expired lease accepted"),
        (
            [
                _claim(2, "b", 0.0, 9.0),
                {"k": "fault", "kind": "revoke", "job": "j", "ok": True, "t0": 1.0, "t1": 1.1},
                _write(2, "b", 2.0),
            ],
            _db(),
            "revoked lease accepted",
        ),
        (
            [
                _claim(2, "b", 0.0, 9.0),
                {"k": "release", "job": "j", "fence": 2, "owner": "b", "ok": True, "t0": 1.0, "t1": 1.1},
                _write(2, "b", 2.0),
            ],
            _db(),
            "released lease accepted",
        ),
        ([_write(2, "b", 1.0), _write(2, "b", 2.0)], _db(), "completed twice"),
        ([], _db(jobs=[("j", "b", 0.0, 2, "a#1", 1)]), "result from a stale lease"),
        ([], _db(jobs=[("j", "b", 9.0, 2, None, 0)]), "job not done"),
        ([], _db(jobs=[]), "job lost"),
        (
            [],
            _db(external=[(1, "job:j", "b", 2), (2, "job:j", "a", 1)], marks={"job:j": 2}),
            "external token went backwards",
        ),
        ([], _db(external=[(1, "job:j", "b", 2)], marks={"job:j": 1}), "external mark behind"),
        ([], _db(external=[(1, "job:j", "c", 3)], marks={"job:j": 3}), "external token never issued"),
        ([], _db(results=[(1, "j", "b", 2)]), "fenced write without completion"),
        ([], _db(integrity="*** in database main ***\nPage 3 is never used"), "integrity"),
        ([{"k": "crash", "type": "KeyError", "message": "boom"}], _db(), "worker crashed"),
        ([{"k": "hung", "worker": 3, "waited": 30.0, "t": 1.0}], _db(), "worker hung"),
    ],
)
def test_verdict_rule_fires(events: list[dict[str, Any]], db: DatabaseState, rule: str) -> None:
    verdict = judge(CONFIG, events, db)
    assert rule in verdict.counts, verdict.violations


def _row(seq: int, event: str, owner: str | None, fence: int, *refusal: Any) -> tuple[Any, ...]:
    """A history row of job ``j``: (seq, job, event, owner, fence, path, reason, holder, current)."""
    return (seq, "j", event, owner, fence, *(refusal or (None, None, None, None)))


#: the honest run's history: a claims, b takes over, a's late write is refused, b completes
HONEST = [
    _row(1, "claim", "a", 1),
    _row(2, "claim", "b", 2),
    _row(3, "refused", "a", 1, "complete", "stale fence", "b", 2),
    _row(4, "complete", "b", 2),
]
HONEST_EVENTS = [
    _claim(1, "a", 0.0, 1.0),
    _write(1, "a", 2.0, ok=False),
    _claim(2, "b", 1.5, 2.5),
    _write(2, "b", 2.1),
]


def test_verdict_passes_an_honest_ownership_history() -> None:
    verdict = judge(CONFIG, HONEST_EVENTS, _db(history=HONEST))
    assert verdict.total == 0, verdict.violations
    assert verdict.tallies[("history", "refused")] == 1


@pytest.mark.parametrize(
    ("history", "events", "rule"),
    [
        (
            [HONEST[0], HONEST[2], HONEST[1], HONEST[3]],
            HONEST_EVENTS,
            "history: refusal with a holder the job never had",
        ),
        (
            [*HONEST[:2], _row(3, "refused", "a", 1, "complete", "stale fence", "c", 2), HONEST[3]],
            HONEST_EVENTS,
            "history: refusal with a holder the job never had",
        ),
        (
            [HONEST[0], _row(2, "complete", "b", 2), _row(3, "claim", "b", 2)],
            [],
            "history: write before its claim",
        ),
        ([_row(1, "release", "a", 1), _row(2, "claim", "a", 1)], [], "history: write before its claim"),
        (HONEST[:3], HONEST_EVENTS, "history: accepted write missing"),
        ([*HONEST[:2], HONEST[3]], HONEST_EVENTS, "history: refused write missing"),
        (
            HONEST,
            [
                *HONEST_EVENTS,
                {"k": "release", "job": "j", "fence": 2, "owner": "b", "ok": True, "t0": 2.0, "t1": 2.1},
            ],
            "history: release missing",
        ),
        (HONEST[:3], [], "history: completion missing"),
    ],
)
def test_verdict_history_rule_fires(
    history: list[tuple[Any, ...]], events: list[dict[str, Any]], rule: str
) -> None:
    verdict = judge(CONFIG, events, _db(history=history))
    assert rule in verdict.counts, verdict.violations


def test_verdict_checks_the_fenced_write_against_the_completion() -> None:
    fenced = TortureConfig(url="unused.db", jobs=1, finish="fenced")
    assert judge(fenced, [], _db(results=[(1, "j", "b", 2)])).total == 0
    assert "fenced write not exactly once" in judge(fenced, [], _db()).counts
    torn = judge(fenced, [], _db(results=[(1, "j", "a", 1)]))
    assert "fenced write torn from its completion" in torn.counts


def test_verdict_allows_for_a_renewal_that_extended_the_lease() -> None:
    renewed = {"k": "renew", "job": "j", "fence": 2, "owner": "b", "until": 3.0, "t0": 0.8, "t1": 0.81}
    events = [_claim(2, "b", 0.0, 1.0), renewed, _write(2, "b", 1.5)]
    assert judge(CONFIG, events, _db()).total == 0


# -- each worker's own counters against its journal -------------------------------------------


def _call(kind: str, job: str, owner: str = "a", **fields: Any) -> dict[str, Any]:
    return {"k": kind, "job": job, "fence": 1, "owner": owner, "t0": 0.0, "t1": 0.001, **fields}


#: one worker ("a") that made every kind of call, and one ("b") killed before it could
#: journal its counters: b's calls must not be counted against a's
CALLS = [
    _call("claim", "j1", until=9.0),
    _call("claim", "j2", until=9.0),
    _call("claim", "j3", until=9.0),
    _call("write", "j1", how="plain", ok=True),
    _call("write", "j2", how="plain", ok=False),
    _call("write", "j3", how="batch", ok=True),
    _call("write", "j4", how="step", ok=True),  # its step claimed nothing
    _call("write", "j5", how="step", ok=False),
    _call("write", "j6", how="fenced", ok=True, nested=True),
    _call("write", "j7", how="fenced", ok=False),
    _call("renew", "j1", until=9.5),
    _call("renew", "j2", until=None),
    _call("release", "j8", ok=True),
    _call("release", "j9", ok=True, delay=0.2),
    _call("release", "j10", ok=False),
    _call("external", "j1", ok=True),
    _call("external", "j2", ok=False),
    _call("claim", "j11", owner="b", until=9.0),
    _call("write", "j11", owner="b", how="plain", ok=True),
    _call("renew", "j11", owner="b", until=9.5),
]
#: what a's store and marks counted for those calls
STORE_COUNTS = {
    "claim_next.calls": 4,  # 2 claim_next calls (one empty) + 2 steps
    "claim_next.jobs": 3,
    "complete.accepted": 1,
    "complete.refused.stale fence": 1,
    "complete_many.accepted": 2,  # the batch's and the step's
    "complete_many.refused.expired": 1,
    "fenced.accepted": 1,
    "fenced.refused.stale fence": 1,
    "renew.accepted": 1,
    "renew.refused.expired": 1,
    "release.accepted": 2,
    "release.refused.done": 1,
    "lock.retried": 3,  # no journal accounts for these
    "lock.busy": 1,
}
MARKS_COUNTS = {"accept.accepted": 1, "accept.refused.older fence": 1}


def _metrics(store: dict[str, int], marks: dict[str, int], owner: str = "a") -> dict[str, Any]:
    return {"k": "metrics", "owner": owner, "worker": 0, "polls": 2, "store": store, "marks": marks, "t": 1.0}


def _changed(counts: dict[str, int], name: str, n: int | None) -> dict[str, int]:
    """``counts`` with ``name`` set to ``n`` (``None``: removed)."""
    changed = {k: v for k, v in counts.items() if k != name}
    return changed if n is None else {**changed, name: n}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        # the refusal counted under another reason: the journal knows none
        {"complete_many.refused.expired": None, "complete_many.refused.done": 1},
        {"lock.retried": 40, "lock.busy": None},  # no journal accounts for these
    ],
)
def test_verdict_finds_a_workers_metrics_agree_with_its_journal(changes: dict[str, int | None]) -> None:
    store = dict(STORE_COUNTS)
    for name, n in changes.items():
        store = _changed(store, name, n)
    verdict = judge(CONFIG, [*CALLS, _metrics(store, MARKS_COUNTS)], _db())
    assert METRICS_DISAGREE not in verdict.counts, verdict.violations
    assert verdict.tallies[("metrics", "checked")] == verdict.tallies[("metrics", "agreed")] == 1


@pytest.mark.parametrize(
    ("which", "name", "n"),
    [
        ("store", "complete.accepted", 2),
        ("store", "complete.refused.stale fence", None),
        ("store", "complete_many.accepted", 1),  # the step's completion not counted
        ("store", "complete_many.refused.expired", 2),
        ("store", "claim_next.calls", 3),
        ("store", "claim_next.jobs", 4),  # b's claim counted as a's
        ("store", "fenced.refused.stale fence", 0),
        ("store", "fenced.accepted", 2),
        ("store", "fenced.accepted", None),  # an accepted block not counted
        ("store", "renew.accepted", 2),
        ("store", "renew.refused.done", 1),
        ("store", "release.accepted", 1),
        ("store", "release.refused.done", None),
        ("store", "revoke.accepted", 1),  # a call the worker never makes
        ("store", "claim.accepted", 1),
        ("marks", "accept.accepted", 2),
        ("marks", "accept.refused.older fence", None),
        ("marks", "record_once.recorded", 1),
    ],
)
def test_verdict_rule_fires_on_a_tampered_metric(which: str, name: str, n: int | None) -> None:
    store, marks = dict(STORE_COUNTS), dict(MARKS_COUNTS)
    if which == "store":
        store = _changed(store, name, n)
    else:
        marks = _changed(marks, name, n)
    verdict = judge(CONFIG, [*CALLS, _metrics(store, marks)], _db())
    assert verdict.counts[METRICS_DISAGREE] == 1, verdict.violations
    [message] = verdict.violations[METRICS_DISAGREE]
    assert message.startswith(f"worker 0 (a): {which} counter {name.partition('.refused.')[0]}"), message
    assert verdict.tallies[("metrics", "checked")] == 1
    assert verdict.tallies[("metrics", "agreed")] == 0


def test_verdict_checks_only_workers_that_journaled_their_metrics() -> None:
    # b was killed: nothing to check; a killed worker's later incarnation is a process (and
    # an owner) of its own, checked against its own calls only
    verdict = judge(CONFIG, CALLS, _db())
    assert METRICS_DISAGREE not in verdict.counts
    assert verdict.tallies[("metrics", "checked")] == 0
    b = {"claim_next.calls": 1, "claim_next.jobs": 1, "complete.accepted": 1, "renew.accepted": 1}
    both = [*CALLS, _metrics(STORE_COUNTS, MARKS_COUNTS), {**_metrics(b, {}, owner="b"), "polls": 1}]
    verdict = judge(CONFIG, both, _db())
    assert METRICS_DISAGREE not in verdict.counts, verdict.violations
    assert verdict.tallies[("metrics", "agreed")] == 2
