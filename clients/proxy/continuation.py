"""Route's answers for conversations as their last turn left them, ready before their next turn.

An agent's next turn resends the whole conversation and appends new messages (a tool's output, the
user's reply). Choosing its prefill on the turn's own path costs rendering and tokenizing the whole
prompt and a Route round trip, milliseconds inside its time to first token. Most of what decides the
choice is known when the turn before ends: which prefill holds the history in its prefix cache,
which decode retains it (the history's KV, answer included), and what a pull of it would cost. So
when a streamed chat turn ends, the router asks Route about the conversation as it now stands (the
turn's prompt token ids followed by its answer's, as the decode computed them) off any request's
path, and keeps the answer here under a digest of the messages through that answer.

When a request arrives whose messages run through a kept conversation's answer, the router ranks
the kept answer with its queues as they are now and sends the request without tokenizing or asking
Route. Route posted its plans for that conversation as continuation plans, so the chosen prefill's
connector usually needs no Lookup either (agents/connector/plans.py). The new messages' tokens are
estimated from their characters at the history's own characters per token.

Everything here only advises: a kept answer that no longer matches the engines (evicted, another
template, an answer the client edited) costs a worse choice or a Lookup, never a wrong block, since
the prefill's connector matches the prompt the engine computes, block hash by block hash.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvloop.v1 import directory_pb2 as pb

CONTINUATION_ROUTES = ("continuation", "continuation_tie")


@dataclass(frozen=True)
class Continued:
    """A kept Route answer for a request's history, and the request's tokens beyond it (estimated)."""

    answer: pb.RouteResponse
    new_tokens: int


@dataclass(frozen=True)
class _Kept:
    answer: pb.RouteResponse
    tokens_per_char: float
    expires: float  # monotonic


def history_key(model: str, cache_salt: str, messages: list[dict]) -> bytes:
    """A conversation's digest: the model, the salt, and each message's role and content."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (model, cache_salt):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\x00")
    for message in messages:
        content = message.get("content")
        digest.update(
            f"{message.get('role')}\x1f{content if isinstance(content, str) else repr(content)}\x1e".encode(
                "utf-8", "surrogatepass"
            )
        )
    return digest.digest()


def _text_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


class ContinuationRoutes:
    """Kept Route answers by conversation (thread-safe); each is taken once, within ``ttl_s``."""

    def __init__(self, ttl_s: float = 120.0, max_entries: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def keep(
        self,
        model: str,
        cache_salt: str,
        messages: list[dict],
        answer: str,
        tokens: int,
        route: pb.RouteResponse,
    ) -> None:
        """Route's answer for the conversation `messages` followed by the assistant's `answer`, which
        together are `tokens` long."""
        history = [*messages, {"role": "assistant", "content": answer}]
        chars = _text_chars(history)
        kept = _Kept(route, tokens / chars if chars else 0.0, time.monotonic() + self.ttl_s)
        key = history_key(model, cache_salt, history)
        with self._lock:
            self._kept.pop(key, None)
            self._kept[key] = kept
            now = time.monotonic()
            while self._kept and (
                len(self._kept) > self.max_entries or next(iter(self._kept.values())).expires < now
            ):
                self._kept.popitem(last=False)

    def take(self, model: str, cache_salt: str, messages: list[dict]) -> Continued | None:
        """The kept answer for the history this request resends (its messages through the last
        assistant message), or None."""
        last = next(
            (i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None
        )
        if last is None or last == len(messages) - 1:
            return None  # a first turn, or no new message after the answer
        key = history_key(model, cache_salt, messages[: last + 1])
        with self._lock:
            kept = self._kept.pop(key, None)
        if kept is None or kept.expires < time.monotonic():
            return None
        return Continued(kept.answer, round(_text_chars(messages[last + 1 :]) * kept.tokens_per_char))

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
