"""What the lease API takes and what it answers, as typed models (pydantic).

The requests are strict: a field is of its own JSON type or refused (a bool is no int, a
string is no number, ``1.0`` is no fence), an unknown field is refused, and a job id, owner
or result must be text that can be stored as UTF-8. Each duration and count is bounded
below here; the API's own bounds (``max_ttl``, ``max_limit``, ``max_attempts``) are added by
:func:`requests_within`, so an app's models, and the OpenAPI document made from them
(:mod:`fencing.web.openapi`), carry its bounds. What the store judges besides (a key's
length, a NUL on PostgreSQL, a ``ttl`` under a millisecond on the database's clock) stays
the store's. The answers are built through their models, so the document says what is sent.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, WithJsonSchema, create_model
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from .._sql.checks import FENCE_MAX
from .._sql.failures import Failure
from .._sql.values import Lease
from ..overview import JobView

__all__ = [
    "MAX_LIMIT",
    "MAX_TTL",
    "ClaimIn",
    "ClaimOut",
    "CompleteIn",
    "CompleteOut",
    "EnqueueIn",
    "EnqueueOut",
    "Enqueued",
    "JobOut",
    "JobRead",
    "LeaseIn",
    "LeaseOut",
    "Problem",
    "ReleaseIn",
    "ReleaseOut",
    "RenewIn",
    "RenewOut",
    "RequestBody",
    "Requests",
    "requests_within",
]

#: the longest lease (``ttl``, seconds) the API hands out by default: a day. A crashed
#: worker's job waits out its lease, so longer work renews (heartbeats) instead
MAX_TTL = 86400.0
#: the most jobs one claim takes by default: one transaction locks them all, and one
#: worker cannot drain a queue that others share
MAX_LIMIT = 1000


def _stored_as_utf8(text: str) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "text_not_utf8", "lone surrogate at index {index}", {"index": exc.start}
            ) from None
    return text


#: a job id, owner or result: a string that can be stored as UTF-8 (``"\ud800"`` in JSON cannot)
Text = Annotated[str, AfterValidator(_stored_as_utf8)]
#: a duration in seconds, more than 0
Seconds = Annotated[float, Field(gt=0)]
#: a count from 1 up (its top is the API's bound, or the store's 2**63-1)
Count = Annotated[int, Field(ge=1)]
#: a fence token: any integer is read (one no claim handed out is refused as stale, ``409``);
#: the document names those a claim hands out
Fence = Annotated[int, Field(json_schema_extra={"minimum": 1, "maximum": FENCE_MAX})]


class RequestBody(BaseModel):
    """A request's body: strict types, no unknown field. ``owner_at``: where the owner the
    request acts as is found (``None``: it acts as none)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    owner_at: ClassVar[tuple[str, ...] | None] = None


class LeaseIn(RequestBody):
    """A lease as a claim or renewal answered it: ``until`` and ``payload`` may come back and
    are not read."""

    job_id: Text
    owner: Text
    fence: Fence
    until: Annotated[object, WithJsonSchema({"type": ["number", "null"]})] = None
    #: a claim's answer carries its job's payload: it may come back, and is not read
    payload: Annotated[object, WithJsonSchema({})] = None

    def token(self) -> Lease:
        """The lease as the store takes it (its deadline is the row's, never the client's)."""
        return Lease(self.job_id, self.owner, self.fence)


class ClaimIn(RequestBody):
    """Claim up to ``limit`` ready jobs for ``owner``, each for ``ttl`` seconds; ``max_attempts``:
    skip jobs claimed that many times (``null``: the API's own, if it has one)."""

    owner_at = ("owner",)

    owner: Text
    ttl: Seconds
    limit: Count = 1
    max_attempts: Count | None = None


class RenewIn(RequestBody):
    """Extend the lease to now + ``ttl``."""

    owner_at = ("lease", "owner")

    lease: LeaseIn
    ttl: Seconds


class CompleteIn(RequestBody):
    """Store ``result`` (``null`` for none) under the lease and mark the job done."""

    owner_at = ("lease", "owner")

    lease: LeaseIn
    result: Text | None


class ReleaseIn(RequestBody):
    """Give the lease back: claimable at once, or after ``delay`` seconds; ``failure``: why
    this attempt failed, kept as the job's last failure (an API whose store keeps failures)."""

    owner_at = ("lease", "owner")

    lease: LeaseIn
    delay: Seconds | None = None
    failure: Text | None = None


class EnqueueIn(RequestBody):
    """Register ``job_id``, claimable from ``ready_at`` (seconds since the epoch; ``null``: now),
    with its arguments ``payload`` (any JSON; an API whose store keeps payloads)."""

    job_id: Text
    ready_at: float | None = None
    payload: JsonValue = None


class Requests(NamedTuple):
    """The request models of one API, its bounds in them."""

    claim: type[ClaimIn]
    renew: type[RenewIn]
    complete: type[CompleteIn]
    release: type[ReleaseIn]
    enqueue: type[EnqueueIn]


@functools.cache
def requests_within(max_ttl: float, max_limit: int, max_attempts: int | None) -> Requests:
    """The request models of an API with these bounds: ``ttl`` at most ``max_ttl``, a claim's
    ``limit`` at most ``max_limit``, its ``max_attempts`` at most the API's (when it has one)."""
    ttl: Any = (Annotated[Seconds, Field(le=max_ttl)], ...)
    claim = create_model(
        "ClaimIn",
        __base__=ClaimIn,
        __module__=__name__,
        __doc__=ClaimIn.__doc__,
        ttl=ttl,
        limit=(Annotated[Count, Field(le=max_limit)], 1),
        max_attempts=(Annotated[Count, Field(le=max_attempts)] | None, None),
    )
    renew = create_model("RenewIn", __base__=RenewIn, __module__=__name__, __doc__=RenewIn.__doc__, ttl=ttl)
    return Requests(claim, renew, CompleteIn, ReleaseIn, EnqueueIn)


# -- the answers ---------------------------------------------------------------------------


class Answer(BaseModel):
    """An answer's body: built by the API from its own values, sent with the fields set."""

    model_config = ConfigDict(extra="forbid")


class LeaseOut(Answer):
    """A lease: ``until`` is its deadline on the database's clock (``null`` when the answer
    ends the lease: a completion or release); a claim's carries its job's ``payload`` where
    the store keeps payloads."""

    job_id: str
    owner: str
    fence: Fence
    until: float | None
    payload: JsonValue = Field(default=None, description="the job's arguments (a claim, with payloads kept)")

    @classmethod
    def of(cls, lease: Lease, *, payload: bool = False) -> LeaseOut:
        """``lease``'s answer; with ``payload``, its job's payload too."""
        if payload:
            return cls(
                job_id=lease.job_id,
                owner=lease.owner,
                fence=lease.fence,
                until=lease.until,
                payload=lease.payload,
            )
        return cls(job_id=lease.job_id, owner=lease.owner, fence=lease.fence, until=lease.until)


class JobOut(BaseModel):
    """A job's row and state, read at ``now`` (the same JSON as the CLI's and the dashboard's)."""

    job_id: str
    state: Literal["ready", "held", "deferred", "done", "poisoned"]
    owner: str | None
    fence: int
    until: float
    until_in: float | None = Field(description="until - now; null: done, or until 0")
    result: str | None
    now: float = Field(description="the database's clock when the job was read")

    @classmethod
    def of(cls, job: JobView) -> JobOut:
        return cls.model_validate(job.as_json())


class ClaimOut(Answer):
    """The leases taken, the longest waiting jobs first (none ready: an empty list)."""

    leases: list[LeaseOut]


class RenewOut(Answer):
    """The renewed lease, with its new ``until``."""

    lease: LeaseOut


class CompleteOut(Answer):
    """The completion's lease; a replay (``replayed``) adds the job's row."""

    completed: Literal[True]
    replayed: bool
    lease: LeaseOut
    job: JobOut | SkipJsonSchema[None] = Field(default=None, description="the job's row, on a replay")


class ReleaseOut(Answer):
    """The released lease; a replay (``replayed``) adds the job's row."""

    released: Literal[True]
    replayed: bool
    lease: LeaseOut
    job: JobOut | SkipJsonSchema[None] = Field(default=None, description="the job's row, on a replay")


class EnqueueOut(Answer):
    """Whether the job was added (``201``: :class:`Enqueued`), and its row after the call."""

    enqueued: bool
    job: JobOut | None


class Enqueued(EnqueueOut):
    """The job was added; its row after the call."""

    enqueued: Literal[True]


class FailureOut(BaseModel):
    """A job's last failure: the attempt's ``fence``, when (``at``, the release's clock) and
    what its worker said (``text``)."""

    fence: int
    at: float
    text: str

    @classmethod
    def of(cls, failure: Failure) -> FailureOut:
        return cls(fence=failure.fence, at=failure.at, text=failure.text)


class JobRead(Answer):
    """The job's row, read now; with the job's ``payload`` and last ``failure`` where the
    store keeps them (``null``: none)."""

    job: JobOut
    payload: JsonValue = Field(default=None, description="the job's arguments (payloads kept)")
    failure: FailureOut | None = Field(default=None, description="the job's last failure (failures kept)")


class Problem(BaseModel):
    """RFC 9457 problem details: the error as the library names it, and what says more."""

    type: str = Field(json_schema_extra={"format": "uri"})
    title: str
    status: int
    detail: str
    error: str = Field(description="the library's error name (Refused for a refused write)")
    reason: str | SkipJsonSchema[None] = Field(
        default=None, description="why a write was refused (fencing.REASONS)"
    )
    job_id: str | SkipJsonSchema[None] = Field(default=None, description="a refused write's job, or a 404's")
    fence: int | SkipJsonSchema[None] = Field(default=None, description="the fence a refused write presented")
    holder: str | None = Field(default=None, description="who holds the job, as the refused write found it")
    current_fence: int | None = Field(
        default=None, description="the job's fence, as the refused write found it"
    )
    owner: str | SkipJsonSchema[None] = Field(
        default=None, description="a 403's owner, not granted to the token"
    )
    caller: str | SkipJsonSchema[None] = Field(
        default=None, description="a 403's caller, as authorize named it"
    )
