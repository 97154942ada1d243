"""The process ``tests/faults/test_crash.py`` kills with SIGKILL: a burst of store operations.

It uses the public API only (``JobStore``, ``FenceMarks``, ``fenced()`` blocks writing the
test's own ``crash_writes`` table) and runs as fast as it can until it is killed. Every
call is announced by an *intent* line before it runs and *acknowledged* by an ack line
after it returns (written and fsynced before the next call), so the parent knows every
call that returned, with its answer, and the one call that may have been in flight.

Log lines are JSON objects: ``{"t": "i", "seq", "op", ...arguments}`` (intent),
``{"t": "n", "seq"}`` (inside a fenced transaction, about to sleep), ``{"t": "a", "seq",
"ret"}`` (ack) and ``{"t": "e", "error"}`` (an unexpected exception: a failure).
"""

from __future__ import annotations

import json
import os
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

import sqlalchemy
from sqlalchemy import BigInteger, Column, Engine, Integer, MetaData, String, Table, event

import fencing
from fencing import FenceMarks, JobStore, Lease, LeaseLost

#: the application's own table, written inside fenced() blocks. ``payload`` is unique per
#: call; ``completes`` says the block completed the job with ``result = payload``
app_metadata = MetaData()
writes = Table(
    "crash_writes",
    app_metadata,
    Column("payload", String(40), primary_key=True),
    Column("job_id", String(40), nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("completes", Integer, nullable=False),
)

#: operation -> relative weight in the burst
OPS: dict[str, int] = {
    "enqueue": 12,
    "claim_next": 14,
    "claim": 8,
    "renew": 8,
    "complete": 10,
    "complete_many": 5,
    "release": 6,
    "revoke": 3,
    "delete": 6,
    "fenced": 20,
    "accept": 8,
}


#: how long a mutant lingers in the window its bug opens, so kills land there
MUTANT_PAUSE = 0.05


@dataclass(frozen=True)
class Burst:
    """What one killed process does. ``stale``: leases earlier processes were given."""

    target: str
    ack_path: str
    owner: str
    seed: int
    durability: str = "full"
    jobs: int = 60
    stale: tuple[tuple[str, str, int, float], ...] = ()
    ttl: tuple[float, float] = (0.2, 0.5)
    #: a backstop: the parent kills long before this
    max_seconds: float = 60.0
    #: SQLite: checkpoint the WAL every this many pages (SQLite's default is 1000)
    checkpoint_pages: int | None = None
    #: a deliberately broken worker, to show the checker catches it: "ack-inside" (acks a
    #: fenced block before it commits) or "torn-fenced" (commits the app write on its own)
    mutant: str | None = None


def job_ids(count: int) -> list[str]:
    return [f"j{n:03d}" for n in range(count)]


def open_engine(target: str, durability: str = "full", checkpoint_pages: int | None = None) -> Engine:
    if "://" in target:
        return sqlalchemy.create_engine(target)
    engine = fencing.create_sqlite_engine(target, durability=durability)  # type: ignore[arg-type]
    if checkpoint_pages is not None:
        # the application's own tuning: checkpoint the WAL into the file every few pages,
        # so kills also land while the database file itself is being rewritten
        pragma = f"PRAGMA wal_autocheckpoint = {checkpoint_pages}"
        event.listen(engine, "connect", lambda dbapi, _record: dbapi.execute(pragma))
    return engine


def lease_json(lease: Lease | None) -> list[Any] | None:
    return None if lease is None else [lease.job_id, lease.owner, lease.fence, lease.until]


class AckLog:
    """Append-only log; an ack is fsynced before the call after it starts."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any], *, sync: bool = False) -> None:
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data) :]
        if sync:
            os.fsync(self.fd)


class MarkRefused(Exception):
    """Raised inside a fenced block to roll it back when the fence mark refuses the token."""


class Worker:
    def __init__(self, burst: Burst, store: JobStore, marks: FenceMarks, log: AckLog) -> None:
        self.burst = burst
        self.store = store
        self.marks = marks
        self.log = log
        self.rng = random.Random(burst.seed)
        self.jobs = job_ids(burst.jobs)
        self.held: dict[str, Lease] = {}  # job -> the newest lease this process got
        self.stale = [Lease(*s) for s in burst.stale]
        self.seq = 0
        self.acked = 0
        self.ops: dict[str, Callable[[], bool]] = {name: getattr(self, f"op_{name}") for name in OPS}

    # -- the log ---------------------------------------------------------------------------

    def call(self, op: str, args: dict[str, Any], fn: Callable[[], Any]) -> Any:
        """Announce, run, acknowledge. ``fn`` returns the answer in its JSON form."""
        self.seq += 1
        self.log.write({"t": "i", "seq": self.seq, "op": op, **args})
        answer = fn()
        if self.acked != self.seq:
            self.ack(answer)
        return answer

    def ack(self, answer: Any) -> None:
        self.log.write({"t": "a", "seq": self.seq, "ret": answer}, sync=True)
        self.acked = self.seq

    def tag(self, kind: str) -> str:
        """A value no other call writes: kind, process, the call's sequence number."""
        return f"{kind}:{self.burst.owner}.{self.seq + 1}"

    # -- choices ---------------------------------------------------------------------------

    def job(self) -> str:
        return self.rng.choice(self.jobs)

    def ttl(self) -> float:
        return self.rng.uniform(*self.burst.ttl)

    def lease(self) -> Lease | None:
        """Mostly a lease of this process; sometimes one an earlier (killed) process held."""
        if self.stale and (not self.held or self.rng.random() < 0.2):
            return self.rng.choice(self.stale)
        return self.rng.choice(list(self.held.values())) if self.held else None

    def got(self, lease: Lease | None) -> None:
        if lease is not None:
            self.held[lease.job_id] = lease

    def drop(self, lease: Lease) -> None:
        if self.held.get(lease.job_id) == lease:
            del self.held[lease.job_id]

    # -- operations: each returns False when it had nothing to work on ------------------------

    def op_enqueue(self) -> bool:
        job = self.job()
        # 0: ready at once on any clock; None: stamped with the database's now
        ready_at = self.rng.choice([0.0, None])
        self.call(
            "enqueue", {"job": job, "ready_at": ready_at}, lambda: self.store.enqueue(job, ready_at=ready_at)
        )
        return True

    def op_claim(self) -> bool:
        job, owner, ttl = self.job(), self.burst.owner, self.ttl()

        def claim() -> Any:
            lease = self.store.claim(job, owner, ttl=ttl)
            self.got(lease)
            return lease_json(lease)

        self.call("claim", {"job": job, "owner": owner, "ttl": ttl}, claim)
        return True

    def op_claim_next(self) -> bool:
        owner, ttl, limit = self.burst.owner, self.ttl(), self.rng.randint(1, 3)

        def claim_next() -> Any:
            leases = self.store.claim_next(owner, ttl=ttl, limit=limit)
            for lease in leases:
                self.got(lease)
            return [lease_json(lease) for lease in leases]

        self.call("claim_next", {"owner": owner, "ttl": ttl, "limit": limit}, claim_next)
        return True

    def op_renew(self) -> bool:
        lease, ttl = self.lease(), self.ttl()
        if lease is None:
            return False

        def renew() -> Any:
            renewed = self.store.renew(lease, ttl=ttl) or None  # refused: a falsy Refusal
            self.drop(lease)
            self.got(renewed)
            return lease_json(renewed)

        self.call("renew", {"lease": lease_json(lease), "ttl": ttl}, renew)
        return True

    def op_complete(self) -> bool:
        lease = self.lease()
        if lease is None:
            return False
        result = self.rng.choice([None, self.tag("r")])

        def complete() -> bool:
            self.drop(lease)
            return bool(self.store.complete(lease, result))

        self.call("complete", {"lease": lease_json(lease), "result": result}, complete)
        return True

    def op_complete_many(self) -> bool:
        picked: dict[str, Lease] = {}
        for _ in range(3):
            lease = self.lease()
            if lease is not None:
                picked.setdefault(lease.job_id, lease)  # one completion per job in a batch
        if not picked:
            return False
        batch = [
            (lease, self.rng.choice([None, f"{self.tag('r')}.{i}"]))
            for i, lease in enumerate(picked.values())
        ]

        def complete_many() -> list[bool]:
            for lease, _ in batch:
                self.drop(lease)
            return [bool(answer) for answer in self.store.complete_many(batch)]

        args = {"leases": [lease_json(lease) for lease, _ in batch], "results": [r for _, r in batch]}
        self.call("complete_many", args, complete_many)
        return True

    def op_release(self) -> bool:
        lease = self.lease()
        if lease is None:
            return False
        delay = self.rng.choice([None, None, self.rng.uniform(0.05, 0.3)])

        def release() -> bool:
            self.drop(lease)
            return bool(self.store.release(lease, delay=delay))

        self.call("release", {"lease": lease_json(lease), "delay": delay}, release)
        return True

    def op_revoke(self) -> bool:
        job = self.job()
        self.call("revoke", {"job": job}, lambda: self.store.revoke(job))
        return True

    def op_delete(self) -> bool:
        job = self.job()
        self.call("delete", {"job": job}, lambda: self.store.delete(job))
        return True

    def op_accept(self) -> bool:
        lease = self.lease()
        if lease is None:
            return False
        resource = f"res:{lease.job_id}"
        fence = max(0, lease.fence + self.rng.choice([-1, 0, 0, 1]))
        self.call(
            "accept",
            {"resource": resource, "fence": fence},
            lambda: self.marks.accept(resource, fence),
        )
        return True

    def op_fenced(self) -> bool:
        """A fenced transaction writing the app table (and maybe a fence mark), sometimes
        sleeping inside it so that kills land while it is open."""
        lease = self.lease()
        if lease is None:
            return False
        mutant = self.burst.mutant
        complete = self.rng.random() < 0.6 or mutant == "torn-fenced"
        payload = self.tag("c" if complete else "w")
        resource = f"res:{lease.job_id}" if self.rng.random() < 0.5 else None
        sleep = self.rng.choice([0.0, 0.0, self.rng.uniform(0.005, 0.03), self.rng.uniform(0.01, 0.08)])
        seq = self.seq + 1

        row = writes.insert().values(
            payload=payload, job_id=lease.job_id, fence=lease.fence, completes=int(complete)
        )

        def fenced() -> str:
            try:
                if mutant == "torn-fenced":
                    # BROKEN on purpose: the application's write commits apart from the completion
                    with self.store.engine.begin() as own:
                        own.execute(row)
                    time.sleep(MUTANT_PAUSE)
                with self.store.fenced(
                    lease, complete=complete, result=payload if complete else None
                ) as conn:
                    if mutant != "torn-fenced":
                        conn.execute(row)
                    if resource is not None and not self.marks.accept(resource, lease.fence, conn=conn):
                        raise MarkRefused(resource)
                    if sleep:
                        self.log.write({"t": "n", "seq": seq})
                        time.sleep(sleep)
                    if mutant == "ack-inside":
                        # BROKEN on purpose: acknowledged before the transaction commits
                        self.ack("committed")
                        time.sleep(MUTANT_PAUSE)
            except LeaseLost:
                self.drop(lease)
                return "lost"
            except MarkRefused:
                return "mark-refused"
            if complete:
                self.drop(lease)
            return "committed"

        args = {
            "lease": lease_json(lease),
            "complete": complete,
            "payload": payload,
            "resource": resource,
            "sleep": sleep,
        }
        self.call("fenced", args, fenced)
        return True

    def run(self, deadline: float) -> None:
        names, weights = list(self.ops), list(OPS.values())
        while time.monotonic() < deadline:
            op = self.rng.choices(names, weights)[0]
            self.ops[op]()


def main(burst: Burst, ready: Pipe) -> None:
    """The child's entry point: connect, say ready, then work until killed."""
    log = AckLog(burst.ack_path)
    try:
        engine = open_engine(burst.target, burst.durability, burst.checkpoint_pages)
        store = JobStore(engine)
        marks = FenceMarks(engine)
        store.state("j000")  # connected before the parent starts timing the kill
        ready.send(True)
        ready.close()
        Worker(burst, store, marks, log).run(time.monotonic() + burst.max_seconds)
    except BaseException:
        log.write({"t": "e", "error": traceback.format_exc()}, sync=True)
        raise
