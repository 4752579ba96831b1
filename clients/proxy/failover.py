"""What the proxy does when a prefill or decode server fails under a request.

Before the client has any response byte, the whole request (prefill + decode) runs again on other
healthy servers: a second decode never gets the first prefill's `kv_transfer_params` (that prefill
may already have freed the blocks after a partial READ). After the client has part of a streamed
answer, the answer continues on another decode: the upstream stream carries token ids
(`return_token_ids`), and the continuation is a `/v1/completions` request whose prompt is the prompt's
token ids followed by the tokens already sent, its chunks rewritten into the original stream's format
(same id, model, created; usage counts the whole answer). Greedy decoding then gives exactly the tokens
an uninterrupted run would; sampled answers cannot be continued exactly, so such a stream ends with an
error event instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

RETRIES = Counter(
    "kvloop_proxy_retries_total",
    "Requests run again (prefill, decode: before the first response byte) or continued (resume: mid-stream) "
    "on another server",
    ["stage", "reason"],
)

# Sampling parameters a continuation keeps (the chat-only ones, messages and tools, have no meaning there).
_CARRIED_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "cache_salt",
    "priority",
    "return_tokens_as_token_ids",
)
# Present and set, each makes a continuation differ from an uninterrupted answer: penalties count only
# the new request's output, stop strings hold text back that the client never got, the rest change the
# chunks' shape or constrain the output with state the continuation would not have.
_UNRESUMABLE_PARAMS = (
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "echo",
    "suffix",
    "tools",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logit_bias",
    "bad_words",
)


class StreamBroken(Exception):
    """The decode's stream ended before its last chunk (connection lost, server gone)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _only_token_ids(chunk: dict) -> bool:
    """A chat chunk vLLM sends only because token ids were asked for (an empty delta, no logprobs, no
    finish): vLLM's chat stream leaves such chunks out otherwise."""
    choices = chunk.get("choices")
    return (
        isinstance(choices, list)
        and bool(choices)
        and all(
            isinstance(c, dict)
            and not c.get("delta")
            and c.get("logprobs") is None
            and c.get("finish_reason") is None
            for c in choices
        )
    )


def unresumable_reason(body: dict, chat: bool) -> str | None:
    """Why a stream of this request cannot be continued token-exactly elsewhere, or None."""
    if body.get("temperature") != 0:
        return "sampled (temperature is not 0): a continuation would not be the same answer"
    for key in _UNRESUMABLE_PARAMS:
        if body.get(key) not in (None, False, 0, [], {}, ""):
            return f"'{key}' is set"
    if not chat and not isinstance(body.get("prompt"), str | list):
        return "prompt is neither a string nor token ids"
    if (
        not chat
        and isinstance(body.get("prompt"), list)
        and body["prompt"]
        and not isinstance(body["prompt"][0], int)
    ):
        return "a batch of prompts"
    return None


def _max_tokens(body: dict) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) else None


@dataclass
class StreamState:
    """One client stream as the proxy has forwarded it: what the client asked for and what it got."""

    chat: bool
    body: dict  # the client's request
    id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_token_ids: list[int] | None = None
    sent_token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # the chunk with finish_reason has gone to the client
    usage_sent: bool = False
    resumed: int = 0  # continuations started
    answer_parts: list[str] = field(default_factory=list)  # chat: the streamed answer's content

    @property
    def client_wants_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def client_wants_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))

    def upstream_body(self, body: dict) -> dict:
        """The decode request of the original stream: as the client sent it, with token ids in every
        chunk when the stream could be continued (they change nothing else for chat; for completions
        with `echo` they would blank the echoed prompt, but echo is not continued anyway)."""
        if unresumable_reason(self.body, self.chat) is not None:
            return body
        return {**body, "return_token_ids": True}

    def forward(self, chunk: dict) -> dict | None:
        """Record an original-stream chunk; the chunk the client gets (token ids only if it asked), or
        None when a plain server would not have sent it: a chat chunk that only carried token ids."""
        if self.id is None:
            self.id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        if self.prompt_token_ids is None and chunk.get("prompt_token_ids"):
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or ():
            self._record(choice)
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage_sent = True
        # the decode's retention handle is the proxy's business, as a plain server's stream has none
        chunk = {k: v for k, v in chunk.items() if k != "kv_transfer_params"}
        if self.client_wants_token_ids:
            return chunk
        if self.chat and _only_token_ids(chunk):
            return None
        # as a plain server streams them when they were not asked for: present, and null
        out: dict[str, Any] = {k: None if k == "prompt_token_ids" else v for k, v in chunk.items()}
        if isinstance(out.get("choices"), list):
            out["choices"] = [
                {k: None if k in ("token_ids", "prompt_token_ids") else v for k, v in c.items()}
                for c in chunk["choices"]
            ]
        return out

    def _record(self, choice: dict) -> None:
        if self.prompt_token_ids is None and choice.get("prompt_token_ids"):  # completions put them here
            self.prompt_token_ids = list(choice["prompt_token_ids"])
        self.sent_token_ids.extend(choice.get("token_ids") or ())
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            self.answer_parts.append(delta["content"])
        if choice.get("finish_reason") is not None:
            self.finished = True

    def unresumable_reason(self) -> str | None:
        why = unresumable_reason(self.body, self.chat)
        if why is None and self.prompt_token_ids is None:
            return "the decode sent no prompt token ids"
        return why

    def remaining_tokens(self) -> int | None:
        limit = _max_tokens(self.body)
        return None if limit is None else limit - len(self.sent_token_ids)

    def resume_body(self) -> dict:
        """The `/v1/completions` request that generates the rest of the answer."""
        assert self.prompt_token_ids is not None
        body: dict[str, Any] = {k: self.body[k] for k in _CARRIED_PARAMS if k in self.body}
        body.update(
            {
                "model": self.body.get("model") or self.model,
                "prompt": [*self.prompt_token_ids, *self.sent_token_ids],
                "stream": True,
                "return_token_ids": True,
            }
        )
        if self.chat and self.body.get("logprobs"):
            # completions' `logprobs: k` gives each token's logprob and its k best alternatives
            body["logprobs"] = self.body.get("top_logprobs") or 0
        elif not self.chat and isinstance(self.body.get("logprobs"), int):
            body["logprobs"] = self.body["logprobs"]
        remaining = self.remaining_tokens()
        if remaining is not None:
            body["max_tokens"] = remaining
        if isinstance(self.body.get("min_tokens"), int):
            body["min_tokens"] = max(0, self.body["min_tokens"] - len(self.sent_token_ids))
        return body

    def translate(self, chunk: dict) -> dict | None:
        """A continuation chunk (completions format) as a chunk of the original stream; None to drop
        (its usage chunk: the proxy sends usage for the whole answer itself)."""
        choices = chunk.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        self._record(choice)
        out_choice: dict[str, Any]
        if self.chat:
            out_choice = {
                "index": 0,
                "delta": {"content": choice.get("text") or ""},
                "logprobs": self._chat_logprobs(choice.get("logprobs")),
            }
        else:
            out_choice = {"index": 0, "text": choice.get("text") or "", "logprobs": choice.get("logprobs")}
        out_choice["finish_reason"] = choice.get("finish_reason")
        if choice.get("finish_reason") is not None:
            out_choice["stop_reason"] = choice.get("stop_reason")
        # token ids as the original stream carried them: null unless the client asked for them
        out_choice["token_ids"] = (choice.get("token_ids") or []) if self.client_wants_token_ids else None
        out = self._envelope([out_choice])
        if chunk.get("usage") is not None:  # continuous usage stats: counted over the whole answer
            out["usage"] = self.usage()
        return out

    def _chat_logprobs(self, completion: dict | None) -> dict | None:
        """A completions chunk's logprobs (parallel lists; top alternatives as token -> logprob maps)
        in the chat format (a list of tokens, each with its logprob and its best alternatives)."""
        if not self.body.get("logprobs") or not completion:
            return None
        top_n = self.body.get("top_logprobs") or 0
        content = []
        tokens = completion.get("tokens") or []
        logprobs = completion.get("token_logprobs") or []
        tops = completion.get("top_logprobs") or [None] * len(tokens)
        for token, logprob, top in zip(tokens, logprobs, tops, strict=False):
            best = sorted((top or {}).items(), key=lambda item: item[1], reverse=True)[:top_n]
            content.append(
                {
                    "token": token,
                    "logprob": logprob,
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in best
                    ],
                }
            )
        return {"content": content}

    def length_finish(self) -> dict:
        """The last chunk of an answer that had all its tokens when its stream broke."""
        content: dict[str, Any] = {"delta": {"content": ""}} if self.chat else {"text": ""}
        return self._envelope([{"index": 0, **content, "logprobs": None, "finish_reason": "length"}])

    def usage(self) -> dict:
        prompt = len(self.prompt_token_ids or ())
        completion = len(self.sent_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_chunk(self) -> dict:
        return {**self._envelope([]), "usage": self.usage()}

    def _envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def sse(payload: dict | str) -> bytes:
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    )
    return f"data: {data}\n\n".encode()


def error_event(message: str, status: int = 502) -> bytes:
    """An error the client can see in the stream (vLLM's own shape for errors after the first chunk)."""
    return sse({"error": {"message": message, "type": "upstream_error", "code": status}})
