"""An ORM application with fencing in its own engine, MetaData, migrations and Sessions.

Run it (from anywhere)::

    python examples/orm_app/app.py demo                      # a SQLite file in a temp dir
    python examples/orm_app/app.py --url jobs.db demo
    python examples/orm_app/app.py --url postgresql+psycopg://postgres@127.0.0.1/test demo

``demo`` migrates the database (``alembic upgrade head``: the application's tables and the
library's, from ``migrations/``), places orders, starts worker processes that bill them,
and checks the outcome. The steps are also commands of their own: ``migrate``, ``order N``,
``work NAME`` and ``report``.

What to copy:

* **One engine, the application's.** ``make_engine()``: ``fencing.create_sqlite_engine`` for
  a SQLite file (WAL, the store's transactions ``BEGIN IMMEDIATE``, the application's
  ``DEFERRED``), any SQLAlchemy engine for a server. The store takes its connections from
  this engine's pool and shows every statement to its logging and events.
* **The library's tables in the application's MetaData** (``models.py``), migrated by the
  application's Alembic like its own tables.
* **Jobs enqueued in the transaction that creates their orders**: ``store.enqueue(...,
  conn=session)``; an order and its job exist together or not at all.
* **The result written through the ORM, fenced**: ``store.fenced(lease, conn=session,
  complete=True, result=...)`` joins the Session's transaction; the ``Invoice`` object and
  the job's completion commit together, and only under the current lease. A worker whose
  lease was lost (it stalled, the lease expired, another worker took the job) gets
  ``LeaseLost`` and its invoice is rolled back: one invoice per order, always.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # models.py, and Alembic's env.py imports it too

from models import Invoice, Order, jobs  # noqa: E402

import fencing  # noqa: E402
from fencing import Heartbeat, JobStore, LeaseLost  # noqa: E402

#: seconds a lease lasts without renewal (the heartbeat renews it every third of that)
TTL = 5.0


def make_engine(url: str) -> Engine:
    """The application's engine: a SQLite file path, or any SQLAlchemy URL."""
    if "://" not in url:
        return fencing.create_sqlite_engine(url)
    return create_engine(url, pool_pre_ping=True)


def alembic_url(url: str) -> str:
    return url if "://" in url else f"sqlite:///{os.path.abspath(url)}"


def migrate(url: str) -> None:
    """``alembic upgrade head``, with this directory's ``alembic.ini``."""
    from alembic import command
    from alembic.config import Config

    config = Config(str(HERE / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", alembic_url(url))
    command.upgrade(config, "head")


def place_orders(url: str, count: int) -> list[int]:
    """``count`` orders, each with its billing job, in one transaction."""
    engine = make_engine(url)
    store = JobStore(engine, jobs)
    try:
        with Session(engine) as session, session.begin():
            orders = [
                Order(customer=f"customer-{n}", quantity=n % 7 + 1, unit_price=100 + n) for n in range(count)
            ]
            session.add_all(orders)
            session.flush()  # the ids
            for order in orders:
                store.enqueue(f"bill-order-{order.id}", conn=session)
            return [order.id for order in orders]
    finally:
        engine.dispose()


def work(url: str, name: str, stall: bool = False, ttl: float = TTL, claimed: Any = None) -> dict[str, int]:
    """A worker: claim a job, compute its invoice, write it fenced; until the queue has been
    empty for two TTLs (long enough for the lease of a worker that died to expire).

    ``stall``: freeze once past the lease just before writing, as a GC pause or a suspended
    VM would; the write must then be refused. ``claimed``: an event set after the first claim.
    """
    engine = make_engine(url)
    store = JobStore(engine, jobs)
    sessions = sessionmaker(engine)
    done = refused = 0
    idle_since = time.monotonic()
    try:
        while time.monotonic() - idle_since < 2 * ttl:
            leases = store.claim_next(name, ttl=ttl)
            if not leases:
                time.sleep(0.05)
                continue
            idle_since = time.monotonic()
            lease = leases[0]
            if claimed is not None:
                claimed.set()
            order_id = int(lease.job_id.removeprefix("bill-order-"))
            try:
                with Heartbeat(store, lease, ttl=ttl) as beat:
                    with sessions() as reading:
                        order = reading.get(Order, order_id)
                        assert order is not None
                        total = order.quantity * order.unit_price
                    time.sleep(0.01)  # the work
                    beat.check()
                    current = beat.lease
                if stall:
                    stall = False
                    time.sleep(ttl * 1.5)  # frozen past the lease: another worker takes the job
                result = f"invoiced {total}"
                with (
                    sessions() as session,
                    session.begin(),
                    store.fenced(current, conn=session, complete=True, result=result),
                ):
                    session.add(Invoice(order_id=order_id, total=total, worker=name, fence=current.fence))
                done += 1
            except LeaseLost:
                refused += 1  # another worker owns the job now; the invoice was rolled back
    finally:
        engine.dispose()
    return {"done": done, "refused": refused}


def report(url: str) -> list[str]:
    """What is wrong with the billing (nothing, if the list is empty)."""
    engine = make_engine(url)
    store = JobStore(engine, jobs)
    problems: list[str] = []
    try:
        with Session(engine) as session:
            orders = session.scalars(select(Order.id)).all()
            per_order = dict(
                session.execute(select(Invoice.order_id, func.count()).group_by(Invoice.order_id)).all()
            )
            invoices = {i.order_id: i for i in session.scalars(select(Invoice))}
        for order_id in orders:
            state = store.state(f"bill-order-{order_id}")
            invoice = invoices.get(order_id)
            if per_order.get(order_id) != 1 or invoice is None:
                problems.append(f"order {order_id}: {per_order.get(order_id, 0)} invoices")
            elif state is None or not state.done:
                problems.append(f"order {order_id}: its job is not done ({state})")
            elif (state.owner, state.fence) != (invoice.worker, invoice.fence):
                problems.append(
                    f"order {order_id}: invoiced by {invoice.worker} (fence {invoice.fence}), "
                    f"completed by {state.owner} (fence {state.fence})"
                )
    finally:
        engine.dispose()
    return problems


def _worker_process(url: str, name: str, stall: bool, ttl: float, out: Any, claimed: Any) -> None:
    out.put((name, work(url, name, stall, ttl, claimed)))


def demo(url: str, orders: int, workers: int, stall_one: bool, ttl: float) -> int:
    migrate(url)
    place_orders(url, orders)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    claimed = ctx.Event()
    stalls = [stall_one and n == 0 for n in range(workers)]
    procs = [
        ctx.Process(target=_worker_process, args=(url, f"worker-{n}", stalls[n], ttl, out, claimed))
        for n in range(workers)
    ]
    for n, proc in enumerate(procs):
        proc.start()
        if stall_one and n == 0:
            claimed.wait(120)  # the worker that will stall holds a job before the others start
    results = dict(out.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(60)
    problems = report(url)
    done = sum(r["done"] for r in results.values())
    refused = sum(r["refused"] for r in results.values())
    for problem in problems:
        print(f"[FAILED] {problem}")
    verdict = "PASS" if not problems and done == orders else "FAIL"
    print(f"{verdict}: {orders} orders, {done} invoices written, {refused} stale writes refused")
    return 0 if verdict == "PASS" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="a SQLite file path or a SQLAlchemy URL (default: a temp SQLite file)")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("demo", help="migrate, order, bill with worker processes, check")
    run.add_argument("--orders", type=int, default=30)
    run.add_argument("--workers", type=int, default=3)
    run.add_argument("--stall-one", action="store_true", help="one worker freezes past its lease once")
    run.add_argument("--ttl", type=float, default=TTL, help=f"lease seconds (default {TTL:g})")
    commands.add_parser("migrate", help="alembic upgrade head")
    order = commands.add_parser("order", help="place N orders (and their jobs)")
    order.add_argument("count", type=int)
    worker = commands.add_parser("work", help="run one worker until the queue stays empty")
    worker.add_argument("name")
    commands.add_parser("report", help="check that every order was billed exactly once")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fencing-orm-app-") as scratch:
        url = args.url or os.path.join(scratch, "app.db")
        if args.command == "demo":
            return demo(url, args.orders, args.workers, args.stall_one, args.ttl)
        if args.command == "migrate":
            migrate(url)
        elif args.command == "order":
            print(f"placed orders {place_orders(url, args.count)}")
        elif args.command == "work":
            print(work(url, args.name))
        else:
            problems = report(url)
            print("\n".join(problems) or "every order billed exactly once")
            return 1 if problems else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
