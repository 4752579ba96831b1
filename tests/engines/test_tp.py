"""A prefill at TP 1 pulls from a decode at TP 2 (vLLM's CPU build runs TP as worker processes).

vLLM's NIXL connector reads across TP sizes that divide each other: each of the decode's two ranks
holds half of the KV heads, and the TP-1 prefill reads both halves of every block. The decode's
kvloop-agent registers TP 2; kvloopd pairs the two (``layout_mismatch``); every pulled block is
compared with a recompute. The decode engine takes ~2 minutes to start on 2 cores, so this module
runs only with KVLOOP_TEST_TP=1 (the layout rules themselves are covered by test_layout_units.py).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from conftest import BS, KV_BYTES_PER_BLOCK, MODEL, EnginePair, EngineSlot, Run
from test_reverse_pull import prefill_and_check, rand_tokens

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(os.environ.get("KVLOOP_TEST_TP") != "1", reason="set KVLOOP_TEST_TP=1 (~3 min more)"),
]


@pytest.fixture(scope="module")
def tp_pair(engine_slot: EngineSlot, tiny_model: Path) -> EnginePair:
    # a rank holds half the heads: half the bytes per block
    return engine_slot.get("tp2", tiny_model, MODEL, KV_BYTES_PER_BLOCK // 2, decode_tp=2)


def test_tp1_prefill_pulls_from_tp2_decode(tp_pair):
    workers = {w.registration.worker_id: w for w in tp_pair.kvloop.client.list_workers(MODEL)}
    assert workers["decode-0"].registration.parallel.tensor_parallel_size == 2
    rnd = random.Random(31)
    prompt = rand_tokens(rnd, 1000)
    p = tp_pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt="cold-tp")
    d = tp_pair.decode.generate(prompt, 64, p["kv_transfer_params"])
    hashes = tp_pair.prefill.call("block_hashes", prompt)  # a multiprocess engine hashes in its core
    run = Run(d["kv_transfer_params"]["remote_request_id"], hashes, time.monotonic())
    tp_pair.kvloop.wait_for_run(run)
    tp_pair.prefill.call("spans")
    assert d["kv_transfer_params"]["tp_size"] == 2
    next_prompt = prompt + d["token_ids"] + rand_tokens(rnd, 100)
    pf = prefill_and_check(tp_pair, next_prompt)  # KV of every full block equals a recompute
    s = pf.span
    assert s["kvloop.path"] == "transfer", s
    assert s["kvloop.pulled_tokens"] >= (len(prompt) // BS) * BS
