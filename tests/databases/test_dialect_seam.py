"""What differs between databases lives in ``fencing/_dialects``: no other module of the
library branches on a dialect's or a driver's name (it asks ``fencing._dialects.of``).

A branch is a comparison (``==``, ``!=``, ``in``, ``not in``) with ``<x>.dialect.name``,
``<x>.dialect.driver``, a URL's ``get_backend_name()`` or a string that names a dialect or a
driver. Naming one in a message, a lookup table or SQLAlchemy's own per-dialect declarations
(``with_variant``, ``@compiles``, ``prefix_with(dialect=...)``) is not a branch.
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
