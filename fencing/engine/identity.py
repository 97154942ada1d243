"""Which database an engine reaches, as the database itself tells it.

The library keeps this process from waiting on its own locks (:mod:`fencing.runtime.holds`):
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

A server's identity costs one query, once per pool: on the first connection checked out
after :func:`watch` (a ``checkout`` listener that does nothing more once it is known), or by
:func:`resolve` when a caller needs it before any. Until then :func:`of` answers the URL.
A failed query never fails the checkout: the identity stays the URL, and is tried again at
most :data:`ATTEMPTS` times.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import URL

__all__ = ["ATTEMPTS", "of", "resolve", "watch"]

#: how many times a server's identity is asked for before the URL stands for it for good
ATTEMPTS = 3

#: the identities found, by pool (engines made by ``engine.execution_options()`` share it)
_known: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_tries: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_listeners: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def of(engine: Engine) -> str:
    """The identity of the database ``engine`` reaches, as far as this process knows it now
    (no I/O beyond ``os.stat``): the database's own once known, else its URL."""
    pool = engine.pool
    found = _known.get(pool)
    if found is not None:
        return found
    if engine.dialect.name == "sqlite":
        found = _sqlite(engine.url, pool)
        if found is not None:
            _known[pool] = found
            return found
    return "url " + engine.url.render_as_string(hide_password=False)


def resolve(engine: Engine) -> str:
    """:func:`of`, after asking the server (a connection checked out once) if it was not
    known yet; still the URL if the server would not say."""
    pool = engine.pool
    if pool in _known or engine.dialect.name == "sqlite" or _tries.get(pool, 0) >= ATTEMPTS:
        return of(engine)
    watch(engine)
    with contextlib.suppress(Exception), engine.connect():
        pass  # the checkout listener asks
    return of(engine)


def watch(engine: Engine) -> None:
    """Learn a server's identity from the first connection ``engine`` checks out (idempotent)."""
    pool = engine.pool
    if engine.dialect.name == "sqlite" or pool in _known:
        return
    with _lock:
        if pool in _listeners:
            return
        dialect = engine.dialect.name
        weak_pool = weakref.ref(pool)  # the listener, kept by the pool, must not keep it alive

        def on_checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
            pool = weak_pool()
            if pool is None or pool in _known or _tries.get(pool, 0) >= ATTEMPTS:
                return
            _tries[pool] = _tries.get(pool, 0) + 1
            _learn(pool, dialect, dbapi_connection, record)

        _listeners[pool] = on_checkout
        event.listen(pool, "checkout", on_checkout)


def _learn(pool: Any, dialect: str, dbapi_connection: Any, record: Any) -> None:
    try:
        cursor = dbapi_connection.cursor()
        try:
            found = _ask(dialect, cursor)
        finally:
            cursor.close()
    except Exception:
        found = None
    # the query began a transaction (a driver's implicit BEGIN): end it, so the checkout
    # hands over the connection as it found it
    try:
        dbapi_connection.rollback()
    except Exception:
        record.invalidate()  # a connection that cannot roll back is not one to hand over
        raise
    if found is not None:
        _known[pool] = found


def _ask(dialect: str, cursor: Any) -> str | None:
    if dialect == "postgresql":
        cursor.execute("SELECT current_database(), has_function_privilege('pg_control_system()', 'EXECUTE')")
        database, can_read_control = cursor.fetchone()
        if can_read_control:
            cursor.execute("SELECT system_identifier FROM pg_control_system()")
            (system,) = cursor.fetchone()
            return f"postgresql {system} {database}"
        cursor.execute("SELECT host(inet_server_addr()), inet_server_port()")
        host, port = cursor.fetchone()
        if host is None:  # a Unix socket: no address to tell two servers apart by
            return None
        return f"postgresql {host}:{port} {database}"
    if dialect in ("mysql", "mariadb"):
        cursor.execute("SELECT @@hostname, @@port, @@datadir, DATABASE()")
        host, port, datadir, database = cursor.fetchone()
        return f"mysql {host}:{port}:{datadir} {database}"
    return None


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
