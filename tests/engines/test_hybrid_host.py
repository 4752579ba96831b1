"""The host retention tier on a hybrid model: a chat continuation pulls the previous prompt even
though the decode freed that prompt's sliding-window blocks while it generated the answer.

The tiny Gemma-3-like model has a 128-token sliding window; each answer here is longer than that,
so when a turn finishes its decode keeps, in the sliding-window group, only the window at the
answer's end. A next prompt that agrees with the history only through the previous prompt (an
answer re-rendered differently, or dropped as reasoning models drop their thinking) needs the
window that ended with the previous prompt: the decode captured it into its host pool when the
prompt's KV arrived, and the run's host copy holds it. So do later copies: a regenerated answer, a
new conversation sharing the prompt, conversations going on side by side and a turn continued again
and again each pull at least the previous prompt's complete blocks. Every pull is checked group by
group, block by block, against a salted recompute of the same prompt.

This module has its own engine pair (a decode with a host pool; see conftest.EngineSlot).
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import BS, EnginePair, EngineSlot
from test_hybrid import (
    GROUP_BYTES,
    MODEL,
    check_against_recompute,
    prefill_and_check,
    rand_tokens,
    spans_of,
)
from test_reverse_pull import empty_prefill_cache

from kvloop.clients.fleet.model import HYBRID_SLIDING_WINDOW, build_tiny_hybrid
from tests.support import wait_until

pytestmark = pytest.mark.engines

ANSWER_TOKENS = HYBRID_SLIDING_WINDOW + 72  # past the window: the prompt's end leaves the decode's KV cache


@pytest.fixture(scope="module")
def hybrid_host(engine_slot: EngineSlot, tmp_path_factory: pytest.TempPathFactory) -> EnginePair:
    model_dir = build_tiny_hybrid(Path(tmp_path_factory.mktemp("tiny-hybrid-host")))
    # room for every copy the module's conversations make: none waits for a released copy's slots,
    # which come free a read window (kvloopd's, 30 s) after the release
    return engine_slot.get("hybrid-host", model_dir, MODEL, 2 * GROUP_BYTES, host_retention_gib=0.25)


def decode_and_copy(pair: EnginePair, prompt: list[int], prefill_params: dict[str, Any]) -> dict[str, Any]:
    """The decode answers ``prompt`` (its KV sent by the prefill) and retains the turn; until the
    run's host copy is in the directory."""
    (d,) = decode_and_copy_many(pair, [prompt], [prefill_params])
    return d


def decode_and_copy_many(
    pair: EnginePair, prompts: list[list[int]], prefill_params: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The decode answers ``prompts`` side by side (one batch), and retains each turn; until every
    run's host copy is in the directory."""
    ds = pair.decode.generate_many(
        [
            {"prompt_token_ids": p, "max_tokens": ANSWER_TOKENS, "kv_transfer_params": params}
            for p, params in zip(prompts, prefill_params, strict=True)
        ]
    )
    runs = [
        (d["kv_transfer_params"]["remote_request_id"], pair.decode.call("block_hashes", p)[0])
        for d, p in zip(ds, prompts, strict=True)
    ]
    rnd = random.Random(runs[0][0])

    def copied() -> bool:
        pair.decode.generate(rand_tokens(rnd, 8), 1)  # the in-process engine steps only for requests
        return all(pair.kvloop.locations(h, "retained", f"{handle}@host") for handle, h in runs)

    wait_until(copied, 30, "the runs' host copies announced")
    return ds


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


def complete(prompt: list[int]) -> int:
    """The tokens of ``prompt``'s complete blocks."""
    return len(prompt) // BS * BS


def partly_filled(rnd: random.Random, n: int) -> list[int]:
    """``n`` random tokens, ``n`` ending inside a block, short of its last token: the decode then
    holds every block of the window that ends with the prompt's last complete block (with one token
    short of a whole block more, vLLM already skips that window's first block when the KV arrives)."""
    assert 0 < n % BS < BS - 1, n
    return rand_tokens(rnd, n)


def continue_whole(pair: EnginePair, history: list[int], rnd: random.Random) -> list[int]:
    """The conversation goes on with its whole history (a later turn whose run starts with every
    block of the earlier one): the next turn is prefilled and decoded; returns its prompt."""
    nxt = history + rand_tokens(rnd, 70)
    empty_prefill_cache(pair)
    out, span = prefill_and_check(pair, nxt)
    assert span["kvloop.path"] == "transfer", span
    decode_and_copy(pair, nxt, out["kv_transfer_params"])
    return nxt


def test_a_regenerated_answer_pulls_its_prompt_each_time(hybrid_host):
    """The same prompt sent again, after its conversation already went on with a later turn (whose
    host copy starts with every block of this turn's): each regenerate pulls every complete block of
    the prompt, and the regenerated turn's own copy serves the next regenerate."""
    rnd = random.Random(36)
    prompt = partly_filled(rnd, 680)
    d = first_turn(hybrid_host, prompt)
    continue_whole(hybrid_host, prompt + d["token_ids"], rnd)
    for _ in range(2):
        empty_prefill_cache(hybrid_host)
        out, span = prefill_and_check(hybrid_host, prompt)
        assert pulled_from_host(span) >= complete(prompt), span
        decode_and_copy(hybrid_host, prompt, out["kv_transfer_params"])


def test_new_conversations_sharing_a_prompt_pull_it(hybrid_host):
    """New conversations that start with an earlier conversation's prompt (the same system prompt and
    document, another question), while that conversation goes on as well: each pulls every complete
    block of the shared prompt."""
    rnd = random.Random(37)
    prompt = partly_filled(rnd, 740)
    d = first_turn(hybrid_host, prompt)
    continue_whole(hybrid_host, prompt + d["token_ids"], rnd)
    for i in range(2):
        empty_prefill_cache(hybrid_host)
        branch = prompt + rand_tokens(rnd, 50 + 30 * i)
        out, span = prefill_and_check(hybrid_host, branch)
        assert pulled_from_host(span) >= complete(prompt), span
        decode_and_copy(hybrid_host, branch, out["kv_transfer_params"])


def prefill_many(pair: EnginePair, prompts: list[list[int]], salted: bool = False) -> list[dict[str, Any]]:
    """The prefill computes ``prompts`` side by side (one batch), each through kvloop, or with
    ``salted`` as a recompute of its own (no prefix hit, no directory match)."""
    return pair.prefill.generate_many(
        [
            {
                "prompt_token_ids": p,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
                "cache_salt": f"ref-{uuid.uuid4()}" if salted else None,
            }
            for p in prompts
        ]
    )


def side_by_side(
    pair: EnginePair, prompts: list[list[int]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``prompts`` prefilled side by side through kvloop, from an empty prefill cache, each checked
    against a recompute (also side by side: the prefill keeps the pulled KV only for its forward
    lease); their outputs and kvloop spans."""
    empty_prefill_cache(pair)
    outs = prefill_many(pair, prompts)
    spans = spans_of(pair, outs)
    refs = prefill_many(pair, prompts, salted=True)
    for prompt, out, ref in zip(prompts, outs, refs, strict=True):
        check_against_recompute(pair, prompt, out, ref)
    return outs, spans


def test_concurrent_conversations_each_pull_the_previous_prompt(hybrid_host):
    """Four conversations side by side. Their second turns continue the whole history (each later
    copy starts with every block of the first turn's), prefilled and decoded side by side; then their
    next requests, side by side again, are each of another kind: the first answer regenerated, a new
    conversation sharing the first prompt, the first turn continued once more, and the third turn
    after the second answer, re-rendered. Each pulls at least the complete blocks of the prompt it
    continues, and its KV equals a recompute's."""
    rnd = random.Random(38)
    firsts = [partly_filled(rnd, n) for n in (610, 675, 740, 805)]
    histories = [p + first_turn(hybrid_host, p)["token_ids"] for p in firsts]
    seconds = [h + rand_tokens(rnd, 60 + 10 * i) for i, h in enumerate(histories)]
    outs, spans = side_by_side(hybrid_host, seconds)
    for span, history in zip(spans, histories, strict=True):
        assert span["kvloop.path"] == "transfer", span
        assert span["kvloop.pulled_tokens"] >= (len(history) - 1) // BS * BS, span
    answers = decode_and_copy_many(hybrid_host, seconds, [o["kv_transfer_params"] for o in outs])
    nexts = [
        firsts[0],  # the first answer regenerated
        firsts[1] + rand_tokens(rnd, 70),  # a new conversation sharing the first prompt
        histories[2] + rand_tokens(rnd, 90),  # the first turn continued once more
        seconds[3] + answers[3]["token_ids"][:5] + rand_tokens(rnd, 50),  # the answer re-rendered
    ]
    continued = [complete(firsts[0]), complete(firsts[1]), complete(histories[2][:-1]), complete(seconds[3])]
    _outs, spans = side_by_side(hybrid_host, nexts)
    pulled = [pulled_from_host(s) if s["kvloop.path"] == "transfer" else s for s in spans]
    assert all(isinstance(x, int) and x >= n for x, n in zip(pulled, continued, strict=True)), pulled


def test_a_run_continued_again_and_again_serves_each_continuation(hybrid_host):
    """The same turn continued several times (the user's next message rewritten and sent again),
    each continuation decoded: every one pulls the whole history but its partly filled last block,
    so at least the previous prompt's complete blocks."""
    rnd = random.Random(39)
    prompt = partly_filled(rnd, 660)
    d = first_turn(hybrid_host, prompt)
    history = prompt + d["token_ids"]
    with_kv = len(history) - 1  # the last sampled token has no KV on the decode
    for i in range(3):
        empty_prefill_cache(hybrid_host)
        nxt = history + rand_tokens(rnd, 60 + 20 * i)
        out, span = prefill_and_check(hybrid_host, nxt)
        assert span["kvloop.path"] == "transfer", span
        assert span["kvloop.pulled_tokens"] >= with_kv // BS * BS >= complete(prompt), span
        decode_and_copy(hybrid_host, nxt, out["kv_transfer_params"])
