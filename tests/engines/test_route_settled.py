"""A prefill whose router's Route found nothing to pull (``kvloop_route_settled``) skips its Lookup:
the connector's prefill side, against a real kvloopd where a peer does hold the prompt, so that a
Lookup, had it been made, would have pulled."""

from __future__ import annotations

import time

import pytest

from kvloop.common.route_estimate import ROUTE_SETTLED_KEY
from tests.engines.prefill_side import BLOCK, Request, beside_a_holder, match, vllm_match


@pytest.mark.parametrize(
    "settled, local_blocks, path, reason",
    [
        ("local_prefix", 4, "local", "local_prefix"),
        ("miss", 0, "miss", "miss"),
        ("a newer reason", 0, None, None),  # not one it knows: it asks kvloopd, which hands out a pull
    ],
)
async def test_a_route_settled_prefill_skips_its_lookup(daemon, settled, local_blocks, path, reason):
    model = f"m-settled-{settled.replace(' ', '-')}"
    async with beside_a_holder(daemon.address, model, "pre-settled", "dec-settled") as (side, client, prompt):
        before = (await client.stats()).lookups
        request = Request("r1", prompt)
        request.kv_transfer_params[ROUTE_SETTLED_KEY] = settled
        count, is_async = match(side, request, local_blocks * BLOCK)
        lookups = (await client.stats()).lookups - before
        outcome = side.finished(request) if path is not None else None
    if path is None:
        assert lookups == 1 and count == 8 * BLOCK and is_async
        assert request.kv_transfer_params["remote_block_ids"]
        return
    assert lookups == 0 and (count, is_async) == (0, False)
    assert "remote_block_ids" not in request.kv_transfer_params
    assert outcome is not None
    assert (outcome["kvloop_path"], outcome["kvloop_reason"]) == (path, reason)
    assert "Route found no peer" in outcome["kvloop_detail"]


async def test_a_pulls_read_deadline_counts_from_when_its_lookup_was_asked(daemon):
    """The holder's lease is 60 s, kvloopd's read window 30 s: the READ deadline the prefill side
    hands its worker is that window counted from when the Lookup was sent, not from when the engine
    loop took the answer (here a step later, as a busy engine's is), so it never ends later than
    kvloopd meant."""
    model = "m-read-deadline"
    async with beside_a_holder(daemon.address, model, "pre-deadline", "dec-deadline", lookup_wait_ms=0) as (
        side,
        _,
        prompt,
    ):
        request = Request("r1", prompt)
        asked = time.perf_counter()
        assert side.match(request, 0, vllm_match) == (None, False)  # asked; the answer comes off the loop
        asked_by = time.perf_counter()
        time.sleep(0.5)  # the engine step in between (not a wait for anything)
        taken = time.perf_counter()
        count, _ = match(side, request)
        deadlines, _epochs = side.take_pulls()
    assert count == 8 * BLOCK
    assert asked + 29.0 <= deadlines["r1"] <= asked_by + 30.0 < taken + 30.0
