"""The proxy's split of a request: what the prefill leg keeps, and which requests go whole to a decode."""

from __future__ import annotations

import pytest

from kvloop.clients.proxy.legs import decode_body, prefill_body, whole_request_reason

MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_prefill_leg_keeps_what_shapes_the_prompt_and_drops_what_only_shapes_the_answer():
    body = {
        "model": "tenant-lora",
        "messages": MESSAGES,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
        "cache_salt": "salt",
        "truncate_prompt_tokens": 100,
        "response_format": {"type": "json_object"},
        "min_tokens": 50,
        "max_tokens": 50,
        "ignore_eos": True,
        "stop": ["x"],
        "logit_bias": {"5": 2.0},
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "a_future_field": 1,
    }
    out = prefill_body(body, chat=True, settled="k")
    for kept in ("model", "messages", "tools", "tool_choice", "chat_template_kwargs", "cache_salt"):
        assert out[kept] == body[kept]
    assert out["truncate_prompt_tokens"] == 100 and out["response_format"] == {"type": "json_object"}
    for dropped in ("min_tokens", "ignore_eos", "stop", "logit_bias", "logprobs", "top_logprobs", "seed"):
        assert dropped not in out
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True and len(out["kv_transfer_params"]) == 2
    assert (
        out["a_future_field"] == 1
    )  # unknown to the proxy: both legs, as vLLM ignores what it does not know
    assert body["min_tokens"] == 50 and "kv_transfer_params" not in body  # the client's body is not changed


def test_the_completions_prefill_leg_has_no_chat_only_cap():
    out = prefill_body({"model": "m", "prompt": "p", "echo": True, "suffix": "s"}, chat=False)
    assert out == {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip


def test_a_prefill_leg_without_pull_asks_its_connector_for_the_own_cache_only():
    out = prefill_body({"model": "m", "prompt": "p"}, chat=False, settled="miss", pull=False)
    # settling is moot: with no pull the connector asks no Lookup anyway
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "kvloop_pull": False}


def test_the_decode_leg_is_the_request_as_sent_with_the_handle():
    body = {"model": "m", "messages": MESSAGES, "min_tokens": 5, "stream": True}
    assert decode_body(body, {"remote_engine_id": "p"}) == {
        **body,
        "kv_transfer_params": {"remote_engine_id": "p"},
    }


@pytest.mark.parametrize(
    "body, chat, reason",
    [
        ([1], True, "not a JSON object"),
        ({"messages": "hi"}, True, "'messages' is not a list"),
        ({"prompt": ["a", "b"]}, False, "a batch of prompts"),
        ({"prompt": ""}, False, "no prompt"),
        ({"prompt_embeds": "x"}, False, "prompt embeddings"),
        ({"messages": MESSAGES, "n": 2}, True, "n > 1"),
        ({"prompt": "p", "use_beam_search": True}, False, "beam search"),
        ({"prompt": "p", "prompt_logprobs": 0}, False, "prompt logprobs"),
        ({"prompt": "p", "echo": True, "logprobs": 1}, False, "echo with logprobs"),
        (
            {"messages": MESSAGES, "echo": True, "logprobs": True, "top_logprobs": 2},
            True,
            "echo with logprobs",
        ),
    ],
)
def test_requests_that_cannot_be_split_say_why(body, chat, reason):
    assert reason in (whole_request_reason(body, chat) or "")


@pytest.mark.parametrize(
    "body, chat",
    [
        ({"messages": MESSAGES, "n": 1, "min_tokens": 9, "echo": True}, True),
        ({"prompt": [1, 2, 3], "logprobs": 2}, False),
        ({"prompt": "p", "echo": True}, False),
        ({"messages": [], "n": True}, True),  # vLLM refuses it on the prefill leg, as it would whole
    ],
)
def test_requests_that_split(body, chat):
    assert whole_request_reason(body, chat) is None


def test_the_docs_show_the_placement_the_proxy_uses():
    from pathlib import Path

    from kvloop.clients.proxy.legs import fields_table

    docs = (Path(__file__).parents[1] / "docs" / "proxy.md").read_text()
    assert fields_table() in docs, "regenerate the table: python -m kvloop.clients.proxy.legs"
