"""The dashboard in a real browser: Chromium (Debian's package) driven by Playwright, on every backend.

The dashboard runs on uvicorn in this process, on the test's database, with actions on; the
workers whose leases it shows are other processes. A screenshot of each page is kept in
``FENCING_ARTIFACTS`` (default ``.artifacts/``), named by backend. Where Chromium or
Playwright is missing the tests skip saying what to install; under ``CI=true`` they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from fencing import JobStore
from fencing._format import duration
from tests.served import served

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("FENCING_ARTIFACTS", ROOT / ".artifacts"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = pytest.mark.slow


def _missing(what: str) -> None:
    message = f"{what}; the browser tests need it"
    if IN_CI:
        pytest.fail(f"CI runs the browser tests: {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        import uvicorn  # noqa: F401
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        _missing(f"{exc.name} is not installed (pip install -e '.[web]' --group test)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        _missing("Chromium is not installed (apt-get install chromium)")
    with sync_playwright() as p:
        # --no-sandbox: these machines run the tests as root, where Chromium's sandbox cannot start
        launched = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def site(engine: Engine, store: JobStore, history: Any) -> Iterator[str]:
    from fencing.web import dashboard

    app = dashboard(engine, history=history, authorize=lambda request: "browser-test", interval=0.25)
    with served(app) as url:
        yield url


@pytest.fixture
def page(browser: Any, site: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    context = browser.new_context()
    tab = context.new_page()
    problems: list[str] = []
    tab.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    tab.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    tab.problems = problems
    tab.site = site
    try:
        yield tab
    finally:
        context.close()


def keep(page: Any, name: str, backend: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}-{backend}.png"), full_page=True)


WORKER = """
import sys
import time
from sqlalchemy import MetaData
from fencing import History, JobStore, history_table
sys.path.insert(0, {tests!r})
from backends import engine_for
# the application's workers record the ownership history, as the dashboard reads it
store = JobStore(engine_for({target!r}), history=History(history_table(MetaData())))
[lease] = store.claim_next("stalled-worker", ttl={ttl})
claimed = time.time()  # the claim is committed: the page has 2 s from here
print(lease.job_id, lease.fence, claimed, flush=True)
sys.stdin.readline()  # stalled until the test says
print("accepted" if store.complete(lease, "stale result") else "refused", flush=True)
"""


@contextlib.contextmanager
def stalled_worker(target: str, ttl: float = 60.0) -> Iterator[subprocess.Popen[str]]:
    """Another process that claims the next job and stalls before completing it."""
    code = WORKER.format(tests=str(ROOT / "tests"), target=target, ttl=ttl)
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    ) as proc:  # closes its pipes
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_the_overview_loads_live_with_no_console_error(page: Any, store: JobStore, backend: Any) -> None:
    for n in range(5):
        store.enqueue(f"job-{n}")
    page.goto(page.site + "/")
    page.wait_for_selector("#live.on", timeout=5000)
    assert page.inner_text('[data-live="summary.ready"]') == "5"
    keep(page, "overview", backend.name)
    for name, path in (("jobs", "/jobs"), ("marks", "/marks"), ("locks", "/locks")):
        page.goto(page.site + path)
        page.wait_for_selector("#live.on", timeout=5000)
        keep(page, name, backend.name)
    assert page.problems == []


def test_a_claim_by_another_process_appears_within_two_seconds(
    page: Any, store: JobStore, target: str, backend: Any
) -> None:
    store.enqueue("watched")
    page.goto(page.site + "/jobs")
    page.wait_for_selector("#live.on", timeout=5000)
    assert page.inner_text('tr[data-job="watched"] .state') == "ready"
    with stalled_worker(target) as worker:
        assert worker.stdout is not None
        # the instant the worker's claim committed (its start-up before it, seconds on a
        # loaded machine, is not the page's to make up; the print's way here is)
        job, fence, claimed = worker.stdout.readline().split()
        assert (job, fence) == ("watched", "1")
        page.wait_for_function(
            "() => { const s = document.querySelector('tr[data-job=\"watched\"] .state');"
            " return s && s.textContent === 'held'; }",
            timeout=2000,
        )
        assert time.time() - float(claimed) < 2.5  # 2 s, and the line's way to this process
        assert "stalled-worker" in page.inner_text('tr[data-job="watched"]')
    assert page.problems == []


def _tenths(text: str) -> float:
    """A time left under 10 s as the page writes it (``7.4s``, as the command line does)."""
    assert re.fullmatch(r"\d\.\ds", text), text
    return float(text[:-1])


def test_a_lease_countdown_moves(page: Any, store: JobStore, backend: Any) -> None:
    store.enqueue("ticking")
    store.claim_next("w", ttl=9)  # under 10 s: counted in tenths
    page.goto(page.site + "/job?id=ticking")
    page.wait_for_timeout(250)  # both readings from the page's ticks, not the server's text
    first = _tenths(page.inner_text("#countdown"))
    page.wait_for_timeout(600)
    second = _tenths(page.inner_text("#countdown"))
    assert 0.3 < first - second < 2.0, (first, second)
    # and it counts against the database's clock: what the page shows is what is left
    left = store.state("ticking").until - time.time()  # one machine: the same clock
    shown = _tenths(page.inner_text("#countdown"))
    assert abs(shown - left) < 0.5, (shown, left)
    keep(page, "job", backend.name)
    assert page.problems == []


def test_a_stale_snapshot_does_not_set_the_countdowns_back(page: Any, store: JobStore) -> None:
    # the feed hands a new page its latest snapshot, read up to an interval before: its clock
    # is a reading from the past, and taken as the present it set every countdown back by its
    # age (CI read 0.1 s in 0.6 s). Here the event stream serves one snapshot 3 s old.
    store.enqueue("ticking")
    store.claim_next("w", ttl=9)
    stale = store.state("ticking").until - 9 - 3  # the claim's instant, 3 s before it

    def old_snapshot(route: Any) -> None:
        body = "event: snapshot\ndata: " + json.dumps({"summary": {"now": stale}}) + "\n\n"
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/events", old_snapshot)
    page.goto(page.site + "/job?id=ticking")
    page.wait_for_timeout(800)  # the stale snapshot has arrived (at once), and ticks after it
    left = store.state("ticking").until - time.time()
    shown = _tenths(page.inner_text("#countdown"))
    assert abs(shown - left) < 0.5, (shown, left)
    assert page.problems == []


def test_the_page_writes_durations_as_the_command_line_does(page: Any, store: JobStore) -> None:
    # live.js's duration() redraws what fencing._format.duration wrote: the same at every scale
    for job_id, ttl in (("minutes", 125.0), ("hours", 3725.0), ("days", 2 * 86400.0 + 3700)):
        store.enqueue(job_id)
        store.claim(job_id, "w", ttl=ttl)
    page.goto(page.site + "/jobs?state=held")
    page.wait_for_timeout(400)  # ticked by the page's script
    for job_id, pattern in (("minutes", r"2m 0[0-5]s"), ("hours", r"1h 02m"), ("days", r"2d 01h")):
        shown = page.inner_text(f'tr[data-job="{job_id}"] [data-until]')
        assert re.fullmatch(pattern, shown), (job_id, shown)
        left = store.state(job_id).until - time.time()
        assert shown == duration(left) or shown == duration(left + 1), (shown, duration(left))
    assert page.problems == []


def test_revoking_from_the_page_by_keyboard_refuses_the_stalled_workers_completion(
    page: Any, store: JobStore, target: str, backend: Any
) -> None:
    store.enqueue("stalled")
    with stalled_worker(target) as worker:
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline().split()[:2] == ["stalled", "1"]
        page.goto(page.site + "/job?id=stalled")
        page.wait_for_selector("#live.on", timeout=5000)
        # to the Revoke button with the keyboard only, and press it
        for _ in range(40):
            page.keyboard.press("Tab")
            if (
                page.evaluate("() => document.activeElement && document.activeElement.textContent")
                == "Revoke"
            ):
                break
        else:
            pytest.fail("the Revoke button cannot be reached with Tab")
        page.keyboard.press("Enter")
        page.wait_for_url("**said=revoked**", timeout=5000)
        assert "Revoked" in page.inner_text(".said")
        assert page.inner_text("#job-fence") == "2"
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "refused"
    # the timeline shows the refused write, live (no reload)
    page.wait_for_selector("#timeline li.event.refused", timeout=3000)
    assert "complete refused: stale fence" in page.inner_text("#timeline li.event.refused")
    row = store.state("stalled")
    assert row is not None and row.result is None and row.fence == 2
    keep(page, "job-revoked", backend.name)
    assert page.problems == []


def test_filters_and_pagination(page: Any, store: JobStore, backend: Any) -> None:
    for n in range(60):
        store.enqueue(f"batch-{n:02d}", ready_at=float(n))
    for n in range(5):
        store.enqueue(f"other-{n}", ready_at=100.0 + n)
    page.goto(page.site + "/jobs")
    page.select_option("select[name=state]", "ready")
    page.fill("input[name=prefix]", "batch-")
    page.click("form.filter button")
    page.wait_for_url("**state=ready**")
    first = page.eval_on_selector_all("tr[data-job]", "rows => rows.map(r => r.dataset.job)")
    assert first == [f"batch-{n:02d}" for n in range(50)]
    page.click("a[rel=next]")
    page.wait_for_url("**after=**")
    second = page.eval_on_selector_all("tr[data-job]", "rows => rows.map(r => r.dataset.job)")
    assert second == [f"batch-{n:02d}" for n in range(50, 60)]
    assert page.locator("a[rel=next]").count() == 0
    keep(page, "jobs-filtered", backend.name)
    assert page.problems == []


def test_every_page_fits_a_desktop_and_a_phone(page: Any, store: JobStore, backend: Any) -> None:
    # wide and narrow (a 390 px phone): nothing wider than the window (a table too wide scrolls
    # inside itself), no number or duration broken over two lines; each page kept as a screenshot
    for n in range(60):
        store.enqueue(f"invoice-{n:03d}-with-a-longer-id-than-usual")
    store.claim_next("worker-on-host-with-a-long-name:4242", ttl=125, limit=5)
    paths = {"overview": "/", "jobs": "/jobs", "job": "/job?id=invoice-000-with-a-longer-id-than-usual",
             "marks": "/marks", "locks": "/locks"}  # fmt: skip
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 900})
        for name, path in paths.items():
            page.goto(page.site + path)
            page.wait_for_timeout(300)
            wide = page.evaluate("document.documentElement.scrollWidth")
            assert wide <= width, (name, width, wide)
            for cell in page.query_selector_all("[data-until], td.num"):
                # the line boxes of its text: one unless it broke
                lines = cell.evaluate(
                    "e => { const r = document.createRange(); r.selectNodeContents(e); "
                    "return new Set(Array.from(r.getClientRects(), b => Math.round(b.top))).size; }"
                )
                assert lines <= 1, (name, width, cell.inner_text())
            keep(page, f"{name}-{width}px", backend.name)
    assert page.problems == []
