"""fencing and the PostgreSQL queues where the database is across a network: jobs/s at a latency.

What is measured
----------------
On localhost a round trip costs ~30 µs and hides how many there are; in one cloud region it
costs 0.3-1 ms, and a worker's rate is then its round trips times that. So every system of
``benchmarks/peers.py`` on PostgreSQL (fencing ``single`` / ``step`` / ``batched``, the async
front on asyncpg, procrastinate, pgqueuer, oban: see that file for what one cycle of each is)
is run through a TCP proxy (``tests/turns_proxy.py``, a process of its own) that adds
``--delays`` milliseconds to every burst in each direction, so a round trip costs twice that
more. Each delay is a separate ``peers.py`` run (``--sizes``, ``--processes``, ``--cycles``,
``--repeat`` are passed through), against the server at ``--postgresql-url`` through the
proxy.

Before each run the round trip through the proxy is measured (``SELECT 1`` on a psycopg
connection in autocommit, the median of 200), and the table shows **the limit of one round
trip per job**, ``1 / rtt`` jobs/s for one worker: a one-at-a-time worker cannot go faster
than that, however little it does, and fencing's ``step`` is one round trip per job on
PostgreSQL (``tests/databases/test_turns.py`` counts it). Beside it, the limit with the server's own
work: **one durable commit per job**, the raw driver updating one row in autocommit (the
median of 200), which is a round trip plus the server's WAL flush: no worker that stores a
result per job goes faster.

Reproduce (peers in a venv of their own, see ``benchmarks/requirements-peers.txt``)::

    python benchmarks/latency.py                               # delays 0, 0.5 and 1 ms
    python benchmarks/latency.py --delays 1 --processes 1 --cycles 300 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "tests" / "turns_proxy.py"
PEERS = ROOT / "benchmarks" / "peers.py"
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


@contextlib.contextmanager
def proxy(upstream: str, delay_ms: float) -> Iterator[int]:
    """A proxy process in front of ``upstream`` (HOST:PORT) with ``delay_ms``: its port."""
    with subprocess.Popen(
        [sys.executable, str(PROXY), "--upstream", upstream, "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        line = process.stdout.readline()  # "listening on 127.0.0.1:PORT -> ..."
        try:
            yield int(line.split()[2].rsplit(":", 1)[1])
        finally:
            process.terminate()
            process.wait(10)


def round_trip(url: str, times: int = 200) -> float:
    """The median seconds of one round trip (``SELECT 1`` in autocommit) to ``url``."""
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        for _ in range(10):
            conn.execute("SELECT 1")
        samples = []
        for _ in range(times):
            started = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def commit_trip(url: str, times: int = 200) -> float:
    """The median seconds of the smallest durable write: one row's ``UPDATE`` in autocommit,
    its own transaction, committed (the WAL flushed, at the server's ``synchronous_commit``),
    on the raw driver. No worker that stores anything per job can go faster than one of these
    per job; with ``fsync`` on, the flush is most of it on localhost."""
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS fencing_latency_floor (id int PRIMARY KEY, n bigint NOT NULL)"
        )
        conn.execute("INSERT INTO fencing_latency_floor VALUES (1, 0) ON CONFLICT (id) DO NOTHING")
        try:
            for _ in range(10):
                conn.execute("UPDATE fencing_latency_floor SET n = n + 1 WHERE id = 1")
            samples = []
            for _ in range(times):
                started = time.perf_counter()
                conn.execute("UPDATE fencing_latency_floor SET n = n + 1 WHERE id = 1")
                samples.append(time.perf_counter() - started)
        finally:
            conn.execute("DROP TABLE fencing_latency_floor")
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--delays", default="0,0.5,1", help="one-way delays in ms (default 0,0.5,1)")
    parser.add_argument("--postgresql-url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    parser.add_argument("--sizes", default="1000", help="backlogs N, for peers.py (default 1000)")
    parser.add_argument("--processes", default="1,4", help="worker process counts (default 1,4)")
    parser.add_argument("--cycles", default="300", help="jobs measured one at a time (default 300)")
    parser.add_argument("--batched-cycles", default="2000", help="jobs measured in batches (default 2000)")
    parser.add_argument("--repeat", default="3", help="repetitions, medians reported (default 3)")
    parser.add_argument(
        "--systems",
        default="fencing,fencing-async,procrastinate,pgqueuer,oban",
        help="peers.py systems (default the PostgreSQL ones)",
    )
    args = parser.parse_args(argv)
    from sqlalchemy import make_url

    url = make_url(args.postgresql_url)
    upstream = f"{url.host or '127.0.0.1'}:{url.port or 5432}"
    for delay in (float(d) for d in args.delays.split(",")):
        with proxy(upstream, delay) as port:
            through = url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
            rtt = round_trip(through)
            commit = commit_trip(through)
            print(
                f"\n=== one-way delay {delay:g} ms: round trip {rtt * 1000:.3f} ms; "
                f"the limit of one round trip per job: {1 / rtt:,.0f} jobs/s per worker; "
                f"one durable commit (a row's UPDATE, the raw driver): {commit * 1000:.3f} ms, "
                f"{1 / commit:,.0f} jobs/s per worker ===",
                flush=True,
            )
            subprocess.run(
                [
                    sys.executable,
                    str(PEERS),
                    "--backends",
                    "postgresql",
                    "--postgresql-url",
                    through,
                    "--systems",
                    args.systems,
                    "--sizes",
                    args.sizes,
                    "--processes",
                    args.processes,
                    "--cycles",
                    args.cycles,
                    "--batched-cycles",
                    args.batched_cycles,
                    "--repeat",
                    args.repeat,
                    "--no-stale-check",
                ],
                check=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
