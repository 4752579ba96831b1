"""Verified pulls on two real vLLM CPU engines: a pulled block that is not what the holder retained
is detected before the prefill computes on it, the turn recomputes (verify_failed), its answer and
its KV equal a recompute's, and the holder is not read from again until it registers anew.

The fault is real memory: the decode's worker overwrites one byte of a retained run's partly filled
last block right after digesting it (``kvloop_fault_corrupt_retained``), as a slot reused too early
would. Every other pull of the engine suite checks its READ too (``kvloop_verify`` defaults to all):
a false alarm there fails that test's transfer.
"""

from __future__ import annotations

import pytest
from conftest import BS, DECODE_WORKER
from test_reverse_pull import _history, prefill_and_check

pytestmark = pytest.mark.engines


@pytest.fixture(autouse=True)
def default_stack(engines):
    engines.ensure_default_stack()


def _verified(engines, result: str) -> float:
    return engines.prefill.call("metrics").get(
        ("kvloop_connector_verified_pulls_total", (("result", result),)), 0.0
    )


def test_an_uncorrupted_pull_is_checked_and_passes(engines):
    passed = _verified(engines, "passed")
    _rnd, prompt = _history(engines, 41)
    pf = prefill_and_check(engines, prompt)
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.verify"] == "passed", pf.span
    assert _verified(engines, "passed") == passed + 1
    assert _verified(engines, "failed") == 0


def test_a_corrupted_retained_block_is_detected_recomputed_and_its_holder_set_aside(engines):
    failed = _verified(engines, "failed")
    engines.decode.call("fault_corrupt_retained", 1.0)
    try:
        _rnd, prompt = _history(engines, 43)  # the decode's run ends in a partly filled block
    finally:
        engines.decode.call("fault_corrupt_retained", 0.0)
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
