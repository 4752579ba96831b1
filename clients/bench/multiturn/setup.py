"""`kvloop bench multiturn`'s setup: its arms and workloads, the run's settings, the seeded
conversations every arm replays alike, the order the arms take turns in, and a turn's record."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvloop.clients.fleet.model import WORDS

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
# kvloop with its prefill checking no READ (kvloop_verify off): what checking each pulled block costs,
# paired with the kvloop arm. Asked for by name.
UNVERIFIED_ARM = "kvloop_unverified"
# Arms run only when asked for by name.
NAMED_ARMS = (HOST_ARM, UNVERIFIED_ARM)
MODEL = "kvloop-tiny"
# Paired per-turn ratios reported (numerator arm, denominator arm): same prompt, adjacent in time.
PAIRED_RATIOS = (("kvloop", "builtin"), ("kvloop", "local"), ("builtin", "local"), ("kvloop", UNVERIFIED_ARM))
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
    # Every process of every arm exports its spans to a receiver of the arm's (WORKDIR/ARM/spans.jsonl),
    # each turn is one trace, and the results carry where each turn's time went (breakdown.py).
    spans: bool = False
    # The decode leg of the direct arms streamed (each turn's TPOT from its chunks) or answered whole.
    # vLLM hands the builtin arm its retention handle only in a whole answer, and on a small host a
    # streamed answer's per-token work (the API server's chunks, the client's parsing) takes CPU from
    # the other sessions' prefills: so with the builtin arm in the run every arm answers whole, unless
    # this says otherwise (None).
    stream_decodes: bool | None = None
    # Each arm's turns run with the other arms' vLLM servers paused (SIGSTOP; their sidecars and kvloopd
    # run on), as if every arm had the host to itself: what an arm's engines do while idle (vLLM's
    # built-in reverse mode steps its loop while it holds a handle) then costs only its own turns.
    # Before an arm is paused, its decode's retained runs are announced. Not with the routing arms,
    # which share one fleet.
    pause_other_arms: bool = True
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

    @property
    def streams_decodes(self) -> bool:
        if self.stream_decodes is not None:
            return self.stream_decodes
        return "builtin" not in self.arms


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
    # The turn's trace (with --spans): its prefill, lookup, READ and decode spans share it.
    trace_id: str | None = None


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
