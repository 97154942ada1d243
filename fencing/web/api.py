"""The lease API over HTTP: workers in any language take part in the same fencing.

A thin mapping of the store's operations to JSON (:func:`lease_api`), mounted by the
application (``app.mount("/leases", lease_api(store, authorize=...))``)::

    POST /claim     {"owner": "w1", "ttl": 30, "limit": 1, "max_attempts": 5}
                    -> 200 {"leases": [{"job_id", "owner", "fence", "until"}, ...]}
    POST /renew     {"lease": {"job_id", "owner", "fence"}, "ttl": 30} -> 200 {"lease": ...}
    POST /complete  {"lease": {...}, "result": "..."}   -> 200 {"completed": true, "lease": ...}
    POST /release   {"lease": {...}, "delay": 60}       -> 200 {"released": true, "lease": ...}
    POST /enqueue   {"job_id": "...", "ready_at": null} -> 201 / 200 {"enqueued": ...}
    GET  /jobs/ID   -> 200 {"job": {"job_id", "state", "owner", "fence", "until", "until_in", "result",
                                "now"}}
    GET  /openapi.json

Every answer carries the fence (the lease's, and the job's current one). A completion or
release that was accepted answers with the lease it ended (no read: the guard let it
through); a replayed one also with the job's row. A write the guard refuses answers ``409``
with the reason (:data:`fencing.REASONS`), the holder and the current fence, as problem
details (:mod:`fencing.web.problems`); bad input ``422`` naming the field; a database that
cannot answer ``503`` with ``Retry-After``. Each body is read as its typed model, strict
(:mod:`fencing.web.models`: a bool is no int, a string no number, an unknown field is
refused), in the order :mod:`fencing.web.reading` keeps; each answer is built through its
model; the OpenAPI document is generated from the models (:mod:`fencing.web.openapi`).

**A token acts only as its own owners.** Every request must be authorized by the
application's ``authorize`` callable (:mod:`fencing.web.auth`): without an answer it gets
``401`` and nothing is read or changed. Who it answers acts as one owner (the name it
returns) or as the owners a :class:`~fencing.web.Caller` grants: a claim, renewal,
completion or release for any other owner is refused with ``403`` before anything is read.

**Retries never double-apply.** A completion retried with the same lease (its answer lost
on the way back) finds the job done *by that lease*, with that result, and answers ``200``
as the first did (``"replayed": true``); with another result it is refused (``409``, the
stored result untouched). A retried release is answered as a replay only when the store's
ownership history shows that very release as the job's last change (its row cannot tell who
released it: a requeue or another owner's token leaves the same row); otherwise ``409``
``released``, the lease being over either way. A renewal is a new deadline each time
(renewing twice renews twice). A claim is not idempotent: a claim whose answer was lost
leaves a lease that ends with its ``ttl`` (keep it short) and nothing is written under it.

**Bounds.** ``ttl`` is at most ``max_ttl`` (a day by default), a claim's ``limit`` at most
``max_limit`` (1,000), ``max_attempts`` at most the API's own ``max_attempts`` (which every
claim applies when it is set); bodies are JSON objects of at most ``max_body`` bytes
(``413`` past it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy.sql import Executable
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._errors import FencingError, InvalidArgument, InvalidArgumentType
from .._runtime.refusals import Refusal
from .._sql.checks import check_count, check_ttl
from .._sql.dberrors import DB_ERRORS, wrap_database_error
from .._sql.values import Lease
from .._sql.views import HistoryViews
from .._store.jobstore import JobStore
from ..overview import JobView, Overview
from . import models
from .auth import Authorize, Caller, caller_of
from .models import (
    MAX_LIMIT,
    MAX_TTL,
    ClaimOut,
    CompleteOut,
    Enqueued,
    EnqueueOut,
    FailureOut,
    JobOut,
    JobRead,
    LeaseOut,
    ReleaseOut,
    RenewOut,
    requests_within,
)
from .openapi import openapi_document
from .problems import from_error, problem
from .reading import read

__all__ = ["MAX_LIMIT", "MAX_TTL", "BadBody", "lease_api", "openapi_document", "read_body", "read_json"]

logger = logging.getLogger("fencing.web")

#: the largest request body the API reads (bytes): a result is the biggest field
MAX_BODY = 1024 * 1024

Handler = Callable[[Request, dict[str, Any], Caller], Awaitable[Response]]
R = TypeVar("R", bound=models.RequestBody)


class BadBody(Exception):
    """A request body the API does not read: its status, name and why."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read up to ``limit`` bytes and no further (``413`` past it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadBody(413, "BodyTooLarge", f"the body is {declared} bytes; at most {limit} are read")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadBody(413, "BodyTooLarge", f"the body is over {limit} bytes; at most {limit} are read")
    return bytes(body)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request's body as a JSON object, read up to ``limit`` bytes and no further."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise BadBody(
            415, "UnsupportedMediaType", f"the body must be application/json, got {kind or 'none'!r}"
        )
    body = await read_body(request, limit)
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise BadBody(400, "MalformedJSON", f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadBody(
            422, "InvalidArgumentType", f"the body must be a JSON object, got {type(value).__name__}"
        )
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def answer(body: BaseModel, status: int = 200) -> JSONResponse:
    """An answer of the API: its model's fields that were set (a replay's ``job`` only on a replay)."""
    return JSONResponse(body.model_dump(exclude_unset=True), status_code=status)


class _Api:
    def __init__(
        self,
        store: JobStore,
        authorize: Authorize,
        *,
        max_body: int,
        max_ttl: float,
        max_limit: int,
        max_attempts: int | None,
    ) -> None:
        self.store = store
        self.overview = Overview(store.engine, store.table)
        self.authorize = authorize
        self.max_body = max_body
        self.max_attempts = max_attempts
        self.requests = requests_within(max_ttl, max_limit, max_attempts)
        self.document = openapi_document(max_ttl=max_ttl, max_limit=max_limit, max_attempts=max_attempts)
        #: the job's last change of lease (refusals change nothing), if the store keeps a history
        self.last_change: Executable | None = None
        if store.history_config is not None:
            self.last_change = HistoryViews(store.history_config.table).last_change

    def endpoint(self, handler: Handler, *, body: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def call(request: Request) -> Response:
            try:
                who = await caller_of(self.authorize, request)
            except FencingError as exc:
                return from_error(exc)
            if who is None:
                response = problem(
                    401, "Unauthorized", "this request is not authorized: nothing was read or changed"
                )
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            try:
                fields = await read_json(request, self.max_body) if body else {}
                return await handler(request, fields, who)
            except BadBody as exc:
                return problem(exc.status, exc.error, exc.detail)
            except FencingError as exc:
                return from_error(exc)

        return call

    def read(self, model: type[R], body: dict[str, Any], who: Caller, path: str) -> R | Response:
        """``body`` as ``model``, in the API's order (:mod:`fencing.web.reading`): what names
        who acts, then who may act (the ``403`` answered), then the values; a refusal of
        either is raised as the library's error (``422`` naming the field)."""
        reading = read(model, body)
        if reading.unnamed is not None:
            raise reading.unnamed
        if reading.owner is not None:
            forbidden = self.not_yours(who, reading.owner, path)
            if forbidden is not None:
                return forbidden
        if reading.invalid is not None:
            raise reading.invalid
        assert reading.request is not None  # no refusal: read
        return reading.request

    def not_yours(self, who: Caller, owner: str, path: str) -> Response | None:
        """The ``403`` of a request for an owner ``who`` is not granted (``None``: it is)."""
        if who.may_act_as(owner):
            return None
        granted = sorted(who.owners)
        shown = ", ".join(map(repr, granted[:5])) + (", ..." if len(granted) > 5 else "")
        return problem(
            403,
            "Forbidden",
            f"{who.name!r} may not {path} as owner {owner!r}: a token acts only as the owners it is "
            f"granted ({shown or 'none'}); nothing was read or changed",
            owner=owner,
            caller=who.name,
        )

    def refused(self, why: Refusal, *, note: str = "") -> Response:
        """The 409 of a write the guard refused: the store's own reason, read in the refused
        write's transaction (nothing is read again to answer)."""
        return problem(
            409,
            "Refused",
            f"the {why.path} of job {why.job_id!r} with fence {why.fence} was refused: {why.reason}{note}",
            reason=why.reason,
            job_id=why.job_id,
            fence=why.fence,
            holder=why.holder,
            current_fence=why.current_fence,
        )

    async def claim(self, request: Request, body: dict[str, Any], who: Caller) -> Response:
        claim = self.read(self.requests.claim, body, who, "claim")
        if isinstance(claim, Response):
            return claim
        max_attempts = self.max_attempts if claim.max_attempts is None else claim.max_attempts
        leases = await run_in_threadpool(
            self.store.claim_next, claim.owner, ttl=claim.ttl, limit=claim.limit, max_attempts=max_attempts
        )
        payload = self.store.payloads is not None
        return answer(ClaimOut(leases=[LeaseOut.of(x, payload=payload) for x in leases]))

    async def renew(self, request: Request, body: dict[str, Any], who: Caller) -> Response:
        renew = self.read(self.requests.renew, body, who, "renew")
        if isinstance(renew, Response):
            return renew
        lease, ttl = renew.lease.token(), renew.ttl
        renewed = await run_in_threadpool(lambda: self.store.renew(lease, ttl=ttl))
        if isinstance(renewed, Refusal):
            return self.refused(renewed)
        return answer(RenewOut(lease=LeaseOut.of(renewed)))

    async def complete(self, request: Request, body: dict[str, Any], who: Caller) -> Response:
        complete = self.read(self.requests.complete, body, who, "complete")
        if isinstance(complete, Response):
            return complete
        lease, result = complete.lease.token(), complete.result
        done = await run_in_threadpool(self.store.complete, lease, result)
        if done:  # the row is what the guard let through: no read to answer
            return answer(CompleteOut(completed=True, replayed=False, lease=LeaseOut.of(lease)))
        if done.reason != "done" or (done.holder, done.current_fence) != (lease.owner, lease.fence):
            return self.refused(done)
        job = await self.job(lease.job_id)
        if job is not None and job.state == "done" and (job.owner, job.fence) == (lease.owner, lease.fence):
            # done by this very lease (a fence is handed out once): a retry, if the result is the same
            if job.result == result:
                replay = CompleteOut(
                    completed=True, replayed=True, lease=LeaseOut.of(lease), job=JobOut.of(job)
                )
                return answer(replay)
            return problem(
                409,
                "Refused",
                f"job {lease.job_id!r} was completed under this lease with another result; it is kept",
                reason="done",
                job_id=lease.job_id,
                fence=lease.fence,
                holder=job.owner,
                current_fence=job.fence,
            )
        return self.refused(done)

    async def release(self, request: Request, body: dict[str, Any], who: Caller) -> Response:
        release = self.read(self.requests.release, body, who, "release")
        if isinstance(release, Response):
            return release
        lease, delay, failure = release.lease.token(), release.delay, release.failure
        if failure is not None and self.store.failures is None:
            return self.not_kept("failure", "failures")
        released = await run_in_threadpool(lambda: self.store.release(lease, delay=delay, failure=failure))
        if released:
            return answer(ReleaseOut(released=True, replayed=False, lease=LeaseOut.of(lease)))
        if released.reason != "released" or released.current_fence != lease.fence:
            return self.refused(released)
        # nobody holds it at this fence: a retry of this very release, if the history proves it
        job, proven = await run_in_threadpool(self.released_by, lease)
        if proven and job is not None:
            return answer(
                ReleaseOut(released=True, replayed=True, lease=LeaseOut.of(lease), job=JobOut.of(job))
            )
        note = ""
        unheld = job is not None and job.state != "done" and job.owner is None and job.fence == lease.fence
        if unheld:
            note = (
                " (nobody holds it at this fence; "
                + (
                    "its history shows no release by this owner at this fence last"
                    if self.last_change is not None
                    else "without an ownership history the API cannot tell who ended the lease"
                )
                + ", so this is no replay)"
            )
        return self.refused(released, note=note)

    def released_by(self, lease: Lease) -> tuple[JobView | None, bool]:
        """The job's row, and whether it proves ``lease`` was released and nothing changed
        since: nobody holds the job at the lease's fence, and the ownership history's last
        change of it is the release of that owner at that fence. The row alone proves
        nothing of who ended a lease (a requeue, or a release under another owner's name,
        leaves the same row), so without a history nothing is proven."""
        ov = self.overview
        with ov.reading() as conn:
            job = ov.job(lease.job_id, conn=conn)
            if self.last_change is None or job is None or job.state == "done":
                return job, False
            if job.owner is not None or job.fence != lease.fence:
                return job, False
            try:
                last = conn.execute(self.last_change, {"job_id": lease.job_id}).first()
            except DB_ERRORS as exc:
                raise wrap_database_error(exc, self.store.table.name) from exc
        return job, last is not None and tuple(last) == ("release", lease.owner, lease.fence)

    async def enqueue(self, request: Request, body: dict[str, Any], who: Caller) -> Response:
        enqueue = self.read(self.requests.enqueue, body, who, "enqueue")
        if isinstance(enqueue, Response):
            return enqueue
        job_id, ready_at, payload = enqueue.job_id, enqueue.ready_at, enqueue.payload
        if payload is not None and self.store.payloads is None:
            return self.not_kept("payload", "payloads")
        added = await run_in_threadpool(
            lambda: self.store.enqueue(job_id, ready_at=ready_at, payload=payload)
        )
        logger.info("enqueue of job %r by %s over HTTP: %s", job_id, who.name, "added" if added else "exists")
        job = await self.job(job_id)
        shown = None if job is None else JobOut.of(job)
        if added:
            return answer(Enqueued(enqueued=True, job=shown), 201)
        return answer(EnqueueOut(enqueued=False, job=shown))

    async def state(self, request: Request, body: dict[str, Any], who: Caller) -> Response:
        job_id = request.path_params["job_id"]
        job = await self.job(job_id)
        if job is None:
            return problem(404, "NotFound", f"there is no job {job_id!r}", job_id=job_id)
        kept: dict[str, Any] = {}  # what the store keeps beside the row: only those are answered
        store = self.store
        if store.payloads is not None:
            kept["payload"] = await run_in_threadpool(store.payload, job_id)
        if store.failures is not None:
            failure = await run_in_threadpool(store.failure, job_id)
            kept["failure"] = None if failure is None else FailureOut.of(failure)
        return answer(JobRead(job=JobOut.of(job), **kept))

    def not_kept(self, field: str, side: str) -> Response:
        """The ``422`` of a request that sends ``field`` to an API whose store keeps no
        ``side`` (nothing was read or changed)."""
        return problem(
            422,
            "InvalidArgument",
            f"{field}: this API's store keeps no {side} "
            f"(JobStore(..., {side}=fencing.{side}_table(metadata))); nothing was changed",
        )

    async def job(self, job_id: str) -> JobView | None:
        return await run_in_threadpool(self.overview.job, job_id)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self.document)


def lease_api(
    store: JobStore,
    *,
    authorize: Authorize,
    max_body: int = MAX_BODY,
    max_ttl: float = MAX_TTL,
    max_limit: int = MAX_LIMIT,
    max_attempts: int | None = None,
) -> Starlette:
    """The lease API (an ASGI app) on ``store``; every request is asked of ``authorize``.

    ``authorize(request)`` returns who is asking, or ``None`` (``401``); see
    :func:`fencing.web.bearer_tokens`. Who is asking acts only as its own owner (the name
    returned) or the owners a :class:`~fencing.web.Caller` grants: a claim, renewal,
    completion or release for another owner answers ``403``. Mount it where the application
    wants it:

        app.mount("/leases", lease_api(store, authorize=bearer_tokens({TOKEN: "worker-go"})))

    ``max_ttl``: the longest lease a claim or renewal asks for (seconds, a day by default);
    ``max_limit``: the most jobs one claim takes (1,000); ``max_attempts``: what every claim
    applies (``claim_next(max_attempts=...)``; a claim may ask for fewer, never more), so
    the API never hands out a job the workers and dashboard count as poisoned. Past a bound:
    ``422`` naming the field. With a ``store`` that records the ownership history, every
    change is recorded, and a retried release is proven by it (see above).
    """
    if not isinstance(store, JobStore):
        raise InvalidArgumentType(f"store must be a fencing.JobStore, got {type(store).__name__}")
    if not callable(authorize):
        raise InvalidArgumentType("authorize must be a callable: request -> who is asking, or None")
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
        raise InvalidArgument(f"max_body must be a positive int of bytes, got {max_body!r}")
    max_ttl = check_ttl(max_ttl, name="max_ttl")
    max_limit = check_count("max_limit", max_limit)
    if max_attempts is not None:
        max_attempts = check_count("max_attempts", max_attempts)
    api = _Api(
        store, authorize, max_body=max_body, max_ttl=max_ttl, max_limit=max_limit, max_attempts=max_attempts
    )
    routes = [
        Route("/claim", api.endpoint(api.claim), methods=["POST"]),
        Route("/renew", api.endpoint(api.renew), methods=["POST"]),
        Route("/complete", api.endpoint(api.complete), methods=["POST"]),
        Route("/release", api.endpoint(api.release), methods=["POST"]),
        Route("/enqueue", api.endpoint(api.enqueue), methods=["POST"]),
        Route("/jobs/{job_id:path}", api.endpoint(api.state, body=False), methods=["GET"]),
        Route("/openapi.json", api.openapi, methods=["GET"]),
    ]
    return Starlette(routes=routes)
