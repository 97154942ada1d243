"""The store meets an engine whose database may lose what it acknowledged: it logs each risk
once per engine (``fencing.durability``), or, for an engine passed to
``fencing.durability.require_durable``, refuses it with ``ConfigurationError`` as it refuses
AUTOCOMMIT. The rules themselves, the doctor and the private servers: tests/cli/test_doctor.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import fencing
from fencing import ConfigurationError, JobStore
from fencing.durability import require_durable

pytestmark = pytest.mark.backend("sqlite")


def durability_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "fencing.durability" and r.levelno == logging.WARNING]


def test_a_store_on_an_unsafe_engine_logs_the_risk_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fencing.durability")
    engine = fencing.create_sqlite_engine(tmp_path / "jobs.db", durability="normal")
    try:
        store = JobStore(engine)
        store.create_table()
        for i in range(5):
            store.enqueue(f"job-{i}")
            assert store.claim(f"job-{i}", "w", ttl=60) is not None
        JobStore(engine).enqueue("again")  # another store, the same engine
        [line] = durability_warnings(caplog)
        assert (line.setting, line.value) == ("synchronous", "normal (journal_mode wal)")  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def test_a_store_on_a_safe_engine_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fencing.durability")
    engine = fencing.create_sqlite_engine(tmp_path / "jobs.db")
    try:
        store = JobStore(engine)
        store.create_table()
        store.enqueue("a")
        assert durability_warnings(caplog) == []
    finally:
        engine.dispose()


def test_a_strict_engine_is_refused_by_the_store(tmp_path: Path) -> None:
    engine = fencing.create_sqlite_engine(tmp_path / "jobs.db", durability="normal")
    try:
        with pytest.raises(ConfigurationError):
            require_durable(engine)
        store = JobStore(engine)
        for _ in range(2):  # at every operation, not only the first
            with pytest.raises(ConfigurationError, match="synchronous = normal"):
                store.enqueue("a")
    finally:
        engine.dispose()
