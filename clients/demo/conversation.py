"""An agent-style conversation driven through the proxy: history + tool output resent every turn."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from kvloop.clients.fleet.model import random_text

SYSTEM_PROMPT_WORDS = 600
TOOL_OUTPUT_WORDS = 350


@dataclass
class TurnResult:
    turn: int
    prompt_tokens: int
    path: str
    reason: str
    matched_tokens: int
    recompute_tokens: int
    bytes_moved: int
    holder: str
    ttft_ms: float
    prefill_ms: float
    total_ms: float
    answer: str
    decode_server: str
    detail: str = ""  # the directory's why, with its cost estimates
    trace_id: str = ""  # the turn's W3C trace id (the proxy's span), for `kvloop trace --trace-id`
    # Bytes pulled per KV-cache group (a hybrid model's sliding-window group moves only its window).
    bytes_per_group: list[int] = field(default_factory=list)
    route: str = ""  # how the proxy chose the prefill (x-kvloop-route)
    tier: str = ""  # where pulled KV was held: device (the holder's KV cache) or host (its pool)

    def as_dict(self) -> dict:
        return asdict(self)


def _header_ints(headers, name: str) -> list[int]:
    try:
        values = json.loads(headers.get(name, "[]"))
    except ValueError:
        return []
    return [int(v) for v in values] if isinstance(values, list) else []


def _header_int(headers, name: str) -> int:
    try:
        return int(float(headers.get(name, "0")))
    except ValueError:
        return 0


def chat_turn(
    proxy_url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    turn: int,
    timeout_s: float = 300.0,
    extra: dict | None = None,
    headers: dict[str, str] | None = None,
) -> TurnResult:
    """One streamed, greedy chat turn; ``extra`` adds request fields (``cache_salt``...), ``headers``
    HTTP headers."""
    body = json.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
    ).encode()
    request = urllib.request.Request(
        f"{proxy_url}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    started = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    prompt_tokens = 0
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        headers = response.headers
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None:
                ttft = time.perf_counter() - started
            for choice in chunk.get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
    total = time.perf_counter() - started
    return TurnResult(
        turn=turn,
        prompt_tokens=prompt_tokens,
        path=headers.get("x-kvloop-path", "unknown"),
        reason=headers.get("x-kvloop-reason", ""),
        matched_tokens=_header_int(headers, "x-kvloop-matched-tokens"),
        recompute_tokens=_header_int(headers, "x-kvloop-recompute-tokens"),
        bytes_moved=_header_int(headers, "x-kvloop-bytes"),
        holder=headers.get("x-kvloop-holder", ""),
        ttft_ms=round((ttft or total) * 1e3, 1),
        prefill_ms=float(headers.get("x-kvloop-prefill-ms", "0")),
        total_ms=round(total * 1e3, 1),
        answer="".join(pieces),
        decode_server=headers.get("x-kvloop-decode", ""),
        detail=headers.get("x-kvloop-detail", ""),
        trace_id=headers.get("x-kvloop-trace-id", ""),
        bytes_per_group=_header_ints(headers, "x-kvloop-group-bytes"),
        route=headers.get("x-kvloop-route", ""),
        tier=headers.get("x-kvloop-tier", ""),
    )


def recompute_turn(proxy_url: str, model: str, messages: list[dict], turn: int) -> TurnResult:
    """The same prompt as a turn, recomputed: sent through the proxy under a fresh random
    ``cache_salt``, which enters every block hash, so no engine holds any of its blocks and the
    prefill computes the whole prompt; one token, so it costs a prefill only. Its trace context is
    not sampled: it leaves no trace (`kvloop trace --last` still shows the conversation's turns).
    The proxy replaces a client's ``kv_transfer_params`` with the prefill's handle, so the decode
    retains this run as any other, under hashes of its own that no turn ever matches."""
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
    return chat_turn(
        proxy_url,
        model,
        messages,
        1,
        turn,
        extra={"cache_salt": secrets.token_hex(16)},
        headers={"traceparent": traceparent},
    )


class AgentConversation:
    """System prompt + task, then per turn: the model's answer and a tool's output appended."""

    def __init__(
        self, seed: int, system_words: int = SYSTEM_PROMPT_WORDS, tool_words: int = TOOL_OUTPUT_WORDS
    ):
        self.seed = seed
        self.tool_words = tool_words
        self.messages: list[dict] = [
            {
                "role": "system",
                "content": "You are a coding agent. Tools: search, read, write. "
                + random_text(system_words, seed),
            },
            {"role": "user", "content": "Task: " + random_text(40, seed + 1)},
        ]
        self.turns = 0

    def record(self, answer: str) -> None:
        self.turns += 1
        self.messages.append({"role": "assistant", "content": answer})
        self.messages.append(
            {
                "role": "user",
                "content": "Tool output: " + random_text(self.tool_words, self.seed * 1000 + self.turns),
            }
        )
