"""The lease API over HTTP (fencing.web.lease_api), on every backend, through Starlette's client.

What a worker in another language relies on: the fence in every answer; a stale write
refused with its reason as problem details; a retried completion answering as the first
did and never overwriting; bad input named, with nothing changed; no answer without
authorization.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine

pytest.importorskip("starlette", reason="the web extra is not installed: pip install 'fencing[web]'")

from starlette.testclient import TestClient

from fencing import JobStore, Lease
from fencing.web import bearer_tokens, lease_api

TOKEN = "t0ken-for-the-go-worker"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def store(engine: Engine) -> JobStore:
    s = JobStore(engine)
    s.create_table()
    return s


@pytest.fixture
def client(store: JobStore) -> Iterator[TestClient]:
    app = lease_api(store, authorize=bearer_tokens({TOKEN: "worker-go"}))
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
    store.enqueue("k")
    [lease] = post(client, "/claim", {"owner": "w", "ttl": 30}).json()["leases"]
    first = post(client, "/release", {"lease": lease})
    again = post(client, "/release", {"lease": lease})
    assert first.status_code == again.status_code == 200
    assert first.json()["replayed"] is False and again.json()["replayed"] is True
    assert again.json()["job"]["fence"] == 1 and again.json()["job"]["owner"] is None
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
    from fencing.tools.serve import app_for

    attempts = attempts_table(MetaData())
    workers = JobStore(engine, attempts=attempts)
    workers.create_table()
    workers.enqueue("a", ready_at=0.0)
    app = app_for(
        engine, workers.table, history=None, locks=None, interval=1.0, max_attempts=1,
        tokens={TOKEN: "worker-go"}, attempts=attempts,
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
