"""A server's engine from a URL, and what to do when it cannot be made, said beside
SQLAlchemy's own error: a scheme SQLAlchemy does not know (``postgres://``: the URL to
write instead), a driver that is not installed (the extra of fencing that installs one), an
asyncio driver where a sync one is needed. Each message names the URL to use, its password
hidden. The command line's ``--url`` and ``service.py``'s server URLs both come here, and
are parsed here (:func:`parse_url`): a text that is not a URL is named with its password hidden
too, as far as its shape shows one.
"""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy
from sqlalchemy import URL, Engine
from sqlalchemy.exc import ArgumentError

from .._errors import InvalidArgument
from . import KNOWN_NAMES, by_name
from .base import Database

__all__ = ["after_failing", "before_connecting", "parse_url", "server_engine"]

#: a password in a text that does not parse as a URL: after ``scheme://user:``, up to ``@``
_PASSWORD = re.compile(r"(?<=://)([^/@:\s]*):[^@\s]*@")


def _hidden(text: str) -> str:
    return _PASSWORD.sub(r"\1:***@", text)


def parse_url(raw: str) -> URL:
    """``sqlalchemy.make_url(raw)``, or :class:`~fencing.InvalidArgument` naming the text (its
    password hidden) and why it is not a URL: a text SQLAlchemy cannot read (its
    ``ArgumentError``, worded differently by its releases: said here in words of our own), or
    the bare ``ValueError`` it raises for a port that is not a number."""
    try:
        return sqlalchemy.make_url(raw)
    except ArgumentError:
        why = "not of the form dialect+driver://user:password@host:port/database"
    except ValueError as exc:
        why = _hidden(str(exc))
    raise InvalidArgument(f"not a database URL: {_hidden(raw)!r} ({why})") from None


def server_engine(url: URL, **options: Any) -> Engine:
    """``sqlalchemy.create_engine(url, **options)`` for a sync engine, or
    :class:`~fencing.InvalidArgument` saying what to do (the URL's password hidden)."""
    shown = url.render_as_string(hide_password=True)
    problem = before_connecting(url)
    if problem is not None:
        raise InvalidArgument(f"cannot use database URL {shown!r}: {problem}")
    try:
        return sqlalchemy.create_engine(url, **options)
    except (ArgumentError, ImportError) as exc:
        raise InvalidArgument(f"cannot use database URL {shown!r}: {exc}{after_failing(url, exc)}") from exc


def _misspelled(backend: str) -> tuple[str, Database] | None:
    for name in KNOWN_NAMES:
        database = by_name(name)
        if backend in database.misspellings:
            return name, database
    return None


def _sync_driver(database: Database) -> tuple[str, str] | None:
    """The sync driver fencing installs for ``database`` and the extra that installs it."""
    return next(iter(database.extras.items()), None)


def _is_async(url: URL) -> bool:
    """Whether ``url`` names an asyncio driver (known without importing the driver)."""
    try:
        return bool(url.get_dialect().is_async)
    except ArgumentError:  # a scheme SQLAlchemy does not know: said when the engine is made
        return False


def _instead(url: URL, backend: str, database: Database) -> str:
    """``url`` with the driver fencing installs for ``database``, and how to install it."""
    sync = _sync_driver(database)
    if sync is None:
        return ""
    driver, extra = sync
    shown = url.set(drivername=f"{backend}+{driver}").render_as_string(hide_password=True)
    install = f" (pip install 'fencing[{extra}]')" if extra else ""
    return f"use {shown!r}{install}"


def before_connecting(url: URL) -> str | None:
    """Why a command cannot use ``url``, known from the URL alone, or ``None``."""
    backend = url.get_backend_name()
    misspelled = _misspelled(backend)
    if misspelled is not None:
        name, database = misspelled
        return f"SQLAlchemy names this database {name!r}, not {backend!r}: " + _instead(url, name, database)
    database = by_name(backend)
    if _is_async(url):
        return (
            f"{url.get_driver_name()} is an asyncio driver and the command connects with a sync one: "
            + _instead(url, backend, database)
            + " (fencing worker runs an async def function on an asyncio driver by itself)"
        )
    return None


def after_failing(url: URL, error: BaseException) -> str:
    """What to do after SQLAlchemy could not make an engine for ``url`` (``error``: its
    :class:`ImportError` or :class:`~sqlalchemy.exc.ArgumentError`); ``""`` if nothing
    more is known."""
    backend, database = url.get_backend_name(), by_name(url.get_backend_name())
    if isinstance(error, ImportError):  # so the dialect loaded: it knows its default driver
        driver = url.get_driver_name()
        missing = error.name or driver
        extra = database.extras.get(driver)
        if extra:
            return f"; its driver {missing} is not installed: pip install 'fencing[{extra}]'"
        instead = _instead(url, backend, database)
        if instead:
            return f"; its driver {missing} is not installed: {instead}, or install {missing} yourself"
        return f"; its driver {missing} is not installed"
    if isinstance(error, ArgumentError) and not database.known:
        known = ", ".join(sorted({by_name(n).family for n in KNOWN_NAMES}))
        return f"; fencing knows {known}"
    return ""
