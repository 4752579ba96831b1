"""A prefill never reads a handle minted under a directory epoch it has seen pass (a store failover
in between): the connector's prefill side, against a real kvloopd, with the engine's own calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.directory import DirectoryLookups, PullerConstraints
from kvloop.agents.connector.prefill import PrefillSide
from kvloop.clients.client import AsyncDirectoryClient
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, retained, running_agent

BLOCK = 16


@dataclass
class _Request:
    """The fields of vllm.v1.request.Request the prefill side reads."""

    request_id: str
    block_hashes: list[bytes]
    kv_transfer_params: dict[str, Any] = field(default_factory=lambda: {"do_remote_decode": True})
    lora_request: Any = None
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.block_hashes) * BLOCK + 1

    @property
    def prompt_token_ids(self) -> list[int]:
        return [1] * self.num_prompt_tokens


def _prefill_side(daemon_address: str, model: str) -> PrefillSide:
    cfg = KvloopConfig(daemon=daemon_address, model=model, lookup_wait_ms=1000, publish_events=False)
    lookups = DirectoryLookups(
        daemon_address, PullerConstraints(model, "pre-stale", BLOCK, 0, 0, 0, "", 0), timeout_ms=5000
    )
    return PrefillSide(cfg, lookups, BLOCK, 65536, 1, emit=lambda event: None)


def _match(side: PrefillSide, request: _Request) -> tuple[int | None, bool]:
    """The scheduler asks again each step until the lookup answered (bounded per call by its wait)."""
    for _ in range(30):
        result = side.match(request, 0, _vllm_match)
        if result[0] is not None:
            return result
    raise AssertionError("the lookup never answered")


def _vllm_match(request, num_computed_tokens: int) -> tuple[int, bool]:
    """NixlConnector's answer for a reverse pull it accepts: every remote token, asynchronously."""
    return request.kv_transfer_params["remote_num_tokens"] - num_computed_tokens, True


@pytest.mark.parametrize("seen", ["before_the_answer_is_applied", "before_the_read_is_posted"])
async def test_a_handle_from_an_older_directory_epoch_is_never_read(daemon, seen):
    model = f"m-stale-{seen}"
    prompt = conversation(model, 8)
    side = _prefill_side(daemon.address, model)
    try:
        async with AsyncDirectoryClient(daemon.address) as client:
            async with running_agent(client, "dec-stale", model, retained(prompt, "h-stale")):
                request = _Request("r1", prompt)
                if seen == "before_the_answer_is_applied":
                    # another lookup of this engine already brought a later epoch (the memory store
                    # mints under 0): the answer's handle is refused before vLLM allocates anything
                    side.directory.epoch = 7
                    assert _match(side, request) == (0, False)
                    assert "remote_block_ids" not in request.kv_transfer_params
                else:
                    count, is_async = _match(side, request)
                    assert count == 8 * BLOCK and is_async  # vLLM allocated the pull
                    side.directory.epoch = 7  # a failover seen between the answer and the READ
                    deadlines, _holder_epochs = side.take_pulls()
                    # the worker posts no READ past its deadline: it reports the pull failed
                    assert deadlines == {"r1": float("-inf")}
                    side.reads_done(set(), {"r1"}, {})
                outcome = side.finished(request)
    finally:
        side.shutdown()
    assert outcome is not None
    assert outcome["kvloop_path"] == "recompute" and outcome["kvloop_reason"] == "stale_epoch"
    assert outcome["kvloop_pulled_tokens"] == 0 and "directory epoch 0" in outcome["kvloop_detail"]


def test_the_reasons_are_named_from_the_proto():
    from kvloop.common.outcomes import REASON_NAMES, reason_name

    assert reason_name(pb.DECISION_REASON_DIRECTORY_RESYNCING) == "directory_resyncing"
    assert {"directory_resyncing", "stale_epoch"} <= set(REASON_NAMES)
