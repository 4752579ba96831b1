"""Spans, logs and metrics of the kvloop connector (one set per process)."""

from __future__ import annotations

import time

import structlog
from opentelemetry import propagate, trace
from prometheus_client import Counter, Histogram

TRACER_NAME = "kvloop.agents.connector"

tracer = trace.get_tracer(TRACER_NAME)


def wall_ns(perf: float) -> int:
    """A perf_counter() reading as epoch nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def child_span(parent, name: str, start_perf: float, end_perf: float, attributes: dict | None = None) -> None:
    """Record a finished step (lookup, NIXL READ) under a turn's kvloop.prefill span."""
    span = tracer.start_span(
        name,
        context=trace.set_span_in_context(parent),
        start_time=wall_ns(start_perf),
        attributes=attributes or {},
    )
    span.end(end_time=wall_ns(end_perf))


def request_context(request):
    """The caller's trace context (W3C traceparent the API server passed down), if any."""
    headers = getattr(request, "trace_headers", None)
    return propagate.extract(dict(headers)) if headers else None


log = structlog.get_logger(TRACER_NAME)

REQUESTS = Counter("kvloop_connector_requests", "Prefill requests by kvloop path", ["path", "reason"])
TOKENS = Counter(
    "kvloop_connector_tokens", "Prompt tokens by how they were obtained", ["kind"]
)  # kind: pulled | recomputed | local
BYTES = Counter("kvloop_connector_pulled_bytes", "KV bytes pulled from peers")
LOOKUP_SECONDS = Histogram(
    "kvloop_connector_lookup_seconds",
    "Directory lookup latency seen by the connector",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
LOOKUP_ERRORS = Counter("kvloop_connector_lookup_errors", "Failed directory lookups", ["kind"])
RETAINED = Counter("kvloop_connector_retained_runs", "Retained runs announced (decode role)")
RETAINED_BLOCKS = Counter("kvloop_connector_retained_blocks", "Blocks in announced retained runs")
RELEASED = Counter("kvloop_connector_released_runs", "Retained runs released", ["reason"])
CLAIMS_RELEASED = Counter(
    "kvloop_connector_claims_released", "Single-use claims given back unread", ["released"]
)
READS_SERVED = Counter("kvloop_connector_reads_served", "READ completion notices received for retained runs")
