"""The asyncio FastAPI example (``examples/async_app``) on the tested database.

Each test drives the application through httpx's ASGI transport with its lifespan running
(so its worker tasks run too), in ``asyncio.run`` under a deadline: a hang is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

import fencing
from fencing.asyncio import AsyncJobStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_app" / "app.py"
#: the backstop for one scenario; each takes a few seconds
DEADLINE = 60.0
#: the async driver of each server backend (the suite's URLs name sync ones)
ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "mysql": "mysql+asyncmy", "mariadb": "mysql+asyncmy"}

T = TypeVar("T")


@pytest.fixture
def example(imports_kept: None) -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_app_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass and models resolve their annotations there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def url(target: str) -> str:
    """What the example's ``create_app`` takes: the SQLite file, or the server's async URL."""
    if "://" not in target:
        return target
    server = sa.make_url(target)
    return server.set(drivername=ASYNC_DRIVERS[server.get_backend_name()]).render_as_string(False)


def run(scenario: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(scenario, DEADLINE)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan (startup, workers, shutdown) and a client on it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield client


async def wait_until_done(client: httpx.AsyncClient, ids: list[str], within: float = 20.0) -> dict[str, Any]:
    """Poll ``GET /jobs/{id}`` until every job is done; their views."""
    deadline = time.monotonic() + within
    while True:
        views = {job_id: (await client.get(f"/jobs/{job_id}")).json() for job_id in ids}
        if all(view["done"] for view in views.values()):
            return views
        pending = sorted(job_id for job_id, view in views.items() if not view["done"])
        assert time.monotonic() < deadline, f"not done within {within} s: {pending}"
        await asyncio.sleep(0.05)


async def thumbnail_rows(example: ModuleType, engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        query = sa.select(example.thumbnails).order_by(example.thumbnails.c.job_id)
        return list((await conn.execute(query)).all())


def test_workers_do_every_job_once_with_one_thumbnail_each(example: ModuleType, url: str) -> None:
    ids = [f"img-{n:02d}" for n in range(20)]

    async def scenario() -> tuple[dict[str, Any], list[Any]]:
        app = example.create_app(url, workers=4, poll=0.05)
        async with serving(app) as client:
            posted = await asyncio.gather(*(client.post(f"/jobs/{job_id}") for job_id in ids))
            assert [(r.status_code, r.json()["created"]) for r in posted] == [(202, True)] * len(ids)
            again = await client.post(f"/jobs/{ids[0]}")  # enqueue is idempotent
            assert (again.status_code, again.json()) == (200, {"job_id": ids[0], "created": False})
            assert (await client.get("/jobs/img-missing")).status_code == 404
            assert (await client.get("/jobs/Not-An-Id")).status_code == 422
            views = await wait_until_done(client, ids)
            return views, await thumbnail_rows(example, app.state.engine)

    views, rows = run(scenario())
    for job_id in ids:
        assert views[job_id]["result"] == example.result_of(example.render(job_id))
    # exactly one thumbnail per job, written under the lease that completed the job
    assert [row.job_id for row in rows] == ids
    for row in rows:
        view, size = views[row.job_id], example.render(row.job_id).size
        assert (row.worker, row.fence, row.size) == (view["owner"], view["fence"], size)
    assert len({row.worker for row in rows}) > 1  # the worker tasks ran side by side


@pytest.mark.parametrize("how", ["revoked", "expired"])
def test_a_stale_workers_write_is_refused_and_the_new_owners_stands(
    example: ModuleType, url: str, how: str
) -> None:
    async def scenario() -> tuple[Any, list[Any], fencing.Lease]:
        app = example.create_app(url, workers=0)  # the test plays the workers
        async with serving(app) as client:
            store: AsyncJobStore = app.state.store
            assert (await client.post("/jobs/img-1")).status_code == 202
            [stale] = await store.claim_next("stale-worker", ttl=0.5 if how == "expired" else 30)
            if how == "revoked":
                assert await store.revoke("img-1")
            else:
                await asyncio.sleep(0.8)  # the stale worker stalls past its lease
            [current] = await store.claim_next("new-worker", ttl=30)
            assert current.fence > stale.fence
            assert await example.process(store, current, example.make_thumbnail)

            # the stale worker comes back with its own result: refused, with or without process()
            with pytest.raises(fencing.LeaseLost):
                await example.store_thumbnail(store, stale, example.Thumbnail(size=1))

            async def stale_work(job_id: str) -> Any:
                return example.Thumbnail(size=2)

            assert not await example.process(store, stale, stale_work)
            view = (await client.get("/jobs/img-1")).json()
            return view, await thumbnail_rows(example, app.state.engine), current

    view, rows, current = run(scenario())
    size = example.render("img-1").size
    assert [tuple(row) for row in rows] == [("img-1", size, "new-worker", current.fence)]
    assert (view["done"], view["owner"], view["fence"]) == (True, "new-worker", current.fence)
    assert view["result"] == example.result_of(example.Thumbnail(size))


def test_a_lease_that_expires_inside_the_write_keeps_nothing(example: ModuleType, url: str) -> None:
    """The thumbnail insert has run when the lease runs out: the block ends in LeaseLost, and the
    insert is rolled back with the completion."""
    inserted: list[str] = []

    def stall_after_insert(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO THUMBNAILS"):
            inserted.append(statement)
            time.sleep(1.5)  # past the lease's until, inside the fenced block

    async def scenario() -> tuple[Any, list[Any], Any, list[Any]]:
        app = example.create_app(url, workers=0)
        async with serving(app) as client:
            store: AsyncJobStore = app.state.store
            engine: AsyncEngine = app.state.engine
            assert (await client.post("/jobs/img-1")).status_code == 202
            [stale] = await store.claim_next("stale-worker", ttl=1.0)
            sa.event.listen(engine.sync_engine, "after_cursor_execute", stall_after_insert)
            try:
                with pytest.raises(fencing.LeaseLost):
                    await example.store_thumbnail(store, stale, example.Thumbnail(size=1))
            finally:
                sa.event.remove(engine.sync_engine, "after_cursor_execute", stall_after_insert)
            after_stale = (await client.get("/jobs/img-1")).json(), await thumbnail_rows(example, engine)
            [current] = await store.claim_next("new-worker", ttl=30)
            assert await example.process(store, current, example.make_thumbnail)
            view = (await client.get("/jobs/img-1")).json()
            return *after_stale, view, await thumbnail_rows(example, engine)

    stale_view, stale_rows, view, rows = run(scenario())
    assert len(inserted) == 1  # the stale insert did run, inside the block
    assert stale_rows == []
    assert (stale_view["done"], stale_view["result"]) == (False, None)
    assert [(row.job_id, row.worker) for row in rows] == [("img-1", "new-worker")]
    assert (view["done"], view["owner"]) == (True, "new-worker")


def test_shutdown_stops_every_worker_and_hands_unfinished_jobs_back(example: ModuleType, url: str) -> None:
    fast = [f"fast-{n:02d}" for n in range(8)]
    slow = [f"slow-{n}" for n in range(3)]  # fewer than the workers: one stays free for the fast
    in_work: set[str] = set()

    async def work(job_id: str) -> Any:
        if job_id.startswith("slow"):
            in_work.add(job_id)
            await asyncio.Event().wait()  # until cancelled
        return example.render(job_id)

    async def scenario() -> tuple[dict[str, Any], dict[str, int]]:
        before = asyncio.all_tasks()
        app = example.create_app(url, workers=4, poll=0.05, work=work)
        async with serving(app) as client:
            for job_id in fast + slow:
                assert (await client.post(f"/jobs/{job_id}")).status_code == 202
            await wait_until_done(client, fast)
            while in_work != set(slow):
                await asyncio.sleep(0.02)
            tasks, engine = list(app.state.workers), app.state.engine
            pool = engine.sync_engine.pool
        # shut down: every worker cancelled and awaited, the engine disposed
        assert len(tasks) == 4 and all(task.cancelled() for task in tasks)
        assert asyncio.all_tasks() == before
        assert engine.sync_engine.pool is not pool and (pool.checkedin(), pool.checkedout()) == (0, 0)

        # what shutdown left: the fast jobs done, the slow ones released at once, nothing half-done
        checker = example.make_engine(url)
        try:
            store = AsyncJobStore(checker, example.jobs)
            states = {job_id: await store.state(job_id) for job_id in fast + slow}
            rows = await thumbnail_rows(example, checker)
        finally:
            await checker.dispose()
        assert [row.job_id for row in rows] == fast
        assert all(states[job_id].done for job_id in fast)
        assert [(s.done, s.owner) for s in map(states.get, slow)] == [(False, None)] * 3
        # fence 1, or 2 when a worker's claim still in flight at the cancel took a job another
        # worker had just released, and gave it back too (an operation runs to its end)
        released = {job_id: states[job_id].fence for job_id in slow}
        assert set(released.values()) <= {1, 2}

        # a restarted app takes the released jobs over at once (their 30 s leases were given back)
        async with serving(example.create_app(url, workers=2, poll=0.05)) as client:
            views = await wait_until_done(client, slow, within=10.0)
        return views, released

    views, released = run(scenario())
    assert {job_id: view["fence"] for job_id, view in views.items()} == {
        j: f + 1 for j, f in released.items()
    }
