"""Where each turn's time went, from its spans (`kvloop bench multiturn --spans`).

Every turn is a trace of its own (the client sends a fresh ``traceparent``), so the spans of every
process that served it share its trace id: vLLM's request span on the prefill (``llm_request``, with
vLLM's own queue and prefill-compute latencies) and on the decode, and the kvloop connector's
``kvloop.prefill`` span with its ``kvloop.lookup`` and ``kvloop.nixl_read`` children. The same split
applies to every arm, the built-in reverse pull included (it has no kvloop spans: its READ is part of
vLLM's queue time, and there is no lookup):

- ``queue``: vLLM's time in queue on the prefill, from the request reaching the scheduler to its first
  compute step: the lookup, the READ and the engine steps waited for in between;
- ``lookup``: kvloop's directory lookup (the RPC, or a plan taken from Route's push);
- ``read``: the lookup's answer to the engine seeing the READ done (NIXL's own transfer time is
  ``xfer``): what the READ's completion waited for beyond the transfer is step boundaries;
- ``steps``: the queue time neither of those explains (waiting for the scheduler's next step);
- ``compute``: vLLM's prefill compute (first scheduled -> first token);
- ``outside``: the client's TTFT less queue and compute: HTTP, chat template, tokenizer, response;
- ``decode_first``: the decode's first token (its own pull of the prefill's KV and first step),
  which a routed turn's TTFT includes and a direct turn's does not.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from kvloop.clients.bench.multiturn.setup import TurnSample
from kvloop.clients.cli.trace import SpanFileError, read_span_file

SPAN_FILE = "spans.jsonl"
PARTS = ("ttft", "queue", "lookup", "read", "xfer", "steps", "compute", "outside", "decode_first")
_VLLM_SPAN = "llm_request"
_QUEUE = "gen_ai.latency.time_in_queue"
_PREFILL = "gen_ai.latency.time_in_model_prefill"
_TTFT = "gen_ai.latency.time_to_first_token"


def read_spans(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Span records of these span files by trace id (`kvloop trace`'s reader: lines a killed process
    cut short are skipped); a stack that exported nothing has no file, or an empty one."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        try:
            spans = read_span_file(path)
        except SpanFileError:
            continue
        for span in spans:
            by_trace[span["trace_id"]].append(span)
    return by_trace


def _duration_ms(span: dict[str, Any]) -> float:
    return (int(span["end_unix_nano"]) - int(span["start_unix_nano"])) / 1e6


def turn_parts(sample: TurnSample, spans: list[dict[str, Any]]) -> dict[str, float] | None:
    """One turn's parts in ms, or None when its prefill's vLLM span did not arrive."""
    requests = sorted(
        (s for s in spans if s.get("name") == _VLLM_SPAN), key=lambda s: int(s["start_unix_nano"])
    )
    if not requests:
        return None
    prefill = requests[0].get("attributes") or {}
    if _QUEUE not in prefill or _PREFILL not in prefill:
        return None
    parts = {
        "ttft": sample.ttft_ms,
        "queue": float(prefill[_QUEUE]) * 1e3,
        "compute": float(prefill[_PREFILL]) * 1e3,
        "lookup": 0.0,
        "read": 0.0,
        "xfer": 0.0,
    }
    for span in spans:
        if span.get("name") == "kvloop.lookup":
            parts["lookup"] += _duration_ms(span)
        elif span.get("name") == "kvloop.nixl_read":
            parts["read"] += _duration_ms(span)
            parts["xfer"] += float((span.get("attributes") or {}).get("kvloop.nixl_xfer_ms") or 0.0)
    parts["steps"] = max(0.0, parts["queue"] - parts["lookup"] - parts["read"])
    parts["outside"] = parts["ttft"] - parts["queue"] - parts["compute"]
    if len(requests) > 1:
        decode = requests[1].get("attributes") or {}
        if _TTFT in decode:
            parts["decode_first"] = float(decode[_TTFT]) * 1e3
    return parts


def breakdown(samples: list[TurnSample], span_files: list[Path]) -> list[dict[str, Any]]:
    """Per workload, sessions and arm: the mean of each part over the continuation turns whose spans
    arrived, and how many those were."""
    by_trace = read_spans(span_files)
    cells: dict[tuple[str, int, str], list[dict[str, float]]] = defaultdict(list)
    missing: dict[tuple[str, int, str], int] = defaultdict(int)
    for sample in samples:
        if sample.turn < 2 or not sample.trace_id:
            continue
        key = (sample.workload, sample.concurrency, sample.arm)
        parts = turn_parts(sample, by_trace.get(sample.trace_id, []))
        if parts is None:
            missing[key] += 1
        else:
            cells[key].append(parts)
    rows = []
    for (workload, concurrency, arm), turns in sorted(cells.items()):
        row: dict[str, Any] = {
            "workload": workload,
            "concurrency": concurrency,
            "arm": arm,
            "turns": len(turns),
            "turns_without_spans": missing.get((workload, concurrency, arm), 0),
        }
        for part in PARTS:
            values = [t[part] for t in turns if part in t]
            row[f"{part}_ms"] = round(mean(values), 2) if values else None
        rows.append(row)
    return rows
