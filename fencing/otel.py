"""Export ``store.metrics`` through OpenTelemetry: ``pip install fencing[otel]``.

The store counts and times in process (:mod:`fencing._runtime.metrics`) whether or not anyone
exports; :func:`instrument` registers *observable* instruments whose callbacks read those
counts when the OpenTelemetry SDK collects (the pull model): the operations themselves do
nothing more::

    from fencing.otel import instrument

    instrument(store)                                   # the global MeterProvider
    instrument(marks, provider, attributes={"service": "billing"})

Instruments (meter ``fencing``), each with the attribute ``fencing.table`` (the store's
table) and your ``attributes``:

* ``fencing.operations`` (counter): every counter of :class:`~fencing._runtime.metrics.StoreMetrics`,
  split into ``operation`` (``complete``, ``claim_next``, ``lock``...), ``outcome``
  (``accepted``, ``refused``, ``calls``, ``jobs``, ``empty``, ``retried``, ``busy``...) and,
  for refusals, ``reason``.
* ``fencing.duration.count`` and ``fencing.duration.sum`` (counters, seconds),
  ``fencing.duration.min`` and ``fencing.duration.max`` (gauges, seconds, since the store
  was made) and ``fencing.duration.bucket`` (counter, cumulative, with ``le`` the bucket's
  upper bound or ``+Inf``: a Prometheus histogram's buckets), each with ``timing``
  (``claim_next.latency``, ``complete.held``, ``lock.wait``...).

Several stores may be instrumented on one meter (give them different ``attributes`` if
they share a table name); :meth:`Instrumentation.remove` stops exporting one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import metrics as otel

from ._errors import InvalidArgumentType
from ._runtime.metrics import BUCKETS, StoreMetrics, Timing

__all__ = ["Instrumentation", "instrument"]

Attributes = dict[str, str | int | float | bool]


class Instrumentation:
    """One store's metrics, exported through one meter until :meth:`remove`."""

    def __init__(self, exporter: _Exporter, metrics: StoreMetrics, attributes: Attributes) -> None:
        self.metrics = metrics
        self.attributes = attributes
        self._exporter = exporter

    def remove(self) -> None:
        """Stop exporting this store's metrics (idempotent)."""
        self._exporter.remove(self)


class _Exporter:
    """The instruments of one meter, reading every store registered on it."""

    def __init__(self, meter: otel.Meter) -> None:
        self._lock = threading.Lock()
        self._sources: list[Instrumentation] = []
        meter.create_observable_counter(
            "fencing.operations",
            [self._operations],
            unit="{operation}",
            description="store operations, by operation, outcome and reason",
        )
        timed = "store timings (claim latency, lease held, lock wait), by timing"
        meter.create_observable_counter(
            "fencing.duration.count", [self._timing(lambda t: [((), t.count)])], unit="1", description=timed
        )
        meter.create_observable_counter(
            "fencing.duration.sum", [self._timing(lambda t: [((), t.sum)])], unit="s", description=timed
        )
        meter.create_observable_gauge(
            "fencing.duration.min", [self._timing(lambda t: [((), t.min)])], unit="s", description=timed
        )
        meter.create_observable_gauge(
            "fencing.duration.max", [self._timing(lambda t: [((), t.max)])], unit="s", description=timed
        )
        meter.create_observable_counter(
            "fencing.duration.bucket",
            [self._timing(_cumulative)],
            unit="1",
            description=timed + "; cumulative counts of those at most le seconds",
        )

    def add(self, metrics: StoreMetrics, attributes: Attributes) -> Instrumentation:
        source = Instrumentation(self, metrics, attributes)
        with self._lock:
            self._sources.append(source)
        return source

    def remove(self, source: Instrumentation) -> None:
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def _each(self) -> list[Instrumentation]:
        with self._lock:
            return list(self._sources)

    def _operations(self, options: otel.CallbackOptions) -> Iterator[otel.Observation]:
        for source in self._each():
            for name, n in source.metrics.snapshot().items():
                operation, _, rest = name.partition(".")
                outcome, _, reason = rest.partition(".")
                labels: Attributes = {**source.attributes, "operation": operation, "outcome": outcome}
                if reason:
                    labels["reason"] = reason
                yield otel.Observation(n, labels)

    def _timing(
        self, values: Callable[[Timing], Iterable[tuple[tuple[tuple[str, str], ...], float]]]
    ) -> Callable[[otel.CallbackOptions], Iterator[otel.Observation]]:
        def observe(options: otel.CallbackOptions) -> Iterator[otel.Observation]:
            for source in self._each():
                for name, timing in source.metrics.timings().items():
                    for extra, value in values(timing):
                        yield otel.Observation(value, {**source.attributes, "timing": name, **dict(extra)})

        return observe


def _cumulative(timing: Timing) -> Iterator[tuple[tuple[tuple[str, str], ...], float]]:
    seen = 0
    for bound, n in zip((*(f"{b:g}" for b in BUCKETS), "+Inf"), timing.buckets, strict=True):
        seen += n
        yield (("le", bound),), seen


_exporters: dict[int, tuple[otel.Meter, _Exporter]] = {}
_exporters_lock = threading.Lock()


def instrument(
    source: Any,
    meter_provider: otel.MeterProvider | None = None,
    *,
    attributes: Mapping[str, str | int | float | bool] | None = None,
) -> Instrumentation:
    """Export the metrics of ``source`` (a ``JobStore``, ``AsyncJobStore``, ``FenceMarks``,
    ``AsyncFenceMarks`` or a :class:`~fencing._runtime.metrics.StoreMetrics`) through
    ``meter_provider`` (default: OpenTelemetry's global one), meter ``fencing``."""
    metrics = source if isinstance(source, StoreMetrics) else getattr(source, "metrics", None)
    if not isinstance(metrics, StoreMetrics):
        raise InvalidArgumentType(
            f"source must be a fencing store or a StoreMetrics, got {type(source).__name__}"
        )
    labels: Attributes = {}
    table = getattr(source, "table", None)
    if table is None:
        table = getattr(source, "marks", None)  # FenceMarks: its marks table
    if table is not None:
        labels["fencing.table"] = table.name
    labels.update(attributes or {})
    provider = meter_provider if meter_provider is not None else otel.get_meter_provider()
    meter = provider.get_meter("fencing")
    with _exporters_lock:
        known = _exporters.get(id(meter))
        if known is None or known[0] is not meter:
            known = _exporters[id(meter)] = (meter, _Exporter(meter))
    return known[1].add(metrics, labels)
