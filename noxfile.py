"""The test matrix: python x SQLAlchemy x database, plus lint, typecheck, demo, package and bench.

``nox`` runs the default sessions; ``nox -t sqlite`` / ``-t postgresql`` / ``-t mariadb``
runs one backend's tests. A server that does not answer skips its sessions with the
reason and how to enable it, except under ``CI=true``, where the suite fails instead.
A python of ``PYTHONS`` that is not on PATH (nor under this machine kind's pyenv) is skipped
locally and fails under ``CI=true``.

Most sessions install the checkout editable (``-e``) and so test the source tree. What a user
gets is the wheel: ``package`` builds, checks, installs and runs it, and ``test_wheel`` runs
the suite against it.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"  # nox.project.dependency_groups
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
# the torture command's bounded run (`nox -s torture`) is outside CI with the soaks: the suite's
# tests/faults/test_torture.py runs the same harness, shorter, on each database and front
nox.options.sessions = ["tests", "test_wheel", "lint", "typecheck", "demo", "package", "docs"]

ROOT = Path(__file__).resolve().parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")

# this project's machines keep their pythons under pyenv, whose shims do not all run: put
# the interpreters themselves on PATH, so the README's `python -m nox` works as it is there
for _bin in sorted(Path("/root/.pyenv/versions").glob("3.1[0-3].*/bin")):
    if str(_bin) not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = f"{_bin}{os.pathsep}{os.environ.get('PATH', '')}"

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
NEWEST = PYTHONS[-1]
#: "latest" is the newest release the session's python can install: SQLAlchemy 2.1 needs
#: Python 3.11, so on 3.10 it resolves to the newest 2.0.x
SQLALCHEMY = {"lowest": "sqlalchemy==2.0.36", "latest": "sqlalchemy"}
#: database alias -> the extra with its driver (psycopg 3, pymysql)
DATABASES = {"sqlite": None, "postgresql": "postgresql", "mariadb": "mysql"}
#: the extras the suite imports besides the "test" group: every driver, also for SQLite (a few
#: tests build engines of each dialect offline), the async store's, OpenTelemetry, the web
TEST_EXTRAS = ["otel", "cron", "aiosqlite", "asyncpg", "asyncmy", "web", *filter(None, DATABASES.values())]
#: the cell of the matrix that test_wheel runs against the built wheel instead of the source
#: tree: a quick one (no slow tests), on a python that is neither end of the range (those test
#: the lowest SQLAlchemy too), with SQLite (no server)
WHEEL = ("3.12", "latest", "sqlite")


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
                if (python, line, db) != WHEEL:
                    params.append(nox.param(python, line, db, id=f"{python}-{line}-{db}", tags=[db]))
    return params


def _install(
    session: nox.Session,
    *extras: str,
    group: str | None = None,
    sqlalchemy: str = "latest",
    wheel: Path | None = None,
) -> None:
    """The checkout, editable (or the built ``wheel``), with ``extras``, one dependency group of
    pyproject.toml and one SQLAlchemy line."""
    names = f"[{','.join(extras)}]" if extras else ""
    project = [f"fencing{names} @ {wheel.as_uri()}"] if wheel else ["-e", f".{names}"]
    groups = nox.project.dependency_groups(PYPROJECT, group) if group else ()
    session.install("--upgrade", *project, *groups, SQLALCHEMY[sqlalchemy])


#: the tests that build the documentation site: the docs session runs them (mkdocs is
#: installed there), the test sessions leave them out rather than skip them
SITE_TESTS = ["tests/docs/test_api_reference.py"]

#: xdist workers for the quick tests: most of their time is waits (the database, sleeps of
#: timing tests), so three on this project's 2-core machines finish a quarter sooner than two
#: (2:48 -> 2:10 for the SQLite suite); the slow tests (processes, kills, torture runs) keep
#: one per core, as their slack for a loaded machine assumes
QUICK_WORKERS = "3"


def _pytest(session: nox.Session, sqlalchemy: str, db: str) -> list[list[str]]:
    """The pytest commands of one cell of the matrix (one, or the quick tests then the slow)."""
    # process races, kills and torture runs take seconds each and do not vary with python or
    # SQLAlchemy: they run once per database, on the newest of both; so does the second run
    # of the store-fixture suite through the async store (test_asyncio.py runs everywhere)
    full = (session.python, sqlalchemy) == (NEWEST, "latest")
    marks = ["not slow"] if full else ["not slow", "not async_front"]
    # argument checks, processes and timing do not vary with SQLAlchemy: on a server the
    # lowest line runs only the tests marked dialect (what SQLAlchemy compiles and executes)
    if sqlalchemy == "lowest" and db != "sqlite":
        marks.insert(0, "dialect")
    # in CI, the slowest tests are named in the log: where the run's minutes go
    slowest = ["--durations=15"] if os.environ.get("CI") else []
    base = ["pytest", "--db", db, *slowest, *(f"--ignore={t}" for t in SITE_TESTS)]
    runs = [[*base, "-n", QUICK_WORKERS, "-m", " and ".join(marks), *session.posargs]]
    if full:
        runs.append([*base, "-n", "auto", "-m", "slow", *session.posargs])
    return runs


@nox.session
@nox.parametrize(("python", "sqlalchemy", "db"), _matrix())
def tests(session: nox.Session, sqlalchemy: str, db: str) -> None:
    """The suite for one python, one SQLAlchemy line and one database, on the source tree."""
    _install(session, *TEST_EXTRAS, group="test", sqlalchemy=sqlalchemy)
    _require_server(session, db)
    for command in _pytest(session, sqlalchemy, db):
        session.run(*command)


@nox.session(python=WHEEL[0], tags=[WHEEL[2]])
def test_wheel(session: nox.Session) -> None:
    """The suite of the matrix's cell ``WHEEL`` (3.12-latest-sqlite) against the built wheel.

    The wheel is installed non-editable; the suite runs from the unpacked sdist (so the sdist
    is shown to hold what the suite needs: the ``tests`` package, the examples and docs the
    tests read, pytest's settings) less what the wheel installs and the egg-info, in a
    temporary directory outside the checkout: nothing on ``sys.path`` can import the source
    instead of site-packages (``FENCING_TEST_INSTALLED=1``: ``tests/conftest.py`` fails the
    run otherwise). The build costs it about 10 s.
    """
    _, sqlalchemy, db = WHEEL
    with tempfile.TemporaryDirectory(prefix="fencing-suite-") as scratch:
        sdist, wheel = _build(session, Path(scratch) / "dist")
        _install(session, *TEST_EXTRAS, group="test", sqlalchemy=sqlalchemy, wheel=wheel)
        # the same version as an editable install of the checkout (an earlier run): replace it
        session.install("--force-reinstall", "--no-deps", str(wheel))
        with tarfile.open(sdist) as tar:
            # the "data" filter (no links out, no special files) where this python has it
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(Path(scratch) / "sdist", **kwargs)  # type: ignore[arg-type]
        (suite,) = (Path(scratch) / "sdist").iterdir()
        with zipfile.ZipFile(wheel) as whl:
            installed = {name.split("/")[0] for name in whl.namelist()}
        for path in [*(suite / name for name in installed), *suite.glob("*.egg-info")]:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        with session.chdir(suite):
            _require_server(session, db)
            for command in _pytest(session, sqlalchemy, db):
                session.run(*command, env={"FENCING_TEST_INSTALLED": "1"})


def _build(session: nox.Session, outdir: Path) -> tuple[Path, Path]:
    """``python -m build``: the sdist of the checkout, then the wheel built from that sdist
    (as pip builds one from PyPI), each in an isolated env with only pyproject.toml's build
    requirements; both into ``outdir``, a new directory."""
    uv = ["--installer", "uv"] if session.venv_backend == "uv" else []
    session.install("build[uv]" if uv else "build")
    session.run("python", "-m", "build", *uv, "--outdir", str(outdir), str(ROOT))
    (sdist,) = outdir.glob("*.tar.gz")
    (wheel,) = outdir.glob("*.whl")
    return sdist, wheel


def _require_server(session: nox.Session, db: str) -> None:
    """Skip a server's session, with the reason, when it does not answer (outside CI)."""
    if db != "sqlite" and os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        why = session.run("python", "-m", "tests.backends", db, silent=True, success_codes=[0, 1])
        if why and why.strip():
            session.skip(f"{db} sessions skipped: {why.strip()}")


#: the bounded run (outside CI, with the soaks): well under 60 s per database, the seed fixed so
#: a failure replays
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
    _install(session, *TEST_EXTRAS, group="test")
    _require_server(session, db)
    backends = ["python", "-m", "tests.backends", "--url", db]
    url = [] if db == "sqlite" else ["--url", session.run(*backends, silent=True).strip()]
    for args in [session.posargs] if session.posargs else [TORTURE, TORTURE_ASYNC]:
        session.run("python", "-m", "fencing", "torture", *url, *args)


def _long_run(session: nox.Session, db: str, test: str, size: tuple[str, str], *args: str) -> None:
    """pytest on one minutes-long test file, its output shown as it goes; ``size`` is the
    environment variable that sets its length and its value, unless ``nox -s NAME -- VALUE``."""
    variable, default = size
    value = session.posargs[0] if session.posargs else default
    session.run("pytest", test, "--db", db, *args, "-s", env={variable: value})


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", list(DATABASES), ids=list(DATABASES))
def election_soak(session: nox.Session, db: str) -> None:
    """The locks' and elections' torture (tests/locks/test_election_torture.py: holders frozen,
    killed, killed inside their transaction, revoked, cut off) with a long fault phase, both
    modes and both fronts: ``nox -s election_soak -- SECONDS`` (default 120). Outside CI: CI
    runs it for 8 s per database, mode and front."""
    _install(session, *TEST_EXTRAS, group="test")
    _require_server(session, db)
    seconds = ("FENCING_ELECTION_TORTURE_SECONDS", "120")
    _long_run(session, db, "tests/locks/test_election_torture.py", seconds)


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", list(DATABASES), ids=list(DATABASES))
def worker_soak(session: nox.Session, db: str) -> None:
    """The worker runtime's torture (tests/faults/test_worker_torture.py: ``fencing worker``
    processes frozen past their leases, killed, stopped by SIGTERM, their jobs revoked), thread
    slots and asyncio slots, with a long fault phase: ``nox -s worker_soak -- SECONDS`` (default
    120). Outside CI: CI runs it for 8 s per database and front."""
    _install(session, *TEST_EXTRAS, group="test")
    _require_server(session, db)
    seconds = ("FENCING_WORKER_TORTURE_SECONDS", "120")
    _long_run(session, db, "tests/faults/test_worker_torture.py", seconds, "-n", "0")


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", list(DATABASES), ids=list(DATABASES))
def schedule_soak(session: nox.Session, db: str) -> None:
    """The schedules' torture (tests/faults/test_schedule_torture.py: four scheduling
    processes on a 1000x clock, killed, frozen, their clocks jumping) with a long fault phase:
    ``nox -s schedule_soak -- SECONDS`` (default 60: some 1,000 ticks of its minute schedule).
    Outside CI: CI runs it for 12 s per database."""
    _install(session, *TEST_EXTRAS, group="test")
    _require_server(session, db)
    seconds = ("FENCING_SCHEDULE_TORTURE_SECONDS", "60")
    _long_run(session, db, "tests/faults/test_schedule_torture.py", seconds, "-n", "0")


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", ["postgresql", "mariadb"], ids=["postgresql", "mariadb"])
def crash_soak(session: nox.Session, db: str) -> None:
    """The torture with the database server itself crashing (tests/faults/test_server_crash.py:
    SIGKILL of a private PostgreSQL or MariaDB, down 0.2-2 s, crash recovery, every 0.75-2.25 s
    of the fault phase; workers frozen, killed, killed inside their transaction, revoked too),
    both fronts: ``nox -s crash_soak -- SECONDS`` (default 300). The servers are the test's own,
    started from the binaries installed here, never the shared ones. Outside CI: CI runs it for
    10 s per database, on the sync front, with only freezes and revokes besides the crashes."""
    _install(session, *TEST_EXTRAS, group="test")
    _long_run(
        session,
        db,
        "tests/faults/test_server_crash.py",
        ("FENCING_CRASH_TORTURE_SECONDS", "300"),
        "-n",
        "0",
        "--long",
    )


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", list(DATABASES), ids=list(DATABASES))
def soak(session: nox.Session, db: str) -> None:
    """A million operations (tests/faults/test_soak.py): the torture until the workers have made
    ``nox -s soak -- OPERATIONS`` operations (default 1,000,000: claims, renewals, completions,
    fenced blocks, releases, guarded writes), on a backlog topped up as it runs out, sync and
    async workers in one run, no simulated work, every fault kind: frozen, killed, killed
    inside the transaction, revoked; on PostgreSQL and MariaDB the server crashed too (a
    private one, started from the binaries installed here, never the shared one); SQLite has
    no server to crash. Prints the figures docs/explanation/proof.md shows. Outside CI: CI runs 3,000
    operations per database."""
    _install(session, *TEST_EXTRAS, group="test")
    operations = ("FENCING_SOAK_OPERATIONS", "1000000")
    soak = ("-n", "0", "-k", "test_soak_of_operations")
    _long_run(session, db, "tests/faults/test_soak.py", operations, *soak)


@nox.session(python=NEWEST)
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting; import-linter: the layers of fencing/ (``[tool.importlinter]``)."""
    session.install("ruff", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # the contract is read from the source tree: each layer imports only those below it,
    # no import circle in any package, the keepers independent, the store free of SQLite glue
    session.run("lint-imports", env={"PYTHONPATH": str(ROOT)})


@nox.session(python=NEWEST)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the library and service.py (fencing.otel and fencing.web with their extras)."""
    # every module is checked, so every extra a module imports is installed (web: starlette,
    # jinja2, uvicorn; otel)
    _install(session, "otel", "web")
    session.install("mypy")
    session.run("mypy")


@nox.session(python=NEWEST)
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml, docs/), built with ``--strict``: a broken link, a
    page missing from the nav or an API reference that does not resolve fails the session;
    then tools/check_site.py: it reads offline, shows no Sphinx role or reST ``::`` raw, no
    class's bases in the API reference, and wraps its code blocks; then the tests that read
    the built site (tests/docs/test_api_reference.py: here, where mkdocs is installed; the
    test sessions leave them out). The pages' code runs in the tests (tests/docs/test_docs.py)."""
    _install(session, *TEST_EXTRAS, group="test")
    session.install(*nox.project.dependency_groups(PYPROJECT, "docs"))
    with tempfile.TemporaryDirectory(prefix="fencing-site-") as site:
        session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})
        session.run("python", "tools/check_site.py", site)
    session.run("pytest", "-p", "no:cacheprovider", *SITE_TESTS)


@nox.session(python=NEWEST)
def demo(session: nox.Session) -> None:
    """The main job: the stalled worker's late write is rejected."""
    _install(session)
    session.run("python", "-m", "fencing", "demo")


#: the extras without which some modules do not import: fencing.otel (opentelemetry-api),
#: fencing.asyncio (greenlet)
IMPORT_EXTRAS = "otel,asyncio,web"
#: the top-level entries the wheel installs, as pyproject.toml's [tool.setuptools] declares them
TOP_LEVEL = ["fencing", "service.py"]


@nox.session(python=NEWEST)
def package(session: nox.Session) -> None:
    """The sdist and the wheel as a user gets them: built, checked, installed and run.

    The wheel is built from the sdist. ``check-wheel-contents`` with ``--package``: the wheel
    holds every file found under ``fencing/`` (walked, never listed: the layout changes) and
    nothing else (W101, W102); so does the sdist it is built from. ``check-manifest``: the
    sdist holds every file git tracks but CI's own scripts (.ci/). ``twine check --strict``
    reads their metadata as PyPI would. Then a new venv (``python -m venv``, outside the
    checkout) gets the wheel, without extras as the README installs it: from a directory
    outside the checkout, ``fencing --help``, every command's ``--help``, ``python -m fencing
    demo`` and a short torture run on SQLite; then with ``IMPORT_EXTRAS``: every module of the
    installed package imports, from that venv (``tests/installed_check.py``).
    """
    # check-manifest builds its own sdist of the tracked files, with this venv's setuptools
    session.install("twine>=6.1", "check-wheel-contents>=0.6", "check-manifest>=0.50", "setuptools>=77")
    with tempfile.TemporaryDirectory(prefix="fencing-package-") as scratch:
        tmp = Path(scratch)
        sdist, wheel = _build(session, tmp / "dist")
        session.run("twine", "check", "--strict", str(sdist), str(wheel))
        packages = [arg for name in TOP_LEVEL for arg in ("--package", str(ROOT / name))]
        session.run("check-wheel-contents", "--toplevel", ",".join(TOP_LEVEL), *packages, str(wheel))
        if (ROOT / ".git").exists():
            session.run("check-manifest", "--no-build-isolation", "--ignore", ".ci,.ci/*", str(ROOT))
        else:
            session.log("not a git checkout: check-manifest skipped (the sdist against git's files)")

        venv = tmp / "venv"
        session.run("python", "-m", "venv", str(venv))
        python = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
        run = tmp / "run"
        run.mkdir()
        shutil.copy(ROOT / "tests" / "installed_check.py", run)
        with session.chdir(run):
            pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
            session.run(*pip, f"fencing @ {wheel.as_uri()}", external=True)
            session.run(python, "-I", "installed_check.py", "commands", str(ROOT), external=True)
            session.run(*pip, f"fencing[{IMPORT_EXTRAS}] @ {wheel.as_uri()}", external=True)
            session.run(python, "-I", "installed_check.py", "modules", str(ROOT), external=True)


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


@nox.session(python=NEWEST)
def lockset(session: nox.Session) -> None:
    """The lock-set run (benchmarks/lockset.py): fencing.Locks, its writes fenced and not,
    beside python-redis-lock, pottery's Redlock, tooz (PostgreSQL, MySQL), PostgreSQL's
    advisory locks, portalocker and filelock, under pauses, kills and ended sessions; about
    15 minutes at 12 s a cell. ``nox -s lockset -- --seconds 30`` passes its arguments on.
    Outside CI: CI runs fencing's cells on each database for 3 s (tests/locks/test_lockset.py)."""
    _install(session, *filter(None, DATABASES.values()))
    session.install("-r", "benchmarks/requirements-locks.txt")
    session.run("python", "benchmarks/lockset.py", *session.posargs)
