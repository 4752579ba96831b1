"""`kvloop trace` on a span file recorded from `kvloop demo` (3 turns; the second and third pulled
from decode-0), and on spans it receives itself over OTLP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvloop.clients.cli.trace import group_traces, read_span_file, select
from kvloop.common.addresses import free_port

BIN = Path(sys.executable).parent
RECORDED = Path(__file__).parent / "data" / "demo_spans.jsonl"
TURNS = [
    "6344b9495f7c108fa68fffdd3940278c",
    "941f39988a494b6a791dcd70c846baee",
    "787b929af3fe017c98cb46d0031524f6",
]


def kvloop(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "kvloop"), *args], capture_output=True, text=True, timeout=timeout)


def test_selection_keeps_the_turns_in_order():
    traces = group_traces(read_span_file(RECORDED))
    # the file also holds start-up and background traces (engine loading, directory polls)
    assert len(traces) > len(TURNS)
    assert [t.trace_id for t in select(traces)] == TURNS
    assert [t.trace_id for t in select(traces, last=2)] == TURNS[1:]
    assert [t.trace_id for t in select(traces, trace_id=TURNS[1][:8].upper())] == [TURNS[1]]
    assert select(traces, trace_id="ffffffffffff") == []


def test_waterfall_shows_the_turn_from_proxy_to_decode():
    result = kvloop("trace", "--spans", str(RECORDED), "--trace-id", TURNS[1])
    assert result.returncode == 0, result.stderr
    lines: list[str] = []
    for line in result.stdout.splitlines():
        if lines and "│" in line and not line.split("│")[0].strip():
            lines[-1] += line  # a long details cell wrapped onto a continuation line
        else:
            lines.append(line)

    def row(*needles: str) -> int:
        return next(i for i, line in enumerate(lines) if all(n in line for n in needles))

    steps = [
        row("kvloop.proxy /v1/chat/completions", "path=transfer"),
        row("llm_request", "vllm-prefill", "prompt_tokens=1072"),
        row("kvloop.prefill", "matched_tokens=672", "bytes=4,128,768"),
        row("/kvloop.v1.Directory/Lookup", "kvloopd", "decision=transfer", "estimated_transfer_ms="),
        row("kvloop.nixl_read", "bytes=4,128,768", "holder=decode-0"),
        row("llm_request", "vllm-decode"),
    ]
    assert steps == sorted(steps), lines
    assert TURNS[1] in lines[0] and "10 spans" in lines[0]


def test_json_nests_kvloopds_lookup_under_the_turns_prefill():
    result = kvloop("--json", "trace", "--spans", str(RECORDED), "--last", "2")
    assert result.returncode == 0, result.stderr
    traces = json.loads(result.stdout)
    assert [t["trace_id"] for t in traces] == TURNS[1:]
    for t in traces:
        spans = {s["span_id"]: s for s in t["spans"]}
        lookup = next(s for s in t["spans"] if s["service"] == "kvloopd")
        chain = []
        while lookup["parent_span_id"] in spans:
            lookup = spans[lookup["parent_span_id"]]
            chain.append(lookup["name"])
        assert chain[:3] == ["/kvloop.v1.Directory/Lookup", "kvloop.lookup", "kvloop.prefill"]
        assert chain[-1] == "kvloop.proxy /v1/chat/completions"
        assert t["spans"][0]["depth"] == 0 and t["spans"][0]["offset_ms"] == 0


def test_bad_input_is_a_message_not_a_traceback(tmp_path):
    missing = kvloop("trace", "--spans", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 1 and "no span file" in missing.stderr and "Traceback" not in missing.stderr
    unknown = kvloop("trace", "--spans", str(RECORDED), "--trace-id", "ffffffffffff")
    assert unknown.returncode == 1 and "no trace 'ffffffffffff'" in unknown.stderr
    bad_listen = kvloop("trace", "--listen", "nowhere")
    assert bad_listen.returncode == 2 and "HOST:PORT" in bad_listen.stderr


def test_listen_receives_a_turn_over_otlp_and_prints_it():
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "kvloop"), "--json", "trace", "--listen", f"127.0.0.1:{port}", "--last", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "listening" in proc.stderr.readline()  # the receiver is up
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "vllm-prefill"}))
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True))
        )
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("kvloop.prefill") as turn:
            turn.set_attribute("kvloop.path", "transfer")
            with tracer.start_as_current_span("kvloop.nixl_read") as read:
                read.set_attribute("kvloop.bytes", 4096)
        with tracer.start_as_current_span("/kvloop.v1.Directory/GetStats"):
            pass  # not a turn: not printed
        provider.shutdown()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    (trace,) = json.loads(out)
    assert trace["trace_id"] == f"{turn.get_span_context().trace_id:032x}"
    assert [(s["name"], s["depth"]) for s in trace["spans"]] == [
        ("kvloop.prefill", 0),
        ("kvloop.nixl_read", 1),
    ]
