"""`kvloop bench proxy-load`: many concurrent streaming clients that hang up at random points, through
`kvloop proxy` in front of real `vllm serve` engines; afterwards no upstream request may still run.

The upstream is the smallest real served stack this project has (`clients/fleet/stack.py`): kvloopd,
one prefill and one decode `vllm serve` with the kvloop connector and their sidecars, the tiny
random-weight Llama, and the proxy. Each client loops for the duration: a chat completion with
``stream: true`` and a random output length; about ``disconnect_fraction`` of them hang up, half of
those before the first byte (the proxy is still in the prefill step or the decode's first token),
half after a random number of chunks. After the clients are gone the engines' own gauges
(``vllm:num_requests_running`` + ``vllm:num_requests_waiting``) must fall to 0, and the proxy's
per-backend in-flight counters with them. The proxy's resident memory is sampled every second.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import psutil

from kvloop.clients.bench.common import percentile

MODEL = "kvloop-tiny"
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class ProxyLoadConfig:
    clients: int = 64
    duration_s: float = 60.0
    disconnect_fraction: float = 0.5
    max_tokens: tuple[int, int] = (16, 128)
    prompt_words: tuple[int, int] = (20, 200)
    seed: int = 1
    # Time the engines get to drop every request once the clients are gone.
    drain_timeout_s: float = 30.0


async def upstream_requests(session: aiohttp.ClientSession, engine_urls: list[str]) -> dict[str, float]:
    """Requests each engine is running or has queued, from its own Prometheus gauges."""
    out = {}
    for url in engine_urls:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
        out[url] = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(_GAUGES)
        )
    return out


async def proxy_in_flight(session: aiohttp.ClientSession, proxy_url: str) -> int:
    async with session.get(f"{proxy_url}/health") as r:
        health = await r.json()
    return sum(b["in_flight"] for role in ("prefill", "decode") for b in health.get(role, []))


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> aiohttp.ClientResponse:
    return await session.post(url, json=body)


async def _client(
    n: int, config: ProxyLoadConfig, proxy_url: str, stop: asyncio.Event, outcomes: Counter, ttft: list
) -> None:
    from kvloop.clients.fleet.model import random_text

    rng = random.Random(config.seed * 1000 + n)
    timeout = aiohttp.ClientTimeout(total=300)
    turn = 0
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            turn += 1
            body = {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": random_text(rng.randint(*config.prompt_words), n * 7919 + turn),
                    }
                ],
                "max_tokens": rng.randint(*config.max_tokens),
                "ignore_eos": True,
                "stream": True,
            }
            hang_up = rng.random() < config.disconnect_fraction
            early = hang_up and rng.random() < 0.5
            after_chunks = rng.randint(1, 20)
            started = time.perf_counter()
            request = asyncio.create_task(_post(session, f"{proxy_url}/v1/chat/completions", body))
            if early:
                # Hang up before the first byte: the proxy is in the prefill step or awaiting the decode.
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                if not request.done():
                    request.cancel()
                    await asyncio.gather(request, return_exceptions=True)
                    outcomes["hung_up_before_first_byte"] += 1
                    continue
            try:
                response = await request
            except aiohttp.ClientError as exc:
                outcomes[f"error:{type(exc).__name__}"] += 1
                continue
            if response.status != 200:
                outcomes[f"http_{response.status}"] += 1
                response.release()
                continue
            chunks = 0
            try:
                async for _ in response.content.iter_any():
                    if chunks == 0:
                        ttft.append((time.perf_counter() - started) * 1000)
                    chunks += 1
                    if hang_up and chunks >= after_chunks:
                        break
            except aiohttp.ClientError as exc:
                outcomes[f"error:{type(exc).__name__}"] += 1
                response.close()
                continue
            if hang_up and chunks >= after_chunks:
                response.close()  # drops the connection mid-stream
                outcomes["hung_up_mid_stream"] += 1
            else:
                response.release()
                outcomes["completed"] += 1


async def load_proxy(
    config: ProxyLoadConfig,
    proxy_url: str,
    engine_urls: list[str],
    proxy_pid: int,
    progress: Callable[[dict], None],
) -> dict:
    stop = asyncio.Event()
    outcomes: Counter[str] = Counter()
    ttft: list[float] = []
    proxy = psutil.Process(proxy_pid)
    rss: list[tuple[float, float]] = []
    peak_upstream = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as probe:
        clients = [
            asyncio.create_task(_client(n, config, proxy_url, stop, outcomes, ttft))
            for n in range(config.clients)
        ]
        started = time.perf_counter()
        while time.perf_counter() - started < config.duration_s:
            rss.append((round(time.perf_counter() - started, 1), proxy.memory_info().rss / 2**20))
            running = await upstream_requests(probe, engine_urls)
            peak_upstream = max(peak_upstream, sum(running.values()))
            progress(
                {"elapsed": time.perf_counter() - started, "outcomes": dict(outcomes), "draining": False}
            )
            await asyncio.sleep(1.0)  # the sampling period
        stop.set()
        # The clients leave now, mid-request: every one still waiting or streaming hangs up.
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        left_at = time.perf_counter()
        progress({"elapsed": left_at - started, "outcomes": dict(outcomes), "draining": True})
        drained_s = None
        while time.perf_counter() - left_at < config.drain_timeout_s:
            running = await upstream_requests(probe, engine_urls)
            in_flight = await proxy_in_flight(probe, proxy_url)
            if sum(running.values()) == 0 and in_flight == 0:
                drained_s = round(time.perf_counter() - left_at, 2)
                break
            await asyncio.sleep(0.2)  # polling the engines' gauges
        running = await upstream_requests(probe, engine_urls)
        in_flight = await proxy_in_flight(probe, proxy_url)
        rss.append((round(time.perf_counter() - started, 1), proxy.memory_info().rss / 2**20))
    half = [m for t, m in rss if t >= rss[-1][0] / 2]
    hung_up = outcomes["hung_up_before_first_byte"] + outcomes["hung_up_mid_stream"]
    errors = {k: v for k, v in outcomes.items() if k.startswith(("error", "http_"))}
    return {
        "upstream_requests_left_running": sum(running.values()),
        "proxy_in_flight_left": in_flight,
        "upstream_drained_after_s": drained_s,
        "config": asdict(config),
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "hung_up": hung_up,
        "errors": sum(errors.values()),
        "upstream_requests_peak": peak_upstream,
        "ttft_p50_ms": round(percentile(ttft, 0.5), 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 0.99), 1) if ttft else None,
        "proxy_rss_mib": [(t, round(m, 1)) for t, m in rss],
        "proxy_rss_growth_last_half_percent": round((max(half) - half[0]) / half[0] * 100, 2)
        if len(half) > 1
        else None,
        "proxy_cpu_percent_of_one_core": None,
    }


def run_proxy_load(
    config: ProxyLoadConfig, workdir: Path | None = None, progress: Callable[[dict], None] = lambda s: None
) -> dict:
    """Start the served stack (kvloopd, prefill + decode `vllm serve`, sidecars, proxy), load it, stop it."""
    from kvloop.clients.fleet.model import build_tiny_llama
    from kvloop.clients.fleet.stack import Stack, StackConfig

    with tempfile.TemporaryDirectory(prefix="kvloop-proxy-load-") as tmp:
        base = workdir or Path(tmp)
        model = build_tiny_llama(base / "model")
        stack = Stack(StackConfig(model_dir=model, workdir=base, decode_servers=1, kv_cache_gib=1))
        try:
            progress({"starting": True})
            stack.start()
            assert stack.proxy is not None
            proxy = psutil.Process(stack.proxy.pid)
            cpu0 = sum(proxy.cpu_times()[:2])
            t0 = time.perf_counter()
            engines = [stack.prefill.config.url, *(d.config.url for d in stack.decodes)]
            result = asyncio.run(load_proxy(config, stack.proxy_url, engines, stack.proxy.pid, progress))
            result["proxy_cpu_percent_of_one_core"] = round(
                (sum(proxy.cpu_times()[:2]) - cpu0) / (time.perf_counter() - t0) * 100, 1
            )
            result["upstream"] = "kvloopd + prefill and decode `vllm serve` (tiny random-weight Llama, CPU)"
            return result
        finally:
            stack.stop()
