"""A bounded, fork-safe, thread-safe cache of stores keyed by SQLite file.

``service.py`` takes a path on every call; building an engine per call costs ~10x and
leaks descriptors. The hazards a cache must survive:

* thousands of files: least recently used stores are evicted and their connections closed;
* a file deleted (and maybe re-created) between calls: each lookup compares the file's
  identity (device, inode) with the one the store opened, and replaces a stale store.
  An open connection keeps the old inode allocated, so a new file cannot reuse its number;
* ``fork()``: a child starts with an empty cache and never closes or uses its parent's
  connections (closing them could checkpoint the parent's WAL);
* threads: lookups and evictions happen under one lock.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .errors import DatabaseMissing, InvalidArgument, InvalidArgumentType
from .sqlite import create_engine
from .store import JobStore
from .store import database_errors as _database_errors

__all__ = ["StoreCache"]

_Identity = tuple[int, int]

# stores whose engines belonged to a parent process: kept referenced, never closed
_INHERITED: list[object] = []


@dataclass
class _Entry:
    store: JobStore
    identity: _Identity | None


def _identity(path: str) -> _Identity | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def normalize_path(path: object) -> str:
    """An absolute path string; the cache key for a database file."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentType(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    raw = os.fspath(path)
    if not isinstance(raw, str):
        raise InvalidArgumentType(f"path must be text, not {type(raw).__name__} {raw!r}")
    if raw == "" or raw == ":memory:":
        raise InvalidArgument(f"path must name a database file, got {raw!r}")
    if "\x00" in raw:
        raise InvalidArgument(f"path must not contain NUL bytes, got {raw!r}")
    return os.path.abspath(raw)


class StoreCache:
    """At most ``maxsize`` :class:`JobStore` objects, one per SQLite file."""

    def __init__(self, maxsize: int = 32) -> None:
        if maxsize < 1:
            raise InvalidArgument(f"maxsize must be >= 1, got {maxsize!r}")
        self.maxsize = maxsize
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, path: object, *, create: bool = False) -> JobStore:
        """The store for ``path``; with ``create=False`` a missing file is an error, not created."""
        key = normalize_path(path)
        identity = _identity(key)
        if identity is None and not create:
            raise DatabaseMissing(f"no database file at {key!r}; call init_db() to create it")
        stale: list[JobStore] = []
        with self._lock:
            if self._pid != os.getpid():
                self._forget_parent()
            entry = self._entries.get(key)
            if entry is not None and identity is not None and entry.identity in (None, identity):
                entry.identity = identity
                self._entries.move_to_end(key)
                return entry.store
            if entry is not None:
                # the file at this path is not the one the store's connections have open
                stale.append(self._entries.pop(key).store)
            store = JobStore(create_engine(key))
            if identity is None:
                # open (and so create) the file now, so the identity we keep is the one in use
                with _database_errors(), store.engine.connect():
                    pass
                identity = _identity(key)
            self._entries[key] = _Entry(store, identity)
            while len(self._entries) > self.maxsize:
                stale.append(self._entries.popitem(last=False)[1].store)
        for old in stale:
            _dispose(old)
        return store

    def clear(self) -> None:
        """Close every cached store's connections."""
        with self._lock:
            if self._pid != os.getpid():
                self._forget_parent()
            stores = [e.store for e in self._entries.values()]
            self._entries.clear()
        for store in stores:
            _dispose(store)

    def _forget_parent(self) -> None:
        _INHERITED.extend(self._entries.values())
        self._entries = OrderedDict()
        self._pid = os.getpid()


def _dispose(store: JobStore) -> None:
    store.dispose()
    store.engine.dispose()
