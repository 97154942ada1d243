"""The checks at the end of a run: what the journals and the database say, against the rules.

Two sources, each checked on its own:

* the database is the ground truth of what committed (rows survive a killed worker whose
  journal line never got written);
* the journals say *when* each call was made and what it returned, so an accepted write
  can be set against the claims, revocations, releases and lease expiries around it.

Every rule is stated so that it is certain, not merely likely: a write that *started*
after a newer fence was handed out, after a revoke or release *returned*, or after the
latest ``until`` any renewal could have given, must have been refused.

What a worker saw acknowledged must be in the database at the end, whatever happened to the
server meanwhile (the ``server-crash`` fault: SIGKILL, crash recovery): every completion it
saw accepted, every external write it saw committed, every lease it saw claimed (in the
ownership history); and no fence is issued twice, also among claims no worker saw return (a
claim whose outcome was unknown may have handed out a fence nobody journaled: the history,
written in the claim's own transaction, has it). A call whose outcome is unknown
(``unknown`` events: the connection was lost during its COMMIT) is held to neither outcome.

A third source is checked against the second: the counters (``store.metrics``,
``marks.metrics``) each worker that stopped cleanly journaled last, against the calls that
same process journaled (its events carry its owner name, one per process): every call
the worker makes is journaled once it returns, so each counter must equal its count there.

Every rule but those about the run as a whole (the jobs' count, the counters, crashed and
hung workers) is about one job: a run takes the verdict a shard of jobs at a time
(:func:`judge_journals`), so a soak of a million operations needs no more memory than a short
run; :func:`judge` takes it all at once, from events in memory.
"""

from __future__ import annotations

import bisect
import json
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .config import SERVER_CRASH, TortureConfig
from .journal import OPERATIONS, journal_files
from .worker import finish_mode

__all__ = ["CLOCK_TOLERANCE", "SHARD_JOBS", "DatabaseState", "Verdict", "job_id", "judge", "judge_journals"]

#: the database clock and ``time.time()`` are the same clock here; SQLite's ``'now'`` has
#: millisecond resolution, a server's a few µs: anything this close is not a finding
CLOCK_TOLERANCE = 0.01
#: at most this many violations of one rule are listed (all are counted)
LISTED_PER_RULE = 5
#: the rule a worker's own counters are held to
METRICS_DISAGREE = "metrics disagree with the journal"
#: counters no journal accounts for call by call: a transaction the store ran again after a
#: lost lock race, and DatabaseBusy raised (some on purpose never reach the worker's
#: journal: the heartbeat retries a renewal that raised, a fenced block's history row is
#: written quietly after its rollback)
UNJOURNALED_COUNTERS = frozenset({"lock.retried", "lock.busy"})
#: the store's path each way of finishing a job counts under (``complete_and_claim_next``
#: judges its completions as ``complete_many`` does, and counts them there)
COUNTED_AS = {"plain": "complete", "batch": "complete_many", "step": "complete_many", "fenced": "fenced"}

Event = dict[str, Any]
LeaseKey = tuple[str, int, str]  # job, fence, owner


@dataclass(frozen=True)
class DatabaseState:
    """What committed: rows as plain tuples."""

    #: (id, owner, until, fence, result, done)
    jobs: Sequence[tuple[Any, ...]]
    #: (seq, job_id, owner, fence)
    results: Sequence[tuple[Any, ...]]
    #: (seq, resource, owner, fence), in seq order
    external: Sequence[tuple[Any, ...]]
    #: resource -> highest fence accepted
    marks: dict[str, int]
    #: ``PRAGMA integrity_check`` on SQLite, else None
    integrity: str | None = None
    #: the ownership history in seq order: (seq, job_id, event, owner, fence, path, reason,
    #: holder, current_fence); None when the run recorded none
    history: Sequence[tuple[Any, ...]] | None = None


@dataclass
class Verdict:
    #: rule -> the first few violations of it, described
    violations: dict[str, list[str]] = field(default_factory=dict)
    #: rule -> how many times it was violated
    counts: Counter[str] = field(default_factory=Counter)
    #: what happened, by kind and outcome: ("claim",), ("write", "refused", "plain"), ...
    tallies: Counter[tuple[str, ...]] = field(default_factory=Counter)

    def flag(self, rule: str, message: str) -> None:
        self.counts[rule] += 1
        listed = self.violations.setdefault(rule, [])
        if len(listed) < LISTED_PER_RULE:
            listed.append(message)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def judge(
    config: TortureConfig, events: Iterable[Event], db: DatabaseState, *, enqueued: int | None = None
) -> Verdict:
    """The verdict on a run's events and its database, all in memory. ``enqueued``: the jobs
    the run enqueued (``config.jobs`` unless it enqueued more as they were done)."""
    verdict = Verdict()
    run = _RunEvents(verdict.tallies)
    by_kind: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        run.add(event)
        by_kind[event["k"]].append(event)
    crashes = _crashes(by_kind)
    recoveries = _Recoveries(crashes)
    _judge_jobs(verdict, config, by_kind, db, crashes, recoveries)
    recoveries.tally(verdict.tallies)
    _judge_run(verdict, run, jobs=len(db.jobs), enqueued=config.jobs if enqueued is None else enqueued)
    if db.integrity is not None and db.integrity != "ok":
        verdict.flag("integrity", f"PRAGMA integrity_check: {db.integrity[:300]}")
    return verdict


#: jobs (by number) judged together when the verdict is taken a shard at a time
SHARD_JOBS = 10_000


def judge_journals(
    config: TortureConfig,
    journal_dir: Path,
    state_of: Callable[[str, str], DatabaseState],
    *,
    jobs: int,
    enqueued: int,
    integrity: str | None = None,
    shard_jobs: int = SHARD_JOBS,
) -> Verdict:
    """The same verdict as :func:`judge`, in bounded memory: a run of a million operations has
    millions of events, gigabytes as dicts. Every rule but a few is about one job, so the
    journals are read once, line by line (tallied, counted per worker, the events of no job
    kept), each job's events written to the shard of its job number (``job-NNNNNNN``,
    ``shard_jobs`` numbers a shard), and then each shard is judged on its own, with the
    database's rows of its jobs (``state_of(first_id, end_id)``: ids in ``[first, end)``).
    ``jobs``: the job rows in the database; ``integrity``: SQLite's integrity check."""
    verdict = Verdict()
    run = _RunEvents(verdict.tallies)
    global_events: dict[str, list[Event]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="fencing-verdict-") as scratch:
        shards: dict[int, TextIO] = {}
        try:
            for path in journal_files(journal_dir):
                with path.open(encoding="utf-8") as lines:
                    for line in lines:
                        if not line.endswith("\n"):
                            continue  # cut short by a kill
                        event = json.loads(line)
                        run.add(event)
                        job = event.get("job")
                        if job is None:
                            if event["k"] == "fault":  # the server's crashes: the rest is tallied
                                global_events["fault"].append(event)
                            continue
                        shard = _shard_of(job, shard_jobs)
                        if shard not in shards:
                            shards[shard] = open(Path(scratch) / f"{shard}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
                        shards[shard].write(line)
        finally:
            for out in shards.values():
                out.close()
        crashes = _crashes(global_events)
        recoveries = _Recoveries(crashes)
        numbered = range(-(-enqueued // shard_jobs))  # every job's shard, with events or not
        for shard in sorted(set(numbered) | set(shards)):
            by_kind: dict[str, list[Event]] = defaultdict(list)
            if shard in shards:
                with open(Path(scratch) / f"{shard}.jsonl", encoding="utf-8") as lines:
                    for line in lines:
                        event = json.loads(line)
                        by_kind[event["k"]].append(event)
            if shard < 0:  # events of a job the run never enqueued: no rows of its own
                db = DatabaseState(jobs=[], results=[], external=[], marks={}, history=[])
            else:
                db = state_of(job_id(shard * shard_jobs), job_id((shard + 1) * shard_jobs))
            _judge_jobs(verdict, config, by_kind, db, crashes, recoveries)
    recoveries.tally(verdict.tallies)
    _judge_run(verdict, run, jobs=jobs, enqueued=enqueued)
    if integrity is not None and integrity != "ok":
        verdict.flag("integrity", f"PRAGMA integrity_check: {integrity[:300]}")
    return verdict


def job_id(number: int) -> str:
    """The id of the run's ``number``-th job (from 0): ids sort as their numbers do."""
    return f"job-{number:07d}"


def _shard_of(job: str, shard_jobs: int) -> int:
    """The shard of a job's events: -1 for an id the run never made."""
    number = job.removeprefix("job-")
    if len(number) != 7 or not number.isdigit():
        return -1
    return int(number) // shard_jobs


def _judge_jobs(
    verdict: Verdict,
    config: TortureConfig,
    by_kind: dict[str, list[Event]],
    db: DatabaseState,
    crashes: list[Event],
    recoveries: _Recoveries,
) -> None:
    """The rules about jobs, each about one job: on all of a run's jobs, or on a shard of them
    (events and rows alike); ``crashes``: all of the run's."""
    recoveries.add(by_kind["write"])
    _fences_issued_once(verdict, by_kind["claim"])
    _accepted_writes_were_current(verdict, by_kind)
    _done_exactly_once(verdict, config, by_kind["write"], db)
    _accepted_writes_kept(verdict, by_kind, db)
    _external_tokens_never_went_back(verdict, db)
    if db.history is not None:
        _history_agrees(verdict, by_kind, db, db.history, crashes)


def _judge_run(verdict: Verdict, run: _RunEvents, *, jobs: int, enqueued: int) -> None:
    """The rules about the whole run: the jobs' count, the workers' counters, crashes, hangs."""
    if jobs != enqueued:
        verdict.flag("job lost", f"{jobs} job rows, {enqueued} enqueued")
    _metrics_agree(verdict, run.metrics, run.calls)
    for crash in run.crashed:
        verdict.flag("worker crashed", f"{crash['type']}: {crash['message']}")
    for hung in run.hung:
        verdict.flag(
            "worker hung",
            f"worker {hung['worker']} did not stop within {hung['waited']:g} s of being asked to",
        )


class _RunEvents:
    """What the verdict keeps of every event as it streams by: the tallies, each process's
    calls counted as its counters count them, and the few events about the run itself."""

    def __init__(self, tallies: Counter[tuple[str, ...]]) -> None:
        self.tallies = tallies
        self.calls: dict[str, tuple[Counter[str], Counter[str]]] = {}
        self.metrics: list[Event] = []
        self.crashed: list[Event] = []
        self.hung: list[Event] = []

    def add(self, event: Event) -> None:
        _tally(self.tallies, event)
        kind = event["k"]
        if kind in _COUNTED_CALLS and "owner" in event:
            store, marks = self.calls.setdefault(event["owner"], (Counter(), Counter()))
            _count_call(store, marks, event)
        elif kind == "metrics":
            self.metrics.append(event)
        elif kind == "crash":
            self.crashed.append(event)
        elif kind == "hung":
            self.hung.append(event)


def _tally(tallies: Counter[tuple[str, ...]], event: Event) -> None:
    kind = event["k"]
    if kind in OPERATIONS:
        tallies[("operations",)] += 1
    if kind in ("claim", "skip", "error", "crash", "died", "unavailable", "unknown", "release"):
        tallies[(kind,)] += 1
    if kind == "unknown":
        tallies[("unknown", event["op"])] += 1
    elif kind == "renew":
        tallies[("renew",)] += 1
        if event["until"] is None:
            tallies[("renew", "refused")] += 1
    elif kind == "write":
        tallies[("write", "accepted") if event["ok"] else ("write", "refused", event["how"])] += 1
        tallies[("write", "how", event["how"])] += 1
        if event.get("nested"):
            tallies[("write", "nested")] += 1
    elif kind == "external":
        tallies[("external", "accepted" if event["ok"] else "refused")] += 1
    elif kind == "release":
        if event["ok"] and "delay" in event:
            tallies[("release-delayed",)] += 1
    elif kind == "fault":
        tallies[("fault", event["kind"])] += 1
    elif kind == "metrics":
        tallies[("metrics", "front", event.get("front", "sync"))] += 1


def _crashes(by_kind: dict[str, list[Event]]) -> list[Event]:
    """The server's crashes, in order (``t0``: killed; ``t1``: answering again)."""
    return sorted((f for f in by_kind["fault"] if f["kind"] == SERVER_CRASH), key=lambda f: f["t0"])


class _Recoveries:
    """Whether the workers rode through: a crash is ``recovered`` once a write that started
    after the server answered again was accepted, before the next crash; and the writes
    accepted after the last one. Fed the writes a shard at a time."""

    def __init__(self, crashes: list[Event]) -> None:
        self.crashes = crashes
        self.ends = [c["t0"] for c in crashes[1:]] + [float("inf")]
        self.recovered: set[int] = set()
        self.after_the_last = 0

    def add(self, writes: list[Event]) -> None:
        if not self.crashes:
            return
        accepted = sorted(w["t0"] for w in writes if w["ok"])
        for n, (crash, end) in enumerate(zip(self.crashes, self.ends, strict=True)):
            first = bisect.bisect_right(accepted, crash["t1"])  # the first write started after it
            if first < len(accepted) and accepted[first] < end:
                self.recovered.add(n)
        self.after_the_last += len(accepted) - bisect.bisect_right(accepted, self.crashes[-1]["t1"])

    def tally(self, tallies: Counter[tuple[str, ...]]) -> None:
        if not self.crashes:
            return
        tallies[(SERVER_CRASH, "recovered")] = len(self.recovered)
        tallies[("write", "accepted after the last crash")] = self.after_the_last


def _fences_issued_once(verdict: Verdict, claims: list[Event]) -> None:
    by_fence: dict[tuple[str, int], list[Event]] = defaultdict(list)
    by_job: dict[str, list[Event]] = defaultdict(list)
    for claim in claims:
        by_fence[claim["job"], claim["fence"]].append(claim)
        by_job[claim["job"]].append(claim)
    for (job, fence), same in by_fence.items():
        if len(same) > 1:
            owners = ", ".join(sorted(c["owner"] for c in same))
            verdict.flag("fence issued twice", f"{job}: fence {fence} went to {owners}")
    for job, job_claims in by_job.items():
        job_claims.sort(key=lambda c: c["t0"])
        latest: Event | None = None  # the claim with the highest fence among those already returned
        for claim in job_claims:
            if latest is not None and latest["t1"] < claim["t0"] and claim["fence"] <= latest["fence"]:
                verdict.flag(
                    "fence went backwards",
                    f"{job}: fence {claim['fence']} to {claim['owner']} after fence {latest['fence']} "
                    f"to {latest['owner']} had been handed out",
                )
            if latest is None or claim["fence"] > latest["fence"]:
                latest = claim


def _accepted_writes_were_current(verdict: Verdict, by_kind: dict[str, list[Event]]) -> None:
    claims: dict[str, list[Event]] = defaultdict(list)
    claim_of: dict[LeaseKey, Event] = {}
    for claim in by_kind["claim"]:
        claims[claim["job"]].append(claim)
        claim_of[claim["job"], claim["fence"], claim["owner"]] = claim
    renewals: dict[LeaseKey, list[Event]] = defaultdict(list)
    for renew in by_kind["renew"]:
        renewals[renew["job"], renew["fence"], renew["owner"]].append(renew)
    unfinished: dict[LeaseKey, list[float]] = defaultdict(list)  # renewals whose outcome is not known
    for start in by_kind["renew-start"]:
        key = (start["job"], start["fence"], start["owner"])
        if all(renew["t0"] != start["t0"] for renew in renewals[key]):
            unfinished[key].append(start["t0"])
    revokes: dict[str, list[Event]] = defaultdict(list)
    for fault in by_kind["fault"]:
        if fault["kind"] == "revoke" and fault.get("ok"):
            revokes[fault["job"]].append(fault)
    releases: dict[LeaseKey, list[Event]] = defaultdict(list)
    for release in by_kind["release"]:
        if release["ok"]:
            releases[release["job"], release["fence"], release["owner"]].append(release)

    for write in by_kind["write"]:
        if not write["ok"]:
            continue
        job, fence, owner = key = (write["job"], write["fence"], write["owner"])
        what = f"{write['how']} write of {job} by {owner} (fence {fence})"
        for claim in claims[job]:
            if claim["fence"] > fence and claim["t1"] < write["t0"]:
                verdict.flag(
                    "stale fence accepted",
                    f"{what} accepted after fence {claim['fence']} had been handed to {claim['owner']}",
                )
                break
        mine = claim_of.get(key)
        if mine is None:
            continue
        for revoke in revokes[job]:
            if mine["t1"] < revoke["t0"] and revoke["t1"] < write["t0"]:
                verdict.flag("revoked lease accepted", f"{what} accepted after the lease was revoked")
                break
        for release in releases[key]:
            if release["t1"] < write["t0"]:
                verdict.flag("released lease accepted", f"{what} accepted after the lease was released")
                break
        if any(t0 < write["t1"] for t0 in unfinished[key]):
            continue  # a renewal with no known outcome may have extended the lease
        until = max(
            [mine["until"]]
            + [r["until"] for r in renewals[key] if r["until"] is not None and r["t0"] < write["t1"]]
        )
        if write["t0"] > until + CLOCK_TOLERANCE:
            verdict.flag(
                "expired lease accepted",
                f"{what} accepted; it started {write['t0'] - until:.3f} s after the lease expired",
            )


def _done_exactly_once(
    verdict: Verdict, config: TortureConfig, writes: list[Event], db: DatabaseState
) -> None:
    accepted = Counter(w["job"] for w in writes if w["ok"])
    for job, n in accepted.items():
        if n > 1:
            verdict.flag("completed twice", f"{job}: {n} completions were accepted")
    results: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in db.results:
        results[row[1]].append(row)
    for job, owner, until, fence, result, done in db.jobs:
        if done != 1:
            verdict.flag(
                "job not done", f"{job} is not done at the end (owner {owner}, fence {fence}, until {until})"
            )
            continue
        if result != f"{owner}#{fence}":
            verdict.flag(
                "result from a stale lease",
                f"{job} holds {result!r}, not from its last lease (owner {owner}, fence {fence})",
            )
        rows = results.pop(job, [])
        if finish_mode(config, job) == "fenced":
            if len(rows) != 1:
                verdict.flag(
                    "fenced write not exactly once", f"{job} has {len(rows)} rows of its fenced write"
                )
            elif (rows[0][2], rows[0][3]) != (owner, fence):
                verdict.flag(
                    "fenced write torn from its completion",
                    f"{job}: the row written by {rows[0][2]} (fence {rows[0][3]}) but completed by {owner} "
                    f"(fence {fence})",
                )
        elif rows:
            verdict.flag(
                "fenced write without completion", f"{job} ({finish_mode(config, job)}) has {len(rows)} rows"
            )
    for job, rows in results.items():
        verdict.flag("fenced write without completion", f"{len(rows)} rows for {job}, which is not a job")


def _accepted_writes_kept(verdict: Verdict, by_kind: dict[str, list[Event]], db: DatabaseState) -> None:
    """No write a worker saw acknowledged is lost: an accepted completion is the job's, done,
    at the end (a done job never changes again); an external write whose transaction
    committed is in the resource's rows."""
    jobs = {job: (owner, fence, done) for job, owner, _until, fence, _result, done in db.jobs}
    for write in by_kind["write"]:
        if not write["ok"]:
            continue
        job, owner, fence = write["job"], write["owner"], write["fence"]
        found = jobs.get(job)
        if found != (owner, fence, 1):
            has = "no such job" if found is None else "owner {}, fence {}, done {}".format(*found)
            verdict.flag(
                "accepted write lost",
                f"the {write['how']} write of {job} by {owner} (fence {fence}) was accepted, but the "
                f"database has {has}",
            )
    rows = Counter((resource, owner, fence) for _seq, resource, owner, fence in db.external)
    for external in by_kind["external"]:
        # kept: False (rolled back) or None (lost during its COMMIT); absent: committed
        if not external["ok"] or not external.get("kept", True):
            continue
        key = (f"job:{external['job']}", external["owner"], external["fence"])
        if not rows[key]:
            verdict.flag(
                "accepted external write lost",
                f"{key[0]}: the write by {key[1]} (fence {key[2]}) committed, but its row is not there",
            )


def _external_tokens_never_went_back(verdict: Verdict, db: DatabaseState) -> None:
    highest: dict[str, tuple[int, str]] = {}
    fences = {job: fence for job, _owner, _until, fence, _result, _done in db.jobs}
    for _seq, resource, owner, fence in db.external:
        before = highest.get(resource)
        if before is not None and fence < before[0]:
            verdict.flag(
                "external token went backwards",
                f"{resource}: fence {fence} from {owner} accepted after fence {before[0]} from {before[1]}",
            )
        if before is None or fence > before[0]:
            highest[resource] = (fence, owner)
        job = resource.removeprefix("job:")
        if job in fences and fence > fences[job]:
            verdict.flag(
                "external token never issued", f"{resource}: fence {fence} was accepted, never issued"
            )
    for resource, (fence, _owner) in highest.items():
        mark = db.marks.get(resource)
        if mark is None or mark < fence:
            verdict.flag("external mark behind", f"{resource}: mark {mark}, but fence {fence} was accepted")


#: history events that write under a lease, which its claim must come before
_WRITES_UNDER_A_LEASE = ("complete", "fenced", "release", "renew")


def _history_agrees(
    verdict: Verdict,
    by_kind: dict[str, list[Event]],
    db: DatabaseState,
    history: Sequence[tuple[Any, ...]],
    crashes: list[Event],
) -> None:
    """The ownership history against the journals and the jobs table: every accepted write's
    lease was claimed before it (in ``seq`` order), every write the journals saw accepted or
    refused is there, every done job's completion is there, and every refused write carries
    a holder and fence its job really had before the refusal was written."""
    for row in history:
        verdict.tallies[("history", row[2])] += 1
    claimed: set[LeaseKey] = set()
    by_event: dict[str, set[LeaseKey]] = defaultdict(set)
    #: job -> the (fence, holder) states it has been in so far, replayed in seq order
    states: dict[str, set[tuple[int, str | None]]] = defaultdict(lambda: {(0, None)})
    now: dict[str, tuple[int, str | None]] = {}
    last_claim: dict[str, int] = {}
    for seq, job, event, owner, fence, path, reason, holder, current in history:
        key = (job, fence, owner)
        by_event[event].add(key)
        if event == "claim":
            # every claim that committed, seen by its worker or not (an unknown outcome)
            if fence <= last_claim.get(job, 0):
                verdict.flag(
                    "history: fence issued twice",
                    f"{job}: fence {fence} claimed by {owner} at seq {seq}, after fence "
                    f"{last_claim[job]} had been claimed",
                )
            last_claim[job] = max(fence, last_claim.get(job, 0))
        if event in _WRITES_UNDER_A_LEASE and key not in claimed:
            verdict.flag(
                "history: write before its claim",
                f"{job}: {event} by {owner} (fence {fence}) at seq {seq}, no claim of that lease before it",
            )
        fence_now, holder_now = now.get(job, (0, None))
        if event == "claim":
            claimed.add(key)
            fence_now, holder_now = fence, owner
        elif event in ("revoke", "delete"):
            fence_now, holder_now = fence, None
        elif event == "release":
            holder_now = None
        elif event == "refused" and current is not None and (current, holder) not in states[job]:
            verdict.flag(
                "history: refusal with a holder the job never had",
                f"{job}: {path} by {owner} (fence {fence}) refused ({reason}) at seq {seq}, recorded "
                f"holder {holder} at fence {current}, a state the history never shows before it",
            )
        now[job] = (fence_now, holder_now)
        states[job].add((fence_now, holder_now))
    for claim in by_kind["claim"]:
        if (claim["job"], claim["fence"], claim["owner"]) not in by_event["claim"]:
            verdict.flag(
                "history: claim missing",
                f"{claim['job']}: the claim of fence {claim['fence']} by {claim['owner']} returned, "
                "but the history has no row of it (it did not commit, or was lost since)",
            )
    for write in by_kind["write"]:
        key = (write["job"], write["fence"], write["owner"])
        if not write["ok"] and write["how"] == "fenced" and _during_a_crash(write, crashes):
            continue  # its refusal is written after the rollback, on its own: a crash may stop it
        if key not in by_event["complete" if write["ok"] else "refused"]:
            outcome = "accepted" if write["ok"] else "refused"
            verdict.flag(
                f"history: {outcome} write missing",
                f"{write['job']}: the {write['how']} write by {write['owner']} (fence {write['fence']}) "
                f"was {outcome} but the history has no row of it",
            )
    for release in by_kind["release"]:
        key = (release["job"], release["fence"], release["owner"])
        if release["ok"] and key not in by_event["release"]:
            verdict.flag("history: release missing", f"{release['job']}: the release by {release['owner']}")
    for job, owner, _until, fence, _result, done in db.jobs:
        if done == 1 and (job, fence, owner) not in by_event["complete"]:
            verdict.flag(
                "history: completion missing",
                f"{job} is done under {owner} (fence {fence}) but the history has no completion of it",
            )


def _during_a_crash(event: Event, crashes: list[Event]) -> bool:
    """Whether the call overlapped a time the server was down (or restarting)."""
    return any(event["t0"] <= crash["t1"] and event["t1"] >= crash["t0"] for crash in crashes)


#: the events a worker journals for the calls its counters count
_COUNTED_CALLS = ("claim", "write", "renew", "release", "external")


def _metrics_agree(
    verdict: Verdict, reported: list[Event], calls: dict[str, tuple[Counter[str], Counter[str]]]
) -> None:
    """Each worker's counters against its own journal (``calls``: what :func:`_count_call`
    counted of it): exact, call by call.

    Store: ``claim_next.jobs`` = its claim events (``claim_next`` and the step's claim);
    ``claim_next.calls`` = its ``claim_next`` calls that returned (``polls``) + its step
    writes; ``complete.*`` = its plain writes, ``complete_many.*`` = its batch and step writes,
    ``fenced.*`` = its fenced writes (blocks that completed their job), ``renew.*`` and
    ``release.*`` = its renewals and releases (the heartbeat's included: through the
    journaled keeper); accepted by ``.accepted``, refused by the sum of ``.refused.<reason>``.
    Marks: ``accept.accepted`` and ``accept.refused.*`` = its external writes. Every other
    counter, save :data:`UNJOURNALED_COUNTERS`, counts calls the worker never makes: 0.
    """
    for metrics in reported:
        owner = metrics["owner"]
        counted_store, counted_marks = calls.get(owner, (Counter(), Counter()))
        store = counted_store + Counter({"claim_next.calls": metrics["polls"]})
        mismatches = [
            *_mismatches("store", store, _folded(metrics["store"])),
            *_mismatches("marks", counted_marks, _folded(metrics["marks"])),
        ]
        verdict.tallies[("metrics", "checked")] += 1
        if not mismatches:
            verdict.tallies[("metrics", "agreed")] += 1
        for mismatch in mismatches:
            verdict.flag(METRICS_DISAGREE, f"worker {metrics['worker']} ({owner}): {mismatch}")


def _count_call(store: Counter[str], marks: Counter[str], event: Event) -> None:
    """One call of a worker's journal, as its counters count it (store, marks), refusals
    summed over their reasons (``<path>.refused``)."""
    kind = event["k"]
    if kind == "claim":
        store["claim_next.jobs"] += 1
    elif kind == "write":
        if event["how"] == "step":
            store["claim_next.calls"] += 1
        path = COUNTED_AS[event["how"]]
        store[f"{path}.accepted" if event["ok"] else f"{path}.refused"] += 1
    elif kind == "renew":
        store["renew.refused" if event["until"] is None else "renew.accepted"] += 1
    elif kind == "release":
        store["release.accepted" if event["ok"] else "release.refused"] += 1
    else:  # external
        marks["accept.accepted" if event["ok"] else "accept.refused"] += 1


def _folded(snapshot: dict[str, int]) -> Counter[str]:
    """A snapshot's counters with each path's refusals summed over their reasons, less
    those no journal accounts for."""
    folded: Counter[str] = Counter()
    for name, n in snapshot.items():
        if name in UNJOURNALED_COUNTERS:
            continue
        path, refused, _reason = name.partition(".refused.")
        folded[f"{path}.refused" if refused else name] += n
    return folded


def _mismatches(which: str, journaled: Counter[str], counted: Counter[str]) -> list[str]:
    return [
        f"{which} counter {name}{'.*' if name.endswith('.refused') else ''} is {counted[name]}, "
        f"its journal says {journaled[name]}"
        for name in sorted(set(journaled) | set(counted))
        if journaled[name] != counted[name]
    ]
