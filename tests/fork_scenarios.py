"""Processes that fork after using the engine, run by ``tests/databases/test_forks.py``.

Each scenario runs in an interpreter of its own with a single thread (a pytest-xdist worker
has several, and fork() with threads alive is unsafe), prints a JSON report on stdout and
exits 0; the test reads the report and checks it, and the database, from its own process.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, select

import fencing
from fencing import ConfigurationError, FenceMarks, JobStore
from fencing._sql.schema import as_text
from tests.backends import engine_for

TTL = 60.0
#: jobs each side works through after the fork
JOBS = 20

app_metadata = MetaData()
#: the application's own table, written inside fenced blocks
app_rows = Table(
    "fork_app_rows",
    app_metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("job", String(100), nullable=False),
    Column("writer", String(20), nullable=False),
)


def prepare(target: str) -> None:
    """Fresh tables: ``JOBS`` ready jobs for both sides to share, and ``held``."""
    engine = engine_for(target)
    try:
        for metadata in (app_metadata, fencing.jobs.metadata, fencing._store.marks.marks_metadata):
            metadata.drop_all(engine)
        store = JobStore(engine)
        store.create_table()
        FenceMarks(engine).create_tables()
        app_metadata.create_all(engine)
        store.enqueue("held", ready_at=0.0)
        for n in range(JOBS):
            store.enqueue(f"job-{n:02d}", ready_at=0.0)
    finally:
        engine.dispose()


def _pipe() -> tuple[int, int]:
    return os.pipe()


def _say(fd: int, word: str) -> None:
    os.write(fd, word.encode() + b"\n")


def _hear(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise EOFError("the other process went away")
        data += chunk
    return data.decode().strip()


def _work(store: JobStore, marks: FenceMarks, who: str) -> list[list[Any]]:
    """Claim and complete ready jobs until none is left; the (job, fence) pairs handed out."""
    got: list[list[Any]] = []
    while leases := store.claim_next(who, ttl=TTL, limit=4):
        for lease in leases:
            got.append([lease.job_id, lease.fence])
            assert marks.accept(f"resource-{lease.job_id}", lease.fence)
            with store.fenced(lease, complete=True, result=who) as conn:
                conn.execute(app_rows.insert().values(job=lease.job_id, writer=who))
    return got


def _finalize_as_at_exit() -> None:
    """What a child that exits normally runs: the garbage collector and atexit hooks
    (SQLAlchemy's pool returns, resets or closes what it still tracks there)."""
    gc.collect()
    atexit._run_exitfuncs()


def _child(run: Callable[[], dict[str, Any]], out: int) -> None:
    """In the forked child: run, report, exit without unwinding into the parent's frames."""
    try:
        report = run()
    except BaseException:
        report = {"error": traceback.format_exc()}
    os.write(out, json.dumps(report).encode())
    os.close(out)
    os._exit(0)


def _read_all(fd: int) -> dict[str, Any]:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks) or b"{}")  # type: ignore[no-any-return]


def used_then_forked_inside_a_fenced_block(target: str) -> dict[str, Any]:
    """The parent uses the engine every way (its own connection, create_table, FenceMarks, a
    fenced block), forks inside an open fenced block, and both sides then work at once."""
    prepare(target)
    engine = engine_for(target)
    # every DBAPI connection the pool made in this process, kept alive so that no id() of
    # theirs is reused by a connection the child makes after closing its copies of them
    made: list[Any] = []
    checked_out: list[int] = []
    event.listen(engine, "connect", lambda dbapi, record: made.append(dbapi))
    event.listen(engine, "checkout", lambda dbapi, record, proxy: checked_out.append(id(dbapi)))
    store = JobStore(engine)
    marks = FenceMarks(engine)
    with engine.connect() as one, engine.connect() as two, engine.connect() as three:
        for conn in (one, two, three):  # the application's own use: three idle connections after
            conn.execute(select(app_rows)).all()
    marks.accept("resource-held", 1)
    lease = store.claim("held", "parent", ttl=TTL)
    assert lease is not None
    report: dict[str, Any] = {}
    to_child_r, to_child_w = _pipe()
    to_parent_r, to_parent_w = _pipe()
    result_r, result_w = _pipe()
    with store.fenced(lease, complete=True, result="parent") as block:
        block.execute(app_rows.insert().values(job="held", writer="parent"))
        pid = os.fork()
        if pid == 0:

            def child() -> dict[str, Any]:
                parents = {id(dbapi) for dbapi in made}  # ids stay across fork(): the parent's
                checked_out.clear()
                _finalize_as_at_exit()  # must not end (or talk on) the parent's transaction
                _say(to_parent_w, "finalized")
                assert _hear(to_child_r) == "committed"
                mine = _work(store, marks, "child")
                _say(to_parent_w, "worked")
                assert _hear(to_child_r) == "disposed"  # the parent has closed all it had
                store.enqueue("c-after-dispose", ready_at=0.0)
                after = store.claim("c-after-dispose", "child", ttl=TTL)
                assert after is not None and store.complete(after, "child")
                return {
                    "leases": [*mine, [after.job_id, after.fence]],
                    "checked out a parent's connection": bool(parents & set(checked_out)),
                    "checked out": len(checked_out),
                }

            _child(child, result_w)
        os.close(result_w)  # the child's: its end of the report reaches us as EOF
        assert _hear(to_parent_r) == "finalized"
        # the child ran its exit-time cleanup: the block's transaction is still open and ours
        outside = engine_for(target)
        try:
            with outside.connect() as other:
                report["uncommitted insert visible elsewhere"] = bool(
                    other.execute(select(app_rows).where(app_rows.c.job == "held")).all()
                )
        finally:
            outside.dispose()
        report["block sees its own insert"] = bool(
            block.execute(select(app_rows).where(app_rows.c.job == "held")).all()
        )
    report["block committed"] = True
    _say(to_child_w, "committed")
    mine = _work(store, marks, "parent")
    assert _hear(to_parent_r) == "worked"
    engine.dispose()  # closes every connection of the parent (SQLite: the last one may checkpoint)
    _say(to_child_w, "disposed")
    child_report = _read_all(result_r)
    _, status = os.waitpid(pid, 0)
    report["child"] = child_report
    report["child status"] = status
    report["parent leases"] = [[lease.job_id, lease.fence], *mine]
    report["parent still works"] = store.state("held") is not None
    engine.dispose()
    return report


def child_leaves_a_fenced_block_the_parent_opened(target: str) -> dict[str, Any]:
    """Forked inside a fenced block, the child returns out of it: it must neither commit nor
    roll back the parent's transaction, and says so."""
    prepare(target)
    engine = engine_for(target)
    store = JobStore(engine)
    lease = store.claim("held", "parent", ttl=TTL)
    assert lease is not None
    report: dict[str, Any] = {}
    result_r, result_w = _pipe()
    done_r, done_w = _pipe()
    pid = -1
    try:
        with store.fenced(lease, complete=True, result="parent") as block:
            block.execute(app_rows.insert().values(job="held", writer="parent"))
            pid = os.fork()
            if pid != 0:
                assert _hear(done_r) == "left"  # wait until the child has left the block
                report["block sees its own insert"] = bool(block.execute(select(app_rows)).all())
    except ConfigurationError as exc:
        if pid == 0:  # the child, leaving the block
            _say(done_w, "left")
            said = {"error type": type(exc).__name__, "message": str(exc)}
            _child(lambda: said, result_w)
        raise
    if pid == 0:
        _say(done_w, "left")
        _child(lambda: {"error type": None}, result_w)
    os.close(result_w)
    report["child"] = _read_all(result_r)
    os.waitpid(pid, 0)
    report["job"] = _state(store, "held")
    with engine.connect() as conn:
        report["rows"] = [list(r) for r in conn.execute(select(app_rows.c.job, app_rows.c.writer)).all()]
    engine.dispose()
    return report


def forked_while_another_thread_held_a_connection(target: str) -> dict[str, Any]:
    """SQLite: another thread is inside a transaction at the fork. The child's copy of SQLite's
    lock table is then wrong for that file, so the library refuses the engine there."""
    prepare(target)
    engine = engine_for(target)
    store = JobStore(engine)
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with engine.connect() as conn:
            conn.execute(select(app_rows)).all()  # a read transaction, open across the fork
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(60)
    result_r, result_w = _pipe()
    pid = os.fork()
    if pid == 0:

        def child() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, call in (
                ("claim", lambda: store.claim("job-00", "child", ttl=TTL)),
                ("state", lambda: store.state("job-00")),
                ("FenceMarks", lambda: FenceMarks(engine).accept("r", 1)),
            ):
                try:
                    call()
                    out[name] = None
                except ConfigurationError as exc:
                    out[name] = str(exc)
            return out

        _child(child, result_w)
    os.close(result_w)
    child_report = _read_all(result_r)
    os.waitpid(pid, 0)
    release.set()
    holder.join(60)
    lease = store.claim("job-01", "parent", ttl=TTL)
    report = {
        "child": child_report,
        "parent claimed": lease is not None,
        "job-00": _state(store, "job-00"),
    }
    engine.dispose()
    return report


def _state(store: JobStore, job_id: str) -> list[Any] | None:
    found = store.state(job_id)
    return None if found is None else list(found)


def table_rows(engine: Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [(r[0], r[1]) for r in conn.execute(select(app_rows.c.job, app_rows.c.writer)).all()]


def job_rows(engine: Engine) -> dict[str, tuple[Any, ...]]:
    jobs = fencing.jobs
    query = select(as_text(jobs.c.id), as_text(jobs.c.owner), jobs.c.fence, jobs.c.result, jobs.c.done)
    with engine.connect() as conn:
        return {r[0]: tuple(r[1:]) for r in conn.execute(query).all()}


if __name__ == "__main__":
    scenario = globals()[sys.argv[1]]
    print(json.dumps(scenario(sys.argv[2])))
    sys.stdout.flush()
