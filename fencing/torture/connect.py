"""Opening the database under test and the store to put on trial, the same way in every process."""

from __future__ import annotations

import importlib
from typing import Any

from sqlalchemy import Engine, Table

from .. import cache
from ..errors import ConfigurationError
from ..store import JobStore

__all__ = ["open_engine", "open_store"]


def open_engine(url: str) -> Engine:
    """A SQLite file path or ``sqlite:///`` URL gets the library's SQLite engine; a server
    URL a pre-pinging one (a killed client must not leave a dead pooled connection): the
    engines ``service.py`` uses."""
    return cache.open_engine(*cache.normalize_target(url))


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
