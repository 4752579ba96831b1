"""Where the Redis Cluster store (:mod:`.redis_cluster_store`) keeps a model's block keys.

A model's block keys are spread over ``buckets`` hash tags. Placing a whole chain in one bucket by
its first block kept a Lookup to one call, but every conversation that starts with the same system
prompt shares that first block, so a fleet whose traffic is a handful of system prompts loaded one
primary with most of the cluster's work. Here the buckets form ``columns`` of ``spread`` each, and
a chain's first block (with its LoRA) picks a column only; within it:

* a retained run goes to the bucket its handle picks: a Lookup asks the column's ``spread`` buckets
  side by side and keeps the longest match (every run that can answer a prompt holds its first
  block, so it is in one of them), the same answer one bucket gave;
* a prefix-cache block goes to the bucket its own key picks: a Route asks each bucket for the
  prompt's blocks it holds, in order, and a worker's cached prefix ends at the first block any of
  them lacks.

A bucket's hash tag is chosen so that its slot lies in the bucket's own stretch of the 16384 slots,
the buckets in order: the ``spread`` buckets of a column are a ``1 / spread`` of the slots apart, so
on a cluster whose primaries own equal contiguous slot ranges (what ``redis-cli --cluster create``
makes) a column with ``spread`` equal to the primaries puts one bucket on each.

The layout is recorded in the store (``LAYOUT_KEY``): block keys of another layout would never be
found where this one looks, nor removed, so a kvloopd refuses a store holding another one.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from redis.crc import key_slot
from redis.exceptions import RedisError

from kvloop.common.block_keys import KEY_BYTES
from kvloop.daemon.index.model import BlockTier
from kvloop.daemon.index.redis_wire import MODELS, PREFIX, text

SLOTS = 16384
# The cluster key layout this code writes: "2" spreads a chain over a column of buckets. The first
# layout (a chain in the bucket of its first block) recorded nothing.
LAYOUT = "2"
LAYOUT_KEY = f"{PREFIX}:cluster-layout"
# Buckets of a column: one per primary of a three-primary cluster.
DEFAULT_SPREAD = 3
_KEY = np.dtype("<u8")
assert _KEY.itemsize == KEY_BYTES


class OtherLayout(RedisError):
    """The cluster holds a directory written in another key layout (a RedisError: startup reports it
    as a store it cannot use)."""


async def claim_layout(client: Any, layout: Layout) -> None:
    """Record this store's key layout in a new cluster; refuse one that holds a directory in another:
    an older kvloopd's, or one placed with other bucket counts (its block keys would be neither found
    nor removed here, and a removed run could still be handed out)."""
    mine = layout.record()
    found = await client.get(LAYOUT_KEY)
    if found is None:
        if await client.hlen(MODELS):
            raise OtherLayout(
                "the cluster holds a directory in an older key layout: stop the kvloopd replicas using "
                "it and flush it (the agents re-push their state), or run the kvloopd release that wrote it"
            )
        await client.set(LAYOUT_KEY, mine, nx=True)
        found = await client.get(LAYOUT_KEY)
    if found is None or text(found) != mine:
        raise OtherLayout(
            f"the cluster holds a directory in key layout {text(found or '')!r} (layout:buckets:spread); "
            f"this kvloopd writes {mine!r}: run every replica with the same cluster_buckets and "
            "cluster_spread, or flush the cluster (the agents re-push their state)"
        )


@functools.lru_cache(maxsize=16384)
def bucket_base(model: str, bucket: int, buckets: int) -> str:
    """The key prefix of bucket ``bucket`` of the ``buckets`` in columns: its hash tag's slot is
    inside the bucket's own stretch of the slots, two slots clear of either end (a primary's range
    may end inside it). A bucket past them (never used) takes any slot."""
    tag = hashlib.sha1(model.encode()).hexdigest()[:16]
    low, high = bucket * SLOTS // buckets + 2, (bucket + 1) * SLOTS // buckets - 2
    if bucket >= buckets:
        low = high = 0
    suffix = 0
    # a stretch of a few slots would take thousands of tries: then any slot does
    while high - low >= 4 and not low <= key_slot(f"{tag}.{bucket}.{suffix}".encode()) < high:
        suffix += 1
    return f"{PREFIX}:{{{tag}.{bucket}.{suffix}}}:"


class Layout:
    """Buckets as ``columns`` x ``spread``: bucket ``column + part * columns``."""

    def __init__(self, buckets: int, spread: int = DEFAULT_SPREAD) -> None:
        if not 1 <= buckets <= SLOTS:
            raise ValueError(f"buckets must be 1..{SLOTS}, got {buckets}")
        if not 1 <= spread <= buckets:
            raise ValueError(f"spread must be 1..buckets ({buckets}), got {spread}")
        self.spread = spread
        self.buckets = buckets
        self.columns = buckets // spread
        self._in_columns = self.columns * spread  # a remainder would unbalance them: left unused

    def record(self) -> str:
        """What the cluster records of this layout (LAYOUT_KEY): replicas must agree on all of it."""
        return f"{LAYOUT}:{self.buckets}:{self.spread}"

    def base(self, model: str, bucket: int | str | bytes) -> str:
        number = bucket if isinstance(bucket, int) else int(text(bucket))
        return bucket_base(model, number, self._in_columns)

    def column(self, lora_name: str, root: bytes) -> int:
        """The column of a chain whose first block is ``root`` (a hash or its key: the key decides)."""
        return zlib.crc32(root[:KEY_BYTES], zlib.crc32(lora_name.encode())) % self.columns

    def chain(self, lora_name: str, root: bytes) -> list[int]:
        """Every bucket a chain's runs and blocks may be in."""
        column = self.column(lora_name, root)
        return [column + part * self.columns for part in range(self.spread)]

    def of_run(self, lora_name: str, root: bytes, handle: str) -> int:
        return self.column(lora_name, root) + zlib.crc32(handle.encode()) % self.spread * self.columns

    def split(self, column: int, keys: bytes) -> dict[int, tuple[bytes, list[int]]]:
        """Block keys (concatenated) by the bucket of ``column`` each goes to: the keys and their
        positions in ``keys``, in order. A key is a block hash's 8 bytes: read as a little-endian
        integer (the same on every host) its remainder picks the bucket."""
        words = np.frombuffer(keys, _KEY, len(keys) // KEY_BYTES)
        if self.spread == 1:
            return {column: (keys, list(range(len(words))))} if len(words) else {}
        parts = words % np.uint64(self.spread)
        out: dict[int, tuple[bytes, list[int]]] = {}
        for part in range(self.spread):
            at = np.flatnonzero(parts == part)
            if at.size:
                out[column + part * self.columns] = (words[at].tobytes(), at.tolist())
        return out


# A lookup function's reasons for answering none, the weakest first: the one a single bucket would
# have given is the strongest any bucket gives (see lookup_in in directory.lua).
_REASONS = ("", "peer_unavailable", "incompatible_layout", "expired", "claimed")


def _reason_rank(reason: str) -> int:
    return _REASONS.index(reason) if reason in _REASONS else len(_REASONS)


def merged_lookup(replies: Sequence[list[Any]], claim: bool) -> tuple[list[Any], int, list[int]]:
    """The lookup answers of a column's buckets as one bucket holding all their runs would have
    answered: (the reply, the index of the bucket its first holder came from or -1, the indexes of
    the other buckets that claimed a single-use run for it, whose claims must be given back)."""
    found = [i for i, reply in enumerate(replies) if text(reply[0]) == "found"]
    if not found:
        reason = max((text(reply[1]) for reply in replies), key=_reason_rank, default="")
        return ["none", reason], -1, []
    matched = max(int(replies[i][1]) for i in found)
    holders = [(i, entry) for i in found if int(replies[i][1]) == matched for entry in replies[i][2:]]
    # as one bucket orders them: device runs before host ones, then the longest-lived (a stable sort
    # keeps each bucket's own order among equals)
    holders.sort(key=lambda held: (int(held[1][9]) != BlockTier.DEVICE, -int(held[1][3])))
    winner = holders[0][0]
    claimed = [i for i in found if claim and i != winner and text(replies[i][2][6]) == "1"]
    return ["found", matched, *(entry for _, entry in holders[:8])], winner, claimed
