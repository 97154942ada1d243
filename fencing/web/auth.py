"""Who is asking, and as which owners it may act: the application's callable decides.

Both the lease API and the dashboard take an ``authorize`` callable: given the
:class:`starlette.requests.Request`, it returns who is asking or ``None`` to refuse. It may
be a plain function or a coroutine function. Who is asking is a name (a ``str``: written to
the log with each action, and the one owner it may act as in the lease API) or a
:class:`Caller` (a name and the owners it is granted). :func:`bearer_tokens` is one: a fixed
table of tokens, compared in constant time.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from starlette.requests import Request

from .._errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "SIGNED_IN_COOKIE",
    "Authorize",
    "Caller",
    "bearer_tokens",
    "caller_of",
    "who_is_asking",
]

#: the cookie an operator's browser holds once it signed in with a token (:class:`TokenSignIn`)
SIGNED_IN_COOKIE = "fencing_operator"


@dataclass(frozen=True, init=False)
class Caller:
    """Who is asking (``name``, written to the log) and the owners it may act as in the lease
    API (``owners``: by default its name alone; an empty list: none, e.g. a token that only
    enqueues). A claim, renewal, completion or release for any other owner is refused (``403``).

    ``Caller("deployer", owners=["go-1", "go-2"])``: one token for a pool of two workers."""

    name: str
    owners: frozenset[str]

    def __init__(self, name: str, owners: Iterable[str] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentType(f"a Caller's name must be a non-empty str, got {name!r:.80}")
        if owners is None:
            granted = frozenset((name,))
        elif isinstance(owners, str) or not isinstance(owners, Iterable):
            # a str is an iterable of its letters: never what was meant
            raise InvalidArgumentType(
                f"a Caller's owners must be a list of str (not one str), got {type(owners).__name__}"
            )
        else:
            granted = frozenset(owners)
            if not all(isinstance(o, str) and o for o in granted):
                raise InvalidArgumentType("a Caller's owners must be non-empty str")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "owners", granted)

    def may_act_as(self, owner: str) -> bool:
        """Whether this caller may claim, renew, complete or release as ``owner``."""
        return owner in self.owners


#: ``authorize(request)``: who is asking (a name, or a :class:`Caller`), or ``None`` to refuse
Authorize = Callable[[Request], str | Caller | Awaitable[str | Caller | None] | None]


def bearer_tokens(tokens: Mapping[str, str | Caller]) -> Authorize:
    """An ``authorize`` that reads ``Authorization: Bearer TOKEN`` and answers who ``tokens``
    maps it to, or ``None``: a name (``{"s3cr3t-token": "worker-go-1"}``: the token acts as
    the owner ``worker-go-1`` only) or a :class:`Caller` granting a list of owners
    (``{"s3cr3t-token": Caller("pool-go", owners=["go-1", "go-2"])}``).

    Every token is compared in constant time (:func:`hmac.compare_digest`), each one, so the
    time taken says nothing of which one nearly matched.
    """
    table = _token_table(tokens)

    def authorize(request: Request) -> Caller | None:
        return _bearer(table, request)

    return authorize


def _token_table(tokens: Mapping[str, str | Caller]) -> list[tuple[bytes, Caller]]:
    if not isinstance(tokens, Mapping):
        raise InvalidArgumentType(f"tokens must be a mapping of token to name, got {type(tokens).__name__}")
    table: list[tuple[bytes, Caller]] = []
    for token, who in tokens.items():
        if not isinstance(token, str) or not isinstance(who, (str, Caller)):
            raise InvalidArgumentType("tokens must map str tokens to str names or fencing.web.Caller")
        if len(token) < 16:
            raise InvalidArgument("a bearer token must be at least 16 characters: a short one can be guessed")
        table.append((token.encode("utf-8"), who if isinstance(who, Caller) else Caller(who)))
    return table


def _matching(table: list[tuple[bytes, Caller]], given: str) -> Caller | None:
    """Whose ``given`` token is: every token compared, in constant time."""
    presented = given.encode("utf-8", "surrogateescape")
    found = None
    for token, who in table:
        if hmac.compare_digest(token, presented) and found is None:
            found = who
    return found


def _bearer(table: list[tuple[bytes, Caller]], request: Request) -> Caller | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    return _matching(table, given.strip())


class TokenSignIn:
    """Operators who sign in to a dashboard with a token (``{"a-long-random-token": "alice"}``):
    the dashboard's ``/login`` page takes the token and, when it is one of them, leaves it in
    an ``HttpOnly``, ``SameSite=Strict`` cookie (``Secure`` over HTTPS) that :meth:`authorize`
    reads, as it reads ``Authorization: Bearer``; ``/logout`` removes it. Tokens are compared
    in constant time, each one (as :func:`bearer_tokens`), and are at least 16 characters.
    What ``fencing serve --operator-tokens FILE`` turns the dashboard's actions on with."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        if not isinstance(tokens, Mapping):
            raise InvalidArgumentType(
                f"tokens must be a mapping of token to name, got {type(tokens).__name__}"
            )
        if not tokens:
            raise InvalidArgument("tokens is empty: nobody could sign in")
        for token, name in tokens.items():
            if not isinstance(token, str) or not isinstance(name, str) or not name:
                raise InvalidArgumentType("tokens must map str tokens to non-empty str names")
        self._table = _token_table(dict(tokens))

    def name_of(self, token: str) -> str | None:
        """Whose ``token`` is, or ``None``."""
        who = _matching(self._table, token)
        return None if who is None else who.name

    def authorize(self, request: Request) -> str | None:
        """Who signed in (the cookie) or presents a token (``Authorization: Bearer``), or ``None``."""
        cookie = request.cookies.get(SIGNED_IN_COOKIE)
        if cookie:
            return self.name_of(cookie)
        who = _bearer(self._table, request)
        return None if who is None else who.name


async def caller_of(authorize: Authorize | None, request: Request) -> Caller | None:
    """Who ``authorize`` says is asking, as a :class:`Caller` (a name it returned acts as that
    owner alone); ``None`` when it refuses, or when there is no ``authorize``."""
    if authorize is None:
        return None
    answer = authorize(request)
    if inspect.isawaitable(answer):
        answer = await answer
    if answer is None or answer == "":
        return None
    if isinstance(answer, Caller):
        return answer
    if isinstance(answer, str):
        return Caller(answer)
    raise InvalidArgumentType(
        "authorize must return who is asking (a str or a fencing.web.Caller) or None, "
        f"got {type(answer).__name__}"
    )


async def who_is_asking(authorize: Authorize | None, request: Request) -> str | None:
    """The name of who ``authorize`` says is asking (``None`` when it refuses, or when there
    is no ``authorize``)."""
    caller = await caller_of(authorize, request)
    return None if caller is None else caller.name
