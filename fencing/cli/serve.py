"""``fencing serve``: the dashboard alone, and the lease API when tokens are given, on uvicorn.

The dashboard is read-only here unless ``--operator-tokens FILE`` (``TOKEN NAME`` per line)
names who may act: an operator signs in at ``/login`` with a token and its browser then has
the actions (revoke, release, delete, enqueue, requeue), each logged with the name. Its pages
are open to whoever reaches it:
it listens on the loopback address by default and answers only the ``Host`` names it was
given (``--allowed-host``; by default the loopback names and ``--host``). With
``--api-tokens FILE`` (``TOKEN OWNER [OWNER ...]`` per line) the lease API is mounted at
``/api``, each worker authenticated by its bearer token and acting only as the owners its
line grants; with the history table it records every change there, and its claims apply
``--max-attempts``. The web extra (starlette, uvicorn) is imported when the command runs: the
parser is built, and ``fencing --help`` printed, where it is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, MetaData, Table

from .._errors import InvalidArgument
from .._sql.schedules import schedules_table
from .._store.history import History
from .._store.jobstore import JobStore
from .._store.locks import locks_table
from ._database import Database, Failed, add_command
from ._options import (
    Commands,
    add_attempts_table,
    add_history_table,
    add_max_attempts,
    add_side_tables,
    at_least,
    whole,
)
from ._output import Output

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from ..web.auth import Caller

__all__ = ["LOOPBACK", "add_serve", "allowed_hosts", "app_for", "is_loopback", "read_tokens", "run"]

#: fencing.web.api's MAX_TTL and MAX_LIMIT, the lease API's own bounds (not imported from
#: there: the web extra may be missing where the parser is built)
API_MAX_TTL, API_MAX_LIMIT = 86400.0, 1000


def add_serve(commands: Commands) -> None:
    parser = add_command(
        commands,
        "serve",
        serve,
        help="serve the dashboard (actions for --operator-tokens) and, with --api-tokens, the lease API",
        description="Run the web dashboard of the jobs table on uvicorn (the web extra: pip install "
        "'fencing[web]'): counts by state, rates, leases counting down, each job's ownership "
        "history, fence marks, locks, live. Its actions (revoke, release, delete, enqueue) are "
        "for the operators of --operator-tokens FILE ('TOKEN NAME' per line), who sign in at "
        "/login with their token. The pages are open to whoever reaches the server; only the "
        "Host names it binds (and --allowed-host) are answered. With --api-tokens FILE (one "
        "'TOKEN OWNER [OWNER ...]' per line) the lease API is served at /api for workers in any "
        "language, each authenticated by its bearer token and acting only as the owners on its "
        "line.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (%(default)s)")
    parser.add_argument("--port", type=whole(1, 65535), default=8000, help="the port (%(default)s)")
    parser.add_argument(
        "--interval",
        type=at_least(0.05),
        default=1.0,
        metavar="SECONDS",
        help="seconds between the live feed's reads of the table (%(default)g)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a Host name to answer besides localhost, 127.0.0.1, [::1] and --host (repeatable; "
        "'*.example.com' for a domain's)",
    )
    parser.add_argument(
        "--api-tokens",
        metavar="FILE",
        help="serve the lease API at /api for these bearer tokens ('TOKEN OWNER [OWNER ...]' "
        "per line: the owners each may act as)",
    )
    parser.add_argument(
        "--operator-tokens",
        metavar="FILE",
        help="turn the dashboard's actions on for operators who sign in at /login with one of "
        "these tokens ('TOKEN NAME' per line; the name is logged with each action)",
    )
    parser.add_argument(
        "--api-max-ttl",
        type=at_least(0.001),
        default=API_MAX_TTL,
        metavar="SECONDS",
        help="the longest lease the API hands out or renews (%(default)g)",
    )
    parser.add_argument(
        "--api-max-limit",
        type=whole(1, 1_000_000),
        default=API_MAX_LIMIT,
        metavar="N",
        help="the most jobs one claim of the API takes (%(default)s)",
    )
    add_max_attempts(parser, "what the workers pass to claim_next, and what the API's claims apply")
    add_history_table(parser, "shown (timelines, refusals) when it exists")
    add_attempts_table(parser)
    add_side_tables(parser)
    parser.add_argument(
        "--locks-table", default="fencing_locks", metavar="NAME", help="the named locks' table (%(default)s)"
    )
    parser.add_argument(
        "--schedules-table",
        default="fencing_schedules",
        metavar="NAME",
        help="the schedules table (%(default)s): its schedules listed when it exists",
    )


def serve(args: argparse.Namespace, db: Database, out: Output) -> int:
    try:  # the web face, and with it the web extra (starlette, jinja2, python-multipart, uvicorn)
        importlib.import_module("fencing.web")
        importlib.import_module("uvicorn")
    except ImportError as exc:
        raise Failed(
            f"the web extra is not installed ({exc.name} is missing): pip install 'fencing[web]'"
        ) from None
    history = db.history(args.history_table)
    locks = (
        locks_table(MetaData(), args.locks_table, schema=db.table.schema)
        if db.has(args.locks_table)
        else None
    )
    tokens = read_tokens(args.api_tokens) if args.api_tokens else None
    operators = read_operators(args.operator_tokens) if args.operator_tokens else None
    hosts = allowed_hosts(args.host, args.allowed_host or ())
    sides = db.beside(args.payloads_table, args.failures_table)
    schedules = (
        schedules_table(MetaData(), args.schedules_table, schema=db.table.schema)
        if db.has(args.schedules_table)
        else None
    )
    app = app_for(
        db.engine,
        db.table,
        history=None if history is None else history.table,
        locks=locks,
        attempts=db.attempts(args.attempts_table),
        payloads=sides.payloads,
        failures=sides.failures,
        schedules=schedules,
        interval=args.interval,
        max_attempts=args.max_attempts,
        tokens=tokens,
        operators=operators,
        hosts=hosts,
        max_ttl=args.api_max_ttl,
        max_limit=args.api_max_limit,
    )
    api = f" and the lease API at http://{args.host}:{args.port}/api" if tokens else ""
    print(
        f"fencing: the dashboard of table {db.table.name!r} at http://{args.host}:{args.port}/{api}, "
        f"answering the host names {', '.join(hosts)} (--allowed-host adds one)",
        file=sys.stderr,
    )
    if not is_loopback(args.host):
        print(
            f"fencing: the dashboard's pages are open to whoever reaches {args.host}:{args.port}: "
            "every job's id, owner and result (mount fencing.web.dashboard with authorize to close them)",
            file=sys.stderr,
        )
    run(app, host=args.host, port=args.port)
    return 0


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


def _token_lines(path: str, what: str, shape: str) -> list[tuple[str, list[str]]]:
    """The ``TOKEN ...`` lines of ``path`` (``#`` comments and empty lines skipped): each
    token with the words after it, at least one; a token on two lines, a file of none, or one
    it cannot read is an error naming ``what`` it holds and the line's ``shape``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read the {what} from {path!r}: {exc.strerror}") from None
    found: dict[str, list[str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        token, *rest = line.split()
        if not rest:
            raise InvalidArgument(f"{path}, line {number}: expected '{shape}'")
        if token in found:
            raise InvalidArgument(f"{path}, line {number}: this token is on an earlier line already")
        found[token] = rest
    if not found:
        raise InvalidArgument(f"{path} holds no token")
    return list(found.items())


def read_operators(path: str) -> dict[str, str]:
    """``TOKEN NAME`` per line from ``path``: the operators who may sign in to the dashboard,
    each by its token (16 characters or more)."""
    operators: dict[str, str] = {}
    for token, rest in _token_lines(path, "operator tokens", "TOKEN NAME"):
        if len(rest) != 1:
            raise InvalidArgument(f"{path}: expected 'TOKEN NAME', got {len(rest) + 1} words on a line")
        if len(token) < 16:
            raise InvalidArgument(f"{path}: a token must be at least 16 characters ({rest[0]}'s)")
        operators[token] = rest[0]
    return operators


def read_tokens(path: str) -> dict[str, Caller]:
    """``TOKEN OWNER [OWNER ...]`` per line from ``path``: the token acts as each owner named,
    the first one its name in the logs."""
    from ..web.auth import Caller

    lines = _token_lines(path, "API tokens", "TOKEN OWNER [OWNER ...]")
    return {token: Caller(owners[0], owners=owners) for token, owners in lines}


def app_for(
    engine: Engine,
    table: Table,
    *,
    history: Table | None,
    locks: Table | None,
    interval: float,
    attempts: Table | None = None,
    payloads: Table | None = None,
    failures: Table | None = None,
    schedules: Table | None = None,
    max_attempts: int | None,
    tokens: dict[str, Caller] | None,
    operators: dict[str, str] | None = None,
    hosts: Sequence[str] = LOOPBACK,
    max_ttl: float = API_MAX_TTL,
    max_limit: int = API_MAX_LIMIT,
) -> Starlette:
    """The app ``fencing serve`` runs: the dashboard at ``/``, the lease API at ``/api``
    (with ``attempts``, a requeued job's attempts count from its requeue in both; with
    ``payloads`` and ``failures``, both show and take a job's payload and last failure; with
    ``history``, the API's changes are recorded there; ``max_attempts`` applies to its
    claims as to the dashboard's poisoned jobs), answering only the ``Host`` names ``hosts``."""
    from starlette.applications import Starlette
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.routing import Mount

    from ..web import bearer_tokens, dashboard, lease_api

    routes = []
    if tokens is not None:
        # never prunes, as the dashboard's store: retention is the application's
        recorded = None if history is None else History(history, retention=None)
        store = JobStore(
            engine, table, history=recorded, attempts=attempts, payloads=payloads, failures=failures
        )
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
        payloads=payloads,
        failures=failures,
        schedules=schedules,
        operator_tokens=operators,
    )
    routes.append(Mount("/", board))
    app = Starlette(routes=routes, lifespan=board.router.lifespan_context)
    # against DNS rebinding: a page whose name resolves to this address is not let in
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(hosts), www_redirect=False)
    return app


def run(app: Starlette, *, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")
