"""kvloopd as a real process: the Connect protocol, lookups, bad input, leases, epochs, claims."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request

import grpc
import pytest

from kvloop.agents.sidecar.link import DirectoryLink
from kvloop.clients.directory_client import (
    AsyncDirectoryClient,
    DirectoryClient,
    KvloopError,
    holder_block_ids,
)
from kvloop.common import block_digests
from kvloop.common.packed_ids import pack_u32
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, registration, retained, running_agent


async def open_stream(client: AsyncDirectoryClient, reg: pb.WorkerRegistration | None = None):
    call = client.stub.Connect()
    if reg is not None:
        await call.write(pb.ConnectRequest(register=reg))
        first = await call.read()
        assert first.WhichOneof("message") == "registered", first
        return call, first.registered
    return call, None


async def expect_abort(call, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        while (await call.read()) is not grpc.aio.EOF:
            pass
    assert failure.value.code() == code, failure.value.details()
    assert fragment in failure.value.details()


def lookup(address: str, model: str, hashes, **kwargs) -> pb.LookupResponse:
    with DirectoryClient(address) as client:
        return client.lookup(model, hashes, **kwargs)


async def test_retained_blocks_are_found_and_transfer_is_decided(daemon):
    model = "m-transfer"
    prompt = conversation("turn", 64)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-t", model, retained(prompt[:40], "req-1")):
            answer = await client.lookup(model, prompt, requester="pre-t", claim=True, block_size=16)
            packed = await client.lookup(model, b"".join(prompt), requester="pre-t", pack_block_ids=True)
    assert answer.decision == pb.DECISION_TRANSFER, answer
    assert answer.reason == pb.DECISION_REASON_TRANSFER_FASTER
    assert answer.matched_blocks == 40 and answer.matched_tokens == 640
    assert answer.recompute_tokens == 24 * 16
    assert answer.holder.worker_id == "dec-t" and answer.holder.retention_handle == "req-1"
    assert list(answer.holder.block_ids) == [1000 + i for i in range(40)]
    assert 0 < answer.holder.expires_in_ms <= 60_000
    # the packed fast path answers the same
    assert packed.matched_blocks == 40 and not packed.holder.block_ids
    assert holder_block_ids(packed.holder) == list(answer.holder.block_ids)


async def test_a_handout_is_readable_for_the_read_window_and_a_dropped_run_is_confirmed_gone(daemon):
    """Holder.expires_in_ms is the lease left, capped at the directory's read window (30 s), which
    FindBlock says; a decode that gave up a run (yielding.py) frees it a read window after FindBlock
    stops listing it, and not before."""
    from kvloop.agents.connector.yielding import GivenUp, ReleaseConfirmer

    model = "m-window"
    prompt = conversation("window", 8)
    run = GivenUp("long-lease", prompt[0], "")
    confirmer = ReleaseConfirmer(daemon.address, model, "dec-w", read_margin_s=2.0)
    # a decode the directory does not serve in sync (here: not registered) confirms nothing
    stranger = ReleaseConfirmer(daemon.address, model, "dec-unknown", read_margin_s=2.0)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(
            client, "dec-w", model, retained(prompt, "long-lease", expires_in_ms=300_000)
        ) as agent:
            answer = await client.lookup(model, prompt, requester="pre-w")
            assert answer.holder.retention_handle == "long-lease"
            assert 29_000 < answer.holder.expires_in_ms <= 30_000  # not the 300 s lease
            with DirectoryClient(daemon.address) as sync_client:
                found = sync_client.find_block_response(model, prompt[0])
                assert found.read_window_ms == 30_000
                assert confirmer.check(sync_client, run) is None  # still listed: never freed early
                agent.publish([pb.BlockEvent(released=pb.RetentionReleased(retention_handle="long-lease"))])
                await agent.wait_acked(timeout=5)
                before = time.perf_counter()
                free_at = confirmer.check(sync_client, run)
                assert stranger.check(sync_client, run) is None
    assert free_at is not None and before + 32.0 <= free_at <= time.perf_counter() + 32.0


async def test_a_runs_partly_filled_last_block_is_served_with_a_whole_run_match(daemon):
    model = "m-tail"
    prompt = conversation("tail", 12)
    event = retained(prompt[:8], "req-tail")
    event.retained.tail_token_ids.extend([5, 6, 7])
    event.retained.tail_block_ids.append(4242)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-tail", model, event):
            whole = await client.lookup(model, prompt, requester="pre-tail")
            part = await client.lookup(model, prompt[:6], requester="pre-tail")
    assert whole.matched_blocks == 8 and list(whole.holder.tail_token_ids) == [5, 6, 7]
    assert list(whole.holder.tail_block_ids) == [4242]
    # a prompt that ends inside the run matches only part of it: the tail is not its continuation
    assert part.matched_blocks == 6 and not part.holder.tail_token_ids and not part.holder.tail_block_ids


async def test_a_runs_block_digests_reach_every_puller_of_it_whole(daemon):
    """The digests a holder announces with a run are checked against the run and handed out whole
    with it, to a lookup of all of it or of a prefix, packed or not; a run without any has none."""
    model = "m-digests"
    prompt, plain = conversation("digested", 12), conversation("undigested", 6)
    blob = block_digests.pack([[[i + 1 for i in range(9)], [0] * 9]])  # 8 blocks and the tail, 2 groups
    event = retained(prompt[:8], "req-digested", groups=2)
    event.retained.tail_token_ids.extend([5, 6, 7])
    event.retained.tail_block_ids.extend([4242, 4243])
    event.retained.block_digests = blob
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-digests", model, event, retained(plain, "req-plain")):
            whole = await client.lookup(model, prompt, requester="pre-digests")
            part = await client.lookup(
                model, b"".join(prompt[:6]), requester="pre-digests", pack_block_ids=True
            )
            none = await client.lookup(model, plain, requester="pre-digests")
    assert whole.matched_blocks == 8 and list(whole.holder.tail_token_ids) == [5, 6, 7]
    assert whole.holder.block_digests == blob
    assert part.matched_blocks == 6 and not part.holder.tail_token_ids and part.holder.block_digests == blob
    assert none.holder.retention_handle == "req-plain" and none.holder.block_digests == b""


def verify_failures(daemon) -> float:
    body = urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics").read().decode()
    (line,) = [line for line in body.splitlines() if line.startswith("kvloop_verify_failed_total ")]
    return float(line.split()[1])


async def test_a_holder_whose_blocks_failed_a_pullers_digest_check_is_withheld_until_it_registers(daemon):
    """A puller reports a READ whose blocks did not match the holder's digests: kvloopd counts it,
    learns no bandwidth from it and hands out none of the holder's runs (a peer unavailable) until
    the holder's agent registers again, on a new stream."""
    model = "m-verify"
    prompt, later = conversation("verify", 48), conversation("verify-later", 48)
    report = pb.BlockEvent(
        transfer=pb.TransferReport(
            source_worker_id="dec-verify",
            bytes=48 * 65536,
            blocks=48,
            duration_us=2_000,
            ok=True,
            nixl_measured=True,
            verify_failed=True,
        )
    )
    before = verify_failures(daemon)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-verify", model, retained(prompt, "run-1"), epoch=9_001):
            found = await client.lookup(model, prompt, requester="pre-verify")
            assert found.decision == pb.DECISION_TRANSFER and found.holder.worker_id == "dec-verify"
            async with running_agent(client, "pre-verify", model, report, role=pb.WORKER_ROLE_PREFILL):
                pass
            withheld = await client.lookup(model, prompt, requester="pre-verify")
            assert withheld.decision == pb.DECISION_RECOMPUTE, withheld
            assert withheld.reason == pb.DECISION_REASON_PEER_UNAVAILABLE
            assert not withheld.HasField("holder")
            pairs = await client.pairs(model)
        assert verify_failures(daemon) == before + 1
        (pair,) = [p for p in pairs.pairs if p.holder_worker_id == "dec-verify"]
        assert pair.puller_worker_id == "pre-verify" and not pair.sample_gbytes_per_s
        # the holder's agent connects again (same epoch: a new stream of the same agent)
        async with running_agent(client, "dec-verify", model, retained(later, "run-2"), epoch=9_001):
            again = await client.lookup(model, later, requester="pre-verify")
    assert again.decision == pb.DECISION_TRANSFER and again.holder.retention_handle == "run-2"


async def test_below_threshold_and_local_prefix_and_miss(daemon):
    model = "m-policy"
    prompt = conversation("p", 20)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-p", model, retained(prompt[:10], "r")):
            short = await client.lookup(model, prompt, local_blocks=7)  # 3 blocks x 16 = 48 < 64 tokens
            local = await client.lookup(model, prompt, local_blocks=12)
            miss = await client.lookup(model, conversation("other", 5))
    assert (short.decision, short.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_BELOW_THRESHOLD)
    assert "48 transferable tokens" in short.detail
    assert (local.decision, local.reason) == (pb.DECISION_LOCAL, pb.DECISION_REASON_LOCAL_PREFIX)
    assert (miss.decision, miss.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_MISS)


async def test_concurrent_claims_of_a_single_use_handle_never_both_win(daemon):
    model = "m-claim"
    prompt = conversation("claim", 32)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-c", model, retained(prompt, "once", single_use=True)):
            answers = await asyncio.gather(
                *[client.lookup(model, prompt, requester=f"pre-{i}", claim=True) for i in range(16)]
            )
    winners = [a for a in answers if a.decision == pb.DECISION_TRANSFER]
    assert len(winners) == 1
    assert all(a.reason == pb.DECISION_REASON_CLAIMED for a in answers if a not in winners)


async def test_a_claim_the_puller_does_not_use_is_given_back(daemon):
    """Single-use mode: a TRANSFER answer claims the run; a puller that then does not read it
    (refused the pull, READ failed) releases the claim, and the next puller gets the run."""
    model = "m-release"
    prompt = conversation("release", 32)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-r", model, retained(prompt, "once", single_use=True)):
            before = (await client.stats()).decisions["transfer/transfer_faster"]
            first = await client.lookup(model, prompt, requester="pre-a", claim=True)
            held = await client.lookup(model, prompt, requester="pre-b", claim=True)
            # only the claimant may give it back; a stranger's release changes nothing
            assert not await client.release_claim(model, "dec-r", "once", requester="pre-b")
            assert await client.release_claim(model, "dec-r", "once", requester="pre-a")
            assert not await client.release_claim(model, "dec-r", "once", requester="pre-a")  # idempotent
            second = await client.lookup(model, prompt, requester="pre-b", claim=True)
            stats = await client.stats()
    assert first.decision == pb.DECISION_TRANSFER and first.holder.retention_handle == "once"
    assert (held.decision, held.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_CLAIMED)
    assert second.decision == pb.DECISION_TRANSFER and second.holder.retention_handle == "once"
    assert stats.decisions["transfer/transfer_faster"] - before == 2
    with pytest.raises(KvloopError) as bad:
        await AsyncDirectoryClient(daemon.address).release_claim("", "dec-r", "once")
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_only_holders_whose_kv_the_puller_can_read_are_chosen(daemon):
    model = "m-layout"
    prompt = conversation("layout", 40)
    bf16 = {"kv_dtype": "bfloat16", "kv_bytes_per_block": 65536}
    async with AsyncDirectoryClient(daemon.address) as client:
        async with (
            running_agent(
                client,
                "dec-fp32",
                model,
                retained(prompt[:36], "long"),
                kv_dtype="float32",
                kv_bytes_per_block=131072,
            ),
            running_agent(
                client,
                "dec-tp2",
                model,
                retained(prompt[:24], "short"),
                parallel=pb.ParallelLayout(tensor_parallel_size=2),
                **bf16,
            ),
        ):
            tp1 = pb.ParallelLayout(tensor_parallel_size=1)
            answer = await client.lookup(model, prompt, requester="pre-l", parallel=tp1, **bf16)
            tp3 = pb.ParallelLayout(tensor_parallel_size=3)
            refused = await client.lookup(model, prompt, requester="pre-l", parallel=tp3, **bf16)
            unknown = await client.lookup(model, prompt, requester="pre-l")
    # the longer run is float32 KV: never read into a bfloat16 cache; the TP-2 holder is readable
    assert answer.decision == pb.DECISION_TRANSFER, answer
    assert answer.holder.worker_id == "dec-tp2" and answer.matched_blocks == 24
    assert answer.holder.tensor_parallel_size == 2
    assert (refused.decision, refused.reason) == (
        pb.DECISION_RECOMPUTE,
        pb.DECISION_REASON_INCOMPATIBLE_LAYOUT,
    )
    assert refused.path == pb.TURN_PATH_RECOMPUTE
    # a puller that states no layout is not filtered (the longest run wins)
    assert unknown.holder.worker_id == "dec-fp32" and unknown.matched_blocks == 36


async def test_an_answer_that_does_not_pull_still_says_what_matched(daemon):
    model = "m-matched"
    prompt = conversation("matched", 20)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-m", model, retained(prompt[:3], "r")):
            answer = await client.lookup(model, prompt, requester="pre-m", block_size=16)
            strict = await client.lookup(
                model,
                conversation("matched", 20),
                requester="pre-m",
                min_pull_tokens=64,
                lease_margin_ms=120_000,
            )
    # 3 blocks x 16 tokens: below the threshold, recomputed, but the match is reported
    assert (answer.decision, answer.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_BELOW_THRESHOLD)
    assert answer.path == pb.TURN_PATH_RECOMPUTE
    assert answer.matched_blocks == 3 and answer.matched_tokens == 48 and answer.recompute_tokens == 320
    # the puller's lease margin (120 s) is longer than the run's lease (60 s): expired for this puller
    assert (strict.reason, strict.path) == (pb.DECISION_REASON_EXPIRED, pb.TURN_PATH_EXPIRED)


async def test_sequence_gap_triggers_resync_and_snapshot_replaces_state(daemon):
    model = "m-gap"
    prompt = conversation("gap", 8)
    async with AsyncDirectoryClient(daemon.address) as client:
        call, ack = await open_stream(client, registration("dec-gap", model=model))
        assert ack.last_applied_sequence == 0 and not ack.resync_required
        await call.write(pb.ConnectRequest(batch=pb.EventBatch(sequence=1, events=[retained(prompt, "a")])))
        assert (await call.read()).ack.sequence == 1
        await call.write(pb.ConnectRequest(batch=pb.EventBatch(sequence=1, events=[retained(prompt, "a")])))
        assert (await call.read()).ack.sequence == 1  # a repeat is acknowledged and ignored
        await call.write(pb.ConnectRequest(batch=pb.EventBatch(sequence=3, events=[])))
        resync = (await call.read()).resync
        assert (resync.expected_sequence, resync.received_sequence) == (2, 3)
        during = await client.lookup(model, prompt)
        assert during.reason == pb.DECISION_REASON_PEER_UNAVAILABLE  # not served while resyncing
        await call.write(pb.ConnectRequest(snapshot_begin=pb.SnapshotBegin()))
        await call.write(pb.ConnectRequest(batch=pb.EventBatch(events=[retained(prompt[:5], "b")])))
        await call.write(pb.ConnectRequest(snapshot_end=pb.SnapshotEnd(sequence=3)))
        assert (await call.read()).ack.sequence == 3
        after = await client.lookup(model, prompt)
        call.cancel()
    assert after.decision == pb.DECISION_TRANSFER and after.matched_blocks == 5
    assert after.holder.retention_handle == "b"


@pytest.mark.parametrize(
    "first, code, fragment",
    [
        (
            pb.ConnectRequest(batch=pb.EventBatch(sequence=1)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "first message on Connect must be register",
        ),
        (
            pb.ConnectRequest(register=registration("", model="m-bad")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "worker_id must be 1-256 characters",
        ),
        (
            pb.ConnectRequest(register=registration("x", model="m-bad", hash_length=3)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "hash_length must be 8..64",
        ),
        (
            pb.ConnectRequest(
                register=registration("x", model="m-bad", epoch=0)
                if False
                else pb.WorkerRegistration(
                    worker_id="x",
                    role=pb.WORKER_ROLE_DECODE,
                    model="m-bad",
                    block_size=16,
                    hash_algorithm="sha256_cbor",
                    hash_length=32,
                    nixl_endpoint="h:1",
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "epoch must be non-zero",
        ),
        (
            pb.ConnectRequest(register=registration("x", model="m-bad", host_engine_id="engine-x@host")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "host_engine_id and host_nixl_endpoint name the host pool together",
        ),
        (
            pb.ConnectRequest(
                register=registration(
                    "x", model="m-bad", host_engine_id="e@host", host_nixl_endpoint="nohost"
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "host_nixl_endpoint must be HOST:PORT",
        ),
    ],
)
async def test_bad_registration_gets_precise_status(daemon, first, code, fragment):
    async with AsyncDirectoryClient(daemon.address) as client:
        call = client.stub.Connect()
        await call.write(first)
        await expect_abort(call, code, fragment)


def _two_block_run(digests: bytes, **fields) -> pb.BlockEvent:
    """A retained run of two blocks in one group, with ``digests`` (and ``fields``) as given."""
    return pb.BlockEvent(
        retained=pb.BlocksRetained(
            block_hashes=conversation("x", 2),
            block_ids=[1, 2],
            num_groups=1,
            retention_handle="h",
            expires_in_ms=1,
            block_digests=digests,
            **fields,
        )
    )


@pytest.mark.parametrize(
    "event, fragment",
    [
        (
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=[b"short"],
                    block_ids=[1],
                    num_groups=1,
                    retention_handle="h",
                    expires_in_ms=1,
                )
            ),
            "must be 32 bytes",
        ),
        (
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=conversation("x", 2),
                    block_ids=[1],
                    num_groups=1,
                    retention_handle="h",
                    expires_in_ms=1,
                )
            ),
            "1 block_ids for 2 hashes",
        ),
        (
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=conversation("x", 1), block_ids=[1], num_groups=1, expires_in_ms=1
                )
            ),
            "retention_handle must be set",
        ),
        (pb.BlockEvent(), "event carries nothing"),
        (
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=conversation("x", 1),
                    block_ids=[1],
                    num_groups=1,
                    retention_handle="h",
                    expires_in_ms=1,
                    tail_token_ids=[7] * 16,
                    tail_block_ids=[2],
                )
            ),
            "16 tail_token_ids",
        ),
        (
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=conversation("x", 1),
                    block_ids=[1],
                    num_groups=1,
                    retention_handle="h",
                    expires_in_ms=1,
                    tail_token_ids=[7],
                )
            ),
            "0 tail_block_ids for 1 groups",
        ),
        (
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    packed_block_hashes=b"".join(conversation("x", 2)),
                    packed_block_ids=bytes(4),
                    num_groups=1,
                    retention_handle="h",
                    expires_in_ms=1,
                )
            ),
            "1 block_ids for 2 hashes",
        ),
        (
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=conversation("x", 1),
                    packed_block_hashes=b"".join(conversation("x", 1)),
                    block_ids=[1],
                    num_groups=1,
                    retention_handle="h",
                    expires_in_ms=1,
                )
            ),
            "not both",
        ),
        (
            _two_block_run(block_digests.pack([[[1, 2]]])[:-1]),
            "block_digests is 23 bytes; its header (1 ranks, 1 groups, 2 positions) says 24",
        ),
        (
            _two_block_run(block_digests.pack([[[1, 2], [3, 4]]])),
            "block_digests covers 2 groups x 2 positions; the run has 1 groups x 2 positions",
        ),
        (
            # the tail block has no digest
            _two_block_run(block_digests.pack([[[1, 2]]]), tail_token_ids=[7], tail_block_ids=[3]),
            "block_digests covers 1 groups x 2 positions; the run has 1 groups x 3 positions",
        ),
        (
            pb.BlockEvent(stored=pb.BlocksStored(packed_block_hashes=bytes(40))),
            "40 bytes, not a multiple of hash_length 32",
        ),
        (
            pb.BlockEvent(
                removed=pb.BlocksRemoved(
                    packed_block_hashes=b"".join(conversation("x", 2)),
                    packed_root_block_hashes=conversation("x", 1)[0],
                )
            ),
            "1 root_block_hashes for 2 block hashes",
        ),
    ],
)
async def test_bad_event_is_refused_and_nothing_else_is_hurt(daemon, event, fragment):
    model = "m-badevent"
    good_prompt = conversation("good", 6)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "healthy", model, retained(good_prompt, "good")) as healthy:
            call, _ = await open_stream(client, registration("misbehaving", model=model))
            bad_prompt = conversation("bad", 3)
            # one valid event and one bad one in the same batch: the whole batch is refused
            await call.write(
                pb.ConnectRequest(batch=pb.EventBatch(sequence=1, events=[retained(bad_prompt, "v"), event]))
            )
            await expect_abort(call, grpc.StatusCode.INVALID_ARGUMENT, fragment)
            assert (await client.lookup(model, bad_prompt)).decision == pb.DECISION_RECOMPUTE
            # the other agent's stream still works and its blocks are still served
            healthy.publish([retained(conversation("good2", 6), "good2")])
            await healthy.wait_acked(timeout=5)
            assert (await client.lookup(model, good_prompt)).matched_blocks == 6
            assert healthy.sessions == 1
    metrics = urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics").read().decode()
    assert 'kvloop_rejected_messages_total{reason="' in metrics and 'rpc="Connect"' in metrics


def rejected(daemon, reason: str) -> float:
    """kvloop_rejected_messages_total for Connect messages refused with `reason`, as kvloopd serves it."""
    body = urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics").read().decode()
    series = f'kvloop_rejected_messages_total{{reason="{reason}",rpc="Connect"}} '
    return sum(float(line.removeprefix(series)) for line in body.splitlines() if line.startswith(series))


HOST_POOL = dict(
    nixl_endpoint="127.0.0.1:5998", host_engine_id="engine-pooled@host", host_nixl_endpoint="127.0.0.1:5999"
)


async def test_packed_events_index_what_one_field_per_hash_does(daemon):
    """kvloopd says it reads packed events; a worker's packed retained run, stored and removed blocks
    are served as the same events with one field per hash are."""
    model = "m-packed"
    prompt = conversation("packed", 8)
    run = pb.BlocksRetained(
        packed_block_hashes=b"".join(prompt[:6]),
        packed_block_ids=pack_u32(range(100, 106)),
        num_groups=1,
        retention_handle="hp",
        expires_in_ms=60_000,
    )
    async with AsyncDirectoryClient(daemon.address) as client:
        call, ack = await open_stream(client, registration("packer", model=model))
        assert ack.packed_events
        events = [
            pb.BlockEvent(retained=run),
            pb.BlockEvent(stored=pb.BlocksStored(packed_block_hashes=b"".join(prompt))),
            pb.BlockEvent(
                removed=pb.BlocksRemoved(
                    packed_block_hashes=b"".join(prompt[4:]), packed_root_block_hashes=prompt[0] * 4
                )
            ),
        ]
        await call.write(pb.ConnectRequest(batch=pb.EventBatch(sequence=1, events=events)))
        assert (await call.read()).ack.sequence == 1
        answer = await client.lookup(model, prompt, requester="puller")
        assert answer.matched_blocks == 6 and list(answer.holder.block_ids) == list(range(100, 106))
        (worker,) = await client.list_workers(model)
        assert (worker.stored_blocks, worker.retained_blocks) == (4, 6)
        call.cancel()


async def test_a_host_memory_copy_is_read_from_the_host_pool_and_a_device_run_is_preferred(daemon):
    model = "m-tier"
    prompt = conversation("tiered", 24)
    device = retained(prompt[:16], "req-1", expires_in_ms=20_000, tier=pb.BLOCK_TIER_DEVICE)
    host = retained(prompt[:16], "req-1@host", tier=pb.BLOCK_TIER_HOST, first_id=7)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with (
            running_agent(client, "pooled", model, host, device, **HOST_POOL) as link,
            running_agent(client, "pre-tier", model, role=pb.WORKER_ROLE_PREFILL),
        ):
            both = await client.lookup(model, prompt, requester="pre-tier")
            routed = await client.route(model, ["pre-tier"], block_hashes=prompt)
            (info,) = [
                w for w in await client.list_workers(model=model) if w.registration.worker_id == "pooled"
            ]
            link.publish([pb.BlockEvent(released=pb.RetentionReleased(retention_handle="req-1"))])
            await link.wait_acked(timeout=5)
            copy_only = await client.lookup(model, prompt, requester="pre-tier")
    # the device run first although the copy's lease is longer; the copy comes from the host pool
    assert (both.holder.retention_handle, both.holder.tier) == ("req-1", pb.BLOCK_TIER_DEVICE)
    assert (both.holder.engine_id, both.holder.nixl_endpoint) == ("engine-pooled", "127.0.0.1:5998")
    (other,) = both.other_holders
    assert (other.retention_handle, other.tier) == ("req-1@host", pb.BLOCK_TIER_HOST)
    assert (other.engine_id, other.nixl_endpoint) == ("engine-pooled@host", "127.0.0.1:5999")
    assert list(other.block_ids) == list(range(7, 23))
    (score,) = routed.ranked
    assert (score.pull_holder_worker_id, score.pull_holder_tier) == ("pooled", pb.BLOCK_TIER_DEVICE)
    assert (info.registration.host_engine_id, info.registration.host_nixl_endpoint) == (
        "engine-pooled@host",
        "127.0.0.1:5999",
    )
    assert copy_only.decision == pb.DECISION_TRANSFER and copy_only.holder.tier == pb.BLOCK_TIER_HOST
    assert copy_only.holder.engine_id == "engine-pooled@host" and not copy_only.other_holders


async def test_a_run_in_a_tier_the_worker_cannot_serve_is_left_out_and_the_rest_applied(daemon):
    """A host run from a worker that registered no host pool (and a disk run, which nothing reads) is
    counted and left out; the batch's other events are applied and acknowledged on the same stream."""
    model = "m-nopool"
    kept, orphan, disk = conversation("kept", 6), conversation("orphan", 6), conversation("disk", 6)
    before = rejected(daemon, "no_host_pool"), rejected(daemon, "unservable_tier")
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "unpooled", model) as link:
            link.publish(
                [
                    retained(orphan, "o@host", tier=pb.BLOCK_TIER_HOST),
                    retained(kept, "k", tier=pb.BLOCK_TIER_DEVICE),
                    retained(disk, "d", tier=pb.BLOCK_TIER_DISK),
                ]
            )
            await link.wait_acked(timeout=5)  # the batch is acknowledged: no resend, no refusal loop
            assert (await client.lookup(model, orphan)).decision == pb.DECISION_RECOMPUTE
            assert (await client.lookup(model, disk)).decision == pb.DECISION_RECOMPUTE
            assert (await client.lookup(model, kept)).holder.retention_handle == "k"
            link.publish([retained(conversation("later", 4), "l")])  # the stream is still the same one
            await link.wait_acked(timeout=5)
            assert (await client.lookup(model, conversation("later", 4))).matched_blocks == 4
            assert link.sessions == 1
    assert (rejected(daemon, "no_host_pool"), rejected(daemon, "unservable_tier")) == (
        before[0] + 1,
        before[1] + 1,
    )


async def test_duplicate_worker_is_refused_while_the_first_is_alive(daemon):
    async with AsyncDirectoryClient(daemon.address) as client:
        first, _ = await open_stream(client, registration("dup", model="m-dup"))
        second = client.stub.Connect()
        await second.write(pb.ConnectRequest(register=registration("dup", model="m-dup")))
        await expect_abort(second, grpc.StatusCode.ALREADY_EXISTS, "is connected")
        first.cancel()


async def test_lookup_bad_input(daemon):
    with DirectoryClient(daemon.address) as client:
        with pytest.raises(KvloopError, match="model must be set") as e:
            client.lookup("", [b"x" * 32])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    async with AsyncDirectoryClient(daemon.address) as aclient, running_agent(aclient, "dec-li", "m-li"):
        with pytest.raises(KvloopError, match="must be 32 bytes"):
            await aclient.lookup("m-li", [b"x" * 31])
        with pytest.raises(KvloopError, match="not a multiple"):
            await aclient.lookup("m-li", b"x" * 33)
        with pytest.raises(KvloopError, match="local_blocks 3 exceeds"):
            await aclient.lookup("m-li", [b"x" * 32], local_blocks=3)
        with pytest.raises(KvloopError, match="uses block_size 16") as e:
            await aclient.lookup("m-li", [b"x" * 32], block_size=32)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_prompt_sent_as_block_keys_is_answered_as_by_whole_hashes(daemon):
    """The directory compares each hash's leading 8 bytes, so a puller may send only those (the
    connector does: a 2,048-block prompt is 16 KiB on the wire instead of 64). The answer is the same
    as for the whole hashes, listed or packed; a key width outside 8..hash_length is refused."""
    model, prompt = "m-keys", conversation("keys", 10)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-keys", model, retained(prompt[:7], "k")):
            whole = await client.lookup(model, prompt, pack_block_ids=True)
            answers = [
                await client.lookup(model, b"".join(prompt), pack_block_ids=True),
                await client.lookup(model, b"".join(prompt), pack_block_ids=True, hash_length=32),
                await client.stub.Lookup(
                    pb.LookupRequest(
                        model=model,
                        packed_block_hashes=b"".join(h[:8] for h in prompt),
                        packed_hash_bytes=8,
                        pack_block_ids=True,
                    )
                ),
            ]
            assert whole.decision == pb.DECISION_TRANSFER and whole.matched_blocks == 7
            for answer in answers:
                assert (answer.decision, answer.matched_blocks) == (whole.decision, whole.matched_blocks)
                assert holder_block_ids(answer.holder) == holder_block_ids(whole.holder)
                assert answer.holder.retention_handle == "k"
            for width, data, fragment in [
                (4, b"x" * 40, "packed_hash_bytes must be 8..32"),
                (33, b"x" * 66, "packed_hash_bytes must be 8..32"),
                (8, b"x" * 12, "not a multiple of packed_hash_bytes 8"),
            ]:
                request = pb.LookupRequest(model=model, packed_block_hashes=data, packed_hash_bytes=width)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.stub.Lookup(request)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert fragment in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.stub.FindBlock(pb.FindBlockRequest(model=model, block_hash=b"short"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "a block hash has at least 8" in refused.value.details()
            with pytest.raises(ValueError, match="not a multiple of hash_length 32"):
                await client.lookup(model, b"x" * 40, hash_length=32)
            with pytest.raises(KvloopError, match="must be at least 8 bytes"):
                await client.lookup("m-nobody-registered", [b"abcd"] * 3)


async def test_lease_expiry_and_epoch_replacement(daemon_factory):
    proc = daemon_factory(
        env={
            "KVLOOP_LEASE_S": "0.6",
            "KVLOOP_HEARTBEAT_INTERVAL_S": "0.2",
            "KVLOOP_REAP_INTERVAL_S": "0.1",
            "KVLOOP_EXPIRY_MARGIN_S": "0",
        }
    )
    model = "m-lease"
    prompt = conversation("lease", 10)
    async with AsyncDirectoryClient(proc.address) as client:
        call, _ = await open_stream(client, registration("silent", model=model, epoch=11))
        await call.write(pb.ConnectRequest(batch=pb.EventBatch(sequence=1, events=[retained(prompt, "h")])))
        assert (await call.read()).ack.sequence == 1
        assert (await client.lookup(model, prompt)).decision == pb.DECISION_TRANSFER
        # no heartbeat: watch the lease lapse
        async for change in client.watch(model):
            if change.kind == "lease" and change.worker_id == "silent":
                break
        lapsed = await client.lookup(model, prompt)
        assert lapsed.reason == pb.DECISION_REASON_PEER_UNAVAILABLE
        (worker,) = await client.list_workers(model)
        assert worker.lease_state == pb.LEASE_STATE_EXPIRED
        # the same worker restarts with a new epoch: old blocks are gone at once, new ones served
        new_call, ack = await open_stream(client, registration("silent", model=model, epoch=12))
        assert ack.last_applied_sequence == 0
        assert (await client.lookup(model, prompt)).reason == pb.DECISION_REASON_MISS
        await new_call.write(
            pb.ConnectRequest(batch=pb.EventBatch(sequence=1, events=[retained(prompt[:4], "n")]))
        )
        assert (await new_call.read()).ack.sequence == 1
        answer = await client.lookup(model, prompt)
        assert answer.matched_blocks == 4 and answer.holder.epoch == 12
        call.cancel()
        new_call.cancel()


async def test_short_retention_lease_is_not_handed_out(daemon_factory):
    proc = daemon_factory(env={"KVLOOP_EXPIRY_MARGIN_S": "30"})
    prompt = conversation("exp", 8)
    async with AsyncDirectoryClient(proc.address) as client:
        async with running_agent(client, "dec-e", "m-exp", retained(prompt, "soon", expires_in_ms=20_000)):
            answer = await client.lookup("m-exp", prompt)
    assert (answer.decision, answer.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_EXPIRED)


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_agent_link_resyncs_after_daemon_restart_unless_the_store_outlives_it(
    daemon_factory, store, request
):
    shared = ("--store", request.getfixturevalue("redis_url")) if store == "redis" else ()
    first = daemon_factory(*shared)
    prompt = conversation("restart", 12)
    mirror = [retained(prompt, "kept")]
    async with AsyncDirectoryClient(first.address) as client:
        link = DirectoryLink(
            client,
            registration("dec-r", model="m-restart"),
            snapshot=lambda: mirror,
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        runner = asyncio.create_task(link.run())
        await link.connected.wait()
        link.publish(mirror)
        await link.wait_acked(timeout=5)
        first.stop()
        # a new in-memory daemon on the same port knows nothing: the link registers again and sends a
        # snapshot; on Redis the directory outlived the daemon: the link resumes at its last sequence
        daemon_factory(*shared, port=int(first.address.rsplit(":", 1)[1]))
        try:
            await link.wait_sessions(2, timeout=10)
            await link.wait_acked(timeout=10)
            answer = await client.lookup("m-restart", prompt)
            assert answer.decision == pb.DECISION_TRANSFER and answer.matched_blocks == 12
            assert link.snapshots_sent == (
                0 if store == "redis" or os.environ.get("KVLOOP_TEST_STORE") else 1
            )
        finally:
            runner.cancel()
