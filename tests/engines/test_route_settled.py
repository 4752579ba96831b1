"""A prefill whose router's Route found nothing to pull (``kvloop_route_settled``) skips its Lookup:
the connector's prefill side, against a real kvloopd where a peer does hold the prompt, so that a
Lookup, had it been made, would have pulled."""

from __future__ import annotations

import pytest

from kvloop.common.route_estimate import ROUTE_SETTLED_KEY
from tests.engines.prefill_side import BLOCK, Request, beside_a_holder, match


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
