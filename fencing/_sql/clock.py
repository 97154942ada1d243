"""The database server's clock, as seconds since the epoch (a double), in SQL.

``now=None`` in the store means "use this": it is evaluated inside the statement that
checks or writes a lease, so workers on machines with skewed clocks still agree.
Each dialect reads a clock that is fixed for one statement and fresh for the next,
even inside a long transaction:

* SQLite: ``julianday('now')`` (stable within one statement; millisecond resolution);
* PostgreSQL: ``statement_timestamp()`` (not ``now()``, which is the transaction's start);
* MariaDB/MySQL: ``UTC_TIMESTAMP(6)`` (independent of the session's time zone).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import Double

from .._dialects import of

__all__ = ["database_now"]


class database_now(FunctionElement[float]):
    """Seconds since 1970-01-01 UTC on the database server's clock."""

    type = Double()
    name = "database_now"
    inherit_cache = True


@compiles(database_now)
def _clock(element: database_now, compiler: SQLCompiler, **kw: Any) -> str:
    sql = of(compiler.dialect).clock_sql  # each database's, in fencing._dialects
    if sql is None:
        raise NotImplementedError(
            f"no database clock for the {compiler.dialect.name!r} dialect; pass now= explicitly"
        )
    return sql
