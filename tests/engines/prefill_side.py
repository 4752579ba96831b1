"""The connector's prefill side driven as vLLM's scheduler drives it, against a real kvloopd: a
request with the fields the side reads, and the engine's own calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.directory import DirectoryLookups, PullerConstraints
from kvloop.agents.connector.prefill import PrefillSide
from kvloop.clients.directory_client import AsyncDirectoryClient
from tests.support import conversation, retained, running_agent

BLOCK = 16


@dataclass
class Request:
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


def prefill_side(
    daemon_address: str, model: str, worker_id: str, lookup_wait_ms: float = 1000
) -> PrefillSide:
    cfg = KvloopConfig(
        daemon=daemon_address, model=model, lookup_wait_ms=lookup_wait_ms, publish_events=False
    )
    lookups = DirectoryLookups(
        daemon_address, PullerConstraints(model, worker_id, BLOCK, 0, 0, 0, "", 0), timeout_ms=5000
    )
    return PrefillSide(cfg, lookups, BLOCK, 65536, 1, emit=lambda event: None)


@asynccontextmanager
async def beside_a_holder(
    daemon_address: str,
    model: str,
    prefill_id: str,
    decode_id: str,
    blocks: int = 8,
    lookup_wait_ms: float = 1000,
) -> AsyncIterator[tuple[PrefillSide, AsyncDirectoryClient, list[bytes]]]:
    """A prefill side, and a decode streaming to kvloopd that retains a prompt of ``blocks`` blocks:
    (the side, a client of kvloopd, the prompt's block hashes)."""
    prompt = conversation(model, blocks)
    side = prefill_side(daemon_address, model, prefill_id, lookup_wait_ms)
    try:
        async with AsyncDirectoryClient(daemon_address) as client:
            async with running_agent(client, decode_id, model, retained(prompt, f"h-{decode_id}")):
                yield side, client, prompt
    finally:
        side.shutdown()


def match(side: PrefillSide, request: Request, num_computed_tokens: int = 0) -> tuple[int | None, bool]:
    """The scheduler asks again each step until the lookup answered (bounded per call by its wait)."""
    for _ in range(30):
        result = side.match(request, num_computed_tokens, vllm_match)
        if result[0] is not None:
            return result
    raise AssertionError("the lookup never answered")


def vllm_match(request, num_computed_tokens: int) -> tuple[int, bool]:
    """NixlConnector's answer for a reverse pull it accepts: every remote token, asynchronously."""
    return request.kv_transfer_params["remote_num_tokens"] - num_computed_tokens, True
