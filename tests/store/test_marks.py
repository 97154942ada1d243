"""Fence marks and idempotency keys: other systems check the fence too, and effects happen once."""

from __future__ import annotations

import multiprocessing
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Column, Engine, Integer, MetaData, Table, func, inspect, select

from fencing import ConfigurationError, InvalidArgument, InvalidArgumentType, TableMissing
from fencing._sql.checks import FENCE_MAX
from fencing._sql.schema import as_text
from fencing._store.marks import (
    FenceMarks,
    fence_marks,
    fence_marks_table,
    idempotency_keys,
    idempotency_keys_table,
)
from tests import backends
from tests.processes import reap

pytestmark = pytest.mark.dialect

THREADS = 8
PROCESSES = 3
THREADS_PER_PROCESS = 3


@pytest.fixture
def marks(engine: Engine) -> FenceMarks:
    m = FenceMarks(engine)
    m.create_tables()
    return m


def rows(engine: Engine, table: Table) -> list[tuple[Any, ...]]:
    """Every row; the resource or key (bytes on MariaDB/MySQL) read as text."""
    key, *rest = table.c
    with engine.connect() as conn:
        return sorted(tuple(r) for r in conn.execute(select(as_text(key), *rest)).all())


# -- the tables ---------------------------------------------------------------------------


def test_create_tables_makes_both_tables_and_is_idempotent(engine: Engine) -> None:
    m = FenceMarks(engine)
    m.create_tables()
    assert m.accept("r", 3)
    assert m.record_once("k")
    m.create_tables()  # a second time changes nothing
    names = set(inspect(engine).get_table_names())
    assert {"fence_marks", "idempotency_keys"} <= names
    assert m.highest("r") == 3
    assert m.record_once("k") is False
    marks_cols = {c["name"]: c for c in inspect(engine).get_columns("fence_marks")}
    keys_cols = {c["name"]: c for c in inspect(engine).get_columns("idempotency_keys")}
    assert list(marks_cols) == ["resource", "fence"]
    assert list(keys_cols) == ["key", "fence", "recorded_at"]
    assert marks_cols["fence"]["nullable"] is False
    assert keys_cols["fence"]["nullable"] is True
    assert inspect(engine).get_pk_constraint("fence_marks")["constrained_columns"] == ["resource"]
    assert inspect(engine).get_pk_constraint("idempotency_keys")["constrained_columns"] == ["key"]


def test_tables_can_be_named_and_placed_in_the_callers_metadata(engine: Engine) -> None:
    metadata = MetaData()
    marks_t = fence_marks_table(metadata, "app_marks")
    keys_t = idempotency_keys_table(metadata, "app_keys")
    assert set(metadata.tables) == {"app_marks", "app_keys"}
    m = FenceMarks(engine, marks_t, keys_t)
    m.create_tables()
    assert m.accept("r", 1) and m.record_once("k")
    assert {"app_marks", "app_keys"} <= set(inspect(engine).get_table_names())
    assert "fence_marks" not in inspect(engine).get_table_names()


def test_using_a_missing_table_raises_table_missing_naming_it(engine: Engine) -> None:
    m = FenceMarks(engine)
    with pytest.raises(TableMissing, match="fence_marks"):
        m.accept("r", 1)
    with pytest.raises(TableMissing, match="fence_marks"):
        m.highest("r")
    with pytest.raises(TableMissing, match="idempotency_keys"):
        m.record_once("k")


def test_unconfigured_sqlite_engine_is_refused(tmp_path: Any) -> None:
    plain = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'plain.db'}")
    try:
        with pytest.raises(ConfigurationError, match="BEGIN IMMEDIATE"):
            FenceMarks(plain)
    finally:
        plain.dispose()


@pytest.mark.parametrize(
    ("args", "name"),
    [(("not an engine",), "engine"), ((None,), "engine")],
)
def test_constructor_refuses_what_is_not_an_engine(args: tuple[Any, ...], name: str) -> None:
    with pytest.raises(InvalidArgumentType, match=name):
        FenceMarks(*args)


def test_constructor_refuses_what_is_not_a_table(engine: Engine) -> None:
    with pytest.raises(InvalidArgumentType, match="marks"):
        FenceMarks(engine, "fence_marks")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentType, match="keys"):
        FenceMarks(engine, fence_marks, "idempotency_keys")  # type: ignore[arg-type]


# -- accept and highest -------------------------------------------------------------------


def test_first_token_for_a_resource_is_accepted(marks: FenceMarks) -> None:
    assert marks.highest("invoice-42") is None
    assert marks.accept("invoice-42", 3) is True
    assert marks.highest("invoice-42") == 3


def test_lower_token_is_rejected_and_changes_nothing(marks: FenceMarks) -> None:
    assert marks.accept("r", 5)
    before = rows(marks.engine, fence_marks)
    assert marks.accept("r", 4) is False
    assert marks.accept("r", 0) is False
    assert rows(marks.engine, fence_marks) == before == [("r", 5)]


def test_equal_token_is_accepted_so_a_lease_may_write_twice(marks: FenceMarks) -> None:
    assert marks.accept("r", 5)
    assert marks.accept("r", 5) is True
    assert marks.accept("r", 5) is True
    assert marks.highest("r") == 5


def test_higher_token_is_accepted_and_becomes_the_mark(marks: FenceMarks) -> None:
    assert marks.accept("r", 1)
    assert marks.accept("r", 2) is True
    assert marks.accept("r", 1000) is True
    assert marks.accept("r", 999) is False
    assert marks.highest("r") == 1000


def test_fence_range_ends_are_accepted(marks: FenceMarks) -> None:
    assert marks.accept("low", 0) is True
    assert marks.highest("low") == 0
    assert marks.accept("high", FENCE_MAX) is True
    assert marks.highest("high") == FENCE_MAX
    assert marks.accept("high", FENCE_MAX - 1) is False
    assert marks.accept("high", FENCE_MAX) is True


def test_resources_are_independent_and_compared_exactly(marks: FenceMarks) -> None:
    # MariaDB/MySQL collations would fold case and trailing spaces: the keys are bytes there
    names = ["a", "A", "a ", "ä", "a\u0308", "🦊", ""]
    for fence, name in enumerate(names, start=10):
        assert marks.accept(name, fence) is True
    for fence, name in enumerate(names, start=10):
        assert marks.highest(name) == fence
    assert marks.accept("a", 10) is True  # only "a"'s own mark counts
    assert marks.accept("A", 10) is False
    assert len(rows(marks.engine, fence_marks)) == len(names)


def test_accept_in_the_callers_transaction_rolls_back_with_it(marks: FenceMarks) -> None:
    assert marks.accept("r", 5)
    with marks.engine.connect() as conn, conn.begin() as tx:
        assert marks.accept("r", 9, conn=conn) is True
        assert marks.highest("r", conn=conn) == 9
        tx.rollback()
    assert marks.highest("r") == 5
    with marks.engine.begin() as conn:
        assert marks.accept("r", 4, conn=conn) is False
        assert marks.accept("r", 7, conn=conn) is True
    assert marks.highest("r") == 7


def test_accept_of_a_new_resource_in_a_rolled_back_transaction_leaves_no_mark(marks: FenceMarks) -> None:
    with marks.engine.connect() as conn, conn.begin() as tx:
        assert marks.accept("new", 9, conn=conn) is True
        tx.rollback()
    assert marks.highest("new") is None
    assert marks.accept("new", 1) is True


def test_accept_is_one_upsert_or_a_locked_read_then_write(marks: FenceMarks) -> None:
    seen: list[str] = []

    def trace(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(" ".join(statement.split()).upper())

    sqlalchemy.event.listen(marks.engine, "before_cursor_execute", trace)
    try:
        assert marks.accept("r", 1)
        assert marks.accept("r", 2)
    finally:
        sqlalchemy.event.remove(marks.engine, "before_cursor_execute", trace)
    work = [s for s in seen if not s.startswith(("BEGIN", "PRAGMA"))]
    if marks.engine.dialect.name in ("sqlite", "postgresql"):
        assert len(work) == 2
        assert all(s.startswith("INSERT") and "ON CONFLICT" in s and "WHERE" in s for s in work)
    else:
        # new resource: created with the token, then read under its lock; then raised
        assert [w.split()[0] for w in work] == ["INSERT", "SELECT", "INSERT", "SELECT", "UPDATE"]
        assert all("ON DUPLICATE KEY UPDATE" in w for w in work if w.startswith("INSERT"))
        assert all(w.endswith("FOR UPDATE") for w in work if w.startswith("SELECT"))
        assert "WHERE" in work[4]


def test_first_accepts_in_concurrent_caller_transactions_do_not_deadlock(marks: FenceMarks) -> None:
    # the caller's transaction cannot be retried for it: a lock race must not end it
    resources = [f"new{n}" for n in range(15)]
    together = threading.Barrier(THREADS)

    def accept_each(i: int) -> list[bool]:
        results = []
        for resource in resources:
            together.wait(timeout=60)  # every caller's first accept of this resource at once
            with marks.engine.begin() as conn:
                results.append(marks.accept(resource, i, conn=conn))
                time.sleep(0.005)  # the caller's own write, under the lock
        return results

    results = _in_threads(THREADS, accept_each)
    for n, resource in enumerate(resources):
        assert marks.highest(resource) == THREADS - 1
        assert results[THREADS - 1][n] is True


# -- idempotency keys ---------------------------------------------------------------------


def test_record_once_is_true_the_first_time_and_false_ever_after(marks: FenceMarks) -> None:
    assert marks.record_once("charge:42") is True
    assert marks.record_once("charge:42") is False
    assert marks.record_once("charge:42", fence=7) is False
    assert marks.record_once("charge:43") is True


def test_record_once_keeps_the_first_recorders_fence_and_the_server_time(marks: FenceMarks) -> None:
    before = time.time()
    assert marks.record_once("k", fence=7)
    assert marks.record_once("k", fence=8) is False
    assert marks.record_once("no-fence")
    [(key, fence, recorded_at), (key2, fence2, _)] = rows(marks.engine, idempotency_keys)
    assert (key, fence) == ("k", 7)
    assert (key2, fence2) == ("no-fence", None)
    assert isinstance(recorded_at, float)
    # the database server runs on this machine: its clock agrees within a minute
    assert abs(recorded_at - before) < 60


def test_keys_are_compared_exactly(marks: FenceMarks) -> None:
    for key in ["k", "K", "k ", "é", "e\u0301"]:
        assert marks.record_once(key) is True
    for key in ["k", "K", "k ", "é", "e\u0301"]:
        assert marks.record_once(key) is False


def test_key_recorded_in_a_rolled_back_transaction_is_not_recorded(marks: FenceMarks) -> None:
    with marks.engine.connect() as conn, conn.begin() as tx:
        assert marks.record_once("k", conn=conn) is True
        assert marks.record_once("k", conn=conn) is False
        tx.rollback()
    assert marks.record_once("k") is True
    assert marks.record_once("k") is False


def test_effect_and_key_commit_together_so_the_effect_happens_once(marks: FenceMarks) -> None:
    effects = Table("effects", MetaData(), Column("n", Integer))
    with marks.engine.begin() as conn:
        effects.create(conn)

    def deliver(fail: bool) -> None:
        with marks.engine.begin() as conn:
            if marks.record_once("send:1", fence=1, conn=conn):
                conn.execute(effects.insert().values(n=1))
                if fail:
                    raise RuntimeError("crash after the effect's write, before commit")

    with pytest.raises(RuntimeError):
        deliver(fail=True)
    for _ in range(3):  # redelivered three times
        deliver(fail=False)
    with marks.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(effects)).scalar_one() == 1


def test_duplicate_key_leaves_the_callers_transaction_usable(marks: FenceMarks) -> None:
    with marks.engine.begin() as conn:
        assert marks.record_once("k", conn=conn) is True
        assert marks.record_once("k", conn=conn) is False
        assert marks.accept("r", 3, conn=conn) is True
        assert marks.record_once("k2", conn=conn) is True
    assert marks.record_once("k") is False
    assert marks.record_once("k2") is False
    assert marks.highest("r") == 3


# -- bad input ----------------------------------------------------------------------------

BAD_TEXT = [
    (None, InvalidArgumentType),
    (b"r", InvalidArgumentType),
    (1, InvalidArgumentType),
    (["r"], InvalidArgumentType),
    ("lone \ud800 surrogate", InvalidArgument),
]
BAD_FENCE = [
    (True, InvalidArgumentType),
    (False, InvalidArgumentType),
    (1.0, InvalidArgumentType),
    ("1", InvalidArgumentType),
    (None, InvalidArgumentType),
    (-1, InvalidArgument),
    (FENCE_MAX + 1, InvalidArgument),
]


def _unchanged(marks: FenceMarks) -> Callable[[], None]:
    assert marks.accept("r", 5)
    assert marks.record_once("k", fence=5)
    snapshot = (rows(marks.engine, fence_marks), rows(marks.engine, idempotency_keys))

    def check() -> None:
        assert (rows(marks.engine, fence_marks), rows(marks.engine, idempotency_keys)) == snapshot

    return check


@pytest.mark.parametrize(("resource", "error"), BAD_TEXT)
def test_bad_resource_is_refused_and_nothing_changes(marks: FenceMarks, resource: Any, error: type) -> None:
    unchanged = _unchanged(marks)
    with pytest.raises(error, match="resource"):
        marks.accept(resource, 6)
    with pytest.raises(error, match="resource"):
        marks.highest(resource)
    unchanged()


@pytest.mark.parametrize(("fence", "error"), BAD_FENCE)
def test_bad_fence_is_refused_and_nothing_changes(marks: FenceMarks, fence: Any, error: type) -> None:
    unchanged = _unchanged(marks)
    with pytest.raises(error, match="fence"):
        marks.accept("r", fence)
    with pytest.raises(error, match="fence"):
        marks.accept("new", fence)
    if fence is not None:  # None is "no fence" for a key
        with pytest.raises(error, match="fence"):
            marks.record_once("new", fence=fence)
    unchanged()
    assert marks.highest("new") is None
    assert marks.record_once("new") is True


@pytest.mark.parametrize(("key", "error"), BAD_TEXT)
def test_bad_key_is_refused_and_nothing_changes(marks: FenceMarks, key: Any, error: type) -> None:
    unchanged = _unchanged(marks)
    with pytest.raises(error, match="key"):
        marks.record_once(key, fence=6)
    unchanged()


@pytest.mark.parametrize("conn", ["conn", 1, object()])
def test_conn_that_is_not_a_connection_is_refused(marks: FenceMarks, conn: Any) -> None:
    unchanged = _unchanged(marks)
    with pytest.raises(InvalidArgumentType, match="conn"):
        marks.accept("r", 6, conn=conn)
    with pytest.raises(InvalidArgumentType, match="conn"):
        marks.highest("r", conn=conn)
    with pytest.raises(InvalidArgumentType, match="conn"):
        marks.record_once("new", conn=conn)
    with pytest.raises(InvalidArgumentType, match="conn"):
        marks.create_tables(conn=conn)
    unchanged()


@pytest.mark.backend("postgresql", "mysql", "mariadb")
def test_keys_too_long_for_the_backend_are_refused_never_truncated(marks: FenceMarks) -> None:
    from fencing._dialects import of

    limit = of(marks.engine.dialect).id_max_bytes
    assert limit is not None
    unchanged = _unchanged(marks)
    longest = "é" * (limit // 2)
    too_long = longest + "x" * (limit - len(longest.encode()) + 1)
    with pytest.raises(InvalidArgument, match="resource"):
        marks.accept(too_long, 6)
    with pytest.raises(InvalidArgument, match="key"):
        marks.record_once(too_long)
    unchanged()
    assert marks.accept(longest, 6) is True
    assert marks.highest(longest) == 6
    assert marks.record_once(longest) is True


@pytest.mark.backend("postgresql")
def test_nul_is_refused_where_text_cannot_hold_it(marks: FenceMarks) -> None:
    unchanged = _unchanged(marks)
    with pytest.raises(InvalidArgument, match="resource"):
        marks.accept("a\x00b", 6)
    with pytest.raises(InvalidArgument, match="key"):
        marks.record_once("a\x00b")
    unchanged()


@pytest.mark.backend("sqlite", "mysql", "mariadb")
def test_nul_is_data_where_the_backend_can_store_it(marks: FenceMarks) -> None:
    assert marks.accept("a\x00b", 6) is True
    assert marks.highest("a\x00b") == 6
    assert marks.highest("a") is None
    assert marks.record_once("a\x00b") is True
    assert marks.record_once("a") is True


# -- races --------------------------------------------------------------------------------

#: what one accept call saw: (mark read before, token offered, accepted?, mark read after)
Step = tuple[int | None, int, bool, int | None]


def _offer_increasing_tokens(marks: FenceMarks, resource: str, seed: int, count: int) -> list[Step]:
    """Offer strictly increasing random tokens, reading the mark around every call."""
    rng = random.Random(seed)
    tokens = sorted(rng.sample(range(1, 1_000_000), count))
    steps = []
    for token in tokens:
        before = marks.highest(resource)
        accepted = marks.accept(resource, token)
        steps.append((before, token, accepted, marks.highest(resource)))
    return steps


def _check_accept_race(histories: list[list[Step]], final: int | None) -> None:
    offered = [token for steps in histories for (_, token, _, _) in steps]
    accepted = [token for steps in histories for (_, token, ok, _) in steps if ok]
    rejected = [token for steps in histories for (_, token, ok, _) in steps if not ok]
    assert final == max(offered) == max(accepted)
    assert rejected, "the callers never contended: the race proved nothing"
    for steps in histories:
        seen: list[int] = []
        for before, token, ok, after in steps:
            assert before is not None or not seen
            assert after is not None
            if before is not None:
                seen.append(before)
            seen.append(after)
            if ok:
                # never accepted below a mark that was already stored when the call began
                assert before is None or token >= before
                # and the mark never fell below it afterwards (no lost update)
                assert after >= token
            else:
                # refused only because a higher mark was stored, and marks never go down
                assert after > token
        assert seen == sorted(seen), "a caller saw the mark go down"


def _in_threads(count: int, work: Callable[[int], Any]) -> list[Any]:
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads)
    return results


def test_accept_race_between_threads_never_accepts_below_the_mark(marks: FenceMarks) -> None:
    seed = random.randrange(2**32)
    histories = _in_threads(THREADS, lambda i: _offer_increasing_tokens(marks, "r", seed + i, 25))
    _check_accept_race(histories, marks.highest("r"))


def test_record_once_race_between_threads_has_exactly_one_winner(marks: FenceMarks) -> None:
    keys = [f"k{n}" for n in range(20)]
    results = _in_threads(THREADS, lambda i: [marks.record_once(k, fence=i) for k in keys])
    for n, key in enumerate(keys):
        assert sorted(r[n] for r in results) == [False] * (THREADS - 1) + [True], key
        winner = next(i for i, r in enumerate(results) if r[n])
        assert (key, winner) in {(k, f) for (k, f, _) in rows(marks.engine, idempotency_keys)}


def _process_worker(target: str, job: str, seed: int, out: Any, barrier: Any) -> None:
    """In a spawned process: its own engine, a few threads, one job; results on ``out``."""
    engine = backends.engine_for(target)
    try:
        marks = FenceMarks(engine)
        barrier.wait(timeout=60)
        if job == "accept":
            result = _in_threads(
                THREADS_PER_PROCESS, lambda i: _offer_increasing_tokens(marks, "r", seed + i, 20)
            )
        else:
            result = _in_threads(
                THREADS_PER_PROCESS, lambda i: [marks.record_once(f"k{n}", fence=seed + i) for n in range(15)]
            )
        out.put(("ok", result))
    except BaseException as exc:
        out.put(("error", repr(exc)))
    finally:
        engine.dispose()


def _in_processes(target: str, job: str) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(PROCESSES)
    seed = random.randrange(2**32)
    procs = [
        ctx.Process(target=_process_worker, args=(target, job, seed + 100 * p, out, barrier))
        for p in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    try:
        results = []
        for _ in procs:
            try:
                status, value = out.get(timeout=300)
            except queue.Empty:
                pytest.fail("a worker process did not report back")
            assert status == "ok", value
            results.extend(value)
        return results
    finally:
        reap(procs, 30)


@pytest.mark.slow
def test_accept_race_between_processes_never_accepts_below_the_mark(marks: FenceMarks, target: str) -> None:
    histories = _in_processes(target, "accept")
    assert len(histories) == PROCESSES * THREADS_PER_PROCESS
    _check_accept_race(histories, marks.highest("r"))


@pytest.mark.slow
def test_record_once_race_between_processes_has_exactly_one_winner(marks: FenceMarks, target: str) -> None:
    results = _in_processes(target, "record")
    callers = PROCESSES * THREADS_PER_PROCESS
    assert len(results) == callers
    for n in range(15):
        assert sorted(r[n] for r in results) == [False] * (callers - 1) + [True], f"k{n}"
    assert len(rows(marks.engine, idempotency_keys)) == 15
