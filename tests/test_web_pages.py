"""The dashboard (fencing.web.dashboard), on every backend, through Starlette's client.

Pages render what the table holds, escaped; listings walk in pages; actions are off without
``authorize`` and refused without the CSRF token or from another origin (nothing changed);
the live feed costs one read per interval however many watch. The browser tests
(tests/test_web_browser.py) drive the same pages in Chromium.
"""

from __future__ import annotations

import asyncio
import html as html_module
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData

pytest.importorskip("starlette", reason="the web extra is not installed: pip install 'fencing[web]'")

from starlette.testclient import TestClient

from fencing import History, JobStore, attempts_table, history_table
from fencing.web import dashboard

HOSTILE = ["<script>alert(1)</script>", "\"'><img src=x onerror=alert(1)>", "\u202eevil\u202c.txt", "a&b;c"]


@pytest.fixture
def history(engine: Engine) -> Any:
    table = history_table(MetaData())
    table.create(engine)
    return table


@pytest.fixture
def store(engine: Engine, history: Any) -> JobStore:
    s = JobStore(engine, history=History(history))
    s.create_table()
    return s


def page(client: TestClient, url: str) -> str:
    answer = client.get(url)
    assert answer.status_code == 200, answer.text
    assert "text/html" in answer.headers["content-type"]
    assert "script-src 'self'" in answer.headers["content-security-policy"]
    return answer.text


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


@pytest.fixture
def viewer(engine: Engine, store: JobStore, history: Any) -> Iterator[TestClient]:
    with TestClient(dashboard(engine, history=history)) as c:
        yield c


@pytest.fixture
def operator(engine: Engine, store: JobStore, history: Any) -> Iterator[TestClient]:
    app = dashboard(engine, history=history, authorize=lambda request: "alice")
    with TestClient(app, base_url="http://dash.test") as c:
        yield c


def test_the_overview_counts_by_state(viewer: TestClient, store: JobStore) -> None:
    for n in range(3):
        store.enqueue(f"j{n}")
    store.claim_next("w", ttl=60)
    html = page(viewer, "/")
    assert re.search(r'data-live="summary.ready">2<', html)
    assert re.search(r'data-live="summary.held">1<', html)
    assert "Leases ending soonest" in html and ">w<" in html


def test_the_jobs_walk_in_pages_of_fifty_with_no_job_twice(viewer: TestClient, store: JobStore) -> None:
    for n in range(120):
        store.enqueue(f"job-{n:03d}", ready_at=float(n))
    seen: list[str] = []
    url: str | None = "/jobs?state=ready"
    pages = 0
    while url:
        html = page(viewer, url)
        seen += re.findall(r'<tr data-job="([^"]+)"', html)
        found = re.search(r'<a href="([^"]+)" rel="next">', html)
        url = None if found is None else found.group(1).replace("&amp;", "&")
        pages += 1
    assert pages == 3
    assert seen == [f"job-{n:03d}" for n in range(120)]


def test_the_prefix_filter_is_exact(viewer: TestClient, store: JobStore) -> None:
    for job in ["order-1", "order-2", "ORDER-3", "order_x", "orderly"]:
        store.enqueue(job)
    html = page(viewer, "/jobs?prefix=order-")
    assert re.findall(r'<tr data-job="([^"]+)"', html) == ["order-1", "order-2"]
    assert re.findall(r'<tr data-job="([^"]+)"', page(viewer, "/jobs?prefix=order_")) == ["order_x"]


@pytest.mark.parametrize("job_id", HOSTILE)
def test_every_id_and_result_is_escaped(viewer: TestClient, store: JobStore, job_id: str) -> None:
    store.enqueue(job_id)
    [lease] = store.claim_next(job_id, ttl=60)
    assert store.complete(lease, job_id)
    for url in ("/jobs", "/jobs?state=done", "/job?id=" + urllib.parse.quote(job_id)):
        html = page(viewer, url)
        assert "<script>alert" not in html and "<img src=x" not in html
    html = page(viewer, "/job?id=" + urllib.parse.quote(job_id))
    assert "<bdi>" in html  # the id is isolated from the text around it


def test_a_job_page_shows_its_timeline_with_the_refused_write(viewer: TestClient, store: JobStore) -> None:
    store.enqueue("t")
    [first] = store.claim_next("slow", ttl=60)
    assert store.revoke("t")
    [second] = store.claim_next("fast", ttl=60)
    assert store.complete(second, "fast's")
    assert not store.complete(first, "slow's")
    html = page(viewer, "/job?id=t")
    events = re.findall(r'<li class="event (\w+)">', html)
    assert events == ["claim", "revoke", "claim", "complete", "refused"]
    assert "complete refused: done" in html


def test_without_authorize_there_are_no_actions_and_posts_are_refused(
    viewer: TestClient, store: JobStore
) -> None:
    store.enqueue("x")
    [lease] = store.claim_next("w", ttl=60)
    html = page(viewer, "/job?id=x")
    assert 'name="action"' not in html
    answer = viewer.post("/act", data={"action": "revoke", "id": "x", "csrf": csrf_of_cookie(viewer)})
    assert answer.status_code == 403
    assert store.holder("x") == lease


def csrf_of_cookie(client: TestClient) -> str:
    return client.cookies.get("fencing_csrf") or ""


def test_revoke_from_the_page_makes_the_holders_write_refused(operator: TestClient, store: JobStore) -> None:
    store.enqueue("r")
    [lease] = store.claim_next("stalled", ttl=60)
    html = page(operator, "/job?id=r")
    answer = operator.post(
        "/act", data={"action": "revoke", "id": "r", "csrf": csrf_of(html)}, follow_redirects=False
    )
    assert answer.status_code == 303
    assert "said=revoked" in answer.headers["location"]
    assert not store.complete(lease, "late")
    row = store.state("r")
    assert row is not None and row.fence == 2 and row.result is None
    shown = page(operator, answer.headers["location"])
    assert "Revoked" in shown and re.findall(r'<li class="event (\w+)">', shown)[-1] == "refused"


@pytest.mark.parametrize("trouble", ["no token", "wrong token", "other origin", "json body", "not allowed"])
def test_an_action_without_its_guards_changes_nothing(
    engine: Engine, operator: TestClient, store: JobStore, history: Any, trouble: str
) -> None:
    store.enqueue("g")
    [lease] = store.claim_next("w", ttl=60)
    token = csrf_of(page(operator, "/job?id=g"))
    form = {"action": "revoke", "id": "g", "csrf": token}
    client, headers, kwargs = operator, {}, {"data": form}
    if trouble == "no token":
        kwargs = {"data": {"action": "revoke", "id": "g"}}
    elif trouble == "wrong token":
        kwargs = {"data": {**form, "csrf": "x" * 43}}
    elif trouble == "other origin":
        headers = {"Origin": "http://evil.test"}
    elif trouble == "json body":
        kwargs = {"json": form}
    elif trouble == "not allowed":
        client = TestClient(
            dashboard(engine, history=history, authorize=lambda r: None), base_url="http://dash.test"
        )
        client.cookies.set("fencing_csrf", token)
    answer = client.post("/act", headers=headers, follow_redirects=False, **kwargs)
    assert answer.status_code in (403, 422), answer.text
    assert store.holder("g") == lease
    assert [e.event for e in store.history("g")] == ["claim"]


def test_release_delete_and_enqueue_from_the_page(operator: TestClient, store: JobStore) -> None:
    store.enqueue("d")
    [lease] = store.claim_next("w", ttl=60)
    token = csrf_of(page(operator, "/job?id=d"))
    released = operator.post(
        "/act", data={"action": "release", "id": "d", "csrf": token}, follow_redirects=False
    )
    assert "said=released" in released.headers["location"]
    assert store.holder("d") is None and store.state("d").fence == 1  # type: ignore[union-attr]
    again = operator.post(
        "/act", data={"action": "release", "id": "d", "csrf": token}, follow_redirects=False
    )
    assert "said=unchanged" in again.headers["location"]
    gone = operator.post("/act", data={"action": "delete", "id": "d", "csrf": token}, follow_redirects=False)
    assert "said=deleted" in gone.headers["location"]
    assert not store.enqueue("d") or store.state("d").fence == 1  # type: ignore[union-attr]
    new = operator.post(
        "/act", data={"action": "enqueue", "id": "n<1>", "csrf": token}, follow_redirects=False
    )
    assert "said=enqueued" in new.headers["location"] and store.state("n<1>") is not None
    assert not store.complete(lease, "late")


def requeue_button(html: str) -> str | None:
    """The attributes of the Requeue form's button (``None``: no such form)."""
    found = re.search(r'name="action" value="requeue">.*?<button type="submit" ?([^>]*)>', html, re.S)
    return None if found is None else found.group(1).strip()


def test_a_poisoned_job_is_requeued_from_the_page(engine: Engine, history: Any) -> None:
    """With the workers' attempts table, the poisoned job's page offers Requeue: pressed, the
    job is ready again for claim_next(max_attempts=...), its fence kept; a held job's Requeue
    is disabled and a post of it changes nothing; without the table the action is refused."""
    attempts = attempts_table(MetaData())
    s = JobStore(engine, history=History(history, retention=None), attempts=attempts)
    s.create_table()
    s.enqueue("p", ready_at=0.0)
    s.enqueue("h", ready_at=0.0)
    [first] = s.claim_next("w", ttl=1.0, now=1.0, max_attempts=1)
    assert first.job_id in ("p", "h")
    [held] = s.claim_next("w", ttl=600.0, max_attempts=1)
    poisoned = first.job_id
    app = dashboard(engine, history=history, attempts=attempts, max_attempts=1, authorize=lambda r: "alice")
    with TestClient(app, base_url="http://dash.test") as client:
        html = page(client, f"/job?id={poisoned}")
        assert "poisoned" in html and requeue_button(html) == ""
        token = csrf_of(html)
        answer = client.post(
            "/act", data={"action": "requeue", "id": poisoned, "csrf": token}, follow_redirects=False
        )
        assert "said=requeued" in answer.headers["location"]
        assert [j.job_id for j in s.poisoned(1)] == []
        [again] = s.claim_next("w2", ttl=600.0, max_attempts=1)
        assert (again.job_id, again.fence) == (poisoned, 2)
        assert [e.event for e in s.history(poisoned)][-2:] == ["requeue", "claim"]
        held_page = page(client, f"/job?id={held.job_id}")
        assert requeue_button(held_page) == "disabled"
        refused = client.post(
            "/act", data={"action": "requeue", "id": held.job_id, "csrf": token}, follow_redirects=False
        )
        assert "said=unchanged" in refused.headers["location"] and s.holder(held.job_id) == held
    plain = dashboard(engine, history=history, authorize=lambda r: "alice")
    with TestClient(plain, base_url="http://dash.test") as client:
        html = page(client, f"/job?id={held.job_id}")
        assert requeue_button(html) is None
        answer = client.post(
            "/act",
            data={"action": "requeue", "id": held.job_id, "csrf": csrf_of(html)},
            follow_redirects=False,
        )
        assert answer.status_code == 422 and "attempts table" in answer.text
        assert s.holder(held.job_id) == held


@pytest.mark.parametrize("text", ["'; DROP TABLE jobs; --", '" OR 1=1 --', "%", "_", "\\", "*", "[a-z]"])
def test_a_prefix_is_data_never_sql(viewer: TestClient, store: JobStore, text: str) -> None:
    store.enqueue(text + "-mine")
    store.enqueue("unrelated")
    html = page(viewer, "/jobs?prefix=" + urllib.parse.quote(text))
    shown = re.findall(r'<tr data-job="([^"]+)"', html)
    assert [html_module.unescape(s) for s in shown] == [text + "-mine"]
    assert store.state("unrelated") is not None  # the table is there, untouched


def test_sizes_are_bounded(operator: TestClient, store: JobStore) -> None:
    long_id = "x" * 5000
    assert operator.get("/job?id=" + long_id).status_code == 422
    assert operator.get("/jobs?prefix=" + long_id).status_code == 422
    token = csrf_of(page(operator, "/jobs"))
    huge = operator.post("/act", data={"action": "enqueue", "id": "y" * 40_000, "csrf": token})
    assert huge.status_code == 413
    assert operator.get("/jobs?after=not-a-cursor").status_code == 422
    assert operator.get("/jobs?state=nonsense").status_code == 422


def test_fifty_watchers_cost_one_read_per_interval(engine: Engine, store: JobStore) -> None:
    store.enqueue("w")
    app = dashboard(engine, interval=0.2)
    feed = app.state.dashboard.feed

    async def watch_all() -> list[int]:
        async def one() -> int:
            got = 0
            async for snap in feed.watch():
                if snap is not None:
                    got += 1
                if got == 5:
                    return got
            return got

        return await asyncio.gather(*(one() for _ in range(50)))

    counts = asyncio.run(watch_all())
    assert counts == [5] * 50
    assert 5 <= feed.reads <= 7  # one per interval (and at most a read's slack at each end)


def test_event_streams_are_bounded(engine: Engine, store: JobStore) -> None:
    app = dashboard(engine, interval=0.2, max_streams=1)
    d = app.state.dashboard
    d.feed.watchers = 1  # one stream open already
    with TestClient(app) as c:
        answer = c.get("/events")
    assert answer.status_code == 503 and answer.json()["error"] == "TooManyStreams"
