"""Which database an engine reaches, as the database itself tells it.

The library keeps this process from waiting on its own locks (:mod:`fencing._runtime.holds`):
a fenced block's lock is found again by whatever would wait for it. Two engines, or two
stores, reach the same database in ways their URLs do not show: the same SQLite file through
another path (a symlink, a relative path, ``..``), the same server by another host name or
address, a ``FenceMarks`` or a store on another table of the same engine. So the meeting
place is the database's identity, not a URL string:

* **SQLite**: the file's device and inode (``os.stat``, no connection needed); an in-memory
  database is its pool's own. A file that does not exist yet is known by its real path until
  it does.
* **PostgreSQL**: the cluster's ``system_identifier`` (``pg_control_system()``, executable by
  everyone by default; where it was revoked, the server's address and port) and
  ``current_database()``.
* **MariaDB/MySQL**: ``@@hostname``, ``@@port``, ``@@datadir`` and ``DATABASE()``.

A server's identity costs one query, once per pool: on the first connection the store
checks out for a transaction of its own (:func:`note`, called by the runner: no pool
listener, which would take the pool off its lean checkout and count as an observer), or by
:func:`resolve` when a caller needs it before any. Until then :func:`of` answers the URL.
A failed query never fails the operation: the identity stays the URL, and is asked again
at most :data:`ATTEMPTS` times.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine import URL

from .._dialects import of as database_of

__all__ = ["ATTEMPTS", "note", "of", "resolve"]

#: how many times a server's identity is asked for before the URL stands for it for good
ATTEMPTS = 3

#: the identities found, by pool (engines made by ``engine.execution_options()`` share it)
_known: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_tries: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def of(engine: Engine) -> str:
    """The identity of the database ``engine`` reaches, as far as this process knows it now
    (no I/O beyond ``os.stat``): the database's own once known, else its URL."""
    pool = engine.pool
    found = _known.get(pool)
    if found is not None:
        return found
    if database_of(engine.dialect).is_file:
        found = _sqlite(engine.url, pool)
        if found is not None:
            _known[pool] = found
            return found
    return "url " + engine.url.render_as_string(hide_password=False)


def resolve(engine: Engine) -> str:
    """:func:`of`, after asking the server (a connection checked out once) if it was not
    known yet; still the URL if the server would not say."""
    if _settled(engine):
        return of(engine)
    with contextlib.suppress(Exception), engine.connect() as conn:
        note(engine, conn.connection.dbapi_connection)
    return of(engine)


def note(engine: Engine, dbapi_connection: Any) -> bool:
    """Learn a server's identity on ``dbapi_connection``, just checked out of ``engine``'s
    pool and idle, unless it is known (or was asked :data:`ATTEMPTS` times); ``True`` once
    there is nothing left to ask (:func:`_settled`). The connection is handed back as it was
    found (its implicit transaction rolled back); a connection that cannot roll back raises:
    drop it."""
    pool = engine.pool
    if _settled(engine):
        return True
    with _lock:
        _tries[pool] = _tries.get(pool, 0) + 1
    try:
        cursor = dbapi_connection.cursor()
        try:
            found = database_of(engine.dialect).identity(cursor)
        finally:
            cursor.close()
    except Exception:
        found = None
    # the query began a transaction (a driver's implicit BEGIN): end it
    dbapi_connection.rollback()
    if found is not None:
        _known[pool] = found
    return _settled(engine)


def _settled(engine: Engine) -> bool:
    """Nothing left to ask the database: its identity is known, it is SQLite's (known by
    its file, no query), or it was asked :data:`ATTEMPTS` times."""
    pool = engine.pool
    return pool in _known or database_of(engine.dialect).is_file or _tries.get(pool, 0) >= ATTEMPTS


def _sqlite(url: URL, pool: Any) -> str | None:
    database = url.database
    if not database or database == ":memory:":
        return f"sqlite memory {id(pool)}"
    path = database
    if path.startswith("file:"):  # a URI filename (uri=true)
        path = path[len("file:") :].split("?", 1)[0]
        if not path or path == ":memory:":
            return None  # a shared in-memory database is known by its URL
    try:
        st = os.stat(path)
    except OSError:
        return None  # not created yet: its URL until it is
    return f"sqlite {st.st_dev}:{st.st_ino}"
