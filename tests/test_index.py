"""The in-memory index against a plain model, plus its lease, epoch, expiry and bound rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.daemon.index import (
    Cleared,
    DirectoryError,
    IndexConfig,
    LeaseState,
    MemoryStore,
    Namespace,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
)
from tests.support import conversation

NS = Namespace("m")


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


def retain(hashes, handle, ms=60_000, single_use=False, groups=1):
    ids = [g * 1000 + i for g in range(groups) for i in range(len(hashes))]
    return Retained(hashes, ids, groups, handle, ms, single_use)


def test_longest_prefix_picks_longest_holder_and_its_block_ids():
    store = MemoryStore()
    store.register(spec("a"), 0, 0.0)
    store.register(spec("b"), 0, 0.0)
    prompt = conversation("c", 40)
    store.apply("a", 1, [retain(prompt[:10], "ha")], 0.0)
    store.apply("b", 1, [retain(prompt[:25] + conversation("other", 5), "hb", groups=2)], 0.0)
    match = store.lookup(NS, prompt, 0, "p", 1.0, claim=False)
    assert match.best is not None and match.best.worker.worker_id == "b"
    assert match.best.matched_blocks == 25
    # group-major ids, truncated per group to the matched blocks
    assert list(match.best.block_ids) == list(range(25)) + [1000 + i for i in range(25)]
    assert match.best.handle == "hb"


def test_local_prefix_and_requester_are_respected():
    store = MemoryStore()
    store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 8)
    store.apply("a", 1, [retain(prompt[:4], "h")], 0.0)
    assert store.lookup(NS, prompt, 4, "p", 0.0, False).best is None
    assert store.lookup(NS, prompt, 2, "p", 0.0, False).best.matched_blocks == 4
    assert store.lookup(NS, prompt, 0, "a", 0.0, False).best is None  # never yourself


def test_expiry_margin_and_reaping():
    store = MemoryStore(IndexConfig(expiry_margin_s=2.0, lease_s=100))
    store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    store.apply("a", 1, [retain(prompt, "h", ms=5_000)], 0.0)
    assert store.lookup(NS, prompt, 0, "p", 2.9, False).best is not None
    match = store.lookup(NS, prompt, 0, "p", 3.1, False)  # 1.9 s left < 2 s margin
    assert match.best is None and match.unservable_reason == "expired"
    changes = store.reap(5.0)
    assert [c.kind for c in changes] == ["expired"]
    assert store.entry_count() == 0
    assert store.lookup(NS, prompt, 0, "p", 5.0, False).unservable_reason is None


def test_worker_lease_lapse_stops_serving_then_drops():
    store = MemoryStore(IndexConfig(lease_s=1.0, drop_after_s=3.0))
    store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    store.apply("a", 1, [retain(prompt, "h")], 0.0)
    assert store.lookup(NS, prompt, 0, "p", 0.9, False).best is not None
    assert store.lookup(NS, prompt, 0, "p", 1.5, False).unservable_reason == "peer_unavailable"
    assert [c.kind for c in store.reap(1.5)] == ["lease"]
    assert store.workers(1.5)[0].state == LeaseState.EXPIRED
    store.heartbeat("a", 1.6)  # a late heartbeat revives it
    assert store.lookup(NS, prompt, 0, "p", 1.7, False).best is not None
    assert [c.kind for c in store.reap(5.0)] == ["lease", "dropped"]
    assert store.workers(5.0) == [] and store.entry_count() == 0


def test_new_epoch_replaces_state_atomically_and_live_duplicate_is_refused():
    store = MemoryStore(IndexConfig(lease_s=5))
    store.register(spec("a", epoch=1), 0, 0.0)
    prompt = conversation("c", 4)
    store.apply("a", 1, [retain(prompt, "h")], 0.0)
    with pytest.raises(DirectoryError) as refused:
        store.register(spec("a", epoch=2), 0, 1.0)  # first stream still alive
    assert refused.value.code == "ALREADY_EXISTS"
    store.disconnect("a", 1, 1.0)
    assert store.register(spec("a", epoch=2), 0, 1.0) == (0, False)
    assert store.lookup(NS, prompt, 0, "p", 1.0, False).best is None
    assert store.entry_count() == 0


def test_same_epoch_reconnect_keeps_state_and_daemon_restart_needs_resync():
    store = MemoryStore()
    store.register(spec("a", epoch=7), 0, 0.0)
    store.apply("a", 1, [retain(conversation("c", 2), "h")], 0.0)
    store.disconnect("a", 7, 0.5)
    assert store.register(spec("a", epoch=7), 1, 0.6) == (1, False)
    fresh = MemoryStore()
    assert fresh.register(spec("a", epoch=7), 5, 0.0) == (0, True)


def test_incompatible_block_size_for_model_is_refused():
    store = MemoryStore()
    store.register(spec("a"), 0, 0.0)
    with pytest.raises(DirectoryError, match="block_size=16") as refused:
        store.register(spec("b", block_size=32), 0, 0.0)
    assert refused.value.code == "FAILED_PRECONDITION"


def test_single_use_claim_is_handed_out_once():
    store = MemoryStore()
    store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 4)
    store.apply("a", 1, [retain(prompt, "h", single_use=True)], 0.0)
    assert store.lookup(NS, prompt, 0, "p", 0.0, claim=False).best is not None  # peeking does not claim
    assert store.lookup(NS, prompt, 0, "p", 0.0, claim=True).best is not None
    second = store.lookup(NS, prompt, 0, "p", 0.0, claim=True)
    assert second.best is None and second.unservable_reason == "claimed"


def test_memory_bound_evicts_oldest_runs():
    store = MemoryStore(IndexConfig(max_entries=100))
    store.register(spec("a"), 0, 0.0)
    for i in range(5):
        store.apply("a", i + 1, [retain(conversation(f"c{i}", 30), f"h{i}")], 0.0)
    assert store.entry_count() <= 100
    assert store.evictions >= 2
    assert store.lookup(NS, conversation("c0", 30), 0, "p", 0.0, False).best is None
    assert store.lookup(NS, conversation("c4", 30), 0, "p", 0.0, False).best.matched_blocks == 30


def test_stored_removed_cleared_and_released():
    store = MemoryStore()
    store.register(spec("a"), 0, 0.0)
    prompt = conversation("c", 6)
    store.apply("a", 1, [Stored(prompt), retain(prompt[:3], "h")], 0.0)
    assert store.entry_count() == 9
    assert {loc.kind for loc in store.find(NS, prompt[0], 0.0)} == {"stored", "retained"}
    store.apply("a", 2, [Removed(prompt[3:])], 0.0)
    assert store.entry_count() == 6
    store.apply("a", 3, [Released("h")], 0.0)
    assert store.entry_count() == 3 and store.lookup(NS, prompt, 0, "p", 0.0, False).best is None
    store.apply("a", 4, [Cleared()], 0.0)
    assert store.entry_count() == 0


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
)


@settings(max_examples=150, deadline=None)
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
)
def test_lookup_matches_plain_model(ops, trunk, length, local):
    store = MemoryStore()
    for w in ("w1", "w2", "w3"):
        store.register(spec(w), 0, 0.0)
    model: dict[tuple[str, str], list[bytes]] = {}
    seq = {"w1": 0, "w2": 0, "w3": 0}
    for op, args in ops:
        if op == "retain":
            worker, handle, t, keep, tail = args
            # a run shares `keep` blocks of trunk t, then diverges
            hashes = TRUNKS[t][:keep] + conversation(f"{worker}{handle}", tail, start=keep)
            event = retain(hashes, f"h{handle}")
            model[(worker, f"h{handle}")] = hashes
        else:
            worker, handle = args
            event = Released(f"h{handle}")
            model.pop((worker, f"h{handle}"), None)
        seq[worker] += 1
        store.apply(worker, seq[worker], [event], 0.0)
    prompt = TRUNKS[trunk][:length]
    local = min(local, length)
    match = store.lookup(NS, prompt, local, "p", 0.0, claim=False)
    expected = model_longest(model, prompt, local)
    assert (match.best.matched_blocks if match.best else 0) == expected
    if match.best:
        held = model[(match.best.worker.worker_id, match.best.handle)]
        assert held[:expected] == prompt[:expected]
    assert store.entry_count() == sum(len(set(h)) for h in model.values())
