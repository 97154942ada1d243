"""The test matrix: python x SQLAlchemy x database, plus lint, typecheck, demo, package and bench.

``nox`` runs the default sessions; ``nox -t sqlite`` / ``-t postgresql`` / ``-t mariadb``
runs one backend's tests. A server that does not answer skips its sessions with the
reason and how to enable it, except under ``CI=true``, where the suite fails instead.

Most sessions install the checkout editable (``-e``) and so test the source tree. What a user
gets is the wheel, and two sessions test that instead:

* ``package`` builds the sdist and, from it, the wheel (``python -m build``), checks what is in
  them (every file of ``fencing/`` found in the tree, whatever its layout; ``twine check
  --strict``; ``check-wheel-contents``), installs the wheel in a new venv outside the checkout
  and runs the command and imports every module from there (``tests/installed_check.py``).
* ``tests(3.12-latest-sqlite)`` (``AGAINST_WHEEL``) runs the suite against the built wheel,
  installed non-editable, from the unpacked sdist less the package itself, so ``fencing`` can
  only come from site-packages (``FENCING_TEST_INSTALLED``: ``tests/conftest.py`` fails the
  run otherwise). That converts a quick session instead of adding one: the build costs it
  about 10 s; the suite does not depend on how the package was installed, beyond that.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "torture", "lint", "typecheck", "demo", "package", "docs"]

ROOT = Path(__file__).resolve().parent

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


#: the tests session that runs the suite against the built wheel instead of the source tree: a
#: quick one (no slow tests), on a python that is neither end of the range (those test the
#: lowest SQLAlchemy too), with SQLite (no server)
AGAINST_WHEEL = ("3.12", "latest", "sqlite")


@nox.session
@nox.parametrize(("python", "sqlalchemy", "db"), _matrix())
def tests(session: nox.Session, sqlalchemy: str, db: str) -> None:
    """The whole suite for one python, one SQLAlchemy line and one database (for
    ``AGAINST_WHEEL``, against the built wheel: see the top of noxfile.py)."""
    # every driver, also for SQLite: a few tests build engines of each dialect offline
    extras = ["test", *filter(None, DATABASES.values())]
    # process races, kills and torture runs take seconds each and do not vary with python or
    # SQLAlchemy: they run once per database, on the newest of both; so does the second run
    # of the store-fixture suite through the async store (test_asyncio.py runs everywhere)
    newest = (session.python, sqlalchemy) == (NEWEST, "latest")
    quick = [] if newest else ["-m", "not slow and not async_front"]
    if sqlalchemy == "lowest" and db != "sqlite" and not session.posargs:
        quick += DIALECT_FACING
    pytest = ["pytest", "-n", "auto", "--db", db, *quick, *session.posargs]
    if (session.python, sqlalchemy, db) == AGAINST_WHEEL:
        with _suite_against_wheel(session, extras, sqlalchemy) as suite, session.chdir(suite):
            _require_server(session, db)
            session.run(*pytest, env={"FENCING_TEST_INSTALLED": "1"})
        return
    _install(session, *extras, sqlalchemy=sqlalchemy)
    _require_server(session, db)
    session.run(*pytest)


@contextlib.contextmanager
def _suite_against_wheel(session: nox.Session, extras: list[str], sqlalchemy: str) -> Iterator[Path]:
    """Install the built wheel (not editable) with ``extras``; yield where to run the suite.

    That is the unpacked sdist (so the sdist is shown to hold what the suite needs: the
    ``tests`` package its tests import helpers from, the examples and docs they read beside
    it, pytest's settings in pyproject.toml) less what the wheel installs (``fencing/``,
    ``service.py``) and the egg-info, in a temporary directory outside the checkout: nothing
    on ``sys.path`` there, neither pytest's rootdir nor the cwd of the processes the tests
    start, can import the source instead of site-packages.
    """
    with tempfile.TemporaryDirectory(prefix="fencing-suite-") as scratch:
        sdist, wheel = _build(session, Path(scratch) / "dist")
        requirement = f"fencing[{','.join(extras)}] @ {wheel.as_uri()}"
        session.install("--upgrade", requirement, SQLALCHEMY[sqlalchemy])
        # the same version as an editable install of the checkout (an earlier run): replace it
        session.install("--force-reinstall", "--no-deps", str(wheel))
        suite = _unpack(sdist, Path(scratch) / "sdist")
        with zipfile.ZipFile(wheel) as whl:
            installed = {name.split("/")[0] for name in whl.namelist()}
        for name in [*installed, *(p.name for p in suite.glob("*.egg-info"))]:
            path = suite / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        yield suite


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


def _unpack(sdist: Path, into: Path) -> Path:
    """Extract ``sdist`` under ``into``: the directory it holds (``fencing-VERSION``)."""
    with tarfile.open(sdist) as tar:
        # the "data" filter (no links out, no special files) where this python has it
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(into, **kwargs)  # type: ignore[arg-type]
    (top,) = into.iterdir()
    return top


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


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", list(DATABASES), ids=list(DATABASES))
def election_soak(session: nox.Session, db: str) -> None:
    """The locks' and elections' torture (tests/test_election_torture.py: holders frozen,
    killed, killed inside their transaction, revoked, cut off) with a long fault phase, both
    modes and both fronts: ``nox -s election_soak -- SECONDS`` (default 120). Outside CI: CI
    runs it for 8 s per database, mode and front."""
    _install(session, "test", *filter(None, DATABASES.values()))
    _require_server(session, db)
    seconds = session.posargs[0] if session.posargs else "120"
    session.run(
        "pytest",
        "tests/test_election_torture.py",
        "--db",
        db,
        "-p",
        "no:randomly",
        "-s",
        env={"FENCING_ELECTION_TORTURE_SECONDS": seconds},
    )


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", ["postgresql", "mariadb"], ids=["postgresql", "mariadb"])
def crash_soak(session: nox.Session, db: str) -> None:
    """The torture with the database server itself crashing (tests/test_server_crash.py:
    SIGKILL of a private PostgreSQL or MariaDB, down 0.2-2 s, crash recovery, every 0.75-2.25 s
    of the fault phase; workers frozen, killed, killed inside their transaction, revoked too),
    both fronts: ``nox -s crash_soak -- SECONDS`` (default 300). The servers are the test's own,
    started from the binaries installed here, never the shared ones. Outside CI: CI runs it for
    10 s per database, on the sync front, with only freezes and revokes besides the crashes."""
    _install(session, "test", *filter(None, DATABASES.values()))
    seconds = session.posargs[0] if session.posargs else "300"
    session.run(
        "pytest",
        "tests/test_server_crash.py",
        "--db",
        db,
        "-n",
        "0",
        "--long",
        "-p",
        "no:randomly",
        "-s",
        env={"FENCING_CRASH_TORTURE_SECONDS": seconds},
    )


@nox.session(python=NEWEST, tags=["soak"])
@nox.parametrize("db", list(DATABASES), ids=list(DATABASES))
def soak(session: nox.Session, db: str) -> None:
    """A million operations (tests/test_soak.py): the torture until the workers have made
    ``nox -s soak -- OPERATIONS`` operations (default 1,000,000: claims, renewals, completions,
    fenced blocks, releases, guarded writes), on a backlog topped up as it runs out, sync and
    async workers in one run, no simulated work, every fault kind: frozen, killed, killed
    inside the transaction, revoked; on PostgreSQL and MariaDB the server crashed too (a
    private one, started from the binaries installed here, never the shared one); SQLite has
    no server to crash. Prints the figures docs/explanation/proof.md shows. Outside CI: CI runs 3,000
    operations per database."""
    _install(session, "test", *filter(None, DATABASES.values()))
    operations = session.posargs[0] if session.posargs else "1000000"
    session.run(
        "pytest",
        "tests/test_soak.py",
        "--db",
        db,
        "-n",
        "0",
        "-k",
        "test_soak_of_operations",
        "-p",
        "no:randomly",
        "-s",
        env={"FENCING_SOAK_OPERATIONS": operations},
    )


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@nox.session(python=NEWEST)
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting; import-linter: the layers of fencing/ (``[tool.importlinter]``)."""
    session.install("ruff", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # the contract is read from the source tree: each layer imports only those below it,
    # no import circle in any package, the library never imports its own public re-exports
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
    page missing from the nav or an API reference that does not resolve fails the session.
    The pages' code runs in the tests (tests/test_docs.py)."""
    _install(session, "docs")
    with tempfile.TemporaryDirectory(prefix="fencing-site-") as site:
        session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})
        fetched = _fetched_from_the_web(Path(site))
        if fetched:
            shown = "\n".join(fetched)
            session.error(f"the site fetches from the web when read (it must read offline):\n{shown}")
        session.log(f"offline: no page, stylesheet or script of the site fetches from the web ({site})")
        roles = [
            str(page.relative_to(site))
            for page in Path(site).rglob("*.html")
            if _RAW_ROLE.search(page.read_text(encoding="utf-8"))
        ]
        if roles:  # docs/hooks/rst_roles.py shows them as the code they name
            session.error(f"Sphinx roles shown raw on: {', '.join(roles)}")


#: a docstring's Sphinx role as Markdown renders it: the role's name before the code
_RAW_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):<code>")

#: what a browser fetches by itself when a page is read (a script, a stylesheet, a font, an
#: image, a preconnect), as opposed to a link the reader may follow. (Material's script names
#: two URLs it loads only on demand: a ResizeObserver polyfill for browsers without one, and
#: mermaid for a page with a diagram; no page has one.)
_FETCHED = re.compile(
    r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["']?(?:https?:)?//[^"'\s>]+"""
    r"""|<link\b[^>]*\bhref=["']?(?:https?:)?//[^"'\s>]+"""
    r"""|@import\s+(?:url\()?["']?(?:https?:)?//[^"')\s]+"""
    r"""|url\(\s*["']?(?:https?:)?//[^"')\s]+""",
    re.I,
)


def _fetched_from_the_web(site: Path) -> list[str]:
    """Every reference in the built site that a browser would fetch from another host."""
    found = []
    for path in sorted(site.rglob("*")):
        if path.suffix in (".html", ".css", ".js") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path.relative_to(site)}: {m.group(0)[:160]}" for m in _FETCHED.finditer(text)]
    return found


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
#: the checkout's files that the sdist leaves out: CI's own scripts, git's files (.gitignore)
SDIST_OMITS = (".ci/", ".git")


@nox.session(python=NEWEST)
def package(session: nox.Session) -> None:
    """The sdist and the wheel as a user gets them: built, checked, installed and run.

    The wheel is built from the sdist; both must hold every ``.py`` and ``py.typed`` file found
    under ``fencing/`` (walked, never listed: the package's layout changes), the wheel
    nothing else, the sdist every file git tracks (but ``SDIST_OMITS``); ``twine check
    --strict`` reads their metadata as PyPI would. Then a new venv (``python -m venv``, outside
    the checkout) gets the wheel, without extras as the README installs it: from a directory
    outside the checkout, ``fencing --help``, every command's ``--help``, ``python -m fencing
    demo`` and a short torture run on SQLite; then with ``IMPORT_EXTRAS``: every module of the
    installed package imports, from that venv (``tests/installed_check.py``).
    """
    session.install("twine>=6.1", "check-wheel-contents>=0.6")
    with tempfile.TemporaryDirectory(prefix="fencing-package-") as scratch:
        tmp = Path(scratch)
        sdist, wheel = _build(session, tmp / "dist")
        _check_contents(session, sdist, wheel)
        session.run("twine", "check", "--strict", str(sdist), str(wheel))
        packages = [arg for name in TOP_LEVEL for arg in ("--package", str(ROOT / name))]
        session.run("check-wheel-contents", "--toplevel", ",".join(TOP_LEVEL), *packages, str(wheel))

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


def _check_contents(session: nox.Session, sdist: Path, wheel: Path) -> None:
    """What the sdist and the wheel must hold, from the files of the checkout."""
    package = ROOT / TOP_LEVEL[0]
    # every file of the package in the tree; the modules and the typing marker must be shipped
    tree = {
        p.relative_to(ROOT).as_posix()
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    }
    tree |= {name for name in TOP_LEVEL[1:] if (ROOT / name).is_file()}
    # every file: modules, the typing marker, and the web's templates and static files
    required = set(tree)
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = {n for n in whl.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
    with tarfile.open(sdist) as tar:
        in_sdist = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
    problems = []
    for kind, names in (("wheel", in_wheel), ("sdist", in_sdist)):
        if missing := sorted(required - names):
            problems.append(f"the {kind} lacks {len(missing)} file(s) of the tree: {', '.join(missing)}")
    if stray := sorted(in_wheel - tree):
        problems.append(f"the wheel holds files that are not in the tree: {', '.join(stray)}")
    if tracked := _tracked():
        if missing := sorted(f for f in tracked if not f.startswith(SDIST_OMITS) and f not in in_sdist):
            problems.append(f"the sdist lacks tracked files (MANIFEST.in): {', '.join(missing)}")
    else:
        session.log("not a git checkout: the sdist is checked for the package's files only")
    if problems:
        session.error("\n".join(problems))
    session.log(
        f"{len(required)} modules and markers of the tree in both; the wheel {len(in_wheel)} files "
        f"besides its metadata, the sdist {len(in_sdist)}"
    )


def _tracked() -> set[str]:
    """The files git tracks in the checkout that are there (none outside a git checkout)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return set()
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return {name for name in listed.split("\0") if name and (ROOT / name).is_file()}


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
