"""OpenTelemetry setup from the standard OTEL_* variables.

Tracing is on when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, or when a span
file is given (argument or KVLOOP_SPAN_FILE: the demo's local fallback, JSON lines);
OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it off.
With tracing off the no-op API provider stays installed and costs nothing.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

_configured: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans as OTLP-shaped JSON lines to a file (for machines with no collector)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [span.to_json(indent=None) for span in spans]
        with self._lock, self._path.open("a") as out:
            out.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def tracing_requested(span_file: str | None = None) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return bool(
        span_file
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure_tracing(service_name: str, span_file: str | None = None) -> bool:
    """Install a TracerProvider exporting over OTLP/gRPC and/or to a JSON-lines file.

    Returns whether tracing is on. Idempotent per process.
    """
    global _configured
    span_file = span_file or os.environ.get("KVLOOP_SPAN_FILE") or None
    if _configured is not None:
        return True
    if not tracing_requested(span_file):
        return False
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return True  # the host process (e.g. vLLM with --otlp-traces-endpoint) already exports spans
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if span_file:
        # Written as each span ends: processes here are often stopped by a signal, not an exit.
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(Path(span_file))))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    _configured = provider
    return True


def shutdown_tracing() -> None:
    """Flush spans still buffered (called on graceful shutdown)."""
    if _configured is not None:
        _configured.shutdown()
