"""Opening the database under test and the store to put on trial, the same way in every process."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Engine, Table, make_url
from sqlalchemy.exc import ArgumentError

from .. import _engines as cache
from .._errors import ConfigurationError, InvalidArgument
from .._store.history import History

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["ASYNC_DRIVERS", "async_driver", "open_async_engine", "open_engine", "open_store"]

#: the asyncio driver the async front runs a server's URL on, by the URL's backend
ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "mysql": "mysql+asyncmy", "mariadb": "mysql+asyncmy"}
#: and a SQLite file's (fencing.asyncio.create_sqlite_engine)
SQLITE_ASYNC_DRIVER = "sqlite+aiosqlite"

S = TypeVar("S")


def open_engine(url: str) -> Engine:
    """A SQLite file path or ``sqlite:///`` URL gets the library's SQLite engine; a server
    URL a pre-pinging one (a killed client must not leave a dead pooled connection): the
    engines ``service.py`` uses."""
    return cache.open_engine(*cache.normalize_target(url))


def async_driver(url: str) -> str:
    """The ``dialect+driver`` the async front uses for ``url`` (a sync URL or a SQLite file)."""
    kind, target = cache.normalize_target(url)
    if kind == "file":
        return SQLITE_ASYNC_DRIVER
    backend = make_url(target).get_backend_name()
    if backend not in ASYNC_DRIVERS:
        known = ", ".join(sorted(ASYNC_DRIVERS))
        raise InvalidArgument(f"the async front has no asyncio driver for {backend}: it runs SQLite, {known}")
    return ASYNC_DRIVERS[backend]


def open_async_engine(url: str) -> AsyncEngine:
    """The async front's engine on the same database: a SQLite file gets
    :func:`fencing.asyncio.create_sqlite_engine`, a server URL its asyncio driver
    (:data:`ASYNC_DRIVERS`), pre-pinging like the sync one: the worker's own transactions
    (its external writes) must not meet a connection a restarted server left dead in the pool."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from .._runtime import sqlite

    driver = async_driver(url)
    kind, target = cache.normalize_target(url)
    if kind == "file":
        return sqlite.create_async_engine(target)
    try:
        return create_async_engine(make_url(target).set(drivername=driver), pool_pre_ping=True)
    except (ArgumentError, ImportError) as exc:
        raise InvalidArgument(f"cannot use database URL {target!r} with {driver}: {exc}") from exc


def open_store(factory: str, engine: object, table: Table, kind: type[S], *, history: History) -> S:
    """``factory`` is ``"module:callable"``; the callable gets ``(engine, table,
    history=history)`` and must return a ``kind`` (the front's store class) that records its
    ownership history as ``history`` says."""
    module_name, _, name = factory.partition(":")
    try:
        build: Any = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load the store factory {factory!r}: {exc}") from exc
    what = _public_name(kind)
    try:
        store = build(engine, table, history=history)
    except TypeError as exc:  # e.g. a sync store's factory given the async front's engine
        raise ConfigurationError(
            f"{factory} cannot build a {what} from ({type(engine).__name__}, Table, history=History): {exc}"
        ) from exc
    if not isinstance(store, kind):
        raise ConfigurationError(f"{factory} returned {type(store).__name__}, not a {what}")
    return store


def _public_name(kind: type) -> str:
    """The path users import ``kind`` by (``fencing.JobStore``, ``fencing.asyncio.AsyncJobStore``)."""
    for module in ("fencing", "fencing.asyncio"):
        if getattr(sys.modules.get(module), kind.__name__, None) is kind:
            return f"{module}.{kind.__name__}"
    return f"{kind.__module__}.{kind.__qualname__}"
