"""The public surface: each public module is the real home of its code, each public object has
one public name, and nothing shadows a module.

The public modules are ``fencing`` (the package's ``__all__``), ``fencing.asyncio``,
``fencing.overview``, ``fencing.otel``, ``fencing.durability``, ``fencing.web`` and
``fencing.cli``; everything else lives in private packages (``fencing._store``,
``fencing._runtime``, ``fencing._sql``) and private modules. ``lint-imports``
(``nox -s lint``) checks the layers themselves.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest

import fencing
import fencing.asyncio
from fencing.torture.config import TortureConfig

PUBLIC = (
    "fencing",
    "fencing.asyncio",
    "fencing.overview",
    "fencing.otel",
    "fencing.durability",
    "fencing.web",
    "fencing.cli",
)

#: the names the library documents, by public module (what the API reference lists, whole)
SURFACE = sum(len(importlib.import_module(m).__all__) for m in PUBLIC)


def test_every_public_name_is_importable_and_there_are_no_more_than_the_reference_lists() -> None:
    for module in PUBLIC:
        shown = importlib.import_module(module)
        for name in shown.__all__:
            assert getattr(shown, name) is not None, f"{module}.{name}"
    # issue 37's aim: about 70; 76 with the worker runtime's view of its busy workers (Holder),
    # 79 with schedules (Schedule, Scheduler, schedules_table)
    assert SURFACE <= 79, SURFACE


def test_each_public_object_has_one_public_name() -> None:
    seen: dict[int, str] = {}
    for module in PUBLIC:
        shown = importlib.import_module(module)
        for name in shown.__all__:
            value = getattr(shown, name)
            if isinstance(value, (str, int, float, tuple, frozenset)) or value is None:
                continue  # a constant is a value, not an object with a home
            where = f"{module}.{name}"
            assert id(value) not in seen, f"{where} is also {seen[id(value)]}"
            seen[id(value)] = where


def test_the_api_reference_lists_every_public_name() -> None:
    pages = pathlib.Path(__file__).parents[2] / "docs" / "reference"
    shown = {
        line.split()[1]
        for page in pages.glob("*.md")
        for line in page.read_text().splitlines()
        if line.startswith("::: ")
    }
    missing = [
        f"{module}.{name}"
        for module in PUBLIC
        for name in importlib.import_module(module).__all__
        if f"{module}.{name}" not in shown
    ]
    assert not missing, missing


@pytest.mark.parametrize(
    "gone", ["sqlite", "schema", "checks", "refusals", "store", "locks", "core", "tools", "errors"]
)
def test_the_old_paths_are_gone_and_shadow_nothing(gone: str) -> None:
    # the package once exported the default locks Table as fencing.locks, which hid a
    # subpackage; the layers' paths and their re-export modules went with issue 37
    code = (
        f"import fencing, importlib\nprint(hasattr(fencing, {gone!r}))\n"
        f"importlib.import_module('fencing.{gone}')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False"], done.stdout
    assert "ModuleNotFoundError: No module named 'fencing." + gone + "'" in done.stderr


def test_the_documented_replacements_of_moved_names() -> None:
    from fencing._runtime import refusals, sqlite
    from fencing._sql import checks, schema

    assert fencing.create_sqlite_engine is sqlite.create_engine
    assert fencing.configure_sqlite is sqlite.configure
    assert fencing.asyncio.create_sqlite_engine is sqlite.create_async_engine
    assert fencing.as_text is schema.as_text
    assert fencing.DATABASE_CLOCK_MIN_TTL == checks.DATABASE_CLOCK_MIN_TTL
    assert fencing.REASONS is refusals.REASONS
    assert fencing.Refusal is refusals.Refusal


@pytest.mark.parametrize(
    ("logger", "module"),
    [
        ("fencing.store", "fencing._store.leases"),
        ("fencing.store", "fencing._store.fenced"),
        ("fencing.store", "fencing._store.context"),
        ("fencing.heartbeat", "fencing._store.rules"),
        ("fencing.refused", "fencing._runtime.refusals"),
    ],
)
def test_the_loggers_keep_the_names_operators_filter_on(logger: str, module: str) -> None:
    assert importlib.import_module(module).logger.name == logger


HARNESS = ("controller", "worker", "verdict", "fronts", "report", "journal", "connect")


@pytest.mark.parametrize("argv", [["--help"], ["jobs", "--help"], ["torture", "--help"]])
def test_the_command_loads_the_torture_harness_only_when_torture_runs(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from fencing.cli.commands import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('fencing.torture.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout.strip().splitlines()[-1])
    assert loaded == ["fencing.torture.config"], loaded
    assert not any(m.endswith(HARNESS) for m in loaded)


def test_the_torture_commands_defaults_are_the_harness_own() -> None:
    from fencing.cli.commands import build_parser

    args = build_parser().parse_args(["torture"])
    defaults = TortureConfig(url="-")
    for field in ("workers", "jobs", "seconds", "ttl", "work", "finish", "batch", "fault_every"):
        assert getattr(args, field) == getattr(defaults, field), field
    for field in ("check_heartbeat", "release_rate", "drain", "prefix", "front"):
        assert getattr(args, field) == getattr(defaults, field), field
    assert args.faults.split(",") == list(defaults.faults)


def test_a_name_taken_out_of_the_surface_still_works_and_says_what_replaces_it() -> None:
    said = r"fencing\.metadata is deprecated: use fencing\.jobs\.metadata"
    with pytest.warns(DeprecationWarning, match=said):
        kept = fencing.metadata  # type: ignore[attr-defined]
    assert kept is fencing.jobs.metadata
    assert "metadata" not in fencing.__all__
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        fencing.no_such_name  # type: ignore[attr-defined]  # noqa: B018
