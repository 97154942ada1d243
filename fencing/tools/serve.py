"""``fencing serve``: the dashboard alone, and the lease API when tokens are given, on uvicorn.

The dashboard is read-only here (its actions need an application's ``authorize``: mount
:func:`fencing.web.dashboard` in your own app to have them). With ``--api-tokens FILE`` (one
``TOKEN NAME`` per line) the lease API is mounted at ``/api``, each worker authenticated by
its bearer token.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, Table
from starlette.applications import Starlette
from starlette.routing import Mount

from ..core.errors import InvalidArgument
from ..store.jobstore import JobStore
from ..web.api import lease_api
from ..web.auth import bearer_tokens
from ..web.pages import dashboard

__all__ = ["app_for", "read_tokens", "run"]


def read_tokens(path: str) -> dict[str, str]:
    """``TOKEN NAME`` per line (``#`` comments and empty lines skipped) from ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read the API tokens from {path!r}: {exc.strerror}") from None
    tokens: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        token, _, name = line.partition(" ")
        if not name.strip():
            raise InvalidArgument(f"{path}, line {number}: expected 'TOKEN NAME'")
        tokens[token] = name.strip()
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
    tokens: dict[str, str] | None,
) -> Starlette:
    """The app ``fencing serve`` runs: the dashboard at ``/``, the lease API at ``/api``
    (with ``attempts``, a requeued job's attempts count from its requeue in both)."""
    routes = []
    if tokens is not None:
        store = JobStore(engine, table, attempts=attempts)
        routes.append(Mount("/api", lease_api(store, authorize=bearer_tokens(tokens))))
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
    return Starlette(routes=routes, lifespan=board.router.lifespan_context)


def run(app: Starlette, *, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")
