"""SQLite files that are not what they were: replaced under the cache, or damaged.

* The cache behind ``service.py`` never runs a statement on a connection to a file that is
  no longer at the path. SQLite itself does not support replacing a database file while a
  connection has it open (its ``-wal`` goes by the path and stays the old database's): the
  case this process can see, a file it had open replaced by a non-empty one while its old
  WAL is still there, is refused with ``ConfigurationError`` until that WAL is gone; a file
  replaced once nothing had it open, or re-created empty, is simply opened.
* ``init_db`` / ``create_table`` run ``PRAGMA quick_check`` on the jobs table once and refuse
  a damaged file with ``DatabaseCorrupt``, writing nothing (the contract's ``init_db`` never
  overwrites an existing file).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import fencing
import service
from fencing import ConfigurationError, DatabaseCorrupt, DatabaseError, JobStore
from fencing._engines import StoreCache

pytestmark = pytest.mark.backend("sqlite")


def _make_database(path: Path, jobs: list[str]) -> None:
    """A database made and closed without the cache: its WAL checkpointed and deleted."""
    engine = fencing.create_sqlite_engine(path)
    store = JobStore(engine)
    try:
        store.create_table()
        with engine.begin() as conn:
            conn.execute(
                store.table.insert(), [{"id": job, "owner": "w", "result": f"{job} " * 3} for job in jobs]
            )
    finally:
        engine.dispose()
    assert not os.path.exists(f"{path}-wal")


def _ids_on_disk(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return {row[0] for row in conn.execute("SELECT id FROM jobs")}


def _remove_wal_and_shm(path: Path) -> None:
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{path}{suffix}")


# -- replaced files ---------------------------------------------------------------------------


def test_a_file_replaced_while_this_process_had_it_open_is_refused_until_its_old_wal_is_gone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "jobs.db"
    service.init_db(path)
    assert service.enqueue(path, "old")  # the cache keeps a connection, and so the WAL, open
    _make_database(tmp_path / "new.db", ["new"])
    os.replace(tmp_path / "new.db", path)  # a restore from a backup, say, with -wal left behind
    replaced = path.read_bytes()

    # read through the old WAL, the new file would show "old" and hide "new"
    for call in (
        lambda: service.state(path, "new"),
        lambda: service.enqueue(path, "x"),
        lambda: service.init_db(path),
    ):
        with pytest.raises(ConfigurationError, match="was replaced while this process had the old one open"):
            call()
    assert path.read_bytes() == replaced

    _remove_wal_and_shm(path)  # what the error says to do, once no process has the old file open
    assert service.state(path, "old") is None
    assert service.state(path, "new") is not None
    assert service.enqueue(path, "after")
    assert _ids_on_disk(path) == {"new", "after"}


def test_a_refusal_ends_when_a_new_wal_takes_the_old_ones_place(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    service.init_db(path)
    assert service.enqueue(path, "old")
    _make_database(tmp_path / "new.db", ["new"])
    os.replace(tmp_path / "new.db", path)
    with pytest.raises(ConfigurationError):
        service.state(path, "new")
    _remove_wal_and_shm(path)
    # another program opens the new file first: a new WAL, maybe on the old one's inode number
    with contextlib.closing(sqlite3.connect(path)) as other:
        other.execute("INSERT INTO jobs (id) VALUES ('by-other')")
        other.commit()
        assert os.path.exists(f"{path}-wal")
        assert service.state(path, "by-other") is not None
        assert service.state(path, "new") is not None
    assert _ids_on_disk(path) == {"new", "by-other"}


def test_a_file_replaced_after_this_process_closed_it_is_read_afresh(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    cache = StoreCache()
    try:
        cache.get(path, create=True).create_table()
        assert cache.get(path).enqueue("old", ready_at=0.0)
        cache.get(path).engine.dispose()  # nothing has the file open: SQLite removed its WAL
        _make_database(tmp_path / "new.db", ["new"])
        os.replace(tmp_path / "new.db", path)
        store = cache.get(path)
        assert store.state("old") is None
        assert store.state("new") is not None
        assert store.enqueue("after", ready_at=0.0)
    finally:
        cache.clear()
    assert _ids_on_disk(path) == {"new", "after"}


def test_a_deleted_file_recreated_empty_by_init_db_is_opened_despite_the_old_wal(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    service.init_db(path)
    assert service.enqueue(path, "old")
    os.remove(path)  # the old -wal and -shm stay: the cache still has them open
    assert os.path.exists(f"{path}-wal")
    service.init_db(path)  # a new, empty file: SQLite drops the WAL of an empty database
    assert service.state(path, "old") is None
    assert service.enqueue(path, "new")
    assert _ids_on_disk(path) == {"new"}


# -- damaged files ----------------------------------------------------------------------------


def _damage_a_middle_page_of_the_table(path: Path, where: str) -> None:
    """Overwrite 64 bytes of a full leaf page of the jobs table near the middle of the file:
    its page header, or the middle of its cells (never the file's 100-byte header)."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[16:18], "big")
    pages = len(data) // size
    for number in sorted(range(1, pages), key=lambda n: abs(n - pages // 2)):
        page = number * size
        cells = int.from_bytes(data[page + 5 : page + 7], "big")  # where its cell content starts
        if data[page] == 0x0D and size - cells > size // 2:  # a table leaf, more than half full
            at = page if where == "page header" else cells + page + (size - cells) // 2
            data[at : at + 64] = bytes(range(7, 71))
            path.write_bytes(bytes(data))
            return
    pytest.fail("no full table leaf page: the test database is too small")


@pytest.mark.parametrize("where", ["page header", "cells"])
def test_init_db_refuses_a_file_whose_jobs_pages_are_damaged_and_writes_nothing(
    tmp_path: Path, where: str
) -> None:
    path = tmp_path / "jobs.db"
    _make_database(path, [f"job-{n:05d}" for n in range(2000)])
    _damage_a_middle_page_of_the_table(path, where)
    damaged = path.read_bytes()
    with pytest.raises(DatabaseCorrupt, match=r"is corrupt: PRAGMA quick_check of table 'jobs'") as excinfo:
        service.init_db(path)
    assert isinstance(excinfo.value, DatabaseError)
    assert str(path) in str(excinfo.value)
    assert path.read_bytes() == damaged

    # the library's create_table is where the check lives
    engine = fencing.create_sqlite_engine(path)
    try:
        with pytest.raises(DatabaseCorrupt):
            JobStore(engine).create_table()
    finally:
        engine.dispose()
    assert path.read_bytes() == damaged


def test_init_db_on_a_sound_file_keeps_every_row(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    jobs = [f"job-{n:05d}" for n in range(2000)]
    _make_database(path, jobs)
    service.init_db(path)
    service.init_db(path)
    state: dict[str, Any] | None = service.state(path, "job-01000")
    assert state is not None and state["result"] == "job-01000 " * 3
    assert _ids_on_disk(path) == set(jobs)
