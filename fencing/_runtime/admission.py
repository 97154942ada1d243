"""What the library needs of the application's engine, and what it must leave to it.

The store is a guest in the application's engine: it takes connections from the engine's
pool, lets the engine's observers (logging, connection events) see what it runs, and
refuses settings under which lock + check + write cannot be one transaction:

* ``isolation_level="AUTOCOMMIT"`` on a server (engine, connection, or a ``connect``
  listener that sets the driver's autocommit): every statement would commit on its own,
  so a fenced block's writes would commit before its check. (On SQLite the engine's
  ``begin`` listener always opens a real transaction, so it is harmless there.)
* pools that hand one DBAPI connection to transactions that must stay apart
  (``StaticPool``, ``SingletonThreadPool``, ``AssertionPool``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import AssertionPool, SingletonThreadPool, StaticPool

from .._dialects import of
from .._errors import ConfigurationError
from .private_sqlalchemy import believes_autocommit, engine_isolation_level

__all__ = [
    "SHARING_POOLS",
    "Observers",
    "autocommit_probe",
    "observed",
    "refuse_autocommit_connection",
    "refuse_autocommit_engine",
    "refuse_sharing_pool",
]

#: pools that hand one DBAPI connection to transactions that must stay apart (every thread,
#: or every checkout of one thread): a heartbeat's renewal would run inside, and commit, a
#: fenced block's transaction
SHARING_POOLS = (StaticPool, SingletonThreadPool, AssertionPool)

#: connection events an observer of statements or transactions listens to; while any has a
#: listener the store runs through Core (``Connection.execute``), which calls them all
_OBSERVING = (
    "before_execute",
    "after_execute",
    "before_cursor_execute",
    "after_cursor_execute",
    "engine_connect",
    "commit",
    "rollback",
    "set_connection_execution_options",
)
#: the dialect's events of the same kind (an engine's listeners for them live on its dialect)
_OBSERVING_DIALECT = ("handle_error", "do_execute", "do_execute_no_params", "do_setinputsizes")

_AUTOCOMMIT_FIX = (
    "lock + check + write must be one transaction; give the store an engine without it "
    "(e.g. engine.execution_options(isolation_level='READ COMMITTED'))"
)


class Observers:
    """Whether anything would notice statements the store ran on the driver directly: a
    logger at INFO (``echo``, ``sqlalchemy.engine``), a connection or dialect event listener
    (other than the library's own ``begin`` listeners), or execution options on the engine
    (``isolation_level``, ``schema_translate_map``...) that Core applies.

    Asked before every transaction, through SQLAlchemy's public names only (the engine's
    execution options and logger, its dispatch's listener collections): about 1.3 µs.
    """

    __slots__ = ("engine", "own_begin_listeners")

    def __init__(self, engine: Engine, own_begin_listeners: int) -> None:
        self.engine = engine
        self.own_begin_listeners = own_begin_listeners

    def __bool__(self) -> bool:
        return observed(self.engine, self.own_begin_listeners)


def observed(engine: Engine, own_begin_listeners: int) -> bool:
    """:class:`Observers`' answer."""
    if engine.get_execution_options() or engine.logger.isEnabledFor(logging.INFO):
        return True
    return listeners(engine, own_begin_listeners)


def listeners(engine: Engine, own_begin_listeners: int) -> bool:
    """Whether a connection or dialect event has a listener besides the library's own."""
    # each collection is falsy when it has no listener: _OBSERVING and _OBSERVING_DIALECT,
    # written out (an ``or`` that stops at the first costs half what any() over them does;
    # asked before every transaction, tests/store/test_host_app.py holds it to the lists)
    d: Any = engine.dispatch
    if len(d.begin) > own_begin_listeners:
        return True
    if (
        d.before_cursor_execute
        or d.after_cursor_execute
        or d.before_execute
        or d.after_execute
        or d.engine_connect
        or d.commit
        or d.rollback
        or d.set_connection_execution_options
    ):
        return True
    dd: Any = engine.dialect.dispatch
    return bool(dd.do_execute or dd.do_execute_no_params or dd.handle_error or dd.do_setinputsizes)


def refuse_sharing_pool(engine: Engine) -> None:
    """:class:`ConfigurationError` for a pool of :data:`SHARING_POOLS`."""
    if isinstance(engine.pool, SHARING_POOLS):
        name = type(engine.pool).__name__
        memory = of(engine.dialect).is_file and engine.url.database in (None, "", ":memory:")
        raise ConfigurationError(
            f"the engine's pool is a {name}, which shares one connection between transactions "
            "that must stay apart (a heartbeat's renewal would commit a fenced block's "
            "transaction); use the default QueuePool (or NullPool)"
            + (" and a database file, not :memory:" if memory else "")
        )


def refuse_autocommit_engine(engine: Engine) -> None:
    """:class:`ConfigurationError` for a server engine whose transactions are AUTOCOMMIT."""
    if not of(engine.dialect).honours_autocommit:
        return
    level = engine.get_execution_options().get("isolation_level") or engine_isolation_level(engine)
    if isinstance(level, str) and level.upper() == "AUTOCOMMIT":
        raise ConfigurationError(f"the engine has isolation_level='AUTOCOMMIT'; {_AUTOCOMMIT_FIX}")


def autocommit_probe(engine: Engine) -> Callable[[Any], bool] | None:
    """How to read, from a DBAPI connection of this engine, whether its driver is in
    autocommit mode right now (the ground truth, however it was set); ``None``: SQLite,
    where it cannot matter, or a driver the library does not know."""
    return of(engine.dialect).autocommit_probe(engine.dialect.driver)


def refuse_autocommit_connection(conn: Connection, probe: Callable[[Any], bool] | None) -> None:
    """:class:`ConfigurationError` for a Connection whose statements would each commit."""
    if not of(conn.dialect).honours_autocommit:
        return
    # the DBAPI-level object, as the driver path reads it (an async driver's adapter), or
    # what SQLAlchemy itself believes
    on = probe(conn.connection.dbapi_connection) if probe is not None else believes_autocommit(conn)
    if on:
        raise ConfigurationError(
            f"the connection is in autocommit mode (isolation_level='AUTOCOMMIT'); {_AUTOCOMMIT_FIX}"
        )
