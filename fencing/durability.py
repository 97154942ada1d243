"""Whether the database keeps what it acknowledged: the settings a fence's survival rests on.

A fence is handed out at most once only if the commit that handed it out survives whatever
happens after the database said "committed". A database set to trade that away for speed
loses the last commits on a crash, power loss or failover; the counter goes back, and the
next claim hands the same fence to a second worker. The library cannot repair that: it can
only name the settings, which :func:`findings` does, per dialect:

* **PostgreSQL**: ``fsync`` and ``full_page_writes`` off; ``synchronous_commit = off``
  (a crash of the server loses commits it acknowledged) or ``local`` while a synchronous
  standby is named (the standby may lack a commit the primary acknowledged: a failover to
  it loses it; with no standby named, ``local`` is ``on``); standbys streaming while
  ``synchronous_standby_names`` is empty (asynchronous: a failover loses what they had not
  received; logical replication's senders are not standbys and are not counted).
  ``remote_write`` is accepted: a commit is lost only if the primary fails and the
  standby's operating system crashes before its next flush.
* **MariaDB/MySQL**: ``innodb_flush_log_at_trx_commit`` other than 1 (3, MariaDB's alias
  of 1, is accepted), ``sync_binlog`` other than 1 while the binary log is on, and
  ``innodb_doublewrite`` off (or MySQL's ``DETECT_ONLY``).
* **SQLite**: ``journal_mode`` ``OFF`` or ``MEMORY``; ``synchronous = OFF`` in any mode,
  ``NORMAL`` in WAL (power loss rolls back the last commits) and in a rollback journal
  (SQLite documents a small chance of corruption on power loss there); ``fullfsync`` off on
  macOS, where ``fsync`` alone does not reach the disk's platter (elsewhere it does not
  apply, and is said so).

Settings are read on a connection of the engine, so a value set per session is the one the
store's sessions get: PostgreSQL's ``synchronous_commit`` per role, per database, in the
URL's ``options`` or by a ``connect`` listener; SQLite's pragmas, which are per connection.

The store meets an engine once per pool (:func:`note`, called by the runner on its first
checkout): every risk is logged once, a WARNING on the ``fencing.durability`` logger with
the fields ``database``, ``setting``, ``value``, ``risk`` and ``advice`` (``extra=``). An
engine passed to :func:`require_durable` is refused instead, with
:class:`~fencing.ConfigurationError`: checked at once, and again where the store meets it.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Connection, Engine

from ._dialects import by_name
from ._errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: what the API reference documents; the rest serves `fencing doctor` and the store
__all__ = ["Finding", "check_durability", "require_durable"]

logger = logging.getLogger("fencing.durability")  # the name operators filter on

#: a setting keeps what was acknowledged; it does not; or it has no meaning here
Status = Literal["ok", "risk", "not applicable"]
#: the values read, by setting name, lowercased (SQLite's numbers as their names)
Values = Mapping[str, str]


@dataclass(frozen=True)
class Finding:
    """One setting as the database reported it, and what it means for a fence."""

    #: ``"postgresql"``, ``"mysql"`` (MariaDB too) or ``"sqlite"``
    database: str
    setting: str
    #: as read (lowercased), with what it was judged with, e.g. ``"normal (journal_mode wal)"``
    value: str
    status: Status
    #: what the value risks for a fence ("" when ok)
    risk: str
    #: what to set instead ("" when ok)
    advice: str
    #: why the setting means nothing here (``not applicable``)
    note: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def judge(database: str, settings: Values, *, platform: str = sys.platform) -> list[Finding]:
    """Each setting of ``database`` (``"postgresql"``, ``"mysql"``, ``"sqlite"``) as
    ``settings`` give it, judged by :data:`RULES`: one :class:`Finding` per setting, the
    first rule that matches deciding. A setting the database did not report is a risk
    (what cannot be read cannot be shown safe). ``platform``: where a SQLite file lives
    (``sys.platform``)."""
    known = by_name(database)
    found = []
    for setting in known.durability_settings:
        if setting not in settings:
            found.append(
                Finding(
                    database,
                    setting,
                    "(not reported)",
                    "risk",
                    "the database does not report it, so what it keeps after a crash is unknown",
                    f"check {setting} by hand",
                )
            )
            continue
        value = known.shown(setting, settings)
        why_not = known.not_applicable(setting, settings, platform)
        if why_not is not None:
            found.append(Finding(database, setting, value, "not applicable", "", "", why_not))
            continue
        rule = next((r for r in known.durability_rules if r.setting == setting and r.unsafe(settings)), None)
        if rule is None:
            found.append(Finding(database, setting, value, "ok", "", ""))
        else:
            found.append(Finding(database, setting, value, "risk", rule.risk, rule.advice))
    return found


# -- reading the settings ----------------------------------------------------------------------


def dialect_family(name: str) -> str | None:
    """The database a SQLAlchemy dialect name reaches, as findings name it, or None for one
    the library has no rules for."""
    known = by_name(name)
    return known.family if known.durability_settings else None


def read_settings(database: str, dbapi_connection: Any) -> dict[str, str]:
    """The settings :func:`judge` needs, read on a driver connection (idle, not in a
    transaction of the caller's: the read's implicit transaction is rolled back)."""
    cursor = dbapi_connection.cursor()
    try:
        settings = by_name(database).read_durability(cursor)
    finally:
        cursor.close()
    dbapi_connection.rollback()  # the read began a transaction (a driver's implicit BEGIN)
    return settings


def findings(conn: Connection, *, platform: str = sys.platform) -> list[Finding]:
    """The durability settings of ``conn``'s database, as a session of its engine gets them,
    one :class:`Finding` per setting (``ok``, ``risk`` or ``not applicable``). ``conn`` must
    not be in a transaction (its driver connection's is rolled back)."""
    database = dialect_family(conn.dialect.name)
    if database is None:
        raise ConfigurationError(f"no durability rules for the {conn.dialect.name} dialect")
    if conn.in_transaction():
        raise ConfigurationError("read the durability settings outside a transaction")
    return judge(database, read_settings(database, conn.connection.dbapi_connection), platform=platform)


def check_durability(engine: Engine) -> list[Finding]:
    """:func:`findings` on a connection of ``engine``'s, checked out for it."""
    with engine.connect() as conn:
        return findings(conn)


# -- the store's own check: once per pool, a WARNING per risk, or a refusal --------------------

#: the dialects (shared by an engine, its execution_options() copies, its AsyncEngine, and
#: kept by dispose()) whose engines must be durable
_strict: weakref.WeakSet[Any] = weakref.WeakSet()
#: the risks found, by pool (read once per pool: a disposed engine's new pool reads again)
_risks: weakref.WeakKeyDictionary[Any, tuple[Finding, ...]] = weakref.WeakKeyDictionary()
#: failed reads, by pool
_tries: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
#: how many times a pool's settings are read before "could not be read" stands for them
ATTEMPTS = 3


def _refusal(risks: tuple[Finding, ...]) -> ConfigurationError:
    named = "; ".join(f"{f.setting} = {f.value}: {f.risk} (set {f.advice})" for f in risks)
    return ConfigurationError(f"the database does not keep every commit it acknowledges: {named}")


def require_durable(engine: Engine | AsyncEngine) -> None:
    """Refuse ``engine`` (:class:`~fencing.ConfigurationError`) where its database could
    lose a commit it acknowledged, instead of logging a WARNING: a sync engine is checked at
    once (one connection), and the store checks again where it meets the engine (a disposed
    engine's new connections too). An ``AsyncEngine`` is checked where the async store
    meets it. The engine's ``execution_options()`` copies are strict with it."""
    sync: Engine = engine.sync_engine if hasattr(engine, "sync_engine") else engine
    _strict.add(sync.dialect)
    if not getattr(sync.dialect, "is_async", False):
        risks = tuple(f for f in check_durability(sync) if f.status == "risk")
        if risks:
            raise _refusal(risks)


def is_strict(engine: Engine) -> bool:
    """Whether :func:`require_durable` was called for ``engine`` (or the engine it was copied from)."""
    return engine.dialect in _strict


def note(engine: Engine, dbapi_connection: Any) -> bool:
    """The store meets ``engine`` on ``dbapi_connection`` (just checked out, idle): on the
    pool's first meeting, read its settings and log a WARNING per risk (once); raise
    :class:`~fencing.ConfigurationError` on every meeting while a risk stands and the
    engine is strict. A read that fails is tried again at the next meeting (refused
    meanwhile when strict), :data:`ATTEMPTS` times, then logged as a risk of its own.
    ``True`` once the pool is known safe: the caller need not ask again for this pool."""
    pool = engine.pool
    risks = _risks.get(pool)
    if risks is None:
        risks = _read_risks(engine, dbapi_connection)
        if risks is None:  # not read this time
            if is_strict(engine):
                raise ConfigurationError("the database's durability settings could not be read")
            return False
        with _lock:
            first = pool not in _risks
            _risks.setdefault(pool, risks)
        if first:
            for f in risks:
                logger.warning(
                    "%s: %s = %s risks what was acknowledged: %s; set %s",
                    f.database,
                    f.setting,
                    f.value,
                    f.risk,
                    f.advice,
                    extra=f.as_dict(),
                )
    if risks and is_strict(engine):
        raise _refusal(risks)
    return not risks


def _read_risks(engine: Engine, dbapi_connection: Any) -> tuple[Finding, ...] | None:
    """The risks of ``engine``'s database; None if the read failed and may be tried again."""
    database = dialect_family(engine.dialect.name)
    if database is None:
        return ()
    try:
        settings = read_settings(database, dbapi_connection)
    except Exception as exc:
        with _lock:
            tries = _tries[engine.pool] = _tries.get(engine.pool, 0) + 1
        if tries < ATTEMPTS:
            return None
        unread = f"the settings could not be read ({type(exc).__name__}: {str(exc).strip()[:200]})"
        return (Finding(database, "(all)", "(not read)", "risk", unread, "check them with `fencing doctor`"),)
    return tuple(f for f in judge(database, settings) if f.status == "risk")
