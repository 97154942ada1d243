"""The test matrix: python x SQLAlchemy x database, plus lint, typecheck, demo and bench.

``nox`` runs the default sessions; ``nox -t sqlite`` / ``-t postgresql`` / ``-t mariadb``
runs one backend's tests. A server that does not answer skips its sessions with the
reason and how to enable it, except under ``CI=true``, where the suite fails instead.
"""

from __future__ import annotations

import glob
import os

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "torture", "lint", "typecheck", "demo"]

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
NEWEST = PYTHONS[-1]
#: "latest" is the newest release the session's python can install: SQLAlchemy 2.1 needs
#: Python 3.11, so on 3.10 it resolves to the newest 2.0.x
SQLALCHEMY = {"lowest": "sqlalchemy==2.0.36", "latest": "sqlalchemy"}
#: database alias -> the extra with its driver (psycopg 3, pymysql)
DATABASES = {"sqlite": None, "postgresql": "postgresql", "mariadb": "mysql"}

# the pyenv interpreters of the development and CI machines, when present
for _bin in sorted(glob.glob("/root/.pyenv/versions/3.1[0-3].*/bin")):
    if _bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")


def _matrix() -> list[nox.param]:
    params = []
    for python in PYTHONS:
        for line in SQLALCHEMY:
            for db in DATABASES:
                # a server's own behaviour does not vary with python: test it on the newest
                if db != "sqlite" and python != NEWEST:
                    continue
                # the lowest SQLAlchemy at both ends of the supported pythons; the latest on each
                if line == "lowest" and python not in (PYTHONS[0], NEWEST):
                    continue
                params.append(nox.param(python, line, db, id=f"{python}-{line}-{db}", tags=[db]))
    return params


def _install(session: nox.Session, *extras: str, sqlalchemy: str = "latest") -> None:
    names = ",".join(e for e in extras if e)
    session.install("--upgrade", "-e", f".[{names}]" if names else ".", SQLALCHEMY[sqlalchemy])


#: what the lowest SQLAlchemy runs on a server: the tests of what SQLAlchemy compiles and
#: executes for that dialect (every statement, its plan, the library's tables, migrations).
#: Argument checks, processes, threads and timing do not vary with SQLAlchemy: they run on
#: the latest line for each server, and on the lowest line on SQLite
DIALECT_FACING = [
    "tests/test_store.py",
    "tests/test_contract.py",
    "tests/test_complete_many.py",
    "tests/test_claim_order.py",
    "tests/test_plans.py",
    "tests/test_step.py",
    "tests/test_types.py",
    "tests/test_fences.py",
    "tests/test_edges.py",
    "tests/test_table.py",
    "tests/test_database_clock.py",
    "tests/test_marks.py",
    "tests/test_refusals.py",
    "tests/test_history.py",
    "tests/test_migrations.py",
]


@nox.session
@nox.parametrize(("python", "sqlalchemy", "db"), _matrix())
def tests(session: nox.Session, sqlalchemy: str, db: str) -> None:
    """The whole suite for one python, one SQLAlchemy line and one database."""
    # every driver, also for SQLite: a few tests build engines of each dialect offline
    _install(session, "test", *filter(None, DATABASES.values()), sqlalchemy=sqlalchemy)
    _require_server(session, db)
    # process races, kills and torture runs take seconds each and do not vary with python or
    # SQLAlchemy: they run once per database, on the newest of both; so does the second run
    # of the store-fixture suite through the async store (test_asyncio.py runs everywhere)
    newest = (session.python, sqlalchemy) == (NEWEST, "latest")
    quick = [] if newest else ["-m", "not slow and not async_front"]
    if sqlalchemy == "lowest" and db != "sqlite" and not session.posargs:
        quick += DIALECT_FACING
    session.run("pytest", "-n", "auto", "--db", db, *quick, *session.posargs)


def _require_server(session: nox.Session, db: str) -> None:
    """Skip a server's session, with the reason, when it does not answer (outside CI)."""
    if db != "sqlite" and not _in_ci():
        why = session.run("python", "-m", "tests.backends", db, silent=True, success_codes=[0, 1])
        if why and why.strip():
            session.skip(f"{db} sessions skipped: {why.strip()}")


#: the bounded run of CI: well under 60 s per database, the seed fixed so a failure replays
TORTURE = ["--workers", "8", "--jobs", "800", "--seconds", "30", "--drain", "25", "--seed", "20261129"]
#: then the workers on the async front (AsyncJobStore, AsyncHeartbeat, the asyncio driver):
#: half the jobs and fault phase, so a database's session stays within about 1.5 minutes; the
#: drain ends once every job is done, and is longer as the workers' start-up (imports, ~1 s
#: of CPU each) takes much of a short fault phase on a loaded 2-core machine
TORTURE_ASYNC = ["--async", "--workers", "8", "--jobs", "400", "--seconds", "15", "--drain", "45"]
TORTURE_ASYNC += TORTURE[-2:]  # the same seed


@nox.session(python=NEWEST, tags=["torture"])
@nox.parametrize("db", list(DATABASES), ids=list(DATABASES))
def torture(session: nox.Session, db: str) -> None:
    """``python -m fencing torture`` on one database, the sync front and then the async one:
    exit 1 on any violation. ``nox -s torture -- ARGS`` runs once, with ARGS instead."""
    _install(session, "test", *filter(None, DATABASES.values()))
    _require_server(session, db)
    url = (
        []
        if db == "sqlite"
        else ["--url", session.run("python", "-m", "tests.backends", "--url", db, silent=True).strip()]
    )
    for args in [session.posargs] if session.posargs else [TORTURE, TORTURE_ASYNC]:
        session.run("python", "-m", "fencing", "torture", *url, *args)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@nox.session(python=NEWEST)
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=NEWEST)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the library and service.py (fencing.otel with its extra installed)."""
    _install(session, "otel")
    session.install("mypy")
    session.run("mypy")


@nox.session(python=NEWEST)
def demo(session: nox.Session) -> None:
    """The main job: the stalled worker's late write is rejected."""
    _install(session)
    session.run("python", "-m", "fencing", "demo")


@nox.session(python=NEWEST)
def bench(session: nox.Session) -> None:
    """The benchmarks: per-op on SQLite, the servers' claim/complete cycle, the worker cycle.

    ``nox -s bench -- ops`` (or ``servers``, ``cycle``, ``backlog``, ``peers``) runs one of
    them; ``peers`` installs the job queues it compares with (bench-only dependencies).
    """
    _install(session, *filter(None, DATABASES.values()))
    if "peers" in session.posargs:
        session.install("-r", "benchmarks/requirements-peers.txt")
    for name in session.posargs or ["ops", "servers", "cycle"]:
        session.run("python", f"benchmarks/{name}.py")
