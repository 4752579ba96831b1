"""`kvloop bench chaos`: faults while conversations flow, every answer checked against a recompute.

The served stack (kvloopd, or with ``--store redis`` two kvloopd replicas over a Redis primary, its
replica and three Sentinels; a prefill and two decode `vllm serve` with the kvloop connector and
their sidecars; the proxy) carries several concurrent multi-turn agent conversations, streamed
through the proxy as users would, while a seeded schedule injects faults:

- ``decode_kill``: kill -9 a decode engine (its process group), start it again on the same ports;
- ``sidecar_kill``: kill -9 a decode's kvloop-agent, start it again;
- ``daemon_kill``: kill -9 the kvloopd the decodes' sidecars stream to (the one daemon, or a
  replica), start it again on its address;
- ``redis_primary_kill`` (redis): stop the Redis primary; Sentinel fails over; the old primary comes
  back as a replica of the new one;
- ``decode_stop``: SIGSTOP the decode that served the latest turn (the holder the next continuation
  READs from) for ``stop_s``, then SIGCONT;
- ``stream_reset``: reset (TCP RST) every connection between the agents / proxy and kvloopd;
- ``network_drop``: the same, and every new connection refused for ``drop_s``;
- ``corrupt_block``: for ``corrupt_s``, every decode overwrites one byte of each run it retains
  (its partly filled last block, right after digesting it) and of each host copy it makes, as a
  fence bug would (``kvloop_fault_file``): each pull of such a block fails its digest check and
  recomputes (``verify_failed``), and its holder is withheld until it registers again; after the
  window the decodes' agents restart, so they do.

With ``host_retention_gib`` the decodes copy retained runs into a host pool of that size (and give
up a run's KV-cache blocks once its copy is announced, so continuations read the pools), two
prefills serve, and three host-tier faults join:

- ``pool_holder_kill``: kill -9 the decode whose pool served the latest pulled turn, while the
  conversations go on pulling; start it again (its pool is gone: its copies leave the directory);
- ``pool_exhausted``: a burst of new long conversations at once, more than the pools hold: copies
  are evicted and finishing runs wait for pool room while the running conversations pull;
- ``prefill_kill``: kill -9 the prefill that served the latest pulled turn (a READ from a pool may
  be in flight); start it again.

The agents and the proxy reach kvloopd through a relay (:class:`FaultyLink`) that makes the last two
faults real TCP events. The client never retries: a request that fails is counted. Afterwards every
turn's request is sent again, as it was, to a reference `vllm serve` without any KV transfer or
prefix cache (float32 everywhere), and the answers compared: the greedy tokens, and each token's
logprob within ``logprob_bound``. A turn whose tokens part where the reference's two best tokens are
within ``tie_bound`` of each other is a near-tie (the last bits of a different, equally right
computation order), counted apart, never a wrong answer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvloop.agents.engine import Engine, EngineConfig, EngineStartError
from kvloop.clients.bench.faulty_link import FaultyLink
from kvloop.clients.demo.conversation import AgentConversation
from kvloop.clients.directory_client import DaemonUnavailable, DirectoryClient
from kvloop.clients.fleet.model import build_tiny_llama
from kvloop.clients.fleet.stack import Stack, StackConfig
from kvloop.common.addresses import free_port, free_port_pair
from kvloop.common.host_names import HOST_SUFFIX

MEMORY_FAULTS = (
    "decode_kill",
    "sidecar_kill",
    "daemon_kill",
    "decode_stop",
    "stream_reset",
    "network_drop",
    "corrupt_block",
)
REDIS_FAULTS = (*MEMORY_FAULTS, "redis_primary_kill")
HOST_FAULTS = ("pool_holder_kill", "pool_exhausted", "prefill_kill")


@dataclass
class ChaosConfig:
    workdir: Path
    store: str = "memory"  # "memory" | "redis"
    seed: int = 0
    quick: bool = False  # every fault kind once, then stop
    duration_s: float = 600.0  # without --quick: faults cycle until then
    conversations: int = 3
    turns_per_conversation: int = 8  # then a fresh conversation: prompts stay bounded
    max_tokens: int = 16
    warmup_s: float = 20.0  # conversations run this long before the first fault
    fault_interval_s: float = 20.0
    stop_s: float = 2.0
    drop_s: float = 2.0
    corrupt_s: float = 10.0
    logprob_bound: float = 1e-3
    tie_bound: float = 1e-4
    request_timeout_s: float = 180.0
    host_retention_gib: float = 0.0  # decodes' host pools (0: none, no host-tier faults)
    burst_conversations: int = 6  # pool_exhausted: new conversations at once ...
    burst_system_words: int = 1500  # ... each this long a system prompt, two turns

    @property
    def kinds(self) -> tuple[str, ...]:
        base = REDIS_FAULTS if self.store == "redis" else MEMORY_FAULTS
        return (*base, *HOST_FAULTS) if self.host_retention_gib else base


@dataclass
class Turn:
    conversation: int
    turn: int
    started_s: float
    ended_s: float
    request: dict
    path: str = ""
    reason: str = ""
    decode: str = ""
    holder: str = ""  # the decode worker the prefill pulled from (a transfer)
    tier: str = ""  # where the pulled KV was: device (a KV cache) or host (a pool)
    prefill: str = ""  # the prefill server that took the turn
    ttft_ms: float | None = None
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    answer: str = ""
    error: str = ""
    verdict: str = ""  # "same" | "near_tie" | "wrong" (after the reference ran)
    detail: str = ""

    def record(self) -> dict:
        out = asdict(self)
        out.pop("request")
        out.pop("logprobs")
        out["tokens"] = len(self.tokens)
        return out


@dataclass
class Fault:
    fault: str
    at_s: float
    target: str = ""
    worker: str = ""  # the worker a fault hit (decode_kill, sidecar_kill, decode_stop)
    restarted_s: float | None = None  # the killed process serving again, from the fault
    note: str = ""
    error: str = ""


def schedule(config: ChaosConfig) -> list[str]:
    """The seeded order of faults: every kind once per cycle, shuffled; cycles until the duration."""
    rnd = random.Random(config.seed)
    cycles = (
        1 if config.quick else max(1, int(config.duration_s // (config.fault_interval_s * len(config.kinds))))
    )
    order: list[str] = []
    for _ in range(cycles):
        kinds = list(config.kinds)
        rnd.shuffle(kinds)
        order += kinds
    return order


# The proxy's x-kvloop-<name> headers a turn's record keeps (each a field of Turn).
PATH_HEADERS = ("path", "reason", "decode", "holder", "tier", "prefill")


def checked_request(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A greedy streamed chat request whose answer can be checked against a reference: token ids
    (not text, which two token sequences can share) and each token's logprob."""
    return {
        "model": model,
        "messages": [dict(m) for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens_as_token_ids": True,
    }


def stream_chat(proxy_url: str, request: dict, timeout_s: float) -> dict:
    """One streamed chat completion through the proxy; the answer's tokens (as token ids), logprobs,
    the path headers, or the error that ended it."""
    out: dict[str, Any] = {"tokens": [], "logprobs": [], "answer": "", "error": ""}
    started = time.perf_counter()
    http = urllib.request.Request(
        f"{proxy_url}/v1/chat/completions",
        data=json.dumps(request).encode(),
        headers={"Content-Type": "application/json"},
    )
    done = False
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as response:
            headers = response.headers
            out.update({name: headers.get(f"x-kvloop-{name}", "") for name in PATH_HEADERS})
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    out["error"] = f"error event in the stream: {chunk['error']}"
                    return out
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    items = (choice.get("logprobs") or {}).get("content") or []
                    if (content or items) and "ttft_ms" not in out:
                        out["ttft_ms"] = round((time.perf_counter() - started) * 1e3, 1)
                    out["answer"] += content or ""
                    for item in items:
                        out["tokens"].append(item["token"])
                        out["logprobs"].append(item["logprob"])
    except urllib.error.HTTPError as exc:
        out["error"] = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        return out
    except (OSError, ValueError) as exc:  # reset, refused, timed out, a broken chunk
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    if not done:
        out["error"] = "the stream ended without [DONE]"
    return out


class Conversations:
    """``config.conversations`` threads, each an agent conversation through the proxy, one turn after
    another until told to stop."""

    def __init__(self, config: ChaosConfig, proxy_url: str, model: str, clock: Callable[[], float]) -> None:
        self.config = config
        self.proxy_url = proxy_url
        self.model = model
        self.clock = clock
        self.turns: list[Turn] = []
        self.latest_decode = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"conversation-{i}", daemon=True)
            for i in range(config.conversations)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self, index: int) -> None:
        generation = 0
        while not self._stop.is_set():
            seed = self.config.seed * 1000 + index * 100 + generation
            conversation = AgentConversation(seed=seed, system_words=300, tool_words=120)
            for turn in range(1, self.config.turns_per_conversation + 1):
                if self._stop.is_set():
                    return
                self._turn(conversation, index * 1000 + generation, turn)
            generation += 1

    def _turn(self, conversation: AgentConversation, number: int, turn: int) -> None:
        request = checked_request(self.model, conversation.messages, self.config.max_tokens)
        started = self.clock()
        result = stream_chat(self.proxy_url, request, self.config.request_timeout_s)
        record = Turn(
            conversation=number,
            turn=turn,
            started_s=round(started, 3),
            ended_s=round(self.clock(), 3),
            request=request,
            **{name: result.get(name, "") for name in PATH_HEADERS},
            ttft_ms=result.get("ttft_ms"),
            tokens=result["tokens"],
            logprobs=result["logprobs"],
            answer=result["answer"],
            error=result["error"],
        )
        with self._lock:
            self.turns.append(record)
            if record.decode and not record.error:
                self.latest_decode = record.decode
        conversation.record(result["answer"])

    def latest_pulled(self) -> Turn | None:
        """The latest answered turn that pulled its history (from a pool, where one did)."""
        with self._lock:
            pulled = [t for t in self.turns if t.path == "transfer" and not t.error]
        from_pool = [t for t in pulled if t.tier == "host"]
        latest = from_pool or pulled
        return latest[-1] if latest else None

    def burst(self, count: int, system_words: int, base: int) -> int:
        """``count`` new conversations of two turns at once (each turn checked like the others);
        returns when all ended. Their numbers start at ``base``."""

        def one(i: int) -> None:
            seed = self.config.seed * 1000 + 900_000 + base + i
            conversation = AgentConversation(seed=seed, system_words=system_words, tool_words=120)
            for turn in (1, 2):
                self._turn(conversation, base + i, turn)

        with ThreadPoolExecutor(count) as pool:
            list(pool.map(one, range(count)))
        return count * 2


class Injector:
    """Injects one fault of a kind into the running stack; restarts what it killed."""

    def __init__(
        self, stack: Stack, links: list[FaultyLink], config: ChaosConfig, rnd: random.Random
    ) -> None:
        self.stack = stack
        self.links = links
        self.config = config
        self.rnd = rnd

    def inject(
        self, kind: str, fault: Fault, conversations: Conversations, clock: Callable[[], float]
    ) -> None:
        getattr(self, kind)(fault, conversations, clock)

    def _decode(self) -> Engine:
        return self.rnd.choice(self.stack.decodes)

    def _wait_ready(self, engine: Engine, fault: Fault, clock: Callable[[], float]) -> None:
        try:
            engine.wait_ready(self.stack.config.start_timeout_s)
            fault.restarted_s = round(clock() - fault.at_s, 2)
        except EngineStartError as exc:
            fault.error = str(exc)[-500:]

    def decode_kill(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        engine = self._decode()
        fault.target = fault.worker = engine.config.worker_id
        engine.kill(vllm=True)
        engine.launch(vllm=True, agent=False)
        self._wait_ready(engine, fault, clock)

    def sidecar_kill(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        engine = self._decode()
        fault.target = f"{engine.config.worker_id} agent"
        fault.worker = engine.config.worker_id
        self._restart_agent(engine, fault, clock)

    def corrupt_block(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        fault.target = "every decode's retained runs and host copies"
        decodes = self.stack.decodes
        for engine in decodes:
            Path(engine.config.fault_file).write_text("device=1 host=1\n")
        try:
            time.sleep(self.config.corrupt_s)  # the fault itself: memory is overwritten this long
        finally:
            for engine in decodes:
                Path(engine.config.fault_file).write_text("device=0 host=0\n")
        for engine in decodes:  # a holder that served a corrupted block is withheld until it registers
            self._restart_agent(engine, fault, clock)
        fault.note = f"corrupted for {self.config.corrupt_s:.0f}s; the decodes' agents registered again"

    def _restart_agent(self, engine: Engine, fault: Fault, clock: Callable[[], float]) -> None:
        engine.kill(vllm=False, agent=True)
        engine.launch(vllm=False, agent=True)
        # serving again: the new agent streams to kvloopd (its /healthz answers 200)
        health = f"http://127.0.0.1:{engine.config.agent_health_port}/healthz"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(health, timeout=2):
                    fault.restarted_s = round(clock() - fault.at_s, 2)
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)  # polling the new agent's health while it starts and registers
        fault.error = f"{engine.config.worker_id}'s agent not streaming to kvloopd 60s after restart"
        return

    def daemon_kill(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        worker = self.stack.decodes[0].config.worker_id
        index = self.stack.replica_of(worker)
        index = 0 if index is None else index
        fault.target = self.stack.kill_replica(index)
        self.stack.restart_replica(index)
        with DirectoryClient(fault.target, timeout=2) as client:
            try:
                client.wait_ready(30)
                fault.restarted_s = round(clock() - fault.at_s, 2)
            except DaemonUnavailable as exc:
                fault.error = str(exc)

    def redis_primary_kill(
        self, fault: Fault, conversations: Conversations, clock: Callable[[], float]
    ) -> None:
        fault.target = self.stack.kill_redis_primary()
        try:
            fault.note = "back as a replica of " + self.stack.rejoin_redis(fault.target, timeout_s=60)
            fault.restarted_s = round(clock() - fault.at_s, 2)
        except (RuntimeError, TimeoutError) as exc:
            fault.error = str(exc)

    def decode_stop(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        engine = next(
            (e for e in self.stack.decodes if e.config.url == conversations.latest_decode), self._decode()
        )
        fault.target = fault.worker = engine.config.worker_id
        assert engine.vllm is not None
        group = os.getpgid(engine.vllm.pid)
        os.killpg(group, signal.SIGSTOP)
        try:
            time.sleep(self.config.stop_s)  # the fault itself: the engine stays stopped this long
        finally:
            os.killpg(group, signal.SIGCONT)
        fault.note = f"stopped {self.config.stop_s:.1f}s"

    def _serving(self, url: str, engines: list[Engine]) -> Engine:
        return next((e for e in engines if e.config.url == url), self.rnd.choice(engines))

    def _kill_and_restart(self, engine: Engine, fault: Fault, clock: Callable[[], float]) -> None:
        fault.target = fault.worker = engine.config.worker_id
        engine.kill(vllm=True)
        engine.launch(vllm=True, agent=False)
        self._wait_ready(engine, fault, clock)

    def pool_holder_kill(
        self, fault: Fault, conversations: Conversations, clock: Callable[[], float]
    ) -> None:
        latest = conversations.latest_pulled()
        holder = latest.holder.removesuffix(HOST_SUFFIX) if latest is not None else ""
        engine = next((e for e in self.stack.decodes if e.config.worker_id == holder), self._decode())
        fault.note = (
            f"its pool served turn {latest.turn} of conversation {latest.conversation}" if latest else ""
        )
        self._kill_and_restart(engine, fault, clock)

    def prefill_kill(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        latest = conversations.latest_pulled()
        engine = self._serving(latest.prefill if latest is not None else "", self.stack.prefills)
        self._kill_and_restart(engine, fault, clock)

    def pool_exhausted(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        count, words = self.config.burst_conversations, self.config.burst_system_words
        fault.target = "the decodes' host pools"
        turns = conversations.burst(count, words, base=10_000_000 + int(fault.at_s * 1000))
        fault.note = f"{count} new conversations with {words}-word system prompts at once ({turns} turns)"

    def stream_reset(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        fault.target = "agent/proxy -> kvloopd connections"
        fault.note = f"{sum(link.reset() for link in self.links)} connections reset"

    def network_drop(self, fault: Fault, conversations: Conversations, clock: Callable[[], float]) -> None:
        fault.target = "agent/proxy -> kvloopd connections"
        cut = sum(link.refuse(self.config.drop_s) for link in self.links)
        fault.note = f"{cut} connections reset, new ones refused for {self.config.drop_s:.1f}s"


def compare(turn: Turn, reference: dict, config: ChaosConfig) -> None:
    """Set the turn's verdict against the reference answer (its tokens, logprobs, top logprobs)."""
    ref_items = (reference["choices"][0].get("logprobs") or {}).get("content") or []
    ref_tokens = [item["token"] for item in ref_items]
    for i, (ours, theirs) in enumerate(zip(turn.tokens, ref_tokens, strict=False)):
        if ours != theirs:
            top = sorted((t["logprob"] for t in ref_items[i].get("top_logprobs") or []), reverse=True)
            gap = top[0] - top[1] if len(top) >= 2 else float("inf")
            if gap <= config.tie_bound:
                turn.verdict, turn.detail = "near_tie", f"token {i}: {ours} vs {theirs}, top-2 gap {gap:.2e}"
            else:
                turn.verdict, turn.detail = "wrong", f"token {i}: {ours} vs {theirs}, top-2 gap {gap:.2e}"
            return
        diff = abs(turn.logprobs[i] - ref_items[i]["logprob"])
        if diff > config.logprob_bound:
            turn.verdict, turn.detail = "wrong", f"token {i}: logprob off by {diff:.2e}"
            return
    if len(turn.tokens) != len(ref_tokens):
        turn.verdict, turn.detail = "wrong", f"{len(turn.tokens)} tokens, reference {len(ref_tokens)}"
        return
    turn.verdict = "same"
    turn.detail = f"max logprob diff {max_logprob_diff(turn, ref_items):.2e}"


def max_logprob_diff(turn: Turn, ref_items: list[dict]) -> float:
    return max((abs(a - b["logprob"]) for a, b in zip(turn.logprobs, ref_items, strict=False)), default=0.0)


def reference_engine(config: ChaosConfig, stack_config: StackConfig, children) -> Engine:
    """A plain `vllm serve` of the same model: no KV transfer, no prefix cache."""
    return Engine(
        EngineConfig(
            role="prefill",
            model=str(stack_config.model_dir),
            served_model_name=stack_config.served_model_name,
            worker_id="reference",
            port=free_port(),
            nixl_port=free_port(),
            kv_events_port=free_port_pair(),
            daemon="",
            block_size=stack_config.block_size,
            dtype=stack_config.dtype,
            kv_cache_gib=stack_config.kv_cache_gib,
            prefix_caching=False,
            mode="recompute",
        ),
        config.workdir / "logs",
        children,
    )


def check_against_reference(
    config: ChaosConfig, stack_config: StackConfig, turns: list[Turn], children, say: Callable[[str], None]
) -> None:
    engine = reference_engine(config, stack_config, children)
    engine.launch()
    try:
        engine.wait_ready(stack_config.start_timeout_s)
        answered = [t for t in turns if not t.error]
        say(f"reference: {len(answered)} answered turns to recompute on {engine.config.url}")

        def recompute(turn: Turn) -> None:
            body = {**turn.request, "stream": False}
            request = urllib.request.Request(
                f"{engine.config.url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=config.request_timeout_s) as response:
                compare(turn, json.loads(response.read()), config)

        with ThreadPoolExecutor(4) as pool:
            for done, _ in enumerate(pool.map(recompute, answered), 1):
                if done % 50 == 0:
                    say(f"reference: {done}/{len(answered)} compared")
    finally:
        engine.stop()


def summarize(
    config: ChaosConfig, turns: list[Turn], faults: list[Fault], elapsed_s: float
) -> dict[str, Any]:
    turns = sorted(turns, key=lambda t: t.started_s)
    failed = [t for t in turns if t.error]
    wrong = [t for t in turns if t.verdict == "wrong"]
    fault_records = []
    for i, fault in enumerate(faults):
        until = faults[i + 1].at_s if i + 1 < len(faults) else float("inf")
        during = [t for t in turns if fault.at_s <= t.ended_s and t.started_s < until]
        # transfers again: any turn, and (a fault that hit one worker) a turn pulling from that worker
        transfers = [t for t in turns if t.started_s >= fault.at_s and t.path == "transfer" and not t.error]
        from_worker = [t for t in transfers if t.holder == fault.worker] if fault.worker else []
        fault_records.append(
            {
                **asdict(fault),
                "failed_requests": sum(1 for t in during if t.error),
                "wrong_answers": sum(1 for t in during if t.verdict == "wrong"),
                "turns": len(during),
                "paths": dict(Counter(t.path or "error" for t in during)),
                # from the fault to the start of the first turn after it that transferred
                "transfer_again_s": round(transfers[0].started_s - fault.at_s, 2) if transfers else None,
                "worker_transfer_again_s": round(from_worker[0].started_s - fault.at_s, 2)
                if from_worker
                else None,
            }
        )
    ttft = [t.ttft_ms for t in turns if t.ttft_ms is not None and t.turn > 1]
    return {
        "store": config.store,
        "host_retention_gib": config.host_retention_gib,
        "seed": config.seed,
        "quick": config.quick,
        "elapsed_s": round(elapsed_s, 1),
        "conversations": config.conversations,
        "turns": len(turns),
        "failed_requests": len(failed),
        "wrong_answers": len(wrong),
        "near_ties": sum(1 for t in turns if t.verdict == "near_tie"),
        "unchecked": sum(1 for t in turns if not t.error and not t.verdict),
        "logprob_bound": config.logprob_bound,
        "tie_bound": config.tie_bound,
        "paths": dict(Counter(t.path or "error" for t in turns)),
        # turns whose pulled blocks failed their digest check and were recomputed
        "verify_failed": sum(1 for t in turns if t.reason == "verify_failed"),
        "pulled_from": dict(Counter(t.tier for t in turns if t.path == "transfer" and not t.error)),
        "continuation_ttft_p50_ms": statistics.median(ttft) if ttft else None,
        "faults": fault_records,
        "failures": [t.record() for t in failed],
        "wrong": [t.record() for t in wrong],
        "turn_log": [t.record() for t in turns],
    }


def run_chaos(config: ChaosConfig, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    config.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_llama(config.workdir / "model")
    links: list[FaultyLink] = []

    def front(address: str) -> str:
        link = FaultyLink(address)
        links.append(link)
        return link.start()

    stack_config = StackConfig(
        model_dir=model_dir,
        workdir=config.workdir,
        decode_servers=2,
        dtype="float32",
        kv_cache_gib=1,
        ha=config.store == "redis",
        daemon_front=front,
        host_retention_gib=config.host_retention_gib,
        host_demote_after_s=0 if config.host_retention_gib else None,  # continuations read the pools
        # with the pools' faults a prefill is killed too: the proxy sends its turns to the other
        prefill_servers=2 if config.host_retention_gib else 1,
        fault_files=True,  # corrupt_block
    )
    stack = Stack(stack_config)
    rnd = random.Random(config.seed)
    order = schedule(config)
    faults: list[Fault] = []
    started = time.monotonic()

    def clock() -> float:
        return time.monotonic() - started

    def say(line: str) -> None:
        progress(f"{clock():7.1f}s {line}")

    try:
        stack.start(lambda what, state: say(f"{what}: {state}"))
        started = time.monotonic()
        conversations = Conversations(config, stack.proxy_url, stack_config.served_model_name, clock)
        conversations.start()
        injector = Injector(stack, links, config, rnd)
        say(f"{config.conversations} conversations running; faults: {', '.join(order)}")
        try:
            quiet_until = config.warmup_s
            for i, kind in enumerate(order):
                # one fault at a time: the next comes an interval (seeded jitter) after the last
                # one's restart finished, so each recovery is seen on its own
                at = quiet_until + rnd.uniform(0, config.fault_interval_s / 4)
                if at > clock():
                    time.sleep(at - clock())  # the schedule: faults at seeded times while traffic flows
                fault = Fault(kind, round(clock(), 2))
                injector.inject(kind, fault, conversations, clock)
                faults.append(fault)
                quiet_until = clock() + config.fault_interval_s
                done = len(conversations.turns)
                failed = sum(1 for t in conversations.turns if t.error)
                say(
                    f"fault {i + 1}/{len(order)} {kind} on {fault.target}: {fault.note or ''}"
                    f"{f' serving again after {fault.restarted_s}s' if fault.restarted_s is not None else ''}"
                    f"{f' ERROR {fault.error}' if fault.error else ''} ({done} turns so far, {failed} failed)"
                )
            # the last fault's recovery is seen by the turns after it
            time.sleep(config.fault_interval_s)  # traffic after the last fault, to see it recover
        finally:
            say("stopping the conversations (in-flight turns finish)")
            conversations.stop()
        elapsed = clock()
    finally:
        for link in links:
            link.stop()
        stack.stop()
    turns = conversations.turns
    say(
        f"{len(turns)} turns, {sum(1 for t in turns if t.error)} failed; checking answers against a recompute"
    )
    check_against_reference(config, stack_config, turns, stack.children, say)
    return summarize(config, turns, faults, elapsed)
