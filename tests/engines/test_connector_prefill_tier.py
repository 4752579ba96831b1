"""A prefill pulling a run from a holder's host-memory pool: the connector's prefill side, driven as
vLLM's scheduler drives it (no engine), against a real kvloopd. The READ goes to the pool's engine,
its report names the tier the cost model learns it under, and the turn's span says the tier."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, retained, running_agent

pytest.importorskip("vllm", reason="the connector's prefill side imports vLLM's metadata types")

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.directory import DirectoryLookups, PullerConstraints
from kvloop.agents.connector.events import KvloopTransferReport
from kvloop.agents.connector.prefill import PrefillSide
from tests.engines.prefill_side import BLOCK, Request, match


@pytest.mark.parametrize("tier", ["device", "host"])
async def test_a_pull_reads_from_the_holders_tier_and_says_so(daemon, monkeypatch, tier):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tm, "tracer", provider.get_tracer("test"))
    model, prompt = f"m-pull-{tier}", conversation(f"pull-{tier}", 8)
    run = retained(prompt, f"req@{tier}", tier=pb.BLOCK_TIER_HOST if tier == "host" else pb.BLOCK_TIER_DEVICE)
    pool = dict(
        nixl_endpoint="127.0.0.1:5801",
        host_engine_id="engine-dec-pool@host",
        host_nixl_endpoint="127.0.0.2:5802",
    )
    emitted: list = []
    cfg = KvloopConfig(daemon=daemon.address, model=model, lookup_wait_ms=1000, publish_events=True)
    lookups = DirectoryLookups(
        daemon.address, PullerConstraints(model, "pre-pool", BLOCK, 0, 0, 0, "", 0), timeout_ms=5000
    )
    side = PrefillSide(cfg, lookups, BLOCK, 65536, 1, emit=emitted.append)
    try:
        async with AsyncDirectoryClient(daemon.address) as client:
            async with running_agent(client, "dec-pool", model, run, **pool):
                request = Request("r1", prompt)
                count, _ = match(side, request)
                assert count == 8 * BLOCK
                params = request.kv_transfer_params
                side.take_pulls()
                side.reads_done({"r1"}, set(), {})
                side.finished(request)
    finally:
        side.shutdown()
    if tier == "host":  # the pool is an engine of its own, on its own side channel
        assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == (
            "engine-dec-pool@host",
            "127.0.0.2",
            5802,
        )
    else:
        assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == (
            "engine-dec-pool",
            "127.0.0.1",
            5801,
        )
    (report,) = [e for e in emitted if isinstance(e, KvloopTransferReport)]
    assert report.source_tier == tier and report.ok
    (turn,) = [s for s in exporter.get_finished_spans() if s.name == "kvloop.prefill"]
    assert turn.attributes["kvloop.tier"] == tier
