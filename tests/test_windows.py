"""Sliding-window coverage (daemon/windows.py): a holder of a hybrid model's prompt is handed out only
as far as its sliding-window groups hold the blocks a pull ending there needs, and the holder that
serves the most is handed out first (a host copy keeping the previous prompt's window before a
KV-cache run that kept only its last one)."""

from __future__ import annotations

import msgspec
import pytest

from kvloop.common.packed_ids import pack_u32
from kvloop.daemon.index import BlockTier, Holding, IndexConfig, Namespace, PrefixMatch, Retained, WorkerSpec
from kvloop.daemon.layout import KvLayout
from kvloop.daemon.policy import Policy
from kvloop.daemon.policy_config import PolicyConfig
from kvloop.daemon.queries import LookupQuery
from kvloop.daemon.windows import WINDOW_NOT_HELD, cut, fit_windows, servable_tokens
from kvloop.v1 import directory_pb2 as pb
from tests.store_backends import BACKENDS, open_store
from tests.support import conversation

BS = 16
WINDOWS = (128, 0)  # a sliding-window group of 8 blocks, then full attention
RUN = 30  # blocks of the run; the previous prompt ended at block 20
SPEC = WorkerSpec("decode-0", 2, "m", "e", "h:1", BS, "sha256_cbor", 32, 1, kv_bytes_per_block=1 << 20)


def sliding(held: range) -> list[int]:
    return [100 + p if p in held else 0 for p in range(RUN)]


# a decode's KV-cache run keeps the window at its end (plus a block); its host copy also keeps the
# complete blocks of the window that ended with the previous prompt
DEVICE_SW = sliding(range(21, 30))
HOST_SW = [a or b for a, b in zip(sliding(range(11, 20)), DEVICE_SW, strict=True)]
FULL = [500 + p for p in range(RUN)]


def holding(sw: list[int], matched: int, tier: int = BlockTier.DEVICE, handle: str = "r") -> Holding:
    ids = sw[:matched] + FULL[:matched]
    return Holding(SPEC, matched, handle, 60_000, pack_u32(ids), 2, False, (1, 2), (7, 8), tier=tier)


def servable_blocks(h: Holding, windows: tuple[int, ...], local_blocks: int) -> int:
    return servable_tokens(h, windows, BS, local_blocks, with_tail=False) // BS


def test_a_pull_ends_where_every_sliding_window_group_holds_the_window_before_it():
    # the whole run matched: the KV-cache run serves it all (its last window is held), and its tail
    assert servable_blocks(holding(DEVICE_SW, RUN), WINDOWS, 0) == RUN
    assert servable_tokens(holding(DEVICE_SW, RUN), WINDOWS, BS, 0) == RUN * BS + 2
    # the prompt departs at block 25: the device run holds no window ending at or before it
    assert servable_blocks(holding(DEVICE_SW, 25), WINDOWS, 0) == 0
    # the host copy serves up to the previous prompt's end: blocks 12-19 are its window
    assert servable_blocks(holding(HOST_SW, 25), WINDOWS, 0) == 20
    # a puller holding blocks up to 14 itself needs only blocks 14-19 of that window ...
    assert servable_blocks(holding(sliding(range(14, 20)), 25), WINDOWS, 14) == 20
    # ... and one holding nothing needs all of 12-19
    assert servable_blocks(holding(sliding(range(14, 20)), 25), WINDOWS, 0) == 0
    # full attention only: every matched block is servable (a full-attention group holds them all)
    assert servable_blocks(holding(DEVICE_SW, 25), (0, 0), 0) == 25


def test_a_cut_holding_keeps_each_groups_first_blocks_and_drops_the_tail():
    short = cut(holding(HOST_SW, 25), 20)
    assert short.matched_blocks == 20 and list(short.block_ids) == HOST_SW[:20] + FULL[:20]
    assert short.tail_token_ids == () and short.tail_block_ids == ()
    whole = holding(DEVICE_SW, RUN)
    assert cut(whole, RUN).tail_token_ids == () and cut(whole, RUN).matched_blocks == RUN


def test_a_cut_holding_hands_out_its_whole_runs_digests():
    """The digests cover the whole run (the tail block last): the puller indexes them by position, so
    a holding cut to fewer blocks carries them unchanged."""
    blob = b"whole run's digests"
    host = msgspec.structs.replace(holding(HOST_SW, 25, BlockTier.HOST, "r@host"), digests=blob)
    assert cut(host, 20).digests == blob
    fitted = fit_windows(PrefixMatch(host, []), WINDOWS, BS, 0)
    assert fitted.best is not None and fitted.best.matched_blocks == 20 and fitted.best.digests == blob


def test_the_holder_serving_the_most_is_handed_out_first():
    device = holding(DEVICE_SW, 25, handle="r")
    host = holding(HOST_SW, 25, BlockTier.HOST, "r@host")
    fitted = fit_windows(PrefixMatch(device, [host]), WINDOWS, BS, 0)
    assert fitted.best is not None and (fitted.best.handle, fitted.best.matched_blocks) == ("r@host", 20)
    assert fitted.others == []  # the KV-cache run serves nothing past the puller's prefix
    # both serve the whole run: the device run first (its READ is the cheaper), both kept
    both = fit_windows(
        PrefixMatch(holding(HOST_SW, RUN, BlockTier.HOST, "r@host"), [holding(DEVICE_SW, RUN)]),
        WINDOWS,
        BS,
        0,
    )
    assert both.best is not None and [both.best.handle, *[o.handle for o in both.others]] == ["r", "r@host"]
    # nothing servable: no holder, and why (a puller told to pull would have to decline)
    lost = fit_windows(PrefixMatch(device, []), WINDOWS, BS, 0)
    assert lost.best is None and lost.others == [] and lost.unservable_reason == WINDOW_NOT_HELD
    assert "sliding window 128" in lost.unservable_detail


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_lookup_hands_out_the_host_copy_that_holds_the_previous_prompts_window(backend, request):
    """Through a real store: the decode's KV-cache run and its host copy of one conversation, the
    next prompt agreeing with them through block 25. Lookup answers the copy, cut to the previous
    prompt's 20 blocks, with its slot ids."""
    store = await open_store(backend, IndexConfig(), request)
    try:
        await store.register(SPEC, 0, 0.0)
        hashes = conversation("c", RUN)
        device = Retained(hashes, DEVICE_SW + FULL, 2, "r", 60_000, False, tier=BlockTier.DEVICE)
        host = Retained(hashes, HOST_SW + FULL, 2, "r@host", 60_000, False, tier=BlockTier.HOST)
        await store.apply("decode-0", 1, 1, [device, host], 0.0)
        prompt = hashes[:25] + conversation("next", 10)
        policy = Policy(PolicyConfig(recompute_threshold_tokens=0, transfer_cost_ratio=1e9))
        layout = KvLayout(kv_group_windows=WINDOWS)
        answer = await policy.answer(
            store, LookupQuery(Namespace("m"), prompt, 0, "p", BS, layout=layout), 1.0
        )
        assert answer.decision == pb.DECISION_TRANSFER, answer.detail
        best = answer.match.best
        assert best is not None and (best.handle, best.tier, answer.matched_blocks) == (
            "r@host",
            BlockTier.HOST,
            20,
        )
        assert list(best.block_ids) == HOST_SW[:20] + FULL[:20]
        # a puller without sliding windows is answered as before: the longest match, device first
        plain = await policy.answer(store, LookupQuery(Namespace("m"), prompt, 0, "p", BS), 1.0)
        assert plain.match.best is not None and (plain.match.best.handle, plain.matched_blocks) == ("r", 25)
    finally:
        await store.close()
