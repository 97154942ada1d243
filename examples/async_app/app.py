"""A FastAPI service with asyncio workers on ``fencing``: each job's result written exactly once.

Run it (``pip install fastapi uvicorn`` and an async driver: aiosqlite, asyncpg or asyncmy)::

    uvicorn --app-dir examples/async_app app:app                      # SQLite file async_app.db
    DATABASE_URL=postgresql+asyncpg://postgres@127.0.0.1/test uvicorn --app-dir examples/async_app app:app
    DATABASE_URL=mysql+asyncmy://root@127.0.0.1/test uvicorn --app-dir examples/async_app app:app

    curl -X POST localhost:8000/jobs/cat-42      # enqueue a thumbnail job (202; 200 if it exists)
    curl localhost:8000/jobs/cat-42              # its state, and its result once done

What to copy:

* **The library's table in the application's MetaData.** ``fencing.jobs_table(metadata)``
  next to the application's ``thumbnails`` table: one ``MetaData``, one set of migrations.
* **One ``AsyncEngine`` and one** :class:`fencing.asyncio.AsyncJobStore` **per process**,
  made in the lifespan and disposed when it ends. SQLite needs the library's engine
  (``fencing.asyncio.create_sqlite_engine``: WAL, ``BEGIN IMMEDIATE``); a server's is a plain
  ``create_async_engine(url)``.
* **N worker tasks in the lifespan** (:func:`run_worker`), each a loop of ``claim_next`` →
  the work (an ``await``, outside any transaction) → :func:`store_thumbnail`, which writes the
  ``thumbnails`` row and completes the job in ONE ``async with store.fenced(lease,
  complete=True, result=...)`` block: both commit together, and only if the lease is still
  current and live when the block ends, in the database. A worker whose lease was lost
  meanwhile (it stalled past its ``ttl``, the job was revoked, another worker took it over)
  gets ``LeaseLost`` and its row is rolled back: one thumbnail per job, always the one of the
  lease that completed it.
* **A clean shutdown**: the workers are cancelled and awaited before the engine is disposed.
  A cancelled operation keeps nothing (a cancelled fenced block none of its writes), and a
  worker cancelled while it holds a job releases it, so another process can take it at once.
  (A claim whose COMMIT was already on its way when the cancellation came may still have
  taken a job: its lease simply lapses after ``ttl``, and the job is claimed again.)

All times come from the database's clock (``now=None``), so processes on machines with
skewed clocks agree on when a lease expires. Work longer than ``ttl`` must keep its lease
alive: ``lease = await store.renew(lease, ttl=ttl)`` (a falsy ``Refusal`` once it is lost) every
``ttl / 3`` or so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Path, Request, Response, status
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import fencing
import fencing.asyncio
from fencing.asyncio import AsyncJobStore

logger = logging.getLogger("async_app")

# -- the application's tables: its own, and the library's, in one MetaData ------------------------

metadata = sa.MetaData()
jobs = fencing.jobs_table(metadata)
thumbnails = sa.Table(
    "thumbnails",
    metadata,
    sa.Column("job_id", sa.String(100), primary_key=True),  # one thumbnail per job, at most
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("worker", sa.String(200), nullable=False),  # the owner of the writing lease
    sa.Column("fence", sa.BigInteger, nullable=False),  # ... and its fence
)

#: job ids the API accepts: lower case, so that they compare alike in every database
JobId = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,99}$")]
#: a job whose work failed is claimable again after this many seconds
RETRY_DELAY = 5.0


def make_engine(database_url: str) -> AsyncEngine:
    """The application's engine: a SQLite file path (or ``sqlite:///`` URL), or an async URL."""
    if "://" in database_url:
        url = sa.make_url(database_url)
        if url.get_backend_name() != "sqlite":
            # no pool_pre_ping: SQLAlchemy 2.0.36's asyncmy adapter fails it (ping() without
            # its argument), and the store replaces a connection the server closed while idle
            return create_async_engine(url)
        database_url = url.database or ""
    return fencing.asyncio.create_sqlite_engine(database_url)


# -- the work -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thumbnail:
    size: int


def render(job_id: str) -> Thumbnail:
    """The thumbnail of a job, computed (a stand-in for the real thing)."""
    return Thumbnail(size=1000 + zlib.crc32(job_id.encode()) % 9000)


def result_of(thumbnail: Thumbnail) -> str:
    """What the job's ``result`` says once done."""
    return f"thumbnail of {thumbnail.size} bytes"


async def make_thumbnail(job_id: str) -> Thumbnail:
    """The slow part (an upstream call, say): awaited outside any transaction."""
    await asyncio.sleep(0.05)
    return render(job_id)


Work = Callable[[str], Awaitable[Thumbnail]]


# -- a worker -----------------------------------------------------------------------------------


async def store_thumbnail(store: AsyncJobStore, lease: fencing.Lease, thumbnail: Thumbnail) -> None:
    """Write the job's thumbnail and complete the job, in ONE transaction, fenced by ``lease``.

    Both commit, or neither does: if ``lease`` is not the job's current, live lease when the
    block starts or when it ends, :class:`fencing.LeaseLost` is raised and the row is rolled back.
    """
    async with store.fenced(lease, complete=True, result=result_of(thumbnail)) as conn:
        await conn.execute(
            thumbnails.insert().values(
                job_id=lease.job_id, size=thumbnail.size, worker=lease.owner, fence=lease.fence
            )
        )


async def process(store: AsyncJobStore, lease: fencing.Lease, work: Work) -> bool:
    """Do one claimed job; whether this lease completed it.

    A lost lease is not an error (another worker owns the job now, and its write stands); failed
    work is handed back for a retry after :data:`RETRY_DELAY`; on cancellation (shutdown) the
    job is released, claimable again at once (a no-op if the job was completed already).
    """
    try:
        try:
            thumbnail = await work(lease.job_id)
        except Exception:
            logger.exception("work on %s failed; retrying in %s s", lease.job_id, RETRY_DELAY)
            await store.release(lease, delay=RETRY_DELAY)
            return False
        await store_thumbnail(store, lease, thumbnail)
        return True
    except fencing.LeaseLost:
        logger.info("lease on %s (fence %d) lost: its write was rolled back", lease.job_id, lease.fence)
        return False
    except asyncio.CancelledError:
        with contextlib.suppress(fencing.FencingError):
            await store.release(lease)
        raise


async def run_worker(store: AsyncJobStore, name: str, *, ttl: float, poll: float, work: Work) -> None:
    """One worker task: claim the next ready job and process it, forever. It ends only when
    cancelled; any other error is logged and the loop goes on (a lease it held lapses after
    ``ttl``, and the job is claimed again)."""
    while True:
        try:
            leases = await store.claim_next(name, ttl=ttl)
            for lease in leases:
                await process(store, lease, work)
        except Exception:
            logger.exception("%s: retrying after an error", name)
            leases = []
        if not leases:
            await asyncio.sleep(poll)  # the queue is empty: ask again later


# -- the HTTP API -------------------------------------------------------------------------------


class JobView(BaseModel):
    job_id: str
    done: bool
    result: str | None
    owner: str | None
    fence: int


class Enqueued(BaseModel):
    job_id: str
    created: bool


def get_store(request: Request) -> AsyncJobStore:
    store: AsyncJobStore = request.app.state.store
    return store


Store = Annotated[AsyncJobStore, Depends(get_store)]


def create_app(
    database_url: str | None = None,
    *,
    workers: int = 4,
    ttl: float = 30.0,
    poll: float = 0.25,
    work: Work = make_thumbnail,
) -> FastAPI:
    """The application on ``database_url`` (default: ``$DATABASE_URL``, else the SQLite file
    ``async_app.db``), with ``workers`` worker tasks holding leases of ``ttl`` seconds and
    asking for work every ``poll`` seconds while the queue is empty.

    The lifespan creates the tables if missing (an application with migrations runs them
    instead), starts the workers, and on shutdown cancels and awaits every one of them before
    disposing the engine: no task is left running and no connection left open.
    """
    url = database_url or os.environ.get("DATABASE_URL", "async_app.db")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(url)
        try:
            store = AsyncJobStore(engine, jobs)
            await store.create_table()  # idempotent; refuses an existing table that differs
            async with engine.begin() as conn:
                await conn.run_sync(metadata.create_all, tables=[thumbnails])
            app.state.engine, app.state.store = engine, store
            prefix = f"{socket.gethostname()}:{os.getpid()}"
            app.state.workers = [
                asyncio.create_task(
                    run_worker(store, f"{prefix}:w{i}", ttl=ttl, poll=poll, work=work), name=f"worker-{i}"
                )
                for i in range(workers)
            ]
            try:
                yield
            finally:
                for task in app.state.workers:
                    task.cancel()
                await asyncio.gather(*app.state.workers, return_exceptions=True)
        finally:
            await engine.dispose()

    app = FastAPI(title="thumbnails, fenced", lifespan=lifespan)

    @app.post("/jobs/{job_id}", status_code=status.HTTP_202_ACCEPTED)
    async def enqueue(job_id: JobId, store: Store, response: Response) -> Enqueued:
        """Enqueue a job (202); an id that exists already is left as it is (200)."""
        created = await store.enqueue(job_id)
        if not created:
            response.status_code = status.HTTP_200_OK
        return Enqueued(job_id=job_id, created=created)

    @app.get("/jobs/{job_id}")
    async def show(job_id: JobId, store: Store) -> JobView:
        """The job as the database has it now; ``result`` is set once it is done."""
        state = await store.state(job_id)
        if state is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
        return JobView(
            job_id=state.job_id, done=state.done, result=state.result, owner=state.owner, fence=state.fence
        )

    return app


app = create_app()
