"""What the library assumes of a database it does not know by name: portable SQL, no clock of
its own, no way to wake a waiter. Each known database overrides what differs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import ColumnElement, func

__all__ = [
    "ARRAYS",
    "COUNTED",
    "DUPLICATE_KEY",
    "EACH",
    "FENCE_AGAIN",
    "LOCKING",
    "LOOP",
    "RETURNED",
    "THREAD",
    "Database",
    "Rule",
    "Values",
]

#: how a batch of completions reaches the database (:attr:`Database.batch_completion`)
EACH, ARRAYS, LOCKING = "each", "returning", "locking"
#: how "insert unless it exists" answers (:attr:`Database.upsert`): the statement's row
#: count (SQLite's ``ON CONFLICT DO NOTHING``), its ``RETURNING`` rows (PostgreSQL's), or a
#: duplicate-key error that undoes only the statement (MariaDB/MySQL)
COUNTED, RETURNED, DUPLICATE_KEY = "counted", "returned", "duplicate key"

#: where a waiter hears of a freed lock or a new job (:meth:`Database.wakeups`): a thread's
#: listening connection, the event loop's, a thread that watches the database file for other
#: connections' commits, or nowhere (it paces itself by backoff)
THREAD, LOOP, WATCHED = "thread", "loop", "watched"


#: the durability settings read, by name, lowercased (SQLite's numbers as their names)
Values = Mapping[str, str]
#: what a lost commit means for a fence
FENCE_AGAIN = "a fence handed out can be handed out again"


@dataclass(frozen=True)
class Rule:
    """An unsafe value of one durability setting: when ``unsafe`` says so of the values
    read, the setting is at ``risk``; ``advice`` says what to set. A setting no rule matches
    is ok (:mod:`fencing.durability`)."""

    setting: str
    unsafe: Callable[[Values], bool]
    risk: str
    advice: str


class Database:
    """A database, as the library needs to know it. The defaults are the portable ones."""

    #: the SQLAlchemy dialect names that reach it
    names: ClassVar[tuple[str, ...]] = ()
    #: its name in messages and in the durability report (``Finding.database``)
    family: ClassVar[str] = "default"
    #: the library knows it by name (fence marks refuse the others)
    known: ClassVar[bool] = False

    # -- the clock -------------------------------------------------------------------------
    #: the SQL of the seconds since 1970-01-01 UTC on its clock; ``None``: it has none the
    #: library knows (``now=`` must be passed)
    clock_sql: ClassVar[str | None] = None
    #: how finely that clock counts, in seconds: a reading is up to this much earlier than
    #: the instant it was taken
    clock_resolution: ClassVar[float] = 1e-3

    # -- keys and text ---------------------------------------------------------------------
    #: UTF-8 bytes a key column (job id, resource, idempotency key) holds; ``None``: no limit
    id_max_bytes: ClassVar[int | None] = None
    #: its text columns can store U+0000
    text_holds_nul: ClassVar[bool] = True

    # -- statements ------------------------------------------------------------------------
    #: how an insert that may exist already tells which happened
    upsert: ClassVar[str] = DUPLICATE_KEY
    #: how a batch of completions is stored: one UPDATE each, one UPDATE ... FROM
    #: unnest(arrays) RETURNING per chunk, or a locking read and one joined UPDATE
    batch_completion: ClassVar[str] = EACH
    #: a writer locks the whole database (SQLite), not the rows it writes
    locks_whole_database: ClassVar[bool] = False
    #: a batched claim of the store's own first makes the planner walk the ready index in
    #: claim order (PostgreSQL on a never-analyzed table)
    walks_claim_order: ClassVar[bool] = False
    #: it starts an index range at a row value ``(until, id) > (u, i)``; else the order is
    #: spelled out for it
    ranges_at_row_values: ClassVar[bool] = False
    #: a table hint (``{index}``: the index's name) without which its planner reads an index
    #: backwards from its far end to a page's cursor, not from the cursor (MariaDB: no index
    #: condition pushdown in a backward scan, and a ``ref`` on the first column preferred)
    backward_walk_hint: ClassVar[str | None] = None
    #: a prefix of a key column needs its lower bound said besides the ``LIKE`` to be walked
    #: as a range of the key (PostgreSQL outside the C collation)
    prefix_needs_low_bound: ClassVar[bool] = False

    def unindexed(self, sql: str) -> str:
        """``sql`` (a column) spelled so that the planner does not drive a join through an
        index on it."""
        return sql

    def fence_sum(self, fence: ColumnElement[Any]) -> ColumnElement[Any]:
        """The sum of ``fence`` over rows, at the last fence too."""
        return func.coalesce(func.sum(fence), 0)

    def prefix_match(self, column: ColumnElement[Any], pattern: ColumnElement[Any]) -> ColumnElement[bool]:
        """``column`` starts with the prefix :meth:`prefix_pattern` made ``pattern`` of."""
        return column.like(pattern, escape="\\")

    def prefix_pattern(self, prefix: str) -> str:
        """``prefix`` as a ``LIKE`` pattern that matches the keys starting with it, exactly."""
        return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"

    # -- the file or the server ------------------------------------------------------------
    #: a file on this machine (SQLite): known by its file, its handles local to a process,
    #: its transactions begun by the library's engine glue
    is_file: ClassVar[bool] = False
    #: the asyncio drivers the library runs on, in the order it prefers them (the module
    #: each imports as, and the driver name of its URL)
    async_drivers: ClassVar[tuple[str, ...]] = ()
    #: the drivers fencing's extras install, by a URL's driver name: the extra's name
    #: (``pip install "fencing[NAME]"``); the first is the sync driver a URL should name
    extras: ClassVar[dict[str, str]] = {}
    #: URL schemes people write for it that SQLAlchemy does not know (``postgres://``)
    misspellings: ClassVar[tuple[str, ...]] = ()
    #: a column's type reads back as the name it was declared with (SQLite's affinity), not
    #: as the database's own type
    types_are_declared_names: ClassVar[bool] = False
    #: its transactions are each their own when the engine says AUTOCOMMIT (a server: the
    #: library refuses that, lock + check + write being one transaction)
    honours_autocommit: ClassVar[bool] = True

    def identity(self, cursor: Any) -> str | None:
        """Which server and database ``cursor``'s connection reaches, as it says itself, or
        ``None`` where it cannot say."""
        return None

    def glues(self, driver: str) -> bool:
        """Whether the library's engine glue (``fencing.configure_sqlite``) supports
        ``driver`` here."""
        return False

    def autocommit_probe(self, driver: str) -> Callable[[Any], bool] | None:
        """How to read, from a DBAPI connection of ``driver``, whether it is in autocommit
        right now; ``None`` for a driver the library does not know."""
        return None

    def wait_for_locks(self, execute: Callable[[str], Any], seconds: float) -> Callable[[], None] | None:
        """Make the transaction ``execute`` runs statements in wait at most ``seconds`` for a
        row lock; what puts the session back as it was, where the setting outlives the
        transaction. ``None`` where the database has no such setting."""
        return None

    def statement_commits(self, driver: str) -> bool:
        """Whether one statement of ``driver`` in autocommit is its own transaction, so a
        single-statement operation needs no ``BEGIN``/``COMMIT`` round trips."""
        return False

    def driven_directly(self, driver: str) -> bool:
        """Whether the store may run its statements on ``driver``'s own connections (compiled
        once, no Core in between) when nothing observes them."""
        return False

    def pipelines(self, driver: str) -> bool:
        """Whether ``driver`` can send several statements before reading their answers."""
        return False

    #: it can notify listening sessions in the transaction that frees a lock (``pg_notify``)
    notifies: ClassVar[bool] = False

    def wakeups(self, driver: str, *, is_async: bool) -> str | None:
        """Where a waiter on ``driver`` hears of a freed lock or a new job (:data:`THREAD`,
        :data:`LOOP`, :data:`WATCHED`), or ``None``: it paces itself by backoff alone."""
        return None

    # -- errors ----------------------------------------------------------------------------
    def transient(self, error: Any) -> bool:
        """The driver's ``error`` says the transaction lost a lock race and was rolled back."""
        return False

    def unavailable(self, error: Any) -> bool:
        """The driver's ``error`` says the server cannot be reached or is shutting down."""
        return False

    def full(self, error: Any) -> bool:
        """The driver's ``error`` says the disk (or a table) is full."""
        return False

    def read_only(self, error: Any) -> bool:
        """The driver's ``error`` says the database refuses writes."""
        return False

    def corrupt(self, error: Any) -> bool:
        """The driver's ``error`` says the database file is damaged."""
        return False

    def duplicate_key(self, error: Any) -> bool:
        """The driver's ``error`` is a unique or primary key violation."""
        return False

    def undefined_column(self, error: Any) -> bool:
        """The driver's ``error`` says a statement named a column its table does not have."""
        return False

    # -- durability (fencing.durability judges; each database knows its settings) ----------
    #: the settings a fence's survival rests on, in the order they are reported (a setting
    #: judged alongside another is shown with it); none: the library has no rules here
    durability_settings: ClassVar[tuple[str, ...]] = ()
    #: every unsafe value the library knows, in the order findings are reported
    durability_rules: ClassVar[tuple[Rule, ...]] = ()

    def read_durability(self, cursor: Any) -> dict[str, str]:
        """The values of :attr:`durability_settings` (and what they are judged alongside),
        read with ``cursor``, by lowercased name."""
        return {}

    def shown(self, setting: str, values: Values) -> str:
        """``setting``'s value as reported, with the one it was judged alongside."""
        return values[setting]

    def not_applicable(self, setting: str, values: Values, platform: str) -> str | None:
        """Why ``setting`` means nothing here (``platform``: where a file lives), or ``None``."""
        return None
