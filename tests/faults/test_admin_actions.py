"""An operator's change of one job (:mod:`fencing._admin`: the CLI's ``revoke``,
``release``, ``delete``, ``requeue`` and the dashboard's actions) with its connection cut,
and the pooled session it gives back.

Cut at the change's COMMIT, its write, or anywhere drawn from a seed
(:mod:`tests.cutting_proxy`, as in ``tests/faults/test_connection_cuts.py``), the change answers what
it did, or raises :class:`~fencing.DatabaseUnavailable` with nothing changed, or
:class:`~fencing.OutcomeUnknown` with all of it or none of it; a COMMIT the server ran whose
answer was lost is always :class:`~fencing.OutcomeUnknown`, never "nothing changed" (and, from
the CLI, exit code 3 with the way to look). The history changes in the same transaction.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, create_engine, delete, event, make_url, select

from fencing import (
    DatabaseBusy,
    DatabaseUnavailable,
    History,
    JobStore,
    OutcomeUnknown,
    attempts_table,
    history_table,
    jobs_table,
)
from fencing._admin import Changed, change_job
from fencing.cli import main
from fencing.overview import Overview
from tests import backends
from tests.cutting_proxy import HOWS, Cut, CuttingProxy
from tests.faults.test_connection_cuts import SEED, cuts_for
from tests.faults.test_connection_cuts import proxy as proxy  # the fixture: a proxy to the server under test

SERVERS = pytest.mark.backend("postgresql", "mysql", "mariadb")  # SQLite has no connection to cut
CHANGES = ("revoke", "release", "delete", "requeue")
#: cuts drawn at random per change, besides the aimed ones
RANDOM_CUTS = 8


@dataclass
class Tables:
    metadata: MetaData = field(default_factory=MetaData)

    def __post_init__(self) -> None:
        self.jobs = jobs_table(self.metadata, "admin_jobs")
        self.history = history_table(self.metadata, "admin_history")
        self.attempts = attempts_table(self.metadata, "admin_attempts")


def _text(value: Any) -> Any:
    return value.decode("utf-8") if isinstance(value, bytes) else value


Rows = tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class Seen:
    """One job as the test reads it, never through the proxy: its row, its attempts base, its
    history."""

    job: Rows
    attempts: Rows
    history: Rows

    @classmethod
    def read(cls, engine: Engine, tables: Tables) -> Seen:
        """The tables hold one job's rows (:meth:`Bench.job` clears them first)."""

        def rows(table: Any, order: Any) -> Rows:
            with engine.connect() as conn:
                return tuple(
                    tuple(_text(v) for v in row) for row in conn.execute(select(table).order_by(order))
                )

        j, a, h = tables.jobs, tables.attempts, tables.history
        return cls(rows(j, j.c.id), rows(a, a.c.id), rows(h, h.c.seq))


def made(name: str, before: Seen, after: Seen) -> bool:
    """The change ``name`` is in ``after``, whole: the job's row as it says, and one more
    history entry, its own."""
    (_, _, until, fence, result, _) = before.job[0]
    new = after.job[0]
    rows = {
        "revoke": (new[0], None, 0.0, fence + 1, result, 0),
        "release": (new[0], None, 0.0, fence, result, 0),
        "delete": (new[0], None, 0.0, fence, result, 2),
        "requeue": (new[0], None, float(until), fence, result, 0),  # ready already: its until kept
    }
    row = (new[0], new[1], float(new[2]), int(new[3]), new[4], int(new[5]))
    events = [entry for entry in after.history if entry not in before.history]
    bases = [int(r[-1]) for r in after.attempts]
    based = bases == [fence] if name == "requeue" else after.attempts == before.attempts
    return row == rows[name] and based and len(events) == 1 and name in events[0]


class Bench:
    """The proxy, the admin's store through it (with the history and attempts tables), and a
    direct way to the same tables for setting up and checking."""

    def __init__(self, target: str, proxy: CuttingProxy) -> None:
        self.tables = t = Tables()
        self.direct_engine = backends.engine_for(target)
        history = History(t.history, retention=None)
        self.direct = JobStore(self.direct_engine, t.jobs, history=history, attempts=t.attempts)
        self.direct.create_table()
        self.url = (
            make_url(target).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        )
        # psycopg prepares nothing (its 5th run of a statement would send other messages);
        # pymysql makes no TLS context for a server that offers none
        postgresql = self.url.startswith("postgresql")
        self.engine = create_engine(
            self.url, connect_args={"prepare_threshold": None} if postgresql else {"ssl_disabled": True}
        )
        self.store = JobStore(self.engine, t.jobs, history=history, attempts=t.attempts)
        self.overview = Overview(self.engine, t.jobs)
        self.proxy = proxy
        self.trial = 0
        self.replaced = True

    def close(self) -> None:
        self.engine.dispose()
        self.direct_engine.dispose()

    def job(self, name: str, trial: int) -> str:
        """A job the change ``name`` changes: held for a revoke, release or delete; for a
        requeue, claimed once long ago (its lease over)."""
        job_id = f"t{trial:05d}"
        with self.direct_engine.begin() as conn:
            for table in (self.tables.jobs, self.tables.attempts, self.tables.history):
                conn.execute(delete(table))
        assert self.direct.enqueue(job_id, ready_at=0.0)
        if name == "requeue":
            assert self.direct.claim(job_id, "w", ttl=1.0, now=1.0) is not None
        else:
            assert self.direct.claim(job_id, "w", ttl=600.0) is not None
        return job_id

    def attempt(self, name: str, cut: Cut | None, *, cold: bool = False) -> tuple[str, Any, Seen, Seen, Any]:
        """``change_job(name)`` once with ``cut`` armed: how it ended, its answer or error, the
        job before and after, and the cut made. ``cold``: the pool is empty first."""
        self.trial += 1
        if self.replaced and not cold:  # a new connection: once uncut, so it sends what it will
            change_job(name, self.store, self.overview, self.job(name, -self.trial), wait=5)
        job_id = self.job(name, self.trial)
        before = Seen.read(self.direct_engine, self.tables)
        if cold:
            self.engine.dispose()
        else:
            self.store.state("nothing")  # a live pooled connection: the change's messages are its own
        self.proxy.arm(cut)
        try:
            answer: Any = change_job(name, self.store, self.overview, job_id, wait=5)
            kind = "answered"
        except OutcomeUnknown as exc:
            answer, kind = exc, "unknown"
        except DatabaseUnavailable as exc:
            answer, kind = exc, "unavailable"
        except BaseException as exc:
            fired = self.proxy.disarm()
            raise AssertionError(f"{name} cut {fired}: {type(exc).__name__}: {exc}") from exc
        fired = self.proxy.disarm()
        self.replaced = fired is not None
        self.proxy.settle()  # what the server got before the cut has run, or was rolled back
        assert self.engine.pool.checkedout() == 0, "a connection was not given back"  # type: ignore[attr-defined]
        return kind, answer, before, Seen.read(self.direct_engine, self.tables), fired


def judge(name: str, kind: str, answer: Any, before: Seen, after: Seen, fired: Any) -> None:
    what = f"{name}, cut {fired}: {kind} ({answer!r})"
    if kind == "answered":
        assert isinstance(answer, Changed) and answer.changed and made(name, before, after), what
    elif kind == "unavailable":
        assert after == before and fired is not None, what  # "nothing changed", truly
        assert "nothing was changed" in str(answer), what
    else:
        assert after == before or made(name, before, after), what  # all of it or none of it
        assert fired is not None and "the outcome is unknown" in str(answer), what
        assert f"of job {before.job[0][0]!r}" in str(answer), what  # which job to read
    if kind != "answered":
        assert answer.__cause__ is not None, what


@SERVERS
@pytest.mark.parametrize("name", CHANGES)
def test_an_operator_change_cut_anywhere_is_done_undone_or_unknown_never_nothing_changed_once_committed(
    target: str, proxy: CuttingProxy, name: str
) -> None:
    bench = Bench(target, proxy)
    committed_unknown = 0
    outcomes: Counter[tuple[str, str]] = Counter()
    try:
        for _ in range(2):  # the second uncut run's messages: what every later one sends
            kind, answer, before, after, fired = bench.attempt(name, None)
            judge(name, kind, answer, before, after, fired)
            assert kind == "answered"
        messages = list(proxy.messages)
        assert any(b"COMMIT" in m for m in messages), messages  # the change commits by COMMIT
        rng = random.Random(f"{SEED}:{make_url(target).get_backend_name()}:admin:{name}")
        aim = SimpleNamespace(aim=b"UPDATE admin_jobs SET")  # the write (FOR UPDATE reads)
        cuts = cuts_for(aim, messages, rng, proxy.protocol == "postgresql")  # type: ignore[arg-type]
        for cut, commits in cuts[: 6 + RANDOM_CUTS]:
            kind, answer, before, after, fired = bench.attempt(name, cut)
            judge(name, kind, answer, before, after, fired)
            outcomes[(cut.how, kind if fired is not None else "not cut")] += 1
            if commits:
                # the server ran the COMMIT and the client never heard: unknown, and made
                assert kind == "unknown" and made(name, before, after), (cut, kind, answer, after)
                committed_unknown += 1
        for at in (1, 2):  # lost while connecting: nothing of the change was sent
            kind, answer, before, after, fired = bench.attempt(
                name, Cut(rng.choice(HOWS), at, fresh=True), cold=True
            )
            judge(name, kind, answer, before, after, fired)
            assert fired is not None and kind == "unavailable", (kind, answer)
    finally:
        bench.close()
    assert committed_unknown == 1
    # the points drawn are within what the change sends: almost every one is cut
    assert sum(n for (_, kind), n in outcomes.items() if kind == "not cut") <= RANDOM_CUTS // 3, outcomes


@SERVERS
@pytest.mark.parametrize("name", CHANGES)
def test_the_cli_says_a_change_cut_at_commit_has_an_unknown_outcome_and_how_to_look(
    target: str, proxy: CuttingProxy, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    bench = Bench(target, proxy)
    commit = b"\x03COMMIT" if proxy.protocol == "mysql" else b"COMMIT"  # (not SET autocommit)
    tables = ["--table", "admin_jobs", "--history-table", "admin_history"]
    if name == "requeue":
        tables += ["--attempts-table", "admin_attempts"]
    try:
        for how, kept in (("after", True), ("before", False)):
            job_id = bench.job(name, bench.trial)
            bench.trial += 1
            before = Seen.read(bench.direct_engine, bench.tables)
            proxy.arm(Cut(how, 1, text=commit))
            code = main([name, job_id, "--url", bench.url, "--json", *tables])
            fired = proxy.disarm()
            proxy.settle()
            out, err = capsys.readouterr()
            assert fired is not None and code == 3, (how, code, out, err)
            assert "the outcome is unknown" in err and f"`fencing show {job_id}`" in err, err
            assert err.count("\n") == 1 and "Traceback" not in err, err
            assert [json.loads(line) for line in out.splitlines()] == [{"id": job_id, f"{name}d": None}]
            after = Seen.read(bench.direct_engine, bench.tables)
            assert made(name, before, after) if kept else after == before, (how, after)
    finally:
        bench.close()


# -- the session an action gives back (MariaDB/MySQL: the lock wait is a session setting) ------


@pytest.fixture
def one_connection(target: str) -> Iterator[Engine]:
    """The application's engine: one pooled connection, whose session sets its own lock wait
    (7 s, neither the server's default nor the action's)."""
    engine = create_engine(target, pool_size=1, max_overflow=0)

    @event.listens_for(engine, "connect")
    def own_wait(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("SET SESSION innodb_lock_wait_timeout = 7")
        cursor.close()

    try:
        yield engine
    finally:
        engine.dispose()


def session_wait(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT @@session.innodb_lock_wait_timeout").scalar_one())


@pytest.mark.backend("mysql", "mariadb")
@pytest.mark.parametrize("name", CHANGES)
def test_an_action_leaves_the_pooled_sessions_lock_wait_as_it_was(one_connection: Engine, name: str) -> None:
    tables = Tables()
    store = JobStore(one_connection, tables.jobs, attempts=tables.attempts)
    store.create_table()
    overview = Overview(one_connection, tables.jobs)
    store.enqueue("j", ready_at=0.0)
    assert store.claim("j", "w", ttl=600.0, now=None if name != "requeue" else 1.0) is not None
    assert session_wait(one_connection) == 7
    assert change_job(name, store, overview, "j", wait=1.0).changed
    assert session_wait(one_connection) == 7  # the action's 1 s stayed with the action
    assert not change_job(name, store, overview, "missing", wait=2.5).changed
    assert session_wait(one_connection) == 7


@pytest.mark.backend("mysql", "mariadb")
def test_an_action_that_waited_in_vain_leaves_the_pooled_sessions_lock_wait_as_it_was(
    one_connection: Engine, engine: Engine
) -> None:
    tables = Tables()
    worker = JobStore(engine, tables.jobs)
    worker.create_table()
    worker.enqueue("j")
    lease = worker.claim("j", "w", ttl=600.0)
    assert lease is not None
    store = JobStore(one_connection, tables.jobs)
    inside, leave = threading.Event(), threading.Event()

    def block() -> None:  # a worker's fenced block: it holds the job's row
        with worker.fenced(lease):
            inside.set()
            leave.wait(60)

    thread = threading.Thread(target=block, daemon=True)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(DatabaseBusy, match="for more than 1 s"):
            change_job("revoke", store, Overview(one_connection, tables.jobs), "j", wait=1.0)
    finally:
        leave.set()
        thread.join(30)
    assert session_wait(one_connection) == 7
    assert worker.holder("j") == lease  # nothing changed
