"""Export ``store.metrics`` through OpenTelemetry: ``pip install fencing[otel]``.

The public import path; the code lives in :mod:`fencing.observe.otel`.
"""

from __future__ import annotations

from .observe.otel import (
    Instrumentation,
    instrument,
)

__all__ = [
    "Instrumentation",
    "instrument",
]
