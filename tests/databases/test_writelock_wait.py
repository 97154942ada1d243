"""Waiting for SQLite's write lock costs the waiter little CPU (``fencing._runtime.writelock``).

On a two-core machine every cycle a waiter spends trying again is taken from the process
that holds the lock. SQLite's own busy handler sleeps up to 100 ms between tries; the
store's waiter, which takes priority after ``STARVING``, backs off too: a wait of seconds
must cost it a small share of a CPU (a fixed 50 µs poll cost it a fifth: 0.6 s of CPU in a
3 s wait), and it must still get the lock before a writer that keeps asking for it.

CPU is measured in the waiting thread itself (``time.thread_time``), so a loaded machine
makes the waits longer but not the share higher.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fencing
from fencing import JobStore, Lease
from fencing._runtime.writelock import COURTESY, POLL_WITH_PRIORITY_MAX, sidecar_path

pytestmark = pytest.mark.backend("sqlite")

NOW = 1000.0
TTL = 1e6
HOLD = 2.5  # how long another connection holds the write lock
#: the most CPU a waiter may spend per second of waiting (measured ~1.5%; before: ~20%)
MAX_CPU_SHARE = 0.05
TIMEOUT = 120.0


@contextlib.contextmanager
def sqlite_store(path: Path) -> Iterator[JobStore]:
    engine = fencing.create_sqlite_engine(path, busy_timeout=60.0)
    store = JobStore(engine)
    try:
        store.create_table()
        # warm: statements compiled and a pooled connection made, so the wait is all we measure
        assert store.claim_next("warm-up", now=NOW, ttl=TTL) == []
        yield store
    finally:
        engine.dispose()


@contextlib.contextmanager
def write_locked(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection, not a fencing store, holding the write lock for the block."""
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield other
        if other.in_transaction:
            other.execute("ROLLBACK")
    finally:
        other.close()


class Waiter(threading.Thread):
    """Runs one store call in its own thread and measures that thread's CPU and wall time."""

    def __init__(self, call: Any) -> None:
        super().__init__(daemon=True)
        self.call = call
        self.result: Any = None
        self.error: BaseException | None = None
        self.cpu = self.wall = 0.0

    def run(self) -> None:
        cpu, wall = time.thread_time(), time.monotonic()
        try:
            self.result = self.call()
        except BaseException as exc:
            self.error = exc
        self.cpu, self.wall = time.thread_time() - cpu, time.monotonic() - wall

    def finished(self) -> Any:
        self.join(TIMEOUT)
        assert not self.is_alive(), "the waiter never got the lock"
        if self.error is not None:
            raise self.error
        return self.result


def test_a_waiter_that_takes_priority_sleeps_while_the_lock_is_held(tmp_path: Path) -> None:
    path = tmp_path / "held.db"
    sidecar = sidecar_path(str(path))
    assert sidecar is not None
    with sqlite_store(path) as store:
        store.enqueue("j", ready_at=0.0)
        with write_locked(path):
            waiter = Waiter(lambda: store.claim_next("w", now=NOW, ttl=TTL))
            waiter.start()
            time.sleep(HOLD)
        assert waiter.finished() == [Lease("j", "w", 1, NOW + TTL)]
    assert os.path.exists(sidecar), "the waiter never took priority: its polling was not exercised"
    assert HOLD <= waiter.wall < HOLD + TIMEOUT
    assert waiter.cpu < MAX_CPU_SHARE * waiter.wall, (
        f"{waiter.cpu * 1000:.0f} ms of CPU in a {waiter.wall:.2f} s wait"
    )


def test_waiters_with_and_without_priority_both_sleep_while_the_lock_is_held(tmp_path: Path) -> None:
    path = tmp_path / "two.db"
    with sqlite_store(path) as store:
        store.enqueue("a", ready_at=0.0)
        store.enqueue("b", ready_at=0.0)
        # one takes priority; the other holds back for it (COURTESY), then waits in SQLite's
        # handler because priority is taken
        with write_locked(path):
            waiters = [Waiter(lambda name=name: store.claim_next(name, now=NOW, ttl=TTL)) for name in "xy"]
            for waiter in waiters:
                waiter.start()
            time.sleep(HOLD)
        claimed = sorted(lease.job_id for waiter in waiters for lease in waiter.finished())
    assert claimed == ["a", "b"]
    for waiter in waiters:
        assert waiter.cpu < MAX_CPU_SHARE * waiter.wall, (
            f"{waiter.cpu * 1000:.0f} ms of CPU in a {waiter.wall:.2f} s wait"
        )


def test_a_priority_holder_that_backed_off_still_goes_before_a_writer_that_keeps_writing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "busy.db"
    with sqlite_store(path) as store, sqlite_store(path) as busy:
        store.enqueue("j", ready_at=0.0)
        commits: list[float] = []
        stop = threading.Event()

        def keep_writing() -> None:
            n = 0
            while not stop.is_set():
                busy.enqueue(f"busy-{n}")
                commits.append(time.monotonic())
                n += 1

        with write_locked(path) as other:
            waiter = Waiter(lambda: (store.claim_next("w", now=NOW, ttl=TTL), time.monotonic()))
            waiter.start()
            # long enough for the priority holder's sleeps to reach their longest
            time.sleep(1.0)
            writer = threading.Thread(target=keep_writing, daemon=True)
            writer.start()
            time.sleep(0.2)
            assert commits == []
            other.execute("ROLLBACK")  # the lock is free: the priority holder's turn
            leases, got_it = waiter.finished()
        stop.set()
        writer.join(TIMEOUT)
    assert leases == [Lease("j", "w", 1, NOW + TTL)]
    # the writer may get in first (it was asleep in SQLite's handler, as was the waiter),
    # but from then on it holds back up to COURTESY per call while the waiter tries every
    # POLL_WITH_PRIORITY_MAX at most: a few of its commits at most come first
    assert POLL_WITH_PRIORITY_MAX < COURTESY
    ahead = [t for t in commits if t < got_it]
    assert len(ahead) <= 3, f"{len(ahead)} commits of a busy writer went before the priority holder"
