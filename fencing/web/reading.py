"""A request's JSON object read as its model: the request, or the library's error naming the field.

The API judges a body in this order. First what names who acts: unknown fields, then the
owner's place (a claim's ``owner``; a lease: an object with its ``job_id``, ``owner`` and
``fence`` and nothing else), so that who may act (``403``) is judged before any value is.
Then the values: a missing field, the API's bounds (``ttl``, ``limit``, ``max_attempts``),
then the others in the body's order. The first refusal is told as the library's error
(``InvalidArgument`` or ``InvalidArgumentType``: ``422``), the field named by its path
(``lease.fence``) and the value shown as the library shows it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from .._errors import FencingError, InvalidArgument, InvalidArgumentType
from .._sql.checks import show_value
from .models import RequestBody

__all__ = ["PAST_BOUND", "Reading", "read"]

R = TypeVar("R", bound=RequestBody)

#: what is said when a request passes one of the API's bounds (``le``: the bound)
PAST_BOUND = {
    "ttl": "ttl must be at most {le:g} s here (the API's max_ttl; longer work renews its lease)",
    "limit": "limit must be at most {le} here (the API's max_limit)",
    "max_attempts": "max_attempts must be at most {le} here: the API poisons jobs claimed {le} times",
}

#: what a body's shape gets wrong, as pydantic names it: judged before who may act when it
#: is where the owner is
_SHAPE = ("missing", "model_type", "extra_forbidden")


@dataclass(frozen=True)
class Reading(Generic[R]):
    """A body read as a request model: the request, or the first refusal before who may act
    is judged (``unnamed``) and after it (``invalid``); ``owner``: the owner it acts as, when
    it names a valid one."""

    request: R | None
    unnamed: FencingError | None
    owner: str | None
    invalid: FencingError | None


def read(model: type[R], body: dict[str, Any]) -> Reading[R]:
    """``body`` as ``model``, or the first refusal of each stage (the module's order)."""
    at = model.owner_at
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    else:
        return Reading(request, None, None if at is None else _dug(body, at), None)
    first = sorted((e for e in errors if _names_who(e, at)), key=_shape_order)
    rest = sorted((e for e in errors if not _names_who(e, at)), key=_value_order)
    if first:
        return Reading(None, _refusal(model, first[0], errors), None, None)
    owner = None if at is None or any(e["loc"] == at for e in rest) else _dug(body, at)
    return Reading(None, None, owner, _refusal(model, rest[0], errors))


def _dug(body: dict[str, Any], at: tuple[str, ...]) -> str | None:
    value: Any = body
    for part in at:
        value = value[part]
    return value if isinstance(value, str) else None


def _names_who(error: ErrorDetails, at: tuple[str, ...] | None) -> bool:
    """Whether ``error`` is read before who may act: an unknown field of the body, or the
    shape of the owner's place (``at``)."""
    loc, kind = error["loc"], error["type"]
    if kind == "extra_forbidden" and len(loc) == 1:
        return True
    return at is not None and kind in _SHAPE and loc[0] == at[0] and len(loc) <= len(at)


def _shape_order(error: ErrorDetails) -> tuple[bool, int, bool]:
    # the body's unknown fields, then a lease missing or no object, its unknown fields, its missing ones
    loc, unknown = error["loc"], error["type"] == "extra_forbidden"
    return (len(loc) > 1 or not unknown, len(loc), not unknown)


def _value_order(error: ErrorDetails) -> tuple[bool, bool]:
    # a missing field, then the API's bounds, then the rest in the body's order (a stable sort)
    return (error["type"] != "missing", error["loc"][0] not in PAST_BOUND)


def _model_at(model: type[BaseModel], path: tuple[int | str, ...]) -> type[BaseModel]:
    """The model of the object at ``path`` in a body of ``model``."""
    for part in path:
        annotation = model.model_fields[str(part)].annotation
        model = next(
            t for t in (annotation, *get_args(annotation)) if inspect.isclass(t) and issubclass(t, BaseModel)
        )
    return model


def _refusal(model: type[BaseModel], error: ErrorDetails, errors: list[ErrorDetails]) -> FencingError:
    """The library's error for pydantic's ``error`` in a body of ``model`` (``errors``: all
    of them, for the unknown fields named together)."""
    loc, kind, value = error["loc"], error["type"], error["input"]
    if not loc:  # not reached through read_json, which takes objects alone
        return InvalidArgumentType(f"the body must be a JSON object, got {type(value).__name__}")
    name, field = ".".join(map(str, loc)), str(loc[-1])
    parent = ".".join(map(str, loc[:-1]))
    owner = _model_at(model, loc[:-1])
    shown, got = show_value(value), f"{type(value).__name__} {show_value(value)}"
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        unknown = ", ".join(
            sorted(repr(e["loc"][-1]) for e in errors if e["type"] == kind and e["loc"][:-1] == loc[:-1])
        )
        takes = ", ".join(owner.model_fields)
        if not parent:
            return InvalidArgument(f"unknown field(s) {unknown}; this call takes {takes}")
        return InvalidArgument(f"unknown field(s) {unknown} in {parent}; {parent} takes {takes}")
    if kind == "missing":
        return InvalidArgument(f"{parent or 'the body'} has no {field!r}")
    if kind == "model_type":
        required = [n for n, f in _model_at(model, loc).model_fields.items() if f.is_required()]
        names = ", ".join(required[:-1]) + f" and {required[-1]}"
        return InvalidArgumentType(f"{name} must be an object with {names}, got {type(value).__name__}")
    none = " or None" if type(None) in get_args(owner.model_fields[field].annotation) else ""
    if kind == "string_type":
        return InvalidArgumentType(f"{name} must be a str{none}, got {got}")
    if kind == "text_not_utf8":
        return InvalidArgument(f"{name} cannot be stored as UTF-8 ({error['msg']}): {shown}")
    if kind == "int_type":
        return InvalidArgumentType(f"{name} must be an int{none}, got {got}")
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        # strict floats take every int a float holds: this one is past a float's range
        return InvalidArgument(
            f"{name} must be a finite number within a float's range (about 1.8e308), got {shown}"
        )
    if kind == "float_type":
        return InvalidArgumentType(f"{name} must be a real number (int or float){none}, got {got}")
    if kind == "finite_number":
        return InvalidArgument(f"{name} must be a finite number, got {shown}")
    if kind == "greater_than":
        return InvalidArgument(f"{name} must be > {_number(ctx['gt'])}, got {shown}")
    if kind == "greater_than_equal":
        return InvalidArgument(f"{name} must be at least {_number(ctx['ge'])}, got {shown}")
    if kind == "less_than_equal":
        said = PAST_BOUND.get(name, "{name} must be at most {le}")
        return InvalidArgument(said.format(name=name, le=ctx["le"]) + f", got {shown}")
    wrong = InvalidArgumentType if kind.endswith("_type") else InvalidArgument
    return wrong(f"{name} is refused ({error['msg']}), got {got}")


def _number(bound: object) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)
