"""A seeded generator of agent traffic in the Mooncake trace format.

Sessions open at random (Poisson arrivals); each starts from one of a few shared system prompts,
then alternates: the model answers, a tool's output (or the user) is appended, the whole history is
resent after a gap. Gaps are log-normal, so most turns follow within seconds and a tail comes back
after minutes, past a lease. By default every session draws its gaps from the same distribution (so
nothing about one session's past gaps says when it comes back); ``population="mixed"`` gives each
session a gap scale of its own class instead: agent sessions (a model looping on tool calls) come back
within seconds, chat sessions (a person reading the answer and typing the next message) after a
minute or more. Every record carries ``session_id`` besides the Mooncake fields (readers
of the format ignore it); the replay uses it to know that a turn's answer is what the next turn
resends.

Block ids follow the format's rule: one id per ``block_size`` tokens of the prompt, equal ids for
equal prefixes, a partly filled last block gets an id of its own.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvloop.clients.bench.replay.trace import MOONCAKE_BLOCK_SIZE


@dataclass(frozen=True)
class SyntheticConfig:
    requests: int = 1000
    seed: int = 1
    system_prompts: int = 6
    system_tokens: tuple[int, int] = (800, 6000)
    user_tokens: tuple[int, int] = (40, 400)
    # Log-normal medians (and sigma) of tool outputs, answers and gaps between turns.
    tool_tokens_median: float = 700.0
    answer_tokens_median: float = 180.0
    turn_gap_s_median: float = 12.0
    turn_gap_sigma: float = 1.3
    # "uniform": every session's gaps have the median above. "mixed": a session is an agent session
    # (chance agent_share) whose gaps have the median agent_gap_s_median, else a chat session with
    # chat_gap_s_median; the same sigma in both. 3 s is a tool call plus the client's next request; 90 s
    # a person reading an answer and typing a reply; 70% agents: agent loops make most requests. The
    # mix's overall median (~8 s) stays near the uniform one.
    population: str = "uniform"
    agent_share: float = 0.7
    agent_gap_s_median: float = 3.0
    chat_gap_s_median: float = 90.0
    # New sessions per second (Poisson) and the mean turns per session (geometric).
    sessions_per_s: float = 1.0
    mean_turns: float = 6.0
    max_context_tokens: int = 32_768
    block_size: int = MOONCAKE_BLOCK_SIZE


class _Ids:
    """Block ids by content: a block is the tuple of (segment, start, end) pieces it covers plus
    its parent's id, so equal prefixes get equal ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def of(self, segments: list[tuple[int, int]], block_size: int) -> list[int]:
        ids: list[int] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        fill = 0
        for uid, length in segments:
            start = 0
            while start < length:
                take = min(length - start, block_size - fill)
                pieces.append((uid, start, start + take))
                start += take
                fill += take
                if fill == block_size:
                    parent = self._id(parent, pieces)
                    ids.append(parent)
                    pieces, fill = [], 0
        if pieces:
            ids.append(self._id(parent, pieces))
        return ids

    def _id(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(pieces))
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found


def _lognormal(rnd: random.Random, median: float, sigma: float = 0.8) -> float:
    return median * math.exp(rnd.gauss(0.0, sigma))


POPULATIONS = ("uniform", "mixed")


def generate(config: SyntheticConfig) -> Iterator[dict[str, Any]]:
    """Records in timestamp order, exactly ``config.requests`` of them."""
    if config.population not in POPULATIONS:
        raise ValueError(f"population {config.population!r}: choose from {', '.join(POPULATIONS)}")
    rnd = random.Random(config.seed)
    ids = _Ids()
    uid = iter(range(1, 1 << 62))
    systems = [(next(uid), rnd.randint(*config.system_tokens)) for _ in range(config.system_prompts)]
    # Each pending turn: (time ms, tie-break, session number, segments so far, turns left).
    pending: list[tuple[float, int, int, list[tuple[int, int]], int]] = []
    t_ms, order, sessions = 0.0, 0, 0
    gap_median: dict[int, float] = {}  # session -> its gaps' median ("mixed")

    def open_session() -> None:
        nonlocal t_ms, order, sessions
        t_ms += rnd.expovariate(config.sessions_per_s) * 1000
        turns = 1 + int(rnd.expovariate(1 / max(config.mean_turns - 1, 1e-9)))
        system = systems[min(int(rnd.paretovariate(1.2)) - 1, len(systems) - 1)]  # a few are popular
        if config.population == "mixed":  # drawn only then: the uniform trace stays as it was
            agent = rnd.random() < config.agent_share
            gap_median[sessions] = config.agent_gap_s_median if agent else config.chat_gap_s_median
        segments = [system, (next(uid), rnd.randint(*config.user_tokens))]
        heapq.heappush(pending, (t_ms, order, sessions, segments, turns))
        order += 1
        sessions += 1

    open_session()
    emitted = 0
    while emitted < config.requests:
        # Keep new sessions arriving ahead of the earliest pending turn.
        while pending[0][0] >= t_ms:
            open_session()
        at, _, session, segments, left = heapq.heappop(pending)
        input_length = sum(length for _, length in segments)
        output_length = max(1, int(_lognormal(rnd, config.answer_tokens_median)))
        yield {
            "timestamp": int(at),
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": ids.of(segments, config.block_size),
            "session_id": f"s{session}",
        }
        emitted += 1
        tool = max(1, int(_lognormal(rnd, config.tool_tokens_median, 1.0)))
        grown = [*segments, (next(uid), output_length), (next(uid), tool)]
        if left > 1 and input_length + output_length + tool <= config.max_context_tokens:
            median = gap_median.get(session, config.turn_gap_s_median)
            gap_ms = _lognormal(rnd, median, config.turn_gap_sigma) * 1000
            heapq.heappush(pending, (at + gap_ms, order, session, grown, left - 1))
            order += 1


def describe(config: SyntheticConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
