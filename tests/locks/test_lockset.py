"""The lock-set workload's short form (``benchmarks/lockset.py``), on the database under test.

Four processes take turns on one :class:`fencing.Locks` name, each turn a read -> work ->
write of a shared set and a shared counter, while holders are ``SIGSTOP``-ped past their ttl
(and, on the servers, have their sessions ended; on SQLite, are ``SIGKILL``-ed): the resource
written through ``fenced()`` in the lock's database and through ``FenceMarks`` in a database
of its own loses no acknowledged add and no increment, holds no element twice, and takes no
write made on a stale read. The run's control, the same lock with writes it does not fence,
shows what the checker counts when a pause lets an old holder write: the lock alone is not
the guarantee. The long form, beside the peers' locks, is ``python benchmarks/lockset.py``
(figures in the guarantee's page).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import backends

pytestmark = [pytest.mark.slow, pytest.mark.sync_only("the workload's holders are processes")]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lockset.py"
#: a waiter's longest pause: a handoff well inside every pause (1.5-2.5 ttl), so the control
#: has a newer holder write while the paused one sleeps (at the default 0.5 s it may not)
POLL = "0.05"


def _run(
    backend: backends.Backend, tmp_path: Path, systems: list[str], faults: list[str], seconds: float
) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if backend.name == "postgresql":
        env["FENCING_PG_URL"] = str(backend.worker_url)
    elif backend.name == "mariadb":
        env["FENCING_MARIADB_URL"] = str(backend.worker_url)
    out = tmp_path / f"outcomes-{len(list(tmp_path.iterdir()))}.json"
    command = [sys.executable, str(SCRIPT), "--systems", ",".join(systems), "--faults", ",".join(faults),
               "--seconds", str(seconds), "--poll", POLL, "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes: list[dict[str, Any]] = json.loads(out.read_text())
    assert [o["skipped"] for o in outcomes] == [""] * len(outcomes), outcomes
    return outcomes


def test_fenced_writes_lose_nothing_under_pauses_and_the_unfenced_control_does(
    backend: backends.Backend, tmp_path: Path
) -> None:
    db = backend.name
    second = "kill" if db == "sqlite" else "session"
    outcomes = _run(backend, tmp_path, [f"fencing-fenced-{db}", f"fencing-marks-{db}"], ["pause", second], 4)
    cell = {(o["system"].split("-")[1], o["fault"]): o for o in outcomes}
    for o in cell.values():
        # (a short run whose pauses block every turn may acknowledge none: its faults count)
        assert o["faults"] > 0 and (o["acked"] > 0 or o["fault"] == "pause"), o
        if o["fault"] == "session":
            assert o["sessions_ended"] > 0, o
        assert (o["lost_adds"], o["duplicates"], o["lost_increments"], o["overlaps"]) == (0, 0, 0, 0), o
    # a holder paused inside fenced() past its ttl wakes to a refused write (its row or its
    # database was locked meanwhile: no other write, only the refusal)
    assert cell["fenced", "pause"]["refused"] > 0, cell["fenced", "pause"]
    # the same pauses, writes not fenced: an old holder's write lands on a newer one's (a
    # longer run: it takes a pause whose sleeper a newer holder overtakes)
    (control,) = _run(backend, tmp_path, [f"fencing-unfenced-{db}"], ["pause"], 6)
    assert control["faults"] > 0 and control["acked"] > 0, control
    assert control["overlaps"] > 0 and control["lost_adds"] + control["lost_increments"] > 0, control
