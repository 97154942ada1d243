"""The page "Is fencing for me?" (``docs/explanation/is-it-for-me.md``) stays true to the code
and to the measurements it quotes.

Its code blocks are files of the reader's (``title="celery_tasks.py"``): ``tests/docs/test_docs.py``
writes them to disk but cannot run them (Celery, procrastinate and a broker are not the suite's),
so this test parses each one and checks every name it takes from ``fencing`` against the
installed package: a renamed class, method or attribute breaks this test, not a reader's task.
Every figure the page quotes comes from a page that measured it: each table row is a row of that
page, and each number of its prose is found there. The README reaches the page in one click.
No database: it reads files.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import fencing
from tests.docs.test_docs import BLOCK, PYTHON, TITLE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGE = DOCS / "explanation" / "is-it-for-me.md"
LINK = "explanation/is-it-for-me.md"
#: the pages that measured what the page quotes
SOURCES = {
    name: (DOCS / "explanation" / f"{name}.md").read_text(encoding="utf-8")
    for name in ("guarantee", "benchmarks", "proof")
}

#: the figures the page's prose quotes, each with the page that measured it
FIGURES = {
    "guarantee": ["5.5-6.4", "21-22", "34.5"],
    "benchmarks": [
        "2,245",
        "1,971",
        "575",
        "422",
        "3,473",
        "1,220",
        "1,198",
        "4.60 ms",
        "1,008 ms",
        "2.34 ms",
        "3.51 ms",
        "2.52 ms",
        "3.87 ms",
        "24.5 ms",
        "148 ms",
        "0.71 (0.61-1.05",
        "1.13",
        "1.71",
        "2.32 ms",
        "316",
        "431",
        "10,867",
        "10,599",
        "7,958",
        "1,852",
        "1,843",
        "One machine's SQLite\nserializes writers; past that, use a server",
    ],
    "proof": ["1,000,601", "1,000,644", "1,000,667", "1,053"],
}


def page_text() -> str:
    return PAGE.read_text(encoding="utf-8")


def titled_blocks() -> dict[str, str]:
    """The page's Python blocks that are files: their title, their code."""
    text = page_text()
    titles = {m.start(): m.group(1) for m in TITLE.finditer(text)}
    return {
        titles[m.start()]: m.group(2)
        for m in BLOCK.finditer(text)
        if m.group(1) in PYTHON and m.start() in titles
    }


# -- the code ------------------------------------------------------------------------------


class Names(ast.NodeVisitor):
    """What a block takes from ``fencing``: every name of a ``fencing`` module it reads, and
    every attribute it reads on an object a ``fencing`` call returned (``store.fenced``: a
    ``JobStore`` built by ``fencing.JobStore(...)``; ``lock.fenced``: the ``HeldLock`` that
    ``Locks.hold`` yields, read from its return annotation)."""

    def __init__(self) -> None:
        self.modules: dict[str, ModuleType] = {}  # local name -> a fencing module
        self.imported: dict[str, object] = {}  # local name -> what it names in fencing
        self.typed: dict[str, type] = {}  # local name -> the fencing class of its value
        self.checked: set[str] = set()  # "JobStore.fenced", "fencing.Heartbeat", ...
        self.missing: set[str] = set()

    # the bindings

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "fencing" or alias.name.startswith("fencing."):
                module = importlib.import_module(alias.name)
                if alias.asname:
                    self.modules[alias.asname] = module
                else:
                    self.modules["fencing"] = fencing

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and (node.module == "fencing" or node.module.startswith("fencing.")):
            module = importlib.import_module(node.module)
            for alias in node.names:
                found = self._attribute(module, alias.name, node.module)
                if found is not None:
                    self.imported[alias.asname or alias.name] = found

    def visit_Assign(self, node: ast.Assign) -> None:
        kind = self._kind(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name) and kind is not None:
                self.typed[target.id] = kind
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            kind = self._kind(item.context_expr)
            if isinstance(item.optional_vars, ast.Name) and kind is not None:
                self.typed[item.optional_vars.id] = kind
        self.generic_visit(node)

    # the reads

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._resolve(node)
        self.generic_visit(node)

    def _resolve(self, node: ast.expr) -> object:
        """What ``node`` names in fencing (a module, a class, a function, a method), or None."""
        if isinstance(node, ast.Name):
            return self.modules.get(node.id) or self.imported.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = self._resolve(node.value)
            if isinstance(owner, ModuleType):
                return self._attribute(owner, node.attr, owner.__name__)
            kind = self._kind(node.value) if owner is None else None
            if kind is not None:
                return self._attribute(kind, node.attr)
        return None

    def _attribute(self, owner: ModuleType | type, name: str, shown: str | None = None) -> object:
        label = f"{shown or owner.__name__}.{name}"
        self.checked.add(label)
        if isinstance(owner, ModuleType):
            try:
                return getattr(owner, name)
            except AttributeError:
                try:
                    return importlib.import_module(f"{owner.__name__}.{name}")
                except ImportError:
                    self.missing.add(label)
                    return None
        fields = {f for k in owner.__mro__ for f in getattr(k, "__annotations__", {})}
        if not hasattr(owner, name) and name not in fields:
            self.missing.add(label)
            return None
        return getattr(owner, name, None)

    def _kind(self, node: ast.expr) -> type | None:
        """The fencing class of a name's value, or of what a call returns: a class called, or
        a method whose return annotation names a public class of ``fencing``
        (``Iterator[HeldLock]``, ``Lease | None``)."""
        if isinstance(node, ast.Name):
            return self.typed.get(node.id)
        if not isinstance(node, ast.Call):
            return None
        called = self._resolve(node.func)
        if inspect.isclass(called) and called.__module__.startswith("fencing"):
            return called
        if callable(called):
            annotation = inspect.signature(called).return_annotation
            text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
            for word in re.findall(r"\w+", text):
                if word in fencing.__all__ and inspect.isclass(getattr(fencing, word)):
                    return getattr(fencing, word)
        return None


def names_of(code: str) -> Names:
    names = Names()
    names.visit(ast.parse(code))
    return names


def test_the_page_has_its_files() -> None:
    assert set(titled_blocks()) == {"celery_tasks.py", "celery_reports.py", "procrastinate_tasks.py"}


@pytest.mark.parametrize("title", sorted(titled_blocks()))
def test_each_file_parses_and_takes_only_names_fencing_has(title: str) -> None:
    names = names_of(titled_blocks()[title])  # ast.parse: a SyntaxError fails here
    assert names.checked, f"{title} takes nothing from fencing: the checker found no name"
    assert not names.missing, f"{title} uses names fencing does not have: {sorted(names.missing)}"


def test_the_checker_follows_the_objects_the_files_build() -> None:
    """The names the files use are the ones checked: calls on a store, a heartbeat, a held lock."""
    checked = set().union(*(names_of(code).checked for code in titled_blocks().values()))
    for name in (
        "fencing.JobStore",
        "fencing.Heartbeat",
        "fencing.Locks",
        "fencing.LeaseLost",
        "fencing.LockTimeout",
        "JobStore.enqueue",
        "JobStore.claim",
        "JobStore.state",
        "JobStore.fenced",
        "JobState.done",
        "JobState.result",
        "Lease.fence",
        "Heartbeat.lease",
        "Heartbeat.check",
        "Locks.hold",
        "HeldLock.fenced",
    ):
        assert name in checked, f"{name} is not checked"


def test_the_checker_catches_a_renamed_api() -> None:
    code = (
        "import fencing\n"
        "from fencing import Locks, NoSuchThing\n"
        "store = fencing.JobStore(engine)\n"
        "lease = store.claim('j', 'o', ttl=1)\n"
        "with fencing.Heartbeat(store, lease, 1) as hb:\n"
        "    hb.beat()\n"
        "store.fence_it(lease)\n"
        "print(lease.token, fencing.Worker2)\n"
        "with Locks(engine).hold('n', 'o', ttl=1) as lock:\n"
        "    lock.fenced_block()\n"
    )
    assert names_of(code).missing == {
        "fencing.NoSuchThing",
        "Heartbeat.beat",
        "JobStore.fence_it",
        "Lease.token",
        "fencing.Worker2",
        "HeldLock.fenced_block",
    }


# -- the way in ----------------------------------------------------------------------------


def test_the_readme_reaches_the_page_near_its_top() -> None:
    head = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:60])
    assert f"(docs/{LINK})" in head


def test_the_site_lists_the_page_first_among_the_explanations() -> None:
    assert f"({LINK})" in (DOCS / "index.md").read_text(encoding="utf-8")
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    explanation = nav.split("  - Explanation:\n", 1)[1]
    assert explanation.splitlines()[0].strip().endswith(LINK)


# -- the figures ---------------------------------------------------------------------------


def prose(text: str) -> str:
    """The page without its code blocks, tables, inline code and link targets."""
    text = BLOCK.sub("", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("|"))
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def test_each_quoted_figure_is_in_the_page_that_measured_it() -> None:
    text = page_text()
    for source, figures in FIGURES.items():
        for figure in figures:
            assert " ".join(figure.split()) in " ".join(text.split()), f"the page no longer quotes {figure!r}"
            assert figure in SOURCES[source], f"{figure!r} is not in {source}.md: the figure drifted"


def test_every_table_row_is_a_row_of_a_measuring_page() -> None:
    rows = [line for line in page_text().splitlines() if line.startswith("|")]
    assert len(rows) >= 20
    lines = {line for text in SOURCES.values() for line in text.splitlines()}
    for row in rows:
        assert row in lines, f"this row is not in guarantee.md, benchmarks.md or proof.md:\n{row}"


#: a number as prose writes it: 2,245, 0.71, 5.5 (a range's ends are numbers of their own)
NUMBER = re.compile(r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?(?![\w]|[.,]\d)")


def test_every_number_of_the_prose_is_in_a_measuring_page() -> None:
    """A figure added to the page's prose without its source fails here (the FIGURES above
    pin the ones that matter to their page)."""
    sources = "\n".join(SOURCES.values())
    numbers = set(NUMBER.findall(prose(page_text())))
    assert {"1,852", "1,220", "0.71"} <= numbers
    for number in sorted(numbers):
        found = re.search(rf"(?<![\w.,]){re.escape(number)}(?![\w]|[.,]\d)", sources)
        assert found, f"{number} is in the page's prose, in none of the pages that measured"
