"""The demo: the story really plays out, and its verdict cannot pass a wrong outcome."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fencing.__main__ import main
from fencing._sql.values import JobState
from fencing.cli.demo import JOB_ID, RESULT_A, RESULT_B, verdict

DEMO_TIMEOUT = 120


def _row(
    *, owner: str | None = "B", fence: int = 2, result: str | None = RESULT_B, done: bool = True
) -> JobState:
    return JobState(JOB_ID, owner, 1_700_000_000.5, fence, result, done)


@pytest.mark.slow
def test_demo_late_worker_write_is_rejected_in_real_processes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fencing", "demo"],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "A's write REJECTED (done: fence 1, current fence 2, holder 'B')" in proc.stdout
    assert f"B's result kept: {RESULT_B!r}" in proc.stdout
    assert "'fence': 2" in proc.stdout
    assert proc.stderr == ""


def test_verdict_passes_the_story_as_it_must_go() -> None:
    assert verdict(a_late_write_accepted=False, b_write_accepted=True, final_state=_row()) == []


def test_verdict_fails_when_late_write_is_accepted() -> None:
    problems = verdict(a_late_write_accepted=True, b_write_accepted=True, final_state=_row(result=RESULT_A))
    assert any("A's late write" in p for p in problems)
    assert any("stored result" in p for p in problems)


def test_verdict_fails_when_current_lease_write_is_rejected() -> None:
    problems = verdict(
        a_late_write_accepted=False, b_write_accepted=False, final_state=_row(result=None, done=False)
    )
    assert any("B's write" in p for p in problems)
    assert any("not marked done" in p for p in problems)


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        pytest.param(_row(result=RESULT_A), "stored result", id="result-is-A's"),
        pytest.param(_row(fence=1), "fence is 1", id="fence-not-advanced"),
        pytest.param(_row(fence=3), "fence is 3", id="fence-advanced-twice"),
        pytest.param(_row(done=False), "not marked done", id="not-done"),
        pytest.param(_row(owner="A"), "owner is 'A'", id="owner-is-A"),
        pytest.param(None, "missing", id="row-missing"),
    ],
)
def test_verdict_fails_on_any_wrong_final_row(row: JobState | None, expected: str) -> None:
    problems = verdict(a_late_write_accepted=False, b_write_accepted=True, final_state=row)
    assert len(problems) == 1
    assert expected in problems[0]


def test_cli_without_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_cli_help_lists_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "demo" in capsys.readouterr().out


@pytest.mark.parametrize("ttl", ["0", "-1", "0.01", "nan", "inf", "soon"])
def test_cli_demo_refuses_unusable_ttl(ttl: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--ttl", ttl])
    assert exited.value.code == 2
    assert "--ttl" in capsys.readouterr().err
