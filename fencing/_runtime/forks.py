"""``fork()``: what a child process keeps of the engines the library uses, and never touches.

A forked child inherits its parent's connection pools, and with them the parent's open
sockets and SQLite handles. Used from the child, a server connection talks over the
parent's session (a ``COMMIT`` from the child commits the parent's open transaction); a
SQLite handle comes with the parent's copy of SQLite's per-process lock table, so even a
new connection in the child takes no real file locks while an inherited one to the same
file is alive, and the parent's last ``close()`` then checkpoints and deletes the WAL the
child is still writing.

So, in every child, right after ``fork()`` (``os.register_at_fork``), for every engine the
library uses (:func:`register`):

* the engine gets a fresh pool, ``engine.dispose(close=False)``: SQLAlchemy's own guidance
  for pools across ``fork()``; the parent's connections are neither used nor closed;
* connections the library had checked out at the fork (a ``fenced()`` block, an operation
  in another thread) are cut loose from their pool records, SQLAlchemy's recipe, so nothing
  in the child rolls them back, returns or closes them through the pool;
* SQLite only: the parent's idle connections are closed *in the child* (SQLite sends nothing
  to anyone on close, and the parent's file locks are its own), which frees the child's copy
  of the lock table, so the child's new connections lock for real. A connection that was in
  use at the fork (by another thread, or a transaction left open across it) cannot be
  closed safely (a thread may have been inside SQLite); the child keeps it, and the library
  refuses to use that engine in the child (:func:`refusal`), because its locks would not hold.

Forking a process with other threads running is unsafe in general (Python warns about it);
the library does not make it safe, it only never makes it worse.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from .._dialects import of
from . import private_sqlalchemy

__all__ = ["GENERATION", "in_use", "on_child", "refusal", "refuse", "register", "released", "root"]

#: bumped in every forked child; an int compare per operation is cheaper than getpid()
GENERATION = [0]

# engines whose pools the library uses
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
# pool checkouts in flight: id(held) -> (proxy or pool record, thread ident, engine)
_IN_USE: dict[int, tuple[Any, int, Engine]] = {}
# what a child must keep referenced and never close: the parent's pools and handles
_INHERITED: list[object] = []
# engines a child must not use: id(engine) -> why
_REFUSED: dict[int, str] = {}
# dialects whose connections are local to the process: name -> the child's release hook
_LOCAL: dict[str, Callable[[Engine, Any, bool], None]] = {}


def root(engine: Engine) -> Engine:
    """The engine that owns ``engine``'s pool: itself, or for ``engine.execution_options(...)``
    (an ``OptionEngine``, which shares its parent's pool and events) the parent."""
    while (parent := private_sqlalchemy.parent_engine(engine)) is not None:
        engine = parent
    return engine


def register(engine: Engine) -> None:
    """Give ``engine`` a fresh pool in every forked child (idempotent)."""
    _ENGINES.add(root(engine))


def in_use(fairy: Any, engine: Engine) -> None:
    """A pooled connection the library has checked out (until :func:`released`); ``engine``
    as :func:`root` gives it."""
    _IN_USE[id(fairy)] = (fairy, threading.get_ident(), engine)


def released(fairy: Any) -> None:
    _IN_USE.pop(id(fairy), None)


def on_child(dialect: str, release: Callable[[Engine, Any, bool], None]) -> None:
    """Mark ``dialect``'s connections as local to the process (a file's handles, not a
    session on a server) and register what a forked child does with such an engine:
    ``release(engine, inherited_pool, kept)`` runs in the child right after the engine got
    its fresh pool; ``kept`` says a connection in use by another thread at the fork was kept.
    The dialect's glue registers itself (:mod:`fencing._runtime.sqlite`): this module knows no
    dialect."""
    _LOCAL[dialect] = release


def refuse(engine: Engine, why: str) -> None:
    """This (forked) process must not use ``engine``: :func:`refusal` says ``why``."""
    _REFUSED[id(root(engine))] = why


def refusal(engine: Engine) -> str | None:
    """Why this (forked) process must not use ``engine``, or ``None``."""
    return _REFUSED.get(id(root(engine))) if _REFUSED else None


def _cut_loose(held: Any) -> Any:
    """SQLAlchemy's recipe: the pool record (and the proxy, if ``held`` is one) forget the
    DBAPI connection, so nothing returns, resets or closes it through the pool; the
    connection is returned."""
    dbapi = getattr(held, "dbapi_connection", None)
    record = private_sqlalchemy.record_of(held)
    if record is not None:
        record.dbapi_connection = None
    with contextlib.suppress(AttributeError):
        held.dbapi_connection = None
    with contextlib.suppress(Exception):
        held.info.clear()  # e.g. the store's cursor, which would keep the connection alive
    return dbapi


def _after_fork_in_child() -> None:
    GENERATION[0] += 1
    me = threading.get_ident()
    kept_local: set[int] = set()
    in_flight = list(_IN_USE.values())
    _IN_USE.clear()
    for held, thread, engine in in_flight:
        dbapi = _cut_loose(held)
        if dbapi is None:
            continue
        local = of(engine.dialect).family in _LOCAL
        if local and thread == me:
            # this very thread held it (e.g. a fenced() block around the fork): closing a
            # process-local handle tells no one anything (for SQLite, it frees this child's
            # copy of the lock table)
            with contextlib.suppress(Exception):
                dbapi.close()
            continue
        # a server connection (closing it would end the parent's session), or one another
        # thread may have been inside the driver with at the fork: kept, never touched
        _INHERITED.append(dbapi)
        if local:
            kept_local.add(id(engine))
    seen: set[int] = set()
    for engine in list(_ENGINES):
        pool = engine.pool
        if id(pool) in seen:  # an OptionEngine shares its parent's pool
            continue
        seen.add(id(pool))
        _INHERITED.append(pool)
        engine.dispose(close=False)
        release = _LOCAL.get(of(engine.dialect).family)
        if release is not None:
            release(engine, pool, id(engine) in kept_local)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
