"""Private: everything that differs between databases, one module per database.

:func:`of` (and :func:`by_name`, for a URL) is the one place that reads a dialect's name: the
rest of the library asks the :class:`~fencing._dialects.base.Database` it returns (how a
statement is spelled there, what its error codes mean, its clock, how a session waits for a
lock, whether it can wake a waiter, how its server says who it is), never the name. A
database the library does not know by name gets the portable
:class:`~fencing._dialects.base.Database`. Column types that differ are declared where the
tables are (``fencing._sql``), with SQLAlchemy's own ``with_variant``.
"""

from __future__ import annotations

from sqlalchemy.engine import Dialect

from .base import Database
from .mysql import MySQL
from .postgresql import PostgreSQL
from .sqlite import SQLite

__all__ = ["KNOWN_NAMES", "Database", "MySQL", "PostgreSQL", "SQLite", "by_name", "of", "same"]

_BY_NAME: dict[str, Database] = {name: kind() for kind in (SQLite, PostgreSQL, MySQL) for name in kind.names}
#: the dialect names the library knows
KNOWN_NAMES = tuple(_BY_NAME)
_PORTABLE = Database()


def by_name(name: str) -> Database:
    """The database SQLAlchemy's dialect name (or a URL's backend name) ``name`` reaches."""
    return _BY_NAME.get(name, _PORTABLE)


def same(one: Dialect, other: Dialect) -> bool:
    """Whether two dialects are the same SQLAlchemy dialect (MariaDB's is not MySQL's)."""
    return one.name == other.name


def of(dialect: Dialect) -> Database:
    """The database ``dialect`` speaks to."""
    return _BY_NAME.get(dialect.name, _PORTABLE)
