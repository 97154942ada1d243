"""The lease API over HTTP (fencing.web.lease_api), on every backend, through Starlette's client.

What a worker in another language relies on: the fence in every answer; a stale write
refused with its reason as problem details; a retried completion answering as the first
did and never overwriting; bad input named, with nothing changed; no answer without
authorization, and a token acting only as its own owners; bounds on what one request takes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, event
from sqlalchemy.pool import QueuePool

pytest.importorskip("starlette", reason="the web extra is not installed: pip install 'fencing[web]'")

from starlette.testclient import TestClient

from fencing import History, JobStore, Lease, attempts_table, failures_table, history_table, payloads_table
from fencing.cli import main
from fencing.overview import Overview
from fencing.web import Caller, bearer_tokens, lease_api
from fencing.web.api import MAX_LIMIT, MAX_TTL
from fencing.web.feed import Feed

TOKEN = "t0ken-for-the-go-worker"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: the owners the tests' token acts as (one token for a pool of workers)
POOL = Caller("worker-go", owners=["go-1", "go-2", "slow", "w", "w2", "x"])
A, B = "token-of-worker-a-0123456789", "token-of-worker-b-0123456789"
AS_A, AS_B = {"Authorization": f"Bearer {A}"}, {"Authorization": f"Bearer {B}"}


@pytest.fixture
def store(engine: Engine) -> JobStore:
    s = JobStore(engine)
    s.create_table()
    return s


@pytest.fixture
def client(store: JobStore) -> Iterator[TestClient]:
    app = lease_api(store, authorize=bearer_tokens({TOKEN: POOL}))
    with TestClient(app) as c:
        yield c


def post(client: TestClient, path: str, body: Any, **kwargs: Any) -> Any:
    return client.post(path, json=body, headers=AUTH, **kwargs)


def test_claim_complete_cycle_carries_the_fence_in_every_answer(client: TestClient, store: JobStore) -> None:
    assert post(client, "/enqueue", {"job_id": "a"}).status_code == 201
    again = post(client, "/enqueue", {"job_id": "a"})
    assert again.status_code == 200 and again.json()["enqueued"] is False
    got = post(client, "/claim", {"owner": "go-1", "ttl": 30})
    assert got.status_code == 200
    [lease] = got.json()["leases"]
    assert lease["job_id"] == "a" and lease["owner"] == "go-1" and lease["fence"] == 1
    assert lease["until"] is not None
    renewed = post(client, "/renew", {"lease": lease, "ttl": 60})
    assert renewed.status_code == 200 and renewed.json()["lease"]["fence"] == 1
    assert renewed.json()["lease"]["until"] > lease["until"]
    done = post(client, "/complete", {"lease": lease, "result": "ok"})
    assert done.status_code == 200
    body = done.json()
    assert body["completed"] is True and body["replayed"] is False
    assert body["lease"]["fence"] == 1 and body["lease"]["job_id"] == "a"
    state = client.get("/jobs/a", headers=AUTH)
    assert state.status_code == 200 and state.json()["job"]["fence"] == 1
    assert store.state("a") is not None and store.state("a").result == "ok"  # type: ignore[union-attr]
    assert post(client, "/claim", {"owner": "go-1", "ttl": 30}).json() == {"leases": []}


def test_a_stale_completion_after_a_revoke_is_refused_with_its_reason(
    client: TestClient, store: JobStore
) -> None:
    store.enqueue("j")
    [lease] = post(client, "/claim", {"owner": "slow", "ttl": 30}).json()["leases"]
    assert store.revoke("j")
    late = post(client, "/complete", {"lease": lease, "result": "stale"})
    assert late.status_code == 409
    assert late.headers["content-type"] == "application/problem+json"
    problem = late.json()
    assert problem["error"] == "Refused" and problem["reason"] == "stale fence"
    assert problem["fence"] == 1 and problem["current_fence"] == 2
    assert problem["type"] == "urn:fencing:error:Refused" and problem["status"] == 409
    row = store.state("j")
    assert row is not None and row.result is None and not row.done


@pytest.mark.parametrize("path", ["renew", "complete", "release"])
def test_a_refused_write_answers_from_the_stores_refusal_without_reading_again(
    client: TestClient, store: JobStore, engine: Engine, path: str
) -> None:
    """The 409 says the reason the store read in the refused write's own transaction: the
    request runs exactly the statements a refused call of the store runs, nothing more."""
    store.enqueue("j")
    [lease] = post(client, "/claim", {"owner": "slow", "ttl": 30}).json()["leases"]
    assert store.revoke("j")
    token = Lease(lease["job_id"], lease["owner"], lease["fence"])
    body: dict[str, Any] = {"lease": lease}
    call: Any = {
        "renew": lambda: store.renew(token, ttl=30),
        "complete": lambda: store.complete(token, "late"),
        "release": lambda: store.release(token),
    }[path]
    body.update({"renew": {"ttl": 30}, "complete": {"result": "late"}, "release": {}}[path])
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", seen)
    try:
        refused = post(client, f"/{path}", body)
        by_api = list(statements)
        statements.clear()
        direct = call()
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert refused.status_code == 409 and refused.json()["reason"] == direct.reason == "stale fence"
    assert (refused.json()["holder"], refused.json()["current_fence"]) == (direct.holder, 2)
    assert by_api == statements and by_api  # the same statements: the write and its reason's read


def test_a_retried_completion_answers_as_the_first_and_never_overwrites(
    client: TestClient, store: JobStore
) -> None:
    store.enqueue("r")
    [lease] = post(client, "/claim", {"owner": "w", "ttl": 30}).json()["leases"]
    first = post(client, "/complete", {"lease": lease, "result": "v1"})
    retry = post(client, "/complete", {"lease": lease, "result": "v1"})
    assert first.status_code == retry.status_code == 200
    assert retry.json()["completed"] is True and retry.json()["replayed"] is True
    assert retry.json()["job"]["fence"] == first.json()["lease"]["fence"] == 1
    assert retry.json()["job"]["state"] == "done" and retry.json()["job"]["result"] == "v1"
    other = post(client, "/complete", {"lease": lease, "result": "v2"})
    assert other.status_code == 409 and other.json()["reason"] == "done"
    assert store.state("r").result == "v1"  # type: ignore[union-attr]
    # another owner presenting the same fence is no retry: refused
    forged = post(client, "/complete", {"lease": {**lease, "owner": "x"}, "result": "v1"})
    assert forged.status_code == 409


def test_a_retried_release_answers_released_and_a_release_after_a_new_claim_is_refused(
    client: TestClient, store: JobStore
) -> None:
    """(The store records no history: a retry is refused as released, the lease being over;
    with a history it is a replay, test_a_release_is_replayed_when_the_history_proves_it.)"""
    store.enqueue("k")
    [lease] = post(client, "/claim", {"owner": "w", "ttl": 30}).json()["leases"]
    first = post(client, "/release", {"lease": lease})
    again = post(client, "/release", {"lease": lease})
    assert first.status_code == 200 and first.json()["replayed"] is False
    assert again.status_code == 409 and again.json()["reason"] == "released"
    assert (again.json()["holder"], again.json()["current_fence"]) == (None, 1)
    [other] = post(client, "/claim", {"owner": "w2", "ttl": 30}).json()["leases"]
    assert other["fence"] == 2
    late = post(client, "/release", {"lease": lease})
    assert late.status_code == 409 and late.json()["reason"] == "stale fence"
    assert store.holder("k") == Lease("k", "w2", 2, store.holder("k").until)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/claim", {"owner": "w", "ttl": 0}, "ttl"),
        ("/claim", {"owner": "w", "ttl": "30"}, "ttl"),
        ("/claim", {"owner": 5, "ttl": 30}, "owner"),
        ("/claim", {"owner": "w", "ttl": 30, "limit": 0}, "limit"),
        ("/claim", {"owner": "w"}, "ttl"),
        ("/claim", {"owner": "w", "ttl": 30, "surprise": 1}, "surprise"),
        ("/complete", {"lease": {"job_id": "x", "owner": "w", "fence": "1"}, "result": "r"}, "fence"),
        ("/complete", {"lease": {"job_id": "x", "owner": "w", "fence": 1.0}, "result": "r"}, "fence"),
        ("/complete", {"lease": {"job_id": "x", "owner": "w", "fence": 1}, "result": 7}, "result"),
        ("/complete", {"lease": "x:w:1", "result": "r"}, "lease"),
        ("/renew", {"lease": {"job_id": "x", "owner": "w", "fence": 1}, "ttl": -1}, "ttl"),
        ("/enqueue", {"job_id": ["x"]}, "job_id"),
        ("/release", {"lease": {"job_id": "x", "owner": "w", "fence": 1}, "delay": float("inf")}, "delay"),
    ],
)
def test_bad_input_is_named_and_changes_nothing(
    client: TestClient, store: JobStore, path: str, body: dict[str, Any], field: str
) -> None:
    store.enqueue("x")
    before = store.state("x")
    if path == "/release" and body.get("delay") == float("inf"):
        raw = b'{"lease": {"job_id": "x", "owner": "w", "fence": 1}, "delay": Infinity}'
        answer = client.post(path, content=raw, headers={**AUTH, "content-type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"] == "MalformedJSON"
    else:
        answer = post(client, path, body)
        assert answer.status_code == 422, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["error"] in ("InvalidArgument", "InvalidArgumentType")
        assert field in problem["detail"]
    assert store.state("x") == before
    assert store.holder("x") is None


_L = {"job_id": "x", "owner": "w", "fence": 1}


@pytest.mark.parametrize(
    ("path", "body", "error", "says"),
    [
        # a JSON value of another type is refused, never converted
        ("/claim", {"owner": "w", "ttl": 30, "limit": True}, "InvalidArgumentType", "limit must be an int"),
        ("/claim", {"owner": "w", "ttl": 30, "limit": 2.0}, "InvalidArgumentType", "limit must be an int"),
        ("/claim", {"owner": "w", "ttl": 30, "limit": None}, "InvalidArgumentType", "limit must be an int"),
        ("/claim", {"owner": "w", "ttl": True}, "InvalidArgumentType", "ttl must be a real number"),
        (
            "/claim",
            {"owner": "w", "ttl": 30, "max_attempts": "3"},
            "InvalidArgumentType",
            "max_attempts must",
        ),
        ("/claim", {"owner": None, "ttl": 30}, "InvalidArgumentType", "owner must be a str, got NoneType"),
        (
            "/renew",
            {"lease": {**_L, "fence": True}, "ttl": 30},
            "InvalidArgumentType",
            "lease.fence must be an int",
        ),
        (
            "/renew",
            {"lease": {**_L, "fence": "1"}, "ttl": 30},
            "InvalidArgumentType",
            "lease.fence must be an int",
        ),
        (
            "/complete",
            {"lease": {**_L, "job_id": 7}, "result": "r"},
            "InvalidArgumentType",
            "lease.job_id must",
        ),
        ("/complete", {"lease": _L, "result": False}, "InvalidArgumentType", "result must be a str or None"),
        ("/release", {"lease": _L, "delay": "60"}, "InvalidArgumentType", "delay must be a real number"),
        (
            "/enqueue",
            {"job_id": "n", "ready_at": "now"},
            "InvalidArgumentType",
            "ready_at must be a real number",
        ),
        # a value of the right type, out of range
        ("/claim", {"owner": "w", "ttl": 10**400}, "InvalidArgument", "ttl must be a finite number within"),
        (
            "/claim",
            {"owner": "w", "ttl": 30, "limit": -1},
            "InvalidArgument",
            "limit must be at least 1, got -1",
        ),
        ("/release", {"lease": _L, "delay": 0}, "InvalidArgument", "delay must be > 0, got 0"),
        # the body's shape: fields missing or unknown, in a lease too
        ("/complete", {"lease": _L}, "InvalidArgument", "the body has no 'result'"),
        (
            "/renew",
            {"lease": {"job_id": "x", "owner": "w"}, "ttl": 30},
            "InvalidArgument",
            "lease has no 'fence'",
        ),
        (
            "/release",
            {"lease": {**_L, "holder": "w"}},
            "InvalidArgument",
            "unknown field(s) 'holder' in lease",
        ),
        (
            "/enqueue",
            {"job_id": "n", "b": 1, "a": 2},
            "InvalidArgument",
            "unknown field(s) 'a', 'b'; this call",
        ),
    ],
)
def test_a_field_is_of_its_own_json_type_and_range_or_refused(
    client: TestClient, store: JobStore, path: str, body: dict[str, Any], error: str, says: str
) -> None:
    """The request models are strict: a bool is no int, a string no number, 2.0 no count,
    null no default; the error is the library's, its detail names the field."""
    store.enqueue("x")
    before = store.state("x")
    answer = post(client, path, body)
    assert answer.status_code == 422, answer.text
    assert (answer.json()["error"], answer.json()["title"]) == (error, error)
    assert says in answer.json()["detail"], answer.json()["detail"]
    assert store.state("x") == before and store.state("n") is None


def test_who_may_act_is_judged_after_the_bodys_shape_and_before_its_values(
    two: TestClient, store: JobStore
) -> None:
    """Unknown fields and where the owner is come first (422); then who may act (403),
    before any value is judged; then the values, the API's bounds before the rest."""
    store.enqueue("j")
    lease = {"job_id": "j", "owner": "worker-a", "fence": 1}
    as_b = [
        ("/claim", {"owner": "worker-a", "ttl": 1e308}, 403),
        ("/claim", {"owner": "worker-a", "ttl": "30", "limit": True}, 403),
        ("/renew", {"lease": {**lease, "fence": "1"}, "ttl": -1}, 403),
        ("/release", {"lease": lease, "delay": "soon"}, 403),
        ("/claim", {"owner": "worker-a", "ttl": 30, "surprise": 1}, 422),
        ("/claim", {"ttl": 30}, 422),
        ("/renew", {"lease": {"job_id": "j", "owner": "worker-a"}, "ttl": 30}, 422),
        ("/complete", {"lease": "j:worker-a:1", "result": "r"}, 422),
    ]
    for path, body, status in as_b:
        answer = two.post(path, json=body, headers=AS_B)
        assert answer.status_code == status, (path, body, answer.text)
    both_wrong = two.post("/claim", json={"owner": 5, "ttl": 0, "limit": 0}, headers=AS_B)
    assert both_wrong.json()["detail"] == "ttl must be > 0, got 0"
    # an owner that is no text names itself (it was a 500: the 403 echoed it, unencodable)
    hdr = {**AS_B, "content-type": "application/json"}
    surrogate = two.post("/claim", content=b'{"owner": "\\ud800", "ttl": 30}', headers=hdr)
    assert surrogate.status_code == 422
    assert surrogate.json()["detail"].startswith(
        "owner cannot be stored as UTF-8 (lone surrogate at index 0)"
    )
    assert store.holder("j") is None and store.state("j").fence == 0  # type: ignore[union-attr]


def test_every_problem_is_the_documents_problem(client: TestClient, store: JobStore) -> None:
    """Each problem the API answers holds only the fields of the Problem model, which is the
    document's (a generated client reads every field it is sent)."""
    from fencing.web.models import Problem

    store.enqueue("p")
    [lease] = post(client, "/claim", {"owner": "go-1", "ttl": 30}).json()["leases"]
    assert post(client, "/complete", {"lease": lease, "result": "a"}).status_code == 200
    hdr = {**AUTH, "content-type": "application/json"}
    answers = [
        client.post("/claim", json={"owner": "w", "ttl": 30}),  # 401
        post(client, "/claim", {"owner": "stranger", "ttl": 30}),  # 403
        client.get("/jobs/none-such", headers=AUTH),  # 404
        post(client, "/complete", {"lease": lease, "result": "b"}),  # 409, done with another result
        post(client, "/renew", {"lease": lease, "ttl": 30}),  # 409, refused
        post(client, "/claim", {"owner": "w", "ttl": "30"}),  # 422
        client.post("/claim", content=b"{", headers=hdr),  # 400
        client.post("/claim", content=b"w", headers={**AUTH, "content-type": "text/plain"}),  # 415
        post(client, "/enqueue", {"job_id": "y" * (2 * 1024 * 1024)}),  # 413
    ]
    assert [a.status_code for a in answers] == [401, 403, 404, 409, 409, 422, 400, 415, 413]
    documented = client.get("/openapi.json").json()["components"]["schemas"]["Problem"]["properties"]
    assert set(documented) == set(Problem.model_fields)
    for answer in answers:
        assert answer.headers["content-type"] == "application/problem+json"
        assert set(answer.json()) <= set(Problem.model_fields), answer.json()
        Problem.model_validate(answer.json(), strict=True)


def test_bodies_that_are_not_json_objects_or_too_large_are_refused(
    client: TestClient, store: JobStore
) -> None:
    hdr = {**AUTH, "content-type": "application/json"}
    surrogate = client.post("/enqueue", content=b'{"job_id": "\\ud800"}', headers=hdr)
    assert surrogate.status_code == 422 and "job_id" in surrogate.json()["detail"]
    assert client.post("/claim", content=b"[1]", headers=hdr).status_code == 422
    assert client.post("/claim", content=b"{", headers=hdr).json()["error"] == "MalformedJSON"
    wrong = client.post("/claim", content=b"owner=w", headers={**AUTH, "content-type": "text/plain"})
    assert wrong.status_code == 415
    store.enqueue("big")
    huge = post(client, "/enqueue", {"job_id": "y" * (2 * 1024 * 1024)})
    assert huge.status_code == 413 and huge.json()["error"] == "BodyTooLarge"
    assert store.state("y" * 10) is None


def test_without_authorization_nothing_is_read_or_changed(client: TestClient, store: JobStore) -> None:
    store.enqueue("s")
    for headers in (
        {},
        {"Authorization": "Bearer wrong-token-wrong-token"},
        {"Authorization": f"Basic {TOKEN}"},
    ):
        claim = client.post("/claim", json={"owner": "w", "ttl": 30}, headers=headers)
        assert claim.status_code == 401 and claim.headers["www-authenticate"] == "Bearer"
        assert client.get("/jobs/s", headers=headers).status_code == 401
    assert store.holder("s") is None and store.state("s").fence == 0  # type: ignore[union-attr]


def test_state_of_any_id_and_of_no_job(client: TestClient, store: JobStore) -> None:
    # (no "%" in it: Starlette's TestClient decodes the path twice; a real server once,
    # which the curl test of test_web_http checks with "%2F" in an id)
    odd = "a/b?c#d e<script>"
    store.enqueue(odd)
    from urllib.parse import quote

    found = client.get("/jobs/" + quote(odd, safe=""), headers=AUTH)
    assert found.status_code == 200 and found.json()["job"]["job_id"] == odd
    missing = client.get("/jobs/none-such", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"] == "NotFound"


def test_the_openapi_document_names_every_route(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/claim", "/renew", "/complete", "/release", "/enqueue", "/jobs/{job_id}"}
    app_routes = {r.path for r in client.app.routes}  # type: ignore[attr-defined]
    assert {p.replace("{job_id}", "{job_id:path}") for p in doc["paths"]} <= app_routes


def test_the_openapi_document_names_every_answer_the_api_gives(client: TestClient) -> None:
    """The statuses this module's tests see each route answer with are all in the document
    (a generated client would otherwise fail on an answer it was never told of)."""
    doc = client.get("/openapi.json").json()["paths"]
    every = {"200", "401", "409", "422", "500", "503", "507"}
    for path in ("/claim", "/renew", "/complete", "/release", "/enqueue"):
        assert set(doc[path]["post"]["responses"]) >= every | {"400", "413", "415"}, path
    assert "201" in doc["/enqueue"]["post"]["responses"]
    assert set(doc["/jobs/{job_id}"]["get"]["responses"]) == every | {"404"}
    added = client.post("/enqueue", json={"job_id": "openapi-1"}, headers=AUTH)
    missing = client.get("/jobs/none-such", headers=AUTH)
    not_json = client.post("/claim", content=b"{", headers={**AUTH, "Content-Type": "application/json"})
    assert (added.status_code, missing.status_code, not_json.status_code) == (201, 404, 400)


def test_a_database_that_is_down_answers_503_with_retry_after(tmp_path: Any) -> None:
    from sqlalchemy import create_engine

    engine = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none", pool_pre_ping=False)
    pytest.importorskip("psycopg")
    app = lease_api(JobStore(engine), authorize=bearer_tokens({TOKEN: "w"}))
    with TestClient(app) as c:
        answer = c.post("/claim", json={"owner": "w", "ttl": 30}, headers=AUTH)
    assert answer.status_code == 503 and answer.json()["error"] == "DatabaseUnavailable"
    assert answer.headers["retry-after"] == "1"


def test_fencing_serves_app_counts_a_requeued_jobs_attempts_from_its_requeue(engine: Engine) -> None:
    """fencing serve --attempts-table: the API's claim with max_attempts takes a job the
    dashboard's Requeue gave its attempts back, above every fence it handed out."""
    from sqlalchemy import MetaData

    from fencing import attempts_table
    from fencing.cli.serve import app_for

    attempts = attempts_table(MetaData())
    workers = JobStore(engine, attempts=attempts)
    workers.create_table()
    workers.enqueue("a", ready_at=0.0)
    app = app_for(
        engine, workers.table, history=None, locks=None, interval=1.0, max_attempts=1,
        tokens={TOKEN: POOL}, attempts=attempts, hosts=["testserver"],
    )  # fmt: skip
    with TestClient(app) as client:
        [first] = post(client, "/api/claim", {"owner": "go-1", "ttl": 30, "max_attempts": 1}).json()["leases"]
        assert post(client, "/api/release", {"lease": first}).status_code == 200
        assert post(client, "/api/claim", {"owner": "go-1", "ttl": 30, "max_attempts": 1}).json() == {
            "leases": []
        }
        assert workers.requeue("a")
        [second] = post(client, "/api/claim", {"owner": "go-2", "ttl": 30, "max_attempts": 1}).json()[
            "leases"
        ]
        assert (first["fence"], second["fence"]) == (1, 2)
        page = client.get("/job?id=a")
        assert page.status_code == 200 and "held" in page.text


# -- a token acts only as its own owners ---------------------------------------------------


@pytest.fixture
def two(store: JobStore) -> Iterator[TestClient]:
    """Two workers, each with a token of its own (the name is the owner it acts as)."""
    app = lease_api(store, authorize=bearer_tokens({A: "worker-a", B: "worker-b"}))
    with TestClient(app) as c:
        yield c


def test_a_token_cannot_act_on_another_owners_lease(two: TestClient, store: JobStore) -> None:
    """worker-b reads worker-a's owner and fence (GET /jobs is open to every token) but
    cannot renew, complete or release under them, nor claim as worker-a: 403, nothing read
    or changed, and worker-a's own completion goes through."""
    store.enqueue("payroll-7")
    [lease] = two.post("/claim", json={"owner": "worker-a", "ttl": 60}, headers=AS_A).json()["leases"]
    job = two.get("/jobs/payroll-7", headers=AS_B).json()["job"]
    forged = {"job_id": "payroll-7", "owner": job["owner"], "fence": job["fence"]}
    for path, body in (
        ("/complete", {"lease": forged, "result": "written by worker-b"}),
        ("/renew", {"lease": forged, "ttl": 600}),
        ("/release", {"lease": forged}),
    ):
        answer = two.post(path, json=body, headers=AS_B)
        assert answer.status_code == 403, (path, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert (problem["error"], problem["owner"], problem["caller"]) == (
            "Forbidden",
            "worker-a",
            "worker-b",
        )
        assert "'worker-b' may not" in problem["detail"] and "'worker-a'" in problem["detail"]
    assert store.holder("payroll-7") == Lease("payroll-7", "worker-a", 1, lease["until"])
    store.enqueue("x")
    as_a = two.post("/claim", json={"owner": "worker-a", "ttl": 60}, headers=AS_B)
    assert as_a.status_code == 403 and as_a.json()["owner"] == "worker-a"
    assert store.holder("x") is None and store.state("x").fence == 0  # type: ignore[union-attr]
    done = two.post("/complete", json={"lease": lease, "result": "a's real result"}, headers=AS_A)
    assert done.status_code == 200 and store.state("payroll-7").result == "a's real result"  # type: ignore[union-attr]


def test_a_caller_acts_as_the_owners_it_is_granted_and_no_other(store: JobStore) -> None:
    """A Caller's owners (bearer_tokens, or any authorize returning one): each may claim;
    one not granted is refused; a token granted none only enqueues and reads."""
    store.enqueue("j1")
    store.enqueue("j2")
    producer = "token-of-the-producer-0123"
    tokens = {TOKEN: Caller("pool", owners=["go-1", "go-2"]), producer: Caller("producer", owners=[])}
    with TestClient(lease_api(store, authorize=bearer_tokens(tokens))) as c:
        assert c.post("/claim", json={"owner": "go-1", "ttl": 30}, headers=AUTH).json()["leases"]
        assert c.post("/claim", json={"owner": "go-2", "ttl": 30}, headers=AUTH).json()["leases"]
        assert c.post("/claim", json={"owner": "pool", "ttl": 30}, headers=AUTH).status_code == 403
        as_producer = {"Authorization": f"Bearer {producer}"}
        assert c.post("/enqueue", json={"job_id": "j3"}, headers=as_producer).status_code == 201
        refused = c.post("/claim", json={"owner": "producer", "ttl": 30}, headers=as_producer)
        assert refused.status_code == 403 and "(none)" in refused.json()["detail"]
    assert store.holder("j3") is None

    async def named(request: Any) -> str | None:  # a coroutine answering a plain name
        return "go-1" if request.headers.get("x-user") == "ann" else None

    store.enqueue("j4")
    with TestClient(lease_api(store, authorize=named)) as c:
        mine = c.post("/claim", json={"owner": "go-1", "ttl": 30}, headers={"x-user": "ann"})
        assert [x["job_id"] for x in mine.json()["leases"]] == ["j3"]
        other = c.post("/claim", json={"owner": "go-2", "ttl": 30}, headers={"x-user": "ann"})
        assert other.status_code == 403
    assert store.holder("j4") is None


@pytest.mark.parametrize("owners", ["go-1", ["go-1", 2], [""], 7])
def test_a_caller_names_its_owners_as_a_list_of_str(owners: Any) -> None:
    from fencing import InvalidArgumentType

    with pytest.raises(InvalidArgumentType, match="owners"):
        Caller("pool", owners=owners)


# -- a release is replayed only when it is proven ------------------------------------------


def test_a_release_is_no_replay_without_proof(two: TestClient, engine: Engine) -> None:
    """Without an ownership history the row cannot tell who ended a lease: a release the
    guard refuses answers 409 with its reason, for fence 0, after a requeue, for a stranger
    at the current fence, and for a retry of the holder's own release alike."""
    # an operator's store on the API's table: the one that requeues
    store = JobStore(engine, attempts=attempts_table(MetaData()))
    store.create_table()
    store.enqueue("fresh", ready_at=0)
    never = two.post(
        "/release", json={"lease": {"job_id": "fresh", "owner": "worker-a", "fence": 0}}, headers=AS_A
    )
    assert never.status_code == 409 and never.json()["reason"] == "stale fence"
    # refused unread (no claim hands out fence 0): nothing is said of the row
    assert (never.json()["holder"], never.json()["current_fence"]) == (None, None)
    store.enqueue("j", ready_at=0)
    a = store.claim("j", "worker-a", ttl=5, now=100.0)
    assert a is not None and store.requeue("j", now=200.0)  # a's lease had run out; an operator requeues
    late = two.post("/release", json={"lease": _lease(a)}, headers=AS_A)
    assert late.status_code == 409 and late.json()["reason"] == "released"
    assert "cannot tell who ended the lease" in late.json()["detail"]
    stranger = two.post("/release", json={"lease": {**_lease(a), "owner": "worker-b"}}, headers=AS_B)
    assert stranger.status_code == 409 and stranger.json()["reason"] == "released"
    [k] = two.post("/claim", json={"owner": "worker-a", "ttl": 60}, headers=AS_A).json()["leases"]
    first = two.post("/release", json={"lease": k}, headers=AS_A)
    assert first.status_code == 200 and first.json()["replayed"] is False
    again = two.post("/release", json={"lease": k}, headers=AS_A)
    assert again.status_code == 409 and again.json()["reason"] == "released"
    assert store.state(k["job_id"]).fence == 1 and store.holder(k["job_id"]) is None  # type: ignore[union-attr]


def _lease(lease: Lease) -> dict[str, Any]:
    return {"job_id": lease.job_id, "owner": lease.owner, "fence": lease.fence}


@pytest.fixture
def recorded(engine: Engine) -> JobStore:
    metadata = MetaData()
    # retention=None: the test's own clock (now=) writes history rows
    history = History(history_table(metadata), retention=None)
    s = JobStore(engine, history=history, attempts=attempts_table(metadata))
    s.create_table()
    return s


def test_a_release_is_replayed_when_the_history_proves_it_and_only_then(recorded: JobStore) -> None:
    """With the ownership history, a retried release of the holder's own lease answers 200
    replayed; the same lease after a requeue, a stranger at the released fence, and a lease
    whose release came after a claim since, are refused (409)."""
    store = recorded
    app = lease_api(store, authorize=bearer_tokens({A: "worker-a", B: "worker-b"}))
    with TestClient(app) as c:
        store.enqueue("k", ready_at=0)
        [k] = c.post("/claim", json={"owner": "worker-a", "ttl": 60}, headers=AS_A).json()["leases"]
        assert c.post("/release", json={"lease": k}, headers=AS_A).json()["replayed"] is False
        again = c.post("/release", json={"lease": k}, headers=AS_A)
        assert again.status_code == 200 and again.json()["replayed"] is True
        assert again.json()["job"]["fence"] == 1 and again.json()["job"]["owner"] is None
        stranger = c.post("/release", json={"lease": {**k, "owner": "worker-b"}}, headers=AS_B)
        assert stranger.status_code == 409 and stranger.json()["reason"] == "released"
        assert "no release by this owner" in stranger.json()["detail"]

        store.enqueue("j", ready_at=0)
        a = store.claim("j", "worker-a", ttl=60)
        assert a is not None and store.revoke("j") and store.requeue("j")
        # the fence moved with the revoke: the late release is stale, not a replay
        late = c.post("/release", json={"lease": _lease(a)}, headers=AS_A)
        assert late.status_code == 409 and late.json()["reason"] == "stale fence"

        store.enqueue("r", ready_at=0)
        b = store.claim("r", "worker-a", ttl=0.5, now=100.0)
        assert b is not None and store.requeue("r", now=200.0)  # run out, then requeued: no revoke
        requeued = c.post("/release", json={"lease": _lease(b)}, headers=AS_A)
        assert requeued.status_code == 409 and requeued.json()["reason"] == "released"
    assert [e.event for e in store.history("r")] == ["claim", "requeue", "refused"]


# -- history, max_attempts, bounds ---------------------------------------------------------


def test_fencing_serves_api_records_the_ownership_history(engine: Engine) -> None:
    """fencing serve --history-table: the API's claims and completions are recorded, as
    the dashboard's actions are."""
    from fencing.cli.serve import app_for

    history = history_table(MetaData())
    workers = JobStore(engine, history=History(history))
    workers.create_table()
    workers.enqueue("h", ready_at=0.0)
    app = app_for(
        engine, workers.table, history=history, locks=None, interval=1.0, max_attempts=None,
        tokens={TOKEN: POOL}, hosts=["testserver"],
    )  # fmt: skip
    with TestClient(app) as client:
        [lease] = post(client, "/api/claim", {"owner": "go-1", "ttl": 30}).json()["leases"]
        assert post(client, "/api/complete", {"lease": lease, "result": "ok"}).status_code == 200
        late = post(client, "/api/complete", {"lease": {**lease, "fence": 7}, "result": "no"})
        assert late.status_code == 409
    entries = workers.history("h")
    assert [(e.event, e.owner, e.fence) for e in entries] == [
        ("claim", "go-1", 1),
        ("complete", "go-1", 1),
        ("refused", "go-1", 7),
    ]


def test_fencing_serves_api_claims_apply_its_max_attempts(engine: Engine) -> None:
    """fencing serve --max-attempts N: a claim with no max_attempts of its own never takes a
    job claimed N times (one the dashboard shows poisoned); one asking for more is refused."""
    from fencing.cli.serve import app_for

    workers = JobStore(engine)
    workers.create_table()
    workers.enqueue("p", ready_at=0.0)
    app = app_for(
        engine, workers.table, history=None, locks=None, interval=1.0, max_attempts=1,
        tokens={TOKEN: POOL}, hosts=["testserver"],
    )  # fmt: skip
    with TestClient(app) as client:
        [first] = post(client, "/api/claim", {"owner": "go-1", "ttl": 30}).json()["leases"]
        assert post(client, "/api/release", {"lease": first}).status_code == 200
        assert post(client, "/api/claim", {"owner": "go-1", "ttl": 30}).json() == {"leases": []}
        more = post(client, "/api/claim", {"owner": "go-1", "ttl": 30, "max_attempts": 5})
        assert more.status_code == 422 and "max_attempts must be at most 1" in more.json()["detail"]
        page = client.get("/jobs?state=poisoned")
        assert page.status_code == 200 and 'data-job="p"' in page.text
    assert workers.state("p").fence == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/claim", {"owner": "w", "ttl": 1e308}, "ttl"),
        ("/claim", {"owner": "w", "ttl": MAX_TTL + 1}, "ttl"),
        ("/claim", {"owner": "w", "ttl": 10**400}, "ttl"),
        ("/claim", {"owner": "w", "ttl": 30, "limit": 100_000}, "limit"),
        ("/claim", {"owner": "w", "ttl": 30, "limit": MAX_LIMIT + 1}, "limit"),
        ("/renew", {"lease": {"job_id": "b0", "owner": "w", "fence": 1}, "ttl": 1e308}, "ttl"),
    ],
)
def test_ttl_and_limit_are_bounded(
    client: TestClient, store: JobStore, path: str, body: dict[str, Any], field: str
) -> None:
    """A lease longer than max_ttl (a day), a claim of more than max_limit (1,000) jobs:
    422 naming the field, nothing claimed or renewed."""
    for n in range(3):
        store.enqueue(f"b{n}")
    if path == "/renew":
        [lease] = post(client, "/claim", {"owner": "w", "ttl": 30}).json()["leases"]
        body = {**body, "lease": lease}
    before = [store.state(f"b{n}") for n in range(3)]
    answer = post(client, path, body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"].startswith(f"{field} must be"), answer.json()["detail"]
    assert [store.state(f"b{n}") for n in range(3)] == before


def test_the_bounds_are_the_apps_and_its_document_says_them(store: JobStore) -> None:
    for n in range(3):
        store.enqueue(f"c{n}")
    app = lease_api(store, authorize=bearer_tokens({TOKEN: POOL}), max_ttl=60, max_limit=2, max_attempts=3)
    with TestClient(app) as c:
        assert post(c, "/claim", {"owner": "w", "ttl": 61}).status_code == 422
        assert post(c, "/claim", {"owner": "w", "ttl": 30, "limit": 3}).status_code == 422
        assert len(post(c, "/claim", {"owner": "w", "ttl": 60, "limit": 2}).json()["leases"]) == 2
        claim = c.get("/openapi.json").json()["paths"]["/claim"]["post"]
    body = claim["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert (body["ttl"]["maximum"], body["limit"]["maximum"], body["max_attempts"]["maximum"]) == (60, 2, 3)
    assert "403" in claim["responses"]
    from fencing import InvalidArgument

    for bad in ({"max_ttl": 0}, {"max_limit": 0}, {"max_attempts": 0}):
        with pytest.raises(InvalidArgument):
            lease_api(store, authorize=bearer_tokens({TOKEN: POOL}), **bad)


def test_fencing_serves_default_bounds_are_the_apis() -> None:
    from fencing.cli.commands import build_parser

    args = build_parser().parse_args(["serve", "--url", "x.db"])
    assert (args.api_max_ttl, args.api_max_limit) == (MAX_TTL, MAX_LIMIT)


def test_closing_the_feed_waits_for_a_read_still_in_its_thread(engine: Engine, store: JobStore) -> None:
    """The application's shutdown closes the feed, then disposes the engine: a read still in
    its worker thread (its caller cancelled) holds a pooled connection, so close() returns only
    once it is back. Otherwise it goes back to a pool already disposed, and is never closed."""
    store.enqueue("shown")

    async def scenario() -> tuple[list[str], int]:
        feed = Feed(Overview(engine), interval=0.05)
        read, steps = feed._read, []

        def slow_read() -> dict[str, Any]:
            steps.append("began")
            time.sleep(0.3)
            try:
                return read()
            finally:
                steps.append("returned")

        feed._read = slow_read  # type: ignore[method-assign]
        watcher = asyncio.ensure_future(anext(feed.watch()))  # starts the feed's poll
        while not steps:
            await asyncio.sleep(0.01)
        watcher.cancel()
        await feed.close()
        assert isinstance(engine.pool, QueuePool)
        return list(steps), engine.pool.checkedout()

    steps, checked_out = asyncio.run(scenario())
    assert steps == ["began", "returned"] and checked_out == 0


def test_the_cli_the_api_and_the_feed_show_a_job_as_the_same_json(
    client: TestClient, store: JobStore, engine: Engine, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store.enqueue("shown")
    assert store.claim("shown", "go-1", ttl=300) is not None
    from_api = client.get("/jobs/shown", headers=AUTH).json()["job"]
    assert main(["jobs", "--url", target, "--json"]) == 0
    [from_cli] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    from_cli = {"job_id" if k == "id" else k: v for k, v in from_cli.items()}  # the CLI's name for it

    async def snapshot() -> dict[str, Any]:
        feed = Feed(Overview(engine))
        try:
            return await feed.latest()
        finally:
            await feed.close()

    [from_feed] = asyncio.run(snapshot())["expiring"]
    faces = [from_api, from_cli, from_feed]
    assert [list(j) for j in faces] == [list(from_api)] * 3, faces
    # each face read the job at its own instant: the same row, each with its own clock
    assert all(j["until_in"] == j["until"] - j["now"] for j in faces), faces
    timeless = [{k: v for k, v in j.items() if k not in ("now", "until_in")} for j in faces]
    assert timeless == [timeless[0]] * 3
    assert timeless[0] == {
        "job_id": "shown",
        "state": "held",
        "owner": "go-1",
        "fence": 1,
        "until": from_api["until"],
        "result": None,
    }


# -- a job's payload and its last failure, where the store keeps them ---------------------------


@pytest.fixture
def keeping(engine: Engine) -> Iterator[tuple[TestClient, JobStore]]:
    """The API on a store that keeps payloads and failures."""
    metadata = MetaData()
    kept = JobStore(engine, payloads=payloads_table(metadata), failures=failures_table(metadata))
    kept.create_table()
    with TestClient(lease_api(kept, authorize=bearer_tokens({TOKEN: POOL}))) as c:
        yield c, kept


def test_a_jobs_payload_goes_in_with_its_enqueue_and_out_with_its_claim(
    keeping: tuple[TestClient, JobStore],
) -> None:
    client, kept = keeping
    payload = {"order": 7, "lines": [{"sku": "é-1", "qty": 2}], "gift": None}
    assert post(client, "/enqueue", {"job_id": "o7", "payload": payload}).status_code == 201
    assert post(client, "/enqueue", {"job_id": "bare"}).status_code == 201
    leases = post(client, "/claim", {"owner": "go-1", "ttl": 30, "limit": 5}).json()["leases"]
    assert {lease["job_id"]: lease["payload"] for lease in leases} == {"o7": payload, "bare": None}
    assert kept.payload("o7") == payload
    shown = client.get("/jobs/o7", headers=AUTH).json()
    assert (shown["payload"], shown["failure"]) == (payload, None)


def test_a_released_attempts_failure_is_kept_and_shown_with_the_job(
    keeping: tuple[TestClient, JobStore],
) -> None:
    client, kept = keeping
    kept.enqueue("j")
    [lease] = post(client, "/claim", {"owner": "go-1", "ttl": 30}).json()["leases"]
    text = "Traceback (most recent call last):\nKeyError: 'sku'"
    released = post(client, "/release", {"lease": lease, "delay": 60, "failure": text})
    assert released.status_code == 200, released.json()
    failure = client.get("/jobs/j", headers=AUTH).json()["failure"]
    assert (failure["fence"], failure["text"]) == (1, text)
    assert isinstance(failure["at"], float)
    # a stale worker's failure is refused with its release, and the kept one stays
    late = post(client, "/release", {"lease": lease, "failure": "late"})
    assert late.status_code == 409
    assert client.get("/jobs/j", headers=AUTH).json()["failure"]["text"] == text


def test_an_api_whose_store_keeps_neither_says_so_and_changes_nothing(
    client: TestClient, store: JobStore
) -> None:
    refused = post(client, "/enqueue", {"job_id": "p", "payload": {"a": 1}})
    assert refused.status_code == 422
    assert "payload: this API's store keeps no payloads" in refused.json()["detail"]
    assert store.state("p") is None
    store.enqueue("j")
    [lease] = post(client, "/claim", {"owner": "go-1", "ttl": 30}).json()["leases"]
    assert "payload" not in lease  # the answer is as it was without payloads
    kept = post(client, "/release", {"lease": lease, "failure": "boom"})
    assert kept.status_code == 422
    assert "failure: this API's store keeps no failures" in kept.json()["detail"]
    assert store.holder("j") is not None  # still held: nothing changed
    shown = client.get("/jobs/j", headers=AUTH).json()
    assert "payload" not in shown and "failure" not in shown


def test_a_payload_that_is_not_json_is_refused_with_nothing_written(
    keeping: tuple[TestClient, JobStore],
) -> None:
    client, kept = keeping
    raw = b'{"job_id": "nan", "payload": {"x": NaN}}'
    refused = client.post("/enqueue", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert refused.status_code == 400  # not JSON: the body is refused before it is read
    assert kept.state("nan") is None
