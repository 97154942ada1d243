"""A SQLite database that is full or read-only (issue 25): a named error at once, nothing
half-written, and the store works again once space is freed.

* **Full.** ``PRAGMA max_page_count`` is per connection, so a ``checkout`` listener on the
  test's engine sets it on every pooled connection (``1``: SQLite raises it to the current
  size, so the file cannot grow). The tables are then filled with the smallest rows until
  SQLite says full: no free page is left and the last page of every table is full. Every
  writing operation (with the ownership history on, every change of a lease writes a row)
  then raises :class:`~fencing.DatabaseFull` with SQLite's ``SQLITE_FULL`` as the cause, the
  whole database reads as before, and the same call succeeds once space is freed: the limit
  raised, or rows of another table deleted (their pages go to the free list and are used
  with the limit still in force). In both journal modes: WAL (the library's) and a rollback
  journal (an application's own ``connect`` listener after the library's).
* **Read-only.** A read-only file and a read-only directory, for a process that really
  cannot write them: a child forked from the test drops root (which ignores permission
  bits) for ``nobody`` before its first operation. And a ``mode=ro`` URI, as root.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import sqlite3
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Engine, event
from sqlalchemy.pool import NullPool

import fencing
import fencing.asyncio
import service
from fencing import DatabaseFull, DatabaseReadOnly, FenceMarks, History, JobStore, Lease, Locks
from fencing._sql import dberrors
from fencing.asyncio import AsyncFenceMarks, AsyncJobStore, AsyncLocks
from tests import asyncfront

pytestmark = pytest.mark.backend("sqlite")

SQLITE_FULL = 13
SQLITE_READONLY = 8
#: what max_page_count allows once space is "freed" by raising it
NO_LIMIT = 1_073_741_823
NOBODY = 65534

#: the application's own table, written inside fenced blocks
APP_DDL = "CREATE TABLE app_rows (id INTEGER PRIMARY KEY, job TEXT NOT NULL, note TEXT)"
#: pages another table holds, which deleting frees
BALLAST_DDL = "CREATE TABLE ballast (b BLOB)"

#: the smallest row of each table: no real row is smaller, so none fits where these did not
FILLERS = {
    "jobs": "INSERT INTO jobs (id, done) SELECT '#' || i, 1 FROM n",
    "fencing_history": "INSERT INTO fencing_history (job_id, event, at) SELECT '', '', 0 FROM n",
    "fencing_locks": "INSERT INTO fencing_locks (id, done) SELECT '#' || i, 1 FROM n",
    "lock_history": "INSERT INTO lock_history (job_id, event, at) SELECT '', '', 0 FROM n",
    "fence_marks": "INSERT INTO fence_marks (resource, fence) SELECT '#' || i, 0 FROM n",
    "idempotency_keys": "INSERT INTO idempotency_keys (\"key\") SELECT '#' || i FROM n",
    "app_rows": "INSERT INTO app_rows (job) SELECT '' FROM n",
}


class PageLimit:
    """``PRAGMA max_page_count`` on every connection the engine hands out."""

    def __init__(self, engine: Engine) -> None:
        self.pages = NO_LIMIT
        self.engine = engine
        event.listen(engine, "checkout", self._apply)

    def _apply(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA max_page_count = {self.pages}")
        finally:
            cursor.close()

    def remove(self) -> None:
        event.remove(self.engine, "checkout", self._apply)


def _raw(path: Path) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(path, isolation_level=None))


def fill_up(path: Path, tables: list[str]) -> None:
    """Fill ``tables`` with their smallest rows until SQLite says the database is full (its
    size as it is now the limit): no free page left, the last page of each table full."""
    with _raw(path) as conn:
        conn.execute("PRAGMA max_page_count = 1")  # raised to the current size
        made = 0  # keys stay unique and short: '#' and a number in hex
        for table in tables:
            rows = 512
            while rows:  # as many rows per statement as fit, then fewer, down to one
                sql = f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {rows}) "
                try:
                    conn.execute(sql + FILLERS[table].replace("'#' || i", f"printf('#%x', i + {made})"))
                    made += rows
                except sqlite3.OperationalError as exc:
                    if not dberrors.is_full(exc):
                        raise
                    rows //= 2
        assert conn.execute("PRAGMA freelist_count").fetchone() == (0,)


def dump(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, in order."""
    with _raw(path) as conn:
        names = [
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        ]
        return {name: conn.execute(f'SELECT * FROM "{name}" ORDER BY rowid').fetchall() for name in names}


def assert_full(exc: BaseException) -> None:
    """The exact class, with SQLite's SQLITE_FULL as the cause."""
    assert type(exc) is DatabaseFull, repr(exc)
    driver = getattr(exc.__cause__, "orig", exc.__cause__)
    assert isinstance(driver, sqlite3.OperationalError), repr(exc.__cause__)
    assert dberrors.is_full(driver), repr(driver)
    assert "full" in str(exc) and "nothing was written" in str(exc)


@dataclass
class World:
    """One database with every table the library writes, through one front."""

    path: Path
    store: Any
    locks: Any
    marks: Any
    limit: PageLimit
    lease: Lease  # job-0, live until 40
    lock: Lease  # "held", live until 40


def _journal(mode: str) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA journal_mode = {mode}")
            assert cursor.fetchone()[0] == mode.lower()
        finally:
            cursor.close()

    return on_connect


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def front(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["WAL", "DELETE"])
def journal(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def world(request: pytest.FixtureRequest, front: str, journal: str, tmp_path: Path) -> Iterator[World]:
    path = tmp_path / "jobs.db"
    md = sqlalchemy.MetaData()
    history = History(fencing.history_table(md), retention=None, renewals=True)
    lock_history = History(fencing.history_table(md, "lock_history"), retention=None, renewals=True)
    # a rollback journal: every connection switches out of WAL, so none may stay open
    pooling: dict[str, Any] = {} if journal == "WAL" else {"poolclass": NullPool}
    loop: asyncio.AbstractEventLoop | None = None
    if front == asyncfront.ASYNC:
        loop = asyncio.new_event_loop()
        async_engine = fencing.asyncio.create_sqlite_engine(path, **pooling)
        engine = async_engine.sync_engine
        store: Any = asyncfront.BlockingAsyncStore(AsyncJobStore(async_engine, history=history), loop)
        locks: Any = asyncfront.BlockingAsyncLocks(AsyncLocks(async_engine, history=lock_history), loop)
        marks: Any = asyncfront.Blocking(AsyncFenceMarks(async_engine), loop)
    else:
        engine = fencing.create_sqlite_engine(path, **pooling)
        store = JobStore(engine, history=history)
        locks = Locks(engine, history=lock_history)
        marks = FenceMarks(engine)
    if journal != "WAL":
        event.listen(engine, "connect", _journal(journal))  # after the library's listener
    limit = PageLimit(engine)
    try:
        store.create_table()
        locks.create_table()
        marks.create_tables()
        for i in range(4):
            store.enqueue(f"job-{i}", ready_at=0.0)
        lease = store.claim("job-0", "w", now=10.0, ttl=30.0)
        lock = locks.try_acquire("held", "w", ttl=30.0, now=10.0)
        assert lease is not None and lock is not None
        with _raw(path) as conn:
            conn.execute(APP_DDL)
            conn.execute(
                "INSERT INTO app_rows (job, note) VALUES ('job-0', 'written before the database was full')"
            )
            conn.execute(BALLAST_DDL)
            conn.executemany("INSERT INTO ballast VALUES (zeroblob(3000))", [()] * 24)
        fill_up(path, list(FILLERS))
        limit.pages = 1  # raised to the current size by SQLite: nothing can grow
        if loop is not None:
            request.node._fencing_loop = loop  # type: ignore[attr-defined]  # the body runs on it
        yield World(path, store, locks, marks, limit, lease, lock)
    finally:
        limit.remove()
        if loop is not None:
            asyncfront.dispose(async_engine, loop)
            loop.close()
        else:
            engine.dispose()


def _fenced_app_update(w: World, *, complete: bool = False) -> bool:
    """A fenced block whose own write fits (an UPDATE that shrinks its row); the store's end
    writes the history."""
    with w.store.fenced(w.lease, now=11.0, complete=complete, result="done") as conn:
        conn.exec_driver_sql("UPDATE app_rows SET note = 'in block' WHERE job = 'job-0'")
    return True


#: every writing operation, and what it returns once there is room
OPERATIONS: dict[str, tuple[Callable[[World], Any], Callable[[Any], bool]]] = {
    "enqueue": (
        lambda w: w.store.enqueue("job-enqueued-on-a-full-database", ready_at=0.0),
        lambda r: r is True,
    ),
    "claim": (lambda w: w.store.claim("job-1", "w2", now=11.0, ttl=30.0), lambda r: r.fence == 1),
    "claim_next one": (
        lambda w: w.store.claim_next("w2", now=11.0, ttl=30.0),
        lambda r: [x.job_id for x in r] == ["job-1"],
    ),
    "claim_next three": (
        lambda w: w.store.claim_next("w2", now=11.0, ttl=30.0, limit=3),
        lambda r: [x.job_id for x in r] == ["job-1", "job-2", "job-3"],
    ),
    "renew": (lambda w: w.store.renew(w.lease, now=11.0, ttl=30.0), lambda r: r.until == 41.0),
    "release": (lambda w: w.store.release(w.lease), lambda r: r is True),
    "complete": (lambda w: w.store.complete(w.lease, "done", now=11.0), lambda r: r is True),
    "complete a large result": (
        lambda w: w.store.complete(w.lease, "x" * 20000, now=11.0),
        lambda r: r is True,
    ),
    "complete_many": (lambda w: w.store.complete_many([(w.lease, "done")], now=11.0), lambda r: r == [True]),
    "complete_and_claim_next": (
        lambda w: w.store.complete_and_claim_next([(w.lease, "done")], "w", now=11.0, ttl=30.0),
        lambda r: r[0] == [True] and [x.job_id for x in r[1]] == ["job-1"],
    ),
    "revoke": (lambda w: w.store.revoke("job-0"), lambda r: r is True),
    "delete": (lambda w: w.store.delete("job-0"), lambda r: r is True),
    "fenced": (_fenced_app_update, lambda r: r is True),
    "fenced complete": (lambda w: _fenced_app_update(w, complete=True), lambda r: r is True),
    "FenceMarks.accept": (lambda w: w.marks.accept("the-printer-on-the-third-floor", 3), lambda r: r is True),
    "FenceMarks.record_once": (
        lambda w: w.marks.record_once("charge:order-1234567890", fence=3),
        lambda r: r is True,
    ),
    "Locks.try_acquire": (
        lambda w: w.locks.try_acquire("a-lock-never-taken-before", "w2", ttl=30.0, now=11.0),
        lambda r: r is not None and r.fence == 1,
    ),
    "Locks.renew": (lambda w: w.locks.renew(w.lock, ttl=30.0, now=11.0), lambda r: isinstance(r, Lease)),
    "Locks.release": (lambda w: w.locks.release(w.lock), lambda r: r is True),
}


def free_space(w: World, how: str) -> None:
    if how == "limit raised":
        w.limit.pages = NO_LIMIT
        return
    with _raw(w.path) as conn:  # the limit stays; the ballast's pages go to the free list
        conn.execute("DELETE FROM ballast")
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] >= 24


@pytest.mark.parametrize("how", ["limit raised", "rows deleted"])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_a_write_to_a_full_database_raises_database_full_and_changes_nothing_until_space_is_freed(
    world: World, name: str, how: str
) -> None:
    run, succeeded = OPERATIONS[name]
    before = dump(world.path)
    with pytest.raises(DatabaseFull) as info:
        run(world)
    assert_full(info.value)
    assert dump(world.path) == before  # nothing half-written, in any table
    with pytest.raises(DatabaseFull):  # and it stays so while the database is full
        run(world)
    assert dump(world.path) == before

    free_space(world, how)
    assert succeeded(run(world))
    assert dump(world.path) != before


def test_an_application_write_in_a_fenced_block_that_finds_no_room_keeps_nothing(world: World) -> None:
    """The block's own statement fails with its own error (the library passes it up as it
    was: it is the application's statement), the block is rolled back whole, and the same
    block commits once space is freed."""
    before = dump(world.path)

    def block() -> None:
        with world.store.fenced(world.lease, now=11.0, complete=True, result="done") as conn:
            conn.exec_driver_sql("INSERT INTO app_rows (job, note) VALUES ('job-0', 'a new row')")

    with pytest.raises(sqlalchemy.exc.OperationalError) as info:
        block()
    assert dberrors.is_full(info.value.orig), repr(info.value.orig)
    assert dump(world.path) == before
    free_space(world, "rows deleted")
    block()
    assert world.store.state("job-0").done
    assert ("a new row",) in [row[2:] for row in dump(world.path)["app_rows"]]


# -- service.py ------------------------------------------------------------------------------


@pytest.fixture
def full_service_db(tmp_path: Path) -> Iterator[tuple[Path, PageLimit]]:
    """A database behind ``service.py`` with job-0 claimed by w (fence 1, until 40), full."""
    path = tmp_path / "jobs.db"
    service.init_db(path)
    for job in ("job-0", "job-1"):
        assert service.enqueue(path, job)
    assert service.claim(path, "job-0", "w", 10.0, 30.0) == 1
    with _raw(path) as conn:
        conn.execute(BALLAST_DDL)
        conn.executemany("INSERT INTO ballast VALUES (zeroblob(3000))", [()] * 24)
    fill_up(path, ["jobs"])
    engine = service._stores.get(path).engine
    limit = PageLimit(engine)
    engine.dispose()  # every connection from now on gets the limit
    limit.pages = 1
    try:
        yield path, limit
    finally:
        limit.remove()
        service._stores.clear()


LONG_OWNER = "a-worker-whose-name-takes-more-room-than-a-page-has-left"

SERVICE_WRITES: dict[str, tuple[Callable[[Path], Any], Any]] = {
    "enqueue": (lambda p: service.enqueue(p, "job-enqueued-on-a-full-database"), True),
    # a row that grows by a long owner's bytes: its page has no room for them
    "claim": (lambda p: service.claim(p, "job-1", LONG_OWNER, 11.0, 30.0), 1),
    "complete": (lambda p: service.complete(p, "job-0", "w", 1, 11.0, "x" * 20000), True),
    "claim_many": (lambda p: service.claim_many(p, "job-1", [LONG_OWNER], 11.0, 30.0), [1]),
}


@pytest.mark.parametrize("name", list(SERVICE_WRITES))
def test_service_writes_to_a_full_database_raise_database_full_and_work_once_space_is_freed(
    full_service_db: tuple[Path, PageLimit], name: str
) -> None:
    """The contract says nothing of a database that fails: the library's error passes up,
    and no call answers as if the write had been refused by the rules."""
    path, limit = full_service_db
    call, expected = SERVICE_WRITES[name]
    before = dump(path)
    with pytest.raises(DatabaseFull) as info:
        call(path)
    assert_full(info.value)
    assert str(path) in str(info.value)
    assert dump(path) == before
    limit.pages = NO_LIMIT
    assert call(path) == expected


def test_release_on_a_full_database_needs_no_room(full_service_db: tuple[Path, PageLimit]) -> None:
    """A write that shrinks its row takes no page: a full database does not refuse it."""
    path, _ = full_service_db
    assert service.release(path, "job-0", "w", 1) is True
    assert service.state(path, "job-0") == {
        "id": "job-0",
        "owner": None,
        "until": 0.0,
        "fence": 1,
        "result": None,
        "done": 0,
    }


# -- read-only files and directories -----------------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory ``nobody`` can reach (pytest's own temporary directories are root's only)."""
    where = Path(tempfile.mkdtemp(prefix="fencing-ro-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        for sub in where.iterdir():
            sub.chmod(0o755)
        shutil.rmtree(where)


def _database_in(directory: Path) -> Path:
    directory.mkdir()
    path = directory / "jobs.db"
    store = JobStore(fencing.create_sqlite_engine(path))
    store.create_table()
    store.enqueue("job-0", ready_at=0.0)
    store.engine.dispose()
    assert not os.path.exists(f"{path}-wal")  # checkpointed and gone: it must be made again
    return path


def as_nobody(check: Callable[[], None]) -> None:
    """Run ``check`` in a child forked from this process that is no longer root (root ignores
    permission bits); a failure there fails the test with the child's traceback."""
    # everything the child will import is imported here: it cannot read root's files
    for module in ("sqlalchemy.dialects.sqlite.aiosqlite", "sqlalchemy.dialects.sqlite.pysqlite"):
        importlib.import_module(module)

    read, write = os.pipe()
    with warnings.catch_warnings():  # the child uses nothing it inherited but the interpreter
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            check()
            os.write(write, b"ok")
            status = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode())
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert said == "ok" and status == 0, said


def _first_operation_read_only(path: Path, *, what: str, reads_work: bool) -> None:
    """Every front's first write raises DatabaseReadOnly naming ``what``; nothing changes."""
    before = path.read_bytes()

    def refused(call: Callable[[], Any]) -> None:
        with pytest.raises(DatabaseReadOnly) as info:
            call()
        assert type(info.value) is DatabaseReadOnly
        driver = getattr(info.value.__cause__, "orig", info.value.__cause__)
        assert dberrors.is_read_only(driver), repr(driver)
        assert what in str(info.value) and "writable for this user" in str(info.value), str(info.value)

    def check() -> None:
        refused(lambda: service.enqueue(path, "job-new"))
        refused(lambda: service.claim(path, "job-0", "w", 10.0, 30.0))
        if reads_work:
            assert service.state(path, "job-0") is not None
        else:  # a WAL database cannot even be read without its -wal and -shm
            refused(lambda: service.state(path, "job-0"))
        engine = fencing.create_sqlite_engine(path)
        refused(lambda: JobStore(engine).claim("job-0", "w", now=10.0, ttl=30.0))
        engine.dispose()

        async def claim_async() -> None:
            async_engine = fencing.asyncio.create_sqlite_engine(path)
            try:
                await AsyncJobStore(async_engine).claim("job-0", "w", now=10.0, ttl=30.0)
            finally:
                await async_engine.dispose()

        refused(lambda: asyncio.run(claim_async()))

    as_nobody(check)
    assert path.read_bytes() == before
    assert service.state(path, "job-0") == {
        "id": "job-0",
        "owner": None,
        "until": 0.0,
        "fence": 0,
        "result": None,
        "done": 0,
    }
    service._stores.clear()


def test_a_read_only_database_file_is_refused_at_the_first_write_naming_it(shared_dir: Path) -> None:
    path = _database_in(shared_dir / "files")
    (shared_dir / "files").chmod(0o777)  # the directory is writable: only the file is not
    path.chmod(0o444)
    _first_operation_read_only(path, what=repr(str(path)), reads_work=True)


def test_a_read_only_directory_is_refused_at_the_first_operation_naming_it(shared_dir: Path) -> None:
    path = _database_in(shared_dir / "locked")
    path.chmod(0o666)  # the file is writable: its directory is not, where the -wal goes
    (shared_dir / "locked").chmod(0o555)
    _first_operation_read_only(path, what=repr(str(shared_dir / "locked")), reads_work=False)


def test_a_new_database_in_a_read_only_directory_is_refused_naming_the_directory(shared_dir: Path) -> None:
    directory = shared_dir / "locked"
    directory.mkdir(mode=0o555)
    directory.chmod(0o555)
    new = directory / "new.db"

    def check() -> None:
        for init in (
            lambda: service.init_db(new),
            lambda: JobStore(fencing.create_sqlite_engine(new)).create_table(),
        ):
            with pytest.raises(DatabaseReadOnly) as info:
                init()
            assert type(info.value) is DatabaseReadOnly
            assert repr(str(directory)) in str(info.value), str(info.value)

    as_nobody(check)
    assert list(directory.iterdir()) == []


def test_a_database_opened_read_only_by_uri_is_refused_at_the_first_write(target: str) -> None:
    """``mode=ro`` (an application's own engine, configured): reads work, writes are refused."""
    path = Path(target)
    store = JobStore(fencing.create_sqlite_engine(path))
    store.create_table()
    store.enqueue("job-0", ready_at=0.0)
    store.engine.dispose()
    before = dump(path)
    engine = fencing.configure_sqlite(sqlalchemy.create_engine(f"sqlite:///file:{path}?mode=ro&uri=true"))
    try:
        read_only = JobStore(engine)
        assert read_only.state("job-0") is not None
        with pytest.raises(DatabaseReadOnly, match="opened read-only") as info:
            read_only.claim("job-0", "w", now=10.0, ttl=30.0)
        assert type(info.value) is DatabaseReadOnly
        with pytest.raises(DatabaseReadOnly):
            read_only.enqueue("job-new", ready_at=0.0)
    finally:
        engine.dispose()
    assert dump(path) == before
