"""``fencing.otel``: ``store.metrics`` read back through the OpenTelemetry SDK."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine

from fencing import FenceMarks, InvalidArgumentType, JobStore, Lease

pytest.importorskip("opentelemetry.sdk.metrics")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fencing._runtime.metrics import BUCKETS
from fencing.otel import instrument

TTL = 10.0


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """Every data point collected now, by instrument name: (attributes, value)."""
    found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for p in metric.data.data_points:
                    found.setdefault(metric.name, []).append((dict(p.attributes or {}), p.value))
    return found


def value(found: dict[str, list[tuple[dict[str, Any], Any]]], name: str, **attributes: Any) -> Any:
    [v] = [v for a, v in found.get(name, []) if attributes.items() <= a.items()]
    return v


def test_store_metrics_are_exported(engine: Engine) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    store = JobStore(engine)
    store.create_table()
    exported = instrument(store, provider, attributes={"service": "test"})
    store.enqueue("job", ready_at=0.0)
    [lease] = store.claim_next("w", ttl=TTL, now=100.0)
    assert not store.complete(Lease("job", "w", 7, None), "forged", now=101.0)
    assert store.complete(lease, "r", now=101.0)

    found = points(reader)
    common = {"fencing.table": "jobs", "service": "test"}
    assert value(found, "fencing.operations", operation="complete", outcome="accepted", **common) == 1
    refused = {"operation": "complete", "outcome": "refused", "reason": "stale fence"}
    assert value(found, "fencing.operations", **refused) == 1
    assert value(found, "fencing.operations", operation="claim_next", outcome="calls") == 1
    assert value(found, "fencing.operations", operation="claim_next", outcome="jobs") == 1
    timing = store.metrics.timings()["claim_next.latency"]
    assert value(found, "fencing.duration.count", timing="claim_next.latency", **common) == 1
    assert value(found, "fencing.duration.sum", timing="claim_next.latency") == pytest.approx(timing.sum)
    assert value(found, "fencing.duration.max", timing="complete.held") > 0
    buckets = [v for a, v in found["fencing.duration.bucket"] if a["timing"] == "complete.held"]
    assert len(buckets) == len(BUCKETS) + 1
    assert buckets == sorted(buckets)  # cumulative
    assert buckets[-1] == 1
    assert value(found, "fencing.duration.bucket", timing="complete.held", le="+Inf") == 1

    # counters are cumulative; a removed store is no longer read
    store.enqueue("other", ready_at=0.0)
    store.claim_next("w", ttl=TTL, now=102.0)
    found = points(reader)
    assert value(found, "fencing.operations", operation="claim_next", outcome="calls") == 2
    exported.remove()
    exported.remove()
    assert "fencing.operations" not in points(reader)
    provider.shutdown()


def test_several_stores_on_one_meter(engine: Engine) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    store = JobStore(engine)
    store.create_table()
    marks = FenceMarks(engine)
    marks.create_tables()
    instrument(store, provider)
    instrument(marks, provider)
    instrument(store.metrics, provider, attributes={"copy": True})
    store.enqueue("job", ready_at=0.0)
    assert store.claim("job", "a", ttl=TTL, now=100.0) is not None
    assert marks.accept("r", 1)
    found = points(reader)
    assert value(found, "fencing.operations", operation="accept", outcome="accepted") == 1
    claims = [
        (a.get("fencing.table"), a.get("copy"), v)
        for a, v in found["fencing.operations"]
        if a["operation"] == "claim"
    ]
    assert sorted(claims, key=str) == sorted([("jobs", None, 1), (None, True, 1)], key=str)
    assert value(found, "fencing.duration.count", timing="claim.latency", **{"fencing.table": "jobs"}) == 1
    provider.shutdown()


def test_instrument_refuses_what_has_no_metrics() -> None:
    with pytest.raises(InvalidArgumentType, match="StoreMetrics"):
        instrument(object(), MeterProvider())
