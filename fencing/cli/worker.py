"""``fencing worker MODULE:FUNCTION``: run a function for each job (:class:`fencing.Worker`,
or :class:`fencing.asyncio.AsyncWorker` for an ``async def`` function).

The function is imported as ``uvicorn`` and ``celery`` import theirs: ``MODULE`` from the
current directory (or ``sys.path``), then ``FUNCTION`` (dots allowed: ``tasks:Mailer.send``).
It is called with a :class:`fencing.Job` (``job.payload`` holds the job's arguments). An
``async def`` function is awaited with a :class:`fencing.asyncio.AsyncJob`, ``--concurrency``
tasks of one loop, on the async driver of the URL's database (aiosqlite, psycopg's async mode
or asyncpg, asyncmy or aiomysql: installed with their extra). One line
per job is logged at INFO on stderr (``--log-level`` to change it). SIGTERM or Ctrl-C drains:
no new claims, running jobs finish within ``--drain`` seconds, the rest are handed back; a
second signal hands them back at once. The exit code is 0 once stopped so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Engine, MetaData

from .._dialects import by_name
from .._errors import FencingError
from .._sql.schedules import schedules_table
from .._store.schedule import Schedule
from .._store.scheduler import Scheduler
from .._store.worker import Worker
from ._database import Database, Failed, add_command
from ._options import Commands, add_max_attempts, add_side_tables, at_least, whole
from ._output import Output

__all__ = ["add_worker", "load_function", "load_schedules"]

#: the options that count: flag, default, most, what it is
_COUNTS = (("--concurrency", 1, 1024, "jobs at once"),)
#: the worker's max_attempts when neither --max-attempts nor $FENCING_MAX_ATTEMPTS says
MAX_ATTEMPTS = 5
#: the options in seconds: flag, least, default, what it is
_SECONDS = (
    ("--ttl", 0.05, 30.0, "each lease's length"),
    ("--retry-delay", 0.0, 1.0, "a failed job's first retry delay, doubled each attempt"),
    ("--max-retry-delay", 0.0, 300.0, "the longest retry delay"),
    ("--drain", 0.0, 30.0, "how long running jobs may finish after SIGTERM"),
)


def add_worker(commands: Commands) -> None:
    parser = add_command(
        commands,
        "worker",
        work,
        help="run a function for each job, N at a time, until SIGTERM (fencing.Worker)",
        description="Run MODULE:FUNCTION for each ready job, --concurrency at a time: each job is "
        "claimed (woken by an enqueue), its lease kept alive while the function runs, and what the "
        "function returns stored fenced as the job's result (a str as it is, anything else as "
        "JSON). A function that raises is retried with backoff and its traceback kept in the "
        "failures table; the attempt at --max-attempts leaves the job poisoned. SIGTERM or Ctrl-C "
        "drains (running jobs finish within --drain seconds, the rest are handed back); a second "
        "signal hands back at once.",
    )
    parser.add_argument(
        "function",
        metavar="MODULE:FUNCTION",
        help="the function to call with each fencing.Job (an async def one: awaited with each "
        "fencing.asyncio.AsyncJob), imported from the current directory",
    )
    for flag, default, most, what in _COUNTS:
        count = whole(1, most)
        parser.add_argument(flag, type=count, default=default, metavar="N", help=f"{what} (%(default)s)")
    add_max_attempts(parser, "claims of a job before it is left poisoned", fallback=MAX_ATTEMPTS)
    for name, least, initial, said in _SECONDS:
        seconds = at_least(least)
        parser.add_argument(
            name, type=seconds, default=initial, metavar="SECONDS", help=f"{said} (%(default)g)"
        )
    parser.add_argument(
        "--timeout",
        type=at_least(0.05),
        default=None,
        metavar="SECONDS",
        help="how long a function may run a job before the job is released as a failed attempt, "
        "with the function's stack as its failure (default: no limit)",
    )
    parser.add_argument("--owner", metavar="NAME", help="the leases' owner (default: host:pid:random)")
    parser.add_argument(
        "--schedules",
        metavar="MODULE:NAME",
        help="a list of fencing.Schedule this worker keeps (each tick one job, however many "
        "workers keep them), in the schedules table --schedules-table",
    )
    parser.add_argument(
        "--schedules-table",
        default="fencing_schedules",
        metavar="NAME",
        help="where the schedules' progress is kept (%(default)s; created if missing)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="what is logged on stderr (%(default)s: a line per job)",
    )
    add_side_tables(parser)


def work(args: argparse.Namespace, db: Database, out: Output) -> int:
    function = load_function(args.function)
    store = db.beside(args.payloads_table, args.failures_table)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings: dict[str, Any] = {
        "concurrency": args.concurrency,
        "ttl": args.ttl,
        "max_attempts": args.max_attempts,
        "retry_delay": args.retry_delay,
        "max_retry_delay": args.max_retry_delay,
        "drain": args.drain,
        "owner": args.owner,
        "timeout": args.timeout,
    }
    if args.schedules is not None:
        schedules = load_schedules(args.schedules)
        kept = schedules_table(MetaData(), args.schedules_table, schema=store.table.schema)
        try:
            scheduler = Scheduler(store, schedules, table=kept)
        except FencingError as exc:
            raise Failed(f"{args.schedules}: {exc}") from None
        scheduler.create_table()
        settings["schedules"] = scheduler
    if not _is_async(function):
        worker = Worker(store, function, **settings)
        with _signals_stop(worker):
            worker.run()
        return 0
    from ..asyncio import AsyncJobStore, AsyncWorker  # (its import is the async front's alone)

    engine = async_engine_for(db.engine)

    async def main() -> None:
        try:
            async_store = AsyncJobStore(engine, store.table, payloads=store.payloads, failures=store.failures)
            worker = AsyncWorker(async_store, function, **settings)
            with _signals_stop(worker):
                await worker.run()
        finally:
            await engine.dispose()

    asyncio.run(main())
    return 0


@contextlib.contextmanager
def _signals_stop(worker: Any) -> Iterator[None]:
    """SIGTERM and SIGINT stop ``worker`` whenever they come. While it runs, its own handlers
    take them (drain, then hand back); before it took them (during start-up) these stop it as
    soon as it runs; once it returned, the process only exits, and the signals are ignored: a
    second SIGTERM as it exits met the default action before (exit -15 for a worker that had
    stopped cleanly), and Python puts that back for a handler of its own as it finalizes."""
    if threading.current_thread() is not threading.main_thread():  # (signals reach it alone)
        yield
        return

    def on_signal(signum: int, frame: object) -> None:
        worker.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)


def _is_async(function: object) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004 - an object with async __call__
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def async_engine_for(engine: Engine) -> Any:
    """An ``AsyncEngine`` on the database of ``engine`` (an ``async def`` function's worker),
    through the first installed async driver of its dialect; a :class:`Failed` that names the
    extra to install otherwise."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from ..asyncio import create_sqlite_engine

    url = engine.url
    backend = url.get_backend_name()
    dialect = by_name(backend)
    for driver in dialect.async_drivers:
        try:
            importlib.import_module(driver)
        except ImportError:
            continue
        if dialect.is_file:  # the library's own engine: its BEGIN IMMEDIATE glue
            return create_sqlite_engine(url.database or "")
        return create_async_engine(url.set(drivername=f"{backend}+{driver}"), pool_pre_ping=True)
    drivers = " or ".join(dialect.async_drivers) or "an async driver"
    raise Failed(
        f"an async def function on {backend} needs {drivers}: install it (fencing's extras name them,"
        " e.g. pip install 'fencing[aiosqlite]')"
    )


def load_function(spec: str) -> Callable[..., Any]:
    """``MODULE:FUNCTION``, imported with the current directory on ``sys.path``; a
    :class:`Failed` that says what is wrong otherwise."""
    found = _load(spec, "the function must be given as MODULE:FUNCTION (tasks:send_email)")
    if not callable(found):
        raise Failed(f"{spec} is a {type(found).__name__}, not a function")
    return found  # type: ignore[no-any-return]


def load_schedules(spec: str) -> list[Schedule]:
    """``MODULE:NAME``, a list (or other iterable) of :class:`fencing.Schedule`."""
    found = _load(spec, "the schedules must be given as MODULE:NAME (tasks:SCHEDULES)")
    if isinstance(found, Schedule):
        return [found]
    try:
        listed = list(found)
    except TypeError:
        raise Failed(f"{spec} is a {type(found).__name__}, not a list of fencing.Schedule") from None
    wrong = [item for item in listed if not isinstance(item, Schedule)]
    if wrong or not listed:
        kind = type(wrong[0]).__name__ if wrong else ""
        what = f"holds {'an' if kind[:1] in 'aeiou' else 'a'} {kind}" if wrong else "is empty"
        raise Failed(f"{spec} {what}: it must be a list of fencing.Schedule")
    return listed


def _load(spec: str, form: str) -> Any:
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise Failed(f"{form}, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise Failed(f"cannot import module {module_name!r} (from {os.getcwd()}): {exc}") from None
    for part in name.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise Failed(f"module {module_name!r} has no {name!r}") from None
    return found
