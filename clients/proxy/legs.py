"""How one OpenAI request splits into a prefill leg and a decode leg.

The prefill leg must compute exactly the KV the decode would compute for the prompt: every field that
enters the prompt's tokens or its KV-cache hash goes to the prefill as the client sent it. vLLM's own
request models say which those are: what `build_chat_params` hands the chat-template renderer (the
template and its kwargs, tools, tool_choice, response_format, documents, reasoning_effort, media
kwargs), what `build_tok_params` uses for tokenising (truncation, special tokens), the prompt itself,
the model (a LoRA adapter is a model name) and `cache_salt`. Every field that only feeds
`to_sampling_params` or the answer's shape is left out of the prefill leg, so vLLM's defaults apply
there and the prefill samples its one token without the client's constraints (`min_tokens` above the
prefill's `max_tokens=1` would be refused). The decode leg gets the client's request as sent.

`FIELDS` names every field of vLLM's `ChatCompletionRequest` and `CompletionRequest`; the tests check it
against the installed vLLM, so a field a new release adds fails them until it is placed here. A field
the proxy does not know (a newer vLLM's, an extension's) goes to both legs, as vLLM ignores fields it
does not know.

Some requests cannot be split: several answers from one prompt (`n > 1`, beam search; each answer is a
request of its own inside vLLM, and a prefill's handle serves one), prompt logprobs (the decode never
computes the prompt), a batch of prompts, prompt embeddings, and bodies vLLM will refuse anyway (not a
JSON object, no message list). `whole_request_reason` names why; the proxy sends such a request
unchanged to one decode server, which prefills and decodes it itself, as an aggregated vLLM would.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from kvloop.common.route_estimate import PULL_KEY, ROUTE_SETTLED_KEY


class Leg(Enum):
    PROMPT = "prompt"  # shapes the prompt's tokens or KV: both legs, as sent
    GENERATION = "generation"  # shapes only sampling or the answer: the decode leg only
    TRANSPORT = "transport"  # set by the proxy per leg


_P, _G, _T = Leg.PROMPT, Leg.GENERATION, Leg.TRANSPORT

# Fields both endpoints share.
_COMMON: dict[str, Leg] = {
    "model": _P,  # a LoRA adapter is served under its own model name
    "cache_salt": _P,  # enters every block hash
    "add_special_tokens": _P,
    "truncate_prompt_tokens": _P,
    "truncation_side": _P,
    "response_format": _P,  # the chat renderer takes it (some templates render it); json_object/_schema
    "ec_transfer_params": _P,  # encoder-cache transfer: the prompt's multimodal inputs
    "priority": _P,
    "user": _P,
    "session_id": _P,
    "vllm_xargs": _P,  # extensions' parameters: both legs, as for an unknown field
    "kv_transfer_params": _T,
    "stream": _T,
    "stream_options": _T,
    "request_id": _T,  # the client's id names the request it sees: the decode's
    "max_tokens": _G,
    "n": _G,
    "frequency_penalty": _G,
    "presence_penalty": _G,
    "repetition_penalty": _G,
    "logit_bias": _G,
    "logprobs": _G,
    "logprob_token_ids": _G,
    "prompt_logprobs": _G,  # never split: whole_request_reason
    "seed": _G,
    "stop": _G,
    "stop_token_ids": _G,
    "include_stop_str_in_output": _G,
    "temperature": _G,
    "top_p": _G,
    "top_k": _G,
    "min_p": _G,
    "min_tokens": _G,
    "ignore_eos": _G,
    "use_beam_search": _G,
    "length_penalty": _G,
    "watermarking": _G,
    "allowed_token_ids": _G,
    "bad_words": _G,
    "structured_outputs": _G,
    "repetition_detection": _G,
    "thinking_token_budget": _G,
    "skip_special_tokens": _G,
    "spaces_between_special_tokens": _G,
    "echo": _G,  # prepends the prompt (or last message) to the answer; with logprobs: whole request
    "return_token_ids": _G,
    "return_tokens_as_token_ids": _G,
    "return_token_offsets": _G,
    "mm_payload": _G,
    "return_mm_kwargs": _G,
    "routed_experts_prompt_start": _G,
    "stream_interval": _G,
}

FIELDS: dict[str, dict[str, Leg]] = {
    "chat": {
        **_COMMON,
        "messages": _P,
        "tools": _P,
        "tool_choice": _P,  # rendered by some templates; "required"/named also constrain the answer
        "chat_template": _P,
        "chat_template_kwargs": _P,
        "add_generation_prompt": _P,
        "continue_final_message": _P,
        "documents": _P,
        "reasoning_effort": _P,  # becomes the template's enable_thinking
        "media_io_kwargs": _P,
        "mm_processor_kwargs": _P,
        "max_completion_tokens": _G,
        "top_logprobs": _G,
        "parallel_tool_calls": _G,
        "include_reasoning": _G,
        "return_prompt_text": _G,
    },
    "completions": {
        **_COMMON,
        "prompt": _P,
        "prompt_embeds": _P,  # never split: whole_request_reason
        "suffix": _G,
    },
}


def _endpoint(chat: bool) -> str:
    return "chat" if chat else "completions"


def whole_request_reason(body: Any, chat: bool) -> str | None:
    """Why this request cannot be split into a prefill and a decode leg (it then goes whole to one
    decode server), or None."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    if chat and not isinstance(body.get("messages"), list):
        return "'messages' is not a list"
    if not chat:
        prompt = body.get("prompt")
        if body.get("prompt_embeds") is not None:
            return "prompt embeddings"
        if not isinstance(prompt, str | list) or not prompt:
            return "no prompt"
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            return "a batch of prompts"
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return "several answers (n > 1)"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs"
    if body.get("echo") and body.get("top_logprobs" if chat else "logprobs"):
        return "echo with logprobs (prompt logprobs)"
    return None


def prefill_body(body: dict, chat: bool, settled: str | None = None, pull: bool = True) -> dict:
    """The prefill leg: the fields that shape the prompt, as sent, and one token to sample; with
    `pull` false its connector uses the prefill's own prefix cache only."""
    fields = FIELDS[_endpoint(chat)]
    out = {k: v for k, v in body.items() if fields.get(k, Leg.PROMPT) is Leg.PROMPT}
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    if not pull:
        out["kv_transfer_params"][PULL_KEY] = False
    elif settled is not None:  # Route found nothing to pull beyond this prefill's own prefix
        out["kv_transfer_params"][ROUTE_SETTLED_KEY] = settled
    return out


def decode_body(body: dict, handle: dict) -> dict:
    """The decode leg: the client's request as sent, with the prefill's handle."""
    return {**body, "kv_transfer_params": handle}


def fields_table() -> str:
    """The placement of every field, as docs/proxy.md shows it (a Markdown table)."""
    rows = ["| field | chat | completions |", "|---|---|---|"]
    chat, completions = FIELDS["chat"], FIELDS["completions"]
    for name in sorted({*chat, *completions}):
        rows.append(
            f"| `{name}` | {chat[name].value if name in chat else '-'} | "
            f"{completions[name].value if name in completions else '-'} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(fields_table())
