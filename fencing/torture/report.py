"""The summary a run prints: what was done, what was injected, what was refused, how many
workers' own counters were set against their journals, what broke."""

from __future__ import annotations

from sqlalchemy import make_url

from .._engines import normalize_target
from .config import TortureConfig
from .connect import async_driver
from .controller import Run

__all__ = ["summary"]

#: what keeps the leases on each front
HEARTBEATS = {"sync": "Heartbeat threads", "async": "AsyncHeartbeat tasks"}


def summary(run: Run) -> str:
    config, tally = run.config, run.verdict.tallies
    kind, target = normalize_target(config.url)
    where = f"SQLite file {target}" if kind == "file" else target
    rows: list[tuple[str, int | str]] = []

    def section(title: str, items: list[tuple[str, int | str]]) -> None:
        rows.append((title, ""))
        rows.extend((f"  {label}", value) for label, value in items)

    def count(*key: str) -> int:
        return tally.get(key, 0)

    section(
        f"operations: {run.operations}, {run.operations / max(run.elapsed, 1e-9):.0f}/s over the whole run",
        [
            ("claims (claim_next, complete_and_claim_next)", count("claim")),
            ("renewals / refused", f"{count('renew')} / {count('renew', 'refused')}"),
            ("completions accepted", count("write", "accepted")),
            ("fenced blocks run under their running heartbeat", count("write", "nested")),
            ("external writes accepted", count("external", "accepted")),
            ("releases / jobs given back with a delay", f"{count('release')} / {count('release-delayed')}"),
            ("database errors reported (retried by the worker)", count("error")),
            ("calls the database was unavailable for (made again)", count("unavailable")),
            ("calls with an unknown outcome (lost during COMMIT)", count("unknown")),
        ],
    )
    section(
        "faults injected",
        [
            ("SIGSTOP past the TTL, then SIGCONT", count("fault", "stop")),
            ("SIGKILL, then restart", count("fault", "kill")),
            ("SIGKILL inside a write transaction, then restart", count("fault", "kill-in-transaction")),
            ("revoke a held lease", count("fault", "revoke")),
            ("SIGKILL of the database server, then restart", count("fault", "server-crash")),
        ],
    )
    if count("fault", "server-crash"):
        section(
            "riding through the server's crashes",
            [
                ("crashes followed by an accepted write", count("server-crash", "recovered")),
                ("writes accepted after the last crash", count("write", "accepted after the last crash")),
            ],
        )
    section(
        "stale writes rejected",
        [
            ("fenced block (LeaseLost, rolled back)", count("write", "refused", "fenced")),
            ("complete()", count("write", "refused", "plain")),
            ("complete_many()", count("write", "refused", "batch")),
            ("complete_and_claim_next()", count("write", "refused", "step")),
            ("external resource (FenceMarks.accept)", count("external", "refused")),
            ("not attempted: the heartbeat said the lease was lost", count("skip")),
        ],
    )
    checked, agreed = count("metrics", "checked"), count("metrics", "agreed")
    rows.append(("metrics cross-checked (workers that stopped cleanly)", f"{agreed} of {checked} agreed"))
    violations = run.violations
    rows.append(("violations", violations))
    width = max(len(label) for label, _ in rows) + 2
    enqueued = run.jobs_enqueued or config.jobs
    target = "" if config.operations is None else f", until {config.operations} operations"
    lines = [
        f"fencing torture: {where}",
        *(_front_line(config, front) for front in config.fronts),
        f"{config.workers} workers, {enqueued} jobs, ttl {config.ttl:g} s, seed {config.seed}{target}; "
        f"{run.elapsed:.1f} s in all, faults for {run.fault_phase:.1f} s; "
        f"{run.jobs_done}/{enqueued} jobs done",
        "",
    ]
    lines += [f"{label:<{width}}{value}" for label, value in rows]
    for rule, examples in run.verdict.violations.items():
        lines.append(f"\nVIOLATION {rule} ({run.verdict.counts[rule]}):")
        lines += [f"  {example}" for example in examples]
    return "\n".join(lines)


def _front_line(config: TortureConfig, front: str) -> str:
    one = config.fronts.index(front)  # the first worker on it
    workers = "" if len(config.fronts) == 1 else f" ({'even' if one == 0 else 'odd'}-numbered workers)"
    mine = config.for_worker(one)
    return f"{front} front{workers}: {mine.store}, {HEARTBEATS[front]}, on {_driver(mine)}"


def _driver(config: TortureConfig) -> str:
    if config.front == "async":
        return async_driver(config.url)
    kind, target = normalize_target(config.url)
    return "sqlite+pysqlite" if kind == "file" else make_url(target).drivername
