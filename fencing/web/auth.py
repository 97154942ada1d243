"""Who is asking: the application's callable decides; the web face only asks it.

Both the lease API and the dashboard's actions take an ``authorize`` callable: given the
:class:`starlette.requests.Request`, it returns who is asking (a name, written to the log
with each action) or ``None`` to refuse. It may be a plain function or a coroutine function.
:func:`bearer_tokens` is one: a fixed table of tokens, compared in constant time.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request

from ..core.errors import InvalidArgument, InvalidArgumentType

__all__ = ["Authorize", "bearer_tokens", "who_is_asking"]

#: ``authorize(request)``: the name of who is asking, or ``None`` to refuse the request
Authorize = Callable[[Request], str | Awaitable[str | None] | None]


def bearer_tokens(tokens: Mapping[str, str]) -> Authorize:
    """An ``authorize`` that reads ``Authorization: Bearer TOKEN`` and answers the name
    ``tokens`` maps it to (``{"s3cr3t-token": "worker-go-1"}``), or ``None``.

    Every token is compared in constant time (:func:`hmac.compare_digest`), each one, so the
    time taken says nothing of which one nearly matched.
    """
    if not isinstance(tokens, Mapping):
        raise InvalidArgumentType(f"tokens must be a mapping of token to name, got {type(tokens).__name__}")
    table: list[tuple[bytes, str]] = []
    for token, name in tokens.items():
        if not isinstance(token, str) or not isinstance(name, str):
            raise InvalidArgumentType("tokens must map str tokens to str names")
        if len(token) < 16:
            raise InvalidArgument("a bearer token must be at least 16 characters: a short one can be guessed")
        table.append((token.encode("utf-8"), name))

    def authorize(request: Request) -> str | None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None
        presented = given.strip().encode("utf-8", "surrogateescape")
        found = None
        for token, name in table:
            if hmac.compare_digest(token, presented) and found is None:
                found = name
        return found

    return authorize


async def who_is_asking(authorize: Authorize | None, request: Request) -> str | None:
    """What ``authorize`` says of ``request`` (``None`` when there is no ``authorize``)."""
    if authorize is None:
        return None
    answer = authorize(request)
    if inspect.isawaitable(answer):
        answer = await answer
    if answer is not None and not isinstance(answer, str):
        raise InvalidArgumentType(
            f"authorize must return the name of who is asking (a str) or None, got {type(answer).__name__}"
        )
    return answer or None
