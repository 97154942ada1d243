"""A bounded, fork-safe, thread-safe cache of stores keyed by SQLite file or server URL.

``service.py`` takes a path on every call; building an engine per call costs ~10x and
leaks descriptors. The hazards a cache must survive:

* thousands of files: least recently used stores are evicted and their connections closed;
* a file deleted (and maybe re-created) between calls: each lookup compares the file's
  identity (device, inode) with the one the store opened, and replaces a stale store (its
  connections are closed before the new file is opened), so no statement ever runs on a
  connection to a file that is no longer at the path. An open connection keeps the old
  inode allocated, so a new file cannot reuse its number.

  What the cache cannot fix is SQLite's: the ``-wal`` and ``-shm`` files go by the path,
  and while any connection (of any process) has the old database open they stay its own;
  SQLite opening a non-empty new file at the path reads it through the old database's WAL
  (old rows, and the new file's pages overwritten at the next checkpoint). SQLite does not
  support replacing or deleting a database file that is in use (sqlite.org/howtocorrupt.html,
  2.4). The cache refuses the case it can see, with :class:`ConfigurationError`: the file it
  had open was replaced by a non-empty one while the ``-wal`` its own connections use is
  still at the path (until that file is gone). A process that never had the old file open
  cannot tell whose WAL it finds; a new *empty* file (``init_db`` after a delete) is safe,
  since SQLite discards the WAL of an empty database;
* ``fork()``: the engines' pools are replaced in the child (:mod:`fencing._runtime.forks`), so a
  cached store goes on working there and never uses or closes its parent's connections;
* threads: lookups and evictions happen under one lock.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import Engine, make_url

from ._dialects import by_name
from ._dialects.urls import parse_url, server_engine
from ._errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseMissing,
    InvalidArgument,
    InvalidArgumentType,
)
from ._runtime.sqlite import create_engine, settings_of
from ._sql.dberrors import database_errors
from ._store.jobstore import JobStore

__all__ = ["StoreCache", "normalize_target"]

_Identity = tuple[int, int]
#: a WAL file: (device, inode) and its 32-byte header, which gets a random salt whenever
#: SQLite starts writing the file from the top (a new WAL on a reused inode is not the old)
_WalMark = tuple[int, int, bytes]


@dataclass
class _Entry:
    store: JobStore
    identity: _Identity | None
    #: set on every hit without the lock; eviction gives used entries a second chance
    used: bool = False


def _identity(path: str) -> _Identity | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino)


def normalize_target(target: object) -> tuple[str, str]:
    """``("file", absolute path)`` for a SQLite file, or ``("url", url)`` for a server."""
    if not isinstance(target, (str, os.PathLike)):
        raise InvalidArgumentType(
            f"path must be a str, os.PathLike or database URL, got {type(target).__name__} {target!r}"
        )
    raw = os.fspath(target)
    if not isinstance(raw, str):
        raise InvalidArgumentType(f"path must be text, not {type(raw).__name__} {raw!r}")
    if "\x00" in raw:
        raise InvalidArgument(f"path must not contain NUL bytes, got {raw!r}")
    if "://" in raw:
        url = parse_url(raw)
        if not by_name(url.get_backend_name()).is_file:
            return "url", url.render_as_string(hide_password=False)
        raw = url.database or ""
    if raw in ("", ":memory:"):
        raise InvalidArgument(f"path must name a database file, got {raw!r}")
    return "file", os.path.abspath(raw)


class StoreCache:
    """At most ``maxsize`` :class:`JobStore` objects, one per SQLite file or server URL."""

    def __init__(self, maxsize: int = 32) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise InvalidArgument(f"maxsize must be an int >= 1, got {maxsize!r}")
        self.maxsize = maxsize
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._normalized: dict[str, tuple[str, str]] = {}
        #: files replaced under this cache whose old WAL is still at the path: refused until
        #: that file is gone (see the module's docstring)
        self._stale_wals: dict[str, _WalMark] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, target: object, *, create: bool = False) -> JobStore:
        """The store for a file path or URL.

        With ``create=False`` a missing SQLite file is an error (and is not created).
        """
        kind, key = self._normalized.get(target, _MISS) if isinstance(target, str) else _MISS
        if kind is None:
            kind, key = normalize_target(target)
            if isinstance(target, str) and os.path.isabs(target) and len(self._normalized) < 4096:
                self._normalized[target] = (kind, key)  # absolute: not relative to the cwd
        identity = _identity(key) if kind == "file" else _SERVER
        # the hit path takes no lock: a dict read is atomic, and a stale entry is never
        # returned from it
        entry = self._entries.get(key)
        if entry is not None and identity is not None and entry.identity == identity:
            entry.used = True
            return entry.store
        if identity is None and not create:
            raise DatabaseMissing(f"no database file at {key!r}; call init_db() to create it")
        if kind == "file" and identity is not None and os.path.isdir(key):
            # SQLite would only say "unable to open database file"
            raise InvalidArgument(f"path is a directory, not a database file: {key!r}")
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if identity is not None and entry.identity == identity:
                    entry.used = True
                    return entry.store  # another thread opened it meanwhile
                # the file at this path is not the one the store's connections have open
                del self._entries[key]
                old_wal = _old_wal_at(key, entry)  # before closing: they pin its inode
                _dispose(entry.store)
                if old_wal is not None and identity is not None and os.path.getsize(key) > 0:
                    self._stale_wals[key] = old_wal
            if key in self._stale_wals:
                if _wal_mark(key) == self._stale_wals[key]:
                    raise ConfigurationError(_stale_wal_message(key))
                del self._stale_wals[key]  # gone (or another file now): safe to open
            store = _open(kind, key)
            if identity is None:
                # open (and so create) the file now, so the identity we keep is the one in use
                try:
                    with database_errors(database=key), store.engine.connect():
                        pass
                except DatabaseError as exc:
                    _dispose(store)
                    raise _creation_error(key, exc) from exc.__cause__
                identity = _identity(key)
            self._make_room()
            self._entries[key] = _Entry(store, identity)
            return store

    def _make_room(self) -> None:
        """Evict until one more entry fits (so the size never exceeds ``maxsize``, not even
        for a moment): least recently used first, approximately, as a used entry gets a
        second chance."""
        while len(self._entries) >= self.maxsize:
            key, entry = next(iter(self._entries.items()))
            if entry.used:
                entry.used = False
                self._entries.move_to_end(key)
            else:
                del self._entries[key]
                _dispose(entry.store)

    def clear(self) -> None:
        """Close every cached store's connections."""
        with self._lock:
            for entry in self._entries.values():
                _dispose(entry.store)
            self._entries.clear()


_MISS: tuple[None, str] = (None, "")

# servers have no file identity to check; a constant stands for "always the same"
_SERVER: _Identity = (-1, -1)


def open_engine(kind: str, key: str) -> Engine:
    """The engine for a target as :func:`normalize_target` gives it: the library's SQLite
    engine for a file, a pre-pinging engine for a server URL."""
    if kind == "file":
        return create_engine(key)
    # pre-ping: a server restart must not hand a dead pooled connection to the next call
    return server_engine(make_url(key), pool_pre_ping=True)


def _open(kind: str, key: str) -> JobStore:
    return JobStore(open_engine(kind, key))


def _creation_error(path: str, exc: DatabaseError) -> DatabaseError:
    """Why a new database file could not be created, when SQLite's own message is only
    "unable to open database file"."""
    parent = os.path.dirname(path)
    if os.path.isdir(parent):
        return exc
    why = "is not a directory" if os.path.exists(parent) else "does not exist"
    return DatabaseError(f"cannot create database file {path!r}: its directory {parent!r} {why}")


def _dispose(store: JobStore) -> None:
    # threads may still be using the evicted store: what they hand back is closed too
    store._ctx.runner.retire()
    store.engine.dispose()


def _wal_mark(path: str) -> _WalMark | None:
    """The WAL at ``path``'s ``-wal``, or ``None`` if there is none or it has no header
    yet (SQLite reads nothing from such a file)."""
    try:
        with open(path + "-wal", "rb") as wal:
            st = os.fstat(wal.fileno())
            header = wal.read(32)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, header) if len(header) == 32 else None


def _old_wal_at(path: str, entry: _Entry) -> _WalMark | None:
    """The WAL at the path if it is the one the entry's open connections use, for the file
    the entry was made for: the old database's, while the path now names another file."""
    settings = settings_of(entry.store.engine)
    files = None if settings is None else settings.files_in_use()
    if files is None or files[0] != entry.identity:
        return None  # nothing open, or opened after the file was replaced: not the old one
    mark = _wal_mark(path)
    return mark if mark is not None and mark[:2] == files[1] else None


def _stale_wal_message(path: str) -> str:
    return (
        f"the SQLite file {path!r} was replaced while this process had the old one open, and "
        f"{path + '-wal'!r} is still the old database's write-ahead log: SQLite would read the "
        "new file through it (old rows; the new file's pages overwritten at the next "
        "checkpoint). Nothing was opened. Once no process has the old database open, delete "
        f"{path + '-wal'!r} and {path + '-shm'!r}; replace a database file only while no "
        "connection has it open (sqlite.org/howtocorrupt.html#unlink)"
    )
