"""Checks of an installed fencing, as its user gets it: ``nox -s package`` runs this file with
the python of a new venv that has only the built wheel installed, from a directory outside
the checkout (a copy of this file, so nothing of the checkout is on ``sys.path``).

``python -I installed_check.py commands CHECKOUT``
    the ``fencing`` console script: ``--help``, ``--version``, every command's ``--help`` (the
    commands as the installed parser declares them), ``python -m fencing demo`` and a short
    ``fencing torture`` on a SQLite file;
``python -I installed_check.py modules CHECKOUT``
    every ``.py`` and ``py.typed`` of CHECKOUT/fencing is installed, and every module of the
    installed package imports (the extras they need installed first).

Both first check that ``fencing`` and ``service`` come from this venv's site-packages, not
from CHECKOUT. The standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from types import ModuleType

#: a short torture run on SQLite (the suite's tests/faults/test_torture.py runs the harness on
#: each database): the sync front, few workers, a seed fixed so a failure replays; about 10 s
#: on a loaded 2-core machine
TORTURE = ["--workers", "3", "--jobs", "120", "--seconds", "8", "--drain", "40", "--seed", "20261129"]
#: one command's longest run: the demo takes seconds, the torture run under a minute
TIMEOUT = 180


def fail(message: str) -> None:
    sys.exit(f"installed_check: FAILED: {message}")


def installed(module: ModuleType, checkout: Path) -> Path:
    """Where ``module`` was imported from, which must be this venv's site-packages."""
    where = Path(module.__file__ or "").resolve()
    site = {Path(sysconfig.get_path(name)).resolve() for name in ("purelib", "platlib")}
    if sys.prefix == sys.base_prefix:
        fail(f"not run in a venv: {sys.executable}")
    if not any(where.is_relative_to(s) for s in site) or where.is_relative_to(checkout):
        fail(f"{module.__name__} imported from {where}: not from this venv's site-packages {sorted(site)}")
    return where


def run(argv: list[str], cwd: Path, *, show: bool = False) -> str:
    """Run one command of the installed package from ``cwd``: its output, or fail."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    shown = " ".join(Path(a).name if a == argv[0] else a for a in argv)
    start = time.monotonic()
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    print(f"  {shown}: exit {proc.returncode} in {time.monotonic() - start:.1f} s", flush=True)
    if proc.returncode != 0:
        fail(f"{shown} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if show:
        print("".join(f"    {line}" for line in proc.stdout.splitlines(keepends=True)), flush=True)
    return proc.stdout


def commands(checkout: Path) -> None:
    import fencing
    from fencing.__main__ import build_parser

    print(f"fencing {metadata.version('fencing')} from {installed(fencing, checkout)}")
    scripts = Path(sysconfig.get_path("scripts"))
    script = str(scripts / ("fencing.exe" if os.name == "nt" else "fencing"))
    # the commands the installed parser declares (argparse keeps them in its subparsers action)
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    names = sorted({name for action in actions for name in action.choices})
    if not names:
        fail("the installed parser declares no command")
    print(f"commands: {', '.join(names)}")
    with tempfile.TemporaryDirectory(prefix="fencing-installed-") as scratch:
        cwd = Path(scratch)
        if "usage:" not in run([script, "--help"], cwd):
            fail("fencing --help printed no usage")
        version = run([script, "--version"], cwd).split()
        if version[-1:] != [metadata.version("fencing")]:
            fail(f"fencing --version printed {' '.join(version)!r}")
        # a process each (most of a second: the imports), two at a time
        with ThreadPoolExecutor(max_workers=2) as pool:
            helps = list(pool.map(lambda name: run([script, name, "--help"], cwd), names))
        for name, text in zip(names, helps, strict=True):
            if "usage:" not in text:
                fail(f"fencing {name} --help printed no usage")
        run([sys.executable, "-m", "fencing", "demo"], cwd, show=True)
        run([script, "torture", *TORTURE], cwd, show=True)


def modules(checkout: Path) -> None:
    import fencing
    import service

    package = installed(fencing, checkout).parent
    installed(service, checkout)
    # every module and marker file of the source tree was installed
    wanted = {
        p.relative_to(checkout / "fencing").as_posix()
        for p in (checkout / "fencing").rglob("*")
        if p.is_file() and (p.suffix == ".py" or p.name == "py.typed") and "__pycache__" not in p.parts
    }
    missing = sorted(f for f in wanted if not (package / f).is_file())
    if missing:
        fail(f"not installed: {', '.join(missing)}")
    # and every module of the installed package imports, from there
    errors: list[str] = []
    names = ["fencing"]
    walk = pkgutil.walk_packages(
        fencing.__path__, "fencing.", onerror=lambda n: errors.append(f"{n}: not walked")
    )
    names += [info.name for info in walk]
    for name in names:
        try:
            installed(importlib.import_module(name), checkout)
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    if errors:
        fail("modules that do not import:\n  " + "\n  ".join(errors))
    print(f"{len(names)} modules imported from {package}, and service from {Path(service.__file__).parent}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("check", choices=["commands", "modules"])
    parser.add_argument("checkout", type=Path, help="the source tree the wheel was built from")
    args = parser.parse_args()
    {"commands": commands, "modules": modules}[args.check](args.checkout.resolve())
    print(f"installed_check {args.check}: OK")


if __name__ == "__main__":
    main()
