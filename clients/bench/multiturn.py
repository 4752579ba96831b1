"""`kvloop bench multiturn`: continuation-turn latency of three arms side by side, on real engines.

Arms (same model, histories, tool outputs and order; interleaved turn by turn):
- recompute: disaggregated prefill/decode without reverse transfer;
- builtin: vLLM's NixlConnector reverse mode (`bidirectional_kv_xfer`), the reverse handle returned by
  the decode cached per conversation and passed to the next prefill, as vLLM's proxy does;
- kvloop: the directory (the prefill's connector looks the prompt's block hashes up in kvloopd);
- local (a reference, not a contender): one engine with prefix caching on that never lost its cache, so
  each turn computes only what is new. No transfer scheme can beat it; kvloop's distance to it is what
  moving the KV costs, and its ratio to recompute is the floor the workload allows.

Each arm has its own prefill + decode `vllm serve` pair; the bench orchestrates prefill -> decode itself
so that all arms are timed the same way: TTFT is the prefill request's latency (the disaggregated first
token, including any KV pull), measured per turn.

The routing bench (more than one prefill or decode) runs the product instead: one shared fleet, and
per arm a `kvloop proxy` process with that arm's routing options (ROUTING_PROXY_OPTIONS) in front of
all its engines. Each arm's sessions send streamed chat requests to their proxy, and a turn's TTFT is
the time to the first token the client receives; the proxy's `x-kvloop-*` headers say how it chose
the prefill and what the prefill's connector did.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from kvloop.clients.bench.steps import Stream, equal_batch, step_gaps, weighted_ratio
from kvloop.clients.fleet.model import REASONING_CHAT_TEMPLATE, WORDS, build_tiny_llama
from kvloop.common.tokens import agreeing_prefix_length

if TYPE_CHECKING:
    from kvloop.clients.fleet.stack import Stack

ARMS = ("recompute", "builtin", "kvloop", "local")
# The routing bench (--prefills / --decodes > 1): one fleet shared by every arm, each arm's requests
# under a cache_salt of its own (same tokens and compute, no cache hit across arms), each arm's
# requests through a `kvloop proxy` of its own started with these options:
# - kvloop: kvloopd's Route picks the prefill (own cache + the pull it would add + queue), then pulls;
# - load_pull: the least-loaded prefill (the proxy without Route), then pulls;
# - prefix_route: the prefill with the longest own prefix (what llm-d's and Dynamo's routers do), no pull;
# - recompute: the least-loaded prefill, no pull (its own prefix cache hits only by chance).
ROUTING_PROXY_OPTIONS = {
    "kvloop": ["--route"],
    "load_pull": ["--no-route"],
    "prefix_route": ["--route", "--route-by", "prefix", "--no-pull"],
    "recompute": ["--no-route", "--no-pull"],
}
ROUTING_ARMS = tuple(ROUTING_PROXY_OPTIONS)
ROUTING_PAIRED_RATIOS = (("kvloop", "load_pull"), ("kvloop", "prefix_route"), ("kvloop", "recompute"))
# reasoning: every answer is the model's thinking plus a short visible answer, and the chat template
# drops earlier turns' thinking (REASONING_CHAT_TEMPLATE): the next prompt departs from the decode's
# retained run where its thinking began.
WORKLOADS = ("plain", "shared_prefix", "edited", "reasoning")
# What runs when no --workload is given.
DEFAULT_WORKLOADS = ("plain", "shared_prefix", "edited")
# The ideal reference arm: its prefill keeps its own prefix cache (no disaggregation, no cache loss).
FLOOR_ARM = "local"
# kvloop with a host retention pool on the decode (--host-retention-gib): asked for by name.
HOST_ARM = "kvloop_host"
MODEL = "kvloop-tiny"
# Paired per-turn ratios reported (numerator arm, denominator arm): same prompt, adjacent in time.
PAIRED_RATIOS = (("kvloop", "builtin"), ("kvloop", "local"), ("builtin", "local"))
# The decode's time per output token, same turn in two arms: a decode that retains runs and serves
# READs (kvloop) against one that does neither (recompute).
PAIRED_TPOT_RATIOS = (("kvloop", "recompute"), ("builtin", "recompute"))


@dataclass
class MultiturnConfig:
    workdir: Path
    sessions: int = 4
    turns: int = 10
    concurrency: tuple[int, ...] = (1, 4, 8)
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    arms: tuple[str, ...] = ARMS
    system_tokens: int = 1500
    tool_tokens: int = 600
    # An agent turn's answer: a tool call of a hundred-odd tokens (the replay generator's median is 180).
    # With a few tokens an answer stays within the last block, and a decode holds nothing beyond the
    # prompt a prefill with prefix caching already has.
    answer_tokens: int = 128
    # "words": answers tokenize back to the ids the decode generated, as a real model's mostly do, so
    # the KV of an answer a decode retains can serve the next turn; "bpe": a random-weight model's
    # answers almost never do (see kvloop.clients.fleet.model._save_tokenizer).
    tokenizer: str = "words"
    # How long a decode retains a finished turn's KV: a conversation's next turn comes within a turn of
    # all arms (seconds to tens of seconds). vLLM's retention (the builtin arm) never yields to new runs:
    # with its 480 s the runs of turns long done fill a 1 GiB decode within one workload of 4 sessions,
    # and new requests wait for the oldest leases to end. kvloop's decodes give up their oldest runs
    # past 0.9 of their share (retention_yield), but every arm runs under the same lease.
    retention_ttl_s: float = 90.0
    # kvloop_retention_max_share of the kvloop arms' decodes. Unbounded here, as vLLM's (the builtin
    # arm's) is: this bench bounds retention by its short lease. At the product's 0.5 the 8-session
    # workload reaches the cap near its last turns (1 GiB float32 decodes), and those turns pull older
    # runs: see the README.
    retention_max_share: float = 1.0
    # Each engine's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB), and the host pool of the kvloop_host arm's decode.
    kv_cache_gib: int = 1
    host_retention_gib: float = 0.0
    # past 0.9 of that share, give up the oldest runs for newer ones (kvloop_retention_yield)
    retention_yield: bool = True
    # reasoning workload: tokens the decode generates per turn (all of it thinking the template drops)
    thinking_tokens: int = 128
    repeats: int = 1
    prefill_prefix_caching: bool = False
    # prefill and decode engines compute on cores of their own (see StackConfig.pin_engines)
    pin_engines: bool = False
    hidden_size: int = 384
    layers: int = 4
    seed: int = 1
    quick: bool = False
    block_size: int = 32
    # float32 by default: in bfloat16 the KV a decode computed token by token and the KV a prefill
    # computes in one batch differ by rounding, which flips greedy near-ties of a random-weight model
    # and makes "answers agree with recompute" measure rounding instead of correctness.
    dtype: str = "float32"
    # Throwaway turns per arm before measuring: fresh engines run their first requests much slower
    # (allocator, kernel and cache warm-up), which would land on whichever workload comes first.
    warmup_turns: int = 2
    # More than one of either: the routing bench (ROUTING_ARMS on one shared fleet).
    prefills: int = 1
    decodes: int = 1
    # UCX transports of the pulls (UCX_TLS of every engine). cma (cross-memory attach) moves a pull
    # between two processes of one host at memory speed, so pulling a whole history costs about what
    # choosing where to pull costs; "tcp,self" costs what a pull between hosts over TCP does (20x
    # slower), where a router that pulls less shows what it saves.
    ucx_tls: str = "cma,tcp,self"

    @property
    def routing(self) -> bool:
        return self.prefills > 1 or self.decodes > 1


@dataclass
class TurnSample:
    arm: str
    workload: str
    concurrency: int
    session: int
    turn: int
    prompt_tokens: int
    ttft_ms: float
    cached_tokens: int
    path: str
    answer: str
    repeat: int = 0
    # Pulled blocks whose KV is not what recomputing this prompt would give (see wrong_pulled_blocks).
    wrong_blocks: int = 0
    # kvloop arm: the connector's own timings (directory lookup; lookup answer -> READ complete).
    lookup_ms: float | None = None
    pull_ms: float | None = None
    # The decode's time per output token as the client saw the tokens stream (first -> last token).
    decode_tpot_ms: float | None = None
    # Routing bench, from the arm's proxy: the prefill it chose, how (its x-kvloop-route: route, tie,
    # continuation, prefix, load_<why>, ...), the time choosing took, and the prefill leg as the proxy
    # timed it (choosing included; what ttft_ms was before the routing arms went through the proxy).
    prefill_worker: str | None = None
    route: str | None = None
    route_ms: float | None = None
    prefill_leg_ms: float | None = None
    # how long the request waited for the rest of its burst before it was placed (proxy's burst.py)
    burst_wait_ms: float | None = None
    # This turn's decode steps as [batch, arrival, step ms] (see steps.step_gaps; the batch counts the
    # arm's sessions streaming at the same time): TPOT compared at equal batch.
    decode_steps: list[list] = field(default_factory=list)
    # kvloop arms: where the pulled run lived on its holder ("device" or "host"; None without a pull).
    tier: str | None = None


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


@dataclass
class Session:
    """A seeded agent session: the same text in every arm."""

    seed: int
    messages: list[dict] = field(default_factory=list)

    @staticmethod
    def words(n: int, rnd: random.Random) -> str:
        return " ".join(rnd.choice(WORDS) for _ in range(n))


def build_sessions(workload: str, count: int, config: MultiturnConfig, base_seed: int) -> list[Session]:
    shared = Session.words(config.system_tokens, random.Random(base_seed))
    sessions = []
    for i in range(count):
        rnd = random.Random(base_seed * 1000 + i)
        system = shared if workload == "shared_prefix" else Session.words(config.system_tokens, rnd)
        s = Session(seed=base_seed * 1000 + i)
        s.messages = [
            {"role": "system", "content": "You are an agent. " + system},
            {"role": "user", "content": "Task: " + Session.words(30, rnd)},
        ]
        sessions.append(s)
    return sessions


def session_seed_base(seed: int, workload: str, concurrency: int, repeat: int) -> int:
    """Every (workload, concurrency, repeat) replays conversations of its own. Reusing one would let
    kvloop pull an earlier run's KV (a longer matching prefix than any real continuation has), and
    hand the builtin arm a cached handle of another workload's conversation for a new one."""
    return seed + 101 * concurrency + 7919 * repeat + 104729 * WORKLOADS.index(workload)


def arm_order(arms: Sequence[str], turn: int) -> list[str]:
    """The arms' order in ``turn``: a row of a Williams design. Over len(arms) consecutive turns (twice
    that for an odd number of arms) each arm runs in each position equally often and right after
    each other arm equally often. Rotating one order instead would keep each arm's predecessor fixed
    in all but one turn of the cycle, so the after-effects of one arm's turn (its decode, its
    sidecar's events, freed memory) would always land on the same other arm."""
    n = len(arms)
    sequence = [0]  # 0, 1, n-1, 2, n-2, ...
    low, high = 1, n - 1
    while len(sequence) < n:
        sequence.append(low)
        low += 1
        if len(sequence) < n:
            sequence.append(high)
            high -= 1
    row = [arms[(position + turn) % n] for position in sequence]
    if n % 2 and (turn // n) % 2:
        row.reverse()
    return row


def next_turn_messages(session: Session, answer: str, turn: int, workload: str, tool_tokens: int) -> None:
    rnd = random.Random(session.seed * 100 + turn)
    if workload == "reasoning":
        # The generated text is the turn's thinking; the visible answer follows it. The template
        # renders only the visible part on later turns.
        answer = f"<think>{answer}</think> Answer: {Session.words(12, rnd)}"
    session.messages.append({"role": "assistant", "content": answer})
    session.messages.append({"role": "user", "content": "Tool output: " + Session.words(tool_tokens, rnd)})
    if workload == "edited" and turn % 2 == 0 and len(session.messages) > 4:
        # Drop an earlier reasoning/answer segment: every later token shifts.
        del session.messages[2]


def engine_totals(exposition: str, series: dict[str, str] = ENGINE_SERIES) -> dict[str, float]:
    """The `series` sums and counts in a vLLM /metrics page, summed over its engines."""
    totals = dict.fromkeys(series.values(), 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in series:
                totals[series[sample.name]] += sample.value
    return totals


def wrong_pulled_blocks(held: list[list[int]], prompt: list[int], pulled_tokens: int, block_size: int) -> int:
    """Pulled blocks whose KV differs from what this prompt's own prefill would compute.

    With causal attention the KV at position p is a function of tokens[0..p] alone, so a pulled
    position is right iff the sequence it was computed for (one of ``held``: what the holders had
    computed) agrees with the prompt up to and including p. A block is wrong if any of its pulled
    positions is at or past the longest such agreement."""
    if pulled_tokens <= 0:
        return 0
    common = max((agreeing_prefix_length(sequence, prompt) for sequence in held), default=0)
    if pulled_tokens <= common:
        return 0
    return -(-pulled_tokens // block_size) - common // block_size


@dataclass
class StreamedAnswer:
    content: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    tpot_ms: float | None  # (last token - first token) / (tokens - 1); None below two tokens
    stream: Stream | None = None  # each chunk's arrival, for the steps it times
    headers: dict[str, str] = field(default_factory=dict)  # the response's, names in lower case


def _stream_chat(url: str, body: dict, timeout: float = 600) -> StreamedAnswer:
    """A streamed chat completion: its answer, and its time per output token from the arrival of each
    chunk's tokens (vLLM sends one chunk per engine step, with that step's token ids)."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
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


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
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


class ArmClient:
    """Prefill -> decode orchestration for one arm (the builtin arm caches reverse handles)."""

    def __init__(
        self,
        arm: str,
        prefill_url: str,
        decode_url: str,
        processes: list[tuple[str, subprocess.Popen]] | None = None,
    ) -> None:
        self.arm = arm
        self.processes = processes or []
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.handles: dict[int, dict] = {}
        # Token sequences this arm's decode has computed KV for: per session the latest (the builtin
        # handle's), and all of them (any may be a kvloop holder's).
        self.latest: dict[int, list[int]] = {}
        self.computed: list[list[int]] = []

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
        t0 = time.perf_counter()
        pre = _post(
            f"{self.prefill_url}/v1/chat/completions",
            {**body, "max_tokens": 1, "max_completion_tokens": 1, "kv_transfer_params": kv},
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
        if self.arm == "builtin":
            # vLLM returns the decode's retention handle only in a whole (not streamed) response
            dec = _post(f"{self.decode_url}/v1/chat/completions", decode_body)
            choice = dec["choices"][0]
            answer = choice["message"]["content"] or ""
            if dec.get("kv_transfer_params"):
                self.handles[session.seed] = dec["kv_transfer_params"]
            decode_prompt = list(dec.get("prompt_token_ids") or prompt_ids)
            answer_ids = list(choice.get("token_ids") or [])
        else:
            streamed = _stream_chat(f"{self.decode_url}/v1/chat/completions", decode_body)
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

    def __init__(self, arm: str, proxy_url: str) -> None:
        super().__init__(arm, "", "")
        self.proxy_url = proxy_url
        self.salt = f"kvloop-bench-{arm}"

    def engine_totals(self) -> dict[str, float]:
        return {}  # every arm runs on the same engines: their counters cannot be told apart per arm

    def turn(self, session: Session, max_tokens: int) -> TurnOutcome:
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
        )


def run_workload(
    clients: dict[str, ArmClient],
    workload: str,
    concurrency: int,
    config: MultiturnConfig,
    on_turn,
    repeat: int = 0,
) -> list[TurnSample]:
    """Every arm replays the same sessions turn by turn (interleaved). The history each arm sends next
    is the same in all arms: the reference arm's answer (recompute) is appended everywhere, so every
    turn's prompt is identical across arms and answers can be compared turn by turn."""
    samples: list[TurnSample] = []
    base_seed = session_seed_base(config.seed, workload, concurrency, repeat)
    per_arm = {arm: build_sessions(workload, concurrency, config, base_seed) for arm in clients}
    reference = "recompute" if "recompute" in clients else next(a for a in clients if a != FLOOR_ARM)
    arms = list(clients)
    # shared_prefix: conversations arrive one turn apart, so every later one is a NEW conversation whose
    # long prefix (system prompt, tool schema) another conversation already holds.
    stagger = workload == "shared_prefix"
    for turn in range(1, config.turns + 1):
        answers: dict[str, list[str]] = {}
        active = [i for i in range(concurrency) if not stagger or i < turn]
        # Arms interleaved turn by turn, in an order that changes every turn so that no arm always
        # runs right after another's turn (whose decode and sidecar work may still be winding down).
        order = arm_order(arms, turn)
        for arm in order:
            client = clients[arm]
            sessions = [per_arm[arm][i] for i in active]
            # shared_prefix: the arriving conversation's first turn runs alone, then the others together,
            # so its TTFT shows what its shared prefix saves rather than the other sessions' load.
            arriving = sessions[-1:] if stagger and turn - 1 in active and turn > 1 else []
            max_tokens = config.thinking_tokens if workload == "reasoning" else config.answer_tokens
            results = [client.turn(s, max_tokens) for s in arriving]
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                results = (
                    list(
                        pool.map(
                            client.turn,
                            sessions[: len(sessions) - len(arriving)],
                            [max_tokens] * concurrency,
                        )
                    )
                    + results
                )
            answers[arm] = [r.answer for r in results]
            # Checked once the turn is over: a concurrent session's run may have been the one pulled.
            client.computed.extend(r.computed_ids for r in results)
            streams = [r.decode_stream for r in results if r.decode_stream and r.decode_stream.times]
            for i, session, r in zip(active, sessions, results, strict=False):
                own_turn = turn - i if stagger else turn
                wrong = wrong_pulled_blocks(
                    client.sources(session), r.prompt_ids, r.cached_tokens, config.block_size
                )
                samples.append(
                    TurnSample(
                        arm,
                        workload,
                        concurrency,
                        i,
                        own_turn,
                        r.prompt_tokens,
                        r.ttft_ms,
                        r.cached_tokens,
                        r.path,
                        r.answer,
                        repeat,
                        wrong,
                        r.lookup_ms,
                        r.pull_ms,
                        r.decode_tpot_ms,
                        r.prefill_worker,
                        r.route,
                        r.route_ms,
                        r.prefill_leg_ms,
                        r.burst_wait_ms,
                        decode_steps=decode_steps_of(r.decode_stream, streams),
                        tier=r.tier,
                    )
                )
                client.latest[session.seed] = r.computed_ids
            on_turn()
        for arm in clients:
            for i, answer in zip(active, answers[reference], strict=False):
                session = per_arm[arm][i]
                next_turn_messages(
                    session, answer, turn - i if stagger else turn, workload, config.tool_tokens
                )
    return samples


def decode_steps_of(mine: Stream | None, streams: list[Stream]) -> list[list]:
    """[batch, arrival, step ms] of each step of `mine`, among the streams decoded at the same time."""
    if mine is None or not mine.times:
        return []
    # the routing bench spreads an arm's sessions over several decodes: a step holds only its engine's
    others = [s for s in streams if s is not mine and s.where == mine.where]
    return [
        [g.batch, g.arrival, round(g.step_ms, 3)] for g in step_gaps([mine, *others])[: len(mine.times) - 1]
    ]


def equal_batch_decode_steps(
    samples: list[TurnSample], pairs: tuple[tuple[str, str], ...] = PAIRED_TPOT_RATIOS
) -> list[dict]:
    """Decode step time of one arm over another at the same batch size, steps without an arrival: the
    TPOT comparison with the arrival pattern taken out (arms whose prefills release sessions to the
    decode together or one by one decode in different batches, and a step grows with its batch).
    ``ratio_weighted``: the per-batch ratios weighted by the denominator arm's steps at that batch."""
    steps: dict[tuple[str, int, str, int], list[float]] = {}
    for s in samples:
        for batch, arrival, ms in s.decode_steps:
            if not arrival:
                steps.setdefault((s.workload, s.concurrency, s.arm, batch), []).append(ms)
    out = []
    for workload, concurrency in sorted({(s.workload, s.concurrency) for s in samples}):
        for top, bottom in pairs:

            def arm(name: str, cell: tuple[str, int] = (workload, concurrency)) -> dict[int, list[float]]:
                return {k[3]: v for k, v in steps.items() if k[:3] == (*cell, name)}

            rows = equal_batch(arm(top), arm(bottom))
            if rows:
                out.append(
                    {
                        "workload": workload,
                        "concurrency": concurrency,
                        "ratio": f"{top}/{bottom}",
                        "by_batch": [asdict(r) for r in rows],
                        "ratio_weighted": weighted_ratio(rows),
                    }
                )
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


def context_bucket(prompt_tokens: int) -> int:
    """Context length to the nearest 2K tokens (in K): ~8K covers 7,000-8,999 tokens."""
    return 2 * ((prompt_tokens + 1000) // 2000)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (0.0, 0.0, 0.0)
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(
    samples: list[TurnSample],
    block_size: int,
    transfers: dict[tuple[str, int, str], dict[str, float]] | None = None,
    pairs: tuple[tuple[str, str], ...] = PAIRED_RATIOS,
) -> dict:
    """Continuation turns per (workload, concurrency, arm): TTFT percentiles (and the per-repeat p50s,
    their spread), ratio to recompute, path shares, tokens and blocks pulled (and how many were wrong),
    answer agreement, and from ``transfers`` (ENGINE_SERIES totals measured on each arm's prefill engine)
    bytes moved, READ time and where the time went inside the engine. Also the same TTFTs per context
    length, per-turn paired ratios between arms,
    and the first turns of new conversations that share a long prefix."""
    continuations = [s for s in samples if s.turn > 1]
    groups = _by_cell(continuations)
    all_turns = _by_cell(samples)
    rows = []
    for (workload, concurrency, arm), group in sorted(groups.items()):
        ttfts = [s.ttft_ms for s in group]
        recompute = groups.get((workload, concurrency, "recompute"), [])
        base = statistics.median([s.ttft_ms for s in recompute]) if recompute else None
        reference = {(s.repeat, s.session, s.turn): s.answer for s in recompute}
        agree = [
            s.answer == reference[(s.repeat, s.session, s.turn)]
            for s in group
            if (s.repeat, s.session, s.turn) in reference
        ]
        by_repeat: dict[int, list[float]] = {}
        for s in group:
            by_repeat.setdefault(s.repeat, []).append(s.ttft_ms)
        rows.append(
            {
                "workload": workload,
                "concurrency": concurrency,
                "arm": arm,
                "continuation_turns": len(group),
                "ttft_p50_ms": percentile(ttfts, 0.5),
                "ttft_p90_ms": percentile(ttfts, 0.9),
                # Engine metrics cover every turn of the workload, so the breakdown beside them does too.
                "ttft_mean_all_turns_ms": round(
                    statistics.fmean(x.ttft_ms for x in all_turns[(workload, concurrency, arm)]), 1
                ),
                "ttft_p50_by_repeat_ms": [
                    round(statistics.median(v), 1) for _, v in sorted(by_repeat.items())
                ],
                "ratio_to_recompute_p50": round(statistics.median(ttfts) / base, 3) if base else None,
                "transfer_share": round(sum(s.cached_tokens > 0 for s in group) / len(group), 3),
                "mean_pulled_tokens": round(statistics.fmean(s.cached_tokens for s in group), 1),
                "mean_prompt_tokens": round(statistics.fmean(s.prompt_tokens for s in group), 1),
                # The floor arm stops at the first token: it has no answer to compare.
                "answer_agreement_with_recompute": round(sum(agree) / len(agree), 3)
                if agree and arm != FLOOR_ARM
                else None,
                "pulled_blocks": sum(-(-s.cached_tokens // block_size) for s in group),
                "pulled_tokens_by_tier": _by_tier(group),
                "wrong_pulled_blocks": sum(s.wrong_blocks for s in group),
                "decode_tpot_p50_ms": _median_or_none(
                    [x.decode_tpot_ms for x in all_turns[(workload, concurrency, arm)] if x.decode_tpot_ms]
                ),
                **_transfer_columns((transfers or {}).get((workload, concurrency, arm))),
                **_connector_columns(group),
                **_routing_columns(group),
            }
        )
    return {
        "rows": rows,
        "by_context": _by_context(continuations),
        "paired": _paired(continuations, pairs=pairs),
        # every turn, the first included: the decode generates an answer on each
        "paired_decode_tpot": _paired(samples, "decode_tpot_ms", PAIRED_TPOT_RATIOS),
        "decode_step_at_equal_batch": equal_batch_decode_steps(samples),
        "shared_prefix_new_conversations": _new_conversations(samples),
    }


# What runs being pooled must agree on: the same arms measured the same way.
POOLED_CONFIG_KEYS = (
    "arms",
    "prefills",
    "decodes",
    "block_size",
    "prefill_prefix_caching",
    "answer_tokens",
    "tokenizer",
    "dtype",
    "hidden_size",
    "layers",
    "ucx_tls",
)


def pooled_summary(results: Sequence[dict]) -> dict:
    """One summary of several runs' results JSONs (seeds apart, as ``--repeats`` cannot be on a fleet
    whose retained runs fill the decodes): each run's turns count as a repeat of their own. Runs that
    measured other arms or another setup are refused (ValueError, naming the setting)."""
    if not results:
        raise ValueError("no results to pool")
    first = results[0]["config"]
    for i, result in enumerate(results[1:], 2):
        for key in POOLED_CONFIG_KEYS:
            if result["config"].get(key) != first.get(key):
                raise ValueError(
                    f"run {i} has {key}={result['config'].get(key)!r}, run 1 {first.get(key)!r}: "
                    "only runs of one setup pool"
                )
    names = {f.name for f in fields(TurnSample)}
    samples: list[TurnSample] = []
    offset = 0  # each run's repeats numbered after those of the runs before it
    for result in results:
        run = [TurnSample(**{k: v for k, v in raw.items() if k in names}) for raw in result["samples"]]
        for sample in run:
            sample.repeat += offset
        offset = 1 + max((s.repeat for s in run), default=offset - 1)
        samples += run
    routing = first.get("prefills", 1) > 1 or first.get("decodes", 1) > 1
    return summarize(samples, first["block_size"], pairs=ROUTING_PAIRED_RATIOS if routing else PAIRED_RATIOS)


def _by_tier(group: list[TurnSample]) -> dict[str, int]:
    """Prompt tokens pulled from each tier of the holders (kvloop arms; empty for the others)."""
    out: dict[str, int] = {}
    for s in group:
        if s.tier and s.cached_tokens:
            out[s.tier] = out.get(s.tier, 0) + s.cached_tokens
    return out


def _by_cell(samples: list[TurnSample]) -> dict[tuple[str, int, str], list[TurnSample]]:
    """Samples per (workload, concurrency, arm), in their order."""
    cells: dict[tuple[str, int, str], list[TurnSample]] = {}
    for s in samples:
        cells.setdefault((s.workload, s.concurrency, s.arm), []).append(s)
    return cells


def _by_context(continuations: list[TurnSample]) -> list[dict]:
    """TTFT per (workload, concurrency, arm, context length to the nearest 2K), with the ratio of its
    p50 to recompute's p50 in the same context bucket."""
    cells: dict[tuple, list[float]] = {}
    for s in continuations:
        cells.setdefault((s.workload, s.concurrency, context_bucket(s.prompt_tokens), s.arm), []).append(
            s.ttft_ms
        )
    out = []
    for (workload, concurrency, k, arm), ttfts in sorted(cells.items()):
        base = cells.get((workload, concurrency, k, "recompute"))
        out.append(
            {
                "workload": workload,
                "concurrency": concurrency,
                "context_k": k,
                "arm": arm,
                "turns": len(ttfts),
                "ttft_p50_ms": percentile(ttfts, 0.5),
                "ttft_p90_ms": percentile(ttfts, 0.9),
                "ratio_to_recompute_p50": round(statistics.median(ttfts) / statistics.median(base), 3)
                if base
                else None,
            }
        )
    return out


def median_ci95(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap confidence interval of the median (seeded: the same samples give the same interval)."""
    rnd = random.Random(seed)
    medians = sorted(statistics.median(rnd.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _median_or_none(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _paired(
    samples: list[TurnSample],
    metric: str = "ttft_ms",
    pairs: tuple[tuple[str, str], ...] = PAIRED_RATIOS,
) -> list[dict]:
    """Per-turn ratios of `metric` between two arms on the same turn (same prompt, run within seconds of
    each other): their median and interquartile range are far less noisy than a ratio of two runs'
    p50s, and the median's confidence interval says whether a target such as "<= 1.05x" is met or
    only not excluded."""
    values = {
        (s.workload, s.concurrency, s.repeat, s.session, s.turn, s.arm): getattr(s, metric)
        for s in samples
        if getattr(s, metric)
    }
    out = []
    for workload, concurrency in sorted({(s.workload, s.concurrency) for s in samples}):
        for top, bottom in pairs:
            ratios = [
                values[(*key[:5], top)] / value
                for key, value in values.items()
                if key[:2] == (workload, concurrency) and key[5] == bottom and (*key[:5], top) in values
            ]
            if ratios:
                q1, median, q3 = quartiles(ratios)
                low, high = median_ci95(ratios)
                out.append(
                    {
                        "workload": workload,
                        "concurrency": concurrency,
                        "ratio": f"{top}/{bottom}",
                        "turns": len(ratios),
                        "median": round(median, 3),
                        "q1": round(q1, 3),
                        "q3": round(q3, 3),
                        "median_ci95": [round(low, 3), round(high, 3)],
                    }
                )
    return out


def _new_conversations(samples: list[TurnSample]) -> list[dict]:
    firsts: dict[tuple, list[TurnSample]] = {}
    for s in samples:
        if s.turn == 1 and s.session > 0 and s.workload == "shared_prefix":
            firsts.setdefault((s.concurrency, s.arm), []).append(s)
    return [
        {
            "concurrency": c,
            "arm": arm,
            "first_turns": len(g),
            "ttft_p50_ms": percentile([s.ttft_ms for s in g], 0.5),
            "mean_pulled_tokens": round(statistics.fmean(s.cached_tokens for s in g), 1),
            "mean_prompt_tokens": round(statistics.fmean(s.prompt_tokens for s in g), 1),
            "wrong_pulled_blocks": sum(s.wrong_blocks for s in g),
        }
        for (c, arm), g in sorted(firsts.items())
    ]


def _transfer_columns(totals: dict[str, float] | None) -> dict:
    if not totals:
        return {}
    reads, requests = int(totals["reads"]), int(totals["requests"])
    columns: dict[str, object] = {
        "nixl_reads": reads,
        "bytes_moved_mib": round(totals["bytes"] / 2**20, 1),
        "nixl_read_ms_mean": round(totals["xfer_s"] * 1e3 / reads, 2) if reads else None,
    }
    if requests:
        columns.update(
            {
                f"engine_{phase}_ms_mean": round(totals[f"{phase}_s"] * 1e3 / requests, 1)
                for phase in ("queue", "prefill", "e2e")
            }
        )
    if totals.get("decode_requests"):
        columns["decode_tpot_ms_mean"] = round(totals["decode_tpot_s"] * 1e3 / totals["decode_requests"], 2)
    cpu = {role: totals.get(f"cpu_{role}_s") for role in CPU_ROLES}
    if any(cpu.values()):
        columns["cpu_s"] = {role: round(seconds or 0.0, 2) for role, seconds in cpu.items()}
    if totals.get("decode_steps"):
        columns["decode_batch_mean"] = round(totals["decode_step_tokens"] / totals["decode_steps"], 2)
    return columns


def _connector_columns(group: list[TurnSample]) -> dict:
    lookups = [s.lookup_ms for s in group if s.lookup_ms is not None]
    pulls = [s.pull_ms for s in group if s.pull_ms is not None]
    columns = {}
    if lookups:
        columns["lookup_ms_p50"] = round(statistics.median(lookups), 2)
    if pulls:
        columns["lookup_to_pulled_ms_p50"] = round(statistics.median(pulls), 1)
    return columns


def _routing_columns(group: list[TurnSample]) -> dict:
    """Routing bench: how the arm's proxy chose the prefills, what choosing took, the prefill leg as
    the proxy timed it, and how many turns waited for their burst."""
    routed = [s for s in group if s.route is not None]
    if not routed:
        return {}
    columns: dict[str, object] = {
        "route_outcomes": dict(Counter(s.route for s in routed)),
        "prefills_used": dict(Counter(s.prefill_worker for s in routed)),
        "burst_waits": sum(1 for s in routed if s.burst_wait_ms),
    }
    for name, values in (
        ("route_ms_p50", [s.route_ms for s in routed if s.route_ms is not None]),
        ("prefill_leg_ms_p50", [s.prefill_leg_ms for s in routed if s.prefill_leg_ms is not None]),
    ):
        if values:
            columns[name] = round(statistics.median(values), 2)
    return columns


def plot(samples: list[TurnSample], by_context: list[dict], out: Path) -> list[str]:
    """Two PNGs, a panel per (workload, sessions): TTFT vs context length (each turn a dot, the line through
    each arm's p50 per 2K bucket from the summary's ``by_context``) and the TTFT distribution per arm.
    Log scale: recompute is 5-20x the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _by_cell([s for s in samples if s.turn > 1])
    groups = sorted({(workload, concurrency) for workload, concurrency, _ in cells})
    if not groups:
        return []
    every = tuple(dict.fromkeys(ARMS + ROUTING_ARMS))
    arms = [arm for arm in every if any(a == arm for _, _, a in cells)]
    colors = {arm: f"C{i}" for i, arm in enumerate(every)}
    labels = {arm: f"{arm} (ideal: own cache kept)" if arm == FLOOR_ARM else arm for arm in arms}
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)

    def panels(title: str):
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
        fig.suptitle(title, fontsize="medium")
        for ax in axes.flat[len(groups) :]:
            ax.set_visible(False)
        return fig, list(axes.flat)

    def panel_title(workload: str, concurrency: int) -> str:
        return f"{workload}, {concurrency} session{'s' if concurrency > 1 else ''}"

    paths = []
    fig, axes = panels("Continuation TTFT vs context (dots: turns; line: p50 per 2K tokens)")
    for ax, (workload, concurrency) in zip(axes, groups, strict=False):
        for arm in arms:
            group = cells.get((workload, concurrency, arm))
            if not group:
                continue
            ax.scatter(
                [s.prompt_tokens for s in group],
                [s.ttft_ms for s in group],
                s=10,
                alpha=0.3,
                color=colors[arm],
            )
            line = [
                (c["context_k"] * 1000, c["ttft_p50_ms"])
                for c in by_context
                if (c["workload"], c["concurrency"], c["arm"]) == (workload, concurrency, arm)
            ]
            ax.plot(
                [x for x, _ in line],
                [y for _, y in line],
                "o--" if arm == FLOOR_ARM else "o-",
                color=colors[arm],
                label=labels[arm],
            )
        ax.set_yscale("log")
        ax.set_title(panel_title(workload, concurrency))
        ax.set_xlabel("context length (prompt tokens)")
        ax.set_ylabel("continuation TTFT (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_context.png", dpi=110)
    paths.append(str(out / "ttft_vs_context.png"))

    fig, axes = panels("Continuation TTFT distribution per arm")
    for ax, (workload, concurrency) in zip(axes, groups, strict=False):
        present = [arm for arm in arms if (workload, concurrency, arm) in cells]
        ax.boxplot(
            [[s.ttft_ms for s in cells[(workload, concurrency, arm)]] for arm in present], tick_labels=present
        )
        ax.set_yscale("log")
        ax.set_title(panel_title(workload, concurrency))
        ax.set_ylabel("continuation TTFT (ms)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ttft_distribution.png", dpi=110)
    paths.append(str(out / "ttft_distribution.png"))
    plt.close("all")
    return paths


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


def run_multiturn(config: MultiturnConfig, progress: bool = True) -> dict:
    from rich.progress import Progress

    from kvloop.clients.console import make_console
    from kvloop.clients.fleet.stack import Stack, StackConfig

    config.workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(
        config.workdir / "model",
        hidden_size=config.hidden_size,
        layers=config.layers,
        chat_template=REASONING_CHAT_TEMPLATE,  # renders other workloads' prompts as the plain one
        tokenizer=config.tokenizer,
    )
    stacks = {}
    started = time.monotonic()
    try:
        if config.routing:
            stacks["fleet"] = Stack(
                StackConfig(
                    model_dir=model,
                    workdir=config.workdir / "fleet",
                    kv_cache_gib=config.kv_cache_gib,
                    block_size=config.block_size,
                    dtype=config.dtype,
                    prefill_prefix_caching=config.prefill_prefix_caching,
                    pin_engines=config.pin_engines,
                    mode="kvloop",
                    prefill_servers=config.prefills,
                    decode_servers=config.decodes,
                    retention_ttl_s=config.retention_ttl_s,
                    retention_max_share=config.retention_max_share,
                    retention_yield=config.retention_yield,
                    ucx_tls=config.ucx_tls,
                    with_proxy=False,
                    # four engines starting at once on a small shared host take several minutes
                    start_timeout_s=900,
                )
            )
        for arm in () if config.routing else config.arms:
            floor = arm == FLOOR_ARM
            if arm == HOST_ARM and not config.host_retention_gib:
                raise ValueError(f"the {HOST_ARM} arm needs --host-retention-gib")
            stacks[arm] = Stack(
                StackConfig(
                    model_dir=model,
                    workdir=config.workdir / arm,
                    kv_cache_gib=config.kv_cache_gib,
                    host_retention_gib=config.host_retention_gib if arm == HOST_ARM else 0.0,
                    block_size=config.block_size,
                    dtype=config.dtype,
                    prefill_prefix_caching=floor or config.prefill_prefix_caching,
                    pin_engines=config.pin_engines,
                    mode="recompute" if floor else "kvloop" if arm == HOST_ARM else arm,
                    decode_servers=0 if floor else 1,
                    retention_ttl_s=config.retention_ttl_s,
                    retention_max_share=config.retention_max_share,
                    retention_yield=config.retention_yield,
                    ucx_tls=config.ucx_tls,
                    with_proxy=False,
                )
            )
        # On stderr: stdout keeps the results (a table, or the JSON with --json).
        with Progress(disable=not progress, transient=True, console=make_console(stderr=True)) as bar:
            task = bar.add_task(f"starting {len(stacks)} arms' engines", total=None)

            def say(text: str) -> None:
                bar.update(task, description=text)
                if progress and not bar.console.is_terminal:  # a log file gets a line per stage instead
                    bar.console.print(f"[{time.monotonic() - started:5.0f}s] {text}")

            for arm, stack in stacks.items():
                stack.start(lambda what, state, arm=arm: say(f"{arm}: {what} {state}"))
            clients: dict[str, ArmClient] = {
                arm: ArmClient(
                    arm,
                    s.prefill.config.url,
                    s.decodes[0].config.url if s.decodes else "",
                    stack_processes(s),
                )
                for arm, s in stacks.items()
                if not config.routing
            }
            if config.routing:
                fleet = stacks["fleet"]
                for arm in config.arms:
                    url = fleet.start_proxy(
                        f"proxy-{arm}",
                        ROUTING_PROXY_OPTIONS[arm],
                        lambda what, state: say(f"{what}: {state}"),
                    )
                    if "--route" in ROUTING_PROXY_OPTIONS[arm]:
                        say(f"proxy-{arm}: loading the model's tokenizer")
                        wait_tokenizer_loaded(url)
                    clients[arm] = ProxiedArmClient(arm, url)
            turns_in_all = (
                len(config.workloads) * len(config.concurrency) * config.turns * len(clients) * config.repeats
            )
            if config.warmup_turns:
                say(f"warm-up: {config.warmup_turns} turns per arm, not measured")
                warmup = MultiturnConfig(**{**asdict(config), "turns": config.warmup_turns})
                run_workload(clients, "plain", 1, warmup, lambda: None, repeat=-1)
                for client in clients.values():
                    client.forget()
            bar.update(task, total=turns_in_all, completed=0)
            samples: list[TurnSample] = []
            transfers: dict[tuple[str, int, str], dict[str, float]] = {}
            for repeat in range(config.repeats):
                for workload in config.workloads:
                    for concurrency in config.concurrency:
                        say(
                            f"repeat {repeat + 1}/{config.repeats}: {workload}, {concurrency} session(s), "
                            f"{config.turns} turns x {len(clients)} arms "
                            f"({int(bar.tasks[0].completed)}/{turns_in_all} arm-turns done)"
                        )
                        before = {arm: c.engine_totals() for arm, c in clients.items()}
                        samples += run_workload(
                            clients, workload, concurrency, config, lambda: bar.advance(task), repeat
                        )
                        for arm, c in clients.items():
                            totals = transfers.setdefault(
                                (workload, concurrency, arm), dict.fromkeys(before[arm], 0.0)
                            )
                            for key, value in c.engine_totals().items():
                                totals[key] += value - before[arm][key]
            say(f"all {turns_in_all} arm-turns done")
        summary = summarize(
            samples, config.block_size, transfers, ROUTING_PAIRED_RATIOS if config.routing else PAIRED_RATIOS
        )
        result = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
            "summary": summary,
            "samples": [asdict(s) for s in samples],
            "engine_start_s": {
                arm: [round(e.started_s or 0, 1) for e in s.engines] for arm, s in stacks.items()
            },
            "wall_s": round(time.monotonic() - started, 1),
        }
        result["plots"] = plot(samples, summary["by_context"], config.workdir)
        return result
    finally:
        for stack in stacks.values():
            stack.stop()
