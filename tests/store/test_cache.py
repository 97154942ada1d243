"""The engine cache behind ``service.py`` (``fencing._engines.StoreCache``), on SQLite files.

It must stay bounded over thousands of files, never serve a file that was deleted or
replaced through a connection to the old one, never let a forked child use its parent's
connections, and be safe to share between threads.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import fencing
import service
from fencing import JobStore
from fencing._engines import StoreCache
from fencing._errors import DatabaseMissing

pytestmark = pytest.mark.backend("sqlite")

ROOT = Path(__file__).resolve().parents[2]
FILES = 1500
#: descriptors one cached store may keep open: a few connections of three files each
#: (database, -wal, -shm); a leak grows with the number of files instead
FDS_PER_STORE = 3 * 3
SLACK = 16


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _make_database(path: str | Path, jobs: tuple[str, ...] = ()) -> None:
    """A database file made without the cache (its WAL checkpointed and gone on return)."""
    engine = fencing.create_sqlite_engine(path)
    store = JobStore(engine)
    try:
        store.create_table()
        for job in jobs:
            store.enqueue(job, ready_at=0.0)
    finally:
        store.engine.dispose()
        engine.dispose()


def _delete_database(path: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


def _rows_on_disk(path: str) -> dict[str, tuple[Any, ...]]:
    """The rows as a connection of its own sees them: what the file at ``path`` holds."""
    conn = sqlite3.connect(path)
    try:
        return {row[0]: row[1:] for row in conn.execute("SELECT id, owner, fence, result, done FROM jobs")}
    finally:
        conn.close()


def _integrity(path: str) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


# -- thousands of files -------------------------------------------------------------------


@pytest.mark.slow
def test_thousands_of_files_keep_descriptors_and_entries_bounded(tmp_path: Path) -> None:
    template = tmp_path / "template.db"
    _make_database(template, ("job",))
    cache = service._stores
    service.state(str(template), "job")  # the first store: imports and lazy setup done
    before = _open_descriptors()
    halfway = 0
    for i in range(FILES):
        path = str(tmp_path / f"db-{i}.db")
        if i % 50 == 0:
            service.init_db(path)
            assert service.enqueue(path, "job")
        else:
            shutil.copyfile(template, path)
        row = service.state(path, "job")
        assert row is not None
        assert row["id"] == "job"
        assert len(cache) <= cache.maxsize
        if i == FILES // 2:
            halfway = _open_descriptors()
    after = _open_descriptors()
    # the second half of the files opened no net descriptors: nothing grows with the count
    assert after - halfway <= SLACK, f"{after - halfway} descriptors leaked over {FILES // 2} files"
    assert after - before <= cache.maxsize * FDS_PER_STORE + SLACK


def test_store_cache_evicts_and_closes_what_it_evicts(tmp_path: Path) -> None:
    template = tmp_path / "template.db"
    _make_database(template, ("job",))
    paths = [str(tmp_path / f"db-{i}.db") for i in range(60)]
    for path in paths:
        shutil.copyfile(template, path)
    before = _open_descriptors()
    cache = StoreCache(maxsize=4)

    for path in paths:
        state = cache.get(path).state("job")
        assert state is not None
        assert len(cache) <= 4
    assert _open_descriptors() - before <= 4 * FDS_PER_STORE + SLACK

    # a cached store is the same object on the next lookup
    last = cache.get(paths[-1])
    assert cache.get(paths[-1]) is last
    cache.clear()
    assert len(cache) == 0
    # every connection the cache opened is closed again
    assert _open_descriptors() <= before


# -- deleted and replaced files -----------------------------------------------------------


def test_recreated_file_is_never_served_from_a_stale_connection(tmp_path: Path) -> None:
    path = str(tmp_path / "jobs.db")
    for cycle in range(10):
        job = f"job-{cycle}"
        if cycle % 2:
            # another program's init_db: this cache sees the new file only on its next call
            other = StoreCache()
            other.get(path, create=True).create_table()
            other.clear()
        else:
            service.init_db(path)
        assert service.state(path, job) is None
        assert service.enqueue(path, job)
        assert service.claim(path, job, "w", 0.0, 10.0) == 1
        if cycle:
            assert service.state(path, f"job-{cycle - 1}") is None, "read through the old file"
        assert service.state(path, job) == {
            "id": job,
            "owner": "w",
            "until": 10.0,
            "fence": 1,
            "result": None,
            "done": 0,
        }
        # the write went to the file at the path, not to an unlinked one
        assert _rows_on_disk(path) == {job: ("w", 1, None, 0)}
        _delete_database(path)
        with pytest.raises(DatabaseMissing):
            service.state(path, job)
        assert not os.path.exists(path)


def test_file_recreated_behind_the_cache_is_read_afresh(tmp_path: Path) -> None:
    path = str(tmp_path / "jobs.db")
    service.init_db(path)
    service.enqueue(path, "job")
    assert service.claim(path, "job", "old-owner", 0.0, 100.0) == 1
    assert service.enqueue(path, "only-old")

    # no call between the deletion and the new file: the cache must notice by itself
    _delete_database(path)
    _make_database(path, ("job", "only-new"))

    assert service.state(path, "only-old") is None
    assert service.state(path, "only-new") is not None
    assert service.state(path, "job") == {
        "id": "job",
        "owner": None,
        "until": 0.0,
        "fence": 0,
        "result": None,
        "done": 0,
    }
    # writes land in the new file too: the job is free there, so it can be claimed
    assert service.claim(path, "job", "new-owner", 0.0, 100.0) == 1
    assert _rows_on_disk(path)["job"] == ("new-owner", 1, None, 0)
    assert _integrity(path) == "ok"


def test_file_replaced_by_another_moved_into_place_is_read_afresh(tmp_path: Path) -> None:
    path = str(tmp_path / "jobs.db")
    service.init_db(path)
    for job in ("shared", "only-old"):
        service.enqueue(path, job)
    assert service.claim(path, "shared", "old-owner", 0.0, 100.0) == 1
    assert service.complete(path, "shared", "old-owner", 1, 1.0, "old result")

    other_dir = tmp_path / "elsewhere"
    other_dir.mkdir()
    other = str(other_dir / "jobs.db")
    _make_database(other, ("shared", "only-new"))
    with contextlib.suppress(FileNotFoundError):
        os.remove(path + "-wal")
    with contextlib.suppress(FileNotFoundError):
        os.remove(path + "-shm")
    os.replace(other, path)

    assert service.state(path, "only-old") is None
    assert service.state(path, "only-new") is not None
    row = service.state(path, "shared")
    assert row is not None
    assert (row["owner"], row["fence"], row["result"], row["done"]) == (None, 0, None, 0)
    assert service.claim(path, "shared", "new-owner", 2.0, 100.0) == 1
    assert service.complete(path, "shared", "new-owner", 1, 3.0, "new result")
    assert _rows_on_disk(path)["shared"] == ("new-owner", 1, "new result", 1)
    assert _integrity(path) == "ok"


# -- fork ---------------------------------------------------------------------------------

FORK_OPS = 40


def _write_jobs(path: str, prefix: str) -> None:
    for i in range(FORK_OPS):
        job = f"{prefix}-{i}"
        assert service.enqueue(path, job)
        fence = service.claim(path, job, prefix, float(i), 10.0)
        assert fence == 1
        assert service.complete(path, job, prefix, fence, float(i) + 1.0, f"{prefix} result {i}")


def _done_by(path: str, prefix: str) -> bool:
    return all(
        (row := service.state(path, f"{prefix}-{i}")) is not None
        and (row["owner"], row["fence"], row["result"], row["done"]) == (prefix, 1, f"{prefix} result {i}", 1)
        for i in range(FORK_OPS)
    )


def _fork_scenario(path: str) -> dict[str, Any]:
    """Use the cache, fork, then use it on both sides at the same time; report what each saw.

    Runs in an interpreter of its own with a single thread (a pytest-xdist worker has more,
    and fork() with threads alive is unsafe and warned about).
    """
    service.init_db(path)
    _write_jobs(path, "before")
    parent_store = service._stores.get(path)
    parent_pool = parent_store.engine.pool
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        report: dict[str, Any] = {}
        try:
            os.close(reader)
            child_store = service._stores.get(path)
            # the engine's pool (and so every connection) is new in the child (fencing._runtime.forks)
            report["child uses the parent's pool"] = child_store.engine.pool is parent_pool
            report["child sees the parent's rows"] = _done_by(path, "before")
            _write_jobs(path, "child")
            report["child sees its own rows"] = _done_by(path, "child")
            # closing the child's cache must not close (or checkpoint) the parent's connections
            service._stores.clear()
            gc.collect()
        except BaseException:
            report["error"] = traceback.format_exc()
        os.write(writer, json.dumps(report).encode())
        os._exit(0)
    os.close(writer)
    _write_jobs(path, "parent")  # while the child writes too
    chunks = []
    while chunk := os.read(reader, 65536):
        chunks.append(chunk)
    os.close(reader)
    _, status = os.waitpid(pid, 0)
    return {
        "child": json.loads(b"".join(chunks) or b"{}"),
        "child exit status": status,
        "parent kept its store": service._stores.get(path) is parent_store,
        "parent kept its pool": parent_store.engine.pool is parent_pool,
        "parent sees the child's rows": _done_by(path, "child"),
        "parent sees its own rows": _done_by(path, "parent"),
        "integrity": _integrity(path),
    }


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX-only")
def test_forked_child_never_uses_the_parents_connections(tmp_path: Path) -> None:
    path = str(tmp_path / "jobs.db")
    script = (
        "import json, sys\n"
        "from tests.store.test_cache import _fork_scenario\n"
        "print(json.dumps(_fork_scenario(sys.argv[1])))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", script, path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["child"] == {
        "child uses the parent's pool": False,
        "child sees the parent's rows": True,
        "child sees its own rows": True,
    }
    assert report["child exit status"] == 0
    assert report["parent kept its store"] is True
    assert report["parent kept its pool"] is True
    assert report["parent sees the child's rows"] is True
    assert report["parent sees its own rows"] is True
    assert report["integrity"] == "ok"
    # and from this process too, through the cache
    assert all(service.state(path, f"{who}-0") is not None for who in ("before", "child", "parent"))


# -- threads ------------------------------------------------------------------------------

THREADS = 8
CALLS = 30


def _hammer(paths: list[str], run: Callable[[str, str, str, int], dict[str, Any] | None]) -> None:
    """THREADS threads, each a full job life cycle per call, spread over ``paths``."""

    def work(thread: int) -> list[tuple[str, str, dict[str, Any] | None]]:
        seen = []
        for k in range(CALLS):
            path = paths[(thread + k) % len(paths)]
            job = f"t{thread}-{k}"
            seen.append((path, job, run(path, job, f"w{thread}", k)))
        return seen

    with ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="hammer") as pool:
        results = [row for rows in pool.map(work, range(THREADS)) for row in rows]

    for path, job, row in results:
        thread, k = job[1:].split("-")
        expected = {
            "id": job,
            "owner": f"w{thread}",
            "until": float(k) + 10.0,
            "fence": 1,
            "result": f"result of {job}",
            "done": 1,
        }
        assert row == expected
        assert _rows_on_disk(path)[job] == (f"w{thread}", 1, f"result of {job}", 1)
    for path in paths:
        assert len(_rows_on_disk(path)) == THREADS * CALLS // len(paths)
        assert _integrity(path) == "ok"


def test_threads_share_the_service_cache_safely(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"db-{i}.db") for i in range(4)]
    for path in paths:
        service.init_db(path)

    def life_cycle(path: str, job: str, owner: str, k: int) -> dict[str, Any] | None:
        assert service.enqueue(path, job)
        fence = service.claim(path, job, owner, float(k), 10.0)
        assert fence == 1
        assert service.complete(path, job, owner, fence, float(k) + 1.0, f"result of {job}")
        return service.state(path, job)

    _hammer(paths, life_cycle)


def test_threads_survive_evictions_of_stores_they_are_using(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"db-{i}.db") for i in range(4)]
    for path in paths:
        _make_database(path)
    cache = StoreCache(maxsize=2)  # fewer than the files: stores are evicted while in use

    def life_cycle(path: str, job: str, owner: str, k: int) -> dict[str, Any] | None:
        assert cache.get(path).enqueue(job, ready_at=0.0)
        lease = cache.get(path).claim(job, owner, now=float(k), ttl=10.0)
        assert lease is not None
        assert lease.fence == 1
        assert cache.get(path).complete(lease, f"result of {job}", now=float(k) + 1.0)
        assert len(cache) <= 2
        state = cache.get(path).state(job)
        return None if state is None else state.as_dict()

    try:
        _hammer(paths, life_cycle)
    finally:
        cache.clear()


# -- missing files ------------------------------------------------------------------------

OPERATIONS: dict[str, Callable[[str], object]] = {
    "state": lambda path: service.state(path, "job"),
    "enqueue": lambda path: service.enqueue(path, "job"),
    "claim": lambda path: service.claim(path, "job", "w", 0.0, 1.0),
    "renew": lambda path: service.renew(path, "job", "w", 1, 0.0, 1.0),
    "complete": lambda path: service.complete(path, "job", "w", 1, 0.0, "r"),
    "release": lambda path: service.release(path, "job", "w", 1),
    "claim_many": lambda path: service.claim_many(path, "job", ["w1", "w2"], 0.0, 1.0),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_missing_database_is_an_error_and_is_not_created(tmp_path: Path, operation: str) -> None:
    path = str(tmp_path / "missing.db")
    with pytest.raises(DatabaseMissing):
        OPERATIONS[operation](path)
    assert os.listdir(tmp_path) == []


def test_missing_directory_is_an_error_and_is_not_created(tmp_path: Path) -> None:
    path = str(tmp_path / "no-such-dir" / "jobs.db")
    with pytest.raises(DatabaseMissing):
        service.state(path, "job")
    assert os.listdir(tmp_path) == []


def test_deleted_database_is_not_recreated_by_a_later_call(tmp_path: Path) -> None:
    path = str(tmp_path / "jobs.db")
    service.init_db(path)
    service.enqueue(path, "job")
    _delete_database(path)  # the cache still holds a store on the old file
    with pytest.raises(DatabaseMissing):
        service.state(path, "job")
    with pytest.raises(DatabaseMissing):
        service.claim(path, "job", "w", 0.0, 1.0)
    assert os.listdir(tmp_path) == []
