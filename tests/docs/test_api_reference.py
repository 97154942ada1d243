"""The API reference (docs/reference/api.md, which mkdocstrings renders from the docstrings)
reads cleanly: no reST ``::`` left in its text, no list of a class's private bases, and its code
blocks wrap their long lines instead of clipping them.

The site is built once here, with ``mkdocs build --strict`` (a few seconds), and read with
``tools/check_site.py``'s own checks, which ``nox -s docs`` runs on the site it builds. It
needs the ``docs`` group (mkdocs, mkdocs-material, mkdocstrings): ``nox -s docs`` runs it, the
test sessions leave it out (``--ignore``); elsewhere it is skipped without them, and in CI
their absence fails it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

for _needed in ("mkdocs", "material", "mkdocstrings_handlers.python"):
    if importlib.util.find_spec(_needed.split(".")[0]) is None or (
        "." in _needed and importlib.util.find_spec(_needed) is None
    ):
        _why = f"{_needed} is not installed (the docs group: pip install . --group docs)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI builds the site here: {_why}", pytrace=False)
        pytest.skip(_why, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "tools" / "check_site.py"


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_site", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_site = load_checker()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built with ``--strict`` as ``nox -s docs`` builds it."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def api(site: Path) -> str:
    return (site / Path(check_site.API_PAGE)).read_text(encoding="utf-8")


def test_no_rest_literal_marker_in_the_text(site: Path, api: str) -> None:
    """A docstring's paragraph before its code block ends in ``:``, not reST's ``::`` (which
    Markdown shows as written), and the block under it is still shown as code."""
    assert check_site.raw_literals(site) == []
    assert not re.search(r"::\s*</p>", api)
    code = "\n".join(re.findall(r"<pre\b.*?</pre>", api, re.S))
    for example in (
        "with store.fenced(lease, complete=True, result=",  # JobStore.fenced
        "store.check(lease, conn=session)",  # JobStore.check
        "[lease] = store.claim_next(",  # JobStore.complete_and_claim_next
        "marks.record_once(",  # FenceMarks.record_once
        "with locks.hold(",  # Locks.hold
        "async with store.fenced(lease, complete=True, result=",  # AsyncJobStore.fenced
        "app.mount(",  # fencing.web.lease_api
    ):
        assert example in code, f"{example!r} is not in a code block of the API reference"


def test_no_bases_listed(site: Path, api: str) -> None:
    """The bases are private mixins (a named tuple says so in its docstring)."""
    assert check_site.bases_shown(site) == []
    assert "doc-class-bases" not in api
    assert "Bases:" not in check_site.text_of(api)
    assert "JobStore" in check_site.text_of(api)  # the page is the reference, read whole


def test_code_blocks_wrap_their_long_lines(site: Path, api: str) -> None:
    """The site's stylesheet that wraps ``pre > code`` is linked from the API reference and
    from every other page with a code block."""
    assert "stylesheets/extra.css" in check_site.wrapping_stylesheets(site, site / check_site.API_PAGE)
    assert check_site.clipped_code(site) == []


def test_roles_read_as_the_code_they_name(site: Path, api: str) -> None:
    """``:meth:`~fencing.JobStore.renew``` reads ``renew``, as Sphinx shows it: no role's name
    and no ``~`` left on any page (39 were, before the hook shortened the target)."""
    assert check_site.raw_roles(site) == []
    assert "<code>~" not in api
    # Refusal's docstring: "a refused :meth:`~fencing.JobStore.renew`"
    assert re.search(r"refused <code>renew</code>", api), "the shortened target is not shown"
    assert check_site.RAW_ROLE.search("a <code>~fencing.Refusal</code>")
    assert check_site.RAW_ROLE.search("a :class:<code>Lease</code>")
    assert not check_site.RAW_ROLE.search("<code>~/.config</code> and <code>Lease</code>")
