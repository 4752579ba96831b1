"""kvloop's layout and KV-cache-group rules against vLLM's own classes (vLLM installed, no engines).

* the daemon pairs a puller with a holder only when vLLM's NIXL connector can READ between their
  layouts (``TransferTopology.tp_ratio`` for TP sizes; the KV-cache groups of the hybrid allocator);
* the connector's per-group block choice follows vLLM's sliding-window allocation
  (``SlidingWindowManager.get_num_skipped_tokens``) and vLLM's clipping of retained groups.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvloop.agents.connector.decode import NULL_BLOCK, aligned  # noqa: E402
from kvloop.agents.connector.directory import HolderInfo  # noqa: E402
from kvloop.agents.connector.prefill import PrefillSide  # noqa: E402
from kvloop.agents.connector.remote_groups import remote_groups  # noqa: E402
from kvloop.agents.connector.scheduler import group_bytes_per_block, group_windows  # noqa: E402
from kvloop.daemon.layout import KvLayout, layout_mismatch  # noqa: E402

BS = 32
WINDOW = 128


def kv_cache_config(*specs) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.attn", f"model.layers.{i + 2}.attn"], s)
        for i, s in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


FULL = FullAttentionSpec(block_size=BS, num_kv_heads=6, head_size=64, dtype=torch.bfloat16)
SLIDING = SlidingWindowSpec(
    block_size=BS, num_kv_heads=6, head_size=64, dtype=torch.bfloat16, sliding_window=WINDOW
)


def topology(tp_size: int) -> TransferTopology:
    return TransferTopology(
        tp_rank=0,
        tp_size=tp_size,
        block_size=BS,
        engine_id="puller",
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=8,
        attn_backends=[],
    )


@pytest.mark.parametrize(("holder_tp", "puller_tp"), list(itertools.product([1, 2, 3, 4, 8], repeat=2)))
def test_tp_pairs_are_refused_exactly_where_vllms_nixl_topology_refuses_them(holder_tp, puller_tp):
    try:
        topology(puller_tp).tp_ratio(holder_tp)
        vllm_reads = True
    except AssertionError:
        vllm_reads = False
    why = layout_mismatch(
        KvLayout(holder_tp, 1, "bfloat16", 1024 // holder_tp),
        KvLayout(puller_tp, 1, "bfloat16", 1024 // puller_tp),
    )
    assert (why is None) == vllm_reads, why


def test_kv_cache_groups_of_a_hybrid_model_are_part_of_the_layout():
    hybrid = kv_cache_config(SLIDING, FULL)
    plain = kv_cache_config(FULL)  # the same model with the hybrid allocator off: one group
    assert group_windows(hybrid) == [WINDOW, 0] and group_windows(plain) == [0]
    assert group_bytes_per_block(hybrid) == [2 * SLIDING.page_size_bytes, 2 * FULL.page_size_bytes]
    windows = tuple(group_windows(hybrid))
    same = KvLayout(1, 1, "bfloat16", 1024, windows)
    assert layout_mismatch(same, same) is None
    assert layout_mismatch(same, KvLayout(1, 1, "bfloat16", 1024)) is None  # unknown: not checked
    why = layout_mismatch(same, KvLayout(1, 1, "bfloat16", 1024, tuple(group_windows(plain))))
    assert why is not None and "groups" in why
    other_window = KvLayout(1, 1, "bfloat16", 1024, (256, 0))
    assert "groups" in (layout_mismatch(same, other_window) or "")


def test_retained_groups_are_aligned_by_position():
    # vLLM's request_finished clips a sliding-window group to its last blocks (window + 1)
    clipped = ([7, 8, 9, 10, 11], list(range(20, 43)))
    sliding, full = aligned(clipped, 23)
    assert full == list(range(20, 43))
    assert sliding[:18] == [NULL_BLOCK] * 18 and sliding[18:] == [7, 8, 9, 10, 11]


def _prefill_side() -> PrefillSide:
    side = PrefillSide.__new__(PrefillSide)  # only the block arithmetic: no directory, no pool
    side.block_size = BS
    side.group_windows = (WINDOW, 0)
    side.group_bytes_per_block = (100, 1000)
    return side


def _holder(run_blocks: int, kept: int) -> HolderInfo:
    sliding = [NULL_BLOCK] * (run_blocks - kept) + [500 + p for p in range(run_blocks - kept, run_blocks)]
    return HolderInfo(
        "decode-0",
        "decode-0",
        "127.0.0.1",
        1,
        "",
        "h",
        (tuple(sliding), tuple(1000 + p for p in range(run_blocks))),
        60_000,
        False,
        1,
    )


@pytest.mark.parametrize("local_blocks", [0, 3, 30])
@pytest.mark.parametrize("end_tokens", [32 * 40, 32 * 40 - 5, 32 * 38 + 1, 32 * 36 + 31])
def test_sliding_window_group_reads_what_vllm_allocates(end_tokens, local_blocks):
    """The blocks read into the sliding-window group are exactly those vLLM allocates there for a
    request whose first ``end_tokens`` tokens are computed (the rest are null padding)."""
    side = _prefill_side()
    manager = SimpleNamespace(sliding_window=WINDOW, extra_retained_tokens=0)
    skipped_blocks = SlidingWindowManager.get_num_skipped_tokens(manager, end_tokens) // BS  # type: ignore[arg-type]
    end = -(-end_tokens // BS)
    allocated_here = list(range(max(skipped_blocks, local_blocks), end))
    matched, tail = end_tokens // BS, end_tokens % BS
    holder = _holder(41, WINDOW // BS + 1)
    if tail:
        holder = HolderInfo(**{**holder.__dict__, "tail_block_ids": (500 + matched, 1000 + matched)})
    reads = remote_groups(holder, side.group_windows, BS, matched, tail, local_blocks)
    if isinstance(reads, str):  # the holder keeps only its run's last window
        assert any(p < 41 - (WINDOW // BS + 1) for p in allocated_here), reads
        return
    assert reads.end_tokens == end_tokens
    sliding, full = reads.block_ids
    # vLLM end-trims each remote list to the blocks allocated here: the sliding list must cover them
    assert [b - 500 for b in sliding[-len(allocated_here) :]] == allocated_here if allocated_here else True
    assert len(sliding) == len(allocated_here)
    assert full == [1000 + p for p in range(end)]
    pulled = end_tokens - local_blocks * BS
    assert side.group_bytes(pulled, local_blocks * BS) == [
        100 * len(allocated_here),
        1000 * (end - local_blocks),
    ]


def test_a_pull_ending_before_the_holders_window_is_declined():
    why = remote_groups(_holder(40, 5), (WINDOW, 0), BS, 20, 0, 0)
    assert isinstance(why, str) and "sliding window" in why
