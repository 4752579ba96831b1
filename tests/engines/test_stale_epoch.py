"""A prefill never reads a handle minted under a directory epoch it has seen pass (a store failover
in between): the connector's prefill side, against a real kvloopd, with the engine's own calls."""

from __future__ import annotations

import pytest

from kvloop.v1 import directory_pb2 as pb
from tests.engines.prefill_side import BLOCK, Request, beside_a_holder, match


@pytest.mark.parametrize("seen", ["before_the_answer_is_applied", "before_the_read_is_posted"])
async def test_a_handle_from_an_older_directory_epoch_is_never_read(daemon, seen):
    model = f"m-stale-{seen}"
    async with beside_a_holder(daemon.address, model, "pre-stale", "dec-stale") as (side, _client, prompt):
        request = Request("r1", prompt)
        if seen == "before_the_answer_is_applied":
            # another lookup of this engine already brought a later epoch (the memory store
            # mints under 0): the answer's handle is refused before vLLM allocates anything
            side.directory.epoch = 7
            assert match(side, request) == (0, False)
            assert "remote_block_ids" not in request.kv_transfer_params
        else:
            count, is_async = match(side, request)
            assert count == 8 * BLOCK and is_async  # vLLM allocated the pull
            side.directory.epoch = 7  # a failover seen between the answer and the READ
            deadlines, _holder_epochs = side.take_pulls()
            # the worker posts no READ past its deadline: it reports the pull failed
            assert deadlines == {"r1": float("-inf")}
            side.reads_done(set(), {"r1"}, {})
        outcome = side.finished(request)
    assert outcome is not None
    assert outcome["kvloop_path"] == "recompute" and outcome["kvloop_reason"] == "stale_epoch"
    assert outcome["kvloop_pulled_tokens"] == 0 and "directory epoch 0" in outcome["kvloop_detail"]


def test_the_reasons_are_named_from_the_proto():
    from kvloop.common.outcomes import REASON_NAMES, reason_name

    assert reason_name(pb.DECISION_REASON_DIRECTORY_RESYNCING) == "directory_resyncing"
    assert {"directory_resyncing", "stale_epoch"} <= set(REASON_NAMES)
