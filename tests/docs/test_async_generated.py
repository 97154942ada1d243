"""The async fronts' forwarders are what ``tools/generate_async.py`` writes, and every public
method of the sync classes has its async twin.

The plain forwarders of :class:`~fencing.asyncio.AsyncJobStore`,
:class:`~fencing.asyncio.AsyncFenceMarks` and :class:`~fencing.asyncio.AsyncLocks` are
generated from the sync signatures. A sync method that changes, or a new one, fails the check
here until the script is run again (``python tools/generate_async.py``); a method the script
does not write is either written by hand on the async class or named sync-only, with the
reason, in the script's ``FRONTS``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import fencing
import fencing.asyncio
from fencing._runtime.execution import CallerConnection

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "generate_async.py"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_async", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


generate = load_generator()


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


# -- the blocks are the script's ---------------------------------------------------------------


def test_the_generated_blocks_are_what_the_script_writes() -> None:
    done = check("--check")
    assert done.returncode == 0, done.stdout + done.stderr
    source = generate.target().read_text(encoding="utf-8")
    assert generate.regenerate(source) == source


def test_the_check_fails_with_a_diff_on_drift_and_a_rewrite_restores_the_block(tmp_path: Path) -> None:
    source = generate.target().read_text(encoding="utf-8")
    right = "        return await run(self.sync_locks.release, lease, conn=caller_sync(conn))\n"
    wrong = "        return await run(self.sync_locks.release, lease, conn=conn)\n"
    assert source.count(right) == 1
    copy = tmp_path / "asyncio.py"
    copy.write_text(source.replace(right, wrong), encoding="utf-8")

    done = check("--check", str(copy))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"-{wrong}" in done.stdout and f"+{right}" in done.stdout
    assert "out of date: run python tools/generate_async.py" in done.stdout
    assert copy.read_text(encoding="utf-8") == source.replace(right, wrong)  # --check writes nothing

    done = check(str(copy))
    assert done.returncode == 0, done.stdout + done.stderr
    assert copy.read_text(encoding="utf-8") == source


def test_the_script_writes_at_ruffs_line_length() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    ruff = pyproject.partition("[tool.ruff]")[2]
    found = re.search(r"^line-length = (\d+)$", ruff, re.M)
    assert found is not None
    assert int(found[1]) == generate.LINE_LENGTH


# -- what the script writes, and what it refuses -----------------------------------------------


class Grown(fencing.JobStore):
    """A sync store with more public methods, as a new operation would come."""

    def touch(
        self, job_id: str, *, deadline: float | None = None, conn: CallerConnection | None = None
    ) -> bool:
        raise NotImplementedError  # read, never run

    def stamped(self, job_id: str, *, at: Callable[[], float]) -> float:
        raise NotImplementedError  # Callable: fencing/asyncio.py imports it from collections.abc


class Stranger(fencing.JobStore):
    def weigh(self, job_id: str) -> ModuleType:  # not a name fencing/asyncio.py imports
        raise NotImplementedError


def store_read_from(monkeypatch: pytest.MonkeyPatch, cls: type, **front: Any) -> None:
    """Make the script read ``cls`` for AsyncJobStore, that front changed by ``front``."""
    fronts = tuple(
        dataclasses.replace(f, **front) if f.name == "AsyncJobStore" else f for f in generate.FRONTS
    )
    monkeypatch.setattr(generate, "FRONTS", fronts)
    sync_class = generate.sync_class
    monkeypatch.setattr(generate, "sync_class", lambda f: cls if f.sync == "JobStore" else sync_class(f))


def test_a_new_sync_method_gets_its_forwarder(monkeypatch: pytest.MonkeyPatch) -> None:
    source = generate.target().read_text(encoding="utf-8")
    store_read_from(monkeypatch, Grown)
    written = generate.regenerate(source)
    touch = (
        "    async def touch(\n"
        "        self, job_id: str, *, deadline: float | None = None, "
        "conn: AsyncCallerConnection | None = None\n"
        "    ) -> bool:\n"
        '        """:meth:`fencing.JobStore.touch` as a coroutine."""\n'
        "        return await run(self.sync_store.touch, job_id, deadline=deadline, conn=caller_sync(conn))\n"
    )
    stamped = (
        "    async def stamped(self, job_id: str, *, at: Callable[[], float]) -> float:\n"
        '        """:meth:`fencing.JobStore.stamped` as a coroutine."""\n'
        "        return await run(self.sync_store.stamped, job_id, at=at)\n"
    )
    assert touch in written and stamped in written
    # nothing else changed
    assert written.replace(touch + "\n", "").replace(stamped + "\n", "") == source
    assert generate.regenerate(written) == written


def test_a_name_fencing_asyncio_does_not_import_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    source = generate.target().read_text(encoding="utf-8")
    store_read_from(monkeypatch, Stranger)
    said = (
        f"fencing.JobStore.weigh uses 'ModuleType', which fencing/asyncio.py does not import: "
        f"import it there as {__name__} does"
    )
    with pytest.raises(generate.GenerationError, match=f"^{re.escape(said)}$"):
        generate.regenerate(source)


def test_a_stale_name_in_the_lists_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    source = generate.target().read_text(encoding="utf-8")
    store_read_from(monkeypatch, fencing.JobStore, sync_only={"check_key": "", "vanished": ""})
    with pytest.raises(generate.GenerationError, match=r"^AsyncJobStore: vanished named in FRONTS, but"):
        generate.regenerate(source)


def test_a_forwarder_also_written_by_hand_is_refused() -> None:
    source = generate.target().read_text(encoding="utf-8")
    end = "    # END GENERATED AsyncFenceMarks\n"
    by_hand = end + "\n    async def highest(self, resource: str) -> int | None:\n        return None\n"
    with pytest.raises(generate.GenerationError, match=r"^AsyncFenceMarks defines highest by hand"):
        generate.regenerate(source.replace(end, by_hand))


def test_a_block_outside_its_class_is_refused() -> None:
    source = generate.target().read_text(encoding="utf-8")
    marks = re.search(
        r"    # START GENERATED AsyncFenceMarks\n.*?# END GENERATED AsyncFenceMarks\n", source, re.S
    )
    assert marks is not None
    store_end = "    # END GENERATED AsyncJobStore\n"
    moved = source.replace(marks[0], "").replace(store_end, store_end + "\n" + marks[0])
    with pytest.raises(
        generate.GenerationError, match=r"^the generated block of AsyncFenceMarks is not inside"
    ):
        generate.regenerate(moved)


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("    # END GENERATED AsyncLocks\n", "", "not one of a pair"),
        ("    # START GENERATED AsyncLocks\n", "    # START GENERATED AsyncLock\n", "not one of a pair"),
        ("GENERATED AsyncLocks\n", "GENERATED Locks\n", "a generated block for Locks, not in FRONTS"),
        ("GENERATED AsyncLocks\n", "\n", "has no generated block for AsyncLocks"),
    ],
)
def test_broken_markers_are_refused_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, said: str
) -> None:
    source = generate.target().read_text(encoding="utf-8")
    assert old in source
    broken = source.replace(old, new)
    copy = tmp_path / "asyncio.py"
    copy.write_text(broken, encoding="utf-8")
    for args in (["--check"], []):
        assert generate.main([*args, str(copy)]) == 2
        assert said in capsys.readouterr().err
        assert copy.read_text(encoding="utf-8") == broken


# -- every sync method has its twin ------------------------------------------------------------


def context_manager(fn: Callable[..., Any], *, kind: str) -> bool:
    """Whether ``fn`` returns a context manager (``kind``: ``""`` or ``"Async"``): made with
    ``contextmanager`` or ``asynccontextmanager``, or annotated so."""
    made = inspect.unwrap(fn)
    if inspect.isgeneratorfunction(made) if not kind else inspect.isasyncgenfunction(made):
        return True
    return str(inspect.signature(fn).return_annotation).startswith(f"contextlib.Abstract{kind}ContextManager")


def shape(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """A signature's parameters as a caller sees them: names, kinds and defaults."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("front", generate.FRONTS, ids=lambda front: front.name)
def test_every_public_method_of_the_sync_class_has_an_async_twin(front: Any) -> None:
    sync_class = getattr(fencing, front.sync)
    async_class = getattr(fencing.asyncio, front.name)
    methods = generate.public_methods(sync_class)
    assert methods, front.sync
    for name, fn in methods.items():
        where = f"{front.name}.{name}"
        if name in front.sync_only:
            assert not hasattr(async_class, name), f"{where} exists: take {name} out of sync_only"
            continue
        twin = getattr(async_class, name, None)
        assert twin is not None, f"{where} is missing: run python tools/generate_async.py"
        if context_manager(fn, kind=""):
            assert context_manager(twin, kind="Async"), f"{where} is not an async context manager"
        else:
            assert inspect.iscoroutinefunction(twin), f"{where} is not a coroutine function"
        assert shape(twin) == shape(fn), where


@pytest.mark.parametrize("front", generate.FRONTS, ids=lambda front: front.name)
def test_every_public_property_of_the_sync_class_is_one_of_the_async_class(front: Any) -> None:
    sync_class = getattr(fencing, front.sync)
    async_class = getattr(fencing.asyncio, front.name)
    properties = [
        name
        for name in dir(sync_class)
        if not name.startswith("_") and isinstance(inspect.getattr_static(sync_class, name), property)
    ]
    assert "metrics" in properties
    for name in properties:
        assert isinstance(inspect.getattr_static(async_class, name, None), property), f"{front.name}.{name}"


def test_the_hand_written_twins_are_outside_the_blocks_and_the_rest_inside() -> None:
    source = generate.target().read_text(encoding="utf-8")
    for front, match in generate.blocks(source):
        by_hand = generate.written_by_hand(source, front, match)
        assert set(front.hand_written) <= by_hand, front.name
        inside = set(re.findall(r"^    async def (\w+)\(", match[0], re.M))
        assert inside == set(generate.forwarded(front)), front.name
