"""A prefill at TP 1 or 2 pulls from a decode at TP 2 (vLLM's CPU build runs TP as worker processes), from
its KV cache and from its host pool.

vLLM's NIXL connector reads across TP sizes that divide each other: each of the decode's two ranks
holds half of the KV heads, and the TP-1 prefill reads both halves of every block. The decode's
host pool is one pool per rank, holding that rank's half, served as the engine ``decode-0@host``
with each rank's handshake; a copy is announced once both ranks made their part. The decode's
kvloop-agent registers TP 2; kvloopd pairs the two (``layout_mismatch``); every pulled block is
compared with a recompute. The decode engine takes ~2 minutes to start on 2 cores, so this module
runs only with KVLOOP_TEST_TP=1 (the layout rules themselves are covered by test_layout_units.py).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from conftest import BS, KV_BYTES_PER_BLOCK, MODEL, EnginePair, EngineSlot
from test_reverse_pull import prefill_and_check, rand_tokens

from tests.support import wait_until

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(os.environ.get("KVLOOP_TEST_TP") != "1", reason="set KVLOOP_TEST_TP=1 (~3 min more)"),
]


@pytest.fixture(scope="module")
def tp_pair(engine_slot: EngineSlot, tiny_model: Path) -> EnginePair:
    # a rank holds half the heads: half the bytes per block
    return engine_slot.get(
        "tp2", tiny_model, MODEL, KV_BYTES_PER_BLOCK // 2, decode_tp=2, host_retention_gib=0.05
    )


def test_tp1_prefill_pulls_from_tp2_decode(tp_pair):
    workers = {w.registration.worker_id: w for w in tp_pair.kvloop.client.list_workers(MODEL)}
    assert workers["decode-0"].registration.parallel.tensor_parallel_size == 2
    rnd = random.Random(31)
    prompt = rand_tokens(rnd, 1000)
    p = tp_pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt="cold-tp")
    d = tp_pair.decode.generate(prompt, 64, p["kv_transfer_params"])
    hashes = tp_pair.prefill.call("block_hashes", prompt)
    handle = d["kv_transfer_params"]["remote_request_id"]
    # retained in the KV cache, or already in the host pool (whose copy takes over from it)
    wait_until(
        lambda: (
            tp_pair.kvloop.locations(hashes[0], "retained", handle)
            or tp_pair.kvloop.locations(hashes[0], "retained", f"{handle}@host")
        ),
        30,
        "the retained run listed",
    )
    tp_pair.prefill.call("spans")
    assert d["kv_transfer_params"]["tp_size"] == 2
    next_prompt = prompt + d["token_ids"] + rand_tokens(rnd, 100)
    pf = prefill_and_check(tp_pair, next_prompt)  # KV of every full block equals a recompute
    s = pf.span
    assert s["kvloop.path"] == "transfer", s
    assert s["kvloop.pulled_tokens"] >= (len(prompt) // BS) * BS


def test_tp1_prefill_pulls_from_the_host_pools_of_a_tp2_decode(tp_pair):
    """Both ranks copy their half of the run into their own pool; once both did, the copy is announced
    as a host run, the run's KV-cache blocks are given up (kvloop_host_demote_after_s 0), and the
    next turn reads both halves of every block from the two pools."""
    from kvloop.v1 import directory_pb2 as pb

    rnd = random.Random(37)
    prompt = rand_tokens(rnd, 700)
    p = tp_pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt="cold-tp-host")
    d = tp_pair.decode.generate(prompt, 32, p["kv_transfer_params"])
    handle = d["kv_transfer_params"]["remote_request_id"]
    hashes = tp_pair.prefill.call("block_hashes", prompt + d["token_ids"])

    def host_only() -> bool:
        tp_pair.decode.generate(rand_tokens(rnd, 8), 1)  # steps the decode: copies are reported at steps
        host = tp_pair.kvloop.locations(hashes[0], "retained", f"{handle}@host")
        device = tp_pair.kvloop.locations(hashes[0], "retained", handle)
        return bool(host) and host[0].tier == pb.BLOCK_TIER_HOST and not device

    wait_until(host_only, 60, "the host copy announced and the KV-cache run given up")
    nxt = prompt + d["token_ids"] + rand_tokens(rnd, 64)
    pf = prefill_and_check(tp_pair, nxt)  # KV of every full block equals a recompute
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.tier"] == "host", pf.span
    assert pf.out["num_cached_tokens"] == len(nxt) - 64 - 1


def test_tp2_prefill_pulls_from_the_host_pools_of_a_tp2_decode(engine_slot: EngineSlot, tiny_model: Path):
    """Both sides at TP 2: each prefill rank reads its own half of every block from the decode rank's
    pool of the same rank (the handshake of ``decode-0@host`` names each rank's pool)."""
    from kvloop.v1 import directory_pb2 as pb

    pair = engine_slot.get(
        "tp2-tp2",
        tiny_model,
        MODEL,
        KV_BYTES_PER_BLOCK // 2,
        decode_tp=2,
        host_retention_gib=0.05,
        prefill_tp=2,
    )
    rnd = random.Random(41)
    prompt = rand_tokens(rnd, 700)
    p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt="cold-tp22-host")
    d = pair.decode.generate(prompt, 32, p["kv_transfer_params"])
    handle = d["kv_transfer_params"]["remote_request_id"]
    hashes = pair.prefill.call("block_hashes", prompt + d["token_ids"])

    def host_only() -> bool:
        pair.decode.generate(rand_tokens(rnd, 8), 1)  # steps the decode: copies are reported at steps
        host = pair.kvloop.locations(hashes[0], "retained", f"{handle}@host")
        device = pair.kvloop.locations(hashes[0], "retained", handle)
        return bool(host) and host[0].tier == pb.BLOCK_TIER_HOST and not device

    wait_until(host_only, 60, "the host copy announced and the KV-cache run given up")

    def host_reads() -> int:  # pulls kvloopd sent to decode-0's pool (verdicts) and READs reported on it
        return sum(
            len(p.sample_gbytes_per_s) + sum(p.verdicts.values())
            for p in pair.kvloop.client.pairs(MODEL).pairs
            if p.holder_worker_id == "decode-0" and p.tier == pb.BLOCK_TIER_HOST
        )

    before = host_reads()
    nxt = prompt + d["token_ids"] + rand_tokens(rnd, 64)
    # KV of every full block, on both ranks, equals a recompute (this prefill's spans stay in its
    # engine-core process: what it pulled is read from its output and from kvloopd)
    pf = prefill_and_check(pair, nxt, span=False)
    # turn 1 was prefilled under a salt: every cached token of this unsalted prompt was pulled
    assert pf.out["num_cached_tokens"] == len(nxt) - 64 - 1
    assert host_reads() > before, "kvloopd saw no pull from decode-0's host pool"
