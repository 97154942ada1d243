"""Locks under pauses, side by side: a Jepsen-style lock-set run against the locks people use.

What is run
-----------
For each system, ``--workers`` processes (default 4) loop on one named lock for ``--seconds``
of wall time per fault. Each turn takes the lock and runs one **critical section** on a
shared resource, **read -> work -> write**: it reads the resource, works ``--work`` seconds
(20 ms), writes it back, and lets the lock go. Turns alternate between two shapes (Jepsen's
etcd ``lock-set``, and a counter):

* **set**: the resource is a list; the section adds one element, unique to it;
* **counter**: the resource is a number; the section adds one.

A section is **acknowledged** once its write has committed (a line in its worker's journal,
written after the commit). The resource is a row whose ``version`` each write sets to the
version it read plus one; each write also appends ``(shape, item, version read)`` to a log in
the same transaction, so the resource itself says in what order the writes landed.

The faults, one kind per run of a system, at random (seeded) every 0.3 to 0.7 s, each aimed at
a worker **inside its section, between its read and its write** (the holder), each section hit
at most once (one woken from a pause is left to reach its write):

* ``pause``: the holder ``SIGSTOP``-ped for 1.5 to 2.5 ttl, then ``SIGCONT``: it wakes
  believing it holds the lock (Kleppmann's GC pause);
* ``kill``: the holder ``SIGKILL``-ed, and a new worker started in its place;
* ``session``: the holder's sessions on the lock's server ended by the server
  (``pg_terminate_backend``, MariaDB ``KILL``, Redis ``CLIENT KILL``): the process runs on;
* ``none``: no fault (the throughput baseline).

The checker, from the resource alone and the journals:

* **lost adds**: acknowledged elements missing from the final set;
* **duplicates**: elements present more than once;
* **lost increments**: committed increments (the log) minus the final counter (0 unless a
  write overwrote another's);
* **overlaps** (seen by the resource): committed writes made on a read another write had
  already made stale (their version read is not the version the previous write set): two
  critical sections that overlapped where it matters;
* **ops/s**: acknowledged sections per second of the run (the same machine, the same run).

The systems, each used as its documentation shows:

``fencing-fenced`` (SQLite, PostgreSQL, MariaDB)
    ``fencing.Locks.hold(name, owner, ttl=1)`` (its heartbeat renews every ttl/3); the section
    is ``lock.fenced()``: one transaction of the lock's own database, the read and the write
    in it, refused (``LeaseLost``, rolled back) unless the lock is still the worker's.
``fencing-marks`` (the lock on SQLite, PostgreSQL, MariaDB)
    The same lock; the resource is **outside** the lock's database (a SQLite file of its own:
    another service's store), guarded by ``fencing.FenceMarks`` there: the read's
    transaction ``accept``-s the lock's token first, and the write's transaction ``accept``-s
    it again before writing (a newer holder's read refuses every older token's write; a read
    that is not fenced lets an old holder's write land between a new holder's read and write).
``fencing-unfenced`` (SQLite, PostgreSQL, MariaDB)
    The same lock, and the resource in the lock's database written as the peers write theirs
    (the read, the work, then the write in a transaction of its own): what the lock alone
    gives, without the fenced write. Not a way to use ``fencing``: the control of the run.
``redis-lock``
    python-redis-lock's ``Lock(redis, name, expire=1, auto_renewal=True)`` on the local Redis.
``redlock``
    pottery's ``Redlock(key=name, masters={redis}, auto_release_time=1)`` (one master: the
    local Redis).
``tooz-postgresql``, ``tooz-mysql``
    tooz's coordinator ``get_lock(name)`` on PostgreSQL (``pg_advisory_lock``) and MariaDB
    (``GET_LOCK``): locks held by a session, no ttl.
``pg-advisory``
    ``SELECT pg_advisory_lock(k)`` / ``pg_advisory_unlock(k)`` on a psycopg connection.
``portalocker``, ``filelock``
    ``portalocker.Lock(path, flags=EXCLUSIVE)`` and ``filelock.FileLock(path)`` on a local
    file (one machine only; the lock goes with the process, no ttl, no sessions).

The peers' resource is a row in PostgreSQL (read in one statement, written in one transaction
after the work): their locks guard it, nothing else does.

Run it in a venv of its own::

    pip install -e ".[postgresql,mysql]" redis python-redis-lock pottery tooz psycopg2-binary \\
        portalocker filelock
    python benchmarks/lockset.py                       # every system, every fault, 12 s each
    python benchmarks/lockset.py --systems fencing-fenced-postgresql,pg-advisory --faults pause

Servers: ``FENCING_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``),
``FENCING_MARIADB_URL`` (``mysql+pymysql://root@127.0.0.1:3306/test``), ``FENCING_REDIS_URL``
(``redis://127.0.0.1:6379/13``). A system whose server or package is missing is reported as
not run, with the reason. It writes tables named ``lockset_*`` (dropped and created again).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fencing

PG = os.environ.get("FENCING_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MARIADB = os.environ.get("FENCING_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS = os.environ.get("FENCING_REDIS_URL", "redis://127.0.0.1:6379/13")
NAME = "lockset"
SHAPES = ("set", "counter")
FAULTS = ("none", "pause", "kill", "session")

# -- the resource ------------------------------------------------------------------------------

metadata = sa.MetaData()
resource = sa.Table(
    "lockset_resource",
    metadata,
    sa.Column("shape", sa.String(16), primary_key=True),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
)
log = sa.Table(
    "lockset_log",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("shape", sa.String(16), nullable=False),
    sa.Column("item", sa.String(64), nullable=False),
    sa.Column("token", sa.BigInteger, nullable=True),
    sa.Column("read_version", sa.Integer, nullable=False),
)
marks_md = sa.MetaData()
marks_table = fencing.fence_marks_table(marks_md, "lockset_marks")
keys_table = fencing.idempotency_keys_table(marks_md, "lockset_keys")


def reset_resource(engine: sa.Engine) -> None:
    metadata.drop_all(engine)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(resource.insert(), [{"shape": "set", "body": "[]", "version": 0},
                                         {"shape": "counter", "body": "0", "version": 0}])  # fmt: skip


def read(conn: sa.Connection, shape: str) -> tuple[Any, int]:
    body, version = conn.execute(
        sa.select(resource.c.body, resource.c.version).where(resource.c.shape == shape)
    ).one()
    return json.loads(body), version


def write(
    conn: sa.Connection, shape: str, body: Any, read_version: int, item: str, token: int | None
) -> None:
    conn.execute(
        resource.update()
        .where(resource.c.shape == shape)
        .values(body=json.dumps(body), version=read_version + 1)
    )
    conn.execute(log.insert().values(shape=shape, item=item, token=token, read_version=read_version))


def changed(shape: str, body: Any, item: str) -> Any:
    return [*body, item] if shape == "set" else body + 1


def unguarded(
    engine: sa.Engine, shape: str, item: str, inside: Callable[[], None], token: int | None
) -> None:
    """A section as the peers write theirs: the read, the work, then the write in a
    transaction of its own, which nothing but the lock guards."""
    with engine.connect() as conn:
        body, version = read(conn, shape)
        conn.rollback()
    inside()
    with engine.begin() as conn:
        write(conn, shape, changed(shape, body, item), version, item, token)


# -- the systems -------------------------------------------------------------------------------


class Refused(Exception):
    """The resource (or the lock's database) refused the write: not acknowledged, not an error."""


@dataclass
class Cell:
    """What one worker needs to know about its run."""

    system: str
    workdir: str
    ttl: float
    work: float
    poll: float | None = None  #: fencing.Locks' poll (None: the library's default)


class System:
    """One lock, as its documentation shows, guarding the resource."""

    name = ""
    server = ""  #: what must answer: postgresql, mariadb, redis or nothing
    sessions = False  #: whether the ``session`` fault means anything for it
    resource_url = PG  #: where the resource lives (the peers: PostgreSQL)

    def __init__(self, cell: Cell) -> None:
        self.cell = cell

    def resource_engine(self) -> sa.Engine:
        return sa.create_engine(self.resource_url, poolclass=sa.pool.NullPool)

    def prepare(self) -> None:
        """In the parent, before the workers start: a fresh resource and a free lock (and no
        connection left open for the forked workers to inherit)."""
        engine = self.resource_engine()
        reset_resource(engine)
        engine.dispose()

    def open(self, who: str) -> None:
        """In the worker: connect (to the resource under a name of its own: the ``session``
        fault ends the lock's sessions, not the resource's)."""
        named = {"application_name": "lockset-resource"} if self.resource_url.startswith("postgresql") else {}
        self.engine = sa.create_engine(self.resource_url, pool_size=2, connect_args=named)

    def locked(self) -> contextlib.AbstractContextManager[int | None]:
        """Hold the lock for the block: the token, if the lock has one."""
        raise NotImplementedError

    def section(self, shape: str, item: str, inside: Callable[[], None]) -> None:
        """Read -> work -> write under the lock; ``Refused`` when a write is refused."""
        with self.locked() as token:
            unguarded(self.engine, shape, item, inside, token)

    def kill_sessions(self, who: str, workdir: Path) -> int:
        return 0


def _session_ids(workdir: Path, who: str) -> list[int]:
    path = workdir / f"sessions-{who}"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _note_session(who: str, session_id: int) -> None:
    with open(Path(os.environ["LOCKSET_DIR"]) / f"sessions-{who}", "a") as f:
        f.write(f"{session_id}\n")


@functools.cache
def _admin(url: str) -> sa.Engine:
    """The parent's connections that end sessions: kept open, so a fault lands in the 20 ms of
    a critical section (a connection made per fault took longer than that)."""
    return sa.create_engine(url, pool_size=1)


def _kill_pg(who: str) -> int:
    with _admin(PG).connect() as conn:
        n = conn.execute(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = :a"
            ),
            {"a": f"lockset-{who}"},
        ).scalar_one()
        conn.commit()
    return int(n)


def _kill_mariadb(ids: list[int]) -> int:
    n = 0
    with _admin(MARIADB).connect() as conn:
        live = {
            int(i) for i in conn.execute(sa.text("SELECT ID FROM information_schema.PROCESSLIST")).scalars()
        }
        for i in ids:
            if i in live:  # ids are never reused while the server runs
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.execute(sa.text(f"KILL CONNECTION {int(i)}"))
                    n += 1
        conn.commit()
    return n


def _end_sessions(db: str, who: str, workdir: Path) -> int:
    """End ``who``'s sessions on ``db``: by name on PostgreSQL, by the ids it noted on MariaDB."""
    return _kill_pg(who) if db == "postgresql" else _kill_mariadb(_session_ids(workdir, who))


class FencingSystem(System):
    """``fencing.Locks`` on one database; ``fenced``, ``marks`` or ``unfenced`` for the resource."""

    def __init__(self, cell: Cell, db: str, mode: str) -> None:
        super().__init__(cell)
        self.db, self.mode = db, mode
        self.server = "" if db == "sqlite" else db
        self.sessions = db != "sqlite"
        self.lock_url = {"postgresql": PG, "mariadb": MARIADB}.get(db, "")
        if db == "sqlite":
            self.lock_url = f"sqlite:///{Path(cell.workdir) / 'locks.db'}"
        if mode in ("fenced", "unfenced"):
            self.resource_url = self.lock_url
        if mode == "marks":
            self.resource_url = f"sqlite:///{Path(cell.workdir) / 'resource.db'}"

    def _engine(self, url: str, who: str | None = None) -> sa.Engine:
        if url.startswith("sqlite"):
            return fencing.create_sqlite_engine(url.removeprefix("sqlite:///"))
        engine = sa.create_engine(url, pool_pre_ping=False)
        if who is not None and url.startswith("mysql"):

            @sa.event.listens_for(engine, "connect")
            def noted(dbapi_conn: Any, record: Any) -> None:
                with dbapi_conn.cursor() as cur:
                    cur.execute("SELECT CONNECTION_ID()")
                    _note_session(who, cur.fetchone()[0])

        return engine

    def resource_engine(self) -> sa.Engine:
        return self._engine(self.resource_url)

    def _locks(self, engine: sa.Engine) -> fencing.Locks:
        poll = {} if self.cell.poll is None else {"poll": self.cell.poll}
        return fencing.Locks(engine, fencing.locks_table(sa.MetaData(), "lockset_locks"), **poll)

    def prepare(self) -> None:
        super().prepare()
        locks = self._locks(self._engine(self.lock_url))
        locks.table.metadata.drop_all(locks.engine)
        locks.create_table()
        locks.engine.dispose()
        if self.mode == "marks":
            engine = self.resource_engine()
            marks_md.drop_all(engine)
            fencing.FenceMarks(engine, marks_table, keys_table).create_tables()
            engine.dispose()

    def open(self, who: str) -> None:
        self.who = who
        self.locks = self._locks(self._engine(self.lock_url, who))
        self.engine = self.locks.engine if self.resource_url == self.lock_url else self.resource_engine()
        self.marks = fencing.FenceMarks(self.engine, marks_table, keys_table)

    def section(self, shape: str, item: str, inside: Callable[[], None]) -> None:
        try:
            with self.locks.hold(NAME, self.who, ttl=self.cell.ttl, timeout=None) as lock:
                if self.mode == "unfenced":  # the lock, and writes it does not fence
                    unguarded(self.engine, shape, item, inside, lock.token)
                    return
                if self.mode == "fenced":
                    with lock.fenced() as conn:
                        body, version = read(conn, shape)
                        inside()
                        write(conn, shape, changed(shape, body, item), version, item, lock.token)
                    return
                with self.engine.begin() as conn:  # the read fenced too: no older write after it
                    if not self.marks.accept(shape, lock.token, conn=conn):
                        raise Refused("an older token read")
                    body, version = read(conn, shape)
                inside()
                with self.engine.begin() as conn:
                    if not self.marks.accept(shape, lock.token, conn=conn):
                        raise Refused("an older token's write")  # rolled back with the write
                    write(conn, shape, changed(shape, body, item), version, item, lock.token)
        except fencing.LeaseLost as exc:
            raise Refused(str(exc)) from exc

    def kill_sessions(self, who: str, workdir: Path) -> int:
        return _end_sessions(self.db, who, workdir)


class RedisLock(System):
    name = "redis-lock"
    server = "redis"
    sessions = True

    def open(self, who: str) -> None:
        import redis
        import redis_lock

        super().open(who)
        self.redis = redis.Redis.from_url(REDIS, client_name=f"lockset-{who}")
        self.new_lock = lambda: redis_lock.Lock(
            self.redis, NAME, expire=max(1, round(self.cell.ttl)), auto_renewal=True
        )

    @contextlib.contextmanager
    def locked(self) -> Iterator[int | None]:
        lock = self.new_lock()  # one per turn, as a `with` block makes it
        lock.acquire()  # (python-redis-lock and Redlock both wait by default)
        try:
            yield None
        finally:
            with contextlib.suppress(Exception):  # NotAcquired, ReleaseUnlockedLock: it expired
                lock.release()

    def prepare(self) -> None:
        import redis

        super().prepare()
        redis.Redis.from_url(REDIS).flushdb()

    def kill_sessions(self, who: str, workdir: Path) -> int:
        import redis

        r = redis.Redis.from_url(REDIS)
        ids = [c["id"] for c in r.client_list() if c.get("name") == f"lockset-{who}"]
        for i in ids:
            with contextlib.suppress(Exception):
                r.execute_command("CLIENT", "KILL", "ID", i)
        return len(ids)


class Redlock(RedisLock):
    name = "redlock"

    def open(self, who: str) -> None:
        import pottery
        import redis

        System.open(self, who)
        self.redis = redis.Redis.from_url(REDIS, client_name=f"lockset-{who}")
        self.new_lock = lambda: pottery.Redlock(
            key=NAME, masters={self.redis}, auto_release_time=self.cell.ttl
        )


class Tooz(System):
    sessions = True

    def __init__(self, cell: Cell, db: str) -> None:
        super().__init__(cell)
        self.db = db
        self.name = f"tooz-{'postgresql' if db == 'postgresql' else 'mysql'}"
        self.server = db

    def open(self, who: str) -> None:
        from tooz import coordination

        super().open(who)
        self.who = who
        if self.db == "postgresql":
            url = sa.make_url(PG).set(drivername="postgresql")
        else:
            url = sa.make_url(MARIADB).set(drivername="mysql")
        self.coordinator = coordination.get_coordinator(url.render_as_string(False), who.encode())
        self.coordinator.start()

    @contextlib.contextmanager
    def locked(self) -> Iterator[int | None]:
        # one lock object per turn, as `with coordinator.get_lock(name):` makes it: a tooz
        # PostgreSQL lock whose release failed (its session ended) still counts itself
        # acquired, and its next blocking acquire retries for ever
        lock = self.coordinator.get_lock(NAME.encode())
        lock.acquire(blocking=True)
        if self.db == "mariadb":
            _note_session(self.who, lock._conn.thread_id())
        try:
            yield None
        finally:
            with contextlib.suppress(Exception):  # its session ended: the lock went with it
                lock.release()

    def kill_sessions(self, who: str, workdir: Path) -> int:
        return _end_sessions(self.db, who, workdir)


class PgAdvisory(System):
    name = "pg-advisory"
    server = "postgresql"
    sessions = True
    key = zlib.crc32(NAME.encode())

    def open(self, who: str) -> None:
        super().open(who)
        self.lock_conn: Any = None

    def _conn(self) -> Any:
        import psycopg

        if self.lock_conn is None or self.lock_conn.closed:
            url = sa.make_url(PG)
            self.lock_conn = psycopg.connect(
                host=url.host, port=url.port or 5432, user=url.username, dbname=url.database, autocommit=True
            )
        return self.lock_conn

    @contextlib.contextmanager
    def locked(self) -> Iterator[int | None]:
        try:
            self._conn().execute("SELECT pg_advisory_lock(%s)", (self.key,))
        except Exception:
            self.lock_conn = None
            raise
        try:
            yield None
        finally:
            try:
                self._conn().execute("SELECT pg_advisory_unlock(%s)", (self.key,))
            except Exception:  # its session ended: the lock went with it
                self.lock_conn = None

    def kill_sessions(self, who: str, workdir: Path) -> int:
        return _kill_pg(who)


class Portalocker(System):
    name = "portalocker"

    @contextlib.contextmanager
    def locked(self) -> Iterator[int | None]:
        import portalocker

        with portalocker.Lock(
            Path(self.cell.workdir) / "portalocker.lock", flags=portalocker.LockFlags.EXCLUSIVE
        ):
            yield None


class Filelock(System):
    name = "filelock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[int | None]:
        import filelock

        with filelock.FileLock(Path(self.cell.workdir) / "filelock.lock"):
            yield None


def systems(cell: Cell) -> dict[str, System]:
    made: list[System] = []
    for db in ("sqlite", "postgresql", "mariadb"):
        for mode in ("fenced", "marks", "unfenced"):
            s = FencingSystem(cell, db, mode)
            s.name = f"fencing-{mode}-{db}"
            made.append(s)
    made += [
        RedisLock(cell),
        Redlock(cell),
        Tooz(cell, "postgresql"),
        Tooz(cell, "mariadb"),
        PgAdvisory(cell),
    ]
    made += [Portalocker(cell), Filelock(cell)]
    return {s.name: s for s in made}


# -- the workers -------------------------------------------------------------------------------


def worker(cell: Cell, slot: int, who: str, inside: Any, stop: Any, ready: Any) -> None:
    """Loop on the lock until ``stop``; a line in the journal per acknowledged section.
    ``inside[slot]``: the turn whose section it is in, past its read (0: none)."""
    os.environ["PGAPPNAME"] = f"lockset-{who}"  # libpq's sessions (psycopg, psycopg2) carry the name
    os.environ["LOCKSET_DIR"] = cell.workdir
    # what the locks' own threads print (python-redis-lock's renewer, on a lost lock) is kept
    sys.stderr = open(Path(cell.workdir) / f"stderr-{who}", "a")  # noqa: SIM115
    system = systems(cell)[cell.system]
    system.open(who)
    journal = os.open(Path(cell.workdir) / f"acks-{who}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    errors: collections.Counter[str] = collections.Counter()
    ready[slot] = 1
    turn = 0

    def between_read_and_write() -> None:
        inside[slot] = turn
        time.sleep(cell.work)

    while not stop.is_set():
        turn += 1
        shape = SHAPES[turn % 2]
        item = f"{who}:{turn}"
        try:
            system.section(shape, item, between_read_and_write)
        except Refused:
            errors["refused"] += 1
            continue
        except Exception as exc:  # a session ended, a lock service error: counted, go on
            errors[type(exc).__name__] += 1
            time.sleep(0.01)
            continue
        finally:
            inside[slot] = 0
        os.write(journal, f"{shape} {item}\n".encode())
    (Path(cell.workdir) / f"errors-{who}").write_text(json.dumps(errors))


@dataclass
class Slot:
    process: Any
    who: str
    paused_until: float | None = None
    hit: int = 0  #: the turn its last fault hit


@dataclass
class Outcome:
    system: str
    fault: str
    seconds: float
    acked: int = 0
    lost_adds: int = 0
    duplicates: int = 0
    increments: int = 0
    lost_increments: int = 0
    overlaps: int = 0
    refused: int = 0
    faults: int = 0
    sessions_ended: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    skipped: str = ""

    @property
    def ops(self) -> float:
        return self.acked / self.seconds if self.seconds else 0.0


def run_cell(system_name: str, fault: str, args: argparse.Namespace, rng: random.Random) -> Outcome:
    workdir = Path(tempfile.mkdtemp(prefix=f"lockset-{system_name}-{fault}-"))
    cell = Cell(system_name, str(workdir), args.ttl, args.work, args.poll)
    system = systems(cell)[system_name]
    outcome = Outcome(system_name, fault, args.seconds)
    if fault == "session" and not system.sessions:
        outcome.skipped = "no server session"
        return outcome
    system.prepare()
    ctx = multiprocessing.get_context("fork")  # a worker starts in milliseconds, not seconds
    inside, ready, stop = ctx.Array("i", args.workers), ctx.Array("i", args.workers), ctx.Event()
    generation = collections.Counter[int]()

    def start(slot: int) -> Slot:
        generation[slot] += 1
        who = f"{slot}.{generation[slot]}"
        p = ctx.Process(target=worker, args=(cell, slot, who, inside, stop, ready), daemon=True)
        p.start()
        return Slot(p, who)

    slots = [start(i) for i in range(args.workers)]
    ends = time.monotonic() + 60
    while not all(ready) and time.monotonic() < ends:
        time.sleep(0.05)
    began = time.monotonic()
    ends = began + args.seconds
    next_fault = began + rng.uniform(0.3, 0.7)
    while (now := time.monotonic()) < ends:
        for s in slots:
            if s.paused_until is not None and s.paused_until <= now:
                os.kill(s.process.pid, signal.SIGCONT)
                s.paused_until = None
        if fault == "none" or now < next_fault:
            time.sleep(0.002)
            continue
        # a section is hit once: one woken from a pause is left to reach its write
        holders = [
            i
            for i, s in enumerate(slots)
            if inside[i] and inside[i] != s.hit and s.paused_until is None and s.process.is_alive()
        ]
        if not holders:
            time.sleep(0.002)
            continue
        i = rng.choice(holders)
        target = slots[i]
        target.hit = inside[i]
        outcome.faults += 1
        next_fault = now + rng.uniform(0.3, 0.7)
        if fault == "pause":
            os.kill(target.process.pid, signal.SIGSTOP)
            target.paused_until = now + rng.uniform(1.5, 2.5) * args.ttl
        elif fault == "kill":
            target.process.kill()
            target.process.join(10)
            inside[i] = 0
            slots[i] = start(i)
        else:
            outcome.sessions_ended += system.kill_sessions(target.who, workdir)
    stop.set()
    for s in slots:
        if s.paused_until is not None:
            os.kill(s.process.pid, signal.SIGCONT)
    for s in slots:
        s.process.join(30)
        if s.process.is_alive():
            s.process.kill()
            s.process.join(10)
    return check(system, outcome, workdir)


def check(system: System, outcome: Outcome, workdir: Path) -> Outcome:
    acks = [line.split() for path in workdir.glob("acks-*") for line in path.read_text().splitlines()]
    outcome.acked = len(acks)
    errors: collections.Counter[str] = collections.Counter()
    for path in workdir.glob("errors-*"):
        errors.update(json.loads(path.read_text()))
    outcome.refused = errors.pop("refused", 0)
    outcome.errors = dict(errors)
    engine = system.resource_engine()
    with engine.connect() as conn:
        final_set, _ = read(conn, "set")
        final_counter, _ = read(conn, "counter")
        rows = conn.execute(sa.select(log.c.shape, log.c.item, log.c.read_version).order_by(log.c.seq)).all()
    present = collections.Counter(final_set)
    outcome.lost_adds = sum(1 for shape, item in acks if shape == "set" and item not in present)
    outcome.duplicates = sum(n - 1 for n in present.values() if n > 1)
    outcome.increments = sum(1 for shape, *_ in rows if shape == "counter")
    outcome.lost_increments = outcome.increments - final_counter
    version = dict.fromkeys(SHAPES, 0)
    for shape, _, read_version in rows:
        if read_version != version[shape]:
            outcome.overlaps += 1
        version[shape] = read_version + 1
    engine.dispose()
    return outcome


def available(system: System) -> str:
    """Why the system cannot run here, or ''."""
    needs = {
        "redis-lock": "redis_lock",
        "redlock": "pottery",
        "tooz-postgresql": "tooz",
        "tooz-mysql": "tooz",
        "portalocker": "portalocker",
        "filelock": "filelock",
    }
    module = needs.get(system.name)
    if module:
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed"
    urls = [PG] if system.resource_url == PG or system.server == "postgresql" else []
    urls += [MARIADB] if system.server == "mariadb" else []
    try:
        if system.server == "redis":
            import redis

            redis.Redis.from_url(REDIS).ping()
        for url in urls:
            engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
            with engine.connect():
                pass
    except Exception as exc:
        return f"{system.server or 'postgresql'} does not answer ({type(exc).__name__}: {exc})"
    return ""


RESOURCES = {
    "fencing-fenced": "a table of the lock's database, `fenced()`",
    "fencing-marks": "a SQLite file of its own, `FenceMarks`",
    "fencing-unfenced": "a table of the lock's database, not fenced (control)",
}


def report(outcomes: list[dict[str, Any]]) -> str:
    """The guarantee page's table: per system, per fault, lost updates / duplicates /
    overlaps and ops/s."""
    by = {(o["system"], o["fault"]): o for o in outcomes}
    lines = [
        "| lock | resource | no fault | pause | kill | session |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name in dict.fromkeys(o["system"] for o in outcomes):
        kind = RESOURCES.get(name.rsplit("-", 1)[0], "a PostgreSQL row")
        cells = []
        for fault in FAULTS:
            o = by.get((name, fault))
            if o is None or o["skipped"]:
                cells.append("—")
                continue
            bad = (o["lost_adds"] + o["lost_increments"], o["duplicates"], o["overlaps"])
            text = "/".join(f"**{n}**" if n else "0" for n in bad)
            cells.append(f"{o['ops']:.1f}/s" if fault == "none" else f"{text}, {o['ops']:.1f}/s")
        lines.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Outcome]:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--systems", default="", help="comma-separated names (default: all)")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--seconds", type=float, default=12.0, help="per system and fault")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--work", type=float, default=0.02)
    parser.add_argument("--poll", type=float, help="fencing.Locks' longest pause of a waiter (default 0.5 s)")
    parser.add_argument("--seed", default="40")
    parser.add_argument("--json", help="write the outcomes to this file")
    parser.add_argument("--report", help="print the docs' table of a --json file (runs nothing)")
    args = parser.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return []
    names = list(systems(Cell("", "", 1.0, 0.0)))
    chosen = args.systems.split(",") if args.systems else names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {names}")
    faults = args.faults.split(",")
    if set(faults) - set(FAULTS):
        parser.error(f"faults are {FAULTS}")
    outcomes = []
    print(f"{'system':<26} {'fault':<8} {'ops/s':>7} {'acked':>6} {'lost adds':>9} {'dup':>4} "
          f"{'lost incs':>9} {'overlaps':>8} {'refused':>7} {'faults':>6}  errors")  # fmt: skip
    for name in chosen:
        why = available(systems(Cell(name, "", 1.0, 0.0))[name])
        for fault in faults:
            rng = random.Random(f"{args.seed}-{name}-{fault}")
            outcome = (
                Outcome(name, fault, args.seconds, skipped=why) if why else run_cell(name, fault, args, rng)
            )
            outcomes.append(outcome)
            if outcome.skipped:
                print(f"{name:<26} {fault:<8} not run: {outcome.skipped}")
                continue
            o = outcome
            print(f"{name:<26} {fault:<8} {o.ops:7.1f} {o.acked:6d} {o.lost_adds:9d} {o.duplicates:4d} "
                  f"{o.lost_increments:9d} {o.overlaps:8d} {o.refused:7d} {o.faults:6d}  "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(o.errors.items()))}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ | {"ops": o.ops} for o in outcomes], indent=1))
    return outcomes


if __name__ == "__main__":
    main()
