"""The agent's conversion of the engine's and the connector's events into protocol events: the tier of
a retained run and of a READ, chain roots, an engine batch's events merged and packed, and a batch
unpacked for a kvloopd that does not read packed fields (agents/sidecar/mirror.py, link.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import msgspec
from prometheus_client import REGISTRY

from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopTransferReport, decode_event_batch
from kvloop.agents.sidecar.link import DirectoryLink, unpacked
from kvloop.agents.sidecar.mirror import WorkerMirror
from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.common import block_digests
from kvloop.common.packed_ids import unpack_u32
from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pb_grpc
from tests.support import conversation, registration


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


def test_a_runs_block_digests_reach_the_directory_event_in_either_form():
    mirror = WorkerMirror(32)
    blob = block_digests.pack([[[11, 0, 13]], [[21, 22, 23]]])  # 2 ranks, 1 group, 3 blocks
    wire = msgspec.msgpack.encode([time.time(), [msgspec.to_builtins(run("d", block_digests=blob))], None])
    (digested,) = decode_event_batch(wire).kvloop
    assert mirror.convert_kvloop(digested).retained.block_digests == blob
    (packed,) = mirror.convert_batch([], [run("p", block_digests=blob)])
    assert packed.retained.packed_block_hashes and packed.retained.block_digests == blob
    resync = {e.retained.retention_handle: e.retained.block_digests for e in mirror.snapshot()}
    assert resync == {"d": blob, "p": blob}
    # a worker that digests nothing sends no field
    assert b"block_digests" not in msgspec.msgpack.encode(run("z"))
    assert mirror.convert_kvloop(run("z")).retained.block_digests == b""


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
    # a resync snapshot sends each chain apart, under its root, packed
    chains = {e.stored.root_block_hash: cut(e.stored.packed_block_hashes) for e in mirror.snapshot()}
    assert chains == {prompt[0]: prompt[:9], b"p" * 32: conversation("orphan", 2)[:1]}


def cut(data: bytes) -> list[bytes]:
    return [data[i : i + 32] for i in range(0, len(data), 32)]


def test_an_engine_batch_goes_as_one_event_per_run_packed():
    """vLLM announces each evicted block on its own: a run of removals (of one LoRA) goes as one event,
    a chain's stored pieces as one, a retained run packed; another kind or LoRA starts a new event."""
    mirror = WorkerMirror(32)
    prompt, other = conversation("p", 8), conversation("o", 3)
    engine = [
        stored(prompt[:2]),
        stored(prompt[2:4], parent=prompt[1]),
        stored(other),  # another chain
        *({"type": "BlockRemoved", "block_hashes": [h]} for h in prompt[2:4]),
        {"type": "BlockRemoved", "block_hashes": other[:1], "lora_name": "l"},
        {"type": "AllBlocksCleared"},
        stored(prompt[:1]),
    ]
    events = mirror.convert_batch(engine, [run("r")])
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["stored", "stored", "removed", "removed", "cleared", "stored", "retained"]
    first, second, gone, gone_lora = (e.stored if e.HasField("stored") else e.removed for e in events[:4])
    assert (cut(first.packed_block_hashes), first.root_block_hash) == (prompt[:4], prompt[0])
    assert not first.block_hashes and cut(second.packed_block_hashes) == other
    assert (
        cut(gone.packed_block_hashes) == prompt[2:4] and cut(gone.packed_root_block_hashes) == [prompt[0]] * 2
    )
    assert gone_lora.lora_name == "l" and cut(gone_lora.packed_block_hashes) == other[:1]
    retained = events[-1].retained
    assert cut(retained.packed_block_hashes) == conversation("r", 3) and not retained.block_hashes
    assert list(unpack_u32(retained.packed_block_ids)) == [1, 2, 3] and not retained.block_ids


def test_a_batch_for_an_older_kvloopd_carries_every_hash_in_its_own_field():
    mirror = WorkerMirror(32)
    prompt = conversation("u", 4)
    removal = [{"type": "BlockRemoved", "block_hashes": [h]} for h in prompt[2:]]
    events = mirror.convert_batch([stored(prompt), *removal], [run("r")])
    batch = unpacked(pb.EventBatch(sequence=7, events=events), 32)
    assert batch.sequence == 7
    plain = WorkerMirror(32)
    expected = [plain.convert_vllm(stored(prompt)), None, plain.convert_kvloop(run("r"))]
    stored_, removed, retained = batch.events
    expected[2].retained.expires_in_ms = retained.retained.expires_in_ms  # each converted at its own time
    assert stored_ == expected[0] and retained.retained == expected[2].retained
    assert list(removed.removed.block_hashes) == prompt[2:]
    assert list(removed.removed.root_block_hashes) == [prompt[0]] * 2
    assert not removed.removed.packed_block_hashes and not removed.removed.packed_root_block_hashes
    # a batch with nothing packed goes as it is
    releases_only = pb.EventBatch(
        sequence=8, events=[pb.BlockEvent(released=pb.RetentionReleased(retention_handle="r"))]
    )
    assert unpacked(releases_only, 32) is releases_only


async def test_a_link_to_a_kvloopd_that_reads_no_packed_events_sends_one_field_per_hash():
    """An older kvloopd's RegisterAck says nothing of packed events: the agent's link sends the same
    batches with every hash and id in a field of its own, which that kvloopd reads."""
    received: list[pb.EventBatch] = []

    class OlderKvloopd(pb_grpc.DirectoryServicer):
        async def Connect(self, requests, context):
            async for request in requests:
                if request.HasField("register"):
                    yield pb.ConnectResponse(
                        registered=pb.RegisterAck(heartbeat_interval_ms=5000, lease_ms=10_000)
                    )
                elif request.HasField("batch"):
                    received.append(request.batch)
                    yield pb.ConnectResponse(ack=pb.BatchAck(sequence=request.batch.sequence))

    server = grpc.aio.server()
    pb_grpc.add_DirectoryServicer_to_server(OlderKvloopd(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    prompt = conversation("older", 3)
    try:
        async with AsyncDirectoryClient(f"127.0.0.1:{port}") as client:
            mirror = WorkerMirror(32)
            link = DirectoryLink(client, registration("w-older"), mirror.snapshot)
            runner = asyncio.create_task(link.run())
            try:
                await asyncio.wait_for(link.connected.wait(), 10)
                link.publish(mirror.convert_batch([stored(prompt)], [run("r")]))
                await link.wait_acked(timeout=10)
            finally:
                runner.cancel()
    finally:
        await server.stop(None)
    ((stored_, retained),) = [batch.events for batch in received]
    assert list(stored_.stored.block_hashes) == prompt and not stored_.stored.packed_block_hashes
    assert list(retained.retained.block_ids) == [1, 2, 3] and not retained.retained.packed_block_ids
