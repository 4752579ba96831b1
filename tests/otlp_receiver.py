"""A real OTLP/gRPC trace receiver (opentelemetry-proto's TraceService) that appends every span it
receives to a JSON-lines file. Run as a process: python -m tests.otlp_receiver PORT OUTFILE."""

from __future__ import annotations

import json
import sys
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":  # e.g. kvloop.group_bytes
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, path: str) -> None:
        self.path = path

    def Export(self, request, context):
        with open(self.path, "a") as out:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        out.write(
                            json.dumps(
                                {
                                    "service": resource.get("service.name"),
                                    "scope": scope_spans.scope.name,
                                    "name": span.name,
                                    "trace_id": span.trace_id.hex(),
                                    "span_id": span.span_id.hex(),
                                    "parent_span_id": span.parent_span_id.hex(),
                                    "duration_ns": span.end_time_unix_nano - span.start_time_unix_nano,
                                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                                }
                            )
                            + "\n"
                        )
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    port, path = int(sys.argv[1]), sys.argv[2]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(path), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
