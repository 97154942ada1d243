"""PostgreSQL's notifications of the library: which channel a table's waiters listen on, and
what an enqueue sends them (:mod:`fencing._store.wakeups` listens)."""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import ColumnElement, Table, Text, column, func, literal, null, select, table

__all__ = ["LISTENING", "channel_of", "listening_notice"]

#: the ``application_name`` of a process's listening connection (:mod:`fencing._store.wakeups`):
#: what an enqueue looks for in ``pg_stat_activity`` before it notifies anyone
LISTENING = "fencing: listening"
#: PostgreSQL's longest identifier (NAMEDATALEN - 1 bytes): a channel name's limit
_CHANNEL_MAX = 63


def channel_of(tbl: Table) -> str:
    """The notification channel of a locks or jobs table: ``fencing:<schema.table>``, or the
    name's digest where that is longer than PostgreSQL allows a channel name."""
    channel = f"fencing:{tbl.fullname}"
    if len(channel.encode()) <= _CHANNEL_MAX:
        return channel
    return "fencing:" + hashlib.sha256(tbl.fullname.encode()).hexdigest()[:40]


def listening_notice(channel: str, listening: str = LISTENING) -> ColumnElement[Any]:
    """What an enqueue RETURNs on PostgreSQL to wake the claims that wait for work in other
    processes: ``pg_notify`` on the jobs table's channel (an empty payload), sent only if some
    process listens now (a session named ``listening`` in ``pg_stat_activity``: a NOTIFY
    takes a lock every notifying commit of the cluster waits for), and whether one did
    (``true``, or ``NULL``: nobody listens)."""
    activity = table("pg_stat_activity", column("application_name", Text()))
    return (
        select(func.pg_notify(literal(channel), literal("")).is_not(null()))
        .where(activity.c.application_name == literal(listening))
        .limit(1)
        .scalar_subquery()
        .label("announced")
    )
