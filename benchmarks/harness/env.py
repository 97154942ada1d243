"""What a run measured with: the versions, the machine, the commit, a server's settings."""

from __future__ import annotations

import os
import platform
import sqlite3
import subprocess
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import Engine

import fencing

#: the repository the benchmarks measure (``service.py`` and ``fencing/`` are there)
ROOT = Path(__file__).resolve().parents[2]


def git_describe(dirty: str = "-dirty") -> str | None:
    """The commit measured, with ``dirty`` appended when the working tree differs from it;
    ``None`` when git cannot tell (not installed, not a checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", f"--dirty={dirty}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


#: what :func:`versions` knows by name, besides installed distributions
FIELDS: dict[str, Callable[[], str]] = {
    "fencing": lambda: fencing.__version__,
    "sqlite": lambda: sqlite3.sqlite_version,
    "sqlalchemy": lambda: sqlalchemy.__version__,
    "python": platform.python_version,
    "platform": platform.platform,
    "cpus": lambda: str(os.cpu_count()),
    "git": lambda: git_describe() or "unknown",
}


def versions(*names: str, missing: str = "raise") -> dict[str, str]:
    """``names`` in the order given: each one of :data:`FIELDS` or an installed
    distribution (its key lowercased, e.g. ``PyMySQL`` -> ``pymysql``). A distribution that
    is not installed raises (``missing="raise"``), is left out (``"omit"``) or shows as
    ``missing`` itself (e.g. ``"not installed"``)."""
    env: dict[str, str] = {}
    for name in names:
        if name in FIELDS:
            env[name] = FIELDS[name]()
            continue
        try:
            env[name.lower()] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if missing == "raise":
                raise
            if missing != "omit":
                env[name.lower()] = missing
    return env


def server_settings(
    engine: Engine, *, postgresql: Iterable[str] = (), mariadb: Iterable[str] = ()
) -> dict[str, Any]:
    """The server's version and what decides its durability: PostgreSQL's
    ``synchronous_commit`` and ``fsync``, MariaDB's ``innodb_flush_log_at_trx_commit`` (as an
    int); then the other settings named for that server (MariaDB's as ints too)."""
    with engine.connect() as conn:
        run = conn.exec_driver_sql
        if engine.dialect.name == "postgresql":
            names = ("synchronous_commit", "fsync", *postgresql)
            return {
                "version": run("SHOW server_version").scalar(),
                **{n: run(f"SHOW {n}").scalar() for n in names},
            }
        names = ("innodb_flush_log_at_trx_commit", *mariadb)
        version, *values = run("SELECT VERSION(), " + ", ".join(f"@@{n}" for n in names)).one()
        return {"version": version, **{n: int(v) for n, v in zip(names, values, strict=True)}}
