"""The layout behind the public paths: what users import still is what the library runs.

The code lives in layers (``fencing/core``, ``sql``, ``engine``, ...; "The layers of the
house" in docs/explanation/design.md); the paths users import from are re-exports over them, and must stay
the very same objects, so a re-export that went stale or a monkeypatch-visible copy fails
here. ``lint-imports`` (``nox -s lint``) checks the layers themselves.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import fencing
from fencing.tools.torture.config import TortureConfig

#: public module -> the module whose code it re-exports
PUBLIC = {
    "fencing.sqlite": "fencing.engine.sqlite",
    "fencing.asyncio": "fencing.fronts.asyncio",
    "fencing.otel": "fencing.observe.otel",
    "fencing.schema": "fencing.sql.schema",
    "fencing.checks": "fencing.core.checks",
    "fencing.refusals": "fencing.observe.refusals",
    "fencing.overview": "fencing.views.overview",
    "fencing.cli": "fencing.tools.cli",
    "fencing.durability": "fencing.engine.durability",
}


@pytest.mark.parametrize(("public", "home"), PUBLIC.items(), ids=list(PUBLIC))
def test_a_public_module_re_exports_its_layers_module_whole(public: str, home: str) -> None:
    shown, real = importlib.import_module(public), importlib.import_module(home)
    assert shown.__all__ == real.__all__, f"{public}.__all__ differs from {home}.__all__"
    for name in real.__all__:
        assert getattr(shown, name) is getattr(real, name), f"{public}.{name} is not {home}.{name}"


def test_every_name_of_the_package_is_importable_and_documented_in_all() -> None:
    for name in fencing.__all__:
        assert getattr(fencing, name) is not None, name
    # the store's old import path keeps working
    from fencing.store import JobStore

    assert JobStore is fencing.JobStore


def test_the_locks_subpackage_is_reached_through_the_package() -> None:
    # the package once exported the default locks Table as fencing.locks, which hid the
    # subpackage: fencing.locks.named raised AttributeError (fencing.locks_table() makes the table)
    assert "locks" not in fencing.__all__
    assert fencing.locks is sys.modules["fencing.locks"]
    code = (
        "import fencing\n"
        "print(fencing.locks.named.Locks is fencing.Locks,"
        " fencing.locks.election.Election is fencing.Election)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


@pytest.mark.parametrize(
    ("logger", "module"),
    [
        ("fencing.store", "fencing.store.leases"),
        ("fencing.store", "fencing.store.fenced"),
        ("fencing.store", "fencing.store.context"),
        ("fencing.heartbeat", "fencing.lease.rules"),
        ("fencing.refused", "fencing.observe.refusals"),
    ],
)
def test_the_loggers_keep_the_names_operators_filter_on(logger: str, module: str) -> None:
    assert importlib.import_module(module).logger.name == logger


HARNESS = ("controller", "worker", "verdict", "fronts", "report", "journal", "connect")


@pytest.mark.parametrize("argv", [["--help"], ["jobs", "--help"], ["torture", "--help"]])
def test_the_command_loads_the_torture_harness_only_when_torture_runs(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from fencing.tools.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('fencing.tools.torture.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout.strip().splitlines()[-1])
    assert loaded == ["fencing.tools.torture.config"], loaded
    assert not any(m.endswith(HARNESS) for m in loaded)


def test_the_torture_commands_defaults_are_the_harness_own() -> None:
    from fencing.tools.cli import build_parser

    args = build_parser().parse_args(["torture"])
    defaults = TortureConfig(url="-")
    for field in ("workers", "jobs", "seconds", "ttl", "work", "finish", "batch", "fault_every"):
        assert getattr(args, field) == getattr(defaults, field), field
    for field in ("check_heartbeat", "release_rate", "drain", "prefix", "front"):
        assert getattr(args, field) == getattr(defaults, field), field
    assert args.faults.split(",") == list(defaults.faults)
