"""Block digests over the KV cache's own tensors (worker side): what a holder states its retained
blocks hold, and what a puller checks its READ brought against (common/block_digests.py carries them).

A block's digest in a KV-cache group is a weighted sum, modulo 2**64, of the block's 64-bit words
in every layer of that group (K and V, whatever the backend's layout), each word with a weight of
its own: odd, so a change to any one word always changes the sum; drawn per layer and position
(splitmix64), so swapped blocks, layers or words change it too. It detects; it is not a
cryptographic hash and needs none (nothing adversarial writes a KV cache). It is chosen because it
is one gather, one multiply and one sum per layer in torch: memory-bound on a GPU (one pass over the
pulled bytes at HBM bandwidth) as on a CPU, with nothing to build or install, and identical wherever
it runs (integer arithmetic, weights from a fixed generator, not from torch's RNG). A digest of 0
is never produced for a real block (it would read as "no block", common/block_digests.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(seeds: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64 seed (Steele, Lea and Flood's finalizer): well-spread weights."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def layer_weights(layer: int, words: int) -> torch.Tensor:
    """The odd weights of ``words`` 64-bit words of a block in a group's ``layer``-th layer (int64)."""
    seeds = (np.uint64(layer + 1) << np.uint64(40)) + np.arange(words, dtype=np.uint64)
    return torch.from_numpy((splitmix64(seeds) | np.uint64(1)).view(np.int64))


def _block_rows(cache: torch.Tensor, ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Blocks ``ids`` of one layer's cache as rows of 64-bit words, whether the layout puts blocks
    first (the CPU backend) or after K/V (a GPU backend's [2, blocks, ...])."""
    dim = 0 if cache.shape[0] == num_blocks else 1
    rows = cache.index_select(dim, ids.to(cache.device)).movedim(dim, 0).contiguous()
    flat = rows.view(torch.uint8).reshape(len(ids), -1)
    if flat.shape[1] % 8:  # a block of an odd byte length: pad its words with zeros
        flat = torch.nn.functional.pad(flat, (0, 8 - flat.shape[1] % 8))
    return flat.view(torch.int64)


class BlockDigester:
    """Digests of block ids per KV-cache group (vLLM's transfer groups, in their order: the groups a
    NIXL READ carries), over this worker's registered KV cache."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self.num_blocks = kv_cache_config.num_blocks
        self.groups: list[list[torch.Tensor]] = [
            [kv_caches[name] for name in group.layer_names if name in kv_caches]
            for group in kv_cache_config.transfer_groups
        ]
        self._weights: dict[tuple[int, int, str], torch.Tensor] = {}

    def _weights_for(self, layer: int, words: int, device: torch.device) -> torch.Tensor:
        key = (layer, words, str(device))
        w = self._weights.get(key)
        if w is None:
            w = self._weights[key] = layer_weights(layer, words).to(device)
        return w

    def group(self, g: int, block_ids: Sequence[int]) -> list[int]:
        """The digest of each block of group ``g`` (as uint64 ints; 0 for vLLM's null block 0)."""
        if not block_ids:
            return []
        caches = self.groups[g]
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        total: torch.Tensor | None = None
        for layer, cache in enumerate(caches):
            rows = _block_rows(cache, ids, self.num_blocks)
            part = (rows * self._weights_for(layer, rows.shape[1], rows.device)).sum(dim=1)
            total = part if total is None else total + part
        if total is None:
            return [0] * len(block_ids)
        values = total.cpu().numpy().view(np.uint64)
        # 0 means "no block": a real block whose sum is 0 gets 1 instead (a 2**-64 event)
        return [0 if b == 0 else (int(v) or 1) for b, v in zip(block_ids, values, strict=True)]

    def run(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Digests of a run's blocks, group by group (``block_ids[g][position]``)."""
        return [self.group(g, ids) for g, ids in enumerate(block_ids)]

    def corrupt(self, g: int, block_id: int) -> None:
        """Flip one byte of block ``block_id`` in group ``g``'s first layer (fault injection only)."""
        cache = self.groups[g][0]
        block = cache[block_id] if cache.shape[0] == self.num_blocks else cache[0, block_id]
        block.view(torch.uint8).view(-1)[0] ^= 0xFF
