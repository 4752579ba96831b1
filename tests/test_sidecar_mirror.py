"""The agent's conversion of the connector's events into protocol events: the tier of a retained run
and of a READ (agents/sidecar/mirror.py)."""

from __future__ import annotations

import time

import msgspec
from prometheus_client import REGISTRY

from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopTransferReport, decode_event_batch
from kvloop.agents.sidecar.mirror import WorkerMirror
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation


def run(handle: str, **fields) -> KvloopBlocksRetained:
    hashes = conversation(handle, 3)
    return KvloopBlocksRetained(
        block_hashes=hashes,
        block_ids=[[1, 2, 3]],
        retention_handle=handle,
        lease_ms=60_000,
        single_use=False,
        ts=time.time(),
        **fields,
    )


def skipped(reason: str) -> float:
    return REGISTRY.get_sample_value("kvloop_agent_skipped_events_total", {"reason": reason}) or 0.0


def test_a_run_keeps_its_tier_and_an_event_without_one_is_a_device_run():
    mirror = WorkerMirror(32, host_pool=True)
    device, host = mirror.convert_kvloop(run("d")), mirror.convert_kvloop(run("h@host", tier="host"))
    assert device.retained.tier == pb.BLOCK_TIER_DEVICE and host.retained.tier == pb.BLOCK_TIER_HOST
    # an event from a connector that predates tiers has no "tier" key on the wire
    wire = msgspec.msgpack.encode([time.time(), [msgspec.to_builtins(run("old"))], None])
    assert b"tier" not in wire
    (old,) = decode_event_batch(wire).kvloop
    assert mirror.convert_kvloop(old).retained.tier == pb.BLOCK_TIER_DEVICE
    # a resync describes the host run with its tier
    assert {e.retained.retention_handle: e.retained.tier for e in mirror.snapshot()}["h@host"] == (
        pb.BLOCK_TIER_HOST
    )


def test_a_host_run_without_a_registered_host_pool_or_an_unknown_tier_is_not_forwarded():
    mirror = WorkerMirror(32)
    before = skipped("no_host_pool"), skipped("unknown_tier")
    assert mirror.convert_kvloop(run("h@host", tier="host")) is None
    assert mirror.convert_kvloop(run("x", tier="tape")) is None
    assert "h@host" not in mirror.retained and "x" not in mirror.retained  # nor in a resync
    assert (skipped("no_host_pool"), skipped("unknown_tier")) == (before[0] + 1, before[1] + 1)
    assert mirror.convert_kvloop(run("d")).retained.tier == pb.BLOCK_TIER_DEVICE


def test_a_reads_source_tier_is_forwarded():
    mirror = WorkerMirror(32)
    report = dict(source_worker_id="dec", bytes=1, blocks=1, duration_us=1, ok=True)
    host = mirror.convert_kvloop(KvloopTransferReport(**report, source_tier="host"))
    assert host.transfer.source_tier == pb.BLOCK_TIER_HOST
    assert mirror.convert_kvloop(KvloopTransferReport(**report)).transfer.source_tier == pb.BLOCK_TIER_DEVICE
    before = skipped("unknown_tier")
    assert mirror.convert_kvloop(KvloopTransferReport(**report, source_tier="tape")) is None
    assert skipped("unknown_tier") == before + 1


def test_a_runs_registration_generation_reaches_the_directory_event():
    mirror = WorkerMirror(32)
    woke = mirror.convert_kvloop(run("g", registration_generation=3))
    assert woke.retained.registration_generation == 3
    # generation 0 (vLLM before 0.33, or never re-registered) is left off the wire
    assert b"registration_generation" not in msgspec.msgpack.encode(run("z"))
    assert mirror.convert_kvloop(run("z")).retained.registration_generation == 0
    resync = {e.retained.retention_handle: e.retained.registration_generation for e in mirror.snapshot()}
    assert resync["g"] == 3


def stored(hashes, parent=None) -> dict:
    event = {"type": "BlockStored", "block_hashes": hashes}
    return event if parent is None else {**event, "parent_block_hash": parent}


def test_each_stored_block_names_its_chains_root_and_a_block_reported_again_is_not_resent():
    mirror = WorkerMirror(32)
    prompt = conversation("roots", 12)
    first = mirror.convert_vllm(stored(prompt[:4]))
    then = mirror.convert_vllm(stored(prompt[4:8], parent=prompt[3]))
    assert first.stored.root_block_hash == then.stored.root_block_hash == prompt[0]
    # vLLM reports blocks 6-9 with 6-7 already held: only 8-9 are sent, under the chain's root
    again = mirror.convert_vllm(stored(prompt[6:10], parent=prompt[5]))
    assert list(again.stored.block_hashes) == prompt[8:10] and again.stored.root_block_hash == prompt[0]
    before = skipped("already_stored")
    assert mirror.convert_vllm(stored(prompt[2:4])) is None and skipped("already_stored") == before + 1
    # a piece whose parent this mirror never held keeps that parent as its root, removal included
    orphan = mirror.convert_vllm(stored(conversation("orphan", 2), parent=b"p" * 32))
    assert orphan.stored.root_block_hash == b"p" * 32
    removed = mirror.convert_vllm(
        {"type": "BlockRemoved", "block_hashes": [prompt[9], conversation("orphan", 2)[1]]}
    )
    assert list(removed.removed.root_block_hashes) == [prompt[0], b"p" * 32]
    # a resync snapshot sends each chain apart, under its root
    chains = {e.stored.root_block_hash: list(e.stored.block_hashes) for e in mirror.snapshot()}
    assert chains == {prompt[0]: prompt[:9], b"p" * 32: conversation("orphan", 2)[:1]}
