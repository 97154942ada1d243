"""Opening the database under test and the store to put on trial, the same way in every process."""

from __future__ import annotations

import importlib
from typing import Any

import sqlalchemy
from sqlalchemy import Engine, Table

from ..cache import normalize_target
from ..errors import ConfigurationError
from ..sqlite import create_engine as create_sqlite_engine
from ..store import JobStore

__all__ = ["open_engine", "open_store"]


def open_engine(url: str) -> Engine:
    """A SQLite file path or ``sqlite:///`` URL gets the library's SQLite engine; a server
    URL a plain engine (pre-ping: a killed client must not leave a dead pooled connection)."""
    kind, key = normalize_target(url)
    if kind == "file":
        return create_sqlite_engine(key)
    return sqlalchemy.create_engine(key, pool_pre_ping=True)


def open_store(factory: str, engine: Engine, table: Table) -> JobStore:
    """``factory`` is ``"module:callable"``; the callable gets ``(engine, table)``."""
    module_name, _, name = factory.partition(":")
    try:
        build: Any = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load the store factory {factory!r}: {exc}") from exc
    store = build(engine, table)
    if not isinstance(store, JobStore):
        raise ConfigurationError(f"{factory} returned {type(store).__name__}, not a fencing.JobStore")
    return store
