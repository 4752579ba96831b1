"""`kvloop bench multiturn`'s arms as HTTP clients: one that orchestrates a prefill -> decode pair
itself (recompute, builtin, kvloop, and the local reference), one that sends each turn to the arm's
own `kvloop proxy` (the routing bench); and what they read from the engines (vLLM's metrics, CPU time)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from kvloop.clients.bench.multiturn.setup import FLOOR_ARM, MODEL, Session
from kvloop.clients.bench.steps import Stream

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvloop.agents.engine import Engine
    from kvloop.clients.fleet.stack import Stack


# Read from each arm's prefill engine (vLLM's Prometheus metrics), the same source in every arm:
# - NIXL histograms (KV-connector metrics): bytes moved and READ time, like for like in both pulling arms;
# - request phases, where a turn's time goes inside the engine: waiting (for kvloop and builtin that
#   includes the lookup and the READ), prefill compute (first scheduled -> first token), and arrival ->
#   finish. What the client measured beyond that is outside the engine (HTTP, chat template, tokenizer).
ENGINE_SERIES = {
    "vllm:nixl_bytes_transferred_sum": "bytes",
    "vllm:nixl_xfer_time_seconds_sum": "xfer_s",
    "vllm:nixl_xfer_time_seconds_count": "reads",
    "vllm:request_queue_time_seconds_sum": "queue_s",
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:e2e_request_latency_seconds_sum": "e2e_s",
    "vllm:e2e_request_latency_seconds_count": "requests",
}
# Read from each arm's decode engine: its time per output token (vLLM's own per-request figure), to
# compare a decode that retains runs and serves READs (kvloop, builtin) with one that does not.
DECODE_SERIES = {
    "vllm:request_time_per_output_token_seconds_sum": "decode_tpot_s",
    "vllm:request_time_per_output_token_seconds_count": "decode_requests",
    # tokens per engine step: a decode's mean batch, which TPOT grows with on a CPU
    "vllm:iteration_tokens_total_sum": "decode_step_tokens",
    "vllm:iteration_tokens_total_count": "decode_steps",
}


CPU_ROLES = ("prefill", "decode", "sidecars", "kvloopd")


def stack_processes(stack: Stack) -> list[tuple[str, subprocess.Popen]]:
    """(role, process) of every process of a stack the benchmark counts CPU time of."""
    processes = [("kvloopd", stack.daemon)] if stack.daemon else []
    for role, engine in [("prefill", stack.prefill)] + [("decode", d) for d in stack.decodes]:
        if engine.vllm is not None:
            processes.append((role, engine.vllm))
        if engine.agent is not None:
            processes.append(("sidecars", engine.agent))
    return processes


def engine_totals(exposition: str, series: dict[str, str] = ENGINE_SERIES) -> dict[str, float]:
    """The `series` sums and counts in a vLLM /metrics page, summed over its engines."""
    totals = dict.fromkeys(series.values(), 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in series:
                totals[series[sample.name]] += sample.value
    return totals


@dataclass
class StreamedAnswer:
    content: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    tpot_ms: float | None  # (last token - first token) / (tokens - 1); None below two tokens
    stream: Stream | None = None  # each chunk's arrival, for the steps it times
    headers: dict[str, str] = field(default_factory=dict)  # the response's, names in lower case


def new_trace_context() -> tuple[str, dict[str, str]]:
    """A fresh sampled W3C trace context: the trace id, and the header that makes a request's spans
    (the proxy's, vLLM's, the connector's, kvloopd's) part of that trace."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return trace_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def _stream_chat(
    url: str, body: dict, timeout: float = 600, headers: dict[str, str] | None = None
) -> StreamedAnswer:
    """A streamed chat completion: its answer, and its time per output token from the arrival of each
    chunk's tokens (vLLM sends one chunk per engine step, with that step's token ids)."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    content: list[str] = []
    token_ids: list[int] = []
    prompt_ids: list[int] = []
    stream = Stream(sent=time.perf_counter(), where=url)
    with urllib.request.urlopen(request, timeout=timeout) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[5:])
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            tokens = 0
            for choice in chunk.get("choices") or []:
                content.append((choice.get("delta") or {}).get("content") or "")
                ids = choice.get("token_ids") or []
                token_ids += ids
                tokens += len(ids)
            if tokens:
                stream.times.append(now)
                stream.tokens.append(tokens)
    # the first chunk's token is the first token: the steps after it are what TPOT measures
    tpot = stream.tpot_ms() if stream.times else None
    return StreamedAnswer("".join(content), token_ids, prompt_ids, tpot, stream, headers)


def _post(url: str, body: dict, timeout: float = 600, headers: dict[str, str] | None = None) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class TurnOutcome:
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    path: str
    answer: str
    # What the decode computed KV for (prompt + generated tokens but the last): what it retains.
    computed_ids: list[int]
    prompt_ids: list[int]
    lookup_ms: float | None = None
    pull_ms: float | None = None
    decode_tpot_ms: float | None = None
    prefill_worker: str | None = None
    route: str | None = None
    route_ms: float | None = None
    decode_stream: Stream | None = None
    tier: str | None = None
    prefill_leg_ms: float | None = None
    burst_wait_ms: float | None = None
    trace_id: str | None = None


class ArmClient:
    """Prefill -> decode orchestration for one arm (the builtin arm caches reverse handles)."""

    def __init__(
        self,
        arm: str,
        prefill_url: str,
        decode_url: str,
        processes: list[tuple[str, subprocess.Popen]] | None = None,
        traced: bool = False,
        stream_decodes: bool = True,
        engines: list[Engine] | None = None,
        settle: Callable[[list[Session]], None] | None = None,
    ) -> None:
        self.arm = arm
        # the decode leg streamed, or answered whole (MultiturnConfig.stream_decodes); builtin's is whole
        self.stream_decodes = stream_decodes
        # the arm's own engines, paused while other arms take their turns (pause_other_arms), and
        # what waits, after a turn, until what the turn left is in place (a kvloop decode's runs announced)
        self.engines = engines or []
        self._settle = settle
        self.processes = processes or []
        # each turn a trace of its own (its prefill and decode requests carry its traceparent)
        self.traced = traced
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.handles: dict[int, dict] = {}
        # Token sequences this arm's decode has computed KV for: per session the latest (the builtin
        # handle's), and all of them (any may be a kvloop holder's).
        self.latest: dict[int, list[int]] = {}
        self.computed: list[list[int]] = []

    def pause(self, paused: bool) -> None:
        for engine in self.engines:
            engine.pause(paused)

    def settle(self, sessions: list[Session]) -> None:
        if self._settle is not None:
            self._settle(sessions)

    def forget(self) -> None:
        """Drop what earlier (warm-up) turns left: handles and the sequences pulls may come from."""
        self.handles.clear()
        self.latest.clear()
        self.computed.clear()

    def engine_totals(self) -> dict[str, float]:
        """ENGINE_SERIES of this arm's prefill engine, DECODE_SERIES of its decode engine and the CPU
        seconds of the arm's processes."""

        def page(url: str) -> str:
            return urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()

        totals = engine_totals(page(self.prefill_url))
        if self.decode_url:  # the local arm has no decode engine: its one engine stops at the first token
            totals.update(engine_totals(page(self.decode_url), DECODE_SERIES))
        totals.update({f"cpu_{role}_s": seconds for role, seconds in self.cpu_seconds().items()})
        return totals

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each process of this arm's stack has used so far: on a host with
        few cores, what one process spends (a sidecar ingesting events, kvloopd answering) the decode
        cannot; read per workload, these show where a TPOT difference goes."""
        import psutil  # the bench extra's; the CLI imports this module without it

        totals = dict.fromkeys(CPU_ROLES, 0.0)
        for role, proc in self.processes:
            try:
                top = psutil.Process(proc.pid)
                for p in [top, *top.children(recursive=True)]:
                    times = p.cpu_times()
                    totals[role] += times.user + times.system
            except psutil.Error:  # gone: counts nothing from now on
                continue
        return totals

    def sources(self, session: Session) -> list[list[int]]:
        """What a pull for this conversation (session) may legitimately have read from."""
        if self.arm == "builtin":
            return [self.latest[session.seed]] if session.seed in self.latest else []
        return self.computed

    def turn(self, session: Session, max_tokens: int) -> TurnOutcome:
        if self.arm == FLOOR_ARM:
            return self._local_turn(session)
        kv: dict = {"do_remote_decode": True}
        if self.arm == "builtin":
            kv.update(self.handles.pop(session.seed, {}))  # single use, like vLLM's proxy
        body = {"model": MODEL, "messages": session.messages, "temperature": 0.0, "return_token_ids": True}
        trace_id, headers = new_trace_context() if self.traced else (None, {})
        t0 = time.perf_counter()
        pre = _post(
            f"{self.prefill_url}/v1/chat/completions",
            {**body, "max_tokens": 1, "max_completion_tokens": 1, "kv_transfer_params": kv},
            headers=headers,
        )
        ttft = (time.perf_counter() - t0) * 1e3
        details = (pre.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or 0
        prompt_tokens = (pre.get("usage") or {}).get("prompt_tokens", 0)
        params = pre.get("kv_transfer_params") or {}
        path = params.get("kvloop_path") or ("transfer" if cached else "recompute")
        decode_body = {**body, "max_tokens": max_tokens, "kv_transfer_params": params}
        prompt_ids = list(pre.get("prompt_token_ids") or [])
        tpot = None
        decode_stream = None
        if self.arm == "builtin" or not self.stream_decodes:
            # vLLM returns the decode's retention handle only in a whole (not streamed) response
            dec = _post(f"{self.decode_url}/v1/chat/completions", decode_body, headers=headers)
            choice = dec["choices"][0]
            answer = choice["message"]["content"] or ""
            if self.arm == "builtin" and dec.get("kv_transfer_params"):
                self.handles[session.seed] = dec["kv_transfer_params"]
            decode_prompt = list(dec.get("prompt_token_ids") or prompt_ids)
            answer_ids = list(choice.get("token_ids") or [])
        else:
            streamed = _stream_chat(f"{self.decode_url}/v1/chat/completions", decode_body, headers=headers)
            answer, answer_ids, tpot = streamed.content, streamed.token_ids, streamed.tpot_ms
            decode_stream = streamed.stream
            decode_prompt = streamed.prompt_token_ids or prompt_ids
        computed = decode_prompt + answer_ids[:-1]
        return TurnOutcome(
            ttft,
            prompt_tokens,
            cached,
            path,
            answer,
            computed,
            prompt_ids,
            params.get("kvloop_lookup_ms"),
            params.get("kvloop_pull_ms"),
            tpot,
            decode_stream=decode_stream,
            tier=params.get("kvloop_tier") or None,
            trace_id=trace_id,
        )

    def _local_turn(self, session: Session) -> TurnOutcome:
        """The first token from an engine that kept every earlier prompt in its own prefix cache. The
        reference answer is appended to the history as in every arm, so only the first token is needed."""
        body = {
            "model": MODEL,
            "messages": session.messages,
            "temperature": 0.0,
            "return_token_ids": True,
            "max_tokens": 1,
            "max_completion_tokens": 1,
        }
        t0 = time.perf_counter()
        out = _post(f"{self.prefill_url}/v1/chat/completions", body)
        ttft = (time.perf_counter() - t0) * 1e3
        usage = out.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        prompt_ids = list(out.get("prompt_token_ids") or [])
        return TurnOutcome(
            ttft,
            usage.get("prompt_tokens", 0),
            cached,
            "local_hit" if cached else "recompute",
            "",
            prompt_ids,
            prompt_ids,
        )


def _header_ms(headers: dict[str, str], name: str) -> float | None:
    value = headers.get(name)
    return float(value) if value else None


class ProxiedArmClient(ArmClient):
    """One arm of the routing bench: its sessions' turns go to the arm's own `kvloop proxy`, which
    chooses the prefill (by its routing options), runs the prefill leg and streams the answer from a
    decode. Every arm's requests carry the arm's own cache_salt: the fleet is shared, the caches are not."""

    def __init__(self, arm: str, proxy_url: str, traced: bool = False) -> None:
        super().__init__(arm, "", "", traced=traced)
        self.proxy_url = proxy_url
        self.salt = f"kvloop-bench-{arm}"

    def engine_totals(self) -> dict[str, float]:
        return {}  # every arm runs on the same engines: their counters cannot be told apart per arm

    def turn(self, session: Session, max_tokens: int) -> TurnOutcome:
        trace_id, trace_headers = new_trace_context() if self.traced else (None, {})
        streamed = _stream_chat(
            f"{self.proxy_url}/v1/chat/completions",
            {
                "model": MODEL,
                "messages": session.messages,
                "temperature": 0.0,
                "return_token_ids": True,
                "cache_salt": self.salt,
                "max_tokens": max_tokens,
            },
            headers=trace_headers,
        )
        stream, headers = streamed.stream, streamed.headers
        if stream is None or not stream.times:
            raise RuntimeError(f"{self.arm}: the proxy streamed no token (headers {headers})")
        # The decode that streamed it: a step holds only the streams of its own engine.
        stream.where = headers.get("x-kvloop-decode", stream.where)
        # What the prefill did not compute: its own prefix-cache hits and what it pulled (the
        # connector's counts, as vLLM's cached_tokens gives them to a direct client).
        cached = sum(int(headers.get(f"x-kvloop-{kind}-tokens") or 0) for kind in ("local", "pulled"))
        prompt_ids = streamed.prompt_token_ids
        return TurnOutcome(
            (stream.first - stream.sent) * 1e3,
            len(prompt_ids),
            cached,
            headers.get("x-kvloop-path") or "unknown",
            streamed.content,
            prompt_ids + streamed.token_ids[:-1],
            prompt_ids,
            _header_ms(headers, "x-kvloop-lookup-ms"),
            _header_ms(headers, "x-kvloop-pull-ms"),
            streamed.tpot_ms,
            headers.get("x-kvloop-prefill"),
            headers.get("x-kvloop-route"),
            _header_ms(headers, "x-kvloop-route-ms"),
            decode_stream=stream,
            tier=headers.get("x-kvloop-tier") or None,
            prefill_leg_ms=_header_ms(headers, "x-kvloop-prefill-ms"),
            burst_wait_ms=_header_ms(headers, "x-kvloop-burst-wait-ms"),
            trace_id=trace_id,
        )


def wait_tokenizer_loaded(proxy_url: str, timeout_s: float = 300.0) -> None:
    """Wait until a routing proxy has loaded the model's tokenizer (it loads in the background, and
    until then the prefills tokenize for Route): measured turns must not pay for the start-up."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{proxy_url}/health", timeout=10) as r:
            state = json.loads(r.read()).get("tokenizers", {}).get(MODEL, "")
        if state.startswith("loaded"):
            return
        if state == "server":
            raise RuntimeError(f"{proxy_url} could not load the model's tokenizer (see its log)")
        time.sleep(0.5)  # polling the proxy's health while it loads
    raise TimeoutError(f"{proxy_url} has not loaded the tokenizer after {timeout_s:.0f}s: {state!r}")
