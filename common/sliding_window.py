"""The one rule for which of a holder's blocks a pull needs, shared by kvloopd and the connector.

A pull (or a prefill) ending at token ``end`` needs, in each KV-cache group, every block from
:func:`first_needed_block` through the one holding token ``end - 1``, past the blocks the puller
computed itself (its local prefix): all of them for full attention, only the last ``window - 1``
tokens' for a sliding window (vLLM's ``SingleTypeKVCacheManager`` allocates nothing earlier). A
holder gives its blocks per group by position, :data:`NULL_BLOCK` where it no longer keeps one (a
decode frees a window's blocks as it generates past them), and its partly filled last block (the
tail) apart.

kvloopd cuts each holder it hands out to :func:`servable_end`, and the connector reads the holder
it got up to the same function's answer for its own local prefix and the tail tokens its prompt
agrees with: the two cannot disagree on a block range, because there is only this one place that
computes it. :func:`shortfall` says which group lacks which block, in the words both sides report.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's null block (``BlockPool.null_block``, never a real KV block): in a holder's group it marks
# a position whose KV the holder no longer keeps.
NULL_BLOCK = 0


def first_needed_block(end_tokens: int, window: int, block_size: int) -> int:
    """The first block a pull (or a prefill) ending at ``end_tokens`` needs in a KV-cache group of
    ``window`` tokens (0: full attention, every block): the blocks holding the last ``window - 1``
    tokens before the end, as vLLM's ``SingleTypeKVCacheManager`` allocates them."""
    return max(0, (end_tokens - window + 1) // block_size) if window else 0


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A group that lacks a block a pull needs: why the holder cannot serve that pull."""

    group: int
    window: int  # the group's sliding window in tokens (0: full attention)
    first: int  # the first block the pull needs in the group
    end: int  # one past the last block it needs
    missing: int  # a needed position the holder no longer keeps

    def __str__(self) -> str:
        kind = f"sliding window {self.window}" if self.window else "full attention"
        return (
            f"KV-cache group {self.group} ({kind}) needs blocks {self.first}-{self.end - 1}; "
            f"the holder no longer keeps block {self.missing}"
        )


def shortfall(
    block_ids: Sequence[Sequence[int]],
    windows: Sequence[int],
    block_size: int,
    local_blocks: int,
    end_tokens: int,
    tail_block_ids: Sequence[int] = (),
) -> Shortfall | None:
    """The first group lacking a block that a pull ending at ``end_tokens`` needs past the puller's
    ``local_blocks`` (None: every group holds them). ``block_ids[g][p]`` is group ``g``'s block at
    position ``p``; a pull ending inside a block reads that block from ``tail_block_ids``."""
    complete = end_tokens // block_size
    end = -(-end_tokens // block_size)
    for g, (ids, window) in enumerate(zip(block_ids, windows, strict=True)):
        first = max(local_blocks, first_needed_block(end_tokens, window, block_size))
        for p in range(first, end):
            if p < complete:
                held = ids[p]
            else:
                held = tail_block_ids[g] if g < len(tail_block_ids) else NULL_BLOCK
            if held == NULL_BLOCK:
                return Shortfall(g, window, first, end, p)
    return None


def servable_end(
    block_ids: Sequence[Sequence[int]],
    windows: Sequence[int],
    block_size: int,
    local_blocks: int,
    matched_blocks: int,
    tail_block_ids: Sequence[int] = (),
    tail_tokens: int = 0,
) -> int:
    """The longest pull end, in tokens, that every group serves past the puller's ``local_blocks``:
    ``matched_blocks`` blocks plus ``tail_tokens`` tokens of the tail block, or else the most whole
    blocks; ``local_blocks * block_size`` when no end past the local prefix is served.

    ``block_ids[g]`` holds group ``g``'s blocks by position for at least ``matched_blocks`` blocks;
    ``windows[g]`` is its sliding window in tokens (0: full attention). A longer end never needs an
    earlier block than a shorter one, so an end whose needed range holds a null block is skipped
    together with every end down to that block: the search costs one step per null, not per block."""
    if matched_blocks < local_blocks:
        return local_blocks * block_size
    nulls = [[p for p in range(matched_blocks) if ids[p] == NULL_BLOCK] for ids in block_ids]

    def blocking_null(end_tokens: int) -> int | None:
        """The highest null position a pull ending at ``end_tokens`` needs (None: none)."""
        end = min(-(-end_tokens // block_size), matched_blocks)
        blocker = None
        for row, window in zip(nulls, windows, strict=True):
            i = bisect_left(row, end) - 1
            if i >= 0 and row[i] >= max(local_blocks, first_needed_block(end_tokens, window, block_size)):
                blocker = row[i] if blocker is None else max(blocker, row[i])
        return blocker

    with_tail = matched_blocks * block_size + tail_tokens
    if (
        0 < tail_tokens < block_size
        and len(tail_block_ids) == len(nulls)
        and NULL_BLOCK not in tail_block_ids
        and blocking_null(with_tail) is None
    ):
        return with_tail
    end = matched_blocks
    while end > local_blocks:
        blocker = blocking_null(end * block_size)
        if blocker is None:
            return end * block_size
        end = blocker  # every end past the blocker needs it as well
    return local_blocks * block_size
