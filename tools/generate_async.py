"""Write the async fronts' plain forwarders from the sync classes' signatures.

``fencing/asyncio.py``'s :class:`AsyncJobStore`, :class:`AsyncFenceMarks` and
:class:`AsyncLocks` run the sync rules through the bridge; most of their methods only carry a
call across (``await run(self.sync_store.renew, lease, ttl=ttl, ..., conn=caller_sync(conn))``).
Those methods are written by this script, in the manner of SQLAlchemy's
``tools/generate_proxy_methods.py``: each async class holds one block between the comments
``# START GENERATED <class>`` and ``# END GENERATED <class>``, and the script rewrites it from
the sync class (:class:`fencing.JobStore` and its parts, :class:`fencing.FenceMarks`,
:class:`fencing.Locks`), read with :func:`inspect.signature`. Every public method of the sync
class gets an ``async def`` there with the sync parameters, annotations and defaults as
written (``conn`` retyped ``AsyncCallerConnection | None`` and passed through
``caller_sync``), the return type kept, and a one-line docstring that points to the sync
method, whose docstring holds the rules (its examples are sync code, and its prose changes
without touching this file). The methods that do more than forward are written by hand,
outside the blocks, and named in :data:`FRONTS` with the reason; so are the sync-only ones.

``python tools/generate_async.py`` rewrites the blocks; ``--check`` changes nothing and exits 1
with a diff when they differ from what it would write (``tests/docs/test_async_generated.py``
runs it). The code is written the way ``ruff format`` lays it out, so no formatter is needed
to check it (the test sessions have none); when ``ruff`` is on hand, a rewrite confirms that
``ruff format`` leaves the blocks as written. Standard library only, besides the package.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import importlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: ``[tool.ruff] line-length`` in pyproject.toml (a test keeps the two equal)
LINE_LENGTH = 110
INDENT = "    "

#: a block: its first line names the class; the script owns every line up to its end marker
BLOCK = re.compile(
    r"^(?P<indent>[ ]*)# START GENERATED (?P<cls>\w+)\n.*?^(?P=indent)# END GENERATED (?P=cls)\n",
    re.M | re.S,
)
MARKER = re.compile(r"^[ ]*# (?:START|END) GENERATED\b.*$", re.M)


@dataclass(frozen=True)
class Front:
    """An async class of ``fencing/asyncio.py`` and the sync class whose methods it forwards."""

    #: the async class
    name: str
    #: the sync class, by its name in ``fencing``
    sync: str
    #: the async object's attribute that holds the sync one
    via: str
    #: public methods of the sync class written by hand on the async class, and why
    hand_written: dict[str, str] = field(default_factory=dict)
    #: public methods of the sync class with no coroutine twin, and why
    sync_only: dict[str, str] = field(default_factory=dict)


#: why a claim is written by hand: what it took for a cancelled caller is released
#: (``_give_back``, ``_give_one``)
GIVES_BACK = "gives back what it took for a caller cancelled meanwhile (run(..., give_back=...))"

FRONTS = (
    Front(
        "AsyncJobStore",
        "JobStore",
        "sync_store",
        hand_written={
            "claim": GIVES_BACK,
            "claim_next": GIVES_BACK,
            "complete_and_claim_next": GIVES_BACK + ": the step's new leases",
            "claim_many": "the claims race as tasks of the loop, each on a connection of its own",
            "fenced": "an async context manager: the block's connection, its end run to its answer",
        },
        sync_only={
            "check_key": "no I/O: a value checked against the store's key rules; an async caller "
            "has it as store.sync_store.check_key",
        },
    ),
    Front("AsyncFenceMarks", "FenceMarks", "sync_marks"),
    Front(
        "AsyncLocks",
        "Locks",
        "sync_locks",
        hand_written={
            "try_acquire": GIVES_BACK,
            "acquire": "carries out the wait's rules in the task, pausing with asyncio.sleep",
            "hold": "an async context manager: the lock kept by an AsyncHeartbeat task",
            "fenced": "the async store's fenced block (an async context manager, not a coroutine)",
        },
    ),
)


class GenerationError(Exception):
    """What the script cannot write, said plainly (the file is left as it is)."""


def sync_class(front: Front) -> type:
    import fencing

    cls = getattr(fencing, front.sync)
    assert isinstance(cls, type)
    return cls


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The public methods of ``cls`` (its own and its bases'; properties are not methods), in
    the order they are defined, a class before its bases; a class- or staticmethod's function."""
    found: dict[str, Callable[..., Any]] = {}
    for klass in cls.__mro__[:-1]:  # not object's
        for name, value in vars(klass).items():
            if name.startswith("_") or name in found:
                continue
            if isinstance(value, (classmethod, staticmethod)):
                found[name] = value.__func__
            elif inspect.isfunction(value):
                found[name] = value
    return found


def forwarded(front: Front) -> dict[str, Callable[..., Any]]:
    """The sync methods whose async twins the script writes, named in :data:`FRONTS` or not."""
    methods = public_methods(sync_class(front))
    for listed in (front.hand_written, front.sync_only):
        stale = sorted(set(listed) - set(methods))
        if stale:
            raise GenerationError(
                f"{front.name}: {', '.join(stale)} named in FRONTS, but fencing.{front.sync} has no "
                "such public method: take it out of FRONTS"
            )
    skipped = front.hand_written.keys() | front.sync_only.keys()
    return {name: fn for name, fn in methods.items() if name not in skipped}


# -- the names a signature uses ----------------------------------------------------------------


def imported_names(source: str, package: str) -> dict[str, object]:
    """The objects ``fencing/asyncio.py`` imports at its top level, by the name it gives them
    (what a generated annotation may use); the names it defines itself map to None."""
    names: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module("." * node.level + (node.module or ""), package)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is None:  # `import a.b` binds a
                    top = alias.name.partition(".")[0]
                    names[top] = importlib.import_module(top)
                else:
                    names[alias.asname] = importlib.import_module(alias.name)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: None for t in targets if isinstance(t, ast.Name)})
    return names


def check_names(annotation: str, fn: Callable[..., Any], where: str, names: dict[str, object]) -> None:
    """Refuse an annotation that would not mean in ``fencing/asyncio.py`` what it means in the
    sync method's module."""
    missing = object()
    for node in ast.walk(ast.parse(annotation, mode="eval")):
        if not isinstance(node, ast.Name):
            continue
        meant = fn.__globals__.get(node.id, getattr(builtins, node.id, missing))
        if meant is missing:
            raise GenerationError(f"{where}: {node.id!r} in {annotation!r} is no name of its module")
        here = names[node.id] if node.id in names else getattr(builtins, node.id, missing)
        if here is missing:
            raise GenerationError(
                f"{where} uses {node.id!r}, which fencing/asyncio.py does not import: import it "
                f"there as {fn.__module__} does"
            )
        if here is not meant:
            raise GenerationError(
                f"{where}: {node.id!r} in fencing/asyncio.py is not the object the sync "
                "signature means by it: import that one"
            )


def literal(value: object, where: str) -> str:
    """A default as source text: only literals, which read the same in both modules."""
    text = repr(value)
    if type(value) not in (type(None), bool, int, float, str):
        raise GenerationError(f"{where}: default {text} is not a literal; write this method by hand (FRONTS)")
    return text


# -- the code ----------------------------------------------------------------------------------


def bracketed(indent: str, head: str, items: list[str], tail: str) -> list[str]:
    """``head`` + items + ``tail`` as ``ruff format`` lays it out: on one line if it fits, else
    the items on one line of their own between the brackets, else one item a line with a
    trailing comma (an item longer than a line is refused: ruff would split it)."""
    flat = f"{indent}{head}{', '.join(items)}{tail}"
    if len(flat) <= LINE_LENGTH:
        return [flat]
    inner = indent + INDENT
    hugged = f"{inner}{', '.join(items)}"
    if len(hugged) <= LINE_LENGTH:
        return [f"{indent}{head}", hugged, f"{indent}{tail}"]
    exploded = [f"{indent}{head}", *(f"{inner}{item}," for item in items), f"{indent}{tail}"]
    too_long = [line.strip() for line in exploded if len(line) > LINE_LENGTH]
    if too_long:
        raise GenerationError(f"{too_long[0]!r} does not fit on a line: write this method by hand (FRONTS)")
    return exploded


def method(front: Front, name: str, fn: Callable[..., Any], names: dict[str, object]) -> list[str]:
    """The lines of ``name``'s forwarder, at a class body's indentation."""
    where = f"fencing.{front.sync}.{name}"
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    if not params or params[0].name != "self":
        raise GenerationError(f"{where} is no instance method; write its twin by hand (FRONTS)")
    declared, passed = ["self"], [f"self.{front.via}.{name}"]
    for param in params[1:]:
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise GenerationError(
                f"{where}: parameter {param} is not positional-or-keyword or keyword-only; "
                "write this method by hand (FRONTS)"
            )
        if param.kind is param.KEYWORD_ONLY and "*" not in declared:
            declared.append("*")
        annotation = param.annotation
        if not isinstance(annotation, str):
            raise GenerationError(
                f"{where}: parameter {param.name!r} has no annotation as written (its module "
                "needs `from __future__ import annotations` and every parameter annotated)"
            )
        value = param.name
        if param.name == "conn":
            if annotation != "CallerConnection | None" or param.default is not None:
                raise GenerationError(
                    f"{where}: conn must be `conn: CallerConnection | None = None`, got {param}"
                )
            annotation, value = "AsyncCallerConnection | None", "caller_sync(conn)"
        else:
            check_names(annotation, fn, where, names)
        text = f"{param.name}: {annotation}"
        if param.default is not param.empty:
            text += f" = {literal(param.default, where)}"
        declared.append(text)
        passed.append(value if param.kind is param.POSITIONAL_OR_KEYWORD else f"{param.name}={value}")
    returns = signature.return_annotation
    if not isinstance(returns, str):
        raise GenerationError(f"{where}: no return annotation as written")
    check_names(returns, fn, where, names)
    body = INDENT * 2
    call = "await run(" if returns == "None" else "return await run("
    return [
        *bracketed(INDENT, f"async def {name}(", declared, f") -> {returns}:"),
        f'{body}""":meth:`{where}` as a coroutine."""',
        *bracketed(body, call, passed, ")"),
    ]


def block(front: Front, indent: str, names: dict[str, object]) -> str:
    """The generated block of ``front``, its markers included."""
    if indent != INDENT:
        raise GenerationError(f"the block of {front.name} must be in its class body (indented 4)")
    lines = [
        f"{INDENT}# START GENERATED {front.name}",
        f"{INDENT}# written by tools/generate_async.py from the signatures of fencing.{front.sync}:",
        f"{INDENT}# edit the script or the sync methods, never this block, then run the script again",
    ]
    for name, fn in forwarded(front).items():
        lines += ["", *method(front, name, fn, names)]
    lines += ["", f"{INDENT}# END GENERATED {front.name}"]
    return "\n".join(lines) + "\n"


def owner(source: str, line: int) -> str | None:
    """The class whose body holds (indented) line ``line`` (1-based) of ``source``: the last
    top-level statement that begins before it, if that is a class."""
    before = [node for node in ast.parse(source).body if node.lineno < line]
    last = before[-1] if before else None
    return last.name if isinstance(last, ast.ClassDef) else None


def blocks(source: str) -> Iterator[tuple[Front, re.Match[str]]]:
    """Each front with its block in ``source``: exactly one, inside its class."""
    fronts = {front.name: front for front in FRONTS}
    matches = list(BLOCK.finditer(source))
    markers = len(MARKER.findall(source))
    if markers != 2 * len(matches):
        raise GenerationError(
            "fencing/asyncio.py has a `# START GENERATED` or `# END GENERATED` comment that is "
            "not one of a pair (`# START GENERATED <class>` ... `# END GENERATED <class>`, the "
            "same indentation)"
        )
    found: dict[str, re.Match[str]] = {}
    for match in matches:
        name = match["cls"]
        if name not in fronts:
            raise GenerationError(f"fencing/asyncio.py has a generated block for {name}, not in FRONTS")
        if name in found:
            raise GenerationError(f"fencing/asyncio.py has two generated blocks for {name}")
        if owner(source, source.count("\n", 0, match.start()) + 1) != name:
            raise GenerationError(f"the generated block of {name} is not inside class {name}")
        found[name] = match
    for front in FRONTS:
        if front.name not in found:
            raise GenerationError(
                f"fencing/asyncio.py has no generated block for {front.name}: put "
                f"`    # START GENERATED {front.name}` and `    # END GENERATED {front.name}` "
                "in its class body"
            )
        yield front, found[front.name]


def written_by_hand(source: str, front: Front, match: re.Match[str]) -> set[str]:
    """The methods class ``front.name`` of ``source`` defines outside its generated block."""
    first = source.count("\n", 0, match.start()) + 1
    last = source.count("\n", 0, match.end())
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == front.name:
            return {
                f.name
                for f in node.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not first <= f.lineno <= last
            }
    return set()


def regenerate(source: str, package: str = "fencing") -> str:
    """``source`` (fencing/asyncio.py's text) with every generated block written anew."""
    names = imported_names(source, package)
    pieces, end = [], 0
    for front, match in sorted(blocks(source), key=lambda pair: pair[1].start()):
        twice = sorted(written_by_hand(source, front, match) & forwarded(front).keys())
        if twice:
            raise GenerationError(
                f"{front.name} defines {', '.join(twice)} by hand and the script writes it too: "
                "delete the hand-written one, or name it in FRONTS (hand_written) with the reason"
            )
        pieces += [source[end : match.start()], block(front, match["indent"], names)]
        end = match.end()
    return "".join([*pieces, source[end:]])


def generated_parts(source: str) -> list[str]:
    return [match.group(0) for _, match in blocks(source)]


def ruff_disagrees(source: str) -> str | None:
    """What ``ruff format`` would change in the generated blocks of ``source`` (None: nothing,
    or no ruff here to ask)."""
    ruff = shutil.which("ruff")
    if ruff is None and importlib.util.find_spec("ruff") is None:
        print("ruff is not on hand: the layout was not confirmed by ruff format", file=sys.stderr)
        return None
    command = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    done = subprocess.run(
        # formatted as the checkout's file is (its pyproject.toml), wherever the file is
        [*command, "format", "--stdin-filename", str(ROOT / "fencing" / "asyncio.py"), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        return f"ruff format failed on the generated file:\n{done.stderr}"
    ours, theirs = generated_parts(source), generated_parts(done.stdout)
    if ours == theirs:
        return None
    as_written, as_ruff_writes = ("".join(parts).splitlines(True) for parts in (ours, theirs))
    return "".join(difflib.unified_diff(as_written, as_ruff_writes, "as generated", "as ruff formats it"))


def target() -> Path:
    """fencing/asyncio.py of the ``fencing`` this script reads (the checkout's, when it has one)."""
    import fencing

    return Path(fencing.__file__).resolve().parent / "asyncio.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 with a diff when the generated blocks are not what this writes",
    )
    parser.add_argument(
        "path", nargs="?", type=Path, help="the file to rewrite or check (default: fencing/asyncio.py)"
    )
    args = parser.parse_args(argv)
    path: Path = args.path or target()
    if args.path is None and not args.check and ROOT not in path.parents:
        print(f"fencing is imported from {path.parent}, not this checkout: not rewritten", file=sys.stderr)
        return 2
    source = path.read_text(encoding="utf-8")
    try:
        written = regenerate(source)
    except GenerationError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if written == source:
            return 0
        diff = difflib.unified_diff(
            source.splitlines(True), written.splitlines(True), f"{path} (as it is)", f"{path} (as generated)"
        )
        sys.stdout.writelines(diff)
        print(f"\n{path}: the generated blocks are out of date: run python tools/generate_async.py")
        return 1
    disagreement = ruff_disagrees(written)
    if disagreement is not None:
        print(disagreement)
        print(f"{path}: not rewritten: ruff format would lay the blocks out otherwise (fix bracketed())")
        return 1
    if written == source:
        print(f"{path}: the generated blocks are up to date")
    else:
        path.write_text(written, encoding="utf-8")
        print(f"{path}: the generated blocks rewritten")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the checkout's fencing before an installed one
    sys.exit(main())
