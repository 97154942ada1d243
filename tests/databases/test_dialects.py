"""One plan per dialect, chosen once: what differs between databases, in one place.

Each row is what the store did by dialect before the plans existed (its flags); a plan that
answers otherwise changes which statements run on that database.
"""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import Dialect

from fencing._store.dialects import ARRAYS, COUNTED, DUPLICATE_KEY, EACH, LOCKING, RETURNED, plan_for


def _dialect(url: str) -> Dialect:
    return create_engine(url).dialect  # no connection is made


@pytest.mark.parametrize(
    ("url", "upsert", "batch", "whole_database", "nul", "max_key", "resolution", "walks"),
    [
        ("sqlite://", COUNTED, EACH, True, True, None, 1e-3, False),
        ("postgresql+psycopg://", RETURNED, ARRAYS, False, False, 2000, 1e-6, True),
        ("mysql+pymysql://", DUPLICATE_KEY, LOCKING, False, True, 1024, 1e-6, False),
        ("mariadb+pymysql://", DUPLICATE_KEY, LOCKING, False, True, 1024, 1e-6, False),
    ],
)
def test_each_dialect_gets_its_plan(
    url: str,
    upsert: str,
    batch: str,
    whole_database: bool,
    nul: bool,
    max_key: int | None,
    resolution: float,
    walks: bool,
) -> None:
    dialect = _dialect(url)
    plan = plan_for(dialect)
    assert plan.upsert == upsert
    assert plan.batch_completion == batch
    assert plan.locks_whole_database is whole_database
    assert plan.text_holds_nul is nul
    assert plan.max_key_bytes == max_key
    assert plan.clock_resolution == resolution
    assert plan.walks_claim_order is walks
    # RETURNING is what SQLAlchemy says this dialect's UPDATE has
    assert plan.returning is bool(getattr(dialect, "update_returning", False))


def test_a_dialect_the_library_does_not_name_gets_the_portable_plan() -> None:
    dialect = _dialect("sqlite://")
    dialect.name = "otherdb"  # as a third-party dialect would call itself
    plan = plan_for(dialect)
    assert (plan.upsert, plan.batch_completion, plan.locks_whole_database) == (DUPLICATE_KEY, EACH, False)
    assert plan.max_key_bytes is None and plan.clock_resolution == 1e-3
