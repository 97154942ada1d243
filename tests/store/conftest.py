"""The store's fixtures besides the suite's own (``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import service


@pytest.fixture
def db(target: str) -> Iterator[str]:
    """``service.py``'s database at ``target``, initialized; its cached stores dropped after."""
    service.init_db(target)
    yield target
    service._stores.clear()
