"""Route's answers for conversations as their last turn left them, ready before their next turn.

An agent's next turn resends the whole conversation and appends new messages (a tool's output, the
user's reply). Choosing its prefill on the turn's own path costs rendering and tokenizing the whole
prompt and a Route round trip, milliseconds inside its time to first token. Most of what decides the
choice is known when the turn before ends: which prefill holds the history in its prefix cache,
which decode retains it (the history's KV, answer included), and what a pull of it would cost. So
when a chat turn ends, the router asks Route about the conversation as it now stands (the
turn's prompt token ids followed by its answer's, as the decode computed them) off any request's
path, and keeps the answer here under a digest of the messages through that answer.

When a request arrives whose messages run through a kept conversation's answer, the router ranks
the kept answer with its queues as they are now and sends the request without tokenizing or asking
Route. Route posted its plans for that conversation as continuation plans, so the chosen prefill's
connector usually needs no Lookup either (agents/connector/plans.py). The new messages' tokens are
estimated from their characters at the history's own characters per token.

A request whose history departs from a kept conversation's (an agent that drops or rewrites an
earlier message, a client that edits an answer) is ranked from the kept answer too, shortened to the
messages the two share (outcome ``history_prefix``): the prefills and peers that held the kept
history hold that prefix, and nobody holds what follows it, since every token after an edit is
new. The shared prefix must be at least ``MIN_SHARED_MESSAGES`` messages long (a system prompt alone
is shared by many conversations). When the request departs inside the kept history and the chosen
prefill's own cache covers the shared prefix, no peer can add to it, so the prefill's connector
skips its Lookup, as after a Route that found nothing to pull.

Everything here only advises: a kept answer that no longer matches the engines (evicted, another
template, an answer the client edited) costs a worse choice or a Lookup, never a wrong block, since
the prefill's connector matches the prompt the engine computes, block hash by block hash.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvloop.v1 import directory_pb2 as pb

CONTINUATION_ROUTES = ("continuation", "continuation_tie")
HISTORY_PREFIX_ROUTES = ("history_prefix", "history_prefix_tie")
# A request must share at least this many leading messages with a kept conversation to be ranked
# from its answer: a system prompt alone is shared by every conversation of an agent.
MIN_SHARED_MESSAGES = 2


@dataclass(frozen=True)
class Continued:
    """A kept Route answer for a request's history, and the request's tokens beyond it (estimated).

    ``outcome`` is ``continuation`` when the request resends the kept history whole, or
    ``history_prefix`` when it departs from it after its first messages (an edit): ``answer`` is
    then shortened to the messages they share, and no peer holds what follows them."""

    answer: pb.RouteResponse
    new_tokens: int
    outcome: str = "continuation"


@dataclass(frozen=True)
class _Kept:
    answer: pb.RouteResponse
    tokens_per_char: float
    expires: float  # monotonic
    messages: int  # in the kept history, its answer included
    prefixes: tuple[bytes, ...]  # digests of its first MIN_SHARED_MESSAGES.. messages


def _prefix_digests(model: str, cache_salt: str, messages: list[dict]) -> list[bytes]:
    """Digests of a conversation's first 1, 2, ... n messages (with the model and the salt): each
    message's role and content."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (model, cache_salt):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\x00")
    out = []
    for message in messages:
        content = message.get("content")
        digest.update(
            f"{message.get('role')}\x1f{content if isinstance(content, str) else repr(content)}\x1e".encode(
                "utf-8", "surrogatepass"
            )
        )
        out.append(digest.copy().digest())
    return out


def _text_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def shortened(answer: pb.RouteResponse, tokens: int) -> pb.RouteResponse:
    """Route's answer for the first `tokens` tokens of the prompt it scored: each candidate's local
    prefix, pull and holder cut to those tokens' full blocks, its compute to what is left of them.
    The transfer is scaled by the blocks still pulled; the queues are the router's to add again."""
    if tokens >= answer.prompt_tokens or not answer.block_size:
        return answer
    blocks = tokens // answer.block_size
    out = pb.RouteResponse()
    out.CopyFrom(answer)
    out.prompt_tokens, out.prompt_blocks = tokens, blocks
    for score in out.ranked:
        local = min(score.local_blocks, blocks)
        pull = max(0, min(score.local_blocks + score.pull_blocks, blocks) - local) if score.pull_blocks else 0
        score.transfer_ms = score.transfer_ms * pull / score.pull_blocks if pull else 0.0
        if not pull:
            score.pull_wait_ms = 0.0
        holder_blocks = min(score.pull_holder_blocks, blocks)
        if holder_blocks <= local:  # no peer holds more of the shorter prompt than the candidate
            score.pull_holder_worker_id, score.pull_holder_blocks = "", 0
            score.pull_reason = pb.DECISION_REASON_LOCAL_PREFIX if local else pb.DECISION_REASON_MISS
            score.ClearField("pull_cost")
        else:
            score.pull_holder_blocks = holder_blocks
        score.local_blocks, score.pull_blocks = local, pull
        score.compute_tokens = max(0, tokens - (local + pull) * answer.block_size)
        if score.prefill_tokens_per_s > 0:
            score.compute_ms = score.compute_tokens / score.prefill_tokens_per_s * 1e3
        score.expected_ttft_ms = score.queue_ms + score.transfer_ms + score.pull_wait_ms + score.compute_ms
    return out


class ContinuationRoutes:
    """Kept Route answers by conversation; each is taken once, within ``ttl_s``. Used from the
    proxy's event loop only."""

    def __init__(self, ttl_s: float = 120.0, max_entries: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()  # oldest first
        self._by_prefix: dict[bytes, bytes] = {}  # a kept history's leading messages -> its key

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
        digests = _prefix_digests(model, cache_salt, history)
        key = digests[-1]
        kept = _Kept(
            route,
            tokens / chars if chars else 0.0,
            time.monotonic() + self.ttl_s,
            len(history),
            tuple(digests[MIN_SHARED_MESSAGES - 1 :]),
        )
        self._drop(key)
        self._kept[key] = kept
        for prefix in kept.prefixes:  # the latest conversation kept with this prefix answers for it
            self._by_prefix[prefix] = key
        now = time.monotonic()
        while self._kept and (
            len(self._kept) > self.max_entries or next(iter(self._kept.values())).expires < now
        ):
            self._drop(next(iter(self._kept)))

    def take(self, model: str, cache_salt: str, messages: list[dict]) -> Continued | None:
        """The kept answer for the history this request resends (its messages through the last
        assistant message), or else for the longest run of leading messages it shares with a kept
        history (at least MIN_SHARED_MESSAGES), shortened to them; None when there is neither."""
        last = next(
            (i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None
        )
        if last is None or last == len(messages) - 1:
            return None  # a first turn, or no new message after the answer
        digests = _prefix_digests(model, cache_salt, messages)
        kept = self._drop(digests[last])
        shared = last + 1
        if kept is None:
            shared = next(
                (
                    n
                    for n in range(len(messages) - 1, MIN_SHARED_MESSAGES - 1, -1)
                    if digests[n - 1] in self._by_prefix
                ),
                0,
            )
            kept = self._drop(self._by_prefix[digests[shared - 1]]) if shared else None
        if kept is None or kept.expires < time.monotonic():
            return None
        new_tokens = round(_text_chars(messages[shared:]) * kept.tokens_per_char)
        if shared == kept.messages:  # the whole kept history (the turn before, or turns before)
            return Continued(kept.answer, new_tokens)
        tokens = min(kept.answer.prompt_tokens, round(_text_chars(messages[:shared]) * kept.tokens_per_char))
        return Continued(shortened(kept.answer, tokens), new_tokens, "history_prefix")

    def _drop(self, key: bytes) -> _Kept | None:
        """Forget a kept answer and its prefixes."""
        kept = self._kept.pop(key, None)
        if kept is not None:
            for prefix in kept.prefixes:
                if self._by_prefix.get(prefix) == key:
                    del self._by_prefix[prefix]
        return kept

    def __len__(self) -> int:
        return len(self._kept)
