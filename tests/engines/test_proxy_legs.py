"""The proxy's split of a request into a prefill and a decode leg, checked against the installed vLLM's
own request models: every field is placed, and no field left off the prefill leg changes the prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvloop.clients.proxy.legs import FIELDS, Leg

vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
vllm_completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")

MODELS = {
    "chat": vllm_chat.ChatCompletionRequest,
    "completions": vllm_completion.CompletionRequest,
}
BASE = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hello"}]},
    "completions": {"model": "m", "prompt": "hello"},
}
# A value other than the default for every field the prefill leg leaves out.
SAMPLES: dict[str, object] = {
    "max_tokens": 7,
    "max_completion_tokens": 7,
    "n": 2,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {"5": 1.0},
    "logprobs": 2,
    "top_logprobs": 2,
    "logprob_token_ids": [1, 2],
    "prompt_logprobs": 1,
    "seed": 3,
    "stop": ["x"],
    "stop_token_ids": [4],
    "include_stop_str_in_output": True,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.1,
    "min_tokens": 3,
    "ignore_eos": True,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "watermarking": True,
    "allowed_token_ids": [1, 2, 3],
    "bad_words": ["bad"],
    "structured_outputs": {"regex": "[a-z]+"},
    "repetition_detection": None,
    "thinking_token_budget": 10,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "echo": True,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "return_token_offsets": True,
    "mm_payload": "none",
    "return_mm_kwargs": False,
    "routed_experts_prompt_start": 2,
    "stream_interval": 2,
    "parallel_tool_calls": False,
    "include_reasoning": False,
    "return_prompt_text": True,
    "suffix": "end",
}
# Fields vLLM accepts only beside another one, per endpoint.
COMPANIONS: dict[tuple[str, str], dict[str, object]] = {
    ("chat", "logprobs"): {"logprobs": True},
    ("chat", "top_logprobs"): {"logprobs": True},
    ("chat", "logprob_token_ids"): {"logprobs": True},
    ("completions", "logprob_token_ids"): {"logprobs": 2},
}
# What only checks the answer's length or decides detokenising, not the prompt's tokens.
NOT_PROMPT = {"max_output_tokens", "max_output_tokens_param", "needs_detokenization", "return_token_offsets"}


def _prompt_inputs(endpoint: str, request) -> tuple:
    tok = request.build_tok_params(SimpleNamespace(max_model_len=4096))
    tok_fields = {k: v for k, v in vars(tok).items() if k not in NOT_PROMPT}
    chat = request.build_chat_params(None, "auto") if endpoint == "chat" else None
    return chat, tok_fields


@pytest.mark.parametrize("endpoint", sorted(MODELS))
def test_every_field_of_vllms_request_model_is_placed(endpoint):
    """A field a new vLLM adds fails here until legs.FIELDS says which leg it belongs to."""
    known = set(FIELDS[endpoint])
    fields = set(MODELS[endpoint].model_fields)
    assert fields - known == set(), "fields of vLLM's request model that legs.FIELDS does not place"
    assert known - fields == set(), "fields legs.FIELDS places that vLLM's request model does not have"


@pytest.mark.parametrize(
    "endpoint, name",
    [(e, n) for e in sorted(FIELDS) for n, leg in sorted(FIELDS[e].items()) if leg is Leg.GENERATION],
)
def test_a_field_left_off_the_prefill_leg_does_not_change_the_prompt(endpoint, name):
    """vLLM's own prompt building (chat-template parameters, tokenising parameters) is the same with the
    field set as without it."""
    assert name in SAMPLES, f"add a non-default sample value for {name!r}"
    model = MODELS[endpoint]
    base = model.model_validate(BASE[endpoint])
    try:
        varied = model.model_validate(
            {**BASE[endpoint], name: SAMPLES[name], **COMPANIONS.get((endpoint, name), {})}
        )
    except ValueError as exc:  # a combination vLLM refuses alone (it needs another field): no prompt
        pytest.fail(f"sample for {name!r} is refused by vLLM: {exc}")
    assert _prompt_inputs(endpoint, varied) == _prompt_inputs(endpoint, base)
