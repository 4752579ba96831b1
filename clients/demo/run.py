"""`kvloop demo`: the main job on embedded defaults."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rich.table import Table

from kvloop.clients.console import make_console
from kvloop.clients.demo.conversation import AgentConversation, TurnResult, chat_turn, recompute_turn
from kvloop.clients.fleet.model import MODEL_BUILDERS
from kvloop.clients.fleet.stack import Stack, StackConfig
from kvloop.common.processes import Terminated
from kvloop.v1 import directory_pb2 as pb

# A turn's `recompute_ttft_ms` and `saving_ratio` (--json) where none was measured: the first turn
# (nothing to reuse yet), or a recompute request that failed.
NOT_MEASURED: dict[str, float | None] = {"recompute_ttft_ms": None, "saving_ratio": None}


def run_demo(
    workdir: Path,
    turns: int,
    max_tokens: int,
    as_json: bool,
    hidden_size: int,
    layers: int,
    keep_running: bool = False,
    model: str = "llama",
    decode_tp: int = 1,
    ha: bool = False,
    host_retention_gib: float = 0.0,
    host_demote_after_s: float | None = None,
) -> int:
    console = make_console(stderr=as_json)
    workdir.mkdir(parents=True, exist_ok=True)
    span_file = workdir / "spans.jsonl"
    if span_file.exists():
        span_file.unlink()
    started = time.monotonic()

    def progress(what: str, state: str) -> None:
        console.print(
            f"[dim]{time.monotonic() - started:6.1f}s[/dim] [bold]{what}[/bold]: {state}", highlight=False
        )

    kind = {"llama": "Llama", "hybrid": "Gemma-3-like hybrid (sliding-window + full attention)"}[model]
    progress(
        "model",
        f"building a random-weight {kind} (hidden {hidden_size}, {layers} layers) in {workdir / model}",
    )
    model_dir = MODEL_BUILDERS[model](workdir / model, hidden_size=hidden_size, layers=layers)
    stack = Stack(
        StackConfig(
            model_dir=model_dir,
            workdir=workdir,
            span_file=span_file,
            decode_tp=decode_tp,
            ha=ha,
            host_retention_gib=host_retention_gib,
            host_demote_after_s=host_demote_after_s,
        )
    )
    try:
        stack.start(progress)
        console.print(
            f"Inspect the directory meanwhile: kvloop --daemon {stack.daemon_address} workers  |  "
            f"grpcurl -plaintext {stack.daemon_address} list",
            highlight=False,
        )
        conversation = _DemoConversation(stack, turns, max_tokens, as_json, progress, ha)
        conversation.run()
        if not as_json:
            console.print(turn_table(conversation.results, conversation.recomputed))
        _print_where_to_look(console, stack, span_file, workdir)
        if keep_running:
            console.print(
                f"Everything keeps running (OpenAI API at {stack.proxy_url}); "
                "Ctrl-C (or SIGTERM, SIGHUP) stops it."
            )
            while True:
                time.sleep(3600)  # until a signal: `kvloop demo` runs this inside stop_on_signals
        return 0
    except Terminated as exc:
        console.print(f"{exc}: stopping everything")
        raise
    except KeyboardInterrupt:  # run without stop_on_signals
        console.print("interrupted: stopping everything")
        return 130
    finally:
        stack.stop()
        console.print(
            f"[dim]stopped kvloopd, engines, sidecars and proxy after {time.monotonic() - started:.0f}s[/dim]"
        )


class _DemoConversation:
    """One agent conversation through the proxy, turn by turn: each continuation turn measured
    against the same prompt recomputed, and with --ha the faults injected before their turns."""

    def __init__(self, stack: Stack, turns: int, max_tokens: int, as_json: bool, progress, ha: bool) -> None:
        self.stack = stack
        self.turns = turns
        self.max_tokens = max_tokens
        self.as_json = as_json
        self.progress = progress
        self.results: list[TurnResult] = []
        # per continuation turn, the same prompt recomputed: its TTFT, and that over the turn's own
        self.recomputed: dict[int, dict[str, float | None]] = {}
        # --ha: before these turns, kill the kvloopd replica the decode's sidecar streams to, then the
        # Redis primary
        self.faults = (
            {max(2, turns // 3): "kvloopd_replica", max(3, 2 * turns // 3): "redis_primary"} if ha else {}
        )
        self.primary_killed_at: float | None = None
        self.killed = ""
        self.past_epoch = 0
        config = stack.config
        # copies demoted at once (--host-demote-after-s 0): the next turn reads the pool, so each turn
        # waits until the pool alone holds the one before
        self.to_pool = config.host_retention_gib > 0 and config.host_demote_after_s == 0

    def run(self) -> None:
        conversation = AgentConversation(seed=11)
        for turn in range(1, self.turns + 1):
            self._inject_fault(turn)
            messages = list(conversation.messages)  # as this turn sends them (its answer is appended)
            try:
                result = chat_turn(
                    self.stack.proxy_url, self.stack.config.served_model_name, messages, self.max_tokens, turn
                )
            except OSError as exc:  # the request failed: recorded, the conversation goes on
                failed = {"turn": turn, "path": "error", "ttft_ms": None, "error": str(exc)}
                emit(failed, self.as_json, self.progress)
                conversation.record("")
                continue
            conversation.record(result.answer)
            self.results.append(result)
            self._note_recovery(turn, result)
            # The agent's tool runs now; meanwhile the decode's retained blocks reach the directory.
            if self.primary_killed_at is not None:
                # a tool that takes as long as Sentinel's failover and the agents' re-push, so a short
                # conversation still shows the recovery (the next turn transfers when the wait ends)
                self.progress("tool", "runs while Sentinel fails over and the agents re-push their state")
                self.stack.wait_failed_over(self.killed, self.past_epoch)
            self.stack.wait_turn_retained(
                messages, timeout_s=10, tier=pb.BLOCK_TIER_HOST if self.to_pool else 0, only=self.to_pool
            )
            if turn > 1:
                self.recomputed[turn] = measure_recompute(self.stack, messages, result, self.progress)
            self._report_turn(turn, result)
        if self.primary_killed_at is not None:
            emit({"fault": "redis_primary", "recovered": None}, self.as_json, self.progress)

    def _inject_fault(self, turn: int) -> None:
        if self.faults.get(turn) == "kvloopd_replica":
            emit(kill_decode_replica(self.stack, turn), self.as_json, self.progress)
        elif self.faults.get(turn) == "redis_primary":
            self.past_epoch = self.stack.directory_epoch()
            self.killed = self.stack.kill_redis_primary()
            self.primary_killed_at = time.monotonic()
            self.progress(
                "fault", f"stopped the Redis primary {self.killed} before turn {turn}; Sentinel fails over"
            )

    def _note_recovery(self, turn: int, result: TurnResult) -> None:
        if self.primary_killed_at is None or result.path != "transfer":
            return
        recovery = {
            "fault": "redis_primary",
            "killed": self.killed,
            "recovered": "first transfer again",
            "at_turn": turn,
            "recovered_s": round(time.monotonic() - self.primary_killed_at, 2),
        }
        emit(recovery, self.as_json, self.progress)
        self.primary_killed_at = None

    def _report_turn(self, turn: int, result: TurnResult) -> None:
        measured = self.recomputed.get(turn, NOT_MEASURED)
        if self.as_json:
            sys.stdout.write(json.dumps(result.as_dict() | measured) + "\n")
            sys.stdout.flush()
            return
        recomputed = (
            f", recomputed {_ms(measured['recompute_ttft_ms'])} ms ({_times(measured['saving_ratio'])})"
            if measured["recompute_ttft_ms"]
            else ""
        )
        self.progress(
            f"turn {turn}",
            f"{result.path} ({result.reason}) prompt {result.prompt_tokens} tokens, "
            f"TTFT {result.ttft_ms:.0f} ms" + recomputed,
        )


def _print_where_to_look(console, stack: Stack, span_file: Path, workdir: Path) -> None:
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    where = f"OTLP endpoint {otlp}" if otlp else f"the local file {span_file}"
    console.print(f"\nTraces went to {where}.")
    if not otlp:
        console.print(
            f"See a turn's trace: kvloop trace --spans {span_file} --last 1  "
            "(or --trace-id ID from the table)",
            highlight=False,
        )
    console.print(
        f"Inspect the daemon: kvloop --daemon {stack.daemon_address} workers  |  "
        f"kvloop --daemon {stack.daemon_address} stats  |  grpcurl -plaintext {stack.daemon_address} "
        "describe kvloop.v1.Directory",
        highlight=False,
    )
    console.print(f"Logs: {workdir / 'logs'}")


def turn_table(results: list[TurnResult], recomputed: dict[int, dict[str, float | None]]) -> Table:
    """The conversation as the demo prints it: a row per turn, with the same prompt's TTFT recomputed
    and that over the turn's own beside each continuation turn's TTFT."""
    table = Table(title="kvloop demo: one agent conversation through the proxy")
    for column in (
        "turn",
        "prompt tokens",
        "path",
        "reason",
        "matched",
        "recomputed",
        "bytes moved",
        "holder",
        "TTFT ms",
        "recompute TTFT ms",
        "saving",
        "trace id",
    ):
        table.add_column(
            column,
            justify="right" if column not in ("path", "reason", "holder", "trace id") else "left",
            no_wrap=column == "trace id",
        )
    for r in results:
        style = "green" if r.path == "transfer" else ("yellow" if r.path in ("recompute", "miss") else "red")
        measured = recomputed.get(r.turn, NOT_MEASURED)
        table.add_row(
            str(r.turn),
            str(r.prompt_tokens),
            f"[{style}]{r.path}[/]",
            r.reason,
            str(r.matched_tokens),
            str(r.recompute_tokens),
            f"{r.bytes_moved:,}",
            f"{r.holder} ({r.tier})" if r.holder and r.tier else (r.holder or "-"),
            f"{r.ttft_ms:.0f}",
            _ms(measured["recompute_ttft_ms"]),
            _times(measured["saving_ratio"]),
            r.trace_id or "-",
        )
    return table


def measure_recompute(
    stack: Stack, messages: list[dict], turn: TurnResult, progress
) -> dict[str, float | None]:
    """The turn's prompt sent again, recomputed (``recompute_turn``): its TTFT, and that over the
    turn's own TTFT (how many times longer the first token takes without what the turn reused).
    None when the request failed or pulled anything (then it measured no recompute)."""
    try:
        again = recompute_turn(stack.proxy_url, stack.config.served_model_name, messages, turn.turn)
    except OSError as exc:
        progress(f"turn {turn.turn}", f"the recompute request failed: {exc}")
        return NOT_MEASURED
    if again.matched_tokens or again.bytes_moved:
        progress(
            f"turn {turn.turn}", f"the recompute request reused {again.matched_tokens} tokens: not counted"
        )
        return NOT_MEASURED
    ratio = round(again.ttft_ms / turn.ttft_ms, 2) if turn.ttft_ms > 0 else None
    return {"recompute_ttft_ms": again.ttft_ms, "saving_ratio": ratio}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def emit(record: dict, as_json: bool, progress) -> None:
    """A fault's or a failed turn's record: one JSON line, or a progress line."""
    if as_json:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    else:
        progress(str(record.get("fault") or f"turn {record.get('turn')}"), json.dumps(record))


def kill_decode_replica(stack: Stack, turn: int, timeout_s: float = 30.0) -> dict:
    """Kill the kvloopd replica the decode's sidecar streams to; the record says when it resumed on
    the other one (its registration there)."""
    worker = stack.decodes[0].config.worker_id
    index = stack.replica_of(worker)
    if index is None:
        return {"fault": "kvloopd_replica", "at_turn": turn, "error": f"{worker} is attached to no replica"}
    address = stack.kill_replica(index)
    killed = time.monotonic()
    while time.monotonic() - killed < timeout_s:
        moved = stack.replica_of(worker)
        if moved is not None and moved != index:
            return {
                "fault": "kvloopd_replica",
                "killed": address,
                "at_turn": turn,
                "recovered": f"{worker}'s stream resumed on {stack.replicas[moved][0]}",
                "recovered_s": round(time.monotonic() - killed, 2),
            }
        time.sleep(0.05)  # polling the surviving replica's log
    return {"fault": "kvloopd_replica", "killed": address, "at_turn": turn, "recovered": None}
