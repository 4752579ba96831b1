"""What one turn's trace must hold, checked on span records (the OTLP receiver's format)."""

from __future__ import annotations


def check_turn_trace(spans: list[dict], trace_id: str, pulled: bool) -> None:
    """One turn is one trace: the proxy's span, vLLM's request spans on prefill and decode, the
    connector's kvloop.prefill with kvloopd's Lookup under it (decision and estimates), and the
    NIXL READ when the turn pulled."""
    turn = [s for s in spans if s["trace_id"] == trace_id]
    by_id = {s["span_id"]: s for s in turn}
    names = {(s["service"], s["name"]) for s in turn}
    for want in (
        ("kvloop-proxy", "kvloop.proxy /v1/chat/completions"),
        ("vllm-prefill", "llm_request"),
        ("vllm-decode", "llm_request"),
        ("vllm-prefill", "kvloop.prefill"),
        ("kvloopd", "/kvloop.v1.Directory/Lookup"),
    ):
        assert want in names, (want, sorted(names))
    lookup = next(s for s in turn if s["service"] == "kvloopd" and s["name"].endswith("/Lookup"))
    assert "kvloop.decision" in lookup["attributes"] and "kvloop.reason" in lookup["attributes"]
    ancestors = []
    span = lookup
    while span.get("parent_span_id") in by_id:
        span = by_id[span["parent_span_id"]]
        ancestors.append(span["name"])
    assert "kvloop.prefill" in ancestors and ancestors[-1].startswith("kvloop.proxy"), ancestors
    reads = [s for s in turn if s["name"] == "kvloop.nixl_read"]
    if pulled:
        assert len(reads) == 1 and reads[0]["attributes"]["kvloop.bytes"] > 0, reads
        assert lookup["attributes"]["kvloop.decision"] == "transfer"
        assert lookup["attributes"]["kvloop.estimated_transfer_ms"] > 0
    else:
        assert reads == []
