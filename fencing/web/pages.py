"""The dashboard an application mounts: what its jobs are doing, who holds them, what was refused.

:func:`dashboard` returns an ASGI app (Starlette) to mount in the application's own
(``app.mount("/fencing", dashboard(engine))``) or to run alone (``fencing serve``). Pages are
plain HTML rendered on the server (Jinja2, every value escaped), one stylesheet and one small
script of its own; no build step, nothing fetched from elsewhere, so it works offline.

* ``/``: counts by state, rates per minute, the job waiting longest, the leases ending
  soonest, refused writes by reason (from the ownership history);
* ``/jobs``: filtered by state and id prefix, in pages that walk the index (a cursor, never
  an ``OFFSET``), sorted as ``fencing jobs`` sorts;
* ``/job?id=ID``: the row, the lease counting down, the ownership history as a timeline with
  the refused writes marked;
* ``/marks``: fence marks and idempotency keys; ``/locks``: named locks and leaders;
* ``/events``: the live feed (server-sent events) every page listens to: one read of the
  table per interval for all of them (:mod:`fencing.web.feed`); at most ``max_streams`` open.

**Reads** (every page, fragment and ``/events``) are asked of ``authorize`` too, when the
application passes one (or of ``authorize_reads``): refused, they answer ``403`` and show
nothing. Only a dashboard without ``authorize`` (read-only, as ``fencing serve`` runs it) is
open to whoever reaches it. With ``allowed_hosts`` a request whose ``Host`` is not listed is
refused (``400``), so a rebound DNS name cannot read it through the browser.

**Actions** (revoke, release, delete, enqueue; requeue with the store's ``attempts`` table)
are off unless the application passes ``authorize`` (:mod:`fencing.web.auth`): without it
no page shows them and every ``POST`` answers ``403``, nothing changed. Each form carries a
CSRF token signed with the dashboard's secret (HMAC) over the browser's cookie
(``SameSite=Strict``) and who is acting, so a cookie and token an attacker chose are refused;
a post from another ``Origin``, or ``Origin: null``, is refused; each action is logged on
``fencing.web`` with who did it, and recorded in the history when there is one.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import jinja2
from markupsafe import Markup
from sqlalchemy import Engine, Table
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._admin import change_job
from .._errors import FencingError, InvalidArgument, InvalidArgumentType
from .._format import duration, instant, when
from .._sql.checks import check_count, check_timeout
from .._sql.failures import Failure
from .._sql.schema import jobs
from .._store.history import History
from .._store.jobstore import JobStore
from .._store.marks import fence_marks, idempotency_keys
from ..overview import STATES, Cursor, JobView, Overview
from .api import BadBody, read_body
from .auth import SIGNED_IN_COOKIE, Authorize, TokenSignIn, who_is_asking
from .feed import SERIES, Feed
from .problems import from_error, problem, status_of

__all__ = ["dashboard"]

logger = logging.getLogger("fencing.web")

#: jobs per page of a listing
PAGE = 50
#: the jobs page without a state: each state's first jobs, in the order an operator reads them
BY_STATE = ("held", "ready", "poisoned", "deferred", "done")
BY_STATE_SHOWN = 10
#: past the last done job in the ready index (done = 1, the latest until): where its newest are
_END_OF_DONE = Cursor(1, 1e300, "")
#: the longest id the pages accept (UTF-8 bytes): a server's key limit, with room
MAX_ID = 2048
#: the largest form an action posts (bytes)
MAX_FORM = 16 * 1024
#: history entries shown on a job's page (the latest)
HISTORY_SHOWN = 200
CSRF_COOKIE = "fencing_csrf"
#: the cookie's nonce: 32 random bytes, URL-safe base64 (what ``secrets.token_urlsafe(32)`` gives)
_NONCE = re.compile(r"[A-Za-z0-9_-]{43}")
#: where a page's handler leaves who may act, for the forms' CSRF token (``request.scope``)
_ACTOR = "fencing_actor"

#: what an action's page says after it (a fixed text per code: nothing from the URL is shown)
SAID = {
    "revoked": "Revoked: the holder's fence is stale now; its next write will be refused.",
    "released": "Released: the lease was ended (the fence is kept); the job is claimable again.",
    "deleted": "Deleted: a tombstone keeps the fence, so the id never hands out an old token.",
    "requeued": "Requeued: its attempts count again from its fence now (kept); it is ready.",
    "enqueued": "Enqueued.",
    "exists": "A job with this id exists already: nothing changed.",
    "unchanged": "Nothing changed: the job was not in a state this action applies to.",
    "signed-in": "Signed in: the actions are on for you in this browser.",
    "signed-out": "Signed out.",
}
#: how long a browser stays signed in with a token (seconds)
SIGNED_IN_FOR = 12 * 3600
_DID = {"revoke": "revoked", "release": "released", "delete": "deleted", "requeue": "requeued"}

_SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
]


class _SecurityHeaders:
    """Every response of the dashboard gets a strict CSP (no inline script, no other origin)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_SECURITY_HEADERS]}
            await send(message)

        await self.app(scope, receive, sending)


class _Stream(StreamingResponse):
    """An event stream holding one of the dashboard's slots, given back when its response
    ends however it ends (a closed connection, a stream never started, an error)."""

    def __init__(self, content: AsyncIterator[str], done: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()


def _q(value: object) -> str:
    """A query-string value, every reserved character encoded."""
    return urllib.parse.quote(str(value), safe="")


def _position(text: str | None) -> int | None:
    """The ``at`` of a listing's URL: the place of its first job (from 1), a hint for the
    page's "jobs 51-100" that a hand-edited URL cannot make an error of."""
    if text is None or not text.isdigit() or len(text) > 9:
        return None
    return int(text) or None


def _length(seconds: float | None) -> str:
    return "—" if seconds is None else duration(seconds)


def _left(seconds: float) -> str:
    """A lease's time left, as ``live.js`` counts it down: ``ended`` once it has run out."""
    return duration(seconds) if seconds > 0 else "ended"


def _shown(value: object) -> Markup:
    """A value from the database in a page: escaped, and isolated from the text around it
    (``<bdi>``), so right-to-left marks in an id cannot reorder what follows."""
    return Markup("<bdi>%s</bdi>") % ("" if value is None else str(value))


def _chart(series: list[dict[str, Any]], window: float, now: float | None) -> dict[str, Any]:
    """The chart's polylines from the feed's series, on a time axis: the last ``window``
    seconds up to ``now`` (the database's clock), each point at its instant, so a feed that
    started a moment ago draws only at the right edge. The page's script redraws them live
    (``live.js`` ``chart()``: change both together)."""
    names = ("claims", "completions", "refused")
    peak = max([1.0, *(p[n] for p in series for n in names if p[n] is not None)])
    lines: dict[str, Any] = {}
    for n in names:
        points = []
        for p in series:
            if p[n] is None or now is None or now - p["at"] > window:
                continue
            x = 600 - (now - p["at"]) / window * 600
            points.append(f"{x:.1f},{155 - p[n] / peak * 150:.1f}")
        lines[n] = " ".join(points)
    lines["peak"] = round(peak)
    lines["window"] = window
    lines["span"] = duration(window)
    lines["half"] = duration(window / 2)
    lines["interval"] = duration(window / SERIES)
    return lines


def _check_id(value: object, name: str = "id") -> str:
    if not isinstance(value, str):
        raise InvalidArgumentType(f"{name} must be text")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID:
        raise InvalidArgument(f"{name} is longer than {MAX_ID} bytes")
    return value


class _Dashboard:
    def __init__(
        self,
        engine: Engine,
        table: Table,
        *,
        history: Table | None,
        locks: Table | None,
        marks: Table,
        keys: Table,
        authorize: Authorize | None,
        readers: Authorize | None,
        secret: bytes,
        interval: float,
        max_streams: int,
        max_attempts: int | None,
        attempts: Table | None,
        payloads: Table | None,
        failures: Table | None,
        wait: float | None,
        title: str,
        schedules: Table | None = None,
        sign_in: TokenSignIn | None = None,
    ) -> None:
        self.sign_in = sign_in
        self.engine = engine
        self.table = table
        self.history = history
        self.overview = Overview(engine, table, marks=marks, keys=keys, attempts=attempts)
        self.locks = None if locks is None else Overview(engine, locks)
        recorded = None if history is None else History(history, retention=None)
        # the dashboard's own store, for the actions: it records them in the history and
        # never prunes it (retention=None: the application's store prunes)
        self.store = JobStore(
            engine, table, history=recorded, attempts=attempts, payloads=payloads, failures=failures
        )
        self.authorize = authorize
        #: who may read the pages and the feed (``None``: anyone who reaches the dashboard)
        self.readers = readers
        self.secret = secret
        self.max_streams = max_streams
        #: event streams open now, counted when admitted (not when they start iterating)
        self.streams = 0
        self.max_attempts = max_attempts
        self.wait = wait
        self.title = title
        self.feed = Feed(
            self.overview, history=history, interval=interval, max_attempts=max_attempts, schedules=schedules
        )
        self.env = jinja2.Environment(
            loader=jinja2.PackageLoader("fencing.web", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(q=_q, shown=_shown)
        # durations as the command line writes them (live.js's duration() redraws them alike)
        self.env.globals.update(
            length=_length, left=_left, instant=lambda at: instant(at, "—"), when=lambda j: when(j, duration)
        )

    # -- rendering --------------------------------------------------------------------------

    def csrf_token(self, nonce: str, actor: str | None) -> str:
        """The forms' CSRF token: the dashboard's HMAC of the browser's cookie nonce and who
        acts. Nobody without the secret makes one, so a cookie planted in the browser (from a
        sibling subdomain, say) comes with no token that matches it."""
        message = "\x00".join(("fencing-csrf", nonce, actor or "")).encode("utf-8", "surrogatepass")
        mac = hmac.new(self.secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")

    def csrf_matches(self, request: Request, form: dict[str, str], who: str | None) -> bool:
        """Whether a posted form's CSRF token is the one this browser's cookie nonce and
        ``who`` make (the actions' and the sign-out's check)."""
        nonce = request.cookies.get(CSRF_COOKIE, "")
        given = form.get("csrf", "").encode("utf-8", "surrogatepass")
        expected = self.csrf_token(nonce, who).encode("ascii")
        return _NONCE.fullmatch(nonce) is not None and hmac.compare_digest(expected, given)

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        nonce = request.cookies.get(CSRF_COOKIE) or ""
        fresh = _NONCE.fullmatch(nonce) is None
        if fresh:
            nonce = secrets.token_urlsafe(32)
        token = self.csrf_token(nonce, request.scope.get(_ACTOR))
        said = SAID.get(request.query_params.get("said", ""))
        base = {
            "title": self.title,
            "root": root,
            "said": said,
            "table_name": self.table.name,
            "dialect": self.engine.dialect.name,
            # with sign-in, the forms only for who signed in (the others see a "sign in" link)
            "actions": self.authorize is not None and (self.sign_in is None or request.scope.get(_ACTOR)),
            "sign_in": self.sign_in is not None,
            "who": request.scope.get(_ACTOR),
            "csrf": token,
            "max_id": MAX_ID,
        }
        html = self.env.get_template(template).render(**base, **context)
        response = HTMLResponse(html, status_code=status, headers={"Cache-Control": "no-store"})
        if fresh:
            response.set_cookie(CSRF_COOKIE, nonce, path=root or "/", httponly=True, samesite="strict")
        return response

    def fragment(self, request: Request, template: str, **context: Any) -> HTMLResponse:
        """The page, or with ``?fragment=1`` only its live part (what the script re-reads)."""
        if request.query_params.get("fragment") == "1":
            return self.render(request, f"_{template}", **context)
        return self.render(request, template, **context)

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        return self.render(request, "error.html", status, page="error", heading="Error", message=message)

    async def may_read(self, request: Request) -> bool:
        """Whether ``request`` may read the dashboard; where it may, who may act is left in
        its scope, for the forms' CSRF token (one call of each callable, or of the one)."""
        reader = await who_is_asking(self.readers, request)
        if self.readers is not None and reader is None:
            return False
        if self.authorize is not None:
            same = self.authorize is self.readers
            request.scope[_ACTOR] = reader if same else await who_is_asking(self.authorize, request)
        return True

    def guarded(
        self, page: Callable[[Request], Awaitable[Response]], *, read: bool = True
    ) -> Callable[[Request], Awaitable[Response]]:
        async def call(request: Request) -> Response:
            try:
                if read and not await self.may_read(request):
                    return self.error(request, 403, "You are not authorized to read this dashboard.")
                return await page(request)
            except _Forbidden as exc:
                return self.error(request, 403, str(exc))
            except BadBody as exc:
                return self.error(request, exc.status, exc.detail)
            except FencingError as exc:
                return self.error(request, status_of(exc), f"{type(exc).__name__}: {exc}")

        return call

    # -- pages ------------------------------------------------------------------------------

    async def overview_page(self, request: Request) -> Response:
        snap = await self.feed.latest()
        url = f"{request.scope.get('root_path', '')}/?fragment=1"
        return self.fragment(request, "overview.html", page="overview", heading="Overview",
            snap=snap, chart=_chart(snap["series"], self.feed.window, (snap["summary"] or {}).get("now")),
            fragment_url=url,
        )  # fmt: skip

    async def jobs_page(self, request: Request) -> Response:
        params = request.query_params
        state = params.get("state") or None
        if state is not None and state not in STATES:
            raise InvalidArgument(f"state must be one of {', '.join(STATES)}")
        prefix = _check_id(params.get("prefix") or "", "prefix") or None
        after = Cursor.parse(params["after"]) if params.get("after") else None
        before = Cursor.parse(params["before"]) if params.get("before") else None
        at = _position(params.get("at"))
        max_attempts = self.max_attempts
        if state == "poisoned" and max_attempts is None:
            raise InvalidArgument(
                "poisoned jobs are those claimed max_attempts times: start the dashboard with max_attempts"
            )
        if state is None and prefix is None and after is None and before is None:
            return await self.jobs_by_state(request)
        if after is not None:
            before = None  # a hand-made URL with both: the way on wins
        found = await run_in_threadpool(
            lambda: self.overview.jobs(
                state, limit=PAGE + 1, max_attempts=max_attempts, after=after, before=before, prefix=prefix
            )
        )
        # one more than a page says whether there is more that way: after the page going on,
        # before it going back (a backward page comes oldest first: the extra one leads)
        if before is not None:
            earlier, shown, later = len(found) > PAGE, found[-PAGE:], True
        else:
            earlier, shown, later = after is not None, found[:PAGE], len(found) > PAGE
        root = request.scope.get("root_path", "")
        query = {k: v for k, v in (("state", state), ("prefix", prefix)) if v}

        def url(**more: Any) -> str:
            return f"{root}/jobs?" + urllib.parse.urlencode({**query, **more})

        cursor = {k: params[k] for k in ("after", "before", "at") if params.get(k)}
        here = urllib.parse.urlencode({**query, **cursor, "fragment": "1"})
        first = at if at is not None else (1 if not earlier else None)
        next_url = prev_url = None
        if later and shown:
            onward = {"at": str(first + len(shown))} if first is not None else {}
            next_url = url(after=shown[-1].cursor.text(), **onward)
        if earlier and shown:
            back = {"at": str(max(1, first - PAGE))} if first is not None and first > PAGE else {}
            prev_url = url(before=shown[0].cursor.text(), **back)
        first_url = url() if earlier else None
        heading = f"{state.capitalize()} jobs" if state else "Jobs"
        total = None if prefix is not None else self._total(await self.feed.latest(), state)
        return self.fragment(request, "jobs.html", page="jobs", heading=heading, jobs=shown, state=state,
            prefix=prefix, states=STATES, next_url=next_url, prev_url=prev_url, first_url=first_url,
            total=total, first=first, sections=None, fragment_url=f"{root}/jobs?{here}",
        )  # fmt: skip

    async def jobs_by_state(self, request: Request) -> Response:
        """Every state's first jobs, in the order an operator reads them: what runs now (held,
        soonest to end), what waits (ready, longest waiting), what needs a look (poisoned,
        when ``max_attempts`` is known), what comes later (deferred, soonest), and what was
        done last (the newest first); each with its count and a link to its whole listing."""
        snap = await self.feed.latest()
        states = [s for s in BY_STATE if s != "poisoned" or self.max_attempts is not None]

        def read() -> list[tuple[str, list[Any]]]:
            found = []
            for s in states:
                if s == "done":  # the newest: the index's far end, walked back
                    last = self.overview.jobs(s, limit=BY_STATE_SHOWN, before=_END_OF_DONE)[::-1]
                    found.append((s, last))
                else:
                    found.append(
                        (s, self.overview.jobs(s, limit=BY_STATE_SHOWN, max_attempts=self.max_attempts))
                    )
            return found

        sections = [(s, jobs, self._total(snap, s)) for s, jobs in await run_in_threadpool(read)]
        root = request.scope.get("root_path", "")
        return self.fragment(request, "jobs.html", page="jobs", heading="Jobs", jobs=[], state=None,
            prefix=None, states=STATES, next_url=None, prev_url=None, first_url=None, total=None,
            first=None, sections=sections, fragment_url=f"{root}/jobs?fragment=1",
        )  # fmt: skip

    @staticmethod
    def _total(snap: dict[str, Any], state: str | None) -> int | None:
        """How many jobs the listing of ``state`` walks, as the feed's latest read counted them
        (``None`` if it could not count them)."""
        summary = snap.get("summary")
        if summary is None or (state == "poisoned" and summary.get("max_attempts") is None):
            return None
        if state is not None:
            return int(summary[state])
        return sum(int(summary[s]) for s in ("ready", "held", "deferred", "done", "poisoned"))

    async def job_page(self, request: Request) -> Response:
        job_id = _check_id(request.query_params.get("id", ""))
        job = await run_in_threadpool(lambda: self.overview.job(job_id, max_attempts=self.max_attempts))
        history = None
        cut = False
        if self.history is not None:
            entries = await run_in_threadpool(self.store.history, job_id)
            cut = len(entries) > HISTORY_SHOWN
            history = entries[-HISTORY_SHOWN:]
        payload, failure = await run_in_threadpool(self.beside, job_id)
        used = None if job is None else await run_in_threadpool(self.overview.attempts_used, job)
        actions = []
        if job is not None:
            live = job.state != "done"
            actions = [
                ("revoke", "Revoke", live),
                ("release", "Release", job.state == "held"),
                ("delete", "Delete", True),
            ]
            if self.store.attempts is not None:
                # its attempts given back: a job nobody holds (a held one: revoke it first)
                actions.insert(2, ("requeue", "Requeue", job.state in ("poisoned", "ready", "deferred")))
        root = request.scope.get("root_path", "")
        heading = Markup("Job ") + _shown(job_id)
        return self.fragment(request, "job.html", page="job", heading=heading, job=job, job_id=job_id,
            history=history, history_cut=cut, job_actions=actions, payload=payload, failure=failure,
            attempts_used=used, max_attempts=self.max_attempts,
            fragment_url=f"{root}/job?id={_q(job_id)}&fragment=1",
        )  # fmt: skip

    def beside(self, job_id: str) -> tuple[str | None, Failure | None]:
        """The job's payload (as indented JSON) and its last failure, where the store keeps
        them (``None``: none, or not kept)."""
        store = self.store
        payload = None if store.payloads is None else store.payload(job_id)
        shown = None if payload is None else json.dumps(payload, indent=2, ensure_ascii=False)
        failure = None if store.failures is None else store.failure(job_id)
        return shown, failure

    async def marks_page(self, request: Request) -> Response:
        ov = self.overview

        def read() -> tuple[Any, Any]:
            marks = ov.fence_marks(limit=PAGE) if ov.has_table(ov.marks) else None
            keys = ov.idempotency_keys(limit=PAGE) if ov.has_table(ov.keys) else None
            return marks, keys

        marks, keys = await run_in_threadpool(read)
        return self.render(request, "marks.html", page="marks", heading="Fence marks", marks=marks, keys=keys)

    async def locks_page(self, request: Request) -> Response:
        locks_view = self.locks

        def read() -> list[JobView] | None:
            if locks_view is None or not locks_view.has_table(locks_view.table):
                return None
            return locks_view.jobs(None, limit=PAGE)

        found = await run_in_threadpool(read)
        return self.render(request, "locks.html", page="locks", heading="Locks and leaders", locks=found)

    # -- the live feed ----------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        try:
            allowed = await self.may_read(request)
        except FencingError as exc:
            return from_error(exc)
        if not allowed:
            return problem(403, "Forbidden", "you are not authorized to read this dashboard's events")
        if self.streams >= self.max_streams:
            return problem(
                503, "TooManyStreams", f"{self.max_streams} event streams are open already; try again later"
            )
        # counted here, with no await since the check: no other request runs in between
        self.streams += 1

        async def stream() -> AsyncIterator[str]:
            async for snap in self.feed.watch():
                if snap is None:
                    yield ": keep-alive\n\n"
                else:
                    yield f"event: snapshot\ndata: {json.dumps(snap, separators=(',', ':'))}\n\n"

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return _Stream(stream(), self.stream_ended, media_type="text/event-stream", headers=headers)

    def stream_ended(self) -> None:
        self.streams -= 1

    # -- signing in with a token (sign_in=) -------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        assert self.sign_in is not None
        root = request.scope.get("root_path", "")

        def form_page(status: int = 200) -> Response:
            return self.render(request, "login.html", status, page="login", heading="Sign in",
                               refused=status != 200, hours=SIGNED_IN_FOR // 3600)  # fmt: skip

        if request.method == "GET":
            request.scope[_ACTOR] = await who_is_asking(self.authorize, request)
            return form_page()
        form = await self.read_form(request)
        name = self.sign_in.name_of(form.get("token", "").strip())
        if name is None:
            logger.warning("a sign-in to the dashboard with a token that is none of the operators'")
            return form_page(403)
        logger.info("%s signed in to the dashboard", name)
        response = RedirectResponse(f"{root}/?said=signed-in", status_code=303)
        response.set_cookie(
            SIGNED_IN_COOKIE, form["token"].strip(), path=root or "/", httponly=True, samesite="strict",
            secure=request.url.scheme == "https", max_age=SIGNED_IN_FOR,
        )  # fmt: skip
        return response

    async def logout(self, request: Request) -> Response:
        root = request.scope.get("root_path", "")
        who = await who_is_asking(self.authorize, request)
        form = await self.read_form(request)
        if not self.csrf_matches(request, form, who):
            return self.error(request, 403, "The form's CSRF token does not match this browser's.")
        response = RedirectResponse(f"{root}/?said=signed-out", status_code=303)
        response.delete_cookie(SIGNED_IN_COOKIE, path=root or "/", httponly=True, samesite="strict")
        return response

    # -- actions ----------------------------------------------------------------------------

    async def act(self, request: Request) -> Response:
        if self.authorize is None:
            return self.error(
                request, 403, "Actions are off: the application mounted the dashboard without authorize."
            )
        who = await who_is_asking(self.authorize, request)
        if who is None:
            return self.error(request, 403, "You are not authorized to change jobs here: nothing changed.")
        form = await self.read_form(request)
        if not self.csrf_matches(request, form, who):
            return self.error(
                request, 403, "The form's CSRF token does not match this browser's: nothing changed."
            )
        action = form.get("action", "")
        job_id = _check_id(form.get("id", ""))
        root = request.scope.get("root_path", "")
        if action == "enqueue":
            if not job_id:
                raise InvalidArgument("the new job needs an id")
            added = await run_in_threadpool(self.store.enqueue, job_id)
            logger.info(
                "enqueue of job %r by %s on the dashboard: %s", job_id, who, "added" if added else "exists"
            )
            said = "enqueued" if added else "exists"
        elif action == "requeue" and self.store.attempts is None:
            raise InvalidArgument("requeue needs the attempts table: dashboard(..., attempts=...)")
        elif action in _DID:
            changed = await run_in_threadpool(
                lambda: change_job(action, self.store, self.overview, job_id, wait=self.wait)
            )
            before = changed.before
            logger.info(
                "%s of job %r by %s on the dashboard: %s",
                action,
                job_id,
                who,
                "done" if changed.changed else "nothing changed",
                extra={
                    "action": action,
                    "job_id": job_id,
                    "who": who,
                    "changed": changed.changed,
                    "fence": None if before is None else before.fence,
                    "owner": None if before is None else before.owner,
                },
            )
            said = _DID[action] if changed.changed else "unchanged"
            if action == "delete" and changed.changed:
                return RedirectResponse(f"{root}/jobs?said={said}", status_code=303)
        else:
            raise InvalidArgument(f"no such action: {action[:40]!r}")
        return RedirectResponse(f"{root}/job?id={_q(job_id)}&said={said}", status_code=303)

    async def read_form(self, request: Request) -> dict[str, str]:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise InvalidArgument("actions are posted as forms (application/x-www-form-urlencoded)")
        origin = request.headers.get("origin")
        # "null" too: a sandboxed frame's or a data: URL's post, from no origin we can trust
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            raise _Forbidden(f"a post from another origin ({origin[:80]}) is refused: nothing changed")
        raw = await read_body(request, MAX_FORM)
        try:
            pairs = urllib.parse.parse_qsl(
                raw.decode("utf-8"), keep_blank_values=True, max_num_fields=10, strict_parsing=False
            )
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidArgument(f"the form cannot be read: {exc}") from None
        return dict(pairs)


class _Forbidden(InvalidArgument):
    pass


def dashboard(
    engine: Engine,
    table: Table = jobs,
    *,
    history: Table | None = None,
    locks: Table | None = None,
    marks: Table = fence_marks,
    keys: Table = idempotency_keys,
    authorize: Authorize | None = None,
    authorize_reads: Authorize | bool = True,
    allowed_hosts: Sequence[str] | None = None,
    csrf_secret: str | bytes | None = None,
    interval: float = 1.0,
    max_streams: int = 100,
    max_attempts: int | None = None,
    attempts: Table | None = None,
    payloads: Table | None = None,
    failures: Table | None = None,
    schedules: Table | None = None,
    wait: float | None = 10.0,
    title: str = "fencing",
    operator_tokens: Mapping[str, str] | None = None,
) -> Starlette:
    """The dashboard of ``table`` (an ASGI app) on ``engine``.

    ``history``: the ownership history table (:func:`fencing.history_table`), for the job
    timelines and the refusals; ``locks``: the named locks' table (:func:`fencing.locks_table`).
    ``authorize(request)`` turns the actions on: it answers who is asking (logged with each
    action) or ``None`` (``403``). ``authorize_reads``: who may read the pages and the live
    feed: ``True`` (the default) asks ``authorize`` (reads are open only on a dashboard
    without one), another callable asks it instead, ``False`` opens them to whoever reaches
    the dashboard; refused, a read answers ``403``. ``allowed_hosts``: the ``Host`` names the
    dashboard answers to (``400`` for another; Starlette's ``TrustedHostMiddleware``, so
    ``"*.example.com"`` works); ``None`` leaves it to the application. ``csrf_secret``: the key
    the forms' CSRF tokens are signed with (HMAC-SHA256; by default a random one per app, so
    processes serving one dashboard behind a balancer must share one, 32 bytes or more).
    ``interval``: seconds between the feed's reads;
    ``max_streams``: event streams open at once (``503`` past it); ``max_attempts``: what the
    workers pass to ``claim_next``, for the ``poisoned`` state; ``attempts``: the workers'
    store's attempts table (:func:`fencing.attempts_table`), which turns on the requeue of a
    poisoned job and counts its attempts from its last requeue; ``payloads`` and ``failures``:
    the workers' store's payloads and failures tables (:func:`fencing.payloads_table`,
    :func:`fencing.failures_table`), whose job's payload and last failure a job's page shows;
    ``schedules``: the schedules table (:func:`fencing.schedules_table`), whose schedules the
    overview lists with their last and next tick and the state of the last tick's job;
    ``wait``: the longest an action waits for a job's row held by a worker's fenced block.
    ``operator_tokens``: ``{token: name}`` of the operators who may sign in: the pages get a
    ``/login`` where a browser signs in with a token (kept in an ``HttpOnly``,
    ``SameSite=Strict`` cookie; tokens of 16 characters or more, compared in constant time) and
    ``/logout``; when no ``authorize`` is given, the actions are on for whoever signed in (the
    reads stay open unless ``authorize_reads`` says otherwise). ``fencing serve
    --operator-tokens FILE`` gives it.
    """
    if not isinstance(engine, Engine):
        raise InvalidArgumentType(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
    for name, value in (
        ("history", history),
        ("locks", locks),
        ("attempts", attempts),
        ("schedules", schedules),
    ):
        if value is not None and not isinstance(value, Table):
            raise InvalidArgumentType(
                f"{name} must be a sqlalchemy Table or None, got {type(value).__name__}"
            )
    if authorize is not None and not callable(authorize):
        raise InvalidArgumentType("authorize must be a callable: request -> who is asking, or None")
    sign_in = None if operator_tokens is None else TokenSignIn(operator_tokens)
    if sign_in is not None and authorize is None:
        authorize = sign_in.authorize
        if authorize_reads is True:
            authorize_reads = False  # signing in is for acting: the pages stay open
    if isinstance(authorize_reads, bool):
        readers = authorize if authorize_reads else None
    elif callable(authorize_reads):
        readers = authorize_reads
    else:
        raise InvalidArgumentType(
            "authorize_reads must be True (ask authorize), False (reads open) or a callable: "
            f"request -> who is asking, or None; got {type(authorize_reads).__name__}"
        )
    hosts = _check_hosts(allowed_hosts)
    secret = _check_secret(csrf_secret)
    interval = check_timeout(interval, name="interval") or 0.0
    if interval < 0.05:
        raise InvalidArgument(f"interval must be at least 0.05 s, got {interval!r}")
    max_streams = check_count("max_streams", max_streams)
    if max_attempts is not None:
        max_attempts = check_count("max_attempts", max_attempts)
    wait = check_timeout(wait, name="wait")
    if not isinstance(title, str):
        raise InvalidArgumentType(f"title must be a str, got {type(title).__name__}")
    d = _Dashboard(
        engine, table, history=history, locks=locks, marks=marks, keys=keys, authorize=authorize,
        readers=readers, secret=secret, interval=interval, max_streams=max_streams,
        max_attempts=max_attempts, attempts=attempts, payloads=payloads, failures=failures, wait=wait,
        title=title, schedules=schedules, sign_in=sign_in,
    )  # fmt: skip
    routes = [
        Route("/", d.guarded(d.overview_page), methods=["GET"]),
        Route("/jobs", d.guarded(d.jobs_page), methods=["GET"]),
        Route("/job", d.guarded(d.job_page), methods=["GET"]),
        Route("/marks", d.guarded(d.marks_page), methods=["GET"]),
        Route("/locks", d.guarded(d.locks_page), methods=["GET"]),
        Route("/events", d.events, methods=["GET"]),
        Route("/act", d.guarded(d.act, read=False), methods=["POST"]),
        *(
            [
                Route("/login", d.guarded(d.login_page, read=False), methods=["GET", "POST"]),
                Route("/logout", d.guarded(d.logout, read=False), methods=["POST"]),
            ]
            if sign_in is not None
            else []
        ),
        Mount("/static", StaticFiles(packages=[("fencing.web", "static")]), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await d.feed.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(_SecurityHeaders)
    if hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)
    app.state.dashboard = d
    return app


def _check_hosts(hosts: object) -> list[str] | None:
    """``allowed_hosts``: ``None``, or host names (``*.example.com`` for a domain's)."""
    if hosts is None:
        return None
    if isinstance(hosts, str) or not isinstance(hosts, Sequence):
        raise InvalidArgumentType(
            f"allowed_hosts must be a list of host names (not one str), got {type(hosts).__name__}"
        )
    for host in hosts:
        if not isinstance(host, str) or not host:
            raise InvalidArgumentType(f"allowed_hosts must hold non-empty str, got {host!r:.80}")
        if "*" in host[1:] or (host.startswith("*") and host != "*" and not host.startswith("*.")):
            raise InvalidArgument(f"a wildcard host must be like '*.example.com', got {host!r:.80}")
    if not hosts:
        raise InvalidArgument("allowed_hosts is empty: no request could be answered")
    return list(hosts)


def _check_secret(secret: object) -> bytes:
    """``csrf_secret``: at least 32 bytes (a str as UTF-8), or ``None`` for a random one."""
    if secret is None:
        return secrets.token_bytes(32)
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes):
        raise InvalidArgumentType(f"csrf_secret must be str, bytes or None, got {type(secret).__name__}")
    if len(secret) < 32:
        raise InvalidArgument(
            f"csrf_secret must be at least 32 bytes: a short one can be guessed, got {len(secret)}"
        )
    return secret
