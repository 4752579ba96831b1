"""`kvloop bench soak`, short: a few agents streaming events with restarts, engine gaps and clears into a
real kvloopd on each store; the directory read back must equal the reference model's replay."""

from __future__ import annotations

import pytest

from kvloop.clients.bench.soak import Reference, SoakConfig, compare, run_soak
from tests.store_backends import BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_soak_loses_nothing_and_invents_nothing(backend, request):
    # the cluster is the soak's own (it starts kvloopd with cluster = true)
    store = backend if backend in ("memory", "redis-cluster") else request.getfixturevalue("redis_url")
    config = SoakConfig(
        agents=4,
        callers=2,
        duration_s=4.0,
        store=store,
        processes=1,
        chains=32,
        chain_blocks=8,
        restart_every_s=1.0,
        gap_every_s=0.5,
        clear_every_s=1.5,
        probe_every_s=0.5,
    )
    result = run_soak(config)
    assert result["lost_events"] == 0, result["lost_samples"]
    assert result["phantom_entries"] == 0, result["phantom_samples"]
    assert result["count_mismatches"] == []
    assert result["unacked_links"] == []
    assert result["entries_found"] > 0
    faults = result["faults_and_events"]
    # The run went through what it is meant to survive, and measured what it reports.
    assert faults["restarts"] >= 1 and faults["gaps"] >= 1 and faults["cleared"] >= 1
    # A gap makes the agent forget its retained runs and resend a snapshot (at once, or when its next
    # session opens): a snapshot that never went would leave those runs as phantom entries above.
    assert faults["snapshots_sent"] >= 1
    assert result["event_lag_samples"] > 0 and result["lookups"] > 0
    assert result["daemon_errors_logged"] == 0


def test_compare_counts_lost_and_phantom_entries():
    """The comparison itself can fail: a run the model holds but the directory lacks is lost, an entry
    of a released run that the directory still reports is phantom."""
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    ref = Reference()
    ref.store("", [h1])
    ref.retain("r1", "", [h1, h2], [7, 8])
    expected = {"w": ref}
    found = {
        ("w", "stored", "", h1),
        ("w", "retained", "", h1, "r1", 0, 7),
        ("w", "retained", "", h1, "r0", 0, 3),
    }
    listed = {"w": {"stored_blocks": 1, "retained_runs": 1, "retained_blocks": 2, "connected": True}}
    verdict = compare(expected, found, listed)
    assert verdict["lost_events"] == 1 and verdict["phantom_entries"] == 1
    assert verdict["count_mismatches"] == []
    listed["w"]["retained_runs"] = 2
    assert compare(expected, found, listed)["count_mismatches"]


def test_link_that_overflows_while_connected_still_delivers_everything(daemon):
    """Found building the soak: a connected link more than ``max_unacked_batches`` ahead of the
    daemon's acks stopped queueing batches (only a *next* session would have snapshotted), so while
    the stream stayed up every later event was silently dropped and ``wait_acked`` never returned."""
    import asyncio
    import hashlib

    from kvloop.agents.sidecar.link import DirectoryLink
    from kvloop.agents.sidecar.mirror import WorkerMirror
    from kvloop.clients.bench.soak import MODEL, _registration
    from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient

    hashes = [hashlib.sha256(f"overflow-{i}".encode()).digest() for i in range(40)]

    async def run() -> None:
        async with AsyncDirectoryClient(daemon.address) as client:
            mirror = WorkerMirror(32)
            link = DirectoryLink(
                client, _registration("soak-overflow", 3), mirror.snapshot, max_unacked_batches=8
            )
            runner = asyncio.create_task(link.run())
            try:
                await asyncio.wait_for(link.connected.wait(), 20)
                for h in hashes:  # one loop turn: no ack can arrive in between
                    event = mirror.convert_vllm({"type": "BlockStored", "block_hashes": [h]})
                    assert event is not None
                    link.publish([event])
                await link.wait_acked(timeout=20)
            finally:
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(run())
    with DirectoryClient(daemon.address) as client:
        for h in (hashes[0], hashes[-1]):
            assert [loc.worker_id for loc in client.find_block(MODEL, h)] == ["soak-overflow"]
