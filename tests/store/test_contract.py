"""Every rule of CONTRACT.md, through ``service.py``, one test per rule."""

from __future__ import annotations

import concurrent.futures
import contextlib
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, update

import fencing._store.leases
import service
from fencing import jobs
from fencing._sql.schema import as_text

pytestmark = pytest.mark.dialect

NOW = 1000.0
TTL = 30.0
ROW_KEYS = ["id", "owner", "until", "fence", "result", "done"]


@contextlib.contextmanager
def raw(path: str) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def row(job_id: str, owner: str | None, until: float, fence: int, result: str | None, done: int) -> dict:
    return {"id": job_id, "owner": owner, "until": until, "fence": fence, "result": result, "done": done}


def claimed(db: str, job_id: str = "j", owner: str = "a", now: float = NOW, ttl: float = TTL) -> int:
    service.enqueue(db, job_id)
    fence = service.claim(db, job_id, owner, now, ttl)
    assert isinstance(fence, int)
    return fence


# -- init_db ------------------------------------------------------------------------------


def test_init_db_creates_the_table(target: str) -> None:
    assert service.init_db(target) is None
    assert service.state(target, "j") is None
    assert service.enqueue(target, "j") is True
    assert service.state(target, "j") == row("j", None, 0.0, 0, None, 0)


def test_init_db_is_idempotent(db: str) -> None:
    fence = claimed(db)
    before = service.state(db, "j")
    assert service.init_db(db) is None
    assert service.init_db(db) is None
    assert service.state(db, "j") == before == row("j", "a", NOW + TTL, fence, None, 0)


def test_init_db_on_an_existing_file_never_empties_it(db: str) -> None:
    service.enqueue(db, "waiting")
    fence = claimed(db, "held")
    done = claimed(db, "done")
    assert service.complete(db, "done", "a", done, NOW + 1, "ok")
    before = [service.state(db, j) for j in ("waiting", "held", "done")]

    service._stores.clear()  # a new process opens the existing file
    service.init_db(db)

    assert [service.state(db, j) for j in ("waiting", "held", "done")] == before
    assert before[1] == row("held", "a", NOW + TTL, fence, None, 0)
    assert before[2] == row("done", "a", NOW + TTL, done, "ok", 1)


@pytest.mark.backend("sqlite")
def test_init_db_never_overwrites_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    content = b"precious notes, not a database\n" * 200
    path.write_bytes(content)
    with pytest.raises(fencing.FencingError):
        service.init_db(str(path))
    assert path.read_bytes() == content


# -- enqueue ------------------------------------------------------------------------------


def test_enqueue_inserts_default_state_and_returns_true(db: str) -> None:
    assert service.enqueue(db, "j") is True
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)


def test_enqueue_twice_returns_false_and_changes_nothing(db: str) -> None:
    assert service.enqueue(db, "j") is True
    assert service.enqueue(db, "j") is False
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)


def test_enqueue_twice_keeps_lease_in_progress(db: str) -> None:
    fence = claimed(db)
    assert service.enqueue(db, "j") is False
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)
    # the lease is still live and still the holder's
    assert service.claim(db, "j", "b", NOW + 1, TTL) is None
    assert service.complete(db, "j", "a", fence, NOW + 1, "r") is True


def test_enqueue_of_done_job_keeps_result_and_fence(db: str) -> None:
    fence = claimed(db)
    assert service.complete(db, "j", "a", fence, NOW + 1, "r")
    assert service.enqueue(db, "j") is False
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, "r", 1)


# -- state --------------------------------------------------------------------------------


def test_state_returns_exact_dict_with_float_until_int_fence_int_done(db: str) -> None:
    service.enqueue(db, "j")
    service.claim(db, "j", "a", 10, 5)  # integer clock and duration
    state = service.state(db, "j")
    assert type(state) is dict
    assert list(state) == ROW_KEYS
    assert state == row("j", "a", 15.0, 1, None, 0)
    assert type(state["until"]) is float
    assert type(state["fence"]) is int
    assert type(state["done"]) is int
    assert type(state["id"]) is str
    assert type(state["owner"]) is str
    service.complete(db, "j", "a", 1, 11, "r")
    done = service.state(db, "j")
    assert done == row("j", "a", 15.0, 1, "r", 1)
    assert type(done["done"]) is int
    assert type(done["result"]) is str


def test_state_of_missing_job_is_none(db: str) -> None:
    service.enqueue(db, "j")
    assert service.state(db, "other") is None


@pytest.mark.backend("sqlite")
def test_state_reads_from_database_not_a_cache(db: str) -> None:
    claimed(db)
    assert service.state(db, "j")["result"] is None
    # another program changes the row behind the service's back
    with raw(db) as other:
        other.execute("UPDATE jobs SET result = 'outside', done = 1, fence = 41 WHERE id = 'j'")
        other.execute("INSERT INTO jobs(id) VALUES ('new')")
    assert service.state(db, "j") == row("j", "a", NOW + TTL, 41, "outside", 1)
    assert service.state(db, "new") == row("new", None, 0.0, 0, None, 0)
    with raw(db) as other:
        other.execute("DELETE FROM jobs WHERE id = 'j'")
    assert service.state(db, "j") is None


def test_state_reads_changes_made_through_another_engine(db: str, engine: Engine) -> None:
    claimed(db)
    assert service.state(db, "j")["fence"] == 1
    with engine.begin() as conn:
        conn.execute(update(jobs).where(as_text(jobs.c.id) == "j").values(fence=9, owner=as_text("z")))
    assert service.state(db, "j") == row("j", "z", NOW + TTL, 9, None, 0)


@pytest.mark.backend("sqlite")
def test_database_deleted_and_recreated_is_not_served_from_cache(db: str) -> None:
    claimed(db)
    service._stores.get(db)  # warm the cache
    for suffix in ("", "-wal", "-shm"):
        Path(db + suffix).unlink(missing_ok=True)
    with pytest.raises(fencing.DatabaseMissing):
        service.state(db, "j")
    service.init_db(db)
    assert service.state(db, "j") is None


# -- claim --------------------------------------------------------------------------------


def test_claim_stores_owner_until_and_returns_incremented_fence(db: str) -> None:
    service.enqueue(db, "j")
    assert service.claim(db, "j", "a", NOW, TTL) == 1
    assert service.state(db, "j") == row("j", "a", NOW + TTL, 1, None, 0)


def test_claim_increments_fence_by_one_each_time(db: str) -> None:
    service.enqueue(db, "j")
    fences = [service.claim(db, "j", f"w{i}", NOW + i * TTL, TTL) for i in range(5)]
    assert fences == [1, 2, 3, 4, 5]
    assert service.state(db, "j") == row("j", "w4", NOW + 5 * TTL, 5, None, 0)


def test_claim_missing_job_returns_none(db: str) -> None:
    service.enqueue(db, "j")
    assert service.claim(db, "missing", "a", NOW, TTL) is None
    assert service.state(db, "missing") is None
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)


def test_claim_on_done_job_returns_none(db: str) -> None:
    fence = claimed(db)
    assert service.complete(db, "j", "a", fence, NOW + 1, "r")
    # long after the lease ended: done stays done
    assert service.claim(db, "j", "b", NOW + 10 * TTL, TTL) is None
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, "r", 1)


def test_claim_on_held_job_returns_none(db: str) -> None:
    fence = claimed(db)
    assert service.claim(db, "j", "b", NOW + TTL - 0.001, TTL) is None
    assert service.claim(db, "j", "a", NOW + 1, TTL) is None  # not even the holder
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_claim_at_until_boundary_is_allowed(db: str) -> None:
    claimed(db)
    assert service.claim(db, "j", "b", NOW + TTL, TTL) == 2
    assert service.state(db, "j") == row("j", "b", NOW + 2 * TTL, 2, None, 0)


def test_claim_ttl_zero_raises_value_error_even_for_a_missing_job(db: str) -> None:
    service.enqueue(db, "j")
    for job_id in ("j", "missing"):
        with pytest.raises(ValueError, match="ttl"):
            service.claim(db, job_id, "a", NOW, 0)
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)
    assert service.state(db, "missing") is None


def test_claim_negative_ttl_raises_value_error(db: str) -> None:
    service.enqueue(db, "j")
    with pytest.raises(ValueError, match="ttl"):
        service.claim(db, "j", "a", NOW, -1.0)
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)


def test_claim_uses_callers_clock_not_the_machines(db: str) -> None:
    service.enqueue(db, "j")
    service.enqueue(db, "k")
    # a clock far in the past and one far in the future both behave by the caller's numbers
    assert service.claim(db, "j", "a", 0.0, 1.0) == 1
    assert service.state(db, "j")["until"] == 1.0
    assert service.claim(db, "j", "b", 0.5, 1.0) is None
    assert service.claim(db, "j", "b", 1.0, 1.0) == 2
    assert service.claim(db, "k", "a", 1e12, 60.0) == 1
    assert service.claim(db, "k", "b", 1e12 + 59.0, 60.0) is None


def test_claim_read_and_update_are_one_atomic_step(db: str) -> None:
    jobs_ids = [f"job{i}" for i in range(10)]
    for job_id in jobs_ids:
        service.enqueue(db, job_id)
    workers = 6
    barrier = threading.Barrier(workers)

    def worker(name: str) -> list[int | None]:
        barrier.wait()
        return [service.claim(db, job_id, name, NOW, TTL) for job_id in jobs_ids]

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(worker, [f"w{i}" for i in range(workers)]))
    for k, job_id in enumerate(jobs_ids):
        column = [r[k] for r in results]
        assert sorted(column, key=lambda f: f is None) == [1] + [None] * (workers - 1)
        winner = f"w{column.index(1)}"
        assert service.state(db, job_id) == row(job_id, winner, NOW + TTL, 1, None, 0)


@pytest.mark.backend("sqlite")
def test_claim_is_one_begin_immediate_transaction_on_sqlite(db: str) -> None:
    service.enqueue(db, "j")
    service._stores.clear()
    store = service._stores.get(db)
    statements: list[str] = []

    @event.listens_for(store.engine, "connect")
    def trace(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.set_trace_callback(statements.append)

    assert service.claim(db, "j", "a", NOW, TTL) == 1
    event.remove(store.engine, "connect", trace)
    work = [s.strip().upper() for s in statements if not s.strip().upper().startswith("PRAGMA")]
    assert work[0] == "BEGIN IMMEDIATE"
    assert work[-1] == "COMMIT"
    assert [s for s in work if s.startswith(("BEGIN", "COMMIT", "ROLLBACK", "END"))] == [
        "BEGIN IMMEDIATE",
        "COMMIT",
    ]
    assert any(s.startswith("UPDATE") for s in work[1:-1])


def test_claim_from_separate_processes_has_exactly_one_winner(db: str) -> None:
    script = textwrap.dedent(
        """
        import sys
        import service
        print("ready", flush=True)
        sys.stdin.readline()
        print(repr(service.claim(sys.argv[1], "j", sys.argv[2], 1000.0, 30.0)), flush=True)
        """
    )
    service.enqueue(db, "j")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, db, f"p{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=30)[0].strip() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sorted(outputs) == ["1", "None", "None"]
    winner = f"p{outputs.index('1')}"
    assert service.state(db, "j") == row("j", winner, 1030.0, 1, None, 0)


# -- renew --------------------------------------------------------------------------------


def test_renew_extends_a_live_lease(db: str) -> None:
    fence = claimed(db)
    assert service.renew(db, "j", "a", fence, NOW + 10, 100.0) is True
    assert service.state(db, "j") == row("j", "a", NOW + 110, fence, None, 0)
    # the extension is real: past the old until, nobody else may claim
    assert service.claim(db, "j", "b", NOW + TTL + 1, TTL) is None


def test_renew_can_shorten_a_live_lease(db: str) -> None:
    fence = claimed(db)
    assert service.renew(db, "j", "a", fence, NOW + 1, 1.0) is True
    assert service.state(db, "j")["until"] == NOW + 2
    assert service.claim(db, "j", "b", NOW + 2, TTL) == fence + 1


@pytest.mark.parametrize("ttl", [0, 0.0, -1, -0.001])
def test_renew_ttl_not_positive_raises_value_error(db: str, ttl: float) -> None:
    fence = claimed(db)
    with pytest.raises(ValueError, match="ttl"):
        service.renew(db, "j", "a", fence, NOW + 1, ttl)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_renew_ttl_zero_raises_value_error_even_for_a_missing_job(db: str) -> None:
    with pytest.raises(ValueError, match="ttl"):
        service.renew(db, "missing", "a", 1, NOW, 0)


def test_renew_with_wrong_owner_is_refused(db: str) -> None:
    fence = claimed(db)
    assert not service.renew(db, "j", "b", fence, NOW + 1, TTL)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_renew_with_wrong_fence_is_refused(db: str) -> None:
    fence = claimed(db)
    for other in (fence - 1, fence + 1, 0, -1, 2**63, 2**100):
        assert not service.renew(db, "j", "a", other, NOW + 1, TTL)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_renew_on_done_job_is_refused(db: str) -> None:
    fence = claimed(db)
    assert service.complete(db, "j", "a", fence, NOW + 1, "r")
    assert not service.renew(db, "j", "a", fence, NOW + 2, TTL)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, "r", 1)


def test_renew_at_until_boundary_is_refused(db: str) -> None:
    fence = claimed(db)
    assert not service.renew(db, "j", "a", fence, NOW + TTL, TTL)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_expired_lease_is_never_revived(db: str) -> None:
    fence = claimed(db)
    # nobody else claimed: the row still names "a" and its fence, but the lease is over
    assert not service.renew(db, "j", "a", fence, NOW + TTL + 1, TTL)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)
    assert not service.complete(db, "j", "a", fence, NOW + TTL + 1, "late")
    assert service.claim(db, "j", "b", NOW + TTL + 1, TTL) == fence + 1


def test_renew_of_missing_job_is_refused(db: str) -> None:
    assert not service.renew(db, "missing", "a", 1, NOW, TTL)
    assert service.state(db, "missing") is None


# -- complete -----------------------------------------------------------------------------


def test_complete_stores_result_and_marks_done(db: str) -> None:
    fence = claimed(db)
    assert service.complete(db, "j", "a", fence, NOW + 1, "the result") is True
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, "the result", 1)


def test_complete_with_none_result_marks_done(db: str) -> None:
    fence = claimed(db)
    assert service.complete(db, "j", "a", fence, NOW + 1, None) is True
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 1)


def test_late_worker_cannot_overwrite_result(db: str) -> None:
    service.enqueue(db, "j")
    fence_a = service.claim(db, "j", "A", NOW, TTL)
    # A stalls; its lease expires and B takes the job and completes it
    fence_b = service.claim(db, "j", "B", NOW + TTL + 5, TTL)
    assert fence_b == fence_a + 1
    assert service.complete(db, "j", "B", fence_b, NOW + TTL + 6, "B's result") is True
    # A wakes up late, still believing it holds the job
    assert not service.complete(db, "j", "A", fence_a, NOW + TTL + 7, "A's stale result")
    assert not service.complete(db, "j", "A", fence_a, NOW + 1, "A with an old clock")
    assert not service.renew(db, "j", "A", fence_a, NOW + 1, TTL)
    assert not service.release(db, "j", "A", fence_a)
    assert service.state(db, "j") == row("j", "B", NOW + 2 * TTL + 5, fence_b, "B's result", 1)


def test_late_worker_cannot_complete_before_newer_worker_finishes(db: str) -> None:
    service.enqueue(db, "j")
    fence_a = service.claim(db, "j", "A", NOW, TTL)
    fence_b = service.claim(db, "j", "B", NOW + TTL, TTL)
    assert not service.complete(db, "j", "A", fence_a, NOW + TTL + 1, "stale")
    assert service.state(db, "j") == row("j", "B", NOW + 2 * TTL, fence_b, None, 0)
    assert service.complete(db, "j", "B", fence_b, NOW + TTL + 2, "fresh") is True


def test_complete_at_until_boundary_is_refused(db: str) -> None:
    fence = claimed(db)
    assert not service.complete(db, "j", "a", fence, NOW + TTL, "r")
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_complete_with_wrong_owner_or_fence_leaves_result_untouched(db: str) -> None:
    fence = claimed(db)
    assert not service.complete(db, "j", "b", fence, NOW + 1, "x")
    assert not service.complete(db, "j", "a", fence + 1, NOW + 1, "x")
    assert not service.complete(db, "j", "a", fence - 1, NOW + 1, "x")
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_complete_twice_is_refused_and_keeps_first_result(db: str) -> None:
    fence = claimed(db)
    assert service.complete(db, "j", "a", fence, NOW + 1, "first") is True
    assert not service.complete(db, "j", "a", fence, NOW + 2, "second")
    assert not service.complete(db, "j", "a", fence, NOW + 2, None)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, "first", 1)


def test_complete_after_release_is_refused(db: str) -> None:
    fence = claimed(db)
    assert service.release(db, "j", "a", fence)
    assert not service.complete(db, "j", "a", fence, NOW + 1, "r")
    assert service.state(db, "j") == row("j", None, 0.0, fence, None, 0)


def test_complete_of_missing_job_is_refused(db: str) -> None:
    assert not service.complete(db, "missing", "a", 1, NOW, "r")
    assert service.state(db, "missing") is None


# -- release ------------------------------------------------------------------------------


def test_release_clears_owner_and_until(db: str) -> None:
    fence = claimed(db)
    assert service.release(db, "j", "a", fence) is True
    assert service.state(db, "j") == row("j", None, 0.0, fence, None, 0)


def test_release_keeps_fence(db: str) -> None:
    fence = claimed(db)
    assert service.release(db, "j", "a", fence) is True
    assert service.state(db, "j")["fence"] == fence
    # immediately claimable again, and the next fence is new
    assert service.claim(db, "j", "b", NOW + 1, TTL) == fence + 1


def test_release_with_wrong_owner_or_fence_is_refused(db: str) -> None:
    fence = claimed(db)
    assert not service.release(db, "j", "b", fence)
    assert not service.release(db, "j", "a", fence + 1)
    assert not service.release(db, "j", "a", 0)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, None, 0)


def test_release_of_done_job_is_refused(db: str) -> None:
    fence = claimed(db)
    assert service.complete(db, "j", "a", fence, NOW + 1, "r")
    assert not service.release(db, "j", "a", fence)
    assert service.state(db, "j") == row("j", "a", NOW + TTL, fence, "r", 1)


def test_release_twice_is_refused(db: str) -> None:
    fence = claimed(db)
    assert service.release(db, "j", "a", fence) is True
    assert not service.release(db, "j", "a", fence)
    assert service.state(db, "j") == row("j", None, 0.0, fence, None, 0)


def test_release_of_unclaimed_or_missing_job_is_refused(db: str) -> None:
    service.enqueue(db, "j")
    assert not service.release(db, "j", "a", 0)
    assert not service.release(db, "missing", "a", 1)
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)


# -- claim_many ---------------------------------------------------------------------------


def test_claim_many_returns_input_order_with_exactly_one_winner(db: str) -> None:
    service.enqueue(db, "j")
    owners = [f"w{i}" for i in range(8)]
    for generation in range(1, 6):
        now = NOW + generation * TTL
        results = service.claim_many(db, "j", owners, now, TTL)
        assert type(results) is list
        assert len(results) == len(owners)
        assert [r for r in results if r is not None] == [generation]
        winner = owners[results.index(generation)]
        assert service.state(db, "j") == row("j", winner, now + TTL, generation, None, 0)


def test_claim_many_with_duplicate_owners_has_one_winner(db: str) -> None:
    service.enqueue(db, "j")
    results = service.claim_many(db, "j", ["a", "a", "a"], NOW, TTL)
    assert sorted(results, key=lambda r: r is None) == [1, None, None]


def test_claim_many_on_held_done_or_missing_job_gives_all_none(db: str) -> None:
    fence = claimed(db, "held")
    done = claimed(db, "done")
    assert service.complete(db, "done", "a", done, NOW + 1, "r")
    owners = ["b", "c", "d"]
    assert service.claim_many(db, "held", owners, NOW + 1, TTL) == [None, None, None]
    assert service.claim_many(db, "done", owners, NOW + 10 * TTL, TTL) == [None, None, None]
    assert service.claim_many(db, "missing", owners, NOW, TTL) == [None, None, None]
    assert service.state(db, "held") == row("held", "a", NOW + TTL, fence, None, 0)
    assert service.state(db, "missing") is None


def test_claim_many_with_no_owners_gives_empty_list(db: str) -> None:
    service.enqueue(db, "j")
    assert service.claim_many(db, "j", [], NOW, TTL) == []
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)


def test_claim_many_ttl_zero_raises_value_error(db: str) -> None:
    service.enqueue(db, "j")
    with pytest.raises(ValueError, match="ttl"):
        service.claim_many(db, "j", ["a", "b"], NOW, 0)
    with pytest.raises(ValueError, match="ttl"):
        service.claim_many(db, "missing", ["a", "b"], NOW, -5)
    assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)


def test_claim_many_runs_claims_concurrently_on_a_thread_pool(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted: list[int] = []

    class Spy(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            submitted.append(self._max_workers)
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(fencing._store.leases, "ThreadPoolExecutor", Spy)
    service.enqueue(db, "j")
    results = service.claim_many(db, "j", ["a", "b", "c", "d"], NOW, TTL)
    assert len(submitted) == 4
    assert min(submitted) > 1  # more than one claim can be in flight at once
    assert sum(r is not None for r in results) == 1


def test_claim_many_has_one_winner_even_when_ttl_is_below_clock_resolution(db: str) -> None:
    # 1e16 + 0.5 == 1e16 in floating point: a lease that would end the moment it starts
    service.enqueue(db, "j")
    now = 1e16
    try:
        results = service.claim_many(db, "j", ["a", "b", "c"], now, 0.5)
    except ValueError:
        assert service.state(db, "j") == row("j", None, 0.0, 0, None, 0)
        return
    assert sum(r is not None for r in results) == 1, results
    assert service.state(db, "j")["until"] > now


# -- return types -------------------------------------------------------------------------


def test_return_types_are_exactly_bool_int_or_none(db: str) -> None:
    assert service.init_db(db) is None
    assert type(service.enqueue(db, "j")) is bool
    assert type(service.enqueue(db, "j")) is bool
    fence = service.claim(db, "j", "a", 10, 5)
    assert type(fence) is int
    assert service.claim(db, "j", "b", 11, 5) is None
    assert type(service.renew(db, "j", "a", fence, 11, 5)) is bool
    assert type(service.renew(db, "j", "b", fence, 11, 5)) is bool
    assert type(service.complete(db, "j", "b", fence, 12, "r")) is bool
    assert type(service.release(db, "j", "b", fence)) is bool
    assert type(service.release(db, "j", "a", fence)) is bool
    results = service.claim_many(db, "j", ["a", "b"], 20, 5)
    assert sorted(type(r).__name__ for r in results) == ["NoneType", "int"]
    fence = next(r for r in results if r is not None)
    owner = service.state(db, "j")["owner"]
    assert type(service.complete(db, "j", owner, fence, 21, "r")) is bool
    assert service.state(db, "j")["done"] == 1
