"""KvloopConnector on a hybrid model: sliding-window and full-attention layers, two KV-cache groups.

The tiny Gemma-3-like model (``build_tiny_hybrid``: layers alternate a 128-token sliding window and
full attention) gets two KV-cache groups from vLLM's hybrid allocator. A decode keeps every block of
the full-attention group but only the last window of the sliding-window group (vLLM freed the rest
while decoding). Every pull is checked group by group, block by block, against a recompute of the
same prompt on the same engine (salted: no prefix hit, no directory match).

This module has its own engine pair (see conftest.EngineSlot); it runs after the other engine tests.
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import BS, EnginePair, EngineSlot, Run
from test_reverse_pull import empty_prefill_cache

from kvloop.agents.connector.decode import NULL_BLOCK, aligned
from kvloop.clients.fleet.model import HYBRID_SLIDING_WINDOW, build_tiny_hybrid
from kvloop.v1 import directory_pb2 as pb

pytestmark = pytest.mark.engines

MODEL = "tiny-hybrid"
# The decode computed generated tokens' KV one at a time and the recompute in one batch: bf16
# rounding differs by a step, and Gemma's V values reach [4, 8) where a step is 0.03125. Differences
# are counted in bf16 steps at each value's magnitude, and the sliding-window layers after a full-
# attention layer carry that through: measured up to 4 steps. KV of the wrong tokens differs by
# hundreds of steps (each check measures that too, on neighbouring blocks).
KV_TOL_STEPS = 8.0
WRONG_KV_STEPS = 50.0
# 2 (K, V) x 32 tokens x 6 heads x 64 dims x 2 bytes (bf16) x 4 layers (2 per group)
GROUP_BYTES = 2 * 32 * 6 * 64 * 2 * 2
WINDOW_BLOCKS = HYBRID_SLIDING_WINDOW // BS


@pytest.fixture(scope="module")
def hybrid(engine_slot: EngineSlot, tmp_path_factory: pytest.TempPathFactory) -> EnginePair:
    model_dir = build_tiny_hybrid(Path(tmp_path_factory.mktemp("tiny-hybrid")))
    pair = engine_slot.get("hybrid", model_dir, MODEL, 2 * GROUP_BYTES)
    groups = pair.prefill.call("kv_groups")
    assert [(g["kind"], g["sliding_window"]) for g in groups] == [
        ("SlidingWindowSpec", HYBRID_SLIDING_WINDOW),
        ("FullAttentionSpec", 0),
    ], groups
    return pair


def rand_tokens(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(2, 1024) for _ in range(n)]


def group_diffs(
    pair: EnginePair, a: dict[str, Any], b: dict[str, Any], n_tokens: int, control: bool = False
) -> list[list[float]]:
    """Per group, max |KV difference| of every full block both prefills hold (by position)."""
    nfull = n_tokens // BS
    a_groups = a["kv_transfer_params"]["remote_block_ids"]
    b_groups = b["kv_transfer_params"]["remote_block_ids"]
    total = max(len(g) for g in (*a_groups, *b_groups))
    a_ids, b_ids = [], []
    for ga, gb in zip(aligned(a_groups, total), aligned(b_groups, total), strict=True):
        pos = [p for p in range(nfull) if ga[p] != NULL_BLOCK and gb[p] != NULL_BLOCK]
        a_ids.append([ga[p] for p in pos])
        b_ids.append([gb[p] for p in pos])
    # the full-attention group holds every full block; the sliding-window group its window
    assert control or (len(a_ids[1]) == nfull and WINDOW_BLOCKS <= len(a_ids[0]) <= WINDOW_BLOCKS + 1), a_ids
    return pair.prefill.call("kv_diff_groups", {"a": a_ids, "b": b_ids})


def prefill_and_check(pair: EnginePair, prompt: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Prefill through kvloop and as a salted recompute; KV of both groups equal, block by block."""
    out = pair.prefill.generate(prompt, 1, {"do_remote_decode": True})
    (span,) = spans_of(pair, [out])
    check_against_recompute(pair, prompt, out)
    return out, span


def spans_of(pair: EnginePair, outs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prefill's kvloop span of each of ``outs`` (its prefills since the last call), in order."""
    spans = pair.prefill.call("spans")
    found = []
    for out in outs:
        rid = out["kv_transfer_params"]["remote_request_id"]
        (span,) = [s for s in spans if s.get("kvloop.request_id") == rid]
        found.append(span)
    return found


def check_against_recompute(
    pair: EnginePair, prompt: list[int], out: dict[str, Any], ref: dict[str, Any] | None = None
) -> None:
    """``out``, the prefill of ``prompt`` through kvloop, against ``ref``, a salted recompute of it
    (made here when not given): KV of both groups equal, block by block, and the same token."""
    if ref is None:
        ref = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"ref-{uuid.uuid4()}")
    diffs = group_diffs(pair, out, ref, len(prompt))
    # the negative control: each block against the reference's next block (other tokens' KV)
    shifted = dict(
        ref,
        kv_transfer_params={
            **ref["kv_transfer_params"],
            "remote_block_ids": [[*list(g[1:]), g[0]] for g in ref["kv_transfer_params"]["remote_block_ids"]],
        },
    )
    assert all(
        min(d) > WRONG_KV_STEPS for d in group_diffs(pair, out, shifted, len(prompt) - BS, control=True)
    )
    for g, d in enumerate(diffs):
        bad = [i for i, x in enumerate(d) if x > KV_TOL_STEPS]
        assert d and not bad, f"group {g}: blocks {bad} differ by up to {max(d)} bf16 steps"
    assert out["token_ids"] == ref["token_ids"]


def decode_turn(pair: EnginePair, prompt: list[int], p_params: dict[str, Any], n: int) -> dict[str, Any]:
    d = pair.decode.generate(prompt, n, p_params)
    run = Run(
        d["kv_transfer_params"]["remote_request_id"],
        pair.decode.call("block_hashes", prompt),
        time.monotonic(),
    )
    pair.kvloop.wait_for_run(run)
    return d


def first_turn(pair: EnginePair, prompt: list[int], n: int) -> dict[str, Any]:
    p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
    d = decode_turn(pair, prompt, p["kv_transfer_params"], n)
    pair.prefill.call("spans")
    return d


def test_retained_run_holds_every_full_attention_block_and_the_last_window(hybrid):
    rnd = random.Random(21)
    prompt = rand_tokens(rnd, 700)
    d = first_turn(hybrid, prompt, 36)
    handle = d["kv_transfer_params"]["remote_request_id"]
    hashes = hybrid.decode.call("block_hashes", prompt + d["token_ids"])
    n = (700 + 36 - 1) // BS  # complete blocks with KV
    ans = hybrid.kvloop.client.lookup(MODEL, hashes[:n], requester="prefill-0", block_size=BS)
    assert ans.decision == pb.DECISION_TRANSFER, ans
    h = ans.holder
    assert h.retention_handle == handle and h.num_groups == 2 and h.matched_blocks == n
    ids = list(h.block_ids)
    sliding, full = ids[:n], ids[n:]
    assert NULL_BLOCK not in full
    held = [p for p, b in enumerate(sliding) if b != NULL_BLOCK]
    # vLLM keeps the window plus one block; the run's partly filled last block is one of them
    assert held == list(range(n - len(held), n)) and WINDOW_BLOCKS - 1 <= len(held) <= WINDOW_BLOCKS + 1
    assert len(h.tail_block_ids) == 2 and NULL_BLOCK not in h.tail_block_ids


def test_conversation_pulls_both_groups_exactly(hybrid):
    rnd = random.Random(22)
    prompt = rand_tokens(rnd, 1200)
    d = first_turn(hybrid, prompt, 100)
    for _turn in range(2, 4):
        prompt = prompt + d["token_ids"] + rand_tokens(rnd, 150)
        out, span = prefill_and_check(hybrid, prompt)
        assert span["kvloop.path"] == "transfer", span
        pulled = span["kvloop.pulled_tokens"]
        assert pulled >= 64
        group_bytes = list(span["kvloop.group_bytes"])
        # the sliding-window group moves its window only, the full-attention group every block
        local = span["kvloop.local_tokens"]
        assert group_bytes[0] <= (WINDOW_BLOCKS + 1) * GROUP_BYTES
        assert group_bytes[1] == (-(-(local + pulled) // BS) - local // BS) * GROUP_BYTES
        assert span["kvloop.bytes"] == sum(group_bytes)
        d = decode_turn(hybrid, prompt, out["kv_transfer_params"], 100)


def test_edit_in_the_last_block_pulls_the_agreeing_prefix(hybrid):
    """The prompt departs from the run inside its partly filled last block (as a re-rendered answer
    does): the holder keeps the window before the departure, so every complete block and the
    agreeing start of the last one are pulled, in both groups."""
    rnd = random.Random(23)
    prompt = rand_tokens(rnd, 1000)
    d = first_turn(hybrid, prompt, 30)
    history = prompt + d["token_ids"]
    complete = (len(history) - 1) // BS  # the last sampled token has no KV on the decode
    assert (len(history) - 1) % BS > 2
    cut = complete * BS + 2
    edited = history[:cut] + rand_tokens(rnd, 120)
    _out, span = prefill_and_check(hybrid, edited)
    assert span["kvloop.path"] == "transfer", span
    assert span["kvloop.pulled_tokens"] == cut


def test_edit_before_the_window_recomputes(hybrid):
    """The prompt departs from the run before its last window: the sliding-window group's blocks
    there are gone on the holder, so nothing is pulled (never a wrong block) and KV is exact."""
    rnd = random.Random(24)
    prompt = rand_tokens(rnd, 1500)
    d = first_turn(hybrid, prompt, 30)
    history = prompt + d["token_ids"]
    edited = history[:600] + rand_tokens(rnd, 64) + history[664:] + rand_tokens(rnd, 50)
    _out, span = prefill_and_check(hybrid, edited)
    assert span["kvloop.path"] != "transfer" and span["kvloop.pulled_tokens"] == 0, span
    assert "sliding window" in span["kvloop.detail"], span


def test_shared_prefix_read_by_two_conversations(hybrid):
    rnd = random.Random(25)
    prompt = rand_tokens(rnd, 1100)
    d = first_turn(hybrid, prompt, 32)
    shared = prompt + d["token_ids"]
    for _ in range(2):
        empty_prefill_cache(hybrid)  # each branch reads the decode's run, not the last branch's pull
        branch = shared + rand_tokens(rnd, 100)
        _out, span = prefill_and_check(hybrid, branch)
        assert span["kvloop.path"] == "transfer", span
        assert span["kvloop.pulled_tokens"] >= (len(shared) - 1) // BS * BS


def test_a_corrupted_block_of_one_group_is_detected_and_recomputed(hybrid):
    """The decode overwrote one byte of its run's last block in the full-attention group only, after
    digesting it (``kvloop_fault_corrupt_retained``): the pull's check fails on that group, the turn
    recomputes, and both groups' KV and the token equal a recompute's."""
    rnd = random.Random(29)
    prompt = rand_tokens(rnd, 1200)
    hybrid.decode.call("fault_corrupt", {"where": "device", "share": 1.0})
    try:
        d = first_turn(hybrid, prompt, 100)
    finally:
        hybrid.decode.call("fault_corrupt", {"where": "device", "share": 0.0})
    prompt = prompt + d["token_ids"] + rand_tokens(rnd, 150)
    _out, span = prefill_and_check(hybrid, prompt)
    assert span["kvloop.path"] == "failed" and span["kvloop.reason"] == "verify_failed", span
    assert span["kvloop.verify"] == "failed", span
    # the holder registers anew (its agent restarts): the module's other tests read from it again
    k = hybrid.kvloop
    assert k.stop_agent() == 0
    k.start_agent()
    k.wait_agent_connected()
