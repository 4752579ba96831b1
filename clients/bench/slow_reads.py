"""`kvloop bench slow-reads`: can a few slow READs switch transfers off?

The regression run for the cost model. A served stack (kvloopd, a prefill and a decode `vllm serve`
with their sidecars, the proxy) carries one agent conversation. During the first transferring turns
the decode engine is stopped (SIGSTOP) for ``stop_s`` seconds, as a network hiccup or a busy peer
would stall it: NIXL runs over UCX's TCP transport here, whose READ needs the holder's progress, so
those READs really take ``stop_s`` as NIXL measures them. Then the decode runs at full speed. The
run reports every turn's path, reason and TTFT, the cost model's samples and verdicts for the pair
(kvloopd's ``ListPairs``), how many continuation turns recomputed although a pull was cheaper (a
later full-speed turn transferred, so the pull was the cheaper path), and how long after the last
stall transfers were back.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloop.clients.demo.conversation import AgentConversation, TurnResult, chat_turn
from kvloop.clients.directory_client import DirectoryClient
from kvloop.clients.fleet.model import build_tiny_llama
from kvloop.clients.fleet.stack import Stack, StackConfig


@dataclass
class SlowReadsConfig:
    workdir: Path
    turns: int = 14
    stalled_turns: tuple[int, ...] = (2, 3, 4)  # turn 2 is the pair's first READ (the handshake)
    stop_s: float = 1.0
    max_tokens: int = 8
    ucx_tls: str = "tcp,self"
    tool_words: int = 350


@dataclass
class _Stall:
    """SIGSTOP a process group now, SIGCONT it after ``seconds`` (from a timer thread)."""

    pgid: int
    seconds: float
    resumed_at: float = 0.0
    _timer: threading.Timer | None = field(default=None, repr=False)

    def __enter__(self) -> _Stall:
        os.killpg(self.pgid, signal.SIGSTOP)
        self._timer = threading.Timer(self.seconds, self._resume)
        self._timer.start()
        return self

    def _resume(self) -> None:
        os.killpg(self.pgid, signal.SIGCONT)
        self.resumed_at = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        assert self._timer is not None
        self._timer.join()  # never leave the decode stopped


def run_slow_reads(
    config: SlowReadsConfig, progress: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    model_dir = build_tiny_llama(config.workdir / "model")
    stack = Stack(
        StackConfig(model_dir=model_dir, workdir=config.workdir, with_proxy=True, ucx_tls=config.ucx_tls)
    )
    results: list[TurnResult] = []
    last_resume = 0.0
    resumed_turn_done: float | None = None
    try:
        stack.start(lambda what, state: progress(f"{what}: {state}"))
        decode = stack.decodes[0]
        assert decode.vllm is not None
        conversation = AgentConversation(seed=7, tool_words=config.tool_words)
        for turn in range(1, config.turns + 1):
            retained = _retained_runs(stack)
            if turn in config.stalled_turns:
                with _Stall(os.getpgid(decode.vllm.pid), config.stop_s) as stall:
                    result = chat_turn(
                        stack.proxy_url,
                        stack.config.served_model_name,
                        conversation.messages,
                        config.max_tokens,
                        turn,
                    )
                last_resume = stall.resumed_at
            else:
                result = chat_turn(
                    stack.proxy_url,
                    stack.config.served_model_name,
                    conversation.messages,
                    config.max_tokens,
                    turn,
                )
                if result.path == "transfer" and last_resume and resumed_turn_done is None:
                    resumed_turn_done = time.monotonic()
            conversation.record(result.answer)
            results.append(result)
            stack.wait_retained(retained + 1)
            stalled = " (decode stalled)" if turn in config.stalled_turns else ""
            progress(f"turn {turn}{stalled}: {result.path}/{result.reason}, TTFT {result.ttft_ms:.0f} ms")
        with DirectoryClient(stack.daemon_address) as directory:
            pairs = directory.pairs(stack.config.served_model_name)
    finally:
        stack.stop()
    return summarize(config, results, pairs, last_resume, resumed_turn_done)


def _retained_runs(stack: Stack) -> int:
    with DirectoryClient(stack.daemon_address) as directory:
        return directory.stats().retained_runs


def summarize(
    config: SlowReadsConfig,
    results: list[TurnResult],
    pairs: Any,
    last_resume: float,
    resumed_turn_done: float | None,
) -> dict[str, Any]:
    after_stalls = [r for r in results if r.turn > 1]
    transferred_later = any(
        r.path == "transfer" for r in results if r.turn > max(config.stalled_turns, default=0)
    )
    # A turn that recomputed because the estimate said so, while the link was (as later turns show)
    # the cheaper path: what the cost model must not do after a few slow READs.
    fooled = [r.turn for r in after_stalls if r.reason == "recompute_faster" and transferred_later]
    pair = next((p for p in pairs.pairs if p.puller_worker_id == "prefill-0"), None)
    continuations = [r.ttft_ms for r in after_stalls if r.turn not in config.stalled_turns]
    return {
        "turns": [r.as_dict() | {"stalled": r.turn in config.stalled_turns} for r in results],
        "stalled_turns": list(config.stalled_turns),
        "stop_s": config.stop_s,
        "ucx_tls": config.ucx_tls,
        "recomputed_though_pull_cheaper": len(fooled),
        "fooled_turns": fooled,
        # From the end of the last stall to the first full-speed turn that transferred (0 when
        # transfers never stopped, i.e. no turn recomputed on a wrong estimate).
        "transfers_resumed_after_s": 0.0
        if not fooled
        else (round(resumed_turn_done - last_resume, 3) if resumed_turn_done else None),
        "pair": None
        if pair is None
        else {
            "holder": pair.holder_worker_id,
            "transfer_gbytes_per_s": pair.transfer_gbytes_per_s,
            "samples_gbytes_per_s": list(pair.sample_gbytes_per_s),
            "verdicts": dict(pair.verdicts),
            "mean_wait_ms": pair.mean_wait_ms,
        },
        "continuation_ttft_p50_ms": statistics.median(continuations) if continuations else None,
    }
