"""Bad inputs are refused before anything changes; odd but valid inputs are just data."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

import service
from fencing import (
    DatabaseError,
    DatabaseMissing,
    InvalidArgument,
    InvalidArgumentType,
    JobState,
    JobStore,
    Lease,
    jobs,
)
from fencing._sql.schema import as_text

NAN, INF = math.nan, math.inf


def _seed(db: str) -> None:
    for job_id in ("job", "free", "done"):
        assert service.enqueue(db, job_id)
    assert service.claim(db, "job", "w", 100.0, 50.0) == 1
    assert service.claim(db, "done", "w", 100.0, 50.0) == 1
    assert service.complete(db, "done", "w", 1, 101.0, "kept")


@pytest.fixture(scope="module")
def sqlite_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded SQLite file, made once through the service and then copied per test."""
    path = tmp_path_factory.mktemp("seed") / "seed.db"
    service.init_db(str(path))
    _seed(str(path))
    service._stores.clear()  # the last connection closes: the WAL is checkpointed into the file
    assert not Path(f"{path}-wal").exists()
    return path


@pytest.fixture
def seeded(target: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A held job (``job``, owner ``w``, fence 1, live until 150), a free one, a done one."""
    if "://" in target:
        service.init_db(target)
        _seed(target)
    else:
        shutil.copyfile(request.getfixturevalue("sqlite_seed"), target)
    yield target
    service._stores.clear()


def snapshot(engine: Engine) -> list[tuple[Any, ...]]:
    """The whole jobs table, every column of every row."""
    with engine.connect() as conn:
        # ids and owners are bytes on MariaDB/MySQL: read as text
        row = (as_text(jobs.c.id), as_text(jobs.c.owner), *list(jobs.c)[2:])
        return [tuple(r) for r in conn.execute(select(*row).order_by(jobs.c.id))]


# -- refused arguments --------------------------------------------------------------------

# the arguments of each function after the path, in order
SIGNATURES = {
    "enqueue": ("job_id",),
    "state": ("job_id",),
    "claim": ("job_id", "owner", "now", "ttl"),
    "renew": ("job_id", "owner", "fence", "now", "ttl"),
    "complete": ("job_id", "owner", "fence", "now", "result"),
    "release": ("job_id", "owner", "fence"),
    "claim_many": ("job_id", "owners", "now", "ttl"),
}

# valid arguments that would change the table if the call went through
GOOD = {
    "job_id": "job",
    "owner": "w",
    "fence": 1,
    "now": 110.0,
    "ttl": 10.0,
    "result": "r",
    "owners": ["w", "x"],
}
GOOD_JOB = {"enqueue": "new", "claim": "free", "claim_many": "free"}

BAD: dict[str, list[tuple[Any, type[Exception]]]] = {
    "ttl": [
        (0, InvalidArgument),
        (0.0, InvalidArgument),
        (-1, InvalidArgument),
        (-0.5, InvalidArgument),
        (NAN, InvalidArgument),
        (INF, InvalidArgument),
        (-INF, InvalidArgument),
        (True, InvalidArgumentType),
        ("5", InvalidArgumentType),
        (None, InvalidArgumentType),
    ],
    "now": [
        (NAN, InvalidArgument),
        (INF, InvalidArgument),
        (-INF, InvalidArgument),
        (True, InvalidArgumentType),
        ("1", InvalidArgumentType),
        (b"1", InvalidArgumentType),
    ],
    "job_id": [
        (None, InvalidArgumentType),
        (1, InvalidArgumentType),
        (b"x", InvalidArgumentType),
        ("\ud800", InvalidArgument),
    ],
    "owner": [
        (None, InvalidArgumentType),
        (1, InvalidArgumentType),
        (b"w", InvalidArgumentType),
        ("w\udfff", InvalidArgument),
    ],
    "fence": [
        ("1", InvalidArgumentType),
        (1.0, InvalidArgumentType),
        (True, InvalidArgumentType),
        (None, InvalidArgumentType),
    ],
    "result": [(1, InvalidArgumentType), (b"x", InvalidArgumentType), ("r\ud800", InvalidArgument)],
    "owners": [
        ("wx", InvalidArgumentType),
        (b"wx", InvalidArgumentType),
        (None, InvalidArgumentType),
        (5, InvalidArgumentType),
        (["w", None], InvalidArgumentType),
        (["w", 1], InvalidArgumentType),
        (["w", "\ud800"], InvalidArgument),
    ],
}


def _cases() -> list[Any]:
    cases = []
    for function, names in SIGNATURES.items():
        for name in names:
            for value, error in BAD[name]:
                # a bad member of owners is reported as a bad owner
                named = "owner" if name == "owners" and isinstance(value, list) else name
                cases.append(
                    pytest.param(function, name, value, error, named, id=f"{function}-{name}={value!r}")
                )
    # now + ttl must not overflow to infinity
    for function in ("claim", "renew", "claim_many"):
        cases.append(pytest.param(function, "now", 1e308, InvalidArgument, "ttl", id=f"{function}-overflow"))
    return cases


def _call(target: str, function: str, args: dict[str, Any]) -> Any:
    return getattr(service, function)(target, *(args[name] for name in SIGNATURES[function]))


@pytest.mark.parametrize(("function", "name", "value", "error", "named"), _cases())
def test_bad_argument_raises_exact_error_naming_it_and_changes_nothing(
    seeded: str, engine: Engine, function: str, name: str, value: Any, error: type[Exception], named: str
) -> None:
    args = {**GOOD, "job_id": GOOD_JOB.get(function, "job"), name: value}
    if name == "now" and value == 1e308:
        args["ttl"] = 1e308
    before = snapshot(engine)
    assert len(before) == 3

    with pytest.raises(error) as excinfo:
        _call(seeded, function, args)

    assert type(excinfo.value) is error
    builtin = ValueError if error is InvalidArgument else TypeError
    assert isinstance(excinfo.value, builtin)
    assert named in str(excinfo.value)
    assert snapshot(engine) == before


@pytest.mark.parametrize("function", [f for f in SIGNATURES if f != "state"])
def test_the_good_arguments_do_change_the_table(seeded: str, engine: Engine, function: str) -> None:
    # the refusals above prove something only if the same call with good arguments writes
    before = snapshot(engine)
    _call(seeded, function, {**GOOD, "job_id": GOOD_JOB.get(function, "job")})
    assert snapshot(engine) != before


# -- refused paths ------------------------------------------------------------------------

PATH_ARGS = {
    "init_db": (),
    "enqueue": ("j",),
    "state": ("j",),
    "claim": ("j", "w", 1.0, 1.0),
    "renew": ("j", "w", 1, 1.0, 1.0),
    "complete": ("j", "w", 1, 1.0, "r"),
    "release": ("j", "w", 1),
    "claim_many": ("j", ["w"], 1.0, 1.0),
}

BAD_PATHS = [
    (None, InvalidArgumentType),
    (1, InvalidArgumentType),
    (1.5, InvalidArgumentType),
    (b"jobs.db", InvalidArgumentType),
    (["jobs.db"], InvalidArgumentType),
    ("", InvalidArgument),
    ("jo\x00bs.db", InvalidArgument),
    (":memory:", InvalidArgument),
    ("sqlite://", InvalidArgument),
    ("sqlite:///:memory:", InvalidArgument),
]


@pytest.mark.parametrize("function", list(PATH_ARGS))
@pytest.mark.parametrize(("path", "error"), BAD_PATHS, ids=[repr(p) for p, _ in BAD_PATHS])
def test_bad_path_raises_exact_error_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, path: Any, error: type[Exception]
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with pytest.raises(error) as excinfo:
        getattr(service, function)(path, *PATH_ARGS[function])
    assert type(excinfo.value) is error
    assert isinstance(excinfo.value, ValueError if error is InvalidArgument else TypeError)
    assert "path" in str(excinfo.value)
    assert os.listdir(cwd) == []


def _missing_forms(tmp_path: Path) -> dict[str, str]:
    return {
        "file": str(tmp_path / "missing.db"),
        "pathlike": tmp_path / "missing.db",  # type: ignore[dict-item]
        "directory": str(tmp_path / "nodir" / "missing.db"),
        "url": f"sqlite:///{tmp_path / 'missing.db'}",
    }


@pytest.mark.backend("sqlite")
@pytest.mark.parametrize("form", ["file", "pathlike", "directory", "url"])
@pytest.mark.parametrize("function", [f for f in PATH_ARGS if f != "init_db"])
def test_missing_database_raises_database_missing_and_is_not_created(
    tmp_path: Path, function: str, form: str
) -> None:
    path = _missing_forms(tmp_path)[form]
    with pytest.raises(DatabaseMissing) as excinfo:
        getattr(service, function)(path, *PATH_ARGS[function])
    assert type(excinfo.value) is DatabaseMissing
    assert "missing.db" in str(excinfo.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.backend("sqlite")
def test_init_db_in_a_missing_directory_fails_and_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "nodir" / "jobs.db"
    with pytest.raises(DatabaseError):
        service.init_db(str(path))
    assert os.listdir(tmp_path) == []
    with pytest.raises(DatabaseMissing):
        service.state(str(path), "j")


# -- odd values are just data -------------------------------------------------------------


def _round_trip(db: str, job_id: str, owner: str, result: str | None) -> None:
    assert service.state(db, job_id) is None
    assert service.enqueue(db, job_id) is True
    assert service.enqueue(db, job_id) is False
    fence = service.claim(db, job_id, owner, 10.0, 5.0)
    assert fence == 1
    assert service.renew(db, job_id, owner, fence, 11.0, 5.0) is True
    assert service.complete(db, job_id, owner, fence, 12.0, result) is True
    state = service.state(db, job_id)
    assert state == {"id": job_id, "owner": owner, "until": 16.0, "fence": 1, "result": result, "done": 1}
    assert state["id"] == job_id  # exact, not merely equal after normalisation
    assert len(state["id"]) == len(job_id)


SQL_METACHARACTERS = [
    "'; DROP TABLE jobs; --",
    '"; DELETE FROM jobs; --',
    "' OR '1'='1",
    "job' OR id LIKE '%",
    "%",
    "_",
    "\\",
    "?",
    ":job_id",
    "$1",
    "/* */",
]


@pytest.mark.parametrize("value", SQL_METACHARACTERS)
def test_sql_metacharacters_are_just_data(seeded: str, engine: Engine, value: str) -> None:
    before = snapshot(engine)
    _round_trip(seeded, value, owner=value, result=value)
    after = snapshot(engine)
    assert [row for row in after if row[0] != value] == before
    # the injected-looking owner holds no other job
    assert not service.complete(seeded, "job", value, 1, 110.0, "x")
    assert service.state(seeded, "job")["result"] is None


@pytest.mark.backend("sqlite", "mysql", "mariadb")
def test_nul_bytes_inside_ids_owners_and_results_are_data(db: str) -> None:
    _round_trip(db, "a\x00b", owner="w\x00x", result="r\x00s")
    # a C string would end at the NUL: "a" and "a\x00" are different jobs from "a\x00b"
    for prefix in ("a", "a\x00", "\x00"):
        assert service.state(db, prefix) is None
        assert service.enqueue(db, prefix) is True
    fence = service.claim(db, "a", "w\x00x", 10.0, 5.0)
    assert fence == 1
    # "w" is not "w\x00x": the owner is compared whole
    assert not service.complete(db, "a", "w", fence, 11.0, "x")
    assert not service.release(db, "a", "w\x00", fence)
    assert service.state(db, "a\x00b")["result"] == "r\x00s"


@pytest.mark.backend("postgresql")
def test_nul_is_refused_where_the_database_cannot_store_it(seeded: str, engine: Engine) -> None:
    before = snapshot(engine)
    for call in (
        lambda: service.enqueue(seeded, "a\x00b"),
        lambda: service.claim(seeded, "free", "w\x00x", 110.0, 5.0),
        lambda: service.complete(seeded, "job", "w", 1, 110.0, "r\x00s"),
    ):
        with pytest.raises(InvalidArgument, match="NUL"):
            call()
    assert snapshot(engine) == before


@pytest.mark.parametrize(
    "value",
    [
        "jöb",
        "職位",
        "🦀🔥",
        "e\u0301",
        "é",
        "Ωmega",
        "\u200b",
        "tab\tnew\nline",
        " padded ",
        "\uff26\uff35\uff2c\uff2c",
    ],
)
def test_non_ascii_and_emoji_round_trip_exactly(db: str, value: str) -> None:
    _round_trip(db, value, owner=value, result=value * 3)


def test_ids_differing_only_in_case_normalisation_or_trailing_space_are_distinct(db: str) -> None:
    ids = ["a", "A", "a ", "é", "e\u0301", "ß", "ss"]
    for job_id in ids:
        assert service.enqueue(db, job_id) is True
    fence = service.claim(db, "a", "owner", 10.0, 5.0)
    assert fence == 1
    for other in ("Owner", "owner ", "OWNER"):
        assert not service.complete(db, "a", other, fence, 11.0, "x")
    assert service.complete(db, "a", "owner", fence, 11.0, "x") is True
    assert [service.state(db, j)["done"] for j in ids] == [1, 0, 0, 0, 0, 0, 0]


@pytest.mark.backend("sqlite")
def test_100_000_character_id_round_trips_exactly(db: str) -> None:
    job_id = "x" * 99_998 + "🦀é"
    assert len(job_id) == 100_000
    _round_trip(db, job_id, owner="w" * 100_000, result="r" * 100_000)
    # no truncation: an id differing only in its last character is another job
    assert service.state(db, job_id[:-1] + "e") is None
    assert service.state(db, job_id[:-1]) is None
    assert service.enqueue(db, job_id[:-1] + "e") is True


def test_empty_strings_are_valid_ids_owners_and_results(db: str) -> None:
    _round_trip(db, "", owner="", result="")


# -- arbitrary text round-trips (hypothesis) ----------------------------------------------


def _text(dialect: str, max_size: int = 30) -> st.SearchStrategy[str]:
    # lone surrogates cannot be stored as UTF-8; PostgreSQL text cannot hold U+0000
    excluded = "\x00" if dialect == "postgresql" else ""
    return st.text(
        alphabet=st.characters(exclude_categories=("Cs",), exclude_characters=excluded),
        max_size=max_size,
    )


FEW = settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@FEW
@given(data=st.data())
def test_arbitrary_text_ids_owners_and_results_round_trip(
    store: JobStore, engine: Engine, data: st.DataObject
) -> None:
    text = _text(engine.dialect.name)
    job_id, owner = data.draw(text, "job_id"), data.draw(text, "owner")
    result = data.draw(st.none() | text, "result")
    with engine.begin() as conn:
        conn.execute(store.table.delete())
    assert store.enqueue(job_id, ready_at=0.0) is True
    lease = store.claim(job_id, owner, now=1.0, ttl=1.0)
    assert lease == Lease(job_id, owner, 1, 2.0)
    assert store.complete(lease, result, now=1.5) is True
    assert store.state(job_id) == JobState(job_id, owner, 2.0, 1, result, True)
    assert store.enqueue(job_id, ready_at=0.0) is False


@FEW
@given(data=st.data())
def test_a_different_owner_string_never_matches(store: JobStore, engine: Engine, data: st.DataObject) -> None:
    text = _text(engine.dialect.name, max_size=10)
    owner = data.draw(text, "owner")
    other = data.draw(text.filter(lambda s: s != owner), "other")
    with engine.begin() as conn:
        conn.execute(store.table.delete())
    store.enqueue("j", ready_at=0.0)
    lease = store.claim("j", owner, now=1.0, ttl=1.0)
    assert lease is not None
    intruder = Lease("j", other, lease.fence)
    assert not store.renew(intruder, now=1.5, ttl=1.0)
    assert not store.complete(intruder, "x", now=1.5)
    assert not store.release(intruder)
    assert store.state("j") == JobState("j", owner, 2.0, 1, None, False)
