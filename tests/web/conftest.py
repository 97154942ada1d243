"""The pages' fixtures: a store that records its ownership history, as the dashboard shows
it (the lease API's tests make their own plain store)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, MetaData

from fencing import History, JobStore, history_table


@pytest.fixture
def history(engine: Engine) -> Any:
    table = history_table(MetaData())
    table.create(engine)
    return table


@pytest.fixture
def store(engine: Engine, history: Any) -> JobStore:
    s = JobStore(engine, history=History(history))
    s.create_table()
    return s
