"""How the proxy continues a broken stream: the continuation request it builds and how it rewrites the
continuation's chunks (the engine-level behaviour is in tests/e2e/test_proxy_failover.py)."""

from __future__ import annotations

import pytest

from kvloop.clients.proxy.failover import StreamState, unresumable_reason

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 10,
    "min_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def chat_chunk(choice: dict | None, **extra) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [choice] if choice else [],
        **extra,
    }


def broken_after_three_tokens(body: dict) -> StreamState:
    stream = StreamState(chat=True, body=body)
    first = stream.forward(
        chat_chunk(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
            prompt_token_ids=[1, 2],
        )
    )
    assert first["prompt_token_ids"] is None  # the client did not ask for token ids: null, as vLLM sends
    out = stream.forward(
        chat_chunk({"index": 0, "delta": {"content": "abc"}, "finish_reason": None, "token_ids": [5, 6, 7]})
    )
    assert out["choices"][0]["token_ids"] is None and out["choices"][0]["delta"] == {"content": "abc"}
    return stream


def test_continuation_prompt_is_prompt_and_sent_tokens_with_the_budget_left():
    stream = broken_after_three_tokens(CHAT)
    assert stream.unresumable_reason() is None
    body = stream.resume_body()
    assert body["prompt"] == [1, 2, 5, 6, 7]
    assert body["max_tokens"] == 7 and body["min_tokens"] == 1
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["return_token_ids"] is True
    assert "messages" not in body


def test_continuation_chunks_become_chunks_of_the_original_stream_and_usage_counts_the_whole_answer():
    stream = broken_after_three_tokens(CHAT)
    completion = {"id": "cmpl-9", "object": "text_completion", "created": 99, "model": "m"}
    middle = stream.translate(
        {**completion, "choices": [{"index": 0, "text": "de", "token_ids": [8, 9], "finish_reason": None}]}
    )
    assert middle == chat_chunk(
        {"index": 0, "delta": {"content": "de"}, "logprobs": None, "finish_reason": None, "token_ids": None}
    )
    last = stream.translate(
        {
            **completion,
            "choices": [
                {"index": 0, "text": "f", "token_ids": [3], "finish_reason": "length", "stop_reason": None}
            ],
        }
    )
    assert last is not None and last["choices"][0]["finish_reason"] == "length"
    assert stream.translate({**completion, "choices": [], "usage": {"prompt_tokens": 8}}) is None
    assert stream.usage_chunk()["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert stream.finished and stream.remaining_tokens() == 4


def test_token_ids_stay_when_the_client_asked_for_them():
    stream = StreamState(chat=True, body={**CHAT, "return_token_ids": True})
    chunk = chat_chunk({"index": 0, "delta": {"content": "a"}, "finish_reason": None, "token_ids": [4]})
    assert stream.forward(chunk) == chunk


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"temperature": 0.7}, "sampled"),
        ({"temperature": None}, "sampled"),  # vLLM's default samples
        ({"stop": ["\n"]}, "'stop'"),
        ({"presence_penalty": 0.5}, "'presence_penalty'"),
        ({"echo": True}, "'echo'"),
    ],
)
def test_what_cannot_be_continued_exactly(change, fragment):
    body = {k: v for k, v in {**CHAT, **change}.items() if v is not None}
    assert fragment in (unresumable_reason(body, chat=True) or "")


def test_a_stream_without_prompt_token_ids_cannot_be_continued():
    stream = StreamState(chat=True, body=CHAT)
    stream.forward(chat_chunk({"index": 0, "delta": {"content": "a"}, "finish_reason": None}))
    assert "prompt token ids" in (stream.unresumable_reason() or "")


def test_completions_streams_carry_prompt_token_ids_in_the_choice():
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "stream": True}
    stream = StreamState(chat=False, body=body)
    assert stream.upstream_body(body)["return_token_ids"] is True
    out = stream.forward(
        {
            "id": "cmpl-1",
            "created": 3,
            "model": "m",
            "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2], "token_ids": [9]}],
        }
    )
    assert out["choices"][0] == {"index": 0, "text": "a", "prompt_token_ids": None, "token_ids": None}
    assert stream.resume_body()["prompt"] == [1, 2, 9] and stream.resume_body()["max_tokens"] == 4


def test_streams_that_cannot_be_continued_are_not_asked_for_token_ids():
    body = {"model": "m", "prompt": "hi", "echo": True, "temperature": 0, "stream": True}
    assert "return_token_ids" not in StreamState(chat=False, body=body).upstream_body(body)


def test_logprobs_continue_in_the_chat_format():
    body = {**CHAT, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    stream = broken_after_three_tokens(body)
    request = stream.resume_body()
    assert request["logprobs"] == 1 and request["return_tokens_as_token_ids"] is True
    out = stream.translate(
        {
            "id": "cmpl-9",
            "created": 99,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": "de",
                    "token_ids": [8, 9],
                    "finish_reason": None,
                    "logprobs": {
                        "tokens": ["token_id:8", "token_id:9"],
                        "token_logprobs": [-0.5, -1.5],
                        "top_logprobs": [
                            {"token_id:8": -0.5, "token_id:2": -2.0},
                            {"token_id:4": -1.0, "token_id:9": -1.5},
                        ],
                    },
                }
            ],
        }
    )
    assert out is not None
    content = out["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("token_id:8", -0.5), ("token_id:9", -1.5)]
    # the best alternatives, best first, as many as the client asked for
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["token_id:8"]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["token_id:4"]


def test_a_chat_chunk_that_only_carried_token_ids_is_left_out_as_vllm_leaves_it_out():
    """The proxy asks the decode for token ids (to continue a broken stream); vLLM then sends a chunk
    for a token whose text is still empty, which a plain server's stream does not have."""
    stream = StreamState(chat=True, body=CHAT)
    assert (
        stream.forward(chat_chunk({"index": 0, "delta": {}, "finish_reason": None, "token_ids": [7]})) is None
    )
    assert stream.sent_token_ids == [7]  # still counted for a continuation
    last = chat_chunk({"index": 0, "delta": {}, "finish_reason": "length", "token_ids": [8]})
    assert stream.forward(last) is not None  # the finish is sent
    asked = StreamState(chat=True, body={**CHAT, "return_token_ids": True})
    assert asked.forward(chat_chunk({"index": 0, "delta": {}, "finish_reason": None, "token_ids": [7]}))
