"""The stream checks of the proxy conformance suite (tests/sse_stream.py): reading a stream does not
depend on where its chunks were cut, and the relay check fails on a relay that merges, splits, drops,
reorders or alters a decode chunk, while the proxy's own relay (StreamState.forward) passes it."""

from __future__ import annotations

import copy

import pytest

from kvloop.clients.proxy.failover import StreamState
from tests.sse_stream import DONE, check_relayed, check_well_formed, read

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def chat(choices: list[dict], **extra) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": choices,
        **extra,
    }


def token(text: str, ids: list[int], lp: float, finish: str | None = None) -> dict:
    return {
        "index": 0,
        "delta": {"content": text} if text else {},
        "logprobs": {"content": [{"token": text, "logprob": lp, "bytes": None, "top_logprobs": []}]}
        if text
        else None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": ids,
    }


def decode_leg() -> list[dict | str]:
    """A decode's chat stream as the proxy asks for it (token ids in every chunk, a retention handle
    in the last), with a chunk that only carries token ids."""
    return [
        chat(
            [{**token("", [], 0.0), "delta": {"role": "assistant", "content": ""}}], prompt_token_ids=[1, 2]
        ),
        chat([token("ab", [5], -0.5)]),
        chat([token("", [6], 0.0)]),  # token ids only: a plain server leaves it out
        chat([token("cd", [7], -0.25)]),
        chat([token("", [], 0.0, finish="length")], kv_transfer_params={"remote_block_ids": [[3]]}),
        chat([], usage={"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}),
        DONE,
    ]


def proxy_relay(leg: list[dict | str]) -> list[dict | str]:
    """What the proxy sends for a decode leg: its own StreamState.forward, chunk by chunk."""
    stream = StreamState(chat=True, body=BODY)
    out: list[dict | str] = [c for x in leg if isinstance(x, dict) if (c := stream.forward(copy.deepcopy(x)))]
    return [*out, DONE]


def test_the_proxys_own_relay_passes():
    leg = decode_leg()
    client = proxy_relay(leg)
    check_relayed(leg, client, chat=True)
    check_well_formed(client, chat=True)
    assert all("kv_transfer_params" not in c for c in client if isinstance(c, dict))


def _merge(stream: list) -> list:
    """The second and third content chunks merged into one, as a relay that batched them would."""
    out = copy.deepcopy(stream)
    first, second = out[1], out[2]
    first["choices"][0]["delta"]["content"] += second["choices"][0]["delta"]["content"]
    first["choices"][0]["logprobs"]["content"] += second["choices"][0]["logprobs"]["content"]
    return [*out[:2], *out[3:]]


def _split(stream: list) -> list:
    out = copy.deepcopy(stream)
    half = copy.deepcopy(out[1])
    out[1]["choices"][0]["delta"]["content"] = "a"
    half["choices"][0]["delta"]["content"] = "b"
    return [*out[:2], half, *out[2:]]


def _alter(stream: list) -> list:
    out = copy.deepcopy(stream)
    out[1]["choices"][0]["logprobs"]["content"][0]["logprob"] = -9.0
    return out


BROKEN = {
    "merged": _merge,
    "split": _split,
    "dropped": lambda s: [*s[:1], *s[2:]],
    "reordered": lambda s: [s[0], s[2], s[1], *s[3:]],
    "altered": _alter,
    "without_done": lambda s: [*s[:-1], s[-2]],
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_a_relay_that_breaks_the_decodes_chunks_fails(fault):
    leg = decode_leg()
    broken = BROKEN[fault](proxy_relay(leg))
    with pytest.raises(AssertionError):
        check_relayed(leg, broken, chat=True)


def test_reading_a_stream_does_not_depend_on_its_chunk_boundaries():
    """The same answer with the finish reason in a chunk of its own, or with the last token."""
    apart = proxy_relay(decode_leg())
    together = copy.deepcopy(apart)
    assert apart[3]["choices"][0]["finish_reason"] == "length" and not apart[3]["choices"][0]["delta"]
    last = together[2]["choices"][0]
    last["finish_reason"], last["stop_reason"] = "length", None
    together = [*together[:3], *together[4:]]
    assert len(together) == len(apart) - 1
    assert read(apart, chat=True) == read(together, chat=True)
    answer = read(apart, chat=True)["answers"][0]
    assert answer["text"] == "abcd" and answer["role"] == "assistant"
    assert answer["finish_reason"] == "length" and [x["logprob"] for x in answer["logprobs"]] == [-0.5, -0.25]


def test_reading_tells_answers_apart():
    stream = proxy_relay(decode_leg())
    other = copy.deepcopy(stream)
    other[1]["choices"][0]["delta"]["content"] = "xx"
    assert read(stream, chat=True) != read(other, chat=True)


def test_a_stream_without_done_is_not_well_formed():
    with pytest.raises(AssertionError):
        check_well_formed(proxy_relay(decode_leg())[:-1], chat=True)
