"""Every refused write says why: one line on ``fencing.refused`` and a count in ``store.metrics``.

Each scenario leaves a job in one state, presents a lease the guard must refuse, and checks
the answer, the one log record (its structured fields: path, job, owner, fence presented,
reason, holder and fence at that moment) and the counters. Accepted writes log nothing and
are counted as accepted. Run on every backend, through the sync and the async store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from fencing import FenceMarks, JobStore, Lease, LeaseLost
from fencing._runtime.refusals import REASONS, Refusal

pytestmark = pytest.mark.dialect

TTL = 10.0
FIELDS = ("path", "job_id", "owner", "fence", "reason", "holder", "current_fence")


@pytest.fixture
def refusals(caplog: pytest.LogCaptureFixture) -> Callable[[], list[dict[str, Any]]]:
    caplog.set_level(logging.INFO, logger="fencing")

    def records() -> list[dict[str, Any]]:
        return [
            {
                k: getattr(r, k)
                for k in ("path", "job_id", "owner", "fence", "reason", "holder", "current_fence")
            }
            | {"level": r.levelname, "message": r.getMessage()}
            for r in caplog.records
            if r.name == "fencing.refused"
        ]

    return records


def claimed(store: JobStore, job: str = "job", owner: str = "a", now: float = 100.0) -> Lease:
    store.enqueue(job, ready_at=0.0)
    lease = store.claim(job, owner, ttl=TTL, now=now)
    assert lease is not None
    return lease


# each: (set the job up and return the lease to present, the refused write, reason, holder, fence)
def _taken_over(store: JobStore) -> Lease:
    old = claimed(store)
    assert store.claim("job", "b", ttl=TTL, now=200.0) is not None  # a's lease expired at 110
    return old


def _expired(store: JobStore) -> Lease:
    return claimed(store)


def _done(store: JobStore) -> Lease:
    lease = claimed(store)
    assert store.complete(lease, "first", now=101.0)
    return lease


def _forged(store: JobStore) -> Lease:
    lease = claimed(store)
    return Lease("job", "mallory", lease.fence, lease.until)


def _released(store: JobStore) -> Lease:
    lease = claimed(store)
    assert store.release(lease)
    return lease


def _deleted(store: JobStore) -> Lease:
    lease = claimed(store)
    assert store.delete("job")
    return lease


def _missing(store: JobStore) -> Lease:
    return Lease("never-enqueued", "a", 1, 150.0)


def _revoked(store: JobStore) -> Lease:
    lease = claimed(store)
    assert store.revoke("job")
    return lease


SCENARIOS = {
    # name: (setup, the time of the late write, reason, the holder then, the fence then)
    "taken over": (_taken_over, 201.0, "stale fence", "b", 2),
    "expired": (_expired, 120.0, "expired", "a", 1),
    "done": (_done, 102.0, "done", "a", 1),
    "forged owner": (_forged, 102.0, "other owner", "a", 1),
    "released": (_released, 102.0, "released", None, 1),
    "deleted": (_deleted, 102.0, "deleted", None, 1),
    "missing": (_missing, 102.0, "missing", None, None),
    "revoked": (_revoked, 102.0, "stale fence", None, 2),
}

WRITES: dict[str, Callable[[JobStore, Lease, float], object]] = {
    "complete": lambda store, lease, now: store.complete(lease, "late", now=now),
    "renew": lambda store, lease, now: store.renew(lease, ttl=TTL, now=now),
    "release": lambda store, lease, now: store.release(lease, delay=5.0, now=now),
    "complete_many": lambda store, lease, now: store.complete_many([(lease, "late")], now=now),
}


#: release refuses no expired lease: a holder may give back a lease that ran out
REFUSED = [(s, w) for s in SCENARIOS for w in WRITES if (s, w) != ("expired", "release")]


@pytest.mark.parametrize(("scenario", "write"), REFUSED)
def test_a_refused_write_logs_its_reason_once_and_counts_it(
    store: JobStore, refusals: Callable[[], list[dict[str, Any]]], scenario: str, write: str
) -> None:
    setup, at, reason, holder, fence = SCENARIOS[scenario]
    lease = setup(store)
    before = store.state(lease.job_id)
    answer = WRITES[write](store, lease, at)

    [refused] = answer if isinstance(answer, list) else [answer]  # what the caller is told
    assert isinstance(refused, Refusal) and not refused
    assert (refused.reason, refused.holder, refused.current_fence) == (reason, holder, fence)
    assert store.state(lease.job_id) == before  # refused: nothing changed
    [record] = refusals()
    assert record == {
        "path": write,
        "job_id": lease.job_id,
        "owner": lease.owner,
        "fence": lease.fence,
        "reason": reason,
        "holder": holder,
        "current_fence": fence,
        "level": "WARNING",
        "message": record["message"],
    }
    assert f"refused {write} of job {lease.job_id!r} by {lease.owner!r}" in record["message"]
    counts = store.metrics.snapshot()
    assert counts[f"{write}.refused.{reason}"] == 1
    assert store.metrics.refused(write) == 1
    assert store.metrics.refused() == 1


def test_release_gives_back_a_lease_that_ran_out(store: JobStore) -> None:
    """Why REFUSED leaves out (expired, release): the holder may still give it back."""
    lease = claimed(store)
    assert store.release(lease, delay=5.0, now=120.0)


def test_accepted_writes_log_nothing_and_are_counted(
    store: JobStore, refusals: Callable[[], list[dict[str, Any]]]
) -> None:
    lease = claimed(store)
    renewed = store.renew(lease, ttl=TTL, now=105.0)
    assert isinstance(renewed, Lease)
    assert store.release(renewed, now=106.0)
    [second] = store.claim_next("b", ttl=TTL, now=107.0)
    assert [bool(v) for v in store.complete_many([(second, "r")], now=108.0)] == [True]
    assert store.claim("job", "c", ttl=TTL, now=109.0) is None  # done: nothing to claim
    assert refusals() == []
    counts = store.metrics.snapshot()
    assert (counts["claim.accepted"], counts["claim.empty"]) == (1, 1)
    assert counts["renew.accepted"] == counts["release.accepted"] == counts["complete_many.accepted"] == 1
    assert counts["claim_next.calls"] == counts["claim_next.jobs"] == 1
    assert store.metrics.refused() == 0


def test_complete_many_reports_each_refused_item_and_counts_the_accepted(
    store: JobStore, refusals: Callable[[], list[dict[str, Any]]]
) -> None:
    live = claimed(store, "live")
    stale = _taken_over(store)
    forged = Lease("live", "a", 7, live.until)  # a fence never handed out
    answer = store.complete_many([(live, "r"), (stale, "late"), (forged, "x"), (live, "again")], now=201.0)
    # live's lease ran out at 110: only the write at its own time would have been accepted
    assert [bool(v) for v in answer] == [False, False, False, False]
    assert [(r["job_id"], r["fence"], r["reason"]) for r in refusals()] == [
        ("live", 1, "expired"),
        ("job", 1, "stale fence"),
        ("live", 7, "stale fence"),
        ("live", 1, "expired"),
    ]
    refusals_before = len(refusals())
    again = claimed(store, "again", now=300.0)
    assert [bool(v) for v in store.complete_many([(again, "r"), (stale, "late")], now=301.0)] == [True, False]
    assert len(refusals()) == refusals_before + 1
    assert store.metrics.snapshot()["complete_many.accepted"] == 1


def test_a_fenced_block_on_a_lost_lease_logs_why(
    store: JobStore, refusals: Callable[[], list[dict[str, Any]]]
) -> None:
    stale = _taken_over(store)
    with pytest.raises(LeaseLost), store.fenced(stale, now=201.0):
        pytest.fail("the block must not run")
    [record] = refusals()
    assert (record["path"], record["reason"], record["holder"], record["current_fence"]) == (
        "fenced",
        "stale fence",
        "b",
        2,
    )


def test_a_refusal_on_the_database_clock_says_expired(
    store: JobStore, refusals: Callable[[], list[dict[str, Any]]]
) -> None:
    store.enqueue("job")
    lease = store.claim("job", "a", ttl=0.05)
    assert lease is not None
    time.sleep(0.2)
    assert not store.complete(lease, "late")
    [record] = refusals()
    assert (record["reason"], record["holder"], record["current_fence"]) == ("expired", "a", 1)


def test_revoke_and_delete_are_logged_at_info_and_counted(
    store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fencing")
    claimed(store)
    assert store.revoke("job")
    assert store.delete("job")
    assert not store.delete("job")  # nothing changed: no line, no count
    lines = [(r.name, r.levelname, r.getMessage(), getattr(r, "path", None)) for r in caplog.records]
    assert lines == [
        ("fencing.store", "INFO", "revoked the lease on job 'job'", "revoke"),
        ("fencing.store", "INFO", "deleted job 'job'", "delete"),
    ]
    counts = store.metrics.snapshot()
    assert (counts["revoke.accepted"], counts["delete.accepted"]) == (1, 1)


def test_every_reason_has_a_scenario() -> None:
    covered = {reason for _, _, reason, _, _ in SCENARIOS.values()}
    assert set(REASONS) - covered == {"not current"}  # only a write racing the read gets it


def test_a_refused_fence_mark_logs_the_newer_mark(engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fencing")
    marks = FenceMarks(engine)
    marks.create_tables()
    assert marks.accept("invoice-42", 3)
    assert marks.accept("invoice-42", 3)  # the same lease writing twice: accepted, no line
    assert not marks.accept("invoice-42", 2)
    assert marks.highest("invoice-42") == 3
    [record] = [r for r in caplog.records if r.name == "fencing.refused"]
    fields = {k: getattr(record, k) for k in ("path", "resource", "fence", "reason", "mark")}
    assert fields == {
        "path": "accept",
        "resource": "invoice-42",
        "fence": 2,
        "reason": "older fence",
        "mark": 3,
    }
    assert record.levelname == "WARNING"


@pytest.mark.parametrize("fence", [0, 2**63])
def test_a_fence_no_claim_hands_out_is_refused_unread_as_stale(
    store: JobStore, refusals: Callable[[], list[dict[str, Any]]], fence: int
) -> None:
    lease = claimed(store)
    forged = Lease("job", "a", fence, lease.until)
    assert not store.complete(forged, "x", now=101.0)
    assert not store.renew(forged, ttl=TTL, now=101.0)
    assert [bool(v) for v in store.complete_many([(forged, "x")], now=101.0)] == [False]
    with pytest.raises(LeaseLost), store.fenced(forged, now=101.0):
        pytest.fail("the block must not run")
    assert [(r["path"], r["reason"], r["holder"]) for r in refusals()] == [
        ("complete", "stale fence", None),
        ("renew", "stale fence", None),
        ("complete_many", "stale fence", None),
        ("fenced", "stale fence", None),
    ]
