"""The directory's behaviour, the same on every backend: lookups against a plain model, plus the
lease, epoch, fence, expiry and bound rules (`store_factory` runs each test on each backend)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.common import block_digests
from kvloop.daemon.index import (
    BlockTier,
    Cleared,
    DirectoryError,
    Fence,
    IndexConfig,
    LeaseState,
    MemoryStore,
    Namespace,
    PackedHashes,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
)
from tests.store_backends import BACKENDS, open_store
from tests.support import conversation

NS = Namespace("m")


@pytest.fixture(params=BACKENDS)
async def make_store(request):
    """Builds empty stores of one backend (closed after the test)."""
    made = []

    async def make(config: IndexConfig | None = None):
        store = await open_store(request.param, config or IndexConfig(), request)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


def spec(worker_id: str, epoch: int = 1, model: str = "m", block_size: int = 16) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id,
        role=2,
        model=model,
        engine_id=f"e-{worker_id}",
        nixl_endpoint="127.0.0.1:1",
        block_size=block_size,
        hash_algorithm="sha256_cbor",
        hash_length=32,
        epoch=epoch,
        kv_bytes_per_block=1024,
    )


def retain(hashes, handle, ms=60_000, single_use=False, groups=1, tier=BlockTier.DEVICE, first_id=0):
    ids = [first_id + g * 1000 + i for g in range(groups) for i in range(len(hashes))]
    return Retained(hashes, ids, groups, handle, ms, single_use, tier=tier)


async def test_longest_prefix_picks_longest_holder_and_its_block_ids(make_store):
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    await store.register(spec("b"), 0, 0.0)
    prompt = conversation("c", 40)
    await store.apply("a", 1, 1, [retain(prompt[:10], "ha")], 0.0)
    await store.apply("b", 1, 1, [retain(prompt[:25] + conversation("other", 5), "hb", groups=2)], 0.0)
    match = await store.lookup(NS, prompt, 0, "p", 1.0, claim=False)
    assert match.best is not None and match.best.worker.worker_id == "b"
    assert match.best.matched_blocks == 25
    # group-major ids, truncated per group to the matched blocks
    assert list(match.best.block_ids) == list(range(25)) + [1000 + i for i in range(25)]
    assert match.best.handle == "hb"


async def test_many_runs_sharing_a_prefix_are_each_held_once_and_dropped_cleanly(make_store):
    # a shared prefix (a system prompt) held by many runs of several workers; one run repeats a
    # hash it shares: it is held once, and dropping runs leaves the others' entries as they were
    store = await make_store()
    system = conversation("sys", 6)
    for w in ("a", "b", "c"):
        await store.register(spec(w), 0, 0.0)
    for i, w in enumerate(("a", "b", "c")):
        await store.apply(w, 1, 1, [retain(system + conversation(w, 2), f"h{w}", first_id=10 * i)], 0.0)
    await store.apply("a", 1, 2, [retain([*system, system[2], *conversation("a2", 1)], "ha2")], 0.0)
    found = await store.find(NS, system[2], 1.0)
    assert sorted((loc.worker_id, loc.handle) for loc in found if loc.kind == "retained") == [
        ("a", "ha"), ("a", "ha2"), ("b", "hb"), ("c", "hc")
    ]  # fmt: skip
    await store.apply("a", 1, 3, [Released("ha2"), Released("ha")], 0.0)
    assert (await store.counts()).entries == 2 * 8
    match = await store.lookup(NS, system + conversation("b", 2), 0, "p", 1.0, claim=False)
    assert match.best is not None and (match.best.worker.worker_id, match.best.matched_blocks) == ("b", 8)
    match = await store.lookup(NS, system + conversation("a", 2), 0, "p", 1.0, claim=False)
    assert match.best is not None and match.best.matched_blocks == 6  # a's own tail is gone


async def test_local_prefix_and_requester_are_respected(make_store):
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 8)
    await store.apply("a", 1, 1, [retain(prompt[:4], "h")], 0.0)
    assert (await store.lookup(NS, prompt, 4, "p", 0.0, False)).best is None
    assert (await store.lookup(NS, prompt, 2, "p", 0.0, False)).best.matched_blocks == 4
    assert (await store.lookup(NS, prompt, 0, "a", 0.0, False)).best is None  # never yourself


async def test_expiry_margin_and_reaping(make_store):
    store = await make_store(IndexConfig(expiry_margin_s=2.0, lease_s=100))
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    await store.apply("a", 1, 1, [retain(prompt, "h", ms=5_000)], 0.0)
    assert (await store.lookup(NS, prompt, 0, "p", 2.9, False)).best is not None
    match = await store.lookup(NS, prompt, 0, "p", 3.1, False)  # 1.9 s left < 2 s margin
    assert match.best is None and match.unservable_reason == "expired"
    changes = await store.reap(5.0)
    assert [c.kind for c in changes] == ["expired"]
    assert (await store.counts()).entries == 0
    assert (await store.lookup(NS, prompt, 0, "p", 5.0, False)).unservable_reason is None


async def test_worker_lease_lapse_stops_serving_then_drops(make_store):
    store = await make_store(IndexConfig(lease_s=1.0, drop_after_s=3.0))
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    await store.apply("a", 1, 1, [retain(prompt, "h")], 0.0)
    assert (await store.lookup(NS, prompt, 0, "p", 0.9, False)).best is not None
    assert (await store.lookup(NS, prompt, 0, "p", 1.5, False)).unservable_reason == "peer_unavailable"
    assert [c.kind for c in await store.reap(1.5)] == ["lease"]
    assert (await store.workers(1.5))[0].state == LeaseState.EXPIRED
    await store.heartbeat("a", 1.6)  # a late heartbeat revives it
    assert (await store.lookup(NS, prompt, 0, "p", 1.7, False)).best is not None
    assert [c.kind for c in await store.reap(5.0)] == ["lease", "dropped"]
    assert await store.workers(5.0) == [] and (await store.counts()).entries == 0


async def test_the_models_layout_follows_its_registered_workers(make_store):
    """model_spec (read on every Lookup) answers from the live registry: a re-registration's new
    spec, another worker once the first is dropped, nothing once none is left."""
    store = await make_store(IndexConfig(lease_s=1.0, drop_after_s=3.0))
    await store.register(spec("a", model="n"), 0, 0.0)
    assert (await store.model_spec("n")).kv_bytes_per_block == 1024
    await store.register(replace(spec("a", model="n"), kv_bytes_per_block=4096), 0, 0.1)  # same epoch
    assert (await store.model_spec("n")).kv_bytes_per_block == 4096
    await store.register(spec("b", model="n"), 0, 2.0)
    await store.reap(5.0)  # a's lease lapsed at 1.1 and it is dropped; b registered at 2.0 is not
    assert (await store.model_spec("n")).worker_id == "b"
    await store.reap(10.0)
    assert await store.model_spec("n") is None


async def test_a_worker_streaming_batches_without_heartbeats_stays_live(make_store):
    """A busy agent's stream is all batches (heartbeats only fill idle gaps): over several leases of
    real time, its batches alone keep it serving (on Redis the liveness key expires in real time)."""
    lease = 0.5
    store = await make_store(IndexConfig(lease_s=lease, drop_after_s=30))
    started = time.monotonic()
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    await store.apply("a", 1, 1, [retain(prompt, "h")], 0.0)
    sequence, elapsed = 2, 0.0
    while elapsed < 3 * lease:
        await asyncio.sleep(lease / 5)  # the pace of a busy engine's batches, not a synchronisation
        elapsed = time.monotonic() - started
        await store.apply("a", 1, sequence, [Stored(conversation(f"s{sequence}", 1))], elapsed)
        sequence += 1
    match = await store.lookup(NS, prompt, 0, "p", elapsed, False)
    assert match.best is not None, match.unservable_reason


async def test_new_epoch_replaces_state_atomically_and_live_duplicate_is_refused(make_store):
    store = await make_store(IndexConfig(lease_s=5))
    await store.register(spec("a", epoch=1), 0, 0.0)
    prompt = conversation("c", 4)
    await store.apply("a", 1, 1, [retain(prompt, "h")], 0.0)
    with pytest.raises(DirectoryError) as refused:
        await store.register(spec("a", epoch=2), 0, 1.0)  # first stream still alive
    assert refused.value.code == "ALREADY_EXISTS"
    # its own agent reconnecting (same epoch) before the old stream was noticed closed takes over
    assert await store.register(spec("a", epoch=1), 1, 1.0) == (1, False)
    await store.disconnect("a", 1, 1.0)
    assert await store.register(spec("a", epoch=2), 0, 1.0) == (0, False)
    assert (await store.lookup(NS, prompt, 0, "p", 1.0, False)).best is None
    assert (await store.counts()).entries == 0


async def test_same_epoch_reconnect_keeps_state_and_daemon_restart_needs_resync(make_store):
    store = await make_store()
    await store.register(spec("a", epoch=7), 0, 0.0)
    await store.apply("a", 7, 1, [retain(conversation("c", 2), "h")], 0.0)
    await store.disconnect("a", 7, 0.5)
    assert await store.register(spec("a", epoch=7), 1, 0.6) == (1, False)
    fresh = await make_store()
    assert await fresh.register(spec("a", epoch=7), 5, 0.0) == (0, True)


async def test_incompatible_block_size_for_model_is_refused(make_store):
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    with pytest.raises(DirectoryError, match="block_size=16") as refused:
        await store.register(spec("b", block_size=32), 0, 0.0)
    assert refused.value.code == "FAILED_PRECONDITION"


async def test_single_use_claim_is_handed_out_once(make_store):
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    await store.apply("a", 1, 1, [retain(prompt, "h", single_use=True)], 0.0)
    assert (
        await store.lookup(NS, prompt, 0, "p", 0.0, claim=False)
    ).best is not None  # peeking does not claim
    assert (await store.lookup(NS, prompt, 0, "p", 0.0, claim=True)).best is not None
    second = await store.lookup(NS, prompt, 0, "p", 0.0, claim=True)
    assert second.best is None and second.unservable_reason == "claimed"


async def test_a_single_use_run_the_puller_cannot_read_is_given_back(make_store):
    """A single-use run the lookup's accept refuses (a layout the puller cannot READ into) is not
    handed out, and its claim is given back: a puller that can read it still gets it."""
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    await store.apply("a", 1, 1, [retain(prompt, "h", single_use=True)], 0.0)
    refused = await store.lookup(NS, prompt, 0, "p", 0.0, claim=True, accept=lambda worker: False)
    assert refused.best is None
    readable = await store.lookup(NS, prompt, 0, "p", 0.0, claim=True)
    assert readable.best is not None and readable.best.handle == "h", readable


async def test_memory_bound_evicts_oldest_runs(make_store):
    """The runs share their first block (one system prompt). A sharded store bounds each bucket and
    spreads one chain's runs over ``spread`` buckets, so there the runs are that many times as many."""
    store = await make_store(IndexConfig(max_entries=100))
    spread = getattr(store, "spread", 1)
    await store.register(spec("a"), 0, 0.0)
    system = conversation("system", 1)
    prompts = [system + conversation(f"c{i}", 29) for i in range(5 * spread * spread)]
    for i, prompt in enumerate(prompts):
        await store.apply("a", 1, i + 1, [retain(prompt, f"h{i}")], 0.0)
    assert (await store.counts()).entries <= 100 * spread
    assert (await store.counts()).evictions >= 2
    oldest = await store.lookup(NS, prompts[0], 0, "p", 0.0, False)
    assert oldest.best is None or oldest.best.matched_blocks == 1  # at most the shared block, elsewhere
    assert (await store.lookup(NS, prompts[-1], 0, "p", 0.0, False)).best.matched_blocks == 30


async def test_stored_removed_cleared_and_released(make_store):
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 6)
    await store.apply("a", 1, 1, [Stored(prompt), retain(prompt[:3], "h")], 0.0)
    assert (await store.counts()).entries == 9
    assert {loc.kind for loc in await store.find(NS, prompt[0], 0.0)} == {"stored", "retained"}
    await store.apply("a", 1, 2, [Removed(prompt[3:])], 0.0)
    assert (await store.counts()).entries == 6
    await store.apply("a", 1, 3, [Released("h")], 0.0)
    assert (await store.counts()).entries == 3 and (
        await store.lookup(NS, prompt, 0, "p", 0.0, False)
    ).best is None
    await store.apply("a", 1, 4, [Cleared()], 0.0)
    assert (await store.counts()).entries == 0


async def test_a_batch_is_fenced_by_epoch_and_sequence(make_store):
    store = await make_store()
    await store.register(spec("a", epoch=3), 0, 0.0)
    first = conversation("c", 4)
    applied = await store.apply("a", 3, 1, [retain(first, "h1")], 0.0)
    assert (applied.fence, applied.last_sequence, applied.touched) == (Fence.APPLIED, 1, 4)
    replay = await store.apply("a", 3, 1, [retain(conversation("x", 4), "hx")], 0.0)
    assert (replay.fence, replay.last_sequence) == (Fence.DUPLICATE, 1)
    gap = await store.apply("a", 3, 3, [retain(conversation("y", 4), "hy")], 0.0)
    assert (gap.fence, gap.last_sequence) == (Fence.GAP, 1)
    stale = await store.apply("a", 2, 2, [retain(conversation("z", 4), "hz")], 0.0)
    assert stale.fence == Fence.STALE_EPOCH
    assert (await store.apply("nobody", 1, 1, [], 0.0)).fence == Fence.UNKNOWN_WORKER
    assert (await store.counts()).entries == 4  # only the first batch landed
    assert await store.last_sequence("a") == 1
    snapshot = await store.apply("a", 3, 0, [retain(conversation("s", 2), "hs")], 0.0)
    assert snapshot.fence == Fence.APPLIED and snapshot.last_sequence == 1  # sequence 0: unfenced


async def test_claim_release_and_runs_tail_and_find(make_store):
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 3)
    run = Retained(prompt, [7, 8, 9, 17, 18, 19], 2, "h", 60_000, True, "", 1, [5, 6], [10, 20])
    await store.apply("a", 1, 1, [run], 0.0)
    claimed = (await store.lookup(NS, prompt, 0, "p", 0.0, claim=True)).best
    assert claimed is not None and claimed.single_use
    assert list(claimed.tail_token_ids) == [5, 6] and list(claimed.tail_block_ids) == [10, 20]
    assert claimed.expires_in_ms == 60_000 and claimed.num_groups == 2
    assert await store.release_claim(NS, "a", "h", "other") is False  # only the claimant
    assert await store.release_claim(NS, "a", "h", "p") is True
    assert await store.release_claim(NS, "a", "h", "p") is False
    partial = (await store.lookup(NS, prompt[:2] + conversation("z", 1), 0, "p", 1.0, claim=False)).best
    assert partial is not None and list(partial.block_ids) == [7, 8, 17, 18] and not partial.tail_token_ids
    (where,) = await store.find(NS, prompt[1], 1.0)
    assert (where.worker_id, where.kind, where.position, where.block_ids) == ("a", "retained", 1, [8, 18])
    assert where.servable and where.tier == 1 and where.handle == "h"
    assert await store.find(Namespace("m", "lora"), prompt[1], 1.0) == []


async def test_at_equal_reach_a_device_run_is_handed_out_before_its_host_copy(make_store):
    """A decode copies a run into its host pool and announces the copy as a second run: a lookup
    prefers the device run while both reach as far (whatever their leases), the copy when it reaches
    further or is the only one left; each holding says its tier and carries its own block ids."""
    store = await make_store()
    pooled = replace(spec("a"), host_engine_id="e-a@host", host_nixl_endpoint="127.0.0.1:2")
    await store.register(pooled, 0, 0.0)
    prompt = conversation("c", 16)
    host = retain(prompt[:10], "r@host", ms=90_000, tier=BlockTier.HOST, first_id=500)
    await store.apply("a", 1, 1, [host, retain(prompt[:10], "r", ms=30_000)], 0.0)
    match = await store.lookup(NS, prompt, 0, "p", 1.0, claim=False)
    assert (match.best.handle, match.best.tier, match.best.matched_blocks) == ("r", BlockTier.DEVICE, 10)
    (copy,) = match.others
    assert (copy.handle, copy.tier, list(copy.block_ids)) == ("r@host", BlockTier.HOST, list(range(500, 510)))
    assert copy.worker.host_engine_id == "e-a@host" and copy.worker.host_nixl_endpoint == "127.0.0.1:2"
    assert sorted(loc.tier for loc in await store.find(NS, prompt[3], 1.0)) == [
        BlockTier.DEVICE,
        BlockTier.HOST,
    ]
    # the copy of a longer run reaches further: longest first, the tier only breaks ties
    longer = retain(prompt[:12], "s@host", tier=BlockTier.HOST, first_id=700)
    await store.apply("a", 1, 2, [longer], 0.0)
    best = (await store.lookup(NS, prompt, 0, "p", 1.0, claim=False)).best
    assert (best.handle, best.tier, best.matched_blocks) == ("s@host", BlockTier.HOST, 12)
    await store.apply("a", 1, 3, [Released("s@host"), Released("r")], 0.0)
    best = (await store.lookup(NS, prompt, 0, "p", 1.0, claim=False)).best
    assert (best.handle, best.tier) == ("r@host", BlockTier.HOST)
    # a run announced without a tier is a device run
    await store.apply("a", 1, 4, [retain(prompt[:10], "old", tier=0)], 0.0)
    best = (await store.lookup(NS, prompt, 0, "p", 1.0, claim=False)).best
    assert (best.handle, best.tier) == ("old", BlockTier.DEVICE)
    assert {loc.handle: loc.tier for loc in await store.find(NS, prompt[0], 1.0)}["old"] == BlockTier.DEVICE


async def test_registry_views(make_store):
    store = await make_store(IndexConfig(lease_s=5))
    await store.register(spec("a"), 0, 0.0)
    await store.register(spec("b", model="n"), 0, 0.0)
    await store.apply("a", 1, 1, [Stored(conversation("s", 3)), retain(conversation("c", 2), "h")], 0.0)
    assert await store.models() == ["m", "n"]
    assert (await store.model_spec("n")).worker_id == "b"
    assert await store.model_spec("x") is None
    assert (await store.worker_spec("a")).kv_bytes_per_block == 1024
    (a,) = await store.workers(1.0, "m")
    assert (a.stored_blocks, a.retained_blocks, a.retained_runs, a.last_applied_sequence) == (3, 2, 1, 1)
    assert a.state == LeaseState.ACTIVE and a.connected and a.events_ingested == 5
    assert await store.set_draining("a") and not await store.set_draining("zz")
    assert (await store.workers(1.0, "m"))[0].state == LeaseState.DRAINING
    assert (await store.lookup(NS, conversation("c", 2), 0, "p", 1.0, False)).unservable_reason == (
        "peer_unavailable"
    )


# ---- property test against a plain model ---------------------------------------------------

TRUNKS = [conversation(f"t{i}", 12) for i in range(3)]


def model_longest(runs: dict[tuple[str, str], list[bytes]], prompt: list[bytes], local: int) -> int:
    best = 0
    for hashes in runs.values():
        m = 0
        while m < min(len(hashes), len(prompt)) and hashes[m] == prompt[m]:
            m += 1
        best = max(best, m)
    return best if best > local else 0


run_strategy = st.tuples(
    st.sampled_from(["w1", "w2", "w3"]),
    st.integers(0, 4),
    st.integers(0, 2),
    st.integers(1, 12),
    st.integers(0, 12),
    st.sampled_from([BlockTier.DEVICE, BlockTier.HOST]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("retain"), run_strategy),
            st.tuples(st.just("release"), st.tuples(st.sampled_from(["w1", "w2", "w3"]), st.integers(0, 4))),
        ),
        max_size=25,
    ),
    trunk=st.integers(0, 2),
    length=st.integers(1, 12),
    local=st.integers(0, 12),
    packed=st.booleans(),
)
async def test_lookup_matches_plain_model(make_store, ops, trunk, length, local, packed):
    store = await make_store()
    for w in ("w1", "w2", "w3"):
        await store.register(spec(w), 0, 0.0)
    model: dict[tuple[str, str], list[bytes]] = {}
    tiers: dict[tuple[str, str], int] = {}
    seq = {"w1": 0, "w2": 0, "w3": 0}
    for op, args in ops:
        if op == "retain":
            worker, handle, t, keep, tail, tier = args
            # a run shares `keep` blocks of trunk t, then diverges
            hashes = TRUNKS[t][:keep] + conversation(f"{worker}{handle}", tail, start=keep)
            event = retain(hashes, f"h{handle}", tier=tier)
            model[(worker, f"h{handle}")] = hashes
            tiers[(worker, f"h{handle}")] = tier
        else:
            worker, handle = args
            event = Released(f"h{handle}")
            model.pop((worker, f"h{handle}"), None)
        seq[worker] += 1
        await store.apply(worker, 1, seq[worker], [event], 0.0)
    prompt = TRUNKS[trunk][:length]
    local = min(local, length)
    # a Lookup's packed prompt (the daemon's fast path) must find what a list of hashes finds
    asked = PackedHashes(b"".join(prompt), len(prompt[0])) if packed else prompt
    match = await store.lookup(NS, asked, local, "p", 0.0, claim=False)
    expected = model_longest(model, prompt, local)
    assert (match.best.matched_blocks if match.best else 0) == expected
    if match.best:
        best = (match.best.worker.worker_id, match.best.handle)
        assert model[best][:expected] == prompt[:expected]
        assert match.best.tier == tiers[best]
        # a host run is handed out only when no device run reaches as far
        reaching = [k for k, hashes in model.items() if hashes[:expected] == prompt[:expected]]
        assert match.best.tier == min(tiers[k] for k in reaching)
    assert (await store.counts()).entries == sum(len(set(h)) for h in model.values())


async def test_stored_prefixes_count_each_workers_leading_cached_blocks(make_store):
    store = await make_store(IndexConfig(lease_s=100))
    for w in ("a", "b", "c"):
        await store.register(spec(w), 0, 0.0)
    prompt = conversation("c", 12)
    await store.apply("a", 1, 1, [Stored(prompt[:8])], 0.0)
    await store.apply("b", 1, 1, [Stored(prompt[:3] + conversation("other", 4))], 0.0)
    # c holds blocks 1..5 but not block 0: no prefix hit at all, as in vLLM
    await store.apply("c", 1, 1, [Stored(prompt[1:6])], 0.0)
    # a retained run is no prefix-cache hit
    await store.apply("c", 1, 2, [retain(prompt[:10], "h")], 0.0)
    got = await store.stored_prefixes(NS, prompt, ["a", "b", "c", "unknown"], 1.0)
    assert got == {"a": 8, "b": 3, "c": 0, "unknown": 0}
    # a block removed mid-prefix ends a's run there
    await store.apply("a", 1, 2, [Removed(prompt[5:6])], 1.0)
    assert (await store.stored_prefixes(NS, prompt, ["a", "b"], 1.0)) == {"a": 5, "b": 3}
    assert (await store.stored_prefixes(Namespace("m", "lora"), prompt, ["a"], 1.0)) == {"a": 0}
    # a worker whose lease lapsed counts nothing
    assert (await store.stored_prefixes(NS, prompt, ["a", "b"], 150.0)) == {"a": 0, "b": 0}


async def test_stored_prefixes_of_a_long_prompt_and_of_workers_with_similar_ids(make_store):
    """Prompts of hundreds of blocks (a store may read them in chunks: holes sit at chunk edges) and
    worker ids one of which contains another (the holders of a block are one string on Redis)."""
    store = await make_store(IndexConfig(lease_s=100))
    for w in ("w1", "w11", "w2", "w3"):
        await store.register(spec(w), 0, 0.0)
    prompt = conversation("long", 300)
    await store.apply("w11", 1, 1, [Stored(prompt[:260])], 0.0)
    # holes at blocks 128 and 256, and 129: where a walk in chunks of 128 or of 64 turns a page
    await store.apply("w2", 1, 1, [Stored(prompt[:128] + prompt[129:])], 0.0)
    await store.apply("w3", 1, 1, [Stored(prompt[:256] + prompt[257:])], 0.0)
    await store.apply("w1", 1, 1, [Stored(prompt[:129] + prompt[130:])], 0.0)
    got = await store.stored_prefixes(NS, prompt, ["w1", "w11", "w2", "w3"], 1.0)
    assert got == {"w1": 129, "w11": 260, "w2": 128, "w3": 256}
    await store.apply("w1", 1, 2, [Stored(prompt[129:130], root=prompt[0])], 1.0)  # extends its chain
    await store.apply("w11", 1, 2, [Removed(prompt[:1])], 1.0)
    got = await store.stored_prefixes(NS, prompt, ["w1", "w11", "w2", "w3"], 1.0)
    assert got == {"w1": 300, "w11": 0, "w2": 128, "w3": 256}


async def test_routes_worker_roster_is_kept_for_its_ttl_and_read_again_when_told(make_store):
    from kvloop.daemon.roster import WorkerRoster

    store = await make_store(IndexConfig(lease_s=100))
    clock = [0.0]
    roster = WorkerRoster(store, ttl_s=1.0, clock=lambda: clock[0])
    assert await roster.workers("m") == []
    await store.register(spec("a"), 0, store.clock())
    assert [v.spec.worker_id for v in await roster.workers("m")] == ["a"]  # nothing was kept for "m"
    await store.register(spec("b"), 0, store.clock())  # as through another replica: not told
    clock[0] = 0.9
    assert [v.spec.worker_id for v in await roster.workers("m")] == ["a"]
    clock[0] = 1.0
    assert sorted(v.spec.worker_id for v in await roster.workers("m")) == ["a", "b"]
    await store.register(spec("c"), 0, store.clock())
    roster.invalidate()  # as a registration through this replica does
    assert sorted(v.spec.worker_id for v in await roster.workers("m")) == ["a", "b", "c"]
    assert await roster.workers("never-registered") == []


async def test_memory_expiry_heap_is_bounded_by_live_runs_under_churn():
    """Found by `kvloop bench soak`: every retained run left an entry in the memory store's expiry heap
    until its lease ended, released or not, so under churn the daemon's memory grew with the event
    rate (one entry per run ever retained within a lease) rather than with what is held. Reaping
    compacts it; runs still held keep expiring on time."""
    store = MemoryStore(IndexConfig(lease_s=1e9))
    await store.register(spec("a"), 0, 0.0)
    kept = conversation("kept", 4)
    seq = 1
    await store.apply("a", 1, seq, [retain(kept, "kept", ms=600_000)], 0.0)
    for i in range(5000):
        seq += 1
        await store.apply("a", 1, seq, [retain(conversation(f"c{i % 50}", 2), f"h{i}", ms=3_600_000)], 0.0)
        seq += 1
        await store.apply("a", 1, seq, [Released(f"h{i}")], 0.0)
    await store.reap(1.0)
    assert len(store._expiry_heap) <= 2 * (await store.counts()).retained_runs + 1024
    changes = await store.reap(601.0)
    assert [(c.kind, c.detail) for c in changes] == [("expired", "retention kept lease ended")]


@pytest.mark.parametrize("traced", [False, True])
async def test_store_calls_are_timed_but_an_untraced_in_process_lookup(traced):
    from kvloop.daemon.index.instrumented import STORE_CALL, InstrumentedStore

    store = InstrumentedStore(MemoryStore(), traced=traced)
    lookups, registers = STORE_CALL.labels("memory", "lookup"), STORE_CALL.labels("memory", "register")
    before = sum(lookups.counts), sum(registers.counts)
    await store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 8)
    await store.apply("a", 1, 1, [retain(prompt, "h")], 0.0)
    match = await store.lookup(NS, prompt, 0, "p", 1.0, claim=False)
    assert match.best is not None and match.best.matched_blocks == 8
    # The Lookup's own latency histogram times an in-process lookup; a traced one is timed with its span.
    assert (sum(lookups.counts) - before[0], sum(registers.counts) - before[1]) == (int(traced), 1)


async def test_a_newer_registration_generation_withdraws_the_workers_older_runs(make_store):
    """vLLM >= 0.33 counts a decode's KV-cache re-registrations (sleep and wake): runs announced under
    an older generation name deregistered memory. The directory keeps each run's generation with the
    holder, withdraws the older runs when a newer one arrives and never indexes a late older one."""
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    await store.register(spec("b"), 0, 0.0)
    before, after, other = conversation("g0", 6), conversation("g1", 4), conversation("o", 5)
    await store.apply("a", 1, 1, [replace(retain(before, "h0"), registration_generation=2)], 0.0)
    await store.apply("b", 1, 1, [replace(retain(other, "hb"), registration_generation=1)], 0.0)
    held = (await store.lookup(NS, before, 0, "p", 0.0, claim=False)).best
    assert held is not None and held.handle == "h0" and held.registration_generation == 2

    woke = await store.apply("a", 1, 2, [replace(retain(after, "h1"), registration_generation=3)], 0.0)
    assert woke.fence == Fence.APPLIED and woke.touched == 6 + 4  # the withdrawn run and the new one
    assert (await store.lookup(NS, before, 0, "p", 0.0, claim=False)).best is None
    fresh = (await store.lookup(NS, after, 0, "p", 0.0, claim=False)).best
    assert fresh is not None and fresh.handle == "h1" and fresh.registration_generation == 3
    # another worker's runs are its own business
    kept = (await store.lookup(NS, other, 0, "p", 0.0, claim=False)).best
    assert kept is not None and kept.worker.worker_id == "b"

    late = await store.apply("a", 1, 3, [replace(retain(before, "h0"), registration_generation=2)], 0.0)
    assert late.fence == Fence.APPLIED and late.touched == 0
    assert (await store.lookup(NS, before, 0, "p", 0.0, claim=False)).best is None

    # a new engine process (new registration epoch) starts counting again
    await store.register(spec("a", epoch=2), 0, 60.0)  # after the old agent's lease lapsed
    await store.apply("a", 2, 1, [retain(before, "n0")], 60.0)
    again = (await store.lookup(NS, before, 0, "p", 60.0, claim=False)).best
    assert again is not None and again.handle == "n0" and again.registration_generation == 0


async def test_memory_runs_are_paths_of_a_few_nodes_and_leave_nothing_behind():
    """The in-memory index keeps retained runs as a tree of chains: a shared system prompt and a
    conversation's turns (each run extending the one before) make paths of a node per turn, whatever
    the runs' lengths; releasing the runs, in any order, leaves no node behind."""
    import random

    store = MemoryStore(IndexConfig(lease_s=1e9))
    await store.register(spec("a"), 0, 0.0)
    system = conversation("system", 300)
    chats = {c: conversation(f"chat{c}", 400, start=300) for c in range(5)}
    handles = []
    for turn in range(4):
        for c, chat in chats.items():
            handles.append(f"c{c}t{turn}")
            await store.apply(
                "a", 1, len(handles), [retain(system + chat[: 100 * (turn + 1)], handles[-1])], 0.0
            )
    (chains,) = store._chains.values()

    def paths(node, depth=1):
        yield depth
        for child in node.children.values():
            yield from paths(child, depth + 1)

    assert max(d for root in chains.roots.values() for d in paths(root)) == 1 + 4
    match = await store.lookup(NS, system + chats[3][:250], 0, "p", 0.0, False)
    # turns 2 and 3 reach as far, with equal leases: the first announced
    assert (match.best.handle, match.best.matched_blocks) == ("c3t2", 550)
    random.Random(7).shuffle(handles)
    for n, handle in enumerate(handles):
        await store.apply("a", 1, 21 + n, [Released(handle)], 0.0)
    assert not chains.roots and (await store.counts()).entries == 0


async def test_a_runs_digests_are_handed_out_whole_with_every_holding_of_it(make_store):
    """A run's block digests are one opaque blob, stored with the run and handed out whole whatever
    part of it a lookup matches (the puller indexes them by position); a run announced without any
    hands out none."""
    store = await make_store()
    await store.register(spec("a"), 0, 0.0)
    await store.register(spec("b"), 0, 0.0)
    prompt, plain = conversation("digested", 12), conversation("plain", 4)
    # 2 ranks x 2 groups x (8 blocks + the tail), zeros (no block) among them
    blob = block_digests.pack(
        [[[(r << 40) + (g << 20) + i if i % 3 else 0 for i in range(9)] for g in range(2)] for r in range(2)]
    )
    ids = [g * 100 + i for g in range(2) for i in range(8)]
    run = Retained(prompt[:8], ids, 2, "hd", 60_000, False, "", 1, [5, 6], [70, 80], digests=blob)
    await store.apply("a", 1, 1, [run], 0.0)
    await store.apply("b", 1, 1, [retain(plain, "hp")], 0.0)

    whole = (await store.lookup(NS, prompt, 0, "p", 0.0, claim=False)).best
    assert whole is not None and whole.matched_blocks == 8 and list(whole.tail_token_ids) == [5, 6]
    assert whole.digests == blob
    prefix = (await store.lookup(NS, prompt[:5] + conversation("other", 2), 0, "p", 0.0, claim=False)).best
    assert prefix is not None and prefix.matched_blocks == 5 and not prefix.tail_token_ids
    assert prefix.digests == blob
    past_local = (await store.lookup(NS, prompt, 3, "p", 0.0, claim=False)).best
    assert past_local is not None and past_local.digests == blob
    undigested = (await store.lookup(NS, plain, 0, "p", 0.0, claim=False)).best
    assert undigested is not None and undigested.digests == b""
    # announced again without digests, under the same handle: the old blob goes with the old run
    await store.apply("a", 1, 2, [replace(run, digests=b"")], 0.0)
    again = (await store.lookup(NS, prompt, 0, "p", 0.0, claim=False)).best
    assert again is not None and again.handle == "hd" and again.digests == b""


async def test_an_unverified_holders_runs_are_withheld_until_it_registers_again(make_store):
    """A puller's READ from a holder failed its digest check: none of the holder's runs is handed out,
    whatever its agent sends, until the agent registers again (a new stream, in its epoch or a new
    one); the other holders serve as before."""
    store = await make_store(IndexConfig(lease_s=5))
    await store.register(spec("a"), 0, 0.0)
    await store.register(spec("b"), 0, 0.0)
    prompt, later = conversation("u", 6), conversation("u-later", 3)
    await store.apply("a", 1, 1, [retain(prompt, "ha")], 0.0)
    await store.apply("b", 1, 1, [retain(prompt[:4], "hb")], 0.0)
    assert (await store.lookup(NS, prompt, 0, "p", 0.1, False)).best.worker.worker_id == "a"

    assert await store.set_unverified("a") and not await store.set_unverified("nobody")
    match = await store.lookup(NS, prompt, 0, "p", 0.2, False)
    assert match.best is not None and (match.best.worker.worker_id, match.best.matched_blocks) == ("b", 4)
    assert not match.others
    await store.apply("b", 1, 2, [Released("hb")], 0.2)
    assert (await store.lookup(NS, prompt, 0, "p", 0.3, False)).unservable_reason == "peer_unavailable"
    assert [loc.servable for loc in await store.find(NS, prompt[0], 0.3)] == [False]
    # its heartbeats and batches do not vouch for it
    await store.heartbeat("a", 0.4)
    await store.apply("a", 1, 2, [retain(later, "ha2")], 0.4)
    assert (await store.lookup(NS, later, 0, "p", 0.5, False)).best is None

    assert await store.register(spec("a"), 2, 0.6) == (2, False)  # its agent's next stream
    assert (await store.lookup(NS, prompt, 0, "p", 0.7, False)).best.worker.worker_id == "a"
    assert (await store.lookup(NS, later, 0, "p", 0.7, False)).best.handle == "ha2"

    # a new agent (a new epoch) starts verified, its predecessor's runs gone
    await store.set_unverified("a")
    await store.disconnect("a", 1, 0.8)
    await store.register(spec("a", epoch=2), 0, 0.9)
    await store.apply("a", 2, 1, [retain(later, "n")], 0.9)
    assert (await store.lookup(NS, later, 0, "p", 1.0, False)).best.handle == "n"
    assert (await store.lookup(NS, prompt, 0, "p", 1.0, False)).best is None
