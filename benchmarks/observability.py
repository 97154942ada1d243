"""What watching the store costs: the ``claim_next -> complete`` cycle with and without it.

What is measured
----------------
One process, one thread, one store at a time: N jobs are enqueued (not timed), then the
cycle ``[lease] = store.claim_next("w", ttl=600)``, ``store.complete(lease, "r")`` runs
until they are all done; cycles/s = N / that time. Every variant (:data:`VARIANTS`, one
entry each) is the same cycle on its own store object over the same engine and table:

``default``
    the library as installed (the yardstick): ``store.metrics`` counting and timing, the ``fencing``
    logger with its ``NullHandler`` only;
``metrics off``
    ``store.metrics`` (and its runner's) replaced by an object whose methods do nothing:
    the cost of counting and timing is the ratio of ``default`` to this;
``WARNING handler``
    a ``StreamHandler`` (to a null stream) on ``fencing`` at WARNING, as an application
    that logs would have; an accepted cycle writes no line, so this measures the level
    checks;
``DEBUG handler``
    the same at DEBUG: every record the library makes is formatted and written (in a
    cycle without lock races there is none either);
``history``
    the ownership history on (:class:`fencing.History`, ``retention=None``): each claim and
    each completion also writes a history row, in its own transaction (an ``INSERT`` more
    in each);
``otel``
    :func:`fencing.otel.instrument` on an SDK ``MeterProvider`` with an in-memory reader
    (collected once per round, outside the timing): the export reads ``store.metrics``
    only when collected, so the cycle does nothing more (skipped without the SDK).

Variants are interleaved finely, because the machine's load changes from second to second:
a round enqueues ``--jobs`` jobs per variant, then runs blocks of ``--block`` cycles, each
variant in turn (the order rotated from block to block), switching the variant on before
its block and off after it (untimed), until every variant has done its jobs. Each round
gives each variant's ratio to ``default`` (time per cycle over the round); the table shows
the median cycles/s and the median (and range) of those ratios over ``--rounds`` rounds.
Below it, ``metrics calls`` is the metrics' own work per cycle measured alone (``claimed``
and ``accepted``, as the store calls them), in microseconds.

Backends: SQLite (``fencing.create_sqlite_engine`` on a file in a temporary directory
under the working directory, the library's default durability: every commit fsynced;
``--durability normal``: no fsync, so the store's own CPU is a larger share), or ``--url`` (a server, on a
table ``bench_obs_<pid>`` dropped at the end).

Reproduce
---------
::

    python benchmarks/observability.py                      # SQLite, 2000 jobs x 7 rounds
    python benchmarks/observability.py --durability normal
    python benchmarks/observability.py --url postgresql+psycopg://postgres@127.0.0.1:5432/test
    python benchmarks/observability.py --url mysql+pymysql://root@127.0.0.1:3306/test

A new variant (e.g. the ownership history) is one more :class:`Variant` in
:data:`VARIANTS`: a name and a function that prepares a store (and returns a cleanup).
"""

from __future__ import annotations

import io
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy
from harness import cli, db, report
from harness.measure import rotated
from sqlalchemy import Engine, MetaData, Table

import fencing
from fencing import History, JobStore, history_table
from fencing._runtime.metrics import StoreMetrics
from fencing._sql.values import Lease
from fencing._store.history import Recorder


class NoMetrics(StoreMetrics):
    """Counts nothing: the store's calls into it cost a method call each, no more."""

    __slots__ = ()

    def add(self, name: str, n: int = 1) -> None:
        pass

    def time(self, name: str, seconds: float) -> None:
        pass

    def claimed(self, leases: Sequence[Lease], started: float) -> None:
        pass

    def claim(self, lease: Lease | None, started: float) -> None:
        pass

    def accepted(self, path: str, lease: tuple[str, int] | None = None) -> None:
        pass

    def refusal(self, refusal: Any) -> None:
        pass

    def ended(self, path: str, job_id: str) -> None:
        pass


Cleanup = Callable[[], None]


@dataclass(frozen=True)
class Variant:
    name: str
    #: prepares a fresh store for this variant; returns what undoes it (after the run)
    prepare: Callable[[JobStore], Cleanup]
    #: made at most once per round, outside the timing (e.g. an exporter's collection)
    after_round: Callable[[], None] | None = None


def _nothing(store: JobStore) -> Cleanup:
    return lambda: None


def _metrics_off(store: JobStore) -> Cleanup:
    metrics = store.metrics
    store.metrics = NoMetrics()  # the setter reaches the runner too

    def undo() -> None:
        store.metrics = metrics

    return undo


def _handler(level: int) -> Callable[[JobStore], Cleanup]:
    def prepare(store: JobStore) -> Cleanup:
        logger = logging.getLogger("fencing")
        handler = logging.StreamHandler(io.StringIO())
        handler.setLevel(level)
        before = logger.level
        logger.setLevel(level)
        logger.addHandler(handler)

        def undo() -> None:
            logger.removeHandler(handler)
            logger.setLevel(before)

        return undo

    return prepare


#: the history tables the ``history`` variant made, by engine (dropped with the jobs table)
_HISTORY_TABLES: dict[int, Table] = {}


def _history(store: JobStore) -> Cleanup:
    """The ownership history switched on for this store (as ``history=`` would at
    construction); the table made once per engine, untimed."""
    table = _HISTORY_TABLES.get(id(store.engine))
    if table is None:
        table = history_table(MetaData(), f"bench_obs_history_{os.getpid()}")
        table.create(store.engine, checkfirst=True)
        _HISTORY_TABLES[id(store.engine)] = table
    store._ctx.recorder = Recorder(History(table, retention=None), store.table)

    def undo() -> None:
        store._ctx.recorder = None

    return undo


def _otel_variant() -> Variant | None:
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        from fencing.otel import instrument
    except ImportError:
        return None
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])

    def prepare(store: JobStore) -> Cleanup:
        return instrument(store, provider).remove

    return Variant("otel", prepare, after_round=lambda: reader.get_metrics_data() and None)


def variants() -> list[Variant]:
    found = [
        Variant("default", _nothing),
        Variant("metrics off", _metrics_off),
        Variant("WARNING handler", _handler(logging.WARNING)),
        Variant("DEBUG handler", _handler(logging.DEBUG)),
        Variant("history", _history),
    ]
    otel = _otel_variant()
    if otel is not None:
        found.append(otel)
    return found


#: the variants measured; the first is what the others are compared with
VARIANTS = variants()


@contextmanager
def backend(url: str | None, durability: str) -> Iterator[tuple[Engine, Table, str]]:
    if url is None:
        with db.workdir(None, ".") as where:
            path = os.path.join(where, "obs.db")
            engine = fencing.create_sqlite_engine(path, durability=durability)  # type: ignore[arg-type]
            try:
                yield engine, fencing.jobs, f"sqlite ({durability}) {path}"
            finally:
                engine.dispose()
        return
    engine = sqlalchemy.create_engine(url)
    table = fencing.jobs_table(MetaData(), f"bench_obs_{os.getpid()}")
    try:
        yield engine, table, engine.url.render_as_string(hide_password=True)
    finally:
        table.drop(engine, checkfirst=True)
        history = _HISTORY_TABLES.pop(id(engine), None)
        if history is not None:
            history.drop(engine, checkfirst=True)
        engine.dispose()


def fill(engine: Engine, table: Table, n: int, round_no: int) -> None:
    with engine.begin() as conn:
        conn.execute(table.delete())
        db.insert_ids(conn, table, (f"r{round_no}-{i:07d}" for i in range(n)))


def cycle(store: JobStore, n: int) -> float:
    """Seconds to claim and complete ``n`` jobs, one at a time."""
    started = time.perf_counter()
    for _ in range(n):
        [lease] = store.claim_next("w", ttl=600.0)
        assert store.complete(lease, "r")
    return time.perf_counter() - started


def metrics_cost(repeat: int = 200_000) -> float:
    """Microseconds of the metrics' own work per accepted cycle, as the store calls it."""
    m = StoreMetrics()
    lease = Lease("job-000001", "w", 1, 0.0)
    leases = [lease]
    started = time.perf_counter()
    for _ in range(repeat):
        m.claimed(leases, time.perf_counter())
        m.accepted("complete", (lease.job_id, lease.fence))
    return (time.perf_counter() - started) / repeat * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--url", help="a PostgreSQL or MariaDB URL (default: a SQLite file)")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per variant per round")
    cli.add_rounds(parser, 7)
    parser.add_argument("--block", type=int, default=50, help="cycles a variant runs in a row")
    cli.add_durability(parser, "full", help="SQLite only")
    args = parser.parse_args(argv)

    with backend(args.url, args.durability) as (engine, table, described):
        JobStore(engine, table).create_table()
        print(f"{described}: {args.jobs} jobs x {args.rounds} rounds, claim_next(limit=1) -> complete")
        rates: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
        ratios: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
        stores = {v.name: JobStore(engine, table) for v in VARIANTS}
        # warm up: statements compiled, a pooled connection made
        fill(engine, table, 50 * len(VARIANTS), -1)
        for v in VARIANTS:
            cycle(stores[v.name], 50)
        blocks = -(-args.jobs // args.block)
        for r in range(args.rounds):
            fill(engine, table, blocks * args.block * len(VARIANTS), r)
            seconds = dict.fromkeys(rates, 0.0)
            for b in range(blocks):
                for variant in rotated(VARIANTS, r + b):
                    undo = variant.prepare(stores[variant.name])
                    try:
                        seconds[variant.name] += cycle(stores[variant.name], args.block)
                    finally:
                        undo()
            for v in VARIANTS:
                if v.after_round is not None:
                    v.after_round()
            base = seconds[VARIANTS[0].name]
            for name, s in seconds.items():
                rates[name].append(blocks * args.block / s)
                ratios[name].append(base / s)  # > 1: faster than the default
        summary = report.Table(
            report.Column("variant", 18, "<"),
            report.Column("cycles/s", 9, spec=".0f"),
            report.Column("vs " + VARIANTS[0].name, 12, spec=".3f"),
            report.Column("range", 13),
        )
        print(summary.header())
        for v in VARIANTS:
            rate, ratio = statistics.median(rates[v.name]), statistics.median(ratios[v.name])
            print(summary.row(v.name, rate, ratio, report.spread(ratios[v.name], ".3f")))
        print(f"metrics calls: {metrics_cost():.2f} us per cycle (alone, one thread)")


if __name__ == "__main__":
    main()
