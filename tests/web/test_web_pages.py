"""The dashboard (fencing.web.dashboard), on every backend, through Starlette's client.

Pages render what the table holds, escaped; listings walk in pages; reads are authorized as
actions are, and only the allowed Host names answered; actions are off without ``authorize``
and refused without the signed CSRF token or from another origin (nothing changed); the live
feed costs one read per interval however many watch, and at most ``max_streams`` stream. The
browser tests (tests/web/test_web_browser.py) drive the same pages in Chromium.
"""

from __future__ import annotations

import asyncio
import functools
import html as html_module
import re
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData

pytest.importorskip("starlette", reason="the web extra is not installed: pip install 'fencing[web]'")

from starlette.testclient import TestClient

from fencing import (
    History,
    InvalidArgument,
    InvalidArgumentType,
    JobStore,
    attempts_table,
    failures_table,
    payloads_table,
)
from fencing.overview import Overview
from fencing.web import dashboard

HOSTILE = ["<script>alert(1)</script>", "\"'><img src=x onerror=alert(1)>", "\u202eevil\u202c.txt", "a&b;c"]


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
    # who holds leases: the owner, its jobs, when its first lease ends
    holders = html.split('id="holders"')[1].split("</table>")[0]
    assert '<td><bdi>w</bdi></td><td class="num">1</td>' in holders, holders
    assert re.search(r">(59s|1m 00s)<", holders), holders  # as the command line writes it


def test_who_holds_leases_says_so_when_nobody_does(viewer: TestClient, store: JobStore) -> None:
    store.enqueue("waiting")
    assert "no lease is held: no worker is busy" in page(viewer, "/")


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


def test_the_jobs_page_both_ways_with_their_place_and_total(viewer: TestClient, store: JobStore) -> None:
    for n in range(120):
        store.enqueue(f"job-{n:03d}", ready_at=float(n))
    said = []
    forward: list[list[str]] = []
    url: str | None = "/jobs?state=ready"
    while url:
        html = page(viewer, url)
        forward.append(re.findall(r'<tr data-job="([^"]+)"', html))
        said.append(
            " ".join(re.search(r'<p class="count" id="count">(.*?)</p>', html, re.S).group(1).split())
        )
        found = re.search(r'<a href="([^"]+)" rel="next">', html)
        url = None if found is None else found.group(1).replace("&amp;", "&")
    assert [len(p) for p in forward] == [50, 50, 20]
    to = "\u2013"  # an en dash: 1-50
    assert [s.split(" <span")[0] for s in said] == [
        f"1{to}50 of 120 ready jobs",
        f"51{to}100 of 120 ready jobs",
        f"101{to}120 of 120 ready jobs",
    ]
    assert 'rel="prev"' not in page(viewer, "/jobs?state=ready")  # the first page has none
    backward: list[list[str]] = [forward[-1]]
    back = re.search(r'<a href="([^"]+)" rel="prev">', html)
    while back is not None:
        html = page(viewer, back.group(1).replace("&amp;", "&"))
        backward.append(re.findall(r'<tr data-job="([^"]+)"', html))
        back = re.search(r'<a href="([^"]+)" rel="prev">', html)
    assert backward == forward[::-1]  # the same pages, each in its order, none skipped
    assert f"1{to}50 of 120" in html and 'rel="next"' in html
    # the same walk on the library's listing: before= the first job of a page is the page before it
    ov = Overview(store.engine)
    second = ov.jobs("ready", limit=50, after=ov.jobs("ready", limit=50)[-1].cursor)
    assert [j.job_id for j in ov.jobs("ready", limit=50, before=second[0].cursor)] == forward[0]
    assert [j.job_id for j in ov.jobs(None, limit=3, before=second[0].cursor)] == forward[0][-3:]
    with pytest.raises(InvalidArgument, match="not both"):
        ov.jobs("ready", after=second[0].cursor, before=second[0].cursor)


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
    store.enqueue(job_id + "-held")
    assert store.claim_next(job_id, ttl=60)  # its owner is shown among the holders
    html = page(viewer, "/")
    assert "<script>alert" not in html and "<img src=x" not in html


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


def test_a_job_page_shows_its_payload_and_its_last_failure_escaped(engine: Engine) -> None:
    metadata = MetaData()
    workers = JobStore(engine, payloads=payloads_table(metadata), failures=failures_table(metadata))
    workers.create_table()
    workers.enqueue("o1", payload={"to": HOSTILE[0], "n": 2})
    workers.enqueue("plain")
    [lease] = workers.claim_next("w", ttl=60)
    assert workers.release(
        lease, delay=60, failure=f"Traceback (most recent call last):\nValueError: {HOSTILE[1]}"
    )
    board = dashboard(engine, payloads=workers.payloads, failures=workers.failures)
    with TestClient(board) as c:
        html = page(c, "/job?id=o1")
        assert "<script>alert" not in html and "<img src=x" not in html
        payload = re.search(r'<pre id="job-payload">(.*?)</pre>', html, re.S)
        assert payload is not None
        assert (
            html_module.unescape(payload.group(1)) == '{\n  "to": "<script>alert(1)</script>",\n  "n": 2\n}'
        )
        assert "Attempt with fence 1, handed back at" in html
        failure = re.search(r'<pre id="job-failure">(.*?)</pre>', html, re.S)
        assert failure is not None and "ValueError:" in html_module.unescape(failure.group(1))
        bare = page(c, "/job?id=plain")
        assert 'id="job-payload"' not in bare and "Last failure" not in bare
    # a dashboard not given the tables shows neither
    with TestClient(dashboard(engine)) as c:
        html = page(c, "/job?id=o1")
        assert 'id="job-payload"' not in html and "Last failure" not in html


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


def test_the_overview_lists_the_schedules_their_ticks_and_the_last_ones_job(
    engine: Engine, store: JobStore
) -> None:
    from fencing import Schedule, Scheduler

    clock = [1796601600.0]  # 2026-12-07 00:00 UTC
    scheduler = Scheduler(
        store, [Schedule("<b>hourly</b>", every=3600, missed="all")], clock=lambda: clock[0]
    )
    scheduler.create_table()
    with TestClient(dashboard(engine)) as plain:
        assert 'id="schedules"' not in page(plain, "/")  # not given: no section
    with TestClient(dashboard(engine, schedules=scheduler.table, interval=0.05)) as c:
        html = page(c, "/")
        assert "no schedule has run yet" in html
        scheduler.run_pending()
        clock[0] += 2 * 3600 + 5
        _, second = scheduler.run_pending()
        assert store.complete(store.claim(second, "w", ttl=60), "ok")
        time.sleep(0.1)  # the feed reads again
        html = page(c, "/")
    listed = html.split('id="schedules"')[1].split("</table>")[0]
    assert "<bdi>&lt;b&gt;hourly&lt;/b&gt;</bdi>" in listed and "<b>hourly" not in listed  # escaped
    assert "every 1 h" in listed
    assert "2026-12-07 02:00:00.000 UTC" in listed and "2026-12-07 03:00:00.000 UTC" in listed
    [(href, state)] = re.findall(r'href="/job\?id=([^"]+)">(\w+)</a>', listed)
    assert (urllib.parse.unquote(href), state) == (second, "done"), listed
    store.delete(second)
    with TestClient(dashboard(engine, schedules=scheduler.table)) as c:
        assert ">deleted</a>" in page(c, "/").split('id="schedules"')[1].split("</table>")[0]


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
        assert re.search(r'<dd id="job-attempts">1 of 1\s', html)  # its one attempt, of one
        token = csrf_of(html)
        answer = client.post(
            "/act", data={"action": "requeue", "id": poisoned, "csrf": token}, follow_redirects=False
        )
        assert "said=requeued" in answer.headers["location"]
        assert [j.job_id for j in s.poisoned(1)] == []
        [again] = s.claim_next("w2", ttl=600.0, max_attempts=1)
        assert (again.job_id, again.fence) == (poisoned, 2)
        assert [e.event for e in s.history(poisoned)][-2:] == ["requeue", "claim"]
        # counted from the requeue: its fence is 2, its attempts 1 since the requeue at fence 1
        shown = page(client, f"/job?id={poisoned}")
        assert re.search(r'<dd id="job-attempts">1 of 1\s', shown) and "since its requeue at fence 1" in shown
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
        assert re.search(r'<dd id="job-attempts">1\s', html) and "max_attempts is not known here" in html
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
    d.streams = 1  # one stream open already
    with TestClient(app) as c:
        answer = c.get("/events")
    assert answer.status_code == 503 and answer.json()["error"] == "TooManyStreams"
    assert d.streams == 1


async def open_streams(app: Any, count: int) -> tuple[list[int], int]:
    """``count`` requests of ``/events`` at once, as a server sends them: the status each
    got, once all have one; then every client goes away. Also the streams still counted
    open after that (none should be)."""
    statuses: list[int] = []
    gone = asyncio.Event()
    answered = asyncio.Event()

    async def one() -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
            "scheme": "http", "path": "/events", "raw_path": b"/events", "root_path": "",
            "query_string": b"", "headers": [(b"host", b"dash.test")], "server": ("dash.test", 80),
            "client": ("127.0.0.1", 5000),
        }  # fmt: skip

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
                if len(statuses) == count:
                    answered.set()
            await asyncio.sleep(0)  # a server's send yields to the other connections

        await app(scope, receive, send)

    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    await asyncio.wait_for(answered.wait(), 10)
    gone.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    d = app.state.dashboard
    await d.feed.close()
    return statuses, d.streams


def test_event_streams_opened_at_once_never_exceed_max_streams(engine: Engine, store: JobStore) -> None:
    """Thirty requests of /events at once with max_streams=2: two streams, 28 refused (503),
    and every slot given back when the clients go away."""
    app = dashboard(engine, interval=0.2, max_streams=2)
    statuses, left = asyncio.run(open_streams(app, 30))
    assert sorted(statuses) == [200] * 2 + [503] * 28
    assert left == 0


# -- reads are authorized, the Host checked -----------------------------------------------

#: every read of the dashboard: its pages, their live fragments and the event stream
READS = ["/", "/?fragment=1", "/jobs", "/jobs?fragment=1", "/job?id=salary", "/job?id=salary&fragment=1",
         "/marks", "/locks", "/events"]  # fmt: skip


def test_reads_are_refused_when_authorize_refuses(engine: Engine, store: JobStore, history: Any) -> None:
    """With an authorize that refuses everyone, no page, fragment or event stream shows a
    job: 403 for each (the event stream before it starts)."""
    store.enqueue("salary")
    lease = store.claim("salary", "payroll-worker-3", ttl=600)
    assert lease is not None and store.complete(lease, "IBAN DE89 3704")
    app = dashboard(engine, history=history, authorize=lambda request: None)
    with TestClient(app) as c:
        for url in READS:
            answer = c.get(url)
            assert answer.status_code == 403, (url, answer.status_code)
            assert "salary" not in answer.text and "payroll-worker-3" not in answer.text, url
            assert "IBAN" not in answer.text, url
    assert app.state.dashboard.streams == 0


def test_reads_ask_authorize_or_authorize_reads(engine: Engine, store: JobStore, history: Any) -> None:
    """Reads ask authorize by default; authorize_reads names another callable (readers
    besides the operators), or False opens them; a dashboard without authorize is open."""
    store.enqueue("salary")

    def operators(request: Any) -> str | None:
        return request.headers.get("x-operator")

    def viewers(request: Any) -> str | None:
        return request.headers.get("x-viewer") or request.headers.get("x-operator")

    board = functools.partial(dashboard, engine, history=history)
    cases = [
        (board(authorize=operators), {"x-operator": "ann"}, {"x-viewer": "bo"}),
        (board(authorize=operators, authorize_reads=viewers), {"x-viewer": "bo"}, {}),
        (board(authorize=operators, authorize_reads=False), {}, None),
        (board(), {}, None),
    ]
    for app, allowed, refused in cases:
        with TestClient(app) as c:
            for url in READS[:-1]:
                assert c.get(url, headers=allowed).status_code == 200, url
                if refused is not None:
                    assert c.get(url, headers=refused).status_code == 403, url
    with pytest.raises(InvalidArgumentType, match="authorize_reads"):
        dashboard(engine, authorize_reads="yes")  # type: ignore[arg-type]


def test_a_host_not_allowed_is_refused(engine: Engine, store: JobStore) -> None:
    """allowed_hosts: a page asked for under another name (a DNS rebinding) is refused."""
    store.enqueue("customer-4711")
    app = dashboard(engine, allowed_hosts=["dash.test", "*.dash.test"])
    with TestClient(app, base_url="http://attacker.example") as c:
        answer = c.get("/job?id=customer-4711")
        assert answer.status_code == 400 and "customer-4711" not in answer.text
        assert c.get("/events").status_code == 400
    for base in ("http://dash.test", "http://eu.dash.test:8080"):
        with TestClient(app, base_url=base) as c:
            assert c.get("/job?id=customer-4711").status_code == 200
    for bad in ("dash.test", [""], ["a*b"], []):
        with pytest.raises((InvalidArgument, InvalidArgumentType), match=r"allowed_hosts|wildcard"):
            dashboard(engine, allowed_hosts=bad)  # type: ignore[arg-type]


def test_fencing_serve_answers_only_the_hosts_it_binds(engine: Engine, store: JobStore) -> None:
    """fencing serve's app: localhost, 127.0.0.1, [::1], --host and --allowed-host; no other."""
    from fencing.cli.serve import allowed_hosts, app_for

    store.enqueue("customer-4711")
    hosts = allowed_hosts("127.0.0.1", ["dash.internal"])
    app = app_for(engine, store.table, history=None, locks=None, interval=1.0, max_attempts=None,
                  tokens={"a-token-of-sixteen-chars": "w"}, hosts=hosts)  # fmt: skip
    for base, status in [
        ("http://attacker.example:8000", 400),
        ("http://127.0.0.1:8000", 200),
        ("http://localhost:8000", 200),
        ("http://[::1]:8000", 200),
        ("http://dash.internal", 200),
    ]:
        with TestClient(app, base_url=base) as c:
            assert c.get("/job?id=customer-4711").status_code == status, base
            claim = c.post("/api/claim", json={"owner": "w", "ttl": 1})
            assert claim.status_code == (400 if status == 400 else 401), base
    assert allowed_hosts("0.0.0.0") == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts("::1") == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts("10.1.2.3") == ["localhost", "127.0.0.1", "[::1]", "10.1.2.3"]


# -- CSRF: a signed token, no null origin --------------------------------------------------


def test_a_post_with_origin_null_is_refused(operator: TestClient, store: JobStore) -> None:
    """Origin: null (a sandboxed frame, a data: URL) is no origin of the dashboard's."""
    store.enqueue("victim")
    [lease] = store.claim_next("w", ttl=600)
    token = csrf_of(page(operator, "/job?id=victim"))
    answer = operator.post(
        "/act",
        data={"action": "revoke", "id": "victim", "csrf": token},
        headers={"Origin": "null"},
        follow_redirects=False,
    )
    assert answer.status_code == 403 and "another origin" in answer.text
    assert store.holder("victim") == lease
    same = operator.post(
        "/act",
        data={"action": "revoke", "id": "victim", "csrf": token},
        headers={"Origin": "http://dash.test"},
        follow_redirects=False,
    )
    assert same.status_code == 303 and store.holder("victim") is None


def test_a_cookie_and_token_an_attacker_chose_are_refused(
    engine: Engine, store: JobStore, history: Any
) -> None:
    """The CSRF token is the dashboard's HMAC of the cookie and of who acts: a pair the
    attacker made up (a cookie tossed from a sibling subdomain), or one signed for another
    operator, is refused; nothing changes."""
    store.enqueue("victim")
    [lease] = store.claim_next("w", ttl=600)

    def operators(request: Any) -> str | None:
        return request.headers.get("x-operator")

    app = dashboard(engine, history=history, authorize=operators)
    with TestClient(app, base_url="https://dash.example.com") as c:
        forged = "A" * 43
        c.cookies.set("fencing_csrf", forged, domain="dash.example.com")
        made_up = c.post(
            "/act",
            data={"action": "revoke", "id": "victim", "csrf": forged},
            headers={"x-operator": "alice"},
            follow_redirects=False,
        )
        assert made_up.status_code == 403 and "CSRF" in made_up.text
        # mallory's own page signs the planted cookie for mallory, not for alice
        mallorys = csrf_of(c.get("/job?id=victim", headers={"x-operator": "mallory"}).text)
        as_alice = c.post(
            "/act",
            data={"action": "revoke", "id": "victim", "csrf": mallorys},
            headers={"x-operator": "alice"},
            follow_redirects=False,
        )
        assert as_alice.status_code == 403
        assert store.holder("victim") == lease
        alices = csrf_of(c.get("/job?id=victim", headers={"x-operator": "alice"}).text)
        assert alices != forged and alices != mallorys
        pressed = c.post(
            "/act",
            data={"action": "revoke", "id": "victim", "csrf": alices},
            headers={"x-operator": "alice"},
            follow_redirects=False,
        )
        assert pressed.status_code == 303 and store.holder("victim") is None
    other = dashboard(engine, history=history, authorize=operators)  # another secret
    with TestClient(other, base_url="https://dash.example.com") as c:
        c.cookies.set("fencing_csrf", forged, domain="dash.example.com")
        stale = c.post(
            "/act",
            data={"action": "enqueue", "id": "n", "csrf": alices},
            headers={"x-operator": "alice"},
            follow_redirects=False,
        )
        assert stale.status_code == 403 and store.state("n") is None
    for bad in ("short", b"x" * 31, 7):
        with pytest.raises((InvalidArgument, InvalidArgumentType), match="csrf_secret"):
            dashboard(engine, csrf_secret=bad)  # type: ignore[arg-type]


# -- bad input -----------------------------------------------------------------------------


def test_a_cursor_past_a_floats_range_is_refused_naming_the_cursor(viewer: TestClient) -> None:
    """A page cursor whose until is an int too large for a float: 422 naming the cursor
    (it was an OverflowError, a 500)."""
    import base64
    import json

    for until in (int("9" * 400), -int("9" * 400)):
        raw = json.dumps([0, until, "j"]).encode()
        after = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        answer = viewer.get("/jobs?after=" + after)
        assert answer.status_code == 422, answer.text[:200]
        assert "not a cursor of this listing" in answer.text


def test_the_chart_has_a_time_axis_and_its_range(viewer: TestClient, store: JobStore) -> None:
    from fencing.web.pages import _chart

    html = page(viewer, "/")
    assert "Per minute, over the last 1m 00s" in html  # 60 reads of the feed, one a second
    assert "<span>1m 00s ago</span><span>30s ago</span><span>now</span>" in html
    # each point at its instant on the axis: a feed that started 30 s ago draws from the middle
    series = [{"at": 970.0, "claims": 4.0, "completions": 2.0, "refused": None},
              {"at": 1000.0, "claims": 8.0, "completions": 0.0, "refused": None}]  # fmt: skip
    drawn = _chart(series, 60.0, 1000.0)
    assert drawn["claims"] == "300.0,80.0 600.0,5.0" and drawn["completions"] == "300.0,117.5 600.0,155.0"
    assert drawn["refused"] == "" and drawn["peak"] == 8
    assert _chart(series, 60.0, 1045.0)["claims"] == "150.0,5.0"  # 75 s old: off the axis


OPERATOR = "an-operator-token-of-32-characters"


def test_operators_sign_in_with_a_token_to_act_and_out_again(
    engine: Engine, store: JobStore, history: Any
) -> None:
    store.enqueue("r")
    [lease] = store.claim_next("w", ttl=60)
    app = dashboard(engine, history=history, operator_tokens={OPERATOR: "alice"})
    with TestClient(app, base_url="http://dash.test") as c:
        html = page(c, "/job?id=r")  # the pages are open; acting needs signing in
        assert 'href="/login">sign in</a>' in html and ">Revoke</button>" not in html
        assert 'href="/login">sign in</a> to act</footer>' in html
        refused = c.post(
            "/act",
            data={"action": "revoke", "id": "r", "csrf": "none: no form is shown"},
            follow_redirects=False,
        )
        assert refused.status_code == 403 and store.state("r").fence == lease.fence
        wrong = c.post("/login", data={"token": "not-" + OPERATOR}, follow_redirects=False)
        assert wrong.status_code == 403 and "none of the operators" in wrong.text
        assert "fencing_operator" not in c.cookies
        signed = c.post("/login", data={"token": OPERATOR}, follow_redirects=False)
        assert signed.status_code == 303 and signed.headers["location"] == "/?said=signed-in"
        cookie = signed.headers["set-cookie"]
        assert "fencing_operator=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
        html = page(c, "/job?id=r")
        assert "alice" in html.split("</header>")[0] and "sign out" in html and ">Revoke</button>" in html
        done = c.post(
            "/act", data={"action": "revoke", "id": "r", "csrf": csrf_of(html)}, follow_redirects=False
        )
        assert done.status_code == 303 and store.state("r").fence == lease.fence + 1
        assert not store.complete(lease, "late")  # the holder's token is stale now
        out = c.post("/logout", data={"csrf": csrf_of(html)}, follow_redirects=False)
        assert out.status_code == 303 and "fencing_operator" not in c.cookies
        html = page(c, "/job?id=r")
        again = c.post(
            "/act",
            data={"action": "delete", "id": "r", "csrf": "none: no form is shown"},
            follow_redirects=False,
        )
        assert again.status_code == 403 and store.state("r") is not None
    with pytest.raises(InvalidArgument, match="at least 16 characters"):
        dashboard(engine, operator_tokens={"short": "bob"})
    with pytest.raises(InvalidArgumentType):
        dashboard(engine, operator_tokens=[(OPERATOR, "bob")])  # type: ignore[arg-type]


def test_fencing_serve_turns_the_actions_on_for_its_operator_tokens(
    engine: Engine, store: JobStore, tmp_path: Any
) -> None:
    from fencing.cli.serve import app_for, read_operators

    tokens = tmp_path / "operators.txt"
    tokens.write_text(f"# who may act on the dashboard\n{OPERATOR} alice\n", encoding="utf-8")
    operators = read_operators(str(tokens))
    assert operators == {OPERATOR: "alice"}
    bad = {
        "short alice\n": "at least 16",
        f"{OPERATOR}\n": "expected 'TOKEN NAME'",
        f"{OPERATOR} a\n{OPERATOR} b\n": "on an earlier line",
        "# none\n": "holds no token",
    }
    for text, said in bad.items():
        tokens.write_text(text, encoding="utf-8")
        with pytest.raises(InvalidArgument, match=said):
            read_operators(str(tokens))
    app = app_for(engine, store.table, history=None, locks=None, interval=1.0, max_attempts=None,
                  tokens=None, operators=operators)  # fmt: skip
    with TestClient(app, base_url="http://localhost") as c:
        assert "sign in" in page(c, "/")
        assert c.post("/login", data={"token": OPERATOR}, follow_redirects=False).status_code == 303
        assert "sign out" in page(c, "/jobs")
    plain = app_for(
        engine, store.table, history=None, locks=None, interval=1.0, max_attempts=None, tokens=None
    )
    with TestClient(plain, base_url="http://localhost") as c:
        assert "sign in" not in page(c, "/") and c.get("/login").status_code == 404


def test_the_jobs_page_reads_as_an_operator_does_state_by_state(
    engine: Engine, store: JobStore, history: Any
) -> None:
    # without a state: what runs, what waits, what needs a look, what comes later, what was done
    for n in range(14):
        store.enqueue(f"wait-{n:02d}", ready_at=float(n))
    store.enqueue("tried-twice", ready_at=0.0)  # waiting longest: it sorted above the ready ones
    for _ in range(2):
        [lease] = store.claim_next("w", ttl=60, max_attempts=2)
        assert lease.job_id == "tried-twice" and store.release(lease)
    store.enqueue("later", ready_at=time.time() + 600)
    store.enqueue("running", ready_at=0.0)
    for n in range(3):
        store.enqueue(f"did-{n}", ready_at=0.0)
    with TestClient(dashboard(engine, history=history, max_attempts=2)) as c:
        for n in range(3):  # done one after another: did-2 the newest
            lease = store.claim(f"did-{n}", "w", ttl=60)
            assert lease is not None and store.complete(lease, "ok")
            time.sleep(0.01)
        assert store.claim("running", "w", ttl=60) is not None
        html = page(c, "/jobs")
        order = re.findall(r'<h2 id="state-(\w+)">', html)
        assert order == ["held", "ready", "poisoned", "deferred", "done"]
        section = {name: html.split(f'id="state-{name}"')[1].split("</section>")[0] for name in order}
        ids = {name: re.findall(r'<tr data-job="([^"]+)"', part) for name, part in section.items()}
        assert ids["held"] == ["running"] and ids["poisoned"] == ["tried-twice"]
        assert ids["ready"] == [f"wait-{n:02d}" for n in range(10)]  # the first 10, longest waiting
        assert ids["deferred"] == ["later"] and ids["done"] == ["did-2", "did-1", "did-0"]  # newest first
        assert (
            "· 14" in section["ready"] and 'href="/jobs?state=ready">every ready job (14)' in section["ready"]
        )
        assert "every held job" not in section["held"]  # all of them shown
        assert re.findall(r'<h2 id="state-(\w+)">', page(c, "/jobs?fragment=1")) == order  # the live part too
    with TestClient(dashboard(engine, history=history)) as c:  # max_attempts unknown: no poisoned
        assert re.findall(r'<h2 id="state-(\w+)">', page(c, "/jobs")) == ["held", "ready", "deferred", "done"]
