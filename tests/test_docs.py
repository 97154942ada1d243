"""Every ``python`` block of the documentation site runs, page by page, in order.

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
from pathlib import Path

import pytest
from sqlalchemy import Engine

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: a fenced block at the start of a line: its language and its text
BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
RUNS_ON = re.compile(r"<!--\s*runs on:\s*([\w, ]+?)\s*(?:\(|-->)")
#: what a block's language must be to be run; the others are shell or output, never Python
PYTHON = {"python", "py", "pycon"}


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def python_blocks(page: Path) -> list[str]:
    return [code for language, code in BLOCK.findall(page.read_text(encoding="utf-8")) if language in PYTHON]


def runs_on(page: Path) -> tuple[str, ...]:
    found = RUNS_ON.search(page.read_text(encoding="utf-8"))
    return ("sqlite",) if found is None else tuple(n.strip() for n in found.group(1).split(","))


def _params() -> list[object]:
    return [
        pytest.param(page, id=str(page.relative_to(DOCS)), marks=pytest.mark.backend(*runs_on(page)))
        for page in pages()
        if python_blocks(page)
    ]


@pytest.mark.sync_only("the pages' own code")
@pytest.mark.parametrize("page", _params())
def test_every_python_block_of_the_page_runs(
    page: Path, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "page"
    work.mkdir()
    monkeypatch.chdir(work)
    if "://" in target:
        monkeypatch.setenv("DATABASE_URL", target)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        run_blocks(page, namespace)
    finally:
        for value in namespace.values():  # the page's engines: their connections closed
            if isinstance(value, Engine):
                value.dispose()


def run_blocks(page: Path, namespace: dict[str, object]) -> None:
    for number, code in enumerate(python_blocks(page), 1):
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):
            try:
                exec(compile(code, f"{page.name}, block {number}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(
                    f"{page.relative_to(DOCS)}, block {number} failed: {exc!r}\n{code}"
                ) from exc


def test_the_pages_have_code_and_the_landing_page_reaches_the_first_worker() -> None:
    """The collector finds the blocks (a page whose fences it cannot read would pass silently),
    and a newcomer reaches the first fenced worker on PostgreSQL from the landing page."""
    assert len(python_blocks(DOCS / "index.md")) == 1
    assert len(python_blocks(DOCS / "tutorials" / "first-worker-postgresql.md")) == 4
    assert runs_on(DOCS / "tutorials" / "first-worker-postgresql.md") == ("postgresql",)
    assert "(tutorials/first-worker-postgresql.md)" in (DOCS / "index.md").read_text(encoding="utf-8")
