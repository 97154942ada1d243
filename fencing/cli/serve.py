"""``fencing serve``: the dashboard alone, and the lease API when tokens are given, on uvicorn.

The dashboard is read-only here (its actions need an application's ``authorize``: mount
:func:`fencing.web.dashboard` in your own app to have them), and open to whoever reaches it:
it listens on the loopback address by default and answers only the ``Host`` names it was
given (``--allowed-host``; by default the loopback names and ``--host``). With
``--api-tokens FILE`` (``TOKEN OWNER [OWNER ...]`` per line) the lease API is mounted at
``/api``, each worker authenticated by its bearer token and acting only as the owners its
line grants; with the history table it records every change there, and its claims apply
``--max-attempts``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import Engine, Table
from starlette.applications import Starlette
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Mount

from .._errors import InvalidArgument
from .._store.history import History
from .._store.jobstore import JobStore
from ..web.api import MAX_LIMIT, MAX_TTL, lease_api
from ..web.auth import Caller, bearer_tokens
from ..web.pages import dashboard

__all__ = ["LOOPBACK", "allowed_hosts", "app_for", "is_loopback", "read_tokens", "run"]

#: the names a local browser reaches the loopback address by (an IPv6 one as a Host header has it)
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")


def allowed_hosts(host: str, more: Sequence[str] = ()) -> list[str]:
    """The ``Host`` names ``fencing serve --host HOST`` answers to: the loopback names, the
    address it binds (unless it binds every address, which names no host), and ``more``."""
    names = list(LOOPBACK)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name, not an address
        address = None
    if address is not None and address.version == 6:
        host = f"[{host}]"
    everywhere = address is not None and address.is_unspecified
    if host and not everywhere and host not in names:
        names.append(host)
    for name in more:
        if not name or "*" in name[1:] or (name.startswith("*") and name != "*" and name[:2] != "*."):
            raise InvalidArgument(
                f"--allowed-host must be a host name, or like '*.example.com', got {name!r}"
            )
        if name not in names:
            names.append(name)
    return names


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``--host``) is reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another name
        return False


def read_tokens(path: str) -> dict[str, Caller]:
    """``TOKEN OWNER [OWNER ...]`` per line (``#`` comments and empty lines skipped) from
    ``path``: the token acts as each owner named, the first one its name in the logs."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read the API tokens from {path!r}: {exc.strerror}") from None
    tokens: dict[str, Caller] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        token, *owners = line.split()
        if not owners:
            raise InvalidArgument(f"{path}, line {number}: expected 'TOKEN OWNER [OWNER ...]'")
        if token in tokens:
            raise InvalidArgument(f"{path}, line {number}: this token is on an earlier line already")
        tokens[token] = Caller(owners[0], owners=owners)
    if not tokens:
        raise InvalidArgument(f"{path} holds no token")
    return tokens


def app_for(
    engine: Engine,
    table: Table,
    *,
    history: Table | None,
    locks: Table | None,
    interval: float,
    attempts: Table | None = None,
    max_attempts: int | None,
    tokens: dict[str, Caller] | None,
    hosts: Sequence[str] = LOOPBACK,
    max_ttl: float = MAX_TTL,
    max_limit: int = MAX_LIMIT,
) -> Starlette:
    """The app ``fencing serve`` runs: the dashboard at ``/``, the lease API at ``/api``
    (with ``attempts``, a requeued job's attempts count from its requeue in both; with
    ``history``, the API's changes are recorded there; ``max_attempts`` applies to its
    claims as to the dashboard's poisoned jobs), answering only the ``Host`` names ``hosts``."""
    routes = []
    if tokens is not None:
        # never prunes, as the dashboard's store: retention is the application's
        recorded = None if history is None else History(history, retention=None)
        store = JobStore(engine, table, history=recorded, attempts=attempts)
        api = lease_api(
            store,
            authorize=bearer_tokens(tokens),
            max_attempts=max_attempts,
            max_ttl=max_ttl,
            max_limit=max_limit,
        )
        routes.append(Mount("/api", api))
    board = dashboard(
        engine,
        table,
        history=history,
        locks=locks,
        interval=interval,
        max_attempts=max_attempts,
        attempts=attempts,
    )
    routes.append(Mount("/", board))
    app = Starlette(routes=routes, lifespan=board.router.lifespan_context)
    # against DNS rebinding: a page whose name resolves to this address is not let in
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(hosts), www_redirect=False)
    return app


def run(app: Starlette, *, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")
