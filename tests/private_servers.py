"""Database servers of a test's own: a private PostgreSQL or MariaDB on a temporary data
directory, a free port and a Unix socket in that directory, never the shared servers.

What the shared servers must not be made to do happens here: server-level settings that
trade durability for speed (``fsync=off``, ``innodb_flush_log_at_trx_commit=2``...), a
SIGKILL of the server itself, a restart. One class per server, the same calls:
``start()`` (initialises the data directory the first time), ``stop()`` (a clean shutdown),
``kill()`` (SIGKILL of the server and every process of it, as a crash of its machine would
leave it; ``start()`` again recovers), ``url`` (a SQLAlchemy URL over TCP), and ``close()``
(stopped, and the directory removed). Both run as their usual system user (``postgres``,
``mysql``), so the suite may run as root; the server is this process's child.

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
        """SIGKILL the server and every process of it, as a crash of its machine would."""
        pid = self.pid()
        if pid is not None:
            _kill_all(pid)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STARTUP)

    def close(self) -> None:
        """Stopped (killed if it will not stop), and its directory removed."""
        try:
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

    def standby(self, settings: Mapping[str, str] | None = None) -> PrivatePostgres:
        """A streaming standby of this (started) server, not started: ``pg_basebackup -R``
        into a directory of its own; ``primary_conninfo`` names it ``standby`` to the
        primary (its ``application_name``)."""
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
            f"host=127.0.0.1 port={self.port} user=postgres application_name=standby",
        )
        other._initialised = True
        return other

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
