"""Errors as RFC 9457 problem details (``application/problem+json``), named as the library names them.

Every error the lease API and the dashboard's actions answer is a JSON object with ``type``
(``urn:fencing:error:NAME``), ``title`` (the error's name), ``status``, ``detail`` (the
library's message) and ``error`` (the name again, for clients that switch on it), plus the
fields that say more: a refused write's ``reason``, ``holder`` and ``current_fence``.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from .. import _errors as errors

__all__ = ["PROBLEM_JSON", "from_error", "problem"]

PROBLEM_JSON = "application/problem+json"

#: the status each library error answers with: the first class of its MRO found here
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (errors.InvalidArgument, 422),
    (errors.InvalidArgumentType, 422),
    (errors.LeaseLost, 409),
    (errors.FencesExhausted, 409),
    (errors.LockTimeout, 409),
    # retrying later may succeed: the database was busy, unreachable, or the write's fate
    # was lost with its connection (a completion retried with the same lease answers as the
    # first one did, so retrying it is safe)
    (errors.DatabaseBusy, 503),
    (errors.DatabaseUnavailable, 503),
    (errors.OutcomeUnknown, 503),
    (errors.PoolTimeout, 503),
    (errors.DatabaseFull, 507),
    (errors.DatabaseReadOnly, 503),
    (errors.TableMissing, 503),
    (errors.DatabaseMissing, 503),
    (errors.FencingError, 500),
)

#: seconds a client should wait before retrying a 503
RETRY_AFTER = 1


def problem(status: int, error: str, detail: str, **fields: Any) -> JSONResponse:
    """A problem details response: ``error`` is the name a client switches on."""
    body = {
        "type": f"urn:fencing:error:{error}",
        "title": error,
        "status": status,
        "detail": detail,
        "error": error,
    }
    body.update(fields)
    headers = {"Retry-After": str(RETRY_AFTER)} if status == 503 else None
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def status_of(exc: BaseException) -> int:
    """The status a library error answers with (500 for one this table does not know)."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def from_error(exc: errors.FencingError) -> JSONResponse:
    """The problem details of a library error: its class's name and its message."""
    return problem(status_of(exc), type(exc).__name__, str(exc))
