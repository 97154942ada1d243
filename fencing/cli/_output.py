"""What the database commands print: aligned tables for people, one JSON object per line for
scripts (``--json``)."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from .._format import instant
from .._store.history import HistoryEntry
from ..overview import JobView


class Output:
    """Where a command writes its results: ``stream``, as JSON lines with ``--json``. ``prog``
    ("fencing jobs") names the command in what it says on stderr."""

    def __init__(self, stream: TextIO, *, as_json: bool, prog: str) -> None:
        self.stream = stream
        self.json = as_json
        self.prog = prog

    def record(self, **fields: Any) -> None:
        """One JSON object on its own line (ASCII: exact under any locale)."""
        print(json.dumps(fields), file=self.stream)

    def lines(self, lines: Sequence[str]) -> None:
        for line in lines:
            print(line, file=self.stream)

    def result(self, fields: Mapping[str, Any], lines: Sequence[str]) -> None:
        """A command's one result: ``fields`` as a record with ``--json``, else ``lines``."""
        if self.json:
            self.record(**fields)
        else:
            self.lines(lines)


def shown(value: str | None) -> str:
    """A value in a table cell: ``-`` for none, control characters escaped (a newline in an
    id must not break the table); quotes and non-ASCII text as they are."""
    if value is None:
        return "-"
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in value)


def _width(text: str) -> int:
    """Terminal columns: East Asian wide characters take two, combining marks none."""
    return sum(
        0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        for ch in text
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> list[str]:
    """Columns two spaces apart, each as wide as its widest cell; ``numeric`` ones right-aligned."""
    widths = [max(_width(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = []
    for row in (headers, *rows):
        cells = []
        for i, (cell, width) in enumerate(zip(row, widths, strict=True)):
            pad = " " * (width - _width(cell))
            cells.append(pad + cell if i in numeric else cell + pad)
        lines.append("  ".join(cells).rstrip())
    return lines


def cell(value: object) -> str:
    """A stored value in a table: text as :func:`shown`, a float as a point in time."""
    if value is None or isinstance(value, str):
        return shown(value)
    if isinstance(value, float):
        return instant(value)
    return str(value)


def job_record(job: JobView) -> dict[str, Any]:
    """The job's JSON, its id named ``id`` as in every record of the CLI."""
    record = job.as_json()
    return {"id": record.pop("job_id"), **record}


def history_lines(entries: Sequence[HistoryEntry]) -> list[str]:
    """An ownership history (a job's, a lock's, an election's) as a table, oldest first."""
    rows = []
    for e in entries:
        if e.event == "refused":
            detail = f"{e.path}: {e.reason}; holder {shown(e.holder)}, fence {cell(e.current_fence)}"
        elif e.until is not None and e.event in ("claim", "renew"):
            detail = f"until {instant(e.until)}"
        else:
            detail = "" if e.path is None else f"by {e.path}"
        rows.append([str(e.seq), instant(e.at), e.event, shown(e.owner), cell(e.fence), detail])
    return table(["SEQ", "AT", "EVENT", "OWNER", "FENCE", "DETAIL"], rows, numeric=(0, 4))
