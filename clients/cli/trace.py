"""`kvloop trace`: a turn's trace as a waterfall in the terminal.

Reads span records (one JSON object per line, :mod:`kvloop.common.otlp_receiver`'s format: what the
demo's receiver and kvloop's JSON-lines exporter write) from a file, or receives them over OTLP/gRPC,
groups them by trace and draws each turn (a trace holding the proxy's or the prefill's kvloop span)
as a tree of spans on one time axis, with what each step decided: the directory's decision and cost
estimates on its Lookup span, the bytes of the NIXL READ, the engines' request spans.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvloop.common.addresses import parse_host_port
from kvloop.common.otlp_receiver import OtlpReceiver, SpanFile

# A trace is a turn when it holds one of these (the proxy's server span, the prefill's kvloop span).
TURN_SPANS = ("kvloop.proxy ", "kvloop.prefill")
BAR_WIDTH = 32

# What each step's row shows, by span name (the attributes' stable names; missing ones are skipped).
DETAILS: dict[str, tuple[str, ...]] = {
    "/kvloop.v1.Directory/Lookup": (
        "kvloop.decision",
        "kvloop.reason",
        "kvloop.matched_tokens",
        "kvloop.recompute_tokens",
        "kvloop.estimated_transfer_ms",
        "kvloop.estimated_recompute_ms",
        "kvloop.holder",
    ),
    "kvloop.prefill": (
        "kvloop.path",
        "kvloop.reason",
        "kvloop.matched_tokens",
        "kvloop.pulled_tokens",
        "kvloop.recompute_tokens",
        "kvloop.bytes",
    ),
    "kvloop.lookup": ("kvloop.path",),
    "kvloop.nixl_read": (
        "kvloop.bytes",
        "kvloop.blocks",
        "kvloop.holder",
        "kvloop.nixl_xfer_ms",
        "kvloop.ok",
    ),
    "kvloop.proxy.prefill": ("kvloop.backend",),
    "kvloop.proxy.decode": ("kvloop.backend",),
    "llm_request": (
        "gen_ai.usage.prompt_tokens",
        "gen_ai.usage.completion_tokens",
        "gen_ai.latency.time_to_first_token",
    ),
}
PROXY_DETAILS = ("kvloop.path", "kvloop.prefill_ms", "kvloop.decode_backend")


class SpanFileError(ValueError):
    """The span file is missing or holds no span records."""


@dataclass
class TraceView:
    trace_id: str
    spans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def start(self) -> int:
        return min(s["start_unix_nano"] for s in self.spans)

    @property
    def end(self) -> int:
        return max(s["end_unix_nano"] for s in self.spans)

    @property
    def is_turn(self) -> bool:
        return any(s["name"].startswith(TURN_SPANS) for s in self.spans)

    def ordered(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(depth, span) in tree order: children under their parent, siblings by start time. A span
        whose parent is not here (another process that exported nothing, or the caller's own
        traceparent) is a root."""
        ids = {s["span_id"] for s in self.spans}
        children: dict[str, list[dict[str, Any]]] = {}
        roots = []
        for s in self.spans:
            parent = s.get("parent_span_id") or ""
            if parent and parent in ids:
                children.setdefault(parent, []).append(s)
            else:
                roots.append(s)

        def walk(span: dict[str, Any], depth: int) -> Iterator[tuple[int, dict[str, Any]]]:
            yield depth, span
            for child in sorted(children.get(span["span_id"], ()), key=_start_key):
                yield from walk(child, depth + 1)

        for root in sorted(roots, key=_start_key):
            yield from walk(root, 0)

    def as_dict(self) -> dict[str, Any]:
        t0 = self.start
        return {
            "trace_id": self.trace_id,
            "start_unix_nano": t0,
            "duration_ms": round((self.end - t0) / 1e6, 3),
            "spans": [
                {
                    "depth": depth,
                    "name": s["name"],
                    "service": s.get("service"),
                    "span_id": s["span_id"],
                    "parent_span_id": s.get("parent_span_id") or "",
                    "offset_ms": round((s["start_unix_nano"] - t0) / 1e6, 3),
                    "duration_ms": round(s["duration_ns"] / 1e6, 3),
                    "status": s.get("status", "UNSET"),
                    "attributes": s.get("attributes", {}),
                }
                for depth, s in self.ordered()
            ],
        }


def _start_key(span: dict[str, Any]) -> tuple[int, int]:
    return span["start_unix_nano"], -span["duration_ns"]


def _normalise(record: dict[str, Any]) -> dict[str, Any] | None:
    """A span record with the fields the waterfall needs, or None when it is not one."""
    try:
        start = int(record["start_unix_nano"])
        end = int(record.get("end_unix_nano") or start + int(record.get("duration_ns", 0)))
        return {
            **record,
            "trace_id": str(record["trace_id"]),
            "span_id": str(record["span_id"]),
            "name": str(record["name"]),
            "start_unix_nano": start,
            "end_unix_nano": end,
            "duration_ns": end - start,
            "attributes": record.get("attributes") or {},
        }
    except (KeyError, TypeError, ValueError):
        return None


def read_span_file(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise SpanFileError(f"no span file at {path} (run `kvloop demo`, or give --spans FILE or --listen)")
    spans = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a process killed mid-write
        span = _normalise(record) if isinstance(record, dict) else None
        if span is not None:
            spans.append(span)
    if not spans:
        raise SpanFileError(f"{path} holds no span records")
    return spans


def group_traces(spans: Iterable[dict[str, Any]]) -> list[TraceView]:
    """Traces in order of their first span's start."""
    by_id: dict[str, TraceView] = {}
    for span in spans:
        by_id.setdefault(span["trace_id"], TraceView(span["trace_id"])).spans.append(span)
    return sorted(by_id.values(), key=lambda t: t.start)


def select(traces: list[TraceView], trace_id: str | None = None, last: int | None = None) -> list[TraceView]:
    """The turn traces (or the one ``trace_id`` names, by a prefix of at least 8 hex digits), the
    latest ``last`` of them."""
    if trace_id:
        wanted = trace_id.lower().removeprefix("0x")
        found = [t for t in traces if t.trace_id.startswith(wanted)]
        if len(found) > 1:
            raise SpanFileError(f"trace id prefix {trace_id!r} matches {len(found)} traces: give more digits")
        return found
    turns = [t for t in traces if t.is_turn]
    return turns[-last:] if last else turns


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def details(span: dict[str, Any]) -> str:
    name = span["name"]
    keys = PROXY_DETAILS if name.startswith("kvloop.proxy ") else DETAILS.get(name, ())
    attrs = span.get("attributes", {})
    shown = []
    for key in keys:
        if key in attrs and attrs[key] not in ("", None):
            shown.append(f"{key.rsplit('.', 1)[-1]}={_fmt(attrs[key])}")
    if span.get("status") == "ERROR":
        shown.append("[error]")
    return " ".join(shown)


def _bar(start: int, duration: int, t0: int, total: int) -> Text:
    if total <= 0:
        return Text("█", style="cyan")
    left = min(BAR_WIDTH - 1, int((start - t0) / total * BAR_WIDTH))
    width = max(1, round(duration / total * BAR_WIDTH))
    width = min(width, BAR_WIDTH - left)
    return Text(" " * left + "█" * width + " " * (BAR_WIDTH - left - width), style="cyan")


_SERVICE_STYLE = {"kvloopd": "magenta", "kvloop-proxy": "blue"}


def render(trace: TraceView, console: Console) -> None:
    t0, total = trace.start, trace.end - trace.start
    table = Table(
        title=f"trace {trace.trace_id}  ({total / 1e6:,.1f} ms, {len(trace.spans)} spans)",
        title_justify="left",
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("span", no_wrap=True)
    table.add_column("service", no_wrap=True)
    table.add_column("start ms", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("waterfall", no_wrap=True)
    table.add_column("details")
    for depth, span in trace.ordered():
        service = span.get("service") or "?"
        style = _SERVICE_STYLE.get(service, "green" if service.startswith("vllm") else "")
        table.add_row(
            Text("  " * depth + span["name"], style="red" if span.get("status") == "ERROR" else ""),
            Text(service, style=style),
            f"{(span['start_unix_nano'] - t0) / 1e6:,.1f}",
            f"{span['duration_ns'] / 1e6:,.1f}",
            _bar(span["start_unix_nano"], span["duration_ns"], t0, total),
            details(span),
        )
    console.print(table)


def show(traces: list[TraceView], console: Console, as_json: bool) -> None:
    if as_json:
        console.file.write(json.dumps([t.as_dict() for t in traces], indent=2, default=str) + "\n")
        return
    for trace in traces:
        render(trace, console)
        console.print()


def listen(
    address: str,
    console: Console,
    as_json: bool,
    count: int | None,
    trace_id: str | None,
    notice: Callable[[str], None],
    settle_s: float = 2.0,
    spans_out: Path | None = None,
) -> int:
    """Receive spans over OTLP/gRPC on ``address``; print each turn once no span of it arrived for
    ``settle_s`` (exporters batch, and the engines export after the proxy). Stops after ``count``
    turns (or the one ``trace_id`` names); otherwise runs until interrupted. Returns turns shown."""
    host, port = parse_host_port(address, "--listen")
    batches: queue.Queue[list[dict[str, Any]]] = queue.Queue()
    sink_file = SpanFile(spans_out) if spans_out else None

    def sink(records: list[dict[str, Any]]) -> None:
        if sink_file is not None:
            sink_file.write(records)
        batches.put(records)

    pending: dict[str, TraceView] = {}
    last_seen: dict[str, float] = {}
    shown = 0
    with OtlpReceiver(sink, host=host, port=port) as receiver:
        notice(
            f"listening for OTLP/gRPC spans at {receiver.endpoint} "
            f"(OTEL_EXPORTER_OTLP_ENDPOINT={receiver.endpoint}); Ctrl-C stops"
        )
        while count is None or shown < count:
            try:
                records = batches.get(timeout=settle_s / 4)
            except queue.Empty:
                records = []
            now = time.monotonic()
            for record in records:
                span = _normalise(record)
                if span is not None:
                    pending.setdefault(span["trace_id"], TraceView(span["trace_id"])).spans.append(span)
                    last_seen[span["trace_id"]] = now
            for tid in [t for t, seen in last_seen.items() if now - seen >= settle_s]:
                trace = pending.pop(tid)
                del last_seen[tid]
                if select([trace], trace_id=trace_id) if trace_id else trace.is_turn:
                    show([trace], console, as_json)
                    shown += 1
                    if trace_id or (count is not None and shown >= count):
                        return shown
    return shown
