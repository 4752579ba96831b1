"""A small real OTLP/gRPC trace receiver (opentelemetry-proto's TraceService) and the span-file format.

The demo runs one in-process and points every process it starts at it, so a machine with no collector
still gets whole traces (vLLM exports its request spans only over OTLP); ``kvloop trace --listen`` runs
one too. Every span received is one JSON line (:func:`record_from_proto`); the JSON-lines exporter in
:mod:`kvloop.common.tracing` writes the same shape (:func:`record_from_sdk`), so ``kvloop trace``
reads either file.

Run as a process (the tests do): ``python -m kvloop.common.otlp_receiver PORT OUTFILE``.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

# Span kinds and status codes by the names the OTel API uses (proto enums are SPAN_KIND_SERVER, ...).
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def record_from_proto(service: str | None, scope: str, span: trace_pb2.Span) -> dict[str, Any]:
    """One received span as a flat JSON-safe record (the span file's line format)."""
    return {
        "service": service,
        "scope": scope,
        "name": span.name,
        "kind": _KINDS.get(span.kind, str(span.kind)),
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "start_unix_nano": span.start_time_unix_nano,
        "end_unix_nano": span.end_time_unix_nano,
        "duration_ns": span.end_time_unix_nano - span.start_time_unix_nano,
        "status": _STATUS.get(span.status.code, str(span.status.code)),
        "attributes": {a.key: _value(a.value) for a in span.attributes},
        "events": [
            {
                "name": e.name,
                "time_unix_nano": e.time_unix_nano,
                "attributes": {a.key: _value(a.value) for a in e.attributes},
            }
            for e in span.events
        ],
    }


def record_from_sdk(span: Any) -> dict[str, Any]:
    """A finished SDK span (``ReadableSpan``) in the same record format."""
    ctx = span.get_span_context()
    parent = span.parent
    start, end = span.start_time or 0, span.end_time or 0
    return {
        "service": span.resource.attributes.get("service.name"),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else "",
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else "",
        "start_unix_nano": start,
        "end_unix_nano": end,
        "duration_ns": end - start,
        "status": span.status.status_code.name,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


class SpanFile:
    """Appends records to a JSON-lines file (thread-safe; one write per batch)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        text = "".join(json.dumps(r, default=str) + "\n" for r in records)
        with self._lock, self.path.open("a") as out:
            out.write(text)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[dict[str, Any]]], None]) -> None:
        self.sink = sink

    def Export(self, request, context):
        records = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    records.append(
                        record_from_proto(resource.get("service.name"), scope_spans.scope.name, span)
                    )
        self.sink(records)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """An OTLP/gRPC TraceService on ``host:port`` (port 0: any free one) handing each export's
    records to ``sink``. ``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT should say."""

    def __init__(
        self, sink: Callable[[list[dict[str, Any]]], None], host: str = "127.0.0.1", port: int = 0
    ) -> None:
        # Two threads: exporters batch, and the machines this runs on are small.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="otlp"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(sink), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop, letting exports in progress finish (their spans are written)."""
        self._server.stop(grace_s).wait()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    port, path = int(sys.argv[1]), Path(sys.argv[2])
    receiver = OtlpReceiver(SpanFile(path).write, port=port).start()
    print("ready", flush=True)
    receiver._server.wait_for_termination()


if __name__ == "__main__":
    main()
