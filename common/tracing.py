"""OpenTelemetry setup from the standard OTEL_* variables.

Tracing is on when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, or when a span
file is given (argument or KVLOOP_SPAN_FILE: the demo's local fallback, JSON lines);
OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it off.
With tracing off the no-op API provider stays installed and costs nothing.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from kvloop.common.otlp_receiver import SpanFile, record_from_sdk

_configured: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a JSON-lines file, one record per span in the format the embedded
    OTLP receiver writes (see :mod:`kvloop.common.otlp_receiver`), for machines with no collector."""

    def __init__(self, path: Path) -> None:
        self._file = SpanFile(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._file.write([record_from_sdk(span) for span in spans])
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def trace_id_hex(span: trace.Span | None = None) -> str:
    """The W3C trace id of ``span`` (default: the current one) as 32 hex digits; "" when none."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else ""


@contextmanager
def not_sampled() -> Iterator[None]:
    """Calls made in this block (through a traced client) carry a trace context whose sampled flag
    is off, so the servers' parent-based samplers record no span for them: for background polls
    that would otherwise start a trace each at kvloopd."""
    ids = RandomIdGenerator()
    context = trace.SpanContext(
        ids.generate_trace_id(), ids.generate_span_id(), is_remote=False, trace_flags=trace.TraceFlags(0)
    )
    with trace.use_span(trace.NonRecordingSpan(context)):
        yield


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
