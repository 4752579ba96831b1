"""`kvloop bench idle`: CPU of a served prefill + decode pair at rest while the decode holds N retained
runs, and the decode's time per output token with and without retained runs.

The stack is the one `kvloop demo` starts (kvloopd, a prefill and a decode `vllm serve` with the kvloop
connector, their sidecars), without the proxy: the bench drives prefill -> decode itself, as the proxy
does. A retained run is one finished request that went through the prefill and then the decode (the
decode keeps its blocks for reverse pulls until the lease ends).

CPU is read from ``/proc/<pid>/stat`` (utime + stime of every thread, children included while they
live) at the start and the end of an idle window, for each process of each group: the vLLM API server,
its engine-core process (and any other child), the sidecar, kvloopd. Figures are % of one core.

TPOT: streamed completions on the decode (no KV transfer, no retention: plain requests), each one's
time per output token as the decode's vLLM measured it (``vllm:request_time_per_output_token_seconds``);
median of the repeats, measured with 0 retained runs and again, on the same engines, with the largest N.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvloop.clients.bench.common import CLK_TCK, ticks
from kvloop.clients.fleet.model import build_tiny_llama

MODEL = "kvloop-tiny"


@dataclass
class IdleConfig:
    workdir: Path
    runs: tuple[int, ...] = (0, 10, 100)
    window_s: float = 20.0
    settle_s: float = 2.0
    prompt_tokens: int = 256
    decode_tokens: int = 8
    tpot_tokens: int = 64
    tpot_repeats: int = 7
    mode: str = "kvloop"
    retention_ttl_s: float = 480.0
    seed: int = 17


@dataclass
class Window:
    runs: int
    seconds: float
    cpu_percent: dict[str, float] = field(default_factory=dict)  # group -> % of one core

    def total(self, prefix: str = "") -> float:
        return round(sum(v for k, v in self.cpu_percent.items() if k.startswith(prefix)), 2)


# ------------------------------------------------------------------------------------ /proc


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"
    return title.rsplit("/", 1)[-1] or "?"


def process_groups(stack) -> dict[str, list[int]]:
    """group name -> pids. Each vLLM server is split into its API server and its children (the
    engine-core process; vLLM names it 'VLLM::EngineCore')."""
    children = _children_map()
    groups: dict[str, list[int]] = {}
    for engine in stack.engines:
        name = engine.config.role
        assert engine.vllm is not None
        groups[f"{name} api-server"] = [engine.vllm.pid]
        kids = _descendants(engine.vllm.pid, children)
        core = [p for p in kids if "EngineCore" in _comm(p)]
        groups[f"{name} engine-core"] = core
        others = [p for p in kids if p not in core]
        if others:
            groups[f"{name} other children"] = others
        if engine.agent is not None:
            groups[f"{name} sidecar"] = [engine.agent.pid, *_descendants(engine.agent.pid, children)]
    if stack.daemon is not None:
        groups["kvloopd"] = [stack.daemon.pid, *_descendants(stack.daemon.pid, children)]
    return groups


def measure_idle(stack, runs: int, seconds: float) -> Window:
    groups = process_groups(stack)
    start = {pid: ticks(pid) for pids in groups.values() for pid in pids}
    t0 = time.monotonic()
    time.sleep(seconds)  # the measurement window itself: nothing is sent to the stack meanwhile
    wall = time.monotonic() - t0
    window = Window(runs=runs, seconds=round(wall, 2))
    for name, pids in groups.items():
        used = 0
        for pid in pids:
            a, b = start.get(pid), ticks(pid)
            if a is not None and b is not None:
                used += b - a
        window.cpu_percent[name] = round(100.0 * used / CLK_TCK / wall, 2)
    return window


# ------------------------------------------------------------------------------------ requests


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def _tokens(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(2, 1000) for _ in range(n)]


def make_run(stack, rnd: random.Random, cfg: IdleConfig) -> list[int]:
    """One prefill -> decode request, as the proxy sends it; the decode retains the finished run.
    Returns the run's tokens (prompt and answer)."""
    prompt = _tokens(rnd, cfg.prompt_tokens)
    first = _post(
        f"{stack.prefill.config.url}/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    kv = {k: v for k, v in (first.get("kv_transfer_params") or {}).items() if not k.startswith("kvloop_")}
    answer = _post(
        f"{stack.decodes[0].config.url}/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": cfg.decode_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": kv,
        },
    )
    return prompt + list(answer["choices"][0].get("token_ids") or ())


TPOT_METRIC = "vllm:request_time_per_output_token_seconds"


def _tpot_totals(url: str) -> tuple[float, float]:
    """The decode's own per-request TPOT histogram (sum of seconds, count of requests)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{TPOT_METRIC}_sum":
                total += sample.value
            elif sample.name == f"{TPOT_METRIC}_count":
                count += sample.value
    return total, count


def tpot_ms(url: str, prompt: list[int], tokens: int) -> float:
    """Stream a plain completion (no KV transfer, so nothing is retained); its time per output token
    as the decode measured it (vLLM's request_time_per_output_token, read from its /metrics before
    and after: the time between streamed HTTP chunks is the API server's batching, not the engine's)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,  # random tokens often decode to no text: count token ids
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    sum0, count0 = _tpot_totals(url)
    streamed = 0
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices", []):
                streamed += len(choice.get("token_ids") or ())
    if streamed != tokens:
        raise RuntimeError(f"the decode streamed {streamed} of {tokens} tokens")
    deadline = time.monotonic() + 10
    while True:  # the API server records the request's stats as it finishes it
        sum1, count1 = _tpot_totals(url)
        if count1 > count0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # polling the decode's /metrics
    if count1 != count0 + 1:
        raise RuntimeError(f"{TPOT_METRIC} counted {count1 - count0} requests, expected 1")
    return (sum1 - sum0) * 1e3


def pull_from_resting_decode(stack, run: list[int], rnd: random.Random) -> dict:
    """The next turn of a retained run, prefilled while the decode holding it rests: the prefill
    pulls the run (a one-sided NIXL READ of the resting decode's blocks)."""
    started = time.perf_counter()
    answer = _post(
        f"{stack.prefill.config.url}/v1/completions",
        {
            "model": MODEL,
            "prompt": run + _tokens(rnd, 64),
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    kv = answer.get("kv_transfer_params") or {}
    return {
        "prefill_ms": round((time.perf_counter() - started) * 1e3, 1),
        "path": kv.get("kvloop_path", ""),
        "reason": kv.get("kvloop_reason", ""),
        "pulled_tokens": kv.get("kvloop_pulled_tokens", 0),
        "prompt_tokens": len(run) + 64,
    }


def measure_tpot(stack, rnd: random.Random, cfg: IdleConfig) -> list[float]:
    url = stack.decodes[0].config.url
    return [round(tpot_ms(url, _tokens(rnd, 64), cfg.tpot_tokens), 3) for _ in range(cfg.tpot_repeats)]


# ------------------------------------------------------------------------------------ the bench


def run_idle_bench(cfg: IdleConfig, progress: Callable[[str], None] = lambda line: None) -> dict:
    from kvloop.clients.fleet.stack import Stack, StackConfig

    cfg.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_llama(cfg.workdir / "model")
    stack = Stack(
        StackConfig(
            model_dir=model_dir,
            workdir=cfg.workdir,
            decode_servers=1,
            mode=cfg.mode,
            retention_ttl_s=cfg.retention_ttl_s,
            with_proxy=False,
        )
    )
    rnd = random.Random(cfg.seed)
    windows: list[Window] = []
    tpot: dict[int, list[float]] = {}
    runs: list[list[int]] = []
    pull: dict = {}
    try:
        stack.start(lambda what, state: progress(f"{what}: {state}"))
        # warm both servers with plain requests (nothing retained): first-request setup off the clock
        for engine in stack.engines:
            _post(
                f"{engine.config.url}/v1/completions",
                {"model": MODEL, "prompt": _tokens(rnd, 64), "max_tokens": 4},
            )
        measure_tpot(stack, rnd, IdleConfig(workdir=cfg.workdir, tpot_repeats=1))
        for n in sorted(set(cfg.runs)):
            while len(runs) < n:
                runs.append(make_run(stack, rnd, cfg))
            if cfg.mode == "kvloop" and n and not stack.wait_retained(n, timeout_s=30):
                progress(f"warning: the directory does not list {n} retained runs")
            time.sleep(cfg.settle_s)  # let the last request's steps, events and exports finish
            progress(f"{n} retained runs: measuring {cfg.window_s:.0f} s at rest")
            window = measure_idle(stack, n, cfg.window_s)
            windows.append(window)
            progress(
                f"{n} retained runs: decode {window.total('decode')}%, prefill {window.total('prefill')}%, "
                f"all {window.total()}% of one core"
            )
            if n in (min(cfg.runs), max(cfg.runs)) and n not in tpot:
                tpot[n] = measure_tpot(stack, rnd, cfg)
                progress(f"{n} retained runs: decode TPOT {statistics.median(tpot[n]):.2f} ms (median)")
        if runs and cfg.mode == "kvloop":
            time.sleep(cfg.settle_s)  # the decode at rest again
            pull = pull_from_resting_decode(stack, runs[0], rnd)
            progress(f"next turn of a run held by the resting decode: {pull}")
    finally:
        stack.stop()
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "windows": [
            {**asdict(w), "decode": w.total("decode"), "prefill": w.total("prefill"), "all": w.total()}
            for w in windows
        ],
        "pull_from_resting_decode": pull,
        "tpot_ms": {
            str(n): {"samples": s, "median": round(statistics.median(s), 3)} for n, s in tpot.items()
        },
    }
