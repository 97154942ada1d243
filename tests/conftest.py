"""Test configuration in the style of SQLAlchemy's own suite.

Choose the database with ``--db NAME`` (an alias for a local server) or ``--dburi URL``;
``FENCING_TEST_DB`` / ``FENCING_TEST_DBURI`` override from the environment. SQLite is the
default: every test gets its own database file under ``tmp_path``. For a server, every
xdist worker gets its own database, created and dropped by a session fixture, and every
test starts with no jobs table in it.

A server that does not answer skips the run with the reason and how to enable it, except
under ``CI=true``, where a missing backend is a failure.

``FENCING_TEST_INSTALLED=1`` (noxfile.py's session that tests the built wheel) fails the run
unless ``fencing`` and ``service`` were imported from this interpreter's site-packages: an
installed wheel, neither the source tree nor an editable install of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from tests import asyncfront, backends


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fencing")
    group.addoption(
        "--db",
        default=None,
        help=f"database alias: one of {sorted(backends.ALIASES)} (default sqlite)",
    )
    group.addoption("--dburi", default=None, help="a SQLAlchemy URL of a server database to test against")
    group.addoption("--long", action="store_true", help="also run the tests marked long (minutes each)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backend(*names): runs only when the tested database is one of these dialect names"
    )
    config.addinivalue_line(
        "markers",
        "sync_only(why): runs with the sync store only, e.g. its own threads call the store "
        "(tests/store/test_asyncio.py races tasks against the async one); deselected for the async one",
    )
    config.addinivalue_line(
        "markers", "async_front: the test body drives the AsyncJobStore (the store fixture's async run)"
    )
    config._fencing_backend = backends.choose(  # type: ignore[attr-defined]
        config.getoption("--db") or os.environ.get("FENCING_TEST_DB"),
        config.getoption("--dburi") or os.environ.get("FENCING_TEST_DBURI"),
    )
    if os.environ.get("FENCING_TEST_INSTALLED") == "1":
        for where in _tested_code():
            if not any(where.is_relative_to(site) for site in _site_packages()):
                raise pytest.UsageError(
                    f"FENCING_TEST_INSTALLED=1, but {where} is not in site-packages "
                    f"({', '.join(map(str, _site_packages()))}): the source tree is tested, not the wheel"
                )


def _tested_code() -> list[Path]:
    """Where ``fencing`` and ``service`` were imported from."""
    import fencing
    import service

    return [Path(module.__file__ or "").resolve() for module in (fencing, service)]


def _site_packages() -> list[Path]:
    return sorted({Path(sysconfig.get_path(name)).resolve() for name in ("purelib", "platlib")})


def pytest_report_header(config: pytest.Config) -> list[str]:
    backend: backends.Backend = config._fencing_backend  # type: ignore[attr-defined]
    installed = " (installed)" if os.environ.get("FENCING_TEST_INSTALLED") == "1" else ""
    return [f"fencing backend: {backend.describe()}", f"fencing under test{installed}: {_tested_code()[0]}"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backend: backends.Backend = config._fencing_backend  # type: ignore[attr-defined]
    keep, drop = [], []
    long = config.getoption("--long")
    for item in items:
        marker = item.get_closest_marker("backend")
        wanted = marker is None or backend.dialect in marker.args
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("store") == asyncfront.ASYNC:
            item.add_marker(pytest.mark.async_front)
            wanted = wanted and item.get_closest_marker("sync_only") is None
        if item.get_closest_marker("long") is not None:
            # minutes long by design: exempt from the run's per-test timeout (pyproject.toml)
            item.add_marker(pytest.mark.timeout(0))
        (keep if wanted and (long or item.get_closest_marker("long") is None) else drop).append(item)
    if drop:
        # deselected, not skipped: they run in the pass for their own backend
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest, worker_id: str) -> Iterator[backends.Backend]:
    chosen: backends.Backend = request.config._fencing_backend  # type: ignore[attr-defined]
    chosen.require()
    with chosen.for_worker(worker_id) as ready:
        yield ready


@pytest.fixture
def target(backend: backends.Backend, tmp_path: Path) -> Iterator[str]:
    """What ``service.py`` and worker processes take: a SQLite file path or a server URL."""
    with backend.fresh_target(tmp_path) as where:
        yield where


@pytest.fixture
def engine(backend: backends.Backend, target: str) -> Iterator[Engine]:
    """An engine on the test's own database, configured the way the library needs."""
    eng = backends.engine_for(target)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture(params=["sync", asyncfront.ASYNC])
def store(request: pytest.FixtureRequest, engine: Engine, target: str) -> Iterator[object]:
    """A store on a fresh database whose jobs table exists and is empty: a ``JobStore``, and
    (``async``) an ``AsyncJobStore`` driven from the test body (:mod:`tests.asyncfront`)."""
    from fencing import JobStore

    if request.param == asyncfront.ASYNC:
        yield from _async_store(request, target)
        return
    s = JobStore(engine)
    s.create_table()
    try:
        yield s
    finally:
        s.engine.dispose()


def _async_store(request: pytest.FixtureRequest, target: str) -> Iterator[object]:
    from fencing.asyncio import AsyncJobStore

    loop = asyncio.new_event_loop()
    async_engine = backends.async_engine_for(target)
    try:
        s = asyncfront.BlockingAsyncStore(AsyncJobStore(async_engine), loop)
        s.create_table()
        request.node._fencing_loop = loop  # type: ignore[attr-defined]  # the body runs on it
        yield s
        # every connection the async store took went back to the pool, the test's included
        assert async_engine.sync_engine.pool.checkedout() == 0, "a connection was not given back"  # type: ignore[attr-defined]
    finally:
        asyncfront.dispose(async_engine, loop)
        loop.close()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A test of the async store runs its body inside the asyncio bridge, on its loop."""
    loop = getattr(pyfuncitem, "_fencing_loop", None)
    if loop is None:
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncfront.run_in_bridge(loop, pyfuncitem.obj, {n: pyfuncitem.funcargs[n] for n in names})
    return True


@pytest.fixture
def logging_kept() -> Iterator[None]:
    """Alembic's env.py runs ``logging.config.fileConfig``, which disables every logger it
    does not name (``fencing.heartbeat`` too, which later tests in this process capture):
    put logging back as it was."""
    root = logging.getLogger()
    loggers = [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    saved = [(lg, lg.disabled, lg.level, list(lg.handlers), lg.propagate) for lg in [root, *loggers]]
    try:
        yield
    finally:
        for lg, disabled, level, handlers, propagate in saved:
            lg.disabled, lg.propagate = disabled, propagate
            lg.setLevel(level)
            lg.handlers[:] = handlers


@pytest.fixture
def imports_kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test that imports an example application's modules (and lets Alembic put ``.`` on
    ``sys.path``) leaves ``sys.path``, those modules and the path finders' caches as it found
    them (libraries it imported for the first time stay: importing them twice is not safe)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    modules = set(sys.modules)
    finders = dict(sys.path_importer_cache)
    examples = str(Path(__file__).resolve().parent.parent / "examples")
    try:
        yield
    finally:
        for name in set(sys.modules) - modules:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(examples):
                del sys.modules[name]
        sys.path_importer_cache.clear()
        sys.path_importer_cache.update(finders)
