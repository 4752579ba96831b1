"""`kvloop demo --json`, the README's main job, end to end on real engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.traces import check_turn_trace

BIN = Path(sys.executable).parent


def test_demo_json_runs_the_loop_and_cleans_up(tmp_path):
    workdir = tmp_path / "demo"
    # as a new user runs it: no OTLP endpoint (the served-stack fixture sets one for this process
    # while it lives), so the demo writes its local span file
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [str(BIN / "kvloop"), "--json", "demo", "--turns", "3", "--workdir", str(workdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    # with --json an error is a JSON object on stdout, progress is on stderr
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    turns = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["path"] in ("miss", "recompute")
    # the first turn has nothing to reuse: no recompute measured beside it
    assert turns[0]["recompute_ttft_ms"] is None and turns[0]["saving_ratio"] is None
    for turn in turns[1:]:
        assert turn["path"] == "transfer", turn
        assert turn["matched_tokens"] > 0 and turn["bytes_moved"] > 0 and turn["ttft_ms"] > 0
        # the same prompt recomputed (a fresh cache salt, nothing pulled): its TTFT and that over the turn's
        again, ratio = turn["recompute_ttft_ms"], turn["saving_ratio"]
        assert isinstance(again, float) and again > 0, turn
        assert isinstance(ratio, float) and ratio > 0 and ratio == round(again / turn["ttft_ms"], 2), turn
    assert "Traces went to" in result.stderr and (workdir / "spans.jsonl").exists()
    # the demo's own OTLP receiver got every process's spans: each turn is one whole trace
    spans = [json.loads(line) for line in (workdir / "spans.jsonl").read_text().splitlines()]
    assert len({t["trace_id"] for t in turns}) == len(turns)
    # the recompute requests left no trace: the proxy's request spans are the turns'
    proxied = {s["trace_id"] for s in spans if s["name"].startswith("kvloop.proxy /")}
    assert proxied == {t["trace_id"] for t in turns}, proxied
    for turn in turns:
        check_turn_trace(spans, turn["trace_id"], pulled=turn["path"] == "transfer")
    # the prefill opened its NIXL connection to the decode before any turn read from it, and its
    # directory polls for peers (ListWorkers) left no traces
    assert "kvloop.peer_warmed" in (workdir / "logs" / "prefill-0.vllm.log").read_text()
    # the connector's lines in the engine logs are JSON at its log level (info): no debug line per
    # retained run on the engine loop's path (structlog unconfigured printed every one)
    decode_log = (workdir / "logs" / "decode-0.vllm.log").read_text().splitlines()
    connector_lines = [json.loads(line) for line in decode_log if line.startswith('{"') and "kvloop." in line]
    assert any(c["event"] == "kvloop.scheduler_init" for c in connector_lines), decode_log[-20:]
    assert not [line for line in decode_log if "kvloop.retained" in line]
    # so no READ waited for a handshake: each is steady state, and the cost model learns from it
    reads = [s for s in spans if s["name"] == "kvloop.nixl_read"]
    assert reads, "no turn read from the decode"
    assert [r["attributes"]["kvloop.first_contact"] for r in reads] == [False] * len(reads), reads
    assert not any(s["name"].endswith("/ListWorkers") for s in spans)
    shown = subprocess.run(
        [str(BIN / "kvloop"), "trace", "--spans", str(workdir / "spans.jsonl"), "--last", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0 and turns[-1]["trace_id"] in shown.stdout, shown.stderr
    # everything it started is gone
    leftovers = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert leftovers == []
