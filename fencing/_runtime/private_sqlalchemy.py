"""Every private SQLAlchemy name the library reads, in this one module, and what each buys.

The rest of the library uses SQLAlchemy's public API only. Each name here is pinned by
``tests/databases/test_private_sqlalchemy.py`` on the lowest and the newest SQLAlchemy of the test
matrix; where one is missing, the code falls back to the public way (the figures are the
price of the fallback).

**A lean checkout** (:class:`Checkout`, :func:`give_back`). ``engine.raw_connection()``
checks a connection out of the engine's pool inside a proxy, SQLAlchemy's
``_ConnectionFairy``, which exists to run the pool's ``checkout``/``checkin``/``reset``
events, pre-ping, debug logging and the garbage-collection safety net for a connection nobody
returned. When the pool has none of those to run (no such listener, no ``pool_pre_ping``, no
``echo_pool="debug"``), the store takes the pool's connection record the way
``_ConnectionRecord.checkout()`` does (``Pool._do_get``), and gives it back the way a failed
checkout does (``_checkin_failed``, ``checkin(_fairy_was_created=False)``), without the proxy:
the same ``pool_size``/``max_overflow`` accounting, the same ``pool_timeout`` wait, the same
``connect`` events, recycling and invalidation, and ``engine.dispose()`` closes what it
returned. It saves about 3 µs of the 5-6.5 µs a checkout costs (SQLite, PostgreSQL), and on
MariaDB the 29 µs round trip of the pool's reset ``ROLLBACK`` after the store's own
``COMMIT``. Through the proxy, ``_close_special(transaction_reset=True)`` tells the pool the
transaction was ended, as Core does after its own ``COMMIT``, so it is not rolled back again
(MariaDB's round trip again).

**Retiring a dead server's connections** (:func:`retire_older`): ``Pool._invalidate`` marks
every connection the pool made before now to be replaced at its next checkout, as Core does
on a disconnect, so a restarted server's closed connections do not each fail a call in turn.
Without it, each fails once and is replaced.

**The engine that owns a pool, and a proxy's record** (:func:`parent_engine`,
:func:`record_of`): ``engine.execution_options(...)`` makes an ``OptionEngine`` that shares its
parent's pool and events, reachable only as ``_proxied``; the settings the library installs
live on the parent. What survives ``fork()`` follows SQLAlchemy's recipe, which forgets the
DBAPI connection on the pool's record: a proxy's record is ``_connection_record``.

**The float bind processor** (:data:`FLOAT_BINDING`): ``sqlalchemy.engine.processors`` is
not documented; its ``to_float`` is what SQLite's dialect binds a ``Double`` with. The store's
numbers are floats already (its argument checks), so the driver path skips it: a call per
bound number saved on every statement.

**Whether an engine's or a connection's transactions are AUTOCOMMIT**
(:func:`engine_isolation_level`, :func:`believes_autocommit`): ``create_engine(
isolation_level=...)`` is kept on the dialect (``_on_connect_isolation_level``), and a
Connection's own answer is ``_is_autocommit_isolation()``; the library refuses AUTOCOMMIT
because lock + check + write must be one transaction. For the drivers it knows, the library
reads the driver itself instead (:func:`fencing._runtime.admission.autocommit_probe`).

**The asyncio bridge** (:data:`greenlet_spawn`, :data:`await_only`, :data:`in_greenlet`):
``sqlalchemy.util.concurrency`` is not documented, yet it is the bridge every async engine
runs on: ``greenlet_spawn`` runs sync code on the event loop's thread, ``await_only`` awaits a
driver's coroutine from inside it, ``in_greenlet`` says whether code runs there. They let the
async fronts run the sync rules unchanged (one set of units for both fronts); the public
``AsyncConnection.run_sync`` needs a connection first, where an operation may need none, or
two.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine.processors import to_float as FLOAT_BINDING
from sqlalchemy.pool import Pool
from sqlalchemy.pool.base import _ConnectionFairy, _ConnectionRecord
from sqlalchemy.util.concurrency import await_only, greenlet_spawn, in_greenlet

__all__ = [
    "FLOAT_BINDING",
    "RECORDS",
    "Checkout",
    "await_only",
    "believes_autocommit",
    "engine_isolation_level",
    "give_back",
    "greenlet_spawn",
    "in_greenlet",
    "parent_engine",
    "record_of",
    "retire_older",
]


def _record_path_available() -> bool:
    try:
        checkin = inspect.signature(_ConnectionRecord.checkin).parameters
    except (TypeError, ValueError):  # pragma: no cover - not a plain function
        return False
    return (
        "_fairy_was_created" in checkin
        and callable(getattr(_ConnectionRecord, "get_connection", None))
        and callable(getattr(_ConnectionRecord, "_checkin_failed", None))
        and callable(getattr(Pool, "_do_get", None))
        and hasattr(_ConnectionFairy, "_close_special")
    )


#: whether this SQLAlchemy's pool has the record methods the lean checkout uses
RECORDS = _record_path_available()


def _plain(pool: Any) -> bool:
    """Nothing in the pool needs the proxy: no checkout/checkin/reset listener, no pre-ping."""
    dispatch = pool.dispatch
    return not (pool._pre_ping or dispatch.checkout or dispatch.checkin or getattr(dispatch, "reset", None))


class Checkout:
    """Checks connections out of one engine's pool: ``(record, True)`` on the lean path, else
    ``(proxy, False)``. Both have ``dbapi_connection``, ``driver_connection``, ``info`` and
    ``invalidate()``; give each back with :func:`give_back`. Whether the pool is plain (and
    logs at debug) is looked at every time."""

    __slots__ = ("engine",)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self) -> tuple[Any, bool, Pool]:
        pool = self.engine.pool
        if RECORDS and not pool._should_log_debug() and _plain(pool):
            record: Any = pool._do_get()  # the pool's accounting and its wait (pool_timeout)
            try:
                record.get_connection()  # (re)connects if invalidated or due for recycling
            except BaseException as exc:
                record._checkin_failed(exc, _fairy_was_created=False)
                raise
            return record, True, pool
        return self.engine.raw_connection(), False, pool


def give_back(held: Any, lean: bool, pool: Pool, engine: Engine, *, ended: bool) -> None:
    """Return what a :class:`Checkout` gave (``pool``: the engine's pool then). ``ended``: its
    transaction was committed or rolled back by the store (else it is rolled back here, or
    dropped if that fails). A connection whose pool the engine has since replaced
    (``engine.dispose()``) is closed, not handed to a pool no one will close."""
    if engine.pool is not pool:
        # close the DBAPI connection: the old pool takes back only the empty record (a proxy
        # checks itself in when invalidated)
        with contextlib.suppress(Exception):
            held.invalidate()
        if not lean:
            return
        ended = True
    if not lean:
        if ended:
            held._close_special(transaction_reset=True)  # what Core does after its own COMMIT
        else:
            held.close()  # the pool resets (rolls back) or discards it
    else:
        if not ended and held.dbapi_connection is not None:
            try:
                held.dbapi_connection.rollback()
            except Exception as exc:  # a dead connection: the pool replaces it
                with contextlib.suppress(Exception):
                    held.invalidate(exc)
        held.checkin(_fairy_was_created=False)
    if engine.pool is not pool:
        # disposed while it was being returned: close what the dropped pool now holds
        with contextlib.suppress(Exception):
            pool.dispose()


def retire_older(pool: Any, held: Any, exc: BaseException | None) -> None:
    """As Core does on a disconnect, mark every connection ``pool`` made before now to be
    replaced at its next checkout: a server that closed one (a restart, a failover, an idle
    cull) has closed the others too, and each would fail a call in turn."""
    mark = getattr(pool, "_invalidate", None)
    if callable(mark):
        with contextlib.suppress(Exception):
            mark(held, exc, _checkin=False)  # the pool's invalidation time: older ones reconnect


def engine_isolation_level(engine: Engine) -> object:
    """The isolation level ``create_engine(isolation_level=...)`` set on every connection,
    or ``None``."""
    return getattr(engine.dialect, "_on_connect_isolation_level", None)


def believes_autocommit(conn: Any) -> bool:
    """Whether SQLAlchemy believes ``conn`` (a Connection) runs each statement in autocommit;
    ``False`` where it cannot say."""
    check = getattr(conn, "_is_autocommit_isolation", None)
    return bool(check()) if check is not None else False


def parent_engine(engine: Engine) -> Engine | None:
    """The engine ``engine`` was made from by ``execution_options(...)`` (whose pool and
    events it shares), or ``None``."""
    return getattr(engine, "_proxied", None)


def record_of(held: Any) -> Any:
    """The pool's record of ``held`` (a proxy from :class:`Checkout`), or ``None`` for a
    record itself or anything else."""
    return getattr(held, "_connection_record", None)
