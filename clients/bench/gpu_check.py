"""`kvloop bench gpu`: the host tier's figures on the machine it runs on (`make gpu-check` on a GPU).

A random-weight Llama built here is served by a stack of one prefill and one decode with a host pool,
twice: with retained runs kept in the decode's KV cache (pulls READ the device), then with each run
given up from the KV cache as soon as its host copy exists (pulls READ the pool). In each, for every
prompt size, a conversation's second turn pulls its first turn's KV, and the same prompt is then
recomputed under a fresh ``cache_salt`` (the demo's measure): continuation TTFT against recompute.

READ GB/s per tier are the prefill's NIXL-timed READs as kvloopd's cost model keeps them (``kvloop
pairs``); copy GB/s are the decode's WRITEs into its pool as NIXL timed them
(``kvloop_connector_host_copied_bytes_total`` over ``kvloop_connector_host_copy_seconds``).
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvloop.clients.demo.conversation import AgentConversation, chat_turn
from kvloop.clients.demo.run import NOT_MEASURED, measure_recompute
from kvloop.clients.directory_client import DirectoryClient
from kvloop.clients.fleet.model import build_tiny_llama
from kvloop.clients.fleet.stack import Stack, StackConfig
from kvloop.v1 import directory_pb2 as pb

TIERS = {"device": pb.BLOCK_TIER_DEVICE, "host": pb.BLOCK_TIER_HOST}


@dataclass
class GpuCheckConfig:
    workdir: Path
    prompt_tokens: tuple[int, ...] = (8192, 16384, 24576)
    # The model: a Llama of about 1B parameters by default (GQA-free, 16 layers): its KV is 128 KiB
    # per token in bf16, so a 24K-token prompt moves 3 GiB.
    hidden_size: int = 2048
    layers: int = 16
    heads: int = 16
    intermediate_size: int = 5632
    kv_cache_gib: int = 16  # CPU engines' KV cache (a GPU's comes from its memory share)
    host_retention_gib: float = 8.0
    max_tokens: int = 8
    tiers: tuple[str, ...] = ("device", "host")
    seed: int = 7


@dataclass
class SizeResult:
    tier: str
    prompt_tokens: int
    path: str
    pulled_tier: str
    matched_tokens: int
    ttft_ms: float
    recompute_ttft_ms: float | None
    saving_ratio: float | None


@dataclass
class TierResult:
    tier: str
    sizes: list[SizeResult] = field(default_factory=list)
    read_gbytes_per_s: float | None = None  # the median of prefill-0's NIXL-timed READs of this tier
    read_samples_gbytes_per_s: list[float] = field(default_factory=list)
    copy_gbytes_per_s: float | None = None  # the decode's WRITEs into its pool, NIXL-timed
    copied_bytes: float = 0.0


def run_gpu_check(config: GpuCheckConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Both stacks, every prompt size; the figures as one JSON-ready dict."""
    started = time.monotonic()

    def say(what: str, state: str) -> None:
        progress(f"{time.monotonic() - started:7.1f}s {what}: {state}")

    config.workdir.mkdir(parents=True, exist_ok=True)
    say("model", f"building a random-weight Llama (hidden {config.hidden_size}, {config.layers} layers)")
    model_dir = build_tiny_llama(
        config.workdir / "model",
        hidden_size=config.hidden_size,
        layers=config.layers,
        heads=config.heads,
        intermediate_size=config.intermediate_size,
    )
    tiers = [_run_tier(config, model_dir, tier, say) for tier in config.tiers]
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "accelerator": _accelerator(),
        "model": {
            "hidden_size": config.hidden_size,
            "layers": config.layers,
            "heads": config.heads,
            "intermediate_size": config.intermediate_size,
        },
        "tiers": [asdict(t) for t in tiers],
        "wall_s": round(time.monotonic() - started, 1),
    }


def _run_tier(
    config: GpuCheckConfig, model_dir: Path, tier: str, say: Callable[[str, str], None]
) -> TierResult:
    stack = Stack(
        StackConfig(
            model_dir=model_dir,
            workdir=config.workdir / tier,
            kv_cache_gib=config.kv_cache_gib,
            max_model_len=max(config.prompt_tokens) + 4096,
            host_retention_gib=config.host_retention_gib,
            # the host stack gives a run up from the KV cache once its copy exists: pulls read the pool
            host_demote_after_s=0.0 if tier == "host" else None,
            retention_max_share=0.9,
        )
    )
    result = TierResult(tier)
    try:
        stack.start(say)
        for n, target in enumerate(config.prompt_tokens):
            result.sizes.append(_continuation(stack, tier, target, config.seed + n, config.max_tokens, say))
        with DirectoryClient(stack.daemon_address, timeout=10) as directory:
            pairs = directory.pairs(stack.config.served_model_name).pairs
        read = [p for p in pairs if p.puller_worker_id == "prefill-0" and p.tier == TIERS[tier]]
        samples = [g for p in read for g in p.sample_gbytes_per_s]
        if samples:  # the samples themselves: a few READs leave the model's default standing in
            result.read_gbytes_per_s = round(statistics.median(samples), 3)
            result.read_samples_gbytes_per_s = [round(g, 3) for g in samples]
        copied, seconds = _copy_totals(stack.decodes[0].config.url)
        result.copied_bytes = copied
        if seconds > 0:
            result.copy_gbytes_per_s = round(copied / seconds / 1e9, 3)
    finally:
        stack.stop()
    return result


def _continuation(
    stack: Stack, tier: str, target: int, seed: int, max_tokens: int, say: Callable[[str, str], None]
) -> SizeResult:
    """Turn 1 of a conversation whose prompt is about ``target`` tokens; once its run is held in
    ``tier``, turn 2 (which pulls it) and the same prompt recomputed."""
    conversation = _conversation_of(stack, target, seed)
    model = stack.config.served_model_name
    first_prompt = list(conversation.messages)
    first = chat_turn(stack.proxy_url, model, first_prompt, max_tokens, 1)
    conversation.record(first.answer)
    # the host stack: until the copy is announced and the KV cache's run given up (Lookup prefers a
    # device holder at equal reach)
    if not stack.wait_turn_retained(first_prompt, timeout_s=120, tier=TIERS[tier], only=tier == "host"):
        say(f"{tier} {target}", "turn 1's run was not held in this tier in time: turn 2 may recompute")
    prompt = list(conversation.messages)
    second = chat_turn(stack.proxy_url, model, prompt, max_tokens, 2)
    recomputed = measure_recompute(stack, prompt, second, say) if second.path == "transfer" else NOT_MEASURED
    say(
        f"{tier} {second.prompt_tokens} tokens",
        f"{second.path} ({second.tier or '-'}, {second.matched_tokens} pulled): "
        f"TTFT {second.ttft_ms:.0f} ms, "
        f"recomputed {recomputed['recompute_ttft_ms'] or '-'} ms",
    )
    return SizeResult(
        tier=tier,
        prompt_tokens=second.prompt_tokens,
        path=second.path,
        pulled_tier=second.tier,
        matched_tokens=second.matched_tokens,
        ttft_ms=second.ttft_ms,
        recompute_ttft_ms=recomputed["recompute_ttft_ms"],
        saving_ratio=recomputed["saving_ratio"],
    )


def _conversation_of(stack: Stack, target: int, seed: int) -> AgentConversation:
    """A conversation whose first prompt is close to ``target`` tokens: its system prompt's words
    scaled once by what the model's tokenizer made of a first guess."""
    words = max(target // 2, 16)
    conversation = AgentConversation(seed=seed, system_words=words)
    tokens = len(stack.tokenize(conversation.messages))
    return AgentConversation(seed=seed, system_words=max(int(words * target / max(tokens, 1)), 16))


def _copy_totals(decode_url: str) -> tuple[float, float]:
    """The decode's bytes written into its pool and the seconds NIXL timed for them."""
    text = urllib.request.urlopen(f"{decode_url}/metrics", timeout=10).read().decode()
    copied = seconds = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvloop_connector_host_copied_bytes_total":
                copied += sample.value
            elif sample.name == "kvloop_connector_host_copy_seconds_sum":
                seconds += sample.value
    return copied, seconds


def _accelerator() -> str:
    """The GPU's name as nvidia-smi gives it, or "cpu"."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return out.splitlines()[0] if out else "cpu"


def write(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
