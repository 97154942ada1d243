"""Every ``python`` block of the documentation site and of the README runs, page by page, in
order; every ``fencing`` command line in their other blocks parses with the real parser.

A page is run like a notebook: its blocks, top to bottom, in one namespace, in an empty
directory of the test's own, so a renamed argument or a changed answer breaks this test, not a
reader. A page runs on SQLite unless it says otherwise in a comment of its own
(``<!-- runs on: postgresql -->``); a server's page gets the suite's database of the test as
``DATABASE_URL``, which it reads. ``mkdocs build --strict`` (``nox -s docs``) checks the links
and the API reference; this checks the code.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, Text, create_engine

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: generated from the parser, and compared with it whole (its synopses are not command lines)
CLI_REFERENCE = DOCS / "reference" / "cli.md"
#: a fenced block at the start of a line: its language and its text
BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
RUNS_ON = re.compile(r"<!--\s*runs on:\s*([\w, ]+?)\s*(?:\(|-->)")
#: what a block's language must be to be run; the others are shell or output, never Python
PYTHON = {"python", "py", "pycon"}


def pages() -> list[Path]:
    """Every page of the site, and the README (the front page people see first)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT if page == README else DOCS))


#: a block that is a file of the reader's (``title="tasks.py"``, which the site shows as the
#: block's header): written into the page's directory, not run, for the later blocks to import
TITLE = re.compile(r'^```\w+[^\n]*title="([\w./-]+\.py)"', re.M)


def python_blocks(page: Path) -> list[str]:
    return [code for language, code in BLOCK.findall(page.read_text(encoding="utf-8")) if language in PYTHON]


def file_blocks(page: Path) -> dict[int, str]:
    """The Python blocks that are files, by their number among the page's Python blocks (from 1)."""
    text = page.read_text(encoding="utf-8")
    numbered = [m for m in BLOCK.finditer(text) if m.group(1) in PYTHON]
    titles = {m.start(): m.group(1) for m in TITLE.finditer(text)}
    return {number: titles[m.start()] for number, m in enumerate(numbered, 1) if m.start() in titles}


#: the names a page may give a database (the suite's --db names), as the dialects the
#: ``backend`` marker selects by (MariaDB's is mysql)
DIALECTS = {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql", "mysql": "mysql"}


def runs_on(page: Path) -> tuple[str, ...]:
    """The dialects a page runs on: SQLite unless it says otherwise; a name it gives that is
    not a database's is an error (a page would otherwise be deselected everywhere, silently)."""
    found = RUNS_ON.search(page.read_text(encoding="utf-8"))
    if found is None:
        return ("sqlite",)
    names = [n.strip() for n in found.group(1).split(",")]
    unknown = sorted(set(names) - set(DIALECTS))
    if unknown:
        raise ValueError(f"{page}: runs on {unknown}? the databases are {sorted(DIALECTS)}")
    return tuple(dict.fromkeys(DIALECTS[n] for n in names))


def _params() -> list[object]:
    return [
        pytest.param(page, id=_name(page), marks=pytest.mark.backend(*runs_on(page)))
        for page in pages()
        if python_blocks(page)
    ]


def reruns(page: Path) -> bool:
    """Whether a reader runs the page again as it is: every tutorial, and every page that runs
    on a server (a database others use: the second run must find its way through the first's)."""
    return "tutorials" in page.parts or runs_on(page) != ("sqlite",)


#: what a shared database already holds: someone's own table named ``jobs``, with rows
STRANGER = Table("jobs", MetaData(), Column("order_id", Integer, primary_key=True), Column("note", Text))
STRANGER_ROWS = [{"order_id": n, "note": f"someone's order {n}"} for n in range(1, 44)]


@pytest.mark.sync_only("the pages' own code")
@pytest.mark.parametrize("page", _params())
def test_every_python_block_of_the_page_runs(
    page: Path, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block in order; a tutorial or a server page twice, in the same directory and
    database; a server page beside someone's own ``jobs`` table, which it leaves as it was."""
    work = tmp_path / "page"
    work.mkdir()
    monkeypatch.chdir(work)
    shared = None
    if "://" in target:
        monkeypatch.setenv("DATABASE_URL", target)
        shared = create_engine(target)
        STRANGER.create(shared)
        with shared.begin() as conn:
            conn.execute(STRANGER.insert(), STRANGER_ROWS)
    files = file_blocks(page)
    if files:
        monkeypatch.syspath_prepend(str(work))  # the page's files import each other, as a reader's do
    try:
        for run in range(2 if reruns(page) else 1):
            _run_page(page, work, files, run)
        if shared is not None:
            with shared.connect() as conn:
                kept = conn.execute(STRANGER.select().order_by(STRANGER.c.order_id)).mappings()
                assert [dict(row) for row in kept] == STRANGER_ROWS
    finally:
        if shared is not None:
            shared.dispose()


def _run_page(page: Path, work: Path, files: dict[int, str], run: int) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    modules = set(sys.modules)
    try:
        run_blocks(page, namespace, files, run=run)
    finally:
        for name in set(sys.modules) - modules:  # the page's own modules: no other page sees them
            if getattr(sys.modules[name], "__file__", "") and str(work) in str(sys.modules[name].__file__):
                del sys.modules[name]
        for value in namespace.values():  # the page's engines: their connections closed
            if isinstance(value, Engine):
                value.dispose()


def run_blocks(
    page: Path, namespace: dict[str, object], files: dict[int, str] | None = None, *, run: int = 0
) -> None:
    again = " (run again)" if run else ""
    for number, code in enumerate(python_blocks(page), 1):
        if files and number in files:
            Path(files[number]).write_text(code, encoding="utf-8")
            continue
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):
            try:
                exec(compile(code, f"{page.name}, block {number}", "exec", dont_inherit=True), namespace)
            except Exception as exc:
                raise AssertionError(f"{_name(page)}, block {number} failed{again}: {exc!r}\n{code}") from exc


def test_the_pages_have_code_and_the_landing_page_reaches_the_first_worker() -> None:
    """The collector finds the blocks (a page whose fences it cannot read would pass silently),
    and a newcomer reaches the first fenced worker on PostgreSQL from the landing page."""
    assert len(python_blocks(DOCS / "index.md")) == 1
    assert len(python_blocks(DOCS / "tutorials" / "first-worker-postgresql.md")) == 6
    assert runs_on(DOCS / "tutorials" / "first-worker-postgresql.md") == ("postgresql",)
    assert "(tutorials/first-worker-postgresql.md)" in (DOCS / "index.md").read_text(encoding="utf-8")


def test_the_readme_is_a_front_page_that_reaches_the_first_worker() -> None:
    """The README is the front page: its ten lines (run above, as a page), the two commands,
    and one click to the first fenced worker on PostgreSQL; everything else lives in docs/."""
    text = README.read_text(encoding="utf-8")
    assert len(python_blocks(README)) == 1
    assert "python -m pip install . && python -m fencing demo" in text
    assert "python -m pip install nox && python -m nox" in text
    assert "(docs/tutorials/first-worker-postgresql.md)" in text
    assert len(text.splitlines()) < 100, "the README is a front page: the rest belongs in docs/"
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), f"the README links to {target}, which does not exist"


# -- the command lines ---------------------------------------------------------------------

#: a command line of a shell or output block: ``fencing ...`` or ``python -m fencing ...``,
#: after a prompt (``$ ``) where the block has prompts (its other lines are output), at the
#: start of any line of a block without them
COMMAND = re.compile(r"^\s*(\$\s+)?(?:python3? -m fencing|fencing)\s+(.*)$")


def command_lines(page: Path) -> list[str]:
    """The ``fencing`` command lines of a page's non-Python blocks: shell comments, pipes,
    redirections and ``&&`` cut off, ``\\`` continuations joined."""
    found = []
    for language, code in BLOCK.findall(page.read_text(encoding="utf-8")):
        if language in PYTHON:
            continue
        prompted = re.search(r"^\s*\$\s", code, re.M) is not None
        for line in code.replace("\\\n", " ").splitlines():
            match = COMMAND.match(line)
            if match is not None and bool(match.group(1)) == prompted:
                found.append(re.split(r"\s(?:#|\||&&|>|<)|;", " " + match.group(2))[0].strip())
    return found


def _command_params() -> list[object]:
    return [
        pytest.param(page, line, id=f"{_name(page)}: fencing {line}")
        for page in pages()
        if page != CLI_REFERENCE
        for line in command_lines(page)
    ]


@pytest.mark.parametrize(("page", "line"), _command_params())
def test_every_command_line_parses(page: Path, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renamed option or command breaks this test, not a reader's paste. ``--url`` may be
    left out (``$FENCING_URL``), as the pages say; ``--help`` lines exit 0."""
    monkeypatch.setenv("FENCING_URL", "jobs.db")
    from fencing.cli.commands import build_parser

    parser = build_parser("fencing")
    code: object = None
    try:
        args = parser.parse_args(shlex.split(line))
    except SystemExit as exit:  # --help and --version exit 0; a bad line exits 2
        code = exit.code
    else:
        assert getattr(args, "run", None) is not None, f"{_name(page)}: `fencing {line}` names no command"
    assert code in (None, 0), f"{_name(page)}: `fencing {line}` does not parse (exit {code})"


def test_the_command_lines_are_found() -> None:
    """The collector finds the pages' command lines (a prompt or a block it could not read
    would leave them unchecked)."""
    lines = [line for page in pages() for line in command_lines(page)]
    assert len(lines) >= 10
    assert any(line.startswith("torture") for line in lines)


def test_the_cli_reference_is_the_parser() -> None:
    from tests.cli_reference import render

    assert CLI_REFERENCE.read_text(encoding="utf-8") == render(), (
        "docs/reference/cli.md is out of date: python -m tests.cli_reference > docs/reference/cli.md"
    )
