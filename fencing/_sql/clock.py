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

__all__ = ["RESOLUTION", "database_now"]


class database_now(FunctionElement[float]):
    """Seconds since 1970-01-01 UTC on the database server's clock."""

    type = Double()
    name = "database_now"
    inherit_cache = True


@compiles(database_now)
def _default(element: database_now, compiler: SQLCompiler, **kw: Any) -> str:
    raise NotImplementedError(
        f"no database clock for the {compiler.dialect.name!r} dialect; pass now= explicitly"
    )


@compiles(database_now, "sqlite")
def _sqlite(element: database_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(database_now, "postgresql")
def _postgresql(element: database_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"


@compiles(database_now, "mysql")
@compiles(database_now, "mariadb")
def _mysql(element: database_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) * 1e-6)"


#: how finely each database's clock (:class:`database_now`) counts, in seconds: SQLite's
#: ``julianday('now')`` counts milliseconds, PostgreSQL's and MariaDB's microseconds. A
#: reading is up to this much earlier than the instant it was taken.
RESOLUTION = {"sqlite": 1e-3, "postgresql": 1e-6, "mysql": 1e-6, "mariadb": 1e-6}
