"""What a run prints and writes: tables and their cells, percentiles, the JSON figures."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    """One column of a :class:`Table`.

    ``title`` heads it (``None``: no header cell, for cells after the last titled column);
    the title and each row's value are aligned (``<`` or ``>``) to ``width``, the value
    formatted by ``spec`` (e.g. ``",.0f"``); ``sep`` stands before the column; ``pad=False``:
    the rows' cells stand as given, wider or narrower than the title."""

    title: str | None
    width: int = 0
    align: str = ">"
    spec: str = ""
    sep: str = " "
    pad: bool = True


class Table:
    """A header and rows of fixed-width columns (``indent`` before each line)."""

    def __init__(self, *columns: Column, indent: str = "") -> None:
        self.columns = columns
        self.indent = indent

    def _line(self, cells: list[str]) -> str:
        return self.indent + "".join(
            (c.sep if i else "") + s for i, (c, s) in enumerate(zip(self.columns, cells, strict=False))
        )

    def header(self) -> str:
        return self._line(
            [format(c.title, f"{c.align}{c.width}") for c in self.columns if c.title is not None]
        )

    def row(self, *values: Any) -> str:
        return self._line(
            [
                format(v, f"{c.align}{c.width}{c.spec}" if c.pad else c.spec)
                for c, v in zip(self.columns, values, strict=True)
            ]
        )

    def rule(self, char: str = "-") -> str:
        """A line of ``char`` as wide as the columns."""
        first, *others = self.columns
        return char * (len(self.indent) + first.width + sum(len(c.sep) + c.width for c in others))


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISS"


def spread(values: Sequence[float], spec: str = ".2f") -> str:
    """``min-max`` of ``values``."""
    return f"{min(values):{spec}}-{max(values):{spec}}"


def median_spread(values: Sequence[float], spec: str = ".2f", unit: str = "") -> str:
    """``median (min-max)`` of ``values``, ``unit`` after the median."""
    return f"{statistics.median(values):{spec}}{unit} ({spread(values, spec)})"


def percentile(values: Sequence[float], q: float) -> float:
    """The value at ``q`` (0 to 1) of the sorted ``values`` (0.0 if there are none)."""
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write_json(path: str, figures: dict[str, Any], *, say: bool = True) -> None:
    """``figures`` as JSON in ``path`` (what JSON cannot hold as its ``repr``); ``say``: print
    where they went."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(figures, f, indent=2, default=repr)
        f.write("\n")
    if say:
        print(f"figures written to {path}")
