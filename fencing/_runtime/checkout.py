"""One pooled connection for one of the store's own transactions, the pool's own way.

``engine.raw_connection()`` checks a connection out of the engine's pool inside a proxy,
SQLAlchemy's ``_ConnectionFairy``, which exists to run the pool's ``checkout``/``checkin``/
``reset`` events, pre-ping, debug logging and the garbage-collection safety net for a
connection nobody returned. When the pool has none of those to run (no such listener, no
``pool_pre_ping``, no ``echo_pool="debug"``), the store takes the pool's connection record
the way ``_ConnectionRecord.checkout()`` does, and gives it back the way a failed checkout
does, without the proxy: the same ``pool_size``/``max_overflow`` accounting, the same
``pool_timeout`` wait, the same ``connect`` events, recycling and invalidation, and
``engine.dispose()`` closes what it returned. It saves 3.5 µs of the ~5 µs a checkout costs,
which is 5-8% of a fenced claim at the default durability. Otherwise (or with a SQLAlchemy
whose pool internals differ) the proxy is used, and every pool feature runs as it would for
the application.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.pool import Pool
from sqlalchemy.pool.base import _ConnectionFairy, _ConnectionRecord

from .admission import NO_STAMP, registry_stamp

__all__ = ["Checkout", "give_back"]


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
    ``(proxy, False)``. Both have ``dbapi_connection``, ``info`` and ``invalidate()``; give
    each back with :func:`give_back`. Whether the pool is plain is looked at again only when
    SQLAlchemy's listener registry changed or the engine has a new pool (``dispose()``);
    debug logging of the pool is read every time."""

    __slots__ = ("_cache", "engine")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cache: tuple[object, object, bool] = (None, NO_STAMP, False)

    def __call__(self) -> tuple[Any, bool, Pool]:
        pool = self.engine.pool
        if RECORDS and not pool._should_log_debug():
            stamp = registry_stamp()
            cached_pool, cached_stamp, plain = self._cache
            if stamp is NO_STAMP or stamp != cached_stamp or cached_pool is not pool:
                plain = _plain(pool)
                self._cache = (pool, stamp, plain)
            if plain:
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
