"""The host retention tier's scheduler side (agents/connector/host/tier.py): which runs get a copy in
the host pool, where, what is announced, and when a copy's slots may be reused (no engine needed)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
import pytest

from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.connector.host.tier import HostTier
from kvloop.agents.connector.yielding import Confirmed, GivenUp
from kvloop.common import block_digests

if TYPE_CHECKING:
    from kvloop.agents.connector.decode import DecodeSide

H = [bytes([i]) * 32 for i in range(20)]


class FakeConfirmer:
    def __init__(self) -> None:
        self.asked: list[GivenUp] = []

    def submit(self, run: GivenUp) -> None:
        self.asked.append(run)


def _hashes(first_id: int, n: int) -> list[bytes]:
    """The chained hashes of KV-cache blocks ``first_id``...: as in vLLM's prefix cache, the same
    block holds the same content (runs of one conversation share blocks; other conversations not)."""
    return [bytes([first_id + i]) * 32 for i in range(n)]


def _device(handle: str, n: int, first_id: int = 10, tail: bool = False) -> KvloopBlocksRetained:
    return KvloopBlocksRetained(
        block_hashes=_hashes(first_id, n),
        block_ids=[[first_id + i for i in range(n)]],
        retention_handle=handle,
        lease_ms=60_000,
        single_use=False,
        tail_token_ids=[1, 2, 3] if tail else [],
        tail_block_ids=[first_id + n] if tail else [],
    )


def _tier(slots: int, confirmer: FakeConfirmer | None = None) -> tuple[HostTier, list]:
    events: list = []
    return HostTier(slots, 600.0, 2.0, events.append, confirmer or FakeConfirmer()), events  # type: ignore[arg-type]


def test_a_copy_is_announced_as_a_host_run_only_once_the_worker_made_it():
    tier, events = _tier(16)
    tier.plan(_device("r1", 3, tail=True))
    (copy,) = tier.take_copies()
    assert copy.handle == "r1@host" and copy.block_ids == [[10, 11, 12, 13]]  # the tail block rides along
    assert sorted(s for g in copy.slots for s in g) == [1, 2, 3, 4]  # slot 0 stands for the null block
    assert not events and not tier.has_copy("r1")  # nothing said before the copy exists
    tier.copied({"r1@host": True})
    (host,) = events
    assert host.tier == "host" and host.retention_handle == "r1@host" and not host.single_use
    assert host.block_hashes == _hashes(10, 3) and host.lease_ms == 600_000
    slot_of = dict(zip(copy.block_ids[0], copy.slots[0], strict=True))
    assert host.block_ids == [[slot_of[10], slot_of[11], slot_of[12]]]
    assert host.tail_block_ids == [slot_of[13]] and host.tail_token_ids == [1, 2, 3]
    assert tier.has_copy("r1") and tier.free_slots == 12


def test_a_failed_copy_is_never_announced_and_gives_its_slots_back():
    tier, events = _tier(8)
    tier.plan(_device("r1", 4))
    tier.take_copies()
    tier.copied({"r1@host": False})
    assert not events and tier.free_slots == 8 and not tier.has_copy("r1")


def test_without_room_the_run_stays_in_the_kv_cache_only():
    tier, _ = _tier(4)
    tier.plan(_device("big", 6))
    assert tier.take_copies() == [] and tier.free_slots == 4


def test_a_released_copys_slots_come_free_only_after_the_directory_confirmed_and_a_read_window():
    confirmer = FakeConfirmer()
    tier, events = _tier(10, confirmer)
    tier.plan(_device("a", 5, first_id=10))
    tier.take_copies()
    tier.copied({"a@host": True})
    tier.plan(_device("b", 6, first_id=30))  # 5 free: the oldest copy goes, and b waits for room
    released = [e for e in events if isinstance(e, KvloopRetentionReleased)]
    assert [(e.retention_handle, e.reason) for e in released] == [("a@host", "evicted")]
    assert [g.handle for g in confirmer.asked] == ["a@host"]
    assert confirmer.asked[0].first_hash == _hashes(10, 1)[0]
    assert not tier.has_copy("a") and tier.take_copies() == []
    tier.step()
    assert tier.free_slots == 5  # a's slots are fenced until the drop is confirmed ...
    tier.confirmed(Confirmed("a@host", time.perf_counter() + 30))
    tier.step()
    assert tier.free_slots == 5  # ... and a read window has passed
    tier.confirmed(Confirmed("a@host", time.perf_counter() - 0.001))
    tier.step()  # a's slots are free: b, waiting for them, takes 6
    assert tier.free_slots == 4 and [c.handle for c in tier.take_copies()] == ["b@host"]
    tier.copied({"b@host": True})
    assert tier.has_copy("b")


def test_a_run_waits_for_room_only_where_the_pool_could_make_it():
    confirmer = FakeConfirmer()
    tier, _ = _tier(10, confirmer)
    tier.plan(_device("a", 4, first_id=10))
    tier.take_copies()
    tier.copied({"a@host": True})
    tier.plan(_device("b", 4, first_id=20))
    tier.take_copies()  # b is being written: not announced, so not a copy to give up yet
    assert tier.can_take({1, 2, 3, 4, 5, 6}) and not tier.can_take(set(range(1, 8)))
    tier.plan(_device("c", 6, first_id=30))  # 2 free: a goes, c waits for its 4 slots
    assert tier.copying("c") and not tier.has_room({1})  # nobody passes a waiting run
    tier.plan(_device("d", 3, first_id=40))  # a's 4 slots go to c: d could not fit even then
    assert not tier.copying("d")
    tier.copied({"b@host": True})
    tier.confirmed(Confirmed("a@host", time.perf_counter() - 0.001))
    tier.step()
    assert [c.handle for c in tier.take_copies()] == ["c@host"] and tier.free_slots == 0


def test_a_waiting_run_whose_blocks_vllm_freed_is_not_copied():
    tier, _ = _tier(4)
    tier.plan(_device("a", 4, first_id=10))
    tier.take_copies()
    tier.copied({"a@host": True})
    tier.plan(_device("b", 2, first_id=20))
    assert tier.copying("b")
    tier.device_released("b")  # its lease ended before the pool had room
    assert not tier.copying("b")
    tier.confirmed(Confirmed("a@host", time.perf_counter() - 0.001))
    tier.step()
    assert tier.take_copies() == [] and tier.free_slots == 4


def test_a_later_turns_copy_supersedes_the_copy_it_starts_with():
    confirmer = FakeConfirmer()
    tier, events = _tier(32, confirmer)
    tier.plan(_device("turn1", 3, first_id=10))
    tier.take_copies()
    tier.copied({"turn1@host": True})
    tier.plan(_device("turn2", 6, first_id=10))
    tier.take_copies()
    assert tier.has_copy("turn1")  # still the only copy until turn 2's is made
    tier.copied({"turn2@host": True})
    released = [(e.retention_handle, e.reason) for e in events if isinstance(e, KvloopRetentionReleased)]
    assert released == [("turn1@host", "superseded")]
    assert tier.has_copy("turn2") and not tier.has_copy("turn1")
    assert [g.handle for g in confirmer.asked] == ["turn1@host"]


def test_an_expired_copy_is_released_and_its_slots_reused_after_the_read_margin(monkeypatch):
    tier, events = _tier(8)
    tier.plan(_device("r", 2))
    tier.take_copies()
    tier.copied({"r@host": True})
    now = time.perf_counter()
    monkeypatch.setattr(time, "perf_counter", lambda: now + 600.5)  # past its lease
    tier.step()
    assert [(e.retention_handle, e.reason) for e in events if isinstance(e, KvloopRetentionReleased)] == [
        ("r@host", "expired")
    ]
    assert tier.free_slots == 6  # within the READ margin (2 s) of its lease's end
    monkeypatch.setattr(time, "perf_counter", lambda: now + 603)
    tier.step()
    assert tier.free_slots == 8


def _hybrid_device(handle: str, n: int, sliding: dict[int, int]) -> KvloopBlocksRetained:
    """A hybrid run as a decode announces it: the sliding-window group (0) holds only ``sliding``
    (position -> block id), the full-attention group (1) every block."""
    return KvloopBlocksRetained(
        block_hashes=H[:n],
        block_ids=[[sliding.get(p, 0) for p in range(n)], [100 + p for p in range(n)]],
        retention_handle=handle,
        lease_ms=60_000,
        single_use=False,
    )


def test_a_window_capture_gives_the_runs_copy_the_blocks_its_kv_cache_run_freed():
    tier, events = _tier(64)
    tier.capture("r", [(0, 3, 43), (0, 4, 44), (0, 5, 45)])
    (capture,) = tier.take_captures().values()
    assert capture.handle == "r@window" and capture.block_ids == [[43, 44, 45]]
    window_slots = capture.slots[0]
    assert tier.free_slots == 61 and not events  # nothing announced: the slots are the run's to take
    tier.copied({"r@window": True})
    tier.plan(_hybrid_device("r", 10, {8: 58, 9: 59}))  # decoding freed positions 3-5 in the KV cache
    (copy,) = tier.take_copies()
    assert copy.block_ids == [[58, 59], [100 + p for p in range(10)]]  # the capture is not copied again
    tier.copied({"r@host": True})
    (host,) = events
    sliding, full = host.block_ids
    assert [p for p, s in enumerate(sliding) if s] == [3, 4, 5, 8, 9]
    assert sliding[3:6] == window_slots and 0 not in full
    assert tier.free_slots == 64 - 3 - 12
    # the copy's slots, the capture's among them, come back together once it is released and fenced
    tier._release("r@host", tier._copies["r@host"], "evicted", fence=False)
    tier._copies["r@host"].free_at = 0.0
    tier.step()
    assert tier.free_slots == 64


def test_a_capture_whose_run_is_not_copied_gives_its_slots_back_once_written():
    tier, _ = _tier(16)
    tier.capture("done", [(0, 1, 11), (0, 2, 12)])
    tier.capture("writing", [(0, 1, 21)])
    tier.capture("failed", [(0, 1, 31)])
    assert len(tier.take_captures()) == 3 and tier.free_slots == 12
    tier.copied({"done@window": True, "failed@window": False})
    assert tier.free_slots == 13  # a failed capture's slot is back at once
    tier.forget_capture("done")  # finished without being retained
    assert tier.free_slots == 15
    tier.forget_capture("writing")  # its copy may still be landing in its slot: kept until reported
    assert tier.free_slots == 15
    tier.copied({"writing@window": True})
    assert tier.free_slots == 16
    tier.capture("unsent", [(0, 1, 51), (0, 2, 52)])
    tier.forget_capture("unsent")  # ended before the worker was told: nothing can be writing its slots
    assert tier.free_slots == 16 and tier.take_captures() == {}
    # a run planned while its capture is unusable (failed) is copied without it
    tier.capture("r", [(0, 0, 40)])
    tier.take_captures()
    tier.copied({"r@window": False})
    tier.plan(_hybrid_device("r", 4, {3: 53}))
    (copy,) = tier.take_copies()
    assert copy.block_ids == [[53], [100, 101, 102, 103]] and tier.free_slots == 16 - 5


def _hybrid_turn(
    tier: HostTier, handle: str, n: int, sliding: dict[int, int], capture: dict[int, int]
) -> None:
    """A hybrid run through the pool: its window capture (position -> KV-cache block) is written
    while it decodes, then its copy is made and announced."""
    tier.capture(handle, [(0, p, b) for p, b in capture.items()])
    tier.take_captures()
    tier.copied({handle + "@window": True})
    tier.plan(_hybrid_device(handle, n, sliding))
    tier.take_copies()
    tier.copied({handle + "@host": True})


def _announced(events: list, handle: str) -> KvloopBlocksRetained:
    (event,) = [e for e in events if isinstance(e, KvloopBlocksRetained) and e.retention_handle == handle]
    return event


def _held(sliding: list[int]) -> list[int]:
    return [p for p, s in enumerate(sliding) if s]


def _two_turns(confirmer: FakeConfirmer) -> tuple[HostTier, list]:
    """Turn 1's prompt ended at block 6 (its capture holds that window, positions 3-5) and its run at
    block 10 (positions 8-9 still in its KV cache); turn 2 continued the whole history, so its run
    starts with every block of turn 1's, but its sliding-window group holds only its own windows
    (its prompt's, 11-13, and its run's end, 14-15)."""
    tier, events = _tier(64, confirmer)
    _hybrid_turn(tier, "t1", 10, {8: 58, 9: 59}, capture={3: 43, 4: 44, 5: 45})
    _hybrid_turn(tier, "t2", 16, {14: 74, 15: 75}, capture={11: 81, 12: 82, 13: 83})
    return tier, events


def test_a_later_turns_copy_takes_over_the_windows_of_the_copy_it_supersedes():
    """Superseding turn 1's copy, turn 2's copy also names turn 1's window slots, so a pull ending
    with turn 1's prompt (a regenerated answer, a new conversation sharing it) or with turn 1's run
    (another continuation of it) is still served once turn 1's copy is gone."""
    confirmer = FakeConfirmer()
    tier, events = _two_turns(confirmer)
    t1 = _announced(events, "t1@host").block_ids[0]
    sliding, full = _announced(events, "t2@host").block_ids
    assert _released(events) == ["t1@host"] and [g.handle for g in confirmer.asked] == ["t1@host"]
    assert _held(sliding) == [3, 4, 5, 8, 9, 11, 12, 13, 14, 15] and 0 not in full
    assert [sliding[p] for p in (3, 4, 5, 8, 9)] == [t1[p] for p in (3, 4, 5, 8, 9)]
    # nothing copied twice: turn 2 wrote only what turn 1's copy does not hold (its own windows,
    # 14-15 and its capture 11-13, and its full-attention blocks 10-15)
    assert tier.free_slots == 64 - 15 - 11
    assert tier.can_take(set(range(1, 65))) and not tier.can_take(set(range(1, 66)))  # each slot once


def test_slots_two_copies_name_come_free_only_once_neither_can_be_read():
    confirmer = FakeConfirmer()
    tier, events = _two_turns(confirmer)
    shared = {_announced(events, "t1@host").block_ids[0][p] for p in (3, 4, 5, 8, 9)}
    # turn 1's copy past its fence: its own slots come free, not those turn 2's copy names
    tier.confirmed(Confirmed("t1@host", time.perf_counter() - 0.001))
    tier.step()
    assert tier.free_slots == 64 - 15 - 11 and not shared & set(tier._free)  # turn 2 names them all
    tier._release("t2@host", tier._copies["t2@host"], "evicted")
    tier.confirmed(Confirmed("t2@host", time.perf_counter() - 0.001))
    tier.step()
    assert tier.free_slots == 64

    # the other order: turn 2's copy released and fenced while turn 1's fence still holds
    confirmer = FakeConfirmer()
    tier, events = _two_turns(confirmer)
    tier._release("t2@host", tier._copies["t2@host"], "evicted")
    tier.confirmed(Confirmed("t2@host", time.perf_counter() - 0.001))
    tier.confirmed(Confirmed("t1@host", time.perf_counter() + 30))
    tier.step()
    # turn 2's own 11 slots: turn 1's readers may READ the rest
    assert tier.free_slots == 64 - 15 and not shared & set(tier._free)
    tier.confirmed(Confirmed("t1@host", time.perf_counter() - 0.001))
    tier.step()
    assert tier.free_slots == 64 and len(set(tier._free)) == 64


def test_a_copy_sharing_a_prefix_names_the_windows_within_it_and_leaves_the_other_copy():
    """Another continuation of turn 1 (a rewritten next message): its run departs from turn 1's at
    block 9, so turn 1's copy stays beside it; the new copy names turn 1's slots within the blocks
    they share (turn 1's prompt window, 3-5, its run's block 8, the full-attention blocks 0-8), its
    capture of block 8 comes back unused, and the shared slots stay as long as either copy does."""
    confirmer = FakeConfirmer()
    tier, events = _tier(64, confirmer)
    _hybrid_turn(tier, "t1", 10, {8: 58, 9: 59}, capture={3: 43, 4: 44, 5: 45})
    t1 = _announced(events, "t1@host").block_ids[0]
    sibling = msgspec.structs.replace(
        _hybrid_device("c", 12, {10: 70, 11: 71}), block_hashes=[*H[:9], *H[16:19]]
    )
    tier.capture("c", [(0, 6, 66), (0, 7, 67), (0, 8, 68)])
    tier.take_captures()
    tier.copied({"c@window": True})
    tier.plan(sibling)
    tier.take_copies()
    tier.copied({"c@host": True})
    sliding = _announced(events, "c@host").block_ids[0]
    assert _released(events) == [] and tier.has_copy("t1") and tier.has_copy("c")
    assert _held(sliding) == [3, 4, 5, 6, 7, 8, 10, 11]
    assert sliding[3:6] == t1[3:6] and sliding[8] == t1[8]
    # c wrote its windows 6-7 (captured), 10-11 and its full-attention blocks 9-11
    assert tier.free_slots == 64 - 15 - 7
    tier._release("t1@host", tier._copies["t1@host"], "evicted")
    tier.confirmed(Confirmed("t1@host", time.perf_counter() - 0.001))
    tier.step()
    # t1's block 9 (its window and its full-attention block) came free; c still names the rest
    assert tier.free_slots == 64 - 15 - 7 + 2 and not set(t1[3:6]) & set(tier._free)


def test_a_decode_captures_the_window_before_its_prompts_last_complete_block():
    """Block size 16, a 128-token sliding window: a pull ending at block 20 (a 330-token prompt's
    last complete block) needs blocks 12-19 of the sliding-window group; the full-attention group
    keeps its blocks until the request finishes, so nothing of it is captured."""
    from kvloop.agents.connector.config import KvloopConfig
    from kvloop.agents.connector.decode import DecodeSide

    tier, _ = _tier(64)
    side = DecodeSide(
        KvloopConfig(), 16, lambda e: None, num_kv_blocks=100, host=tier, group_windows=(128, 0)
    )
    sliding = [0] * 11 + [200 + p for p in range(11, 21)]  # vLLM allocated the window and a block more
    full = [300 + p for p in range(21)]
    side.capture_window("r", [sliding, full], 330)
    (capture,) = side.take_host_captures().values()
    assert capture.block_ids == [[200 + p for p in range(12, 20)]]
    plain = DecodeSide(KvloopConfig(), 16, lambda e: None, num_kv_blocks=100, host=tier, group_windows=(0,))
    plain.capture_window("q", [full], 330)
    assert plain.take_host_captures() == {}


def test_a_request_waits_for_its_window_capture_but_never_longer_than_the_wait():
    from kvloop.agents.connector.host.pool import HeldRequests

    held = HeldRequests(wait_s=5.0)
    held.hold("a", "a@window", 100.0)
    held.hold("b", "b@window", 100.0)
    assert held.release({"a@window", "b@window"}, 101.0) == (set(), [])  # both still being written
    assert held.release({"b@window"}, 102.0) == ({"a"}, [])  # a's copy ended: a goes on
    # b's WRITE hangs: b decodes anyway once the wait is over, and its capture is abandoned
    assert held.release({"b@window"}, 105.0) == ({"b"}, ["b@window"])
    assert held.requests == {}


@pytest.mark.parametrize("gib, per_block, slots", [(1.0, 2**20, 1023), (0.0, 2**20, 0), (2**-20, 2**20, 0)])
def test_pool_slots_leave_slot_zero_for_the_null_block(gib, per_block, slots):
    from types import SimpleNamespace

    from kvloop.agents.connector.host.pool import pool_slots

    config = SimpleNamespace(num_blocks=10, kv_cache_tensors=[SimpleNamespace(size=10 * per_block)])
    assert pool_slots(config, gib) == slots  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ with engines
# This module's engine pair (conftest's host_pair) has a decode with a host pool; it runs after the
# tiny-Llama pair's tests.


def _host_runs(pair, first_hash: bytes, handle: str) -> list:
    return pair.kvloop.locations(first_hash, "retained", handle)


@pytest.mark.engines
def test_a_pull_from_the_host_pool_gives_the_kv_a_recompute_gives(host_pair):
    """Turn 1 retains on the decode, which copies the run into its host pool (the bytes equal the KV
    cache's, block by block) and announces the copy as a host-tier run of its own engine,
    ``decode-0@host``. With the decode's copy of the run given up, the next turn's prefill pulls the
    history from the host pool, and the KV it gets equals a recompute's, block by block."""
    import random
    import uuid

    from conftest import KV_BYTES_PER_BLOCK
    from test_reverse_pull import prefill_and_check, rand_tokens

    from kvloop.v1 import directory_pb2 as pb
    from tests.support import wait_until

    pair = host_pair
    rnd = random.Random(41)
    prompt = rand_tokens(rnd, 700)
    p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
    d = pair.decode.generate(prompt, 32, p["kv_transfer_params"])
    handle = d["kv_transfer_params"]["remote_request_id"]
    hashes = pair.decode.call("block_hashes", prompt + d["token_ids"])
    device_ids = d["kv_transfer_params"]["remote_block_ids"][0]

    def copied() -> list:
        pair.decode.generate(rand_tokens(rnd, 8), 1)  # the in-process engine steps only for requests
        return _host_runs(pair, hashes[0], f"{handle}@host")

    (host,) = wait_until(copied, 30, "the host copy announced")
    assert host.tier == pb.BLOCK_TIER_HOST
    # the slot of each block, as the directory lists it (one id per KV-cache group)
    slots = [_host_runs(pair, h, f"{handle}@host")[0].block_ids[0] for h in hashes]
    assert 0 not in slots and len(set(slots)) == len(slots)
    assert pair.decode.call("host_pool_diff", {"ids": device_ids[: len(slots)], "slots": slots}) == [0] * len(
        slots
    ), "the pool holds other bytes than the KV cache"
    metrics = pair.decode.call("metrics")
    assert metrics.get(("kvloop_connector_host_copies_total", (("outcome", "copied"),)))
    # the WRITE as NIXL counted and timed it: every block of the copy, once
    assert metrics.get(("kvloop_connector_host_copied_bytes_total", ()), 0) >= len(slots) * KV_BYTES_PER_BLOCK
    assert metrics.get(("kvloop_connector_host_copy_seconds_count", ()), 0) >= 1

    # the decode's own copy goes (the pool still holds the run): the next turn reads the pool
    def device_dropped() -> bool:
        pair.decode.generate(rand_tokens(rnd, 8), 1)
        return not _host_runs(pair, hashes[0], handle)

    wait_until(device_dropped, 30, "the KV-cache run dropped")
    nxt = prompt + d["token_ids"] + rand_tokens(rnd, 64)
    pf = prefill_and_check(pair, nxt)
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.tier"] == "host", pf.span
    # the whole history but its last token (as from a KV cache): the tail block came from the pool too
    assert pf.out["num_cached_tokens"] == len(nxt) - 64 - 1


def _finish(side: DecodeSide, rid: str, blocks: list[int], own_conversation: bool = True) -> bool:
    """A decode request ``rid`` finishes holding ``blocks``: True when retained (announced, or bound
    for the pool). Each request's hashes are its own conversation's, unless ``own_conversation`` is
    False (then requests of one length hold the same blocks)."""
    from test_connector_units import _Finished

    if not side.admits([blocks], rid):
        return False
    request = _Finished(rid, len(blocks))
    if own_conversation:
        request.block_hashes = [rid.encode() * 32 + h for h in request.block_hashes]
    side.announce(request, {"remote_block_ids": [blocks]}, 60.0, [blocks])
    return True


def test_a_run_past_the_share_moves_to_the_pool_instead_of_being_declined():
    """Past retention_max_share, a finishing request the pool has room for is admitted only to be
    copied there: it is never announced from the KV cache, and its blocks are freed as soon as the
    copy is made, while the copy is announced as a host run."""
    from test_connector_units import _Finished

    from kvloop.agents.connector.config import KvloopConfig
    from kvloop.agents.connector.decode import DecodeSide

    events: list = []
    cfg = KvloopConfig(retention_max_share=0.1)
    host = HostTier(64, 600.0, 2.0, events.append, None)
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, host=host)  # 10 blocks pinned at most

    assert _finish(side, "fits", list(range(1, 9)), own_conversation=False)
    (device,) = events
    assert device.retention_handle == "fits" and device.tier == "device"
    events.clear()
    assert _finish(
        side, "moves", list(range(20, 28)), own_conversation=False
    )  # 8 more blocks: past the share, the pool has room
    assert events == []  # not announced from the KV cache
    assert [c.handle for c in side.take_host_copies()] == ["fits@host", "moves@host"]
    assert side.take_free_early() == {}  # its blocks stay until the copy is made
    side.host_copied({"moves@host": True})
    (announced,) = [e for e in events if e.retention_handle == "moves@host"]
    assert announced.tier == "host"
    assert set(side.take_free_early()) == {"moves"}  # then they go at once: nobody was handed them
    host_full = HostTier(2, 600.0, 2.0, events.append, None)
    full = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, host=host_full)
    assert full.admits([list(range(1, 11))], "a")
    full.announce(_Finished("a", 10), {"remote_block_ids": [list(range(1, 11))]}, 60.0, [list(range(1, 11))])
    assert not full.admits([[50, 51, 52]], "b")  # no room in the pool either: declined as before


class _FakeDecodeConfirmer(FakeConfirmer):
    """What DecodeSide asks of its ReleaseConfirmer; drops are confirmed by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.done: list[Confirmed] = []

    def take(self) -> list[Confirmed]:
        out, self.done = self.done, []
        return out

    def stop(self) -> None:
        pass


def test_a_run_past_the_share_waits_for_pool_room_announced_from_the_kv_cache():
    """Past the share, with the pool full of announced copies: the finishing run is not declined. The
    pool gives up its oldest copy; until that copy's slots come free the run stays announced from the
    KV cache (pullable), and once its own copy is announced its KV-cache blocks are given up."""

    from kvloop.agents.connector.config import KvloopConfig
    from kvloop.agents.connector.decode import DecodeSide

    events: list = []
    confirmer = _FakeDecodeConfirmer()
    cfg = KvloopConfig(retention_max_share=0.1)
    host = HostTier(16, 600.0, 2.0, events.append, confirmer)  # type: ignore[arg-type]
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, confirmer=confirmer, host=host)  # type: ignore[arg-type]
    side._confirmer = confirmer  # type: ignore[assignment]  # publish_events off in this config

    def announced(handle: str) -> bool:
        return any(isinstance(e, KvloopBlocksRetained) and e.retention_handle == handle for e in events)

    assert _finish(side, "a", list(range(1, 9)))  # 8 blocks, within the share; copied into the pool
    side.host_copied({c.handle: True for c in side.take_host_copies()})
    # past the share, within max_in_transit: b is announced from the KV cache until its copy is (a
    # continuation arriving meanwhile pulls b, not an older copy), then given up
    assert _finish(side, "b", list(range(20, 28)))
    assert announced("b")
    side.host_copied({c.handle: True for c in side.take_host_copies()})
    assert announced("b@host") and host.free_slots == 0
    assert side.take_free_early() == {}  # b given up: its blocks wait for the directory's drop
    assert [g.handle for g in confirmer.asked] == ["b"]
    confirmer.done.append(Confirmed("b", time.perf_counter() - 0.001))
    assert set(side.take_free_early()) == {"b"}
    side.released({"b"})
    # pool full of announced copies, share full: c overflows instead of being declined
    assert _finish(side, "c", list(range(40, 48)))
    assert announced("c")  # pullable from the KV cache meanwhile
    assert host.copying("c") and [g.handle for g in confirmer.asked] == ["b", "a@host"]  # oldest copy
    confirmer.done.append(Confirmed("a@host", time.perf_counter() - 0.001))
    assert side.take_free_early() == {}  # a's slots free: c's copy is written now
    (copy,) = side.take_host_copies()
    assert copy.handle == "c@host"
    side.host_copied({"c@host": True})
    side.take_free_early()
    released = [e.retention_handle for e in events if isinstance(e, KvloopRetentionReleased)]
    assert released == ["b", "a@host", "c"] and announced("c@host")  # the pool serves c now
    assert [g.handle for g in confirmer.asked] == ["b", "a@host", "c"]
    confirmer.done.append(Confirmed("c", time.perf_counter() - 0.001))
    assert set(side.take_free_early()) == {"c"}  # its KV-cache blocks go once the drop is confirmed


def test_runs_moving_to_the_pool_are_not_bounded_but_runs_announced_meanwhile_are():
    """A run kept announced from the KV cache until its copy is holds its blocks for a read window
    more, so those stay within ``max_in_transit`` beyond the share; past it, a run that moves holds
    its blocks for a step or so (until its copy is written), however many finish at once."""

    from kvloop.agents.connector.config import KvloopConfig
    from kvloop.agents.connector.decode import DecodeSide

    events: list = []
    confirmer = _FakeDecodeConfirmer()
    cfg = KvloopConfig(retention_max_share=0.1)
    host = HostTier(40, 600.0, 2.0, events.append, confirmer)  # type: ignore[arg-type]
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, confirmer=confirmer, host=host)  # type: ignore[arg-type]
    side._confirmer = confirmer  # type: ignore[assignment]  # publish_events off in this config
    assert side.max_in_transit == 10

    # three runs of 12 blocks finish at once, each past the share alone: a is announced from here
    # (12 kept, within 10 + 10), b and c would pass that and move (36 pinned)
    assert all(_finish(side, rid, list(range(20 * i + 1, 20 * i + 13))) for i, rid in enumerate("abc"))
    assert side.pinned_blocks == 36
    assert [e.retention_handle for e in events if isinstance(e, KvloopBlocksRetained)] == ["a"]
    side.host_copied({c.handle: True for c in side.take_host_copies()})
    assert set(side.take_free_early()) == {"b", "c"}  # a's drop awaits the directory
    confirmer.done.append(Confirmed("a", time.perf_counter() - 0.001))
    assert set(side.take_free_early()) == {"a"}
    side.released({"a", "b", "c"})
    # the pool (4 free of 40) must now release copies for the next runs: they wait, announced from
    # here, until the kept blocks would pass the share plus max_in_transit (20)
    assert _finish(side, "d", list(range(100, 112)))
    assert _finish(side, "e", list(range(120, 128)))  # 12 + 8 = 20 kept
    assert not _finish(side, "f", [130])  # 21: declined
    assert {e.retention_handle for e in events if isinstance(e, KvloopBlocksRetained)} >= {"d", "e"}


@pytest.mark.engines
def test_a_relaunched_decode_forgets_its_pool(host_pair):
    """The decode killed and relaunched under its agent (a new epoch), its pool with it. The
    old process's copies leave the directory with its other runs, and the next turn recomputes."""
    import random
    import uuid

    from test_reverse_pull import prefill_and_check, rand_tokens, relaunch_decode

    from tests.support import wait_until

    pair = host_pair
    rnd = random.Random(47)
    prompt = rand_tokens(rnd, 700)
    p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
    d = pair.decode.generate(prompt, 32, p["kv_transfer_params"])
    handle = d["kv_transfer_params"]["remote_request_id"]
    first_hash = pair.decode.call("block_hashes", prompt)[0]

    def copied() -> list:
        pair.decode.generate(rand_tokens(rnd, 8), 1)
        return _host_runs(pair, first_hash, f"{handle}@host")

    wait_until(copied, 30, "the host copy announced")
    relaunch_decode(pair)
    wait_until(lambda: not _host_runs(pair, first_hash, f"{handle}@host"), 30, "the old epoch's copy dropped")
    pf = prefill_and_check(pair, prompt + d["token_ids"] + rand_tokens(rnd, 64))
    assert pf.span["kvloop.path"] == "miss", pf.span


@pytest.mark.engines
def test_a_copy_the_pool_released_is_recomputed_and_named(host_pair):
    """A small pool under churn: once a conversation's copy is released for room (and its KV-cache
    run is long given up), its next turn recomputes, named as a miss, with the same answer as a
    recompute; nothing read a released copy."""
    import random
    import uuid

    from test_reverse_pull import prefill_and_check, rand_tokens

    from tests.support import wait_until

    pair = host_pair
    rnd = random.Random(43)
    slots = _metric(pair, "kvloop_connector_host_released_total", ("reason", "evicted"))
    first = None
    histories = []
    # each conversation takes 23 slots of the pool's 272: the oldest copies are released for room
    for _ in range(14):
        prompt = rand_tokens(rnd, 700)
        p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
        d = pair.decode.generate(prompt, 32, p["kv_transfer_params"])
        pair.decode.generate(rand_tokens(rnd, 8), 1)  # a step: the copy is posted and reported
        histories.append(prompt + d["token_ids"])
        if first is None:
            first = (
                d["kv_transfer_params"]["remote_request_id"],
                pair.decode.call("block_hashes", prompt)[0],
            )
    assert first is not None
    handle, first_hash = first

    def released() -> bool:
        pair.decode.generate(rand_tokens(rnd, 8), 1)
        return _metric(pair, "kvloop_connector_host_released_total", ("reason", "evicted")) > slots

    wait_until(released, 30, "the oldest copies released for room")
    wait_until(lambda: not _host_runs(pair, first_hash, f"{handle}@host"), 30, "the first copy dropped")
    assert not _host_runs(pair, first_hash, handle)  # its KV-cache run went long ago (demoted at once)
    pf = prefill_and_check(pair, histories[0] + rand_tokens(rnd, 64))
    assert pf.span["kvloop.path"] == "miss" and pf.span["kvloop.reason"] == "miss", pf.span
    # the latest conversation still pulls (from its copy, or its run still in the KV cache)
    last = prefill_and_check(pair, histories[-1] + rand_tokens(rnd, 64))
    assert last.span["kvloop.path"] == "transfer", last.span
    assert not _metric(pair, "kvloop_connector_host_copies_total", ("outcome", "failed"))


def _metric(pair, name: str, label: tuple[str, str]) -> float:
    return pair.decode.call("metrics").get((name, (label,)), 0.0)


def _run_of(handle: str, n: int, first_id: int) -> KvloopBlocksRetained:
    """A run of ``n`` blocks of its own (hashes no other run starts with)."""
    return KvloopBlocksRetained(
        block_hashes=[f"{handle}/{i}".encode().ljust(32, b".") for i in range(n)],
        block_ids=[[first_id + i for i in range(n)]],
        retention_handle=handle,
        lease_ms=60_000,
        single_use=False,
    )


def _copied(tier: HostTier, handle: str, n: int, first_id: int) -> None:
    tier.plan(_run_of(handle, n, first_id))
    tier.take_copies()
    tier.copied({handle + "@host": True})


def _released(events: list) -> list[str]:
    return [e.retention_handle for e in events if isinstance(e, KvloopRetentionReleased)]


def test_by_default_the_oldest_copies_go_first():
    tier, events = _tier(12)
    assert tier.eviction.name == "lru"
    for i, handle in enumerate(["a", "b", "c"]):
        _copied(tier, handle, 3, 10 + 10 * i)
    assert tier.eviction.victims(0.0) == ["a@host", "b@host", "c@host"]
    tier.plan(_run_of("d", 5, 50))  # 3 free, 5 needed: a goes (its slots come free once fenced)
    assert _released(events) == ["a@host"]
    assert tier.eviction.victims(0.0) == ["b@host", "c@host"]  # released copies leave the policy


def test_the_pool_releases_copies_in_its_policys_order_skipping_copies_not_announced():
    from kvloop.agents.connector.host.eviction import Lru

    class Newest(Lru):
        def victims(self, now: float) -> list[str]:
            return super().victims(now)[::-1]

    tier, events = _tier(12)
    tier.eviction = Newest()
    for i, handle in enumerate(["a", "b"]):
        _copied(tier, handle, 3, 10 + 10 * i)
    tier.plan(_run_of("c", 3, 30))  # still being copied: never released
    tier.take_copies()
    tier.plan(_run_of("d", 4, 40))  # 3 free, 4 needed: the newest announced copy, b, goes
    assert _released(events) == ["b@host"]


def test_the_tier_takes_its_eviction_policy_by_name():
    tier = HostTier(8, 600.0, 2.0, lambda e: None, None, eviction="predicted_return")
    assert tier.eviction.name == "predicted_return" and tier.eviction.horizon_s == 600.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown host eviction policy 'mru'"):
        HostTier(8, 600.0, 2.0, lambda e: None, None, eviction="mru")


def test_an_idle_decode_is_woken_to_give_up_a_run_whose_copy_is_old_enough():
    """With ``kvloop_host_demote_after_s``, a run whose copy is announced is parked (the engine loop
    may sleep) only until its demotion is due, not until its lease ends: the step that gives it up
    comes then even on a decode with nothing else to do."""
    from kvloop.agents.connector.config import KvloopConfig
    from kvloop.agents.connector.decode import DecodeSide

    events: list = []
    confirmer = _FakeDecodeConfirmer()
    cfg = KvloopConfig(retention_max_share=0.5, host_demote_after_s=5.0)
    host = HostTier(64, 600.0, 2.0, events.append, confirmer)  # type: ignore[arg-type]
    side = DecodeSide(cfg, 4, events.append, num_kv_blocks=100, confirmer=confirmer, host=host)  # type: ignore[arg-type]
    assert _finish(side, "a", list(range(1, 9)))
    assert side.parked_until("a") is None  # its copy is reported at an engine step
    side.host_copied({c.handle: True for c in side.take_host_copies()})
    announced = host.announced_at["a"]
    lease_end = side.parked_until("a")
    assert lease_end is not None and lease_end == pytest.approx(announced + 5.0)
    host.announced_at["a"] = announced - 5.0  # the copy is 5 s old: due now
    side.take_free_early()
    assert [g.handle for g in confirmer.asked] == ["a"]  # given up from the KV cache
    assert side.parked_until("a") is None  # the engine steps until the drop is settled
    without = DecodeSide(KvloopConfig(retention_max_share=0.5), 4, events.append, num_kv_blocks=100)
    assert _finish(without, "b", list(range(20, 28)))
    assert without.parked_until("b") is not None and without.parked_until("b") > announced + 30  # its lease


def test_a_host_run_is_announced_with_its_slots_digests_wherever_they_were_written():
    tier, events = _tier(16)
    tier.plan(_device("r1", 3, tail=True))
    (copy,) = tier.take_copies()
    digest_of = {b: 1000 + b for b in copy.block_ids[0]}  # the worker's digests of the source blocks
    tier.digests.reported({"r1@host": {0: [[digest_of[b] for b in copy.block_ids[0]]]}})
    tier.copied({"r1@host": True})
    (first,) = events
    digests = block_digests.unpack(first.block_digests)
    assert [digests.of(0, 0, p) for p in range(4)] == [1010, 1011, 1012, 1013]  # the tail block last
    # a later turn names the slots the pool holds already: their digests come from the first copy
    tier.plan(_device("r2", 5, tail=False))
    (second,) = tier.take_copies()
    assert second.block_ids == [[13, 14]]  # only blocks 3 and 4 are written
    tier.digests.reported({"r2@host": {0: [[2013, 2014]]}})
    tier.copied({"r2@host": True})
    later = next(e for e in events if e.retention_handle == "r2@host")
    digests = block_digests.unpack(later.block_digests)
    assert [digests.of(0, 0, p) for p in range(5)] == [1010, 1011, 1012, 2013, 2014]


def test_a_host_run_whose_slots_digests_are_not_all_known_goes_out_unchecked():
    tier, events = _tier(16)
    tier.plan(_device("r1", 3))
    tier.take_copies()
    tier.copied({"r1@host": True})  # the worker reported no digests (it has none)
    (host,) = events
    assert host.block_digests == b""
