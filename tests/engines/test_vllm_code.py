"""kvloop's pieces that follow vLLM's own code, checked against the installed vLLM (no engines): a
decode request's retention opt-out, block hashes, and the tiny models' reasoning chat template
rendered by jinja2 (vLLM's template engine)."""

from __future__ import annotations

from kvloop.clients.bench.multiturn.setup import Session, next_turn_messages
from kvloop.common import block_hash


def test_only_a_decode_request_declines_retention():
    from kvloop.agents.connector.scheduler import declines_retention

    assert declines_retention({"kvloop_retain": False, "remote_block_ids": [[1]]})
    assert not declines_retention({"kvloop_retain": True})
    assert not declines_retention({"remote_block_ids": [[1]]})
    assert not declines_retention(None)
    # a prefill's request, or one whose KV load never ran: vLLM's own bookkeeping must see it
    assert not declines_retention({"kvloop_retain": False, "do_remote_decode": True})
    assert not declines_retention({"kvloop_retain": False, "do_remote_prefill": True})


def test_block_hashes_equal_vllms_own():
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.core import kv_cache_utils

    bs = 16
    tokens = list(range(100, 100 + 3 * bs))
    for name, fn in (("sha256_cbor", sha256_cbor), ("sha256", sha256)):
        parent, expected = fn("vllm-none-hash"), []
        for i in range(3):
            extra = (("cache_salt", "s"),) if i == 0 else None
            parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs], extra)
            expected.append(bytes(parent))
        assert block_hash.block_hashes(tokens, bs, name, cache_salt="s") == expected


def test_block_hashes_of_a_lora_request_equal_vllms_own():
    """vLLM's own request block hasher, on a salted LoRA request: the adapter's name and path enter
    every block."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    bs = 16
    tokens = list(range(100, 100 + 3 * bs + 5))
    kv_cache_utils.init_none_hash(sha256_cbor)
    request = Request(
        "r",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        lora_request=LoRARequest("tenant", 1, "/adapters/tenant"),
        cache_salt="s",
        block_hasher=kv_cache_utils.get_request_block_hasher(bs, sha256_cbor),
    )
    expected = [bytes(h) for h in request.block_hashes]
    assert len(expected) == 3
    ours = block_hash.block_hashes(
        tokens,
        bs,
        "sha256_cbor",
        # the seed vLLM resolved: PYTHONHASHSEED where this process has it (the engine fixtures set it)
        seed=kv_cache_utils.get_none_hash_seed(),
        cache_salt="s",
        lora=("tenant", "/adapters/tenant"),
    )
    assert ours == expected
    # another adapter path under the same name is other KV
    assert (
        block_hash.block_hashes(tokens, bs, "sha256_cbor", cache_salt="s", lora=("tenant", "/b"))[0]
        != ours[0]
    )


def test_reasoning_workload_drops_earlier_thinking_from_the_next_prompt():
    import jinja2

    from kvloop.clients.fleet.model import REASONING_CHAT_TEMPLATE

    template = jinja2.Environment().from_string(REASONING_CHAT_TEMPLATE)
    session = Session(seed=3, messages=[{"role": "user", "content": "Task: a b"}])
    generated = "kv cache block hash lease"
    before = template.render(messages=session.messages, add_generation_prompt=True)
    next_turn_messages(session, generated, 1, "reasoning", tool_tokens=5)
    after = template.render(messages=session.messages, add_generation_prompt=True)
    assert generated in session.messages[1]["content"]  # the history keeps what was generated
    assert after.startswith(before) and generated not in after  # the prompt drops the thinking
    assert after[len(before) :].startswith("Answer: ")
    plain = Session(seed=3, messages=[{"role": "user", "content": "Task: a b"}])
    next_turn_messages(plain, generated, 1, "plain", tool_tokens=5)
    assert template.render(messages=plain.messages, add_generation_prompt=True).startswith(before + generated)
