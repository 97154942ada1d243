"""The ``jobs`` table, built for a caller's ``MetaData``, and its safe creation.

On SQLite the declared types are exactly the contract's (``PRAGMA table_info`` shows
TEXT, TEXT, REAL, INTEGER, TEXT, INTEGER). Elsewhere the variants keep the meaning:
``until`` is double precision (PostgreSQL's REAL is single precision), ``fence`` is
64-bit, and on MariaDB/MySQL ids and owners are bytes (a bounded ``VARBINARY`` key).

Every column type is a stock SQLAlchemy type, so Alembic renders and compares the table
like any other. The UTF-8 codec for the byte columns lives in the statements instead:
their bind parameters are typed :data:`KEY_TYPE` and their reads are coerced to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    VARBINARY,
    BigInteger,
    Column,
    ColumnElement,
    Connection,
    Dialect,
    Double,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    TypeDecorator,
    inspect,
    text,
    type_coerce,
    types,
)
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.schema import CreateIndex, CreateTable, DropIndex

from .._dialects import of
from .._dialects.mysql import MySQL
from .._errors import DatabaseCorrupt, InvalidArgumentType, SchemaMismatch
from .checks import check_new_table
from .dberrors import is_corrupt

__all__ = [
    "KEY_COLUMN",
    "KEY_TYPE",
    "LONG_TEXT",
    "SECONDS",
    "Utf8Key",
    "as_text",
    "ensure_jobs_table",
    "jobs",
    "jobs_table",
    "metadata",
]


# -- what the columns are: stock SQLAlchemy types only, so Alembic renders and compares them ----
# On MariaDB/MySQL ids, owners, resources and keys are bytes: their text collations fold case
# and ignore trailing spaces ('a' = 'A' = 'a '), which would merge distinct ids and let a
# different owner string match; bytes compare exactly.

#: the column type of every key: job ids, fence-mark resources, idempotency keys
KEY_COLUMN: types.TypeEngine[Any] = Text().with_variant(VARBINARY(MySQL.id_max_bytes), "mysql", "mariadb")
_OWNER = Text().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
#: text of any length (results, payloads): on MariaDB/MySQL a 4 GiB, byte-exact column
LONG_TEXT = Text().with_variant(
    mysql.LONGTEXT(charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
)
#: an instant in seconds since 1970 (a lease's end, a failure's time): a double everywhere,
#: REAL as the contract declares it on SQLite
SECONDS: types.TypeEngine[float] = Double().with_variant(sqlite.REAL(), "sqlite")
_FENCE = BigInteger().with_variant(sqlite.INTEGER(), "sqlite")


# -- how statements see them: str on every backend --------------------------------------------


class Utf8Key(TypeDecorator[str]):
    """A ``str`` sent and read as UTF-8 bytes: the codec of the byte columns on MariaDB/MySQL.

    The library types its bind parameters with it and ``type_coerce``-s its reads to it; it
    is never a column type of the library's tables (Alembic could not import it).
    """

    impl = VARBINARY
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> bytes | None:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else bytes(value).decode("utf-8")


#: ``str`` in and out on every backend: the type of every bind parameter and read of an id,
#: owner, resource or key (``bindparam(..., type_=KEY_TYPE)``, ``type_coerce(col, KEY_TYPE)``)
KEY_TYPE: types.TypeEngine[str] = Text().with_variant(Utf8Key(MySQL.id_max_bytes), "mysql", "mariadb")


def as_text(value: ColumnElement[Any] | str | None) -> ColumnElement[str]:
    """An id, owner, resource or key column, or a value for one, as ``str`` on every backend.

    On MariaDB/MySQL these columns are bytes: a plain ``jobs.c.id`` reads as ``bytes`` and
    refuses a ``str``. ``select(as_text(jobs.c.id))`` reads text, ``as_text(jobs.c.owner) ==
    "w"`` compares with text, ``.values(owner=as_text("w"))`` writes text.
    """
    if value is not None and not isinstance(value, (str, ColumnElement)):
        raise InvalidArgumentType(f"as_text takes a column, a str or None, got {type(value).__name__}")
    return type_coerce(value, KEY_TYPE)


def jobs_table(metadata: MetaData, name: str = "jobs", *, schema: str | None = None) -> Table:
    """The jobs table in ``metadata`` (under another ``name`` or ``schema`` if you must).

    This is the table to put in your application's ``MetaData`` for Alembic: ``id`` is
    declared NOT NULL, as every database reflects a primary key column, so a second
    autogenerate finds nothing to change.
    """
    return _jobs_table(metadata, name, schema, id_nullable=False)


def _jobs_table(metadata: MetaData, name: str, schema: str | None, *, id_nullable: bool) -> Table:
    check_new_table(metadata, name, schema)
    return Table(
        name,
        metadata,
        Column("id", KEY_COLUMN, primary_key=True, nullable=id_nullable),
        Column("owner", _OWNER, nullable=True),
        Column("until", SECONDS, nullable=False, server_default=text("0")),
        Column("fence", _FENCE, nullable=False, server_default=text("0")),
        Column("result", LONG_TEXT, nullable=True),
        Column("done", Integer, nullable=False, server_default=text("0")),
        # claim_next's search: ready jobs in the order they became ready, ties by id, which
        # is the claim order itself (ORDER BY until, id), so the pick walks the index from
        # its start and stops at LIMIT: no sort of the ready set at any backlog. An index,
        # not a column: the contract's columns stay as they are
        Index(f"ix_{name}_ready", "done", "until", "id"),
        schema=schema,
        mysql_charset="utf8mb4",
        mariadb_charset="utf8mb4",
    )


metadata = MetaData()
#: the default table: the contract's DDL to the letter, so on SQLite ``id TEXT PRIMARY KEY``
#: without NOT NULL (``PRAGMA table_info`` notnull = 0). The library never writes a NULL id,
#: and the servers make a primary key NOT NULL anyway; Alembic would see that difference, so
#: migrations use :func:`jobs_table` instead
jobs = _jobs_table(metadata, "jobs", None, id_nullable=True)


@dataclass(frozen=True)
class _Expected:
    name: str
    sqlite_type: str
    #: acceptable reflected types elsewhere: a double, a 64-bit integer, text or bytes
    generic: tuple[type[types.TypeEngine[Any]], ...]
    notnull: bool
    #: inserts name only the id: the other NOT NULL columns must default to 0
    zero_default: bool


#: bytes, as the servers reflect them: SQLAlchemy's public binary types and MySQL's BLOB sizes
#: (together every subclass of its private binary base on SQLite, PostgreSQL and MySQL)
_BYTES = (types.LargeBinary, types.BINARY, types.VARBINARY, mysql.TINYBLOB, mysql.MEDIUMBLOB, mysql.LONGBLOB)

_EXPECTED = (
    _Expected("id", "TEXT", (types.String, *_BYTES), False, False),
    _Expected("owner", "TEXT", (types.String, *_BYTES), False, False),
    _Expected("until", "REAL", (types.Double,), True, True),
    _Expected("fence", "INTEGER", (types.BigInteger,), True, True),
    _Expected("result", "TEXT", (types.String,), False, False),
    _Expected("done", "INTEGER", (types.Integer,), True, True),
)


def ensure_jobs_table(conn: Connection, table: Table = jobs) -> None:
    """Create ``table`` if it is missing, then check that what exists matches.

    Never drops, alters or empties a table: an existing table with other columns raises
    :class:`SchemaMismatch` naming every difference and is left as it was. Its index for
    ``claim_next`` is created if missing, and replaced if an older version made it with
    other columns (earlier versions made ``(done, until)``). On SQLite
    a table whose pages are damaged raises :class:`DatabaseCorrupt` (:func:`_check_pages`).
    """
    conn.execute(CreateTable(table, if_not_exists=True))
    if of(conn.dialect).is_file:
        _check_pages(conn, table)
    problems = _differences(conn, table)
    if problems:
        where = f"{table.schema}.{table.name}" if table.schema else table.name
        raise SchemaMismatch(
            f"existing table {where!r} does not match the jobs schema (left unchanged): "
            + "; ".join(problems)
        )
    # a table made by the contract's plain DDL gets the index too; one made by an older
    # version, whose index of that name had other columns, gets it replaced (an index holds
    # no data: dropping it loses nothing, and claim_next needs the claim order in it)
    present = {
        ix["name"]: list(ix["column_names"])
        for ix in inspect(conn).get_indexes(table.name, schema=table.schema)
    }
    for index in table.indexes:
        if index.name not in present:
            conn.execute(CreateIndex(index))
        elif present[index.name] != [c.name for c in index.columns]:
            conn.execute(DropIndex(index))
            conn.execute(CreateIndex(index))


def _check_pages(conn: Connection, table: Table) -> None:
    """``PRAGMA quick_check`` of the table and its indexes, once per ``create_table``: the
    pages the store reads and writes, not the application's other tables, in time that grows
    with the jobs table (measured ~0.05 s per 100,000 jobs). SQLite before 3.33 checks the whole file."""
    quote = conn.dialect.identifier_preparer.quote_identifier
    prefix = f"{quote(table.schema)}." if table.schema else ""
    cause: DBAPIError | None = None
    try:
        rows = conn.exec_driver_sql(f"PRAGMA {prefix}quick_check({quote(table.name)})").fetchall()
        # one finding per line; a "*** in database main ***" line heads them
        found = [line for row in rows for line in str(row[0]).splitlines() if not line.startswith("***")]
    except DBAPIError as exc:
        if not is_corrupt(exc):
            raise
        found, cause = [str(exc.orig)], exc  # so damaged that the check itself stopped
    if found == ["ok"]:
        return
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    raise DatabaseCorrupt(
        f"the SQLite database {conn.engine.url.database!r} is corrupt: PRAGMA quick_check of "
        f"table {table.name!r} and its indexes found: {'; '.join(found[:3])}{more}. Nothing was "
        "changed; restore the file from a backup (sqlite.org/recovery.html can salvage rows)"
    ) from cause


def _differences(conn: Connection, table: Table) -> list[str]:
    found = {c["name"]: c for c in inspect(conn).get_columns(table.name, schema=table.schema)}
    on_sqlite = of(conn.dialect).types_are_declared_names
    problems = []
    for want in _EXPECTED:
        col = found.pop(want.name, None)
        if col is None:
            problems.append(f"column {want.name!r} is missing")
            continue
        got = col["type"]
        if on_sqlite:
            declared = str(got.compile(dialect=conn.dialect)).upper()
            if declared != want.sqlite_type:
                problems.append(f"column {want.name!r} is {declared}, expected {want.sqlite_type}")
        elif not isinstance(got, want.generic):
            expected = " or ".join(sorted({g.__name__ for g in want.generic}))
            problems.append(f"column {want.name!r} has type {got!r}, expected {expected}")
        if want.notnull and col["nullable"]:
            problems.append(f"column {want.name!r} allows NULL, expected NOT NULL")
        if want.zero_default and not _is_zero(col.get("default")):
            problems.append(f"column {want.name!r} has default {col.get('default')!r}, expected 0")
    problems.extend(f"unexpected column {name!r}" for name in found)
    pk = inspect(conn).get_pk_constraint(table.name, schema=table.schema)
    if list(pk.get("constrained_columns") or []) != ["id"]:
        # without the key, enqueue could store the same id twice
        problems.append(f"primary key is {pk.get('constrained_columns')!r}, expected ['id']")
    return problems


def _is_zero(default: object) -> bool:
    """A reflected server default that means 0: '0', '0.0', "'0'", '(0)', '0::bigint'..."""
    if not isinstance(default, str):
        return False
    text = default.split("::")[0].strip().strip("()").strip().strip("'\"")
    try:
        return float(text) == 0.0
    except ValueError:
        return False
