"""Who holds leases (:meth:`fencing.overview.Overview.holders`), on the database under test.

Each owner with live leases, the number of jobs it holds and when its leases end, the most
jobs first, on the database's clock: what the dashboard shows as the busy workers. An
expired lease, a deferred job, a done one and a deleted one are held by nobody.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine

from fencing import InvalidArgument, InvalidArgumentType, Job, JobStore, Worker
from fencing.overview import Overview

pytestmark = pytest.mark.sync_only("the overview reads through a sync engine")


def test_holders_are_the_owners_of_live_leases_the_most_jobs_first(store: JobStore, engine: Engine) -> None:
    for n in range(6):
        store.enqueue(f"j{n}")
    store.enqueue("later", ready_at=time.time() + 600)  # deferred: nobody holds it
    first = store.claim_next("worker-b", ttl=60, limit=1)
    second = store.claim_next("worker-a", ttl=120, limit=3)
    assert len(first) == 1 and len(second) == 3
    assert len(store.claim_next("worker-c", ttl=0.2)) == 1  # runs out: then held by nobody
    assert store.complete(second[0], "done")  # done: no longer held
    ov = Overview(engine, store.table)
    holders = ov.holders()
    assert [(h.owner, h.jobs) for h in holders] == [("worker-a", 2), ("worker-b", 1), ("worker-c", 1)]
    a = holders[0]
    assert a.first_until == min(lease.until for lease in second[1:])
    assert a.last_until == max(lease.until for lease in second[1:])
    assert 100 < a.first_until_in <= 120  # on the database's clock
    assert a.as_json()["first_until_in"] == a.first_until_in
    time.sleep(0.3)
    assert [h.owner for h in ov.holders()] == ["worker-a", "worker-b"]  # worker-c's lease ran out
    assert [h.owner for h in ov.holders(limit=1)] == ["worker-a"]
    assert store.delete(first[0].job_id)
    assert [h.owner for h in ov.holders()] == ["worker-a"]


def test_no_lease_held_is_no_holder(store: JobStore, engine: Engine) -> None:
    store.enqueue("waiting")
    assert Overview(engine, store.table).holders() == []


@pytest.mark.parametrize(
    ("limit", "error"), [(0, InvalidArgument), ("5", InvalidArgumentType), (True, InvalidArgumentType)]
)
def test_a_bad_limit_is_refused(engine: Engine, store: JobStore, limit: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="limit"):
        Overview(engine, store.table).holders(limit=limit)


def test_a_running_worker_is_a_holder_under_its_owner_name(store: JobStore, engine: Engine) -> None:
    started, finish = threading.Barrier(3), threading.Event()

    def function(job: Job) -> None:
        started.wait(20.0)
        finish.wait(20.0)

    for n in range(3):
        store.enqueue(f"w{n}")
    worker = Worker(store, function, concurrency=2, ttl=30.0, owner="host-1:42:abc")
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    try:
        started.wait(20.0)
        [holder] = Overview(engine, store.table).holders()
        assert (holder.owner, holder.jobs) == ("host-1:42:abc", 2)
    finally:
        worker.stop()  # first: the slots claim nothing more once their jobs finish
        finish.set()
        thread.join(30.0)
    assert Overview(engine, store.table).holders() == []
