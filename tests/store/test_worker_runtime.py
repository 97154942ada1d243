"""The worker runtime (:class:`fencing.Worker`): each test on the database under test.

A worker runs the function once per job with its payload, stores what it returned fenced,
retries a failure with backoff and keeps its reason, leaves a job poisoned at
``max_attempts``, never stores the result of a function whose lease was lost, lets a
function complete the job in its own transaction, runs ``concurrency`` jobs at once, and on
stop lets running jobs finish within ``drain`` then hands the rest back.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, select

from fencing import (
    InvalidArgument,
    InvalidArgumentType,
    Job,
    JobStore,
    LeaseLost,
    Worker,
    failures_table,
    jobs_table,
    payloads_table,
)
from fencing._store import worker_rules as worker_module

TTL = 3.0


@pytest.fixture
def store(engine: Engine, request: pytest.FixtureRequest) -> JobStore:
    metadata = MetaData()
    name = "wk_" + request.node.name.split("[")[0][-20:]
    store = JobStore(
        engine,
        jobs_table(metadata, name),
        payloads=payloads_table(metadata, name + "_p"),
        failures=failures_table(metadata, name + "_f"),
    )
    store.create_table()
    return store


@pytest.fixture(autouse=True)
def quick_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "IDLE_WAIT", 0.2)  # a stopped worker's idle slots end soon


def _running(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    return thread


class _WaitsForLoss:
    """A job function that says it started, then waits (30 s at most) for its job's loss (the
    lease lost, or the job handed back), says whether it saw it and whether ``job.check()``
    then raised ``LeaseLost``, and returns ``returns``."""

    def __init__(self, returns: str | None = None) -> None:
        self.returns = returns
        self.started, self.saw_loss = threading.Event(), threading.Event()

    def __call__(self, job: Job) -> str | None:
        self.started.set()
        if job.lost.wait(30.0):
            with pytest.raises(LeaseLost):
                job.check()
            self.saw_loss.set()
        return self.returns


def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    ends = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < ends, "timed out"
        time.sleep(0.01)


def _run_until(worker: Worker, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    thread = _running(worker)
    try:
        _until(condition, timeout)
    finally:
        worker.stop()
        thread.join(30.0)
    assert not thread.is_alive()


def test_each_job_runs_once_with_its_payload_and_its_result_is_stored(store: JobStore) -> None:
    seen: list[tuple[str, Any, int]] = []

    def function(job: Job) -> Any:
        seen.append((job.job_id, job.payload, job.attempt))
        return {"total": job.payload["n"] * 2} if job.job_id != "text" else "as it is"

    for i in range(5):
        store.enqueue(f"order-{i}", payload={"n": i})
    store.enqueue("text", payload={"n": 0})
    worker = Worker(store, function, concurrency=2, ttl=TTL)
    _run_until(
        worker, lambda: all(store.state(f"order-{i}").done for i in range(5)) and store.state("text").done
    )
    assert sorted(seen) == sorted([(f"order-{i}", {"n": i}, 1) for i in range(5)] + [("text", {"n": 0}, 1)])
    assert json.loads(store.state("order-3").result) == {"total": 6}
    assert store.state("text").result == "as it is"


def test_a_failure_is_retried_with_backoff_and_its_reason_kept_then_poisoned(store: JobStore) -> None:
    attempts: list[float] = []

    def function(job: Job) -> None:
        attempts.append(time.monotonic())
        raise ValueError(f"card declined (attempt {job.attempt})")

    store.enqueue("pay")
    worker = Worker(store, function, ttl=TTL, max_attempts=3, retry_delay=0.2, max_retry_delay=0.3)
    _run_until(worker, lambda: len(attempts) == 3 and not worker.running and store.holder("pay") is None)
    time.sleep(0.8)  # poisoned: no fourth attempt however long it waits
    assert len(attempts) == 3
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.15  # the delays: 0.1-0.2 s, then 0.15-0.3 s (equal jitter)
    failure = store.failure("pay")
    assert failure is not None and failure.fence == 3
    assert "ValueError: card declined (attempt 3)" in failure.text
    assert "Traceback (most recent call last)" in failure.text and "in function" in failure.text
    assert [lease.job_id for lease in store.poisoned(max_attempts=3)] == ["pay"]
    assert not store.state("pay").done


def test_a_function_that_exits_fails_its_job_and_the_slot_goes_on(store: JobStore) -> None:
    def function(job: Job) -> str:
        if job.job_id == "exits":
            raise SystemExit(3)
        return "ok"

    store.enqueue("exits")
    store.enqueue("after", ready_at=time.time() + 0.5)
    worker = Worker(store, function, ttl=TTL, max_attempts=1)
    _run_until(worker, lambda: store.state("after").done)
    failure = store.failure("exits")
    assert failure is not None and "SystemExit: 3" in failure.text


def test_a_result_that_is_not_json_fails_the_job_and_says_why(store: JobStore) -> None:
    store.enqueue("odd")
    worker = Worker(store, lambda job: {"x": float("nan")}, ttl=TTL, max_attempts=1)
    _run_until(worker, lambda: store.failure("odd") is not None)
    failure = store.failure("odd")
    assert failure is not None and "NaN" in failure.text and not store.state("odd").done


def test_a_function_whose_lease_is_lost_sees_it_and_its_result_is_not_stored(store: JobStore) -> None:
    function = _WaitsForLoss(returns="stale")
    store.enqueue("slow")
    worker = Worker(store, function, ttl=TTL)
    thread = _running(worker)
    try:
        assert function.started.wait(20.0)
        assert store.revoke("slow")  # an operator takes the job away: the next renewal is refused
        lease = store.claim("slow", "someone-else", ttl=30.0)
        assert lease is not None
        assert function.saw_loss.wait(20.0)
        _until(lambda: not worker.running)
        assert store.complete(lease, "fresh")
    finally:
        worker.stop()
        thread.join(30.0)
    assert store.state("slow").result == "fresh"


# -- the timeout -------------------------------------------------------------------------------


def stuck_in_a_call(job: Job, seconds: float) -> None:
    """Where the timed-out function is (its failure names this frame)."""
    job.lost.wait(seconds)


def test_a_job_past_its_timeout_is_released_as_a_failure_with_its_stack_then_retried(store: JobStore) -> None:
    runs: list[tuple[int, bool]] = []

    def function(job: Job) -> str:
        if job.attempt == 1:
            stuck_in_a_call(job, 30.0)  # set at the timeout: the function is told to stop
            runs.append((job.attempt, job.lost.is_set()))
            with pytest.raises(LeaseLost, match="ran past the worker's timeout"):
                job.check()
            return "late"  # not stored
        runs.append((job.attempt, job.lost.is_set()))
        return "second"

    store.enqueue("slow")
    worker = Worker(store, function, ttl=TTL, timeout=0.5, retry_delay=0.05, max_retry_delay=0.05)
    began = time.monotonic()
    _run_until(worker, lambda: store.state("slow").done)
    assert runs == [(1, True), (2, False)]
    assert time.monotonic() - began < 10.0  # not the ttl's expiry, nor the 30 s wait
    assert store.state("slow").result == "second"
    failure = store.failure("slow")
    assert failure is not None and failure.fence == 1
    assert "TimeoutError: job 'slow' ran past the worker's timeout of 0.5 s" in failure.text
    assert "where it was when it timed out:" in failure.text and "in stuck_in_a_call" in failure.text
    assert _worker_counts(store) == {
        "worker.started": 2,
        "worker.timed_out": 1,
        "worker.retried": 1,  # the timed-out attempt's outcome; its late return counts nothing
        "worker.completed": 1,
    }


def test_what_a_timed_out_function_writes_later_is_refused(store: JobStore, engine: Engine) -> None:
    orders = Table("wk_late", MetaData(), Column("id", String(40), primary_key=True))
    orders.create(engine, checkfirst=True)
    refused: list[BaseException] = []
    try:

        def function(job: Job) -> None:
            stuck_in_a_call(job, 30.0)
            try:
                with job.completing("late") as conn:  # the lease was given up at the timeout
                    conn.execute(orders.insert().values(id=job.job_id))
            except LeaseLost as exc:
                refused.append(exc)

        store.enqueue("late")
        worker = Worker(store, function, ttl=TTL, timeout=0.3, max_attempts=1)
        _run_until(worker, lambda: bool(refused) and store.holder("late") is None)
        assert [lease.job_id for lease in store.poisoned(max_attempts=1)] == ["late"]
        assert not store.state("late").done and store.holder("late") is None
        with engine.connect() as conn:
            assert conn.execute(select(orders.c.id)).all() == []
    finally:
        orders.drop(engine)


def test_a_function_that_times_out_inside_its_own_block_keeps_none_of_its_writes(
    store: JobStore, engine: Engine
) -> None:
    # the block holds the job's row (SQLite: the write lock) while the function hangs in it:
    # the release waits for it on a thread of its own, and the block's writes roll back
    orders = Table("wk_inside", MetaData(), Column("id", String(40), primary_key=True))
    orders.create(engine, checkfirst=True)
    refused: list[BaseException] = []
    try:

        def function(job: Job) -> str:
            if job.attempt > 1:
                return "second"
            try:
                with job.completing("first") as conn:
                    conn.execute(orders.insert().values(id=job.job_id))
                    stuck_in_a_call(job, 30.0)  # told at the timeout, still inside the block
            except LeaseLost as exc:
                refused.append(exc)
            return "first, late"

        store.enqueue("inside")
        worker = Worker(store, function, ttl=TTL, timeout=0.5, retry_delay=0.05, max_retry_delay=0.05)
        _run_until(worker, lambda: store.state("inside").done)
        assert len(refused) == 1 and "ran past the worker's timeout" in str(refused[0])
        assert store.state("inside").result == "second"
        failure = store.failure("inside")
        assert failure is not None and failure.fence == 1 and "TimeoutError" in failure.text
        with engine.connect() as conn:
            assert conn.execute(select(orders.c.id)).all() == []  # rolled back with the block
    finally:
        orders.drop(engine)


def test_a_function_that_ignores_its_timeout_keeps_no_slot_from_the_other_jobs(store: JobStore) -> None:
    let_go = threading.Event()
    done: list[str] = []

    def function(job: Job) -> str:
        if job.job_id == "hangs":
            let_go.wait(30.0)  # does not look at job.lost: its thread cannot be stopped
            return "too late"
        done.append(job.job_id)
        return "ok"

    store.enqueue("hangs")
    worker = Worker(store, function, ttl=TTL, timeout=0.3, max_attempts=1)
    thread = _running(worker)
    try:
        _until(lambda: store.failure("hangs") is not None)  # timed out, the function still in it
        for n in range(3):
            store.enqueue(f"next-{n}")
        _until(lambda: len(done) == 3)  # concurrency 1, and a new slot runs them
        assert worker.running == [] and not store.state("hangs").done
    finally:
        let_go.set()
        worker.stop()
        thread.join(30.0)
    assert not thread.is_alive()
    assert store.state("hangs").result is None and store.holder("hangs") is None


def test_a_job_within_its_timeout_is_untouched(store: JobStore) -> None:
    store.enqueue("quick")
    worker = Worker(store, lambda job: time.sleep(0.05) or "ok", ttl=TTL, timeout=5.0)
    _run_until(worker, lambda: store.state("quick").done)
    assert store.failure("quick") is None and "worker.timed_out" not in _worker_counts(store)


def _worker_counts(store: Any) -> dict[str, int]:
    return {name: n for name, n in store.metrics.snapshot().items() if name.startswith("worker.")}


def test_the_worker_counts_each_jobs_outcome_on_the_stores_metrics(store: JobStore) -> None:
    lost_started = threading.Event()

    def function(job: Job) -> str:
        if job.job_id == "fails":
            raise ValueError("no")
        if job.job_id == "lost":
            lost_started.set()
            job.lost.wait(30.0)
        return "ok"

    for job_id in ("ok", "fails", "lost"):
        store.enqueue(job_id)
    worker = Worker(
        store, function, concurrency=2, ttl=TTL, max_attempts=2, retry_delay=0.05, max_retry_delay=0.05
    )
    thread = _running(worker)
    try:
        assert lost_started.wait(20.0)
        assert store.revoke("lost")  # its next renewal is refused: lost, its result not stored
        _until(lambda: _worker_counts(store).get("worker.lost") == 1)
        _until(lambda: _worker_counts(store).get("worker.poisoned") == 1 and store.state("ok").done)
    finally:
        worker.stop()
        thread.join(30.0)
    assert _worker_counts(store) == {
        "worker.started": 4,  # ok, lost, and fails twice
        "worker.completed": 1,
        "worker.retried": 1,
        "worker.poisoned": 1,
        "worker.lost": 1,
    }
    run = store.metrics.timings()["worker.run"]
    assert run.count == 4 and run.max >= run.min >= 0.0


def test_a_function_may_complete_its_job_in_its_own_transaction(store: JobStore, engine: Engine) -> None:
    orders = Table("wk_orders", MetaData(), Column("id", String(40), primary_key=True), Column("n", Integer))
    orders.create(engine, checkfirst=True)
    try:

        def function(job: Job) -> None:
            with job.completing({"stored": True}) as conn:
                conn.execute(orders.insert().values(id=job.job_id, n=job.payload))

        store.enqueue("o-1", payload=7)
        worker = Worker(store, function, ttl=TTL)
        _run_until(worker, lambda: store.state("o-1").done)
        assert json.loads(store.state("o-1").result) == {"stored": True}
        with engine.connect() as conn:
            assert conn.execute(select(orders.c.n)).all() == [(7,)]
    finally:
        orders.drop(engine)


def test_concurrency_runs_that_many_jobs_at_once(store: JobStore) -> None:
    together = threading.Barrier(3, timeout=20.0)

    def function(job: Job) -> str:
        together.wait()  # only three jobs running at once get past this
        return "ok"

    for i in range(6):
        store.enqueue(f"j{i}")
    worker = Worker(store, function, concurrency=3, ttl=TTL)
    _run_until(worker, lambda: all(store.state(f"j{i}").done for i in range(6)))
    assert not together.broken


def test_stop_lets_a_running_job_finish_within_drain(store: JobStore) -> None:
    started, go_on = threading.Event(), threading.Event()

    def function(job: Job) -> str:
        started.set()
        go_on.wait(20.0)
        return "finished"

    store.enqueue("long")
    store.enqueue("later", ready_at=time.time() + 3600)
    worker = Worker(store, function, ttl=TTL, drain=20.0)
    thread = _running(worker)
    assert started.wait(20.0)
    worker.stop()
    time.sleep(TTL)  # past one ttl: the heartbeat keeps the lease while it drains
    assert store.holder("long") is not None
    go_on.set()
    thread.join(30.0)
    assert not thread.is_alive()
    assert store.state("long").result == "finished"


def test_a_job_still_running_at_the_drain_deadline_is_handed_back(store: JobStore) -> None:
    function = _WaitsForLoss(returns="too late")
    store.enqueue("stuck")
    worker = Worker(store, function, ttl=TTL, drain=0.5)
    thread = _running(worker)
    assert function.started.wait(20.0)
    stopped = time.monotonic()
    worker.stop()
    _until(lambda: store.holder("stuck") is None)
    assert time.monotonic() - stopped < 0.5 + TTL / 3 + 2.0  # the deadline plus one heartbeat
    assert function.saw_loss.wait(20.0)
    thread.join(30.0)
    lease = store.claim("stuck", "next-worker", ttl=30.0)  # at once: handed back, not expired
    assert lease is not None and lease.fence == 2
    assert store.complete(lease, "done by the next")
    assert store.state("stuck").result == "done by the next"
    # handed back, and what it returned afterwards counted as lost, not completed
    _until(lambda: _worker_counts(store).get("worker.lost") == 1)
    assert _worker_counts(store) == {"worker.started": 1, "worker.handed_back": 1, "worker.lost": 1}


def test_stop_now_hands_back_at_once(store: JobStore) -> None:
    function = _WaitsForLoss()
    store.enqueue("now")
    worker = Worker(store, function, ttl=TTL, drain=60.0)
    thread = _running(worker)
    assert function.started.wait(20.0)
    worker.stop(now=True)
    thread.join(10.0)
    assert not thread.is_alive() and store.holder("now") is None


@pytest.mark.parametrize(
    ("arguments", "error", "says"),
    [
        ({"concurrency": 0}, InvalidArgument, "concurrency"),
        ({"concurrency": 1.5}, InvalidArgumentType, "concurrency"),
        ({"ttl": 0}, InvalidArgument, "ttl must be a finite number of seconds > 0, got 0"),
        ({"ttl": "30"}, InvalidArgumentType, "ttl must be a number of seconds, got str '30'"),
        ({"max_attempts": 0}, InvalidArgument, "max_attempts"),
        ({"retry_delay": -1}, InvalidArgument, "retry_delay must be a finite number of seconds >= 0"),
        ({"drain": float("inf")}, InvalidArgument, "drain must be a finite number of seconds >= 0"),
        ({"owner": 5}, InvalidArgumentType, "owner"),
        ({"timeout": 0}, InvalidArgument, "timeout must be a finite number of seconds > 0, got 0"),
        ({"timeout": float("nan")}, InvalidArgument, "timeout must be a finite number of seconds > 0"),
        ({"timeout": True}, InvalidArgumentType, "timeout must be a number of seconds, got bool True"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    store: JobStore, arguments: dict[str, Any], error: type[Exception], says: str
) -> None:
    store.enqueue("untouched")
    with pytest.raises(error, match=says):
        Worker(store, lambda job: None, **arguments)
    with pytest.raises(InvalidArgumentType, match="function must be callable"):
        Worker(store, "not a function")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentType, match=r"store must be a fencing\.JobStore"):
        Worker(object(), lambda job: None)  # type: ignore[arg-type]
    assert store.holder("untouched") is None and store.state("untouched").fence == 0


def test_each_job_costs_one_transaction_and_no_renewal(
    store: JobStore, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    commits: list[object] = []
    renewals: list[object] = []
    renew = store.renew
    monkeypatch.setattr(store, "renew", lambda *a, **k: renewals.append(a) or renew(*a, **k))
    for i in range(20):
        store.enqueue(f"r{i}")
    ran: list[int] = []  # the commits so far, as each job runs
    worker = Worker(store, lambda job: ran.append(len(commits)), ttl=30.0)
    counted = commits.append
    event.listen(engine, "commit", counted)
    try:
        _run_until(worker, lambda: len(ran) == 20)  # (a stopping slot still stores its last job)
    finally:
        event.remove(engine, "commit", counted)
    assert all(store.state(f"r{i}").done for i in range(20))
    # the first claim, then one step per job (its completion and the next claim): the 20th
    # job runs after 20 commits; its lease needed no renewal to start
    assert ran[-1] == 20, ran
    assert renewals == []


def test_a_heartbeat_of_a_lease_just_claimed_sends_no_first_renewal(store: JobStore) -> None:
    from fencing import Heartbeat

    store.enqueue("hb")
    before = time.monotonic()
    [lease] = store.claim_next("w", ttl=30.0)
    with pytest.raises(
        InvalidArgument, match=r"claimed_at must be time\.monotonic\(\) read before the claim"
    ):
        Heartbeat(store, lease, 30.0, claimed_at=time.monotonic() + 60.0)
    heartbeat = Heartbeat(store, lease, 30.0, claimed_at=before)
    with heartbeat:
        assert heartbeat.held and heartbeat.lease is lease  # not renewed: the claim's own lease
        assert before + 30.0 - 0.01 <= heartbeat.deadline <= before + 30.0
    assert store.complete(lease, "ok")


def test_slots_that_finish_together_share_one_transaction(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    together = threading.Barrier(4, timeout=20.0)
    batches: list[list[str]] = []
    step = store.complete_and_claim_next

    def slow_step(completions: Any, *args: Any, **kwargs: Any) -> Any:
        completions = list(completions)
        batches.append([lease.job_id for lease, _ in completions])
        if len(batches) == 1:
            time.sleep(1.0)  # the first batch on its way: the three others finish meanwhile
        return step(completions, *args, **kwargs)

    monkeypatch.setattr(store, "complete_and_claim_next", slow_step)
    for i in range(4):
        store.enqueue(f"b{i}")

    def function(job: Job) -> str:
        together.wait()  # the four finish at once
        return job.job_id

    worker = Worker(store, function, concurrency=4, ttl=TTL)
    _run_until(worker, lambda: all(store.state(f"b{i}").done for i in range(4)))
    # the first slot to finish stores its job (with any that finished as it began); those that
    # finished while it was on its way are one batch: never a transaction per job
    assert len(batches) <= 2 and sorted(itertools.chain(*batches)) == [f"b{i}" for i in range(4)], batches
    assert all(store.state(f"b{i}").result == f"b{i}" for i in range(4))


def test_a_batch_shares_its_answers_each_to_its_slot() -> None:
    from fencing import Lease
    from fencing._store.worker_rules import Handoff

    batch = [
        Handoff((Lease("a", "w", 1, 10.0), "ra"), True, threading.Event()),
        Handoff((Lease("b", "w", 1, 10.0), "rb"), False, threading.Event()),
        Handoff((Lease("c", "w", 1, 10.0), "rc"), True, threading.Event()),
        Handoff((Lease("d", "w", 1, 10.0), "rd"), True, threading.Event()),
    ]
    refused = object()
    Handoff.share(
        batch, [True, refused, True, True], [Lease("x", "w", 1, 20.0), Lease("y", "w", 1, 20.0)], 5.0
    )
    assert [h.accepted for h in batch] == [True, refused, True, True]
    # the new leases go to the slots that claim, in order; the last claimer finds none left
    assert [h.lease.job_id if h.lease else None for h in batch] == ["x", None, "y", None]
    assert {h.claimed_at for h in batch} == {5.0}
