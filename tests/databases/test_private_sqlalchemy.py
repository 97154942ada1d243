"""The private SQLAlchemy names the library reads, pinned: they live in one module
(``fencing/_runtime/private_sqlalchemy.py``), and each still does there what that module says
it buys. Marked ``dialect``: the lowest SQLAlchemy of the matrix runs these on every server
too, and the newest everywhere.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Engine, event
from sqlalchemy.exc import TimeoutError as PoolTimeout

import fencing
from fencing._runtime import private_sqlalchemy as private
from fencing._runtime.private_sqlalchemy import Checkout, give_back, retire_older

pytestmark = pytest.mark.dialect

LIBRARY = pathlib.Path(fencing.__file__).parent
HOME = LIBRARY / "_runtime" / "private_sqlalchemy.py"


def _engine(target: str, **options: Any) -> Engine:
    if "://" in target:
        return sqlalchemy.create_engine(target, **options)
    return fencing.create_sqlite_engine(target, **options)


@pytest.fixture
def made(target: str) -> Iterator[Any]:
    engines: list[Engine] = []

    def make(**options: Any) -> Engine:
        engines.append(_engine(target, **options))
        return engines[-1]

    yield make
    for engine in engines:
        engine.dispose()


def _sqlalchemy_privates_in(path: pathlib.Path) -> set[str]:
    """Private names ``path`` imports from sqlalchemy, or reads as an attribute of something
    that is not its own (``self``, ``cls``) nor one of the library's own modules."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    #: the names this module binds to SQLAlchemy's modules and objects (``from sqlalchemy
    #: import types``, ``import sqlalchemy as sa``): a ``_name`` read off one is private
    from_sqlalchemy = {
        a.asname or a.name.partition(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for a in node.names
        if ((node.module or "") if isinstance(node, ast.ImportFrom) else a.name).startswith("sqlalchemy")
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _root(node) in from_sqlalchemy
        ):
            found.add(node.attr)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            found |= {a.name for a in node.names if a.name.startswith("_")}
            if any(part.startswith("_") for part in (node.module or "").split(".")):
                found.add(node.module or "")
            if node.module in UNDOCUMENTED_MODULES:
                found.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in PRIVATE_NAMES:
                found.add(node.value)
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            found.add(node.attr)
    return found


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (``sa`` of ``sa.types._Binary``)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


#: SQLAlchemy modules without a documented API: importing from one is reading private names
UNDOCUMENTED_MODULES = {"sqlalchemy.engine.processors", "sqlalchemy.util", "sqlalchemy.util.concurrency"}

#: what the one module reads (by attribute, import or getattr string)
PRIVATE_NAMES = {
    "_ConnectionFairy",
    "_ConnectionRecord",
    "_do_get",
    "_checkin_failed",
    "_fairy_was_created",
    "_close_special",
    "_pre_ping",
    "_should_log_debug",
    "_should_log_info",
    "_invalidate",
    "_on_connect_isolation_level",
    "_is_autocommit_isolation",
    "_execution_options",
    "_has_events",
    "_key_to_collection",
    "_connection_record",
    "_proxied",
    "sqlalchemy.engine.processors",
    "sqlalchemy.util.concurrency",
}


def test_no_module_but_one_reads_a_private_sqlalchemy_name() -> None:
    readers = {
        path.relative_to(LIBRARY).as_posix(): names
        for path in LIBRARY.rglob("*.py")
        if (names := _sqlalchemy_privates_in(path))
    }
    assert set(readers) == {"_runtime/private_sqlalchemy.py"}, readers
    assert readers["_runtime/private_sqlalchemy.py"] <= PRIVATE_NAMES


def test_sqlite_binds_a_double_with_the_float_processor_the_driver_path_skips() -> None:
    from sqlalchemy import Double
    from sqlalchemy.dialects import sqlite

    dialect = sqlite.dialect()
    assert Double().dialect_impl(dialect).bind_processor(dialect) is private.FLOAT_BINDING


def test_this_sqlalchemy_has_every_name_the_lean_checkout_reads() -> None:
    assert private.RECORDS, f"SQLAlchemy {sqlalchemy.__version__}: the pool's record methods changed"


def test_the_lean_checkout_keeps_the_pools_accounting_and_timeout(made: Any) -> None:
    engine = made(pool_size=1, max_overflow=0, pool_timeout=0.2)
    checkout = Checkout(engine)
    held, lean, pool = checkout()
    assert lean and pool is engine.pool
    assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    with pytest.raises(PoolTimeout):
        checkout()  # the pool's own wait, then its own error
    first = held.dbapi_connection
    give_back(held, lean, pool, engine, ended=False)
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    again, lean, pool = checkout()
    assert lean and again.dbapi_connection is first  # pooled, not reconnected
    give_back(again, lean, pool, engine, ended=True)


def test_a_pool_listener_or_pre_ping_takes_the_proxy(made: Any) -> None:
    for engine in (made(pool_pre_ping=True), made()):
        if not engine.pool._pre_ping:  # type: ignore[attr-defined]
            event.listen(engine, "checkout", lambda *args: None)
        held, lean, pool = Checkout(engine)()
        assert not lean
        give_back(held, lean, pool, engine, ended=False)


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "open"])
def test_the_proxy_is_not_rolled_back_again_after_the_stores_commit(
    made: Any, monkeypatch: pytest.MonkeyPatch, ended: bool
) -> None:
    engine = made()
    engine.connect().close()  # the first connect's own rollback (dialect.initialize) is done
    event.listen(engine, "checkout", lambda *args: None)  # the proxy path
    rollbacks: list[object] = []
    original = engine.dialect.do_rollback
    monkeypatch.setattr(engine.dialect, "do_rollback", lambda conn: (rollbacks.append(conn), original(conn)))
    held, lean, pool = Checkout(engine)()
    assert not lean
    cursor = held.dbapi_connection.cursor()
    cursor.execute("SELECT 1")
    cursor.fetchall()
    cursor.close()
    held.dbapi_connection.commit()
    give_back(held, lean, pool, engine, ended=ended)
    # _close_special(transaction_reset=True): no reset ROLLBACK (a round trip on MariaDB)
    assert len(rollbacks) == (0 if ended else 1)


def test_retiring_marks_the_pools_older_connections_for_replacement(made: Any) -> None:
    engine = made()
    checkout = Checkout(engine)
    held, lean, pool = checkout()
    old = held.dbapi_connection
    retire_older(pool, held, None)
    give_back(held, lean, pool, engine, ended=False)
    fresh, lean, pool = checkout()
    assert fresh.dbapi_connection is not old  # made before the mark: replaced at checkout
    give_back(fresh, lean, pool, engine, ended=False)


def test_an_option_engine_leads_to_the_engine_that_owns_its_pool(made: Any) -> None:
    engine = made()
    derived = engine.execution_options(isolation_level="SERIALIZABLE")
    assert private.parent_engine(derived) is engine
    assert private.parent_engine(engine) is None
    held, lean, pool = Checkout(engine)()
    assert private.record_of(held) is None  # a record is its own record
    give_back(held, lean, pool, engine, ended=False)
    event.listen(engine, "checkout", lambda *args: None)  # the proxy path
    proxy, lean, pool = Checkout(engine)()
    record = private.record_of(proxy)
    assert not lean and record is not None and record.dbapi_connection is proxy.dbapi_connection
    give_back(proxy, lean, pool, engine, ended=False)


def test_what_sqlalchemy_says_of_autocommit(made: Any, target: str) -> None:
    plain, autocommit = made(), made(isolation_level="AUTOCOMMIT")
    assert private.engine_isolation_level(plain) is None
    assert private.engine_isolation_level(autocommit) == "AUTOCOMMIT"
    with plain.connect() as conn:
        assert not private.believes_autocommit(conn)
        conn.commit()
        assert private.believes_autocommit(conn.execution_options(isolation_level="AUTOCOMMIT"))
