"""Verified pulls on two real vLLM CPU engines: a pulled block that is not what the holder retained
is detected before the prefill computes on it, the turn recomputes (verify_failed), its answer and
its KV equal a recompute's, and the holder is not read from again until it registers anew.

The fault is real memory: the decode's worker overwrites one byte of a retained run's partly filled
last block right after digesting it (``kvloop_fault_corrupt_retained``), or one byte of a host-pool
slot once its copy is made (``kvloop_fault_corrupt_host``), as a block or slot reused too early
would. Every other pull of the engine suite checks its READ too (``kvloop_verify`` defaults to all):
a false alarm there fails that test's transfer.
"""

from __future__ import annotations

import random
import uuid

import pytest
from conftest import BS, DECODE_WORKER
from test_reverse_pull import _history, prefill_and_check, rand_tokens

from kvloop.agents.connector.config import KvloopConfig
from kvloop.v1 import directory_pb2 as pb
from tests.support import wait_until

pytestmark = pytest.mark.engines


@pytest.fixture
def default_stack(engines):
    """kvloopd and the agent up, and a decode with the default retention share (the reverse-pull
    tests leave theirs relaunched with a small one)."""
    from test_reverse_pull import relaunch_decode

    share = engines.decode.spec.extra_config.get("kvloop_retention_max_share", DEFAULT_SHARE)
    if share != DEFAULT_SHARE or not engines.decode.proc.is_alive():
        relaunch_decode(engines, kvloop_retention_max_share=DEFAULT_SHARE)
    engines.ensure_default_stack()


DEFAULT_SHARE = KvloopConfig().retention_max_share


def _verified(pair, result: str) -> float:
    return pair.prefill.call("metrics").get(
        ("kvloop_connector_verified_pulls_total", (("result", result),)), 0.0
    )


def test_an_uncorrupted_pull_is_checked_and_passes(engines, default_stack):
    passed, failed = _verified(engines, "passed"), _verified(engines, "failed")
    _rnd, prompt = _history(engines, 41)
    pf = prefill_and_check(engines, prompt)
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.verify"] == "passed", pf.span
    assert _verified(engines, "passed") == passed + 1
    assert _verified(engines, "failed") == failed


def test_a_corrupted_retained_block_is_detected_recomputed_and_its_holder_set_aside(engines, default_stack):
    failed = _verified(engines, "failed")
    engines.decode.call("fault_corrupt", {"where": "device", "share": 1.0})
    try:
        _rnd, prompt = _history(engines, 43)  # the decode's run ends in a partly filled block
    finally:
        engines.decode.call("fault_corrupt", {"where": "device", "share": 0.0})
    assert (len(prompt) - 64 - 1) % BS, "the run must have a tail block to corrupt"
    pf = prefill_and_check(engines, prompt)  # KV of every full block and the answer = recompute
    assert pf.span["kvloop.path"] == "failed", pf.span
    assert pf.span["kvloop.reason"] == "verify_failed", pf.span
    assert pf.span["kvloop.verify"] == "failed", pf.span
    assert pf.span["kvloop.holder"] == DECODE_WORKER
    assert pf.out["kv_transfer_params"]["kvloop_reason"] == "verify_failed"
    assert _verified(engines, "failed") == failed + 1

    # a clean run of the same holder is not read: the fault that gave one wrong block may give others
    _rnd, clean = _history(engines, 44)
    pf = prefill_and_check(engines, clean)
    assert pf.span["kvloop.path"] != "transfer", pf.span
    assert pf.out["num_cached_tokens"] == 0

    # the holder registers anew (its agent restarts): its runs are read, and checked, again
    k = engines.kvloop
    assert k.stop_agent() == 0
    k.start_agent()
    k.wait_agent_connected()
    _rnd, later = _history(engines, 45)
    pf = prefill_and_check(engines, later)
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.verify"] == "passed", pf.span


def test_a_corrupted_host_pool_slot_is_detected_and_recomputed(host_pair):
    """The decode's host pool holds a run's copy whose last slot was overwritten after the copy was
    made: the next turn pulls from the pool, the check fails, the turn recomputes with the answer and
    KV of a recompute."""
    from test_host_tier import _host_runs

    pair = host_pair
    failed = _verified(pair, "failed")
    rnd = random.Random(4747)  # a prompt of its own: the pair's prefill caches what it recomputes
    prompt = rand_tokens(rnd, 700)
    p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
    pair.decode.call("fault_corrupt", {"where": "host", "share": 1.0})
    try:
        d = pair.decode.generate(prompt, 32, p["kv_transfer_params"])
        handle = d["kv_transfer_params"]["remote_request_id"]
        first = pair.decode.call("block_hashes", prompt)[0]

        def host_only() -> bool:  # the copy announced, the KV-cache run given up (demoted at once)
            pair.decode.generate(rand_tokens(rnd, 8), 1)  # the in-process engine steps only for requests
            return bool(_host_runs(pair, first, f"{handle}@host")) and not _host_runs(pair, first, handle)

        wait_until(host_only, 30, "the run held in the host pool only")
    finally:
        pair.decode.call("fault_corrupt", {"where": "host", "share": 0.0})
    assert _host_runs(pair, first, f"{handle}@host")[0].tier == pb.BLOCK_TIER_HOST
    pf = prefill_and_check(pair, prompt + d["token_ids"] + rand_tokens(rnd, 64))
    assert pf.span["kvloop.path"] == "failed", pf.span
    assert pf.span["kvloop.reason"] == "verify_failed" and pf.span["kvloop.tier"] == "host", pf.span
    assert _verified(pair, "failed") == failed + 1
    # the holder registers anew, so the pair's other tests read from it again
    k = pair.kvloop
    assert k.stop_agent() == 0
    k.start_agent()
    k.wait_agent_connected()
