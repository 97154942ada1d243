"""``fencing doctor`` and the durability check behind it (:mod:`fencing.durability`).

Every unsafe setting is set where it can be, and the doctor must name it: per session on the
shared PostgreSQL (``synchronous_commit``), per connection on a SQLite file (the pragmas),
and on private servers (:mod:`tests.private_servers`) for what only a server-wide setting
can do (``fsync``, ``full_page_writes``, standbys, InnoDB's flushing, the binary log,
the doublewrite buffer): never on the shared servers. The shared servers, as they are, are
the safe case. The WARNING once per engine and the strict refusal are tested through
:func:`fencing.durability.note`, the call the store makes where it meets an engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Engine, event, make_url
from sqlalchemy.pool import NullPool

import fencing
from fencing import ConfigurationError
from fencing.cli import main
from fencing.durability import Finding, check_durability, judge, note, require_durable
from tests import private_servers
from tests.backends import Backend

SCRIPT = Path(sys.executable).with_name("fencing")


def risks(found: list[Finding]) -> dict[str, str]:
    """The settings at risk, with their values."""
    return {f.setting: f.value for f in found if f.status == "risk"}


def doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int | str | None, str, str]:
    try:
        code: int | str | None = main(["doctor", *argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def sqlite_engine(path: Path, *pragmas: str, **kwargs: Any) -> Engine:
    """The library's SQLite engine, then ``pragmas`` on every connection (after its own)."""
    engine = fencing.create_sqlite_engine(path, **kwargs)

    @event.listens_for(engine, "connect")
    def unsafe(dbapi_connection: Any, record: Any) -> None:
        for pragma in pragmas:
            dbapi_connection.execute(pragma)

    return engine


@pytest.fixture
def with_options(backend: Backend, target: str) -> Iterator[Callable[[str], Engine]]:
    """``with_options("-c synchronous_commit=off")``: an engine on the test's PostgreSQL
    database whose sessions get those options (libpq's, per session)."""
    made: list[Engine] = []

    def make(options: str) -> Engine:
        made.append(sqlalchemy.create_engine(target, connect_args={"options": options}))
        return made[-1]

    yield make
    for engine in made:
        engine.dispose()


# -- the rules, as data --------------------------------------------------------------------------


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize(
    ("database", "values", "expected"),
    [
        ("postgresql", {"synchronous_commit": "local"}, set()),  # no standby named: local is on
        ("postgresql", {"synchronous_commit": "remote_write", "synchronous_standby_names": "s"}, set()),
        ("postgresql", {"synchronous_commit": "remote_apply", "synchronous_standby_names": "s"}, set()),
        (
            "postgresql",
            {"synchronous_commit": "local", "synchronous_standby_names": "s"},
            {"synchronous_commit"},
        ),
        (
            "postgresql",
            {"synchronous_commit": "off", "synchronous_standby_names": "s"},
            {"synchronous_commit"},
        ),
        ("postgresql", {"standbys": "2", "synchronous_standby_names": "s"}, set()),
        ("postgresql", {"standbys": "2"}, {"synchronous_standby_names"}),
        ("mysql", {"innodb_flush_log_at_trx_commit": "3"}, set()),  # MariaDB's alias of 1
        ("mysql", {"innodb_flush_log_at_trx_commit": "0"}, {"innodb_flush_log_at_trx_commit"}),
        ("mysql", {"sync_binlog": "0"}, set()),  # the binary log is off
        ("mysql", {"sync_binlog": "0", "log_bin": "on"}, {"sync_binlog"}),
        ("mysql", {"innodb_doublewrite": "detect_only"}, {"innodb_doublewrite"}),
        ("sqlite", {"synchronous": "normal", "journal_mode": "delete"}, {"synchronous"}),
        ("sqlite", {"synchronous": "extra", "journal_mode": "delete"}, set()),
    ],
)
def test_each_rule_names_the_unsafe_value_and_only_it(
    database: str, values: dict[str, str], expected: set[str]
) -> None:
    safe = {
        "postgresql": {
            "fsync": "on",
            "full_page_writes": "on",
            "synchronous_commit": "on",
            "synchronous_standby_names": "",
            "standbys": "0",
        },
        "mysql": {
            "innodb_flush_log_at_trx_commit": "1",
            "sync_binlog": "1",
            "log_bin": "off",
            "innodb_doublewrite": "on",
        },
        "sqlite": {"journal_mode": "wal", "synchronous": "full", "fullfsync": "off"},
    }[database]
    found = judge(database, {**safe, **values}, platform="linux")
    assert set(risks(found)) == expected
    for f in found:
        assert bool(f.risk and f.advice) == (f.status == "risk"), f


@pytest.mark.backend("sqlite")
def test_fullfsync_is_a_risk_on_macos_only_and_says_so_elsewhere() -> None:
    values = {"journal_mode": "wal", "synchronous": "full", "fullfsync": "off"}
    [mac] = [f for f in judge("sqlite", values, platform="darwin") if f.setting == "fullfsync"]
    assert mac.status == "risk" and "PRAGMA fullfsync = ON" in mac.advice
    [linux] = [f for f in judge("sqlite", values, platform="linux") if f.setting == "fullfsync"]
    assert linux.status == "not applicable" and "macOS only" in linux.note
    on = judge("sqlite", {**values, "fullfsync": "on"}, platform="darwin")
    assert risks(on) == {}


@pytest.mark.backend("sqlite")
def test_a_setting_the_database_does_not_report_is_a_risk() -> None:
    found = judge("mysql", {"innodb_flush_log_at_trx_commit": "1", "log_bin": "off", "sync_binlog": "0"})
    assert risks(found) == {"innodb_doublewrite": "(not reported)"}


# -- the shared servers, as they are: the safe case ----------------------------------------------


def test_the_shared_database_as_it_is_keeps_what_it_acknowledges(
    engine: Engine, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    found = check_durability(engine)
    assert risks(found) == {}, found
    assert [f.setting for f in found if f.status == "not applicable"] == {
        "sqlite": ["fullfsync"],  # not macOS
        "postgresql": [],
        "mysql": ["sync_binlog"],  # the shared MariaDB runs without a binary log
    }[found[0].database]
    code, out, err = doctor(capsys, "--url", target)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == "every setting keeps what the database acknowledged"
    assert [line.split()[0] for line in out.splitlines()[1:-1]] == [
        {"ok": "ok", "not applicable": "n/a"}[f.status] for f in found
    ]
    code, out, _ = doctor(capsys, "--url", target, "--json")
    assert code == 0 and [json.loads(line) for line in out.splitlines()] == [f.as_dict() for f in found]


# -- per session: PostgreSQL's synchronous_commit ------------------------------------------------


@pytest.mark.backend("postgresql")
def test_synchronous_commit_off_for_the_session_is_a_risk(
    with_options: Callable[[str], Engine], target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    found = check_durability(with_options("-c synchronous_commit=off"))
    assert risks(found) == {"synchronous_commit": "off (synchronous_standby_names '')"}
    # no standby is named on the shared server: local is on, and safe
    assert risks(check_durability(with_options("-c synchronous_commit=local"))) == {}
    url = make_url(target).update_query_dict({"options": "-c synchronous_commit=off"})
    code, out, err = doctor(capsys, "--url", url.render_as_string(hide_password=False))
    assert (code, err) == (1, "")
    [line] = [line for line in out.splitlines() if line.startswith("RISK")]
    assert line.startswith(
        "RISK  synchronous_commit = off (synchronous_standby_names ''): a crash of the server"
    )
    assert "set synchronous_commit = on" in line
    assert out.splitlines()[-1] == "1 setting(s) at risk (synchronous_commit): exit code 1"


@pytest.mark.backend("postgresql")
def test_synchronous_commit_set_by_a_connect_listener_is_read_as_the_store_gets_it(target: str) -> None:
    engine = sqlalchemy.create_engine(target)

    @event.listens_for(engine, "connect")
    def no_wait(dbapi_connection: Any, record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit = off")
        dbapi_connection.commit()

    try:
        assert set(risks(check_durability(engine))) == {"synchronous_commit"}
    finally:
        engine.dispose()


# -- per connection: SQLite's pragmas --------------------------------------------------------------


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize(
    ("pragmas", "expected"),
    [
        ((), {}),
        (("PRAGMA synchronous = NORMAL",), {"synchronous": "normal (journal_mode wal)"}),
        (("PRAGMA synchronous = OFF",), {"synchronous": "off (journal_mode wal)"}),
        (
            ("PRAGMA journal_mode = DELETE", "PRAGMA synchronous = NORMAL"),
            {"synchronous": "normal (journal_mode delete)"},
        ),
        (("PRAGMA journal_mode = DELETE", "PRAGMA synchronous = FULL"), {}),
        (("PRAGMA journal_mode = OFF",), {"journal_mode": "off"}),
        (("PRAGMA journal_mode = MEMORY",), {"journal_mode": "memory"}),
    ],
)
def test_each_unsafe_sqlite_pragma_is_named(
    tmp_path: Path, pragmas: tuple[str, ...], expected: dict[str, str]
) -> None:
    engine = sqlite_engine(tmp_path / "jobs.db", *pragmas)
    try:
        assert risks(check_durability(engine)) == expected
    finally:
        engine.dispose()


@pytest.mark.backend("sqlite")
def test_durability_normal_is_named_as_the_risk_it_is(tmp_path: Path) -> None:
    engine = fencing.create_sqlite_engine(tmp_path / "jobs.db", durability="normal")
    try:
        [found] = [f for f in check_durability(engine) if f.status == "risk"]
        assert found.setting == "synchronous" and "power loss or an OS crash rolls back" in found.risk
    finally:
        engine.dispose()


# -- the command: exit codes and errors --------------------------------------------------------


@pytest.mark.backend("sqlite")
def test_doctor_exits_2_when_it_cannot_read_the_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = doctor(capsys, "--url", str(tmp_path / "missing.db"))
    assert code == 2 and "no database file at" in err
    code, _, err = doctor(
        capsys, "--url", f"postgresql+psycopg://postgres:secret@127.0.0.1:{private_servers.free_port()}/x"
    )
    assert code == 2 and "cannot read the settings of postgresql+psycopg://postgres:***@127.0.0.1" in err
    assert "secret" not in err
    code, _, err = doctor(capsys, "--url", "postgresql+psycopg://h:notaport/x")
    assert code == 2 and "not a database URL" in err
    monkeypatch.delenv("FENCING_URL", raising=False)
    code, _, err = doctor(capsys)
    assert code == 2 and "--url is required (or $FENCING_URL)" in err
    made = fencing.create_sqlite_engine(tmp_path / "jobs.db")
    made.connect().close()  # the file exists
    made.dispose()
    monkeypatch.setenv("FENCING_URL", str(tmp_path / "jobs.db"))
    assert doctor(capsys)[0] == 0


def test_the_console_script_runs_doctor(target: str, engine: Engine) -> None:
    engine.connect().close()  # a SQLite file exists
    done = subprocess.run(
        [str(SCRIPT), "doctor", "--url", target, "--json"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert {json.loads(line)["status"] for line in done.stdout.splitlines()} <= {"ok", "not applicable"}


# -- the store's check: one WARNING per engine, or a refusal ------------------------------------


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    return [
        {name: getattr(r, name) for name in ("database", "setting", "value", "risk", "advice")}
        for r in caplog.records
        if r.name == "fencing.durability" and r.levelno == logging.WARNING
    ]


@pytest.mark.backend("sqlite")
def test_the_store_logs_each_risk_once_per_engine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fencing.durability")
    engines = [fencing.create_sqlite_engine(tmp_path / "jobs.db", durability="normal") for _ in range(2)]
    try:
        for engine in engines:
            for _ in range(3):  # three meetings, on three connections at once
                with engine.connect() as a, engine.connect() as b:
                    assert note(engine, a.connection.dbapi_connection) is False
                    assert note(engine.execution_options(), b.connection.dbapi_connection) is False
        logged = warnings_of(caplog)
        assert len(logged) == 2  # one per engine
        assert logged[0] == logged[1]
        assert logged[0]["setting"] == "synchronous" and logged[0]["value"] == "normal (journal_mode wal)"
        assert "power loss" in logged[0]["risk"] and "synchronous = FULL" in logged[0]["advice"]
        safe = fencing.create_sqlite_engine(tmp_path / "safe.db")
        with safe.connect() as conn:
            assert note(safe, conn.connection.dbapi_connection) is True
        safe.dispose()
        assert len(warnings_of(caplog)) == 2
    finally:
        for engine in engines:
            engine.dispose()


@pytest.mark.backend("sqlite")
def test_a_strict_engine_is_refused_at_once_and_at_every_meeting(tmp_path: Path) -> None:
    engine = fencing.create_sqlite_engine(tmp_path / "jobs.db", durability="normal")
    try:
        with pytest.raises(ConfigurationError, match=r"synchronous = normal \(journal_mode wal\): the WAL"):
            require_durable(engine)
        for copy in (engine, engine.execution_options(), engine):
            with copy.connect() as conn, pytest.raises(ConfigurationError, match="synchronous"):
                note(copy, conn.connection.dbapi_connection)
        engine.dispose()  # a new pool: read again, and refused again
        with engine.connect() as conn, pytest.raises(ConfigurationError, match="synchronous"):
            note(engine, conn.connection.dbapi_connection)
    finally:
        engine.dispose()
    safe = fencing.create_sqlite_engine(tmp_path / "safe.db")
    try:
        require_durable(safe)
        with safe.connect() as conn:
            assert note(safe, conn.connection.dbapi_connection) is True
    finally:
        safe.dispose()


@pytest.mark.backend("postgresql")
def test_a_strict_engine_is_refused_for_a_session_setting(with_options: Callable[[str], Engine]) -> None:
    with pytest.raises(ConfigurationError, match="synchronous_commit = off"):
        require_durable(with_options("-c synchronous_commit=off"))
    require_durable(with_options("-c synchronous_commit=on"))


# -- private servers: what only a server-wide setting does ----------------------------------------


@pytest.fixture
def private() -> Iterator[Callable[..., private_servers.PrivateServer]]:
    """``private("postgresql", {"fsync": "off"})``: a started private server, closed after."""
    with contextlib.ExitStack() as stack:

        def start(kind: str, settings: dict[str, str] | None = None) -> private_servers.PrivateServer:
            return stack.enter_context(private_servers.private_server(kind, settings))

        yield start


def read(url: str) -> list[Finding]:
    engine = sqlalchemy.create_engine(url, poolclass=NullPool)
    try:
        return check_durability(engine)
    finally:
        engine.dispose()


def run_sql(url: str, *statements: str) -> None:
    engine = sqlalchemy.create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for statement in statements:
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


@pytest.mark.backend("postgresql")
def test_fsync_full_page_writes_and_synchronous_commit_off_on_a_private_postgresql(
    private: Callable[..., private_servers.PrivateServer], capsys: pytest.CaptureFixture[str]
) -> None:
    server = private("postgresql", {"fsync": "off", "full_page_writes": "off", "synchronous_commit": "off"})
    assert risks(read(server.url)) == {
        "fsync": "off",
        "full_page_writes": "off",
        "synchronous_commit": "off (synchronous_standby_names '')",
    }
    code, out, _ = doctor(capsys, "--url", server.url)
    assert code == 1
    assert [line.split()[:2] for line in out.splitlines()[1:-1]] == [
        ["RISK", "fsync"],
        ["RISK", "full_page_writes"],
        ["RISK", "synchronous_commit"],
        ["ok", "synchronous_standby_names"],
    ]
    assert out.splitlines()[-1] == (
        "3 setting(s) at risk (fsync, full_page_writes, synchronous_commit): exit code 1"
    )


@pytest.mark.backend("postgresql")
def test_standbys_are_a_risk_while_asynchronous_and_local_commits_while_synchronous(
    private: Callable[..., private_servers.PrivateServer],
) -> None:
    primary = private("postgresql")
    assert isinstance(primary, private_servers.PrivatePostgres)
    standby = primary.standby()
    try:
        standby.start()
        deadline = time.monotonic() + 30
        while risks(read(primary.url)) == {}:  # until the standby streams
            assert time.monotonic() < deadline, "the standby never streamed"
            time.sleep(0.05)
        assert risks(read(primary.url)) == {"synchronous_standby_names": "'' (1 standbys streaming)"}
        # named: synchronous, and safe; a session committing locally is not
        run_sql(
            primary.url, "ALTER SYSTEM SET synchronous_standby_names = 'standby'", "SELECT pg_reload_conf()"
        )
        deadline = time.monotonic() + 30
        while risks(read(primary.url)) != {}:
            assert time.monotonic() < deadline, "the standby never became synchronous"
            time.sleep(0.05)
        local = make_url(primary.url).update_query_dict({"options": "-c synchronous_commit=local"})
        assert risks(read(local.render_as_string(hide_password=False))) == {
            "synchronous_commit": "local (synchronous_standby_names 'standby')"
        }
    finally:
        standby.close()


@pytest.mark.backend("mysql", "mariadb")
def test_innodb_flushing_the_binary_log_and_the_doublewrite_buffer_on_a_private_mariadb(
    private: Callable[..., private_servers.PrivateServer], capsys: pytest.CaptureFixture[str]
) -> None:
    server = private(
        "mariadb",
        {
            "innodb-flush-log-at-trx-commit": "2",
            "innodb-doublewrite": "skip",
            "log-bin": "binlog",
            "sync-binlog": "0",
        },
    )
    assert risks(read(server.url)) == {
        "innodb_flush_log_at_trx_commit": "2",
        "sync_binlog": "0 (log_bin on)",
        "innodb_doublewrite": "off",
    }
    code, out, _ = doctor(capsys, "--url", server.url, "--json")
    assert code == 1
    shown = [json.loads(line) for line in out.splitlines()]
    assert [(f["setting"], f["status"]) for f in shown] == [
        ("innodb_flush_log_at_trx_commit", "risk"),
        ("sync_binlog", "risk"),
        ("innodb_doublewrite", "risk"),
    ]
    assert "power loss or an OS crash loses up to a second" in shown[0]["risk"]
    # the private server's own globals (never the shared one's)
    run_sql(server.url, "SET GLOBAL innodb_flush_log_at_trx_commit = 0")
    [flush] = [f for f in read(server.url) if f.setting == "innodb_flush_log_at_trx_commit"]
    assert flush.status == "risk" and "a crash of the server (or of its machine)" in flush.risk
    run_sql(server.url, "SET GLOBAL innodb_flush_log_at_trx_commit = 1", "SET GLOBAL sync_binlog = 1")
    assert risks(read(server.url)) == {"innodb_doublewrite": "off"}


@pytest.mark.backend("sqlite")
def test_a_private_server_without_its_binaries_skips_but_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing() -> Path:
        raise private_servers.ServerMissing("no pg_ctl")

    monkeypatch.setattr(private_servers, "_postgres_bin", missing)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="no private postgresql server: no pg_ctl"):
        private_servers.private_server("postgresql").__enter__()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI requires a private postgresql server"):
        private_servers.private_server("postgresql").__enter__()
