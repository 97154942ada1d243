"""The OpenAPI 3.1 document of the lease API, made from its models (:mod:`fencing.web.models`).

Each operation's request and answer are the JSON Schemas of their models, with the app's
bounds in them (``ttl``'s and ``limit``'s ``maximum``, and ``max_attempts``' when the API has
one); what several share (a lease, a job, the problem details) is a component. Every
operation names every status it may answer with.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from .models import (
    ClaimOut,
    CompleteOut,
    Enqueued,
    EnqueueOut,
    JobRead,
    Problem,
    ReleaseOut,
    RenewOut,
    requests_within,
)

__all__ = ["openapi_document"]

#: the problems every request may answer with: not authorized, an error of the library's
#: (refused, bad input, a database that cannot answer, is full, or an error it does not name)
_EVERY_PROBLEM = ("401", "409", "422", "500", "503", "507")
#: and those of a request for an owner: another owner's (not granted to the token)
_OWNER_PROBLEMS = ("403",)
#: and those of a request with a body: not JSON, too large, not application/json
_BODY_PROBLEMS = ("400", "413", "415")

_REF = "#/components/schemas/{model}"


class _Schemas(GenerateJsonSchema):
    """JSON Schema as the document writes it: no title on each field, ``null`` in a type
    list (``["integer", "null"]``), and no ``"default": null`` on a field an answer leaves out
    rather than sends as ``null``."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        inner = self.generate_inner(schema["schema"])
        if isinstance(inner.get("type"), str):
            return {**inner, "type": [inner["type"], "null"]}
        return super().nullable_schema(schema)

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        found = super().default_schema(schema)
        if "default" in found and found["default"] is None and not _takes_null(found):
            del found["default"]
        return found


def _takes_null(schema: JsonSchemaValue) -> bool:
    kinds = schema.get("type")
    return (
        kinds == "null"
        or (isinstance(kinds, list) and "null" in kinds)
        or any(_takes_null(s) for s in schema.get("anyOf", ()))
    )


class _Document:
    """The schemas of one document: each model's, and the components they share."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def schema(self, model: type[BaseModel], mode: Literal["validation", "serialization"]) -> JsonSchemaValue:
        found = model.model_json_schema(ref_template=_REF, schema_generator=_Schemas, mode=mode)
        self.components.update(found.pop("$defs", {}))
        return found

    def operation(
        self,
        summary: str,
        request: type[BaseModel] | None,
        answer: type[BaseModel],
        *,
        added: type[BaseModel] | None = None,
        problems: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """An operation: its ``200`` answer (and ``added``, its ``201`` when it may add), and
        every problem it may answer with (those of a body when it takes one)."""
        answered = {"application/json": {"schema": self.schema(answer, "serialization")}}
        statuses = (*_EVERY_PROBLEM, *(_BODY_PROBLEMS if request is not None else ()), *problems)
        responses: dict[str, Any] = {"200": {"description": "done", "content": answered}}
        if added is not None:
            responses["200"]["description"] = "found registered already: nothing changed"
            created = {"application/json": {"schema": self.schema(added, "serialization")}}
            responses["201"] = {"description": "added", "content": created}
        responses.update({status: {"$ref": "#/components/responses/Problem"} for status in sorted(statuses)})
        op: dict[str, Any] = {"summary": summary, "security": [{"bearer": []}], "responses": responses}
        if request is not None:
            body = {"application/json": {"schema": self.schema(request, "validation")}}
            op["requestBody"] = {"required": True, "content": body}
        return op


def openapi_document(*, max_ttl: float, max_limit: int, max_attempts: int | None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an API with these bounds, served at ``/openapi.json``."""
    requests = requests_within(max_ttl, max_limit, max_attempts)
    doc = _Document()
    mine = _OWNER_PROBLEMS
    paths = {
        "/claim": {
            "post": doc.operation(
                "Claim up to limit ready jobs, longest waiting first", requests.claim, ClaimOut, problems=mine
            )
        },
        "/renew": {
            "post": doc.operation("Extend a live lease to now + ttl", requests.renew, RenewOut, problems=mine)
        },
        "/complete": {
            "post": doc.operation(
                "Store the result under the current, live lease (a retry answers as the first)",
                requests.complete,
                CompleteOut,
                problems=mine,
            )
        },
        "/release": {
            "post": doc.operation(
                "Give the lease back (claimable at once, or after delay seconds); the fence is kept",
                requests.release,
                ReleaseOut,
                problems=mine,
            )
        },
        "/enqueue": {
            "post": doc.operation(
                "Register a job (201), or find it registered already (200, nothing changed)",
                requests.enqueue,
                EnqueueOut,
                added=Enqueued,
            )
        },
        "/jobs/{job_id}": {
            "get": {
                **doc.operation("The job's row and state, read now", None, JobRead, problems=("404",)),
                "parameters": [
                    {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
            }
        },
    }
    problem = {"$ref": _REF.format(model="Problem")}
    doc.components["Problem"] = doc.schema(Problem, "serialization")
    return {
        "openapi": "3.1.0",
        "info": {"title": "fencing lease API", "version": "1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "Problem": {
                    "description": "RFC 9457 problem details",
                    "content": {"application/problem+json": {"schema": problem}},
                }
            },
            "schemas": dict(sorted(doc.components.items())),
        },
        "paths": paths,
    }
