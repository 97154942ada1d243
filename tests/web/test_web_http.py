"""A worker that is not Python: ``curl`` drives the lease API on a real server, on every backend.

The API runs on uvicorn (in this process); every request is a ``curl`` process, as a shell
script or a Go or Node worker would send it. A claim, a completion, and a stale completion
after a revoke that the guard refuses, with its reason, through real HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from sqlalchemy import Engine

pytest.importorskip("uvicorn", reason="the web extra is not installed: pip install 'fencing[web]'")

from fencing import JobStore
from fencing.web import Caller, bearer_tokens, lease_api
from tests.served import served

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

TOKEN = "curl-token-0123456789"

# a server and curl processes: once per database (the newest python and SQLAlchemy)
pytestmark = pytest.mark.slow


@pytest.fixture
def store(engine: Engine) -> JobStore:
    s = JobStore(engine)
    s.create_table()
    return s


@pytest.fixture
def api(store: JobStore) -> Iterator[str]:
    if shutil.which("curl") is None:
        if IN_CI:
            pytest.fail("CI runs the curl worker: curl is not installed", pytrace=False)
        pytest.skip("curl is not installed")
    pool = Caller("curl-worker", owners=["curl-1", "curl-2", "x"])
    with served(lease_api(store, authorize=bearer_tokens({TOKEN: pool}))) as url:
        yield url


def curl(
    url: str, body: dict[str, Any] | None = None, *, token: str = TOKEN, host: str | None = None
) -> tuple[int, str, Any]:
    """One request by curl: the status, the content type, the JSON body (``None`` if not JSON)."""
    argv = [
        "curl",
        "-sS",
        "-o",
        "-",
        "-w",
        "\n%{http_code} %{content_type}",
        "-H",
        f"Authorization: Bearer {token}",
    ]
    if host is not None:
        argv += ["-H", f"Host: {host}"]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    out = subprocess.run([*argv, url], capture_output=True, text=True, check=True, timeout=30).stdout
    text, _, tail = out.rpartition("\n")
    status, _, kind = tail.partition(" ")
    return int(status), kind, json.loads(text) if "json" in kind else None


def test_curl_claims_and_completes_and_its_stale_completion_is_refused(api: str, store: JobStore) -> None:
    job = "order/42%2F<x>"  # a slash, an escape and markup: the path carries any id
    status, _, body = curl(f"{api}/enqueue", {"job_id": job})
    assert status == 201 and body["enqueued"] is True
    status, _, body = curl(f"{api}/claim", {"owner": "curl-1", "ttl": 30})
    assert status == 200
    [lease] = body["leases"]
    assert lease["job_id"] == job and lease["fence"] == 1
    status, _, body = curl(f"{api}/jobs/{quote(job, safe='')}")
    assert status == 200 and body["job"]["state"] == "held" and body["job"]["owner"] == "curl-1"

    assert store.revoke(job)  # an operator cuts the worker off while it stalls
    status, kind, problem = curl(f"{api}/complete", {"lease": lease, "result": "stale"})
    assert status == 409 and kind == "application/problem+json"
    assert problem["reason"] == "stale fence" and problem["current_fence"] == 2
    row = store.state(job)
    assert row is not None and row.result is None and not row.done

    status, _, body = curl(f"{api}/claim", {"owner": "curl-2", "ttl": 30})
    [fresh] = body["leases"]
    assert fresh["fence"] == 3  # the revoke took fence 2
    status, _, body = curl(f"{api}/complete", {"lease": fresh, "result": "fresh"})
    assert status == 200 and body["completed"] is True and body["lease"]["fence"] == 3
    status, _, body = curl(f"{api}/complete", {"lease": fresh, "result": "fresh"})
    assert status == 200 and body["replayed"] is True
    assert store.state(job).result == "fresh"  # type: ignore[union-attr]


def test_curl_without_a_valid_token_gets_401_and_changes_nothing(api: str, store: JobStore) -> None:
    store.enqueue("locked-out")
    status, kind, problem = curl(f"{api}/claim", {"owner": "x", "ttl": 30}, token="not-the-token-at-all")
    assert status == 401 and kind == "application/problem+json" and problem["error"] == "Unauthorized"
    assert store.holder("locked-out") is None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fencing_serve_runs_the_dashboard_and_the_api(store: JobStore, target: str, tmp_path: Any) -> None:
    """The command as a user runs it: its own process, the dashboard at /, the API at /api."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# workers: the token, then the owners it acts as\n{TOKEN} cli cli-2\n")
    store.enqueue("served")
    port = free_port()
    argv = [sys.executable, "-m", "fencing", "serve", "--url", target, "--port", str(port)]
    with subprocess.Popen(
        [*argv, "--api-tokens", str(tokens), "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            deadline = time.monotonic() + 30
            while True:
                probe = subprocess.run(
                    ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://127.0.0.1:{port}/"],
                    capture_output=True,
                    text=True,
                )
                if probe.stdout == "200":
                    break
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "fencing serve did not answer within 30 s"
                time.sleep(0.2)
            status, _, body = curl(f"http://127.0.0.1:{port}/api/claim", {"owner": "cli", "ttl": 30})
            assert status == 200 and body["leases"][0]["job_id"] == "served"
            status, _, body = curl(f"http://127.0.0.1:{port}/api/claim", {"owner": "go-1", "ttl": 30})
            assert status == 403 and body["owner"] == "go-1"
            # a name rebound to this address (DNS rebinding) is not answered, pages nor API
            for path in ("/job?id=served", "/api/jobs/served"):
                status, _, _ = curl(f"http://127.0.0.1:{port}{path}", host=f"attacker.example:{port}")
                assert status == 400, path
            page = subprocess.run(
                ["curl", "-s", f"http://127.0.0.1:{port}/jobs?state=held"], capture_output=True, text=True
            ).stdout
            assert 'data-job="served"' in page and "actions off" in page
        finally:
            proc.terminate()
            proc.wait(15)
