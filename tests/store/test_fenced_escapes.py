"""Inside ``fenced()``, nothing the application does lets a later write escape the fence.

A fenced block's transaction is the store's. If the application ends it inside the block
(``conn.commit()``, ``conn.rollback()``, or raw ``COMMIT``/``ROLLBACK``), what it wrote until
then was written while the lease was locked and current; everything after runs in a new
transaction that the block's end checks again: a write made after the lease was lost is
never kept, and the block ends in :class:`LeaseLost`. On PostgreSQL through psycopg the
block runs pipelined with the driver in autocommit, where a statement sent outside a
transaction would commit on its own: it once did. Same on every backend and both fronts.

The engine's isolation level holds in a fenced block and in every operation (a
``create_engine(isolation_level=...)`` engine on PostgreSQL once ran its pipelined blocks at
the server's default).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Column, Connection, Engine, MetaData, String, Table, select, text

from fencing import JobStore, LeaseLost
from tests import backends

writes_metadata = MetaData()
writes = Table("fx_writes", writes_metadata, Column("k", String(40), primary_key=True))

#: how the block ends its own transaction part-way, and whether what it wrote before is kept
ENDINGS: dict[str, tuple[Callable[[Connection], object], bool]] = {
    "commit": (lambda conn: conn.commit(), True),
    "rollback": (lambda conn: conn.rollback(), False),
    "raw COMMIT": (lambda conn: conn.exec_driver_sql("COMMIT"), True),
    "raw ROLLBACK": (lambda conn: conn.exec_driver_sql("ROLLBACK"), False),
}


@pytest.fixture
def tables(engine: Engine) -> Iterator[None]:
    writes_metadata.create_all(engine)
    yield
    writes_metadata.drop_all(engine)


def kept(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(select(writes.c.k)).scalars())


def revoke_elsewhere(target: str, job_id: str) -> None:
    """Another process's operator revokes the lease (its own engine, on a thread of its own)."""
    other = JobStore(backends.engine_for(target))
    answer: list[Any] = []
    th = threading.Thread(target=lambda: answer.append(other.revoke(job_id)))
    th.start()
    th.join(60)
    other.engine.dispose()
    assert answer == [True]


def a_write_after_a_revoke(store: JobStore, target: str, end: Callable[[Connection], object]) -> LeaseLost:
    """A fenced block on a fresh job "j" writes, ends its own transaction with ``end``, sees
    its lease revoked by another process, and writes again: the LeaseLost it must end in."""
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", ttl=600.0)
    assert lease is not None

    def block() -> None:
        with store.fenced(lease) as conn:
            conn.execute(writes.insert().values(k="before"))
            end(conn)
            revoke_elsewhere(target, "j")  # possible now: the block's row lock went with its transaction
            conn.execute(writes.insert().values(k="after-revoke"))

    with pytest.raises(LeaseLost) as lost:
        block()
    return lost.value


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_write_after_the_block_ended_its_own_transaction_is_still_fenced(
    store: JobStore, engine: Engine, target: str, tables: None, ending: str
) -> None:
    end, keeps_before = ENDINGS[ending]
    lost = a_write_after_a_revoke(store, target, end)
    assert lost.reason == "stale fence"  # the revoke moved the fence on
    assert kept(engine) == (["before"] if keeps_before else [])  # never "after-revoke"
    state = store.state("j")
    assert state is not None and state.fence == 2 and not state.done


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_block_that_ended_its_own_transaction_still_commits_while_its_lease_holds(
    store: JobStore, engine: Engine, tables: None, ending: str
) -> None:
    end, keeps_before = ENDINGS[ending]
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", ttl=600.0)
    assert lease is not None
    with store.fenced(lease, complete=True, result="r") as conn:
        conn.execute(writes.insert().values(k="before"))
        end(conn)
        conn.execute(writes.insert().values(k="after"))
    assert kept(engine) == (["after", "before"] if keeps_before else ["after"])
    state = store.state("j")
    assert state is not None and state.done and state.result == "r"


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_block_that_ended_its_transaction_and_wrote_nothing_after_is_checked_at_its_end(
    store: JobStore, target: str, ending: str
) -> None:
    end, _ = ENDINGS[ending]
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", "w", ttl=600.0)
    assert lease is not None

    def block() -> None:
        with store.fenced(lease, complete=True, result="late") as conn:
            end(conn)
            revoke_elsewhere(target, "j")

    with pytest.raises(LeaseLost):
        block()
    state = store.state("j")
    assert state is not None and not state.done and state.result is None


@pytest.mark.backend("postgresql")
@pytest.mark.parametrize("level", ["SERIALIZABLE", "REPEATABLE READ"])
def test_the_engines_isolation_level_holds_in_fenced_blocks_and_operations(target: str, level: str) -> None:
    """``create_engine(isolation_level=...)`` sets the level on each driver connection: the
    store's transactions begin with it (pipelined or not), and a one-statement operation is
    no longer sent in autocommit, where it would run at the server's default."""
    engine = sqlalchemy.create_engine(target, isolation_level=level)
    try:
        store = JobStore(engine)
        store.create_table()
        store.enqueue("j", ready_at=0.0)
        lease = store.claim("j", "w", ttl=600.0)
        assert lease is not None
        with store.fenced(lease) as conn:
            seen = conn.execute(text("SHOW transaction_isolation")).scalar_one()
        assert seen == level.lower()
        # every operation's statements, seen by a listener (the store then runs through Core):
        # in a transaction of the engine's level, not in autocommit
        levels: set[str] = set()

        def seen_level(conn: Connection, *_: Any) -> None:
            levels.add(conn.get_isolation_level())

        sqlalchemy.event.listen(engine, "before_cursor_execute", seen_level)
        store.enqueue("k", ready_at=0.0)
        [taken] = store.claim_next("w", ttl=600.0)
        assert store.renew(taken, ttl=600.0)
        assert store.complete(taken, "r")
        assert store.revoke("j")
        assert levels == {level}
    finally:
        engine.dispose()


@pytest.mark.parametrize("ending", ["raw COMMIT", "commit"])
def test_a_store_on_an_engine_with_execution_options_fences_the_block_the_same(
    engine: Engine, target: str, tables: None, ending: str
) -> None:
    """An engine made by ``engine.execution_options(...)`` (whose connections SQLAlchemy 2.0
    takes no listener on) keeps a block's later writes fenced all the same."""
    end, keeps_before = ENDINGS[ending]
    store = JobStore(engine.execution_options(logging_token="app"))
    store.create_table()
    a_write_after_a_revoke(store, target, end)
    assert kept(engine) == (["before"] if keeps_before else [])
