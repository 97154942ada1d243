"""Observability: counters and timings (``store.metrics``), the log lines of refused writes
and other events, and the OpenTelemetry export."""
