"""Database servers of a test's own: a private PostgreSQL or MariaDB on a temporary data
directory, a free port and a Unix socket in that directory, never the shared servers.

What the shared servers must not be made to do happens here: server-level settings that
trade durability for speed (``fsync=off``, ``innodb_flush_log_at_trx_commit=2``...), a
SIGKILL of the server itself, a restart. One class per server, the same calls:
``start()`` (initialises the data directory the first time), ``stop()`` (a clean shutdown),
``kill()`` (SIGKILL of the server and every process of it, as a crash of its machine would
leave it; ``start()`` again recovers), ``freeze()``/``thaw()`` (SIGSTOP/SIGCONT of every
process of it: a server, or a standby, that hangs with its connections open), ``url`` (a
SQLAlchemy URL over TCP), and ``close()`` (stopped, and the directory removed). Both run as
their usual system user (``postgres``, ``mysql``), so the suite may run as root; the server
is this process's child.

For failover, a PostgreSQL server makes a streaming ``standby()`` of itself, waits for it
(:meth:`PrivatePostgres.wait_for_standby`: streaming, synchronous, caught up), changes its
own settings (:meth:`PrivatePostgres.alter_system`) and is promoted
(:meth:`PrivatePostgres.promote`); :func:`multi_host_url` reaches whichever of several
servers takes writes.

:func:`private_server` is the fixture's helper: it starts one, or skips when the binaries
are missing, except under ``CI=true``, where a missing binary fails the test (as a missing
shared server does, :mod:`tests.backends`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import Row

#: how long a server may take to start or stop
STARTUP = 60.0


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerMissing(RuntimeError):
    """A binary the server needs is not installed here."""


def _as_user(user: str, cwd: Path) -> dict[str, Any]:
    """``subprocess`` keywords that run a command as ``user`` (when this process is root)
    in ``cwd``."""
    if os.geteuid() != 0:
        return {"cwd": cwd}
    return {"cwd": cwd, "user": user, "group": user, "extra_groups": []}


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(stat).read_text()
            ppid = int(text.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is dead
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _kill_all(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants, and wait until none is left."""
    doomed = [pid, *_children(pid)]
    for p in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + STARTUP
    while any(_alive(p) for p in doomed):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {doomed} outlived SIGKILL")
        time.sleep(0.02)


class PrivateServer:
    """What both servers share: a temporary directory owned by the server's user, a port."""

    #: the system user the server runs as
    user = ""

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        #: server settings, by name (PostgreSQL's ``-c name=value``, MariaDB's ``--name=value``)
        self.settings = dict(settings or {})
        self.root = Path(tempfile.mkdtemp(prefix=f"fencing-private-{type(self).__name__.lower()}-"))
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._initialised = False
        #: SIGSTOPped by freeze(), until thaw() (or a kill)
        self.frozen = False
        if os.geteuid() == 0:
            shutil.chown(self.root, self.user, self.user)

    @property
    def url(self) -> str:
        raise NotImplementedError

    def pid(self) -> int | None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the server and every process of it, as a crash of its machine would
        (a frozen server too: what sat unread in its sockets is gone with it)."""
        pid = self.pid()
        if pid is not None:
            _kill_all(pid)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STARTUP)
        self.frozen = False

    def freeze(self) -> None:
        """SIGSTOP the server and every process of it: it keeps its connections and sockets
        open but reads, writes and answers nothing (a hung machine, a stalled network), until
        :meth:`thaw` or :meth:`kill`."""
        pid = self.pid()
        if pid is None:
            raise RuntimeError(f"{type(self).__name__} is not running")
        os.kill(pid, signal.SIGSTOP)  # first, so it starts no process that would escape the stop
        for p in _children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT what :meth:`freeze` stopped: it goes on where it was."""
        pid = self.pid()
        if pid is not None:
            for p in [pid, *_children(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)
        self.frozen = False

    def close(self) -> None:
        """Stopped (killed if it will not stop, or is frozen), and its directory removed."""
        try:
            if self.frozen:
                self.kill()
            if self.pid() is not None:
                try:
                    self.stop()
                except Exception:
                    self.kill()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _wait_until_answering(self) -> None:
        engine = sqlalchemy.create_engine(self.url, poolclass=sqlalchemy.pool.NullPool)
        deadline = time.monotonic() + STARTUP
        try:
            while True:
                try:
                    with engine.connect():
                        return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    if self.process is not None and self.process.poll() is not None:
                        raise RuntimeError(f"{type(self).__name__} exited: {self.log()}") from None
                    time.sleep(0.1)
        finally:
            engine.dispose()

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def _postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl is None:
        raise ServerMissing("no pg_ctl (/usr/lib/postgresql/*/bin or PATH): install PostgreSQL's server")
    return Path(pg_ctl).parent


class PrivatePostgres(PrivateServer):
    """A PostgreSQL cluster of its own: ``initdb`` (trust authentication), then the
    postmaster on 127.0.0.1:``port``, its socket in the directory, ``settings`` as ``-c``."""

    user = "postgres"

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.bin = _postgres_bin()
        super().__init__(settings)
        self.data = self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def pid(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None
        return self.process.pid

    def _run(self, *argv: str) -> None:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=STARTUP, **_as_user(self.user, self.root)
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stdout}{done.stderr}\n{self.log()}")

    def start(self) -> None:
        if not self._initialised:
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-N")
            self._initialised = True
        options = {
            "port": str(self.port),
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.root),
            **self.settings,
        }
        flags = [f"--{name}={value}" for name, value in options.items()]
        with open(self.root / "server.log", "ab") as log:
            # the postmaster is this process's child, reaped here when it is killed (where
            # PID 1 reaps no orphan, a zombie postmaster would block the next start)
            self.process = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), *flags],
                stdout=log,
                stderr=log,
                start_new_session=True,
                **_as_user(self.user, self.root),
            )
        self._wait_until_answering()

    def standby(self, settings: Mapping[str, str] | None = None, *, name: str = "standby") -> PrivatePostgres:
        """A streaming standby of this (started) server, not started: ``pg_basebackup -R``
        into a directory of its own; ``primary_conninfo`` names it ``name`` to the primary
        (its ``application_name``, what ``synchronous_standby_names`` lists). The settings
        this server has now (its ``postgresql.auto.conf``) are the standby's too: name it
        in ``synchronous_standby_names`` after this, or once promoted it waits for itself."""
        other = PrivatePostgres(settings)
        self._run(
            str(self.bin / "pg_basebackup"),
            "-D",
            str(other.data),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-R",
            "-X",
            "stream",
            "-d",
            f"host=127.0.0.1 port={self.port} user=postgres application_name={name}",
        )
        other._initialised = True
        return other

    def execute(self, *statements: str) -> list[Row[Any]]:
        """Run ``statements`` on this server (autocommit, a connection of their own): the
        rows of the last one (none for a statement that returns none)."""
        engine = sqlalchemy.create_engine(
            self.url, poolclass=sqlalchemy.pool.NullPool, isolation_level="AUTOCOMMIT"
        )
        try:
            with engine.connect() as conn:
                rows: list[Row[Any]] = []
                for statement in statements:
                    result = conn.exec_driver_sql(statement)
                    rows = list(result) if result.returns_rows else []
                return rows
        finally:
            engine.dispose()

    def alter_system(self, settings: Mapping[str, str]) -> None:
        """``ALTER SYSTEM SET`` each setting, then reload: for settings a reload applies
        (``synchronous_standby_names``, ``synchronous_commit``...). Kept in this server's
        ``postgresql.auto.conf``, so a standby made after this has them too."""
        self.execute(
            *(f"ALTER SYSTEM SET {name} = '{value}'" for name, value in settings.items()),
            "SELECT pg_reload_conf()",
        )

    def wait_for_standby(
        self, name: str = "standby", *, sync: bool = False, caught_up: bool = False, timeout: float = 30.0
    ) -> None:
        """Return once the standby ``name`` streams from this server: with ``sync``, as
        its synchronous standby; with ``caught_up``, having replayed everything written here
        so far (what this server has committed is on the standby, readable)."""
        deadline = time.monotonic() + timeout
        while True:
            [row] = self.execute(
                "SELECT count(*) FILTER (WHERE state = 'streaming'), "
                "count(*) FILTER (WHERE sync_state = 'sync'), "
                "count(*) FILTER (WHERE replay_lsn >= pg_current_wal_lsn()) "
                f"FROM pg_stat_replication WHERE application_name = '{name}'"
            )
            streaming, synchronous, replayed = tuple(row)
            if streaming and (synchronous or not sync) and (replayed or not caught_up):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"standby {name!r}: streaming {streaming}, sync {synchronous}, caught up "
                    f"{replayed} after {timeout} s\n{self.log()}"
                )
            time.sleep(0.02)

    def in_recovery(self) -> bool:
        """Whether this server is a standby (in recovery), as it says itself."""
        [(recovering,)] = self.execute("SELECT pg_is_in_recovery()")
        return bool(recovering)

    def promote(self) -> None:
        """Promote this standby to a primary (``pg_ctl promote``), and return once it
        takes writes: it replays the WAL it has, leaves recovery, and starts a new
        timeline."""
        self._run(str(self.bin / "pg_ctl"), "promote", "-w", "-t", str(int(STARTUP)), "-D", str(self.data))
        deadline = time.monotonic() + STARTUP
        while self.in_recovery():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the standby was not promoted\n{self.log()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """A fast shutdown (SIGINT): sessions are ended, the data is checkpointed."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=STARTUP)
        except subprocess.TimeoutExpired:
            self.kill()


def _mariadb_bins() -> tuple[str, str]:
    server = shutil.which("mariadbd") or shutil.which("mariadbd", path="/usr/sbin:/usr/local/sbin")
    install = shutil.which("mariadb-install-db")
    if server is None or install is None:
        raise ServerMissing("no mariadbd or mariadb-install-db: install MariaDB's server")
    return server, install


class PrivateMariaDB(PrivateServer):
    """A MariaDB server of its own: ``mariadb-install-db`` (root without a password), then
    ``mariadbd`` on 127.0.0.1:``port``, its socket in the directory, ``settings`` as
    ``--name=value`` (``--skip-NAME`` for a value of ``"skip"``)."""

    user = "mysql"

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.server, self.install = _mariadb_bins()
        super().__init__(settings)
        self.data = self.root / "data"

    @property
    def url(self) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/mysql"

    def pid(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None
        return self.process.pid

    def _flags(self) -> list[str]:
        return [
            "--no-defaults",
            f"--datadir={self.data}",
            f"--user={self.user}",
        ]

    def start(self) -> None:
        if not self._initialised:
            done = subprocess.run(
                [
                    self.install,
                    *self._flags(),
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    "--skip-name-resolve",
                ],
                capture_output=True,
                text=True,
                timeout=STARTUP * 2,
            )
            if done.returncode != 0:
                raise RuntimeError(f"mariadb-install-db: {done.stdout}{done.stderr}")
            self._initialised = True
        settings = [
            f"--skip-{name}" if value == "skip" else f"--{name}={value}"
            for name, value in self.settings.items()
        ]
        argv = [
            self.server,
            *self._flags(),
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.root / 'mariadb.sock'}",
            f"--pid-file={self.root / 'mariadb.pid'}",
            f"--log-error={self.root / 'server.log'}",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=32M",
            *settings,
        ]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=self.root
        )
        self._wait_until_answering()

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STARTUP)
        except subprocess.TimeoutExpired:
            self.kill()


def multi_host_url(*servers: PrivatePostgres, target_session_attrs: str = "read-write") -> str:
    """One SQLAlchemy URL for several PostgreSQL servers (psycopg): libpq tries them in
    order and keeps the first whose session is ``target_session_attrs`` (``read-write``:
    the primary, whichever it is now). SQLAlchemy's form for several hosts is one ``host``
    query parameter each, ``host:port``."""
    hosts = "&".join(f"host=127.0.0.1:{server.port}" for server in servers)
    return f"postgresql+psycopg://postgres@/postgres?{hosts}&target_session_attrs={target_session_attrs}"


SERVERS: Mapping[str, type[PrivateServer]] = {"postgresql": PrivatePostgres, "mariadb": PrivateMariaDB}


@contextlib.contextmanager
def private_server(kind: str, settings: Mapping[str, str] | None = None) -> Iterator[PrivateServer]:
    """A started private ``kind`` server (``"postgresql"`` or ``"mariadb"``), closed after.
    Binaries missing: a skip that says what to install, or under ``CI=true`` a failure."""
    try:
        server = SERVERS[kind](settings)
    except ServerMissing as exc:
        if in_ci():
            pytest.fail(f"CI requires a private {kind} server: {exc}", pytrace=False)
        pytest.skip(f"no private {kind} server: {exc}")
    try:
        server.start()
        yield server
    finally:
        server.close()
