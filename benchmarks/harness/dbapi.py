"""What reaches the driver: driver connections that record or time the calls made on them,
and the statements SQLAlchemy sends on an engine.

A *tap* (:class:`Tap`) sees the calls a driver connection and its cursors are asked to make
and makes them: :class:`Recorder` logs each one. The connection and cursor classes are
subclasses of the driver's own (``sqlite3``, psycopg, pymysql) built for one kind of tap:
they intercept only the calls that kind handles (a tap that times ``execute`` and
``commit`` adds nothing to a fetch), and only while a tap is on (:func:`tapping`); otherwise
each call goes straight to the driver after one check. What they intercept:

* ``sqlite3``: ``Connection.cursor()`` (``cursor``), ``Connection.execute`` (which makes a
  cursor of its own, ``connection_execute``), the cursor's ``execute``, ``executemany`` and
  ``fetch*``;
* psycopg and pymysql: the cursor's ``execute``, ``executemany`` and ``fetch*``, the
  connection's ``commit()`` and ``rollback()``.

Use :func:`sqlite3_factory` (``connect_args={"factory": ...}``), :func:`connect` or
:func:`tap_engine` (a ``do_connect`` listener: every new DBAPI connection of the engine is a
tapped one, opened with the arguments SQLAlchemy would have used) to get them.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sqlalchemy import Engine, event

Call = Callable[..., Any]
#: a tap's methods: what the classes built for it may intercept
HOOKS = ("cursor", "connection_execute", "execute", "executemany", "fetch", "commit", "rollback")


class Tap:
    """Passes each call on; a subclass does something around the calls it overrides."""

    def cursor(self) -> None:
        """A cursor is asked for (``sqlite3``)."""

    def connection_execute(self, call: Call, sql: str, params: Any) -> Any:
        return call(sql, params)

    def execute(self, call: Call, sql: Any, params: Any, **kw: Any) -> Any:
        return call(sql, params, **kw)

    def executemany(self, call: Call, sql: Any, seq: Any, **kw: Any) -> Any:
        return call(sql, seq, **kw)

    def fetch(self, call: Call, name: str, *args: Any) -> Any:
        return call(*args)

    def commit(self, call: Call) -> None:
        call()

    def rollback(self, call: Call) -> None:
        call()


def _params(params: Any) -> Any:
    if params is None:
        return None
    return dict(params) if isinstance(params, dict) else tuple(params)


class Recorder(Tap):
    """Logs every call, then makes it: ``("cursor",)``, ``("conn.execute", sql, params)``,
    ``("execute", sql, params)``, ``("executemany", sql, [params, ...])``,
    ``("fetch", "fetchall")``, ``("commit",)``, ``("rollback",)``; the SQL as a string, the
    parameters copied (a dict or a tuple)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def cursor(self) -> None:
        self.log.append(("cursor",))

    def connection_execute(self, call: Call, sql: str, params: Any) -> Any:
        self.log.append(("conn.execute", str(sql), _params(params)))
        return call(sql, params)

    def execute(self, call: Call, sql: Any, params: Any, **kw: Any) -> Any:
        self.log.append(("execute", str(sql), _params(params)))
        return call(sql, params, **kw)

    def executemany(self, call: Call, sql: Any, seq: Any, **kw: Any) -> Any:
        seq = list(seq)
        self.log.append(("executemany", str(sql), [_params(p) for p in seq]))
        return call(sql, seq, **kw)

    def fetch(self, call: Call, name: str, *args: Any) -> Any:
        self.log.append(("fetch", name))
        return call(*args)

    def commit(self, call: Call) -> None:
        self.log.append(("commit",))
        call()

    def rollback(self, call: Call) -> None:
        self.log.append(("rollback",))
        call()


#: the tap the tapped connections report to; ``None``: none, every call goes straight through
_ON: list[Tap | None] = [None]


@contextlib.contextmanager
def tapping(tap: Tap | None) -> Iterator[Any]:
    """``tap`` on (``None``: none) for the block; then whichever was on before."""
    before = _ON[0]
    _ON[0] = tap
    try:
        yield tap
    finally:
        _ON[0] = before


def _hooks(kind: type[Tap]) -> frozenset[str]:
    """The calls a ``kind`` of tap handles: the methods it overrides."""
    return frozenset(name for name in HOOKS if getattr(kind, name) is not getattr(Tap, name))


def _cursor(base: type, hooks: frozenset[str], no_params: Any) -> type:
    """``base`` (a driver's cursor) with the calls in ``hooks`` reported to the tap that is
    on: ``execute`` and ``executemany`` (``no_params``: what ``execute`` sends without
    parameters, as the driver's own default), ``fetch`` (``fetchone``, ``fetchmany``,
    ``fetchall``)."""

    class Cursor(base):  # type: ignore[misc]
        if "execute" in hooks:

            def execute(self, sql: Any, params: Any = no_params, **kw: Any) -> Any:
                tap = _ON[0]
                if tap is None:
                    return super().execute(sql, params, **kw)
                return tap.execute(super().execute, sql, params, **kw)

        if "executemany" in hooks:

            def executemany(self, sql: Any, seq: Any, **kw: Any) -> Any:
                tap = _ON[0]
                if tap is None:
                    return super().executemany(sql, seq, **kw)
                return tap.executemany(super().executemany, sql, seq, **kw)

        if "fetch" in hooks:

            def fetchone(self) -> Any:
                tap = _ON[0]
                return super().fetchone() if tap is None else tap.fetch(super().fetchone, "fetchone")

            def fetchmany(self, *size: Any) -> Any:
                tap = _ON[0]
                if tap is None:
                    return super().fetchmany(*size)
                return tap.fetch(super().fetchmany, "fetchmany", *size)

            def fetchall(self) -> Any:
                tap = _ON[0]
                return super().fetchall() if tap is None else tap.fetch(super().fetchall, "fetchall")

    return Cursor


def _transactions(base: type, hooks: frozenset[str]) -> type:
    """``base`` (a driver's connection) with those of ``commit()`` and ``rollback()`` that
    are in ``hooks`` reported to the tap that is on."""

    def reported(name: str) -> Callable[[Any], None]:
        driver = getattr(base, name)

        def method(self: Any) -> None:
            tap = _ON[0]
            if tap is None:
                driver(self)
            else:
                getattr(tap, name)(driver.__get__(self))

        return method

    methods: dict[str, Any] = {name: reported(name) for name in ("commit", "rollback") if name in hooks}
    return type(base.__name__, (base,), methods)


@functools.cache
def sqlite3_factory(kind: type[Tap]) -> type[sqlite3.Connection]:
    """A ``sqlite3.Connection`` subclass (``sqlite3.connect(..., factory=...)``) whose
    cursors are tapped for ``kind`` of tap."""
    hooks = _hooks(kind)
    cursor_class = _cursor(sqlite3.Cursor, hooks, ())

    class Connection(sqlite3.Connection):
        def cursor(self, factory: Any = cursor_class) -> Any:
            if "cursor" in hooks and (tap := _ON[0]) is not None:
                tap.cursor()
            return super().cursor(factory)

        if "connection_execute" in hooks:

            def execute(self, sql: str, parameters: Any = (), /) -> Any:
                tap = _ON[0]
                if tap is None:
                    return super().execute(sql, parameters)
                return tap.connection_execute(super().execute, sql, parameters)

    return Connection


@functools.cache
def server_classes(db: str, kind: type[Tap]) -> tuple[Any, type]:
    """Subclasses of the driver's connection and cursor (psycopg for ``postgresql``, else
    pymysql) tapped for ``kind`` of tap."""
    hooks = _hooks(kind)
    if db == "postgresql":
        import psycopg

        cursor_base: type = psycopg.Cursor
        connection_base: type = psycopg.Connection
    else:
        import pymysql
        import pymysql.cursors

        cursor_base, connection_base = pymysql.cursors.Cursor, pymysql.connections.Connection
    if hooks & {"commit", "rollback"}:
        connection_base = _transactions(connection_base, hooks)
    return connection_base, _cursor(cursor_base, hooks, None)


def connect(db: str, cargs: Any, cparams: Mapping[str, Any], kind: type[Tap] | None = None) -> Any:
    """``psycopg.connect`` / ``pymysql.connect``; with ``kind``, the same on the classes
    tapped for it (:func:`server_classes`)."""
    if db == "postgresql":
        import psycopg

        if kind is None:
            return psycopg.connect(*cargs, **cparams)
        connection_class, cursor_class = server_classes(db, kind)
        return connection_class.connect(*cargs, cursor_factory=cursor_class, **cparams)
    import pymysql

    if kind is None:
        return pymysql.connect(*cargs, **cparams)
    connection_class, cursor_class = server_classes(db, kind)
    return connection_class(*cargs, cursorclass=cursor_class, **cparams)


def tap_engine(engine: Engine, kind: type[Tap]) -> Engine:
    """``engine`` (PostgreSQL or MariaDB) with every new DBAPI connection tapped for ``kind``:
    a ``do_connect`` listener opens it with the arguments SQLAlchemy would have used."""
    db = engine.dialect.name

    def do_connect(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        return connect(db, cargs, cparams, kind)

    event.listen(engine, "do_connect", do_connect)
    return engine


@contextlib.contextmanager
def statements(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    """The statements and parameters SQLAlchemy sends on ``engine`` during the block (a
    ``before_cursor_execute`` listener, which also takes the store off its driver path)."""
    sent: list[tuple[str, Any]] = []

    def listener(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", listener)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", listener)
