"""Reading an OpenAI-style server-sent-event stream as a client does, and the proxy's relay contract.

Two servers answering the same greedy request stream the same answer, but not necessarily in the same
chunks: whether vLLM sends the finish reason with the last token or in a chunk of its own, or how many
tokens one chunk carries, depends on timing in its output loop. So two streams are compared by what a
client reads from them (:func:`read`): text, token ids, tool calls as assembled, logprobs per token,
the final finish and stop reasons, usage, the first chunk's role, the ``[DONE]`` terminator; and each
chunk is checked to be well formed (:func:`check_well_formed`).

Chunk boundaries do matter in one place: the proxy relays the decode's own chunks, one for one. That
is stated by :func:`check_relayed`, which compares the proxy's output with the decode leg it relayed
(a stream both sides saw, so the comparison is exact whatever the timing).
"""

from __future__ import annotations

import json
from typing import Any

# Differ between any two servers: ids, times, fingerprints.
VOLATILE = {"id", "created", "system_fingerprint"}
DONE = "[DONE]"


def chunks(text: str) -> list[dict | str]:
    """The ``data:`` payloads of a stream, JSON-decoded (``[DONE]`` kept as the string)."""
    out: list[dict | str] = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == DONE else json.loads(data))
    return out


def usage(chunk: dict) -> dict | None:
    """Usage without ``created_cache_tokens``: the blocks a server wrote into its own prefix cache,
    which differ by deployment (a disaggregated decode got its prompt KV from its prefill)."""
    out = chunk.get("usage")
    if isinstance(out, dict) and isinstance(out.get("prompt_tokens_details"), dict):
        details = {k: v for k, v in out["prompt_tokens_details"].items() if k != "created_cache_tokens"}
        out = {**out, "prompt_tokens_details": details}
    return out


def check_well_formed(stream: list[dict | str], chat: bool) -> None:
    """Every chunk a well-formed chunk of its endpoint, ``[DONE]`` once and last."""
    assert stream and stream[-1] == DONE, "a stream ends with data: [DONE]"
    assert stream.count(DONE) == 1, "[DONE] once"
    kind = "chat.completion.chunk" if chat else "text_completion"
    for chunk in stream[:-1]:
        assert isinstance(chunk, dict), chunk
        assert isinstance(chunk.get("id"), str) and chunk["id"], chunk
        assert chunk.get("object") == kind, chunk
        assert isinstance(chunk.get("created"), int), chunk
        assert isinstance(chunk.get("model"), str), chunk
        assert isinstance(chunk.get("choices"), list), chunk
        for choice in chunk["choices"]:
            assert isinstance(choice.get("index"), int), choice
            if chat:
                assert isinstance(choice.get("delta"), dict), choice
            else:
                assert isinstance(choice.get("text"), str), choice
    ids = {c["id"] for c in stream[:-1] if isinstance(c, dict)}
    assert len(ids) == 1, f"one id for the whole stream, got {ids}"


def key_sets(stream: list[dict | str]) -> tuple[set, set]:
    """The distinct key sets of the chunks and of their choices (what fields a client finds)."""
    tops = {frozenset(k for k in c if k not in VOLATILE) for c in stream if isinstance(c, dict)}
    choices = {frozenset(x) for c in stream if isinstance(c, dict) for x in c.get("choices") or ()}
    return tops, choices


def _add_tool_call_delta(calls: dict[int, dict], delta: dict) -> None:
    """Assemble streamed tool calls as the OpenAI client does: by index, arguments concatenated."""
    call = calls.setdefault(delta.get("index", 0), {"type": None, "name": "", "arguments": ""})
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function") or {}
    call["name"] += function.get("name") or ""
    call["arguments"] += function.get("arguments") or ""


def _add_logprobs(answer: dict, logprobs: Any, chat: bool) -> None:
    if logprobs is None:
        return
    if chat:
        answer["logprobs"].extend(logprobs.get("content") or [])
        return
    tokens = logprobs.get("tokens") or []
    for i, token in enumerate(tokens):
        answer["logprobs"].append(
            {
                "token": token,
                "logprob": (logprobs.get("token_logprobs") or [None] * len(tokens))[i],
                "top_logprobs": (logprobs.get("top_logprobs") or [None] * len(tokens))[i],
            }
        )


def read(stream: list[dict | str], chat: bool) -> dict:
    """What a client reads from a stream, chunk boundaries aside: per answer (choice index) the role,
    the text (or content and reasoning), token ids, tool calls as assembled, logprobs per token and
    the final finish and stop reasons; and the stream's model, object and last usage."""
    answers: dict[int, dict] = {}
    out: dict[str, Any] = {"model": None, "object": None, "usage": None, "answers": answers}
    for chunk in stream:
        if not isinstance(chunk, dict):
            continue
        out["model"], out["object"] = chunk.get("model"), chunk.get("object")
        if chunk.get("usage") is not None:
            out["usage"] = usage(chunk)
        for choice in chunk.get("choices") or ():
            answer = answers.setdefault(
                choice["index"],
                {
                    "role": None,
                    "text": "",
                    "reasoning": "",
                    "token_ids": [],
                    "tool_calls": {},
                    "logprobs": [],
                    "finish_reason": None,
                    "stop_reason": None,
                },
            )
            if chat:
                delta = choice.get("delta") or {}
                if answer["role"] is None and delta.get("role"):
                    answer["role"] = delta["role"]
                answer["text"] += delta.get("content") or ""
                answer["reasoning"] += delta.get("reasoning_content") or delta.get("reasoning") or ""
                for call in delta.get("tool_calls") or ():
                    _add_tool_call_delta(answer["tool_calls"], call)
            else:
                answer["text"] += choice.get("text") or ""
            answer["token_ids"].extend(choice.get("token_ids") or ())
            _add_logprobs(answer, choice.get("logprobs"), chat)
            if choice.get("finish_reason") is not None:
                answer["finish_reason"] = choice["finish_reason"]
                answer["stop_reason"] = choice.get("stop_reason")
    out["done"] = bool(stream) and stream[-1] == DONE
    return out


def _chat_chunk_with_only_token_ids(chunk: dict) -> bool:
    choices = chunk.get("choices")
    return (
        isinstance(choices, list)
        and bool(choices)
        and all(
            not c.get("delta") and c.get("logprobs") is None and c.get("finish_reason") is None
            for c in choices
        )
    )


def relayed(chunk: dict, chat: bool, client_wants_token_ids: bool) -> dict | None:
    """The chunk a client gets for one chunk of the decode leg, by the proxy's contract: the decode's
    retention handle removed; token ids the client did not ask for present and null, as a plain server
    streams them; a chat chunk that only carried such token ids not sent at all (vLLM's chat stream
    leaves those out when token ids are not asked for)."""
    chunk = {k: v for k, v in chunk.items() if k != "kv_transfer_params"}
    if client_wants_token_ids:
        return chunk
    if chat and _chat_chunk_with_only_token_ids(chunk):
        return None
    out = {k: None if k == "prompt_token_ids" else v for k, v in chunk.items()}
    if isinstance(out.get("choices"), list):
        out["choices"] = [
            {k: None if k in ("token_ids", "prompt_token_ids") else v for k, v in c.items()}
            for c in out["choices"]
        ]
    return out


def check_relayed(
    leg: list[dict | str], client: list[dict | str], chat: bool, client_wants_token_ids: bool = False
) -> None:
    """The proxy's output is the decode leg it relayed, chunk for chunk: none merged, split, dropped,
    reordered or altered beyond :func:`relayed`, and one ``[DONE]`` at the end."""
    assert leg and leg[-1] == DONE, "the decode leg ended with [DONE]"
    expected = [
        out
        for chunk in leg
        if isinstance(chunk, dict) and (out := relayed(chunk, chat, client_wants_token_ids)) is not None
    ]
    assert client[-1:] == [DONE], "the proxy ends the stream with [DONE]"
    sent = client[:-1]
    assert len(sent) == len(expected), f"{len(sent)} chunks relayed for {len(expected)} expected"
    for i, (mine, theirs) in enumerate(zip(sent, expected, strict=True)):
        assert mine == theirs, f"chunk {i} differs from the decode's"
