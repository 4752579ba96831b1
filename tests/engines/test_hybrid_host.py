"""The host retention tier on a hybrid model: a chat continuation pulls the previous prompt even
though the decode freed that prompt's sliding-window blocks while it generated the answer.

The tiny Gemma-3-like model has a 128-token sliding window; each answer here is longer than that,
so when a turn finishes its decode keeps, in the sliding-window group, only the window at the
answer's end. A next prompt that agrees with the history only through the previous prompt (an
answer re-rendered differently, or dropped as reasoning models drop their thinking) needs the
window that ended with the previous prompt: the decode captured it into its host pool when the
prompt's KV arrived, and the run's host copy holds it. Every pull is checked group by group, block
by block, against a salted recompute of the same prompt.

This module has its own engine pair (a decode with a host pool; see conftest.EngineSlot).
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import BS, EnginePair, EngineSlot
from test_hybrid import GROUP_BYTES, MODEL, prefill_and_check, rand_tokens
from test_reverse_pull import empty_prefill_cache

from kvloop.clients.fleet.model import HYBRID_SLIDING_WINDOW, build_tiny_hybrid
from tests.support import wait_until

pytestmark = pytest.mark.engines

ANSWER_TOKENS = HYBRID_SLIDING_WINDOW + 72  # past the window: the prompt's end leaves the decode's KV cache


@pytest.fixture(scope="module")
def hybrid_host(engine_slot: EngineSlot, tmp_path_factory: pytest.TempPathFactory) -> EnginePair:
    model_dir = build_tiny_hybrid(Path(tmp_path_factory.mktemp("tiny-hybrid-host")))
    return engine_slot.get("hybrid-host", model_dir, MODEL, 2 * GROUP_BYTES, host_retention_gib=0.1)


def decode_and_copy(pair: EnginePair, prompt: list[int], prefill_params: dict[str, Any]) -> dict[str, Any]:
    """The decode answers ``prompt`` (its KV sent by the prefill) and retains the turn; until the
    run's host copy is in the directory."""
    d = pair.decode.generate(prompt, ANSWER_TOKENS, prefill_params)
    handle = d["kv_transfer_params"]["remote_request_id"]
    first_hash = pair.decode.call("block_hashes", prompt)[0]
    rnd = random.Random(handle)

    def copied() -> list:
        pair.decode.generate(rand_tokens(rnd, 8), 1)  # the in-process engine steps only for requests
        return pair.kvloop.locations(first_hash, "retained", f"{handle}@host")

    wait_until(copied, 30, "the run's host copy announced")
    return d


def first_turn(pair: EnginePair, prompt: list[int]) -> dict[str, Any]:
    p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
    d = decode_and_copy(pair, prompt, p["kv_transfer_params"])
    pair.prefill.call("spans")
    return d


def pulled_from_host(span: dict[str, Any]) -> int:
    assert span["kvloop.path"] == "transfer" and span["kvloop.tier"] == "host", span
    return int(span["kvloop.pulled_tokens"])


@pytest.mark.parametrize("seed", [31, 32, 33])
def test_a_continuation_that_departs_after_the_previous_prompt_pulls_that_prompt(hybrid_host, seed):
    """The answer dropped from the history (the next prompt departs right after the previous one):
    every complete block of the previous prompt is pulled, in both groups, from the host copy."""
    rnd = random.Random(seed)
    prompt = rand_tokens(rnd, rnd.randrange(400, 900))
    d = first_turn(hybrid_host, prompt)
    assert len(d["token_ids"]) == ANSWER_TOKENS
    nxt = prompt + rand_tokens(rnd, 90)
    pf = prefill_and_check(hybrid_host, nxt)
    assert pulled_from_host(pf[1]) >= len(prompt) // BS * BS


def test_a_conversation_pulls_each_previous_prompt_from_the_host_copy(hybrid_host):
    """Three turns, each answer re-rendered differently after its first tokens: each turn pulls at
    least the previous prompt (the previous turn's host copy holds that prompt's window), and its
    decode captures its own prompt's window for the next."""
    rnd = random.Random(34)
    prompt = rand_tokens(rnd, 600)
    d = first_turn(hybrid_host, prompt)
    for _turn in range(2, 5):
        history = prompt + d["token_ids"][:5]  # the answer's first tokens agree, the rest re-rendered
        nxt = history + rand_tokens(rnd, 40) + rand_tokens(rnd, 80)
        empty_prefill_cache(hybrid_host)  # as a prefill that did not serve the previous turn
        out, span = prefill_and_check(hybrid_host, nxt)
        assert pulled_from_host(span) >= len(prompt) // BS * BS
        d = decode_and_copy(hybrid_host, nxt, out["kv_transfer_params"])
        prompt = nxt


def test_a_continuation_of_the_whole_history_still_pulls_it_whole(hybrid_host):
    """The history agreeing to its end: the run's last window (in its KV cache or its copy) serves
    the whole history, as without a host tier."""
    rnd = random.Random(35)
    prompt = rand_tokens(rnd, 700)
    d = first_turn(hybrid_host, prompt)
    history = prompt + d["token_ids"]
    out, span = prefill_and_check(hybrid_host, history + rand_tokens(rnd, 60))
    assert span["kvloop.path"] == "transfer", span
    assert span["kvloop.pulled_tokens"] >= (len(history) - 1) // BS * BS
    assert out["kv_transfer_params"]["remote_request_id"]
