"""What differs between databases lives in ``fencing/_dialects``: no other module of the
library branches on a dialect's or a driver's name (it asks ``fencing._dialects.of``).

A branch is a comparison (``==``, ``!=``, ``in``, ``not in``) with ``<x>.dialect.name``,
``<x>.dialect.driver``, a URL's ``get_backend_name()`` or a string that names a dialect or a
driver. Naming one in a message, a lookup table or SQLAlchemy's own per-dialect declarations
(``with_variant``, ``@compiles``, ``prefix_with(dialect=...)``) is not a branch.

SQLAlchemy's per-database constructs (``sqlalchemy.dialects.<name>``: ``ON CONFLICT``, ``ON
DUPLICATE KEY``, a database's column types) are imported only where the statements and tables
are built (``fencing/_sql``), which builds each database's form for the plan that
``fencing/_dialects`` chose, and in ``fencing/_dialects`` itself.
"""

from __future__ import annotations

import ast
import pathlib

import fencing

LIBRARY = pathlib.Path(fencing.__file__).parent
NAMES = {
    "sqlite",
    "postgresql",
    "mysql",
    "mariadb",
    "pysqlite",
    "aiosqlite",
    "psycopg",
    "psycopg_async",
    "asyncpg",
    "pymysql",
    "asyncmy",
}


def _names_a_dialect(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_dialect(e) for e in node.elts)
    if isinstance(node, ast.Attribute) and node.attr in ("name", "driver"):
        return isinstance(node.value, ast.Attribute) and node.value.attr == "dialect"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "get_backend_name"
    return False


def _branches(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(_names_a_dialect(n) for n in (node.left, *node.comparators)):
            found.append(f"{path.relative_to(LIBRARY)}:{node.lineno}")
    return found


def test_only_the_dialect_package_branches_on_a_dialect_or_driver_name() -> None:
    found = [
        where
        for path in sorted(LIBRARY.rglob("*.py"))
        if "_dialects" not in path.relative_to(LIBRARY).parts
        for where in _branches(path)
    ]
    assert found == [], found


def test_the_check_sees_a_branch() -> None:
    tree = "if engine.dialect.name == 'sqlite': pass\nif driver in ('psycopg', 'asyncpg'): pass\n"
    flagged = [n for n in ast.walk(ast.parse(tree)) if isinstance(n, ast.Compare)]
    assert all(any(_names_a_dialect(x) for x in (n.left, *n.comparators)) for n in flagged)
    assert len(flagged) == 2


def _imports_a_dialects_construct(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(n == "sqlalchemy.dialects" or n.startswith("sqlalchemy.dialects.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_sql_and_dialect_packages_import_a_databases_constructs() -> None:
    found = [
        f"{path.relative_to(LIBRARY)}:{line}"
        for path in sorted(LIBRARY.rglob("*.py"))
        if not {"_sql", "_dialects"} & set(path.relative_to(LIBRARY).parts)
        for line in _imports_a_dialects_construct(ast.parse(path.read_text()))
    ]
    assert found == [], found


def test_the_check_sees_an_import_of_a_databases_constructs() -> None:
    tree = ast.parse(
        "from sqlalchemy.dialects import postgresql\n"
        "from sqlalchemy.dialects.sqlite import insert\n"
        "import sqlalchemy.dialects.mysql\n"
        "from sqlalchemy import dialects\n"
        "from sqlalchemy import select\n"
    )
    assert _imports_a_dialects_construct(tree) == [1, 2, 3, 4]
