"""Every statement the library runs is built in ``fencing/_sql``: no other module of the
library builds one with SQLAlchemy Core (it uses the builders there).

Building is a call of one of Core's statement constructors (``select``, ``insert``,
``update``, ``delete``, ``exists``, ``union_all``, ``text``, ...) imported from ``sqlalchemy``
or a module of it (``sqlalchemy.dialects.postgresql.insert`` too), by its name or through the
module, or a table's own constructor called bare (``table.insert()``, ``.update()``,
``.delete()``, ``.select()``). Exempt: ``fencing/_dialects`` (each database's settings
queries, read through the driver's cursor), the torture run (``fencing/torture``, which
queries its own verification tables) and docstrings (not code).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import fencing

LIBRARY = pathlib.Path(fencing.__file__).parent
EXEMPT = {"_sql", "_dialects", "torture"}
#: Core's constructors of a statement, or of a part only a statement has
BUILDERS = {
    "select",
    "insert",
    "update",
    "delete",
    "exists",
    "union",
    "union_all",
    "intersect",
    "except_",
    "text",
    "values",
    "lateral",
    "literal_select",
}
#: a table's own constructors, called with no argument
TABLE_BUILDERS = {"select", "insert", "update", "delete"}


def _sqlalchemy(module: str | None) -> bool:
    return module is not None and (module == "sqlalchemy" or module.startswith("sqlalchemy."))


def _is_module(package: str, name: str) -> bool:
    """Whether ``from package import name`` binds a module (``sqlalchemy.dialects``' ``postgresql``)."""
    if inspect.ismodule(getattr(importlib.import_module(package), name, None)):
        return True
    try:
        importlib.import_module(f"{package}.{name}")
    except ImportError:
        return False
    return True


def _builds(tree: ast.AST) -> list[int]:
    """The lines of ``tree`` that build a statement with Core."""
    builders: set[str] = set()  # names bound to a constructor
    modules: set[str] = set()  # names bound to sqlalchemy or one of its modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _sqlalchemy(node.module):
            for alias in node.names:
                bound = alias.asname or alias.name
                if alias.name in BUILDERS:
                    builders.add(bound)
                elif _is_module(node.module, alias.name):
                    modules.add(bound)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _sqlalchemy(alias.name):
                    modules.add(alias.asname or alias.name.split(".")[0])
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in builders:
            found.append(node.lineno)
        elif isinstance(f, ast.Attribute) and f.attr in BUILDERS:
            root = f.value
            while isinstance(root, ast.Attribute):
                root = root.value
            through_module = isinstance(root, ast.Name) and root.id in modules
            bare = f.attr in TABLE_BUILDERS and not node.args and not node.keywords
            if through_module or bare:
                found.append(node.lineno)
    return sorted(found)


def test_only_the_sql_package_builds_statements() -> None:
    found = [
        f"{path.relative_to(LIBRARY)}:{line}"
        for path in sorted(LIBRARY.rglob("*.py"))
        if not EXEMPT & set(path.relative_to(LIBRARY).parts)
        for line in _builds(ast.parse(path.read_text()))
    ]
    assert found == [], found


def test_the_check_sees_each_way_of_building_one() -> None:
    code = """
from sqlalchemy import select as pick, func
from sqlalchemy.dialects import postgresql
import sqlalchemy as sa

pick(func.count())
postgresql.insert(t).values(x=1)
sa.update(t)
t.delete()
"""
    assert _builds(ast.parse(code)) == [6, 7, 8, 9]


def test_the_check_passes_what_is_not_building() -> None:
    code = '''
"""select(t) in a docstring"""
from sqlalchemy import func, bindparam
d = {}
d.update({"a": 1})
items.insert(0, "x")
func.count()
bindparam("x")
'''
    assert _builds(ast.parse(code)) == []
