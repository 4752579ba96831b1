"""Traces that join: the connector's Lookup carries the caller's trace context to kvloopd, the embedded
OTLP receiver and the JSON-lines exporter write the same records, and warm peers pick the right
holders."""

from __future__ import annotations

import json

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvloop.agents.connector.directory import DirectoryLookups, PullerConstraints
from kvloop.agents.connector.peers import Peer, peers_to_warm
from kvloop.common.otlp_receiver import OtlpReceiver, SpanFile
from kvloop.common.tracing import JsonLinesSpanExporter, not_sampled, trace_id_hex
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, wait_until


def test_connector_lookup_joins_the_callers_trace(daemon_factory, otlp_receiver):
    daemon = daemon_factory(
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "kvloopd-joined",
        }
    )
    constraints = PullerConstraints("m-joined", "prefill-joined", 16, 64, 1000, 1, "bfloat16", 4096)
    lookups = DirectoryLookups(daemon.address, constraints, timeout_ms=2000, traced=True)
    untraced = DirectoryLookups(daemon.address, constraints, timeout_ms=2000)
    tracer = TracerProvider(resource=Resource.create({SERVICE_NAME: "test-prefill"})).get_tracer("test")
    try:
        with not_sampled():  # first: a background poll that must leave no span at kvloopd
            assert lookups.lookup(conversation("joined", 3), 0) is not None
        with tracer.start_as_current_span("kvloop.prefill") as turn:
            assert lookups.lookup(conversation("joined", 3), 0) is not None
            assert untraced.lookup(conversation("joined", 3), 0) is not None
    finally:
        lookups.close()
        untraced.close()
    trace_id = trace_id_hex(turn)
    wait_until(lambda: len(_lookup_spans(otlp_receiver)) >= 2, what="both Lookup spans exported")
    spans = _lookup_spans(otlp_receiver)
    joined = [s for s in spans if s["trace_id"] == trace_id]
    # the traced call's server span sits in the turn's trace, under its span (or under the
    # interceptor's client span, when this process records one); the untraced call starts its own
    assert len(joined) == 1, spans
    assert joined[0]["parent_span_id"] and joined[0]["kind"] == "SERVER"
    assert joined[0]["attributes"]["kvloop.decision"] == "recompute"
    assert len([s for s in spans if s["trace_id"] != trace_id and not s["parent_span_id"]]) == 1
    assert len(spans) == 2, "the not-sampled call was recorded"


def _lookup_spans(receiver) -> list[dict]:
    return [
        s
        for s in receiver.spans()
        if s["service"] == "kvloopd-joined" and s["name"] == "/kvloop.v1.Directory/Lookup"
    ]


def test_receiver_and_span_file_write_the_same_records(tmp_path):
    """A span exported over OTLP to the embedded receiver and one written by the JSON-lines exporter
    are the same record, so `kvloop trace` reads either file."""
    received = tmp_path / "received.jsonl"
    written = tmp_path / "written.jsonl"
    with OtlpReceiver(SpanFile(received).write) as receiver:
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "svc"}))
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True))
        )
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(written)))
        tracer = provider.get_tracer("scope-a")
        with tracer.start_as_current_span("parent", kind=trace.SpanKind.SERVER) as parent:
            parent.set_attributes({"kvloop.bytes": 123, "kvloop.path": "transfer", "kvloop.ms": 1.5})
            with tracer.start_as_current_span("child") as child:
                child.add_event("first_chunk", {"n": 1})
                child.set_attribute("kvloop.ok", True)
        provider.shutdown()
        wait_until(lambda: received.exists() and len(received.read_text().splitlines()) == 2, what="2 spans")
    got = [json.loads(line) for line in received.read_text().splitlines()]
    want = [json.loads(line) for line in written.read_text().splitlines()]
    assert got == want
    child_rec, parent_rec = want
    assert child_rec["parent_span_id"] == parent_rec["span_id"] and parent_rec["parent_span_id"] == ""
    assert parent_rec["kind"] == "SERVER" and parent_rec["attributes"]["kvloop.bytes"] == 123
    assert child_rec["events"][0]["name"] == "first_chunk"


def _worker(worker_id: str, role: int, engine_id: str, endpoint: str, model: str = "m") -> pb.WorkerInfo:
    return pb.WorkerInfo(
        registration=pb.WorkerRegistration(
            worker_id=worker_id,
            role=role,
            model=model,
            engine_id=engine_id,
            nixl_endpoint=endpoint,
            parallel=pb.ParallelLayout(tensor_parallel_size=2 if worker_id == "decode-1" else 0),
        )
    )


def test_warm_peers_are_the_other_holders_of_the_model_once_this_engine_pulls():
    workers = [
        _worker("prefill-0", pb.WORKER_ROLE_PREFILL, "e-p0", "10.0.0.1:5600"),
        _worker("prefill-1", pb.WORKER_ROLE_PREFILL, "e-p1", "10.0.0.2:5600"),
        _worker("decode-0", pb.WORKER_ROLE_DECODE, "e-d0", "10.0.0.3:5601"),
        _worker("decode-1", pb.WORKER_ROLE_BOTH, "e-d1", "[::1]:5602"),
        _worker("decode-other", pb.WORKER_ROLE_DECODE, "e-d2", "10.0.0.4:5600", model="other"),
        _worker("decode-noaddr", pb.WORKER_ROLE_DECODE, "e-d3", ""),
    ]
    assert peers_to_warm(workers, "prefill-0", "e-p0", "m") == [
        Peer("decode-0", "e-d0", "10.0.0.3", 5601, 1),
        Peer("decode-1", "e-d1", "[::1]", 5602, 2),
    ]
    # a decode opens no connections; nor does an engine kvloopd has not registered yet
    assert peers_to_warm(workers, "decode-0", "e-d0", "m") == []
    assert peers_to_warm(workers[2:], "prefill-0", "e-p0", "m") == []


def test_a_holders_host_pool_is_warmed_as_an_engine_of_its_own():
    workers = [
        _worker("prefill-0", pb.WORKER_ROLE_PREFILL, "e-p0", "10.0.0.1:5600"),
        _worker("decode-0", pb.WORKER_ROLE_DECODE, "e-d0", "10.0.0.3:5601"),
    ]
    workers[1].registration.host_engine_id = "e-d0@host"
    workers[1].registration.host_nixl_endpoint = "10.0.0.3:6601"
    assert peers_to_warm(workers, "prefill-0", "e-p0", "m") == [
        Peer("decode-0", "e-d0", "10.0.0.3", 5601, 1),
        Peer("decode-0", "e-d0@host", "10.0.0.3", 6601, 1),
    ]
