"""Tenant isolation through the proxy with real engines: a request under one `cache_salt` never pulls
KV that a request under another salt (or through another LoRA adapter) left on a decode, even when
its tokens are identical."""

from __future__ import annotations

from kvloop.clients.demo.conversation import AgentConversation, chat_turn
from tests.e2e.conftest import LORAS

MODEL = "kvloop-tiny"


def test_a_tenant_never_pulls_another_tenants_kv(served_stack):
    conversation = AgentConversation(seed=41, system_words=400, tool_words=200)
    # a first block of its own: the unsalted turn below may rightly pull the unsalted KV of other
    # tests' conversations (seed 41 opens test_metrics' too), and must find none of tenant a's
    conversation.messages[0]["content"] = "Tenant 41. " + conversation.messages[0]["content"]
    first = chat_turn(
        served_stack.proxy_url, MODEL, conversation.messages, 8, 1, extra={"cache_salt": "tenant-a"}
    )
    assert first.path in ("miss", "recompute"), first
    conversation.record(first.answer)
    assert served_stack.wait_turn_retained(conversation.messages[:-2], cache_salt="tenant-a"), (
        "tenant a's retained run never reached kvloopd"
    )

    # tenant b sends exactly tenant a's next prompt: nothing of a's may be pulled for it
    other = chat_turn(
        served_stack.proxy_url, MODEL, conversation.messages, 8, 2, extra={"cache_salt": "tenant-b"}
    )
    assert other.path != "transfer" and other.matched_tokens == 0 and other.bytes_moved == 0, other
    # unsalted, the same tokens hash differently again: no pull either
    plain = chat_turn(served_stack.proxy_url, MODEL, conversation.messages, 8, 2)
    assert plain.path != "transfer" and plain.matched_tokens == 0, plain

    # tenant a's own continuation pulls what it left (so the misses above were the salt's doing)
    own = chat_turn(
        served_stack.proxy_url, MODEL, conversation.messages, 8, 2, extra={"cache_salt": "tenant-a"}
    )
    assert (
        own.path == "transfer" and own.matched_tokens >= first.prompt_tokens // 2 and own.bytes_moved > 0
    ), own
    # and every tenant got the same greedy answer to the same tokens
    assert own.answer == other.answer == plain.answer


def test_a_lora_adapter_never_pulls_another_adapters_or_the_base_models_kv(served_stack):
    """Two tenants' LoRA adapters of one base model: the same tokens through another adapter (or the
    base model) compute other KV, so nothing one left on a decode may be pulled for another."""
    lora_a, lora_b = LORAS
    conversation = AgentConversation(seed=43, system_words=400, tool_words=200)
    # a first block of its own: every AgentConversation opens with the same words, whose base-model
    # KV other tests leave on the decodes (and the base model may rightly pull)
    conversation.messages[0]["content"] = "Tenant 43. " + conversation.messages[0]["content"]
    first = chat_turn(served_stack.proxy_url, lora_a, conversation.messages, 8, 1)
    assert first.path in ("miss", "recompute"), first
    conversation.record(first.answer)
    assert served_stack.wait_turn_retained(conversation.messages[:-2], lora_a), (
        "adapter a's retained run never reached kvloopd"
    )

    for model in (lora_b, MODEL):
        other = chat_turn(served_stack.proxy_url, model, conversation.messages, 8, 2)
        assert other.path != "transfer" and other.matched_tokens == 0 and other.bytes_moved == 0, (
            model,
            other,
        )
    own = chat_turn(served_stack.proxy_url, lora_a, conversation.messages, 8, 2)
    assert own.path == "transfer" and own.matched_tokens >= first.prompt_tokens // 2, own
