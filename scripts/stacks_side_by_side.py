"""Decode speed of two served stacks side by side on one host, taking turns.

Each stack is one prefill + decode pair of its own (``kvloop`` or ``builtin`` mode, see
``StackConfig.mode``; a trailing digit names a second stack of the same mode). Turn by turn, in an
order that alternates, each stack prefills a ~900-token prompt and decodes 128 tokens answered whole;
the script prints each stack's median milliseconds per output token. What one stack does while it is
idle (vLLM's built-in reverse mode steps its engine loop while it holds a handle) lands on the other's
turns, which is what this shows.

    .venv/bin/python scripts/stacks_side_by_side.py kvloop builtin --turns 12
    .venv/bin/python scripts/stacks_side_by_side.py kvloop kvloop2 --turns 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvloop.clients.bench.multiturn.arms import _post
from kvloop.clients.bench.multiturn.setup import MODEL
from kvloop.clients.fleet.model import build_tiny_llama
from kvloop.clients.fleet.stack import Stack, StackConfig

ANSWER_TOKENS = 128


def _chat(url: str, body: dict) -> dict:
    return _post(f"{url}/v1/chat/completions", body)


def decode_ms_per_token(stack: Stack, turn: int) -> float:
    messages = [{"role": "user", "content": f"w{turn} w2 w3 " * 300}]
    base = {"model": MODEL, "messages": messages, "temperature": 0.0}
    prefill = _chat(
        stack.prefill.config.url,
        {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    started = time.perf_counter()
    _chat(
        stack.decodes[0].config.url,
        {
            **base,
            "max_tokens": ANSWER_TOKENS,
            "min_tokens": ANSWER_TOKENS,
            "ignore_eos": True,
            "kv_transfer_params": prefill.get("kv_transfer_params"),
        },
    )
    return (time.perf_counter() - started) * 1000 / ANSWER_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stacks", nargs=2, help="kvloop | builtin, a digit appended for a second of one mode")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvloop-side-by-side-"))
    model = build_tiny_llama(workdir / "model", hidden_size=384, layers=4, tokenizer="words")
    stacks: dict[str, Stack] = {}
    try:
        for name in args.stacks:
            stack = stacks[name] = Stack(
                StackConfig(
                    model_dir=model,
                    workdir=workdir / name,
                    mode=name.rstrip("0123456789"),
                    kv_cache_gib=1,
                    dtype="float32",
                    with_proxy=False,
                    retention_ttl_s=90,
                    retention_max_share=1.0,
                )
            )
            stack.start(lambda what, state, name=name: print(f"{name}: {what} {state}", flush=True))
        times: dict[str, list[float]] = {name: [] for name in stacks}
        for turn in range(args.turns):
            order = list(stacks) if turn % 2 == 0 else list(stacks)[::-1]
            for name in order:
                times[name].append(decode_ms_per_token(stacks[name], turn))
            print(f"turn {turn + 1}/{args.turns}", flush=True)
        for name, values in times.items():
            print(f"{name}: median {statistics.median(values):.2f} ms per token over {len(values)} decodes")
    finally:
        for stack in stacks.values():
            stack.stop()


if __name__ == "__main__":
    main()
