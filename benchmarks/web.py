"""The web face: page render times at 100,000 jobs, HTTP lease cycles against the store, the feed's reads.

What is measured
----------------
**Pages at a realistic size.** A jobs table of ``--jobs`` (100,000) rows: a tenth done, a
tenth held, a hundredth deferred, the rest ready (ids ``job-0000000``...). Each page of
:func:`fencing.web.dashboard` is requested ``--requests`` times through Starlette's
in-process client (the server's work: queries and rendering, no network), median and p95
in milliseconds: the overview (its snapshot read each time: the summary is one pass over the
table), the first page of every state, the ready jobs' first page, a page deep in them (after
a cursor at the middle), a prefix matching 100 ids, one job with its history.

**HTTP lease cycles.** One client (``httpx``, one kept-alive connection) runs claim ->
complete through the lease API of ``fencing serve`` (its own process, uvicorn) on this
machine, for ``--seconds``;
beside it, the same cycle called on the store directly (``claim_next`` then ``complete``).
Cycles/s and the ratio: what HTTP and JSON add to the store's two transactions.

**The shared feed.** ``--streams`` (50) event streams stay open on the dashboard for
``--feed-seconds``; the database reads the feed made over that time, against the intervals
that passed (one read per interval is the target, however many watch).

Reproduce (``pip install -e .[web,postgresql,mysql,test]``)::

    python benchmarks/web.py                                    # SQLite, PostgreSQL, MariaDB
    python benchmarks/web.py --only sqlite --jobs 100000
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
from harness import cli, env
from harness.report import percentile, write_json
from sqlalchemy import Engine, MetaData, bindparam, create_engine, insert, literal, type_coerce, update

import fencing
from fencing import History, JobStore, history_table
from fencing._sql.schema import KEY_TYPE
from fencing.web import dashboard

TOKEN = "benchmark-token-0123456789"


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)


def engine_for(name: str, url: str | None, scratch: str) -> Engine:
    if name == "sqlite":
        return fencing.create_sqlite_engine(os.path.join(scratch, "web.db"))
    return create_engine(url)  # type: ignore[arg-type]


def fresh(engine: Engine) -> tuple[JobStore, Any]:
    history = history_table(MetaData())
    with engine.begin() as conn:
        fencing.jobs.drop(conn, checkfirst=True)
        history.drop(conn, checkfirst=True)
    history.create(engine)
    store = JobStore(engine, history=History(history, retention=None))
    store.create_table()
    return store, history


def load(engine: Engine, store: JobStore, jobs: int) -> None:
    t = store.table
    now = time.time()
    rows = [{"k": f"job-{n:07d}", "u": 1000.0 + n / 1000} for n in range(jobs)]
    add = insert(t).values(id=bindparam("k", type_=KEY_TYPE), until=bindparam("u"))
    with engine.begin() as conn:
        for at in range(0, jobs, 10_000):
            conn.execute(add, rows[at : at + 10_000])
        key = bindparam("k", type_=KEY_TYPE)
        by_id = type_coerce(t.c.id, KEY_TYPE) == key  # the id as the store binds it (MariaDB: bytes)
        conn.execute(
            update(t).where(by_id).values(done=1, result="r", fence=1),
            [{"k": f"job-{n:07d}"} for n in range(0, jobs, 10)],
        )
        conn.execute(
            update(t).where(by_id).values(owner=literal("w", KEY_TYPE), fence=1, until=now + 3600),
            [{"k": f"job-{n:07d}"} for n in range(1, jobs, 10)],
        )
        conn.execute(
            update(t).where(by_id).values(until=now + 3600),
            [{"k": f"job-{n:07d}"} for n in range(2, jobs, 100)],
        )
    analyze = {"sqlite": "ANALYZE", "postgresql": f"ANALYZE {t.name}"}.get(
        engine.dialect.name, f"ANALYZE TABLE {t.name}"
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(analyze)


def pages(
    engine: Engine, store: JobStore, history: Any, jobs: int, requests: int
) -> dict[str, dict[str, float]]:
    from starlette.testclient import TestClient

    from fencing.overview import Overview

    middle = Overview(engine).job(f"job-{jobs // 2 + 3:07d}")
    assert middle is not None
    store.enqueue("timeline")
    store.claim_next("w", ttl=60)  # a timeline of one claim on the job page
    app = dashboard(engine, history=history, interval=0.05)
    feed = app.state.dashboard.feed
    urls = {
        "overview (one pass)": "/",
        "jobs, every state": "/jobs",
        "ready jobs": "/jobs?state=ready",
        "ready jobs, deep page": f"/jobs?state=ready&after={middle.cursor.text()}",
        "prefix of 100 ids": f"/jobs?prefix=job-{jobs // 2 // 100:05d}",
        "one job + history": "/job?id=timeline",
    }
    figures: dict[str, dict[str, float]] = {}
    with TestClient(app) as client:
        for name, url in urls.items():
            times = []
            for _ in range(requests):
                feed.snapshot = None  # the overview reads its snapshot anew each time
                started = time.perf_counter()
                answer = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
                assert answer.status_code == 200, answer.text[:300]
            figures[name] = {"median_ms": statistics.median(times), "p95_ms": percentile(times, 0.95)}
    return figures


@contextlib.contextmanager
def serving(where: str, scratch: str) -> Iterator[str]:
    """``fencing serve`` on ``where`` (a SQLite path or a URL) with the API at ``/api``."""
    tokens = os.path.join(scratch, "tokens")
    with open(tokens, "w") as f:
        f.write(f"{TOKEN} bench\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        sys.executable,
        "-m",
        "fencing",
        "serve",
        "--url",
        where,
        "--port",
        str(port),
        "--api-tokens",
        tokens,
    ]
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/api/openapi.json", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("fencing serve did not start") from None
                    time.sleep(0.1)
            yield f"http://127.0.0.1:{port}/api"
        finally:
            proc.terminate()
            proc.wait(15)


def cycles(engine: Engine, store: JobStore, seconds: float, where: str, scratch: str) -> dict[str, float]:
    with engine.begin() as conn:
        conn.execute(store.table.delete())
    count = 200_000
    with engine.begin() as conn:
        add = insert(store.table).values(id=bindparam("k", type_=KEY_TYPE))
        for at in range(0, count, 10_000):
            conn.execute(add, [{"k": f"c-{n:07d}"} for n in range(at, at + 10_000)])
    plain = JobStore(engine)

    def direct() -> int:
        done, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            [lease] = plain.claim_next("direct", ttl=30)
            assert plain.complete(lease, "r")
            done += 1
        return done

    started = time.perf_counter()
    n = direct()
    direct_rate = n / (time.perf_counter() - started)
    # the API in a process of its own, as it is deployed (`fencing serve`), so client and
    # server do not share one interpreter's lock
    with (
        serving(where, scratch) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as http,
    ):
        done, started = 0, time.perf_counter()
        end = started + seconds
        while time.perf_counter() < end:
            [lease] = http.post("/claim", json={"owner": "http", "ttl": 30}).json()["leases"]
            answer = http.post("/complete", json={"lease": lease, "result": "r"})
            assert answer.status_code == 200
            done += 1
        http_rate = done / (time.perf_counter() - started)
    return {"direct": direct_rate, "http": http_rate, "ratio": http_rate / direct_rate}


def feed_reads(engine: Engine, streams: int, seconds: float, interval: float) -> dict[str, float]:
    app = dashboard(engine, interval=interval)
    feed = app.state.dashboard.feed

    async def watch(url: str) -> None:
        async with (
            httpx.AsyncClient(base_url=url, timeout=None) as client,
            client.stream("GET", "/events") as answer,
        ):
            async for _ in answer.aiter_lines():
                pass

    async def run(url: str) -> None:
        tasks = [asyncio.create_task(watch(url)) for _ in range(streams)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with served(app) as url:
        before, started = feed.reads, time.perf_counter()
        asyncio.run(run(url))
        elapsed = time.perf_counter() - started
        reads = feed.reads - before
    return {"streams": streams, "seconds": elapsed, "reads": reads, "intervals": elapsed / interval}


def main() -> int:
    parser = cli.parser(__doc__)
    cli.add_server_urls(parser)
    parser.add_argument("--only", choices=["sqlite", "postgresql", "mariadb"], action="append")
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=10.0, help="of each lease-cycle run")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--feed-seconds", type=float, default=10.0)
    cli.add_json(parser)
    args = parser.parse_args()
    backends = {"sqlite": None, **cli.server_urls(args)}
    chosen = args.only or list(backends)
    print(env.versions("fencing", "sqlalchemy", "starlette", "uvicorn", "httpx", missing="omit"))
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fencing-web-") as scratch:
        for name in chosen:
            engine = engine_for(name, backends[name], scratch)
            try:
                store, history = fresh(engine)
                load(engine, store, args.jobs)
                got = {"pages": pages(engine, store, history, args.jobs, args.requests)}
                got["feed"] = feed_reads(engine, args.streams, args.feed_seconds, 1.0)
                where = backends[name] or os.path.join(scratch, "web.db")
                got["cycles"] = cycles(engine, store, args.seconds, where, scratch)
                figures[name] = got
            finally:
                engine.dispose()
            print(f"\n{name}: pages at {args.jobs:,} jobs (ms, median / p95)")
            for page, t in got["pages"].items():
                print(f"  {page:<28} {t['median_ms']:8.1f} {t['p95_ms']:8.1f}")
            c, f = got["cycles"], got["feed"]
            http, direct = f"{c['http']:,.0f}/s over HTTP", f"{c['direct']:,.0f}/s on the store"
            print(f"  claim -> complete: {http}, {direct} ({c['ratio']:.2f})")
            reads = f"{f['reads']} reads in {f['intervals']:.1f} intervals"
            print(f"  feed: {f['streams']} streams for {f['seconds']:.1f} s: {reads}")
    if args.json:
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
