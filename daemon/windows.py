"""Sliding-window coverage: how far each holder of a prompt can actually be pulled.

A store's match says how many leading blocks of the prompt a run holds by hash. On a hybrid model
(sliding-window and full-attention layers, one KV-cache group each) that is not what can be read: a
pull ending at block k needs, in every sliding-window group of w tokens, the blocks holding the last
w - 1 tokens before k (vLLM's ``SingleTypeKVCacheManager`` rules), and a holder keeps only some of
them (a decode frees a window's blocks as it generates past them; its host copy keeps the window at
the prompt's end as well). A run with a null block in that range cannot serve a pull ending there.

:func:`fit_windows` cuts each holding back to its longest servable end and ranks the holdings by it,
so the directory hands out the holder that serves the most of the prompt (a host copy holding the
previous prompt's window before a KV-cache run that kept only the last one), never a block range the
puller would have to decline.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvloop.common.packed_ids import pack_u32
from kvloop.common.sliding_window import first_needed_block
from kvloop.daemon.index.model import BlockTier, Holding, PrefixMatch

# vLLM's null block: a position a run's group no longer holds.
NULL_BLOCK = 0


def servable_blocks(holding: Holding, windows: Sequence[int], block_size: int, local_blocks: int) -> int:
    """The longest pull end (in blocks, at most ``holding.matched_blocks``) at which every group of
    ``windows`` (sliding window in tokens per group, 0: full attention) holds the blocks it needs
    past the puller's ``local_blocks``; ``local_blocks`` when there is none."""
    matched, groups = holding.matched_blocks, holding.num_groups
    if not any(windows) or len(windows) != groups or matched <= local_blocks:
        return matched
    ids = holding.block_ids
    # per sliding-window group: the last null position at or before each position (-1: none)
    last_null: list[tuple[int, list[int]]] = []
    for g, window in enumerate(windows):
        if not window:
            continue
        row, seen = [], -1
        for p in range(matched):
            if ids[g * matched + p] == NULL_BLOCK:
                seen = p
            row.append(seen)
        last_null.append((window, row))
    for end in range(matched, local_blocks, -1):
        if all(
            row[end - 1] < max(local_blocks, first_needed_block(end * block_size, window, block_size))
            for window, row in last_null
        ):
            return end
    return local_blocks


def cut(holding: Holding, blocks: int) -> Holding:
    """``holding`` serving only its first ``blocks`` blocks (its partly filled tail dropped)."""
    if blocks == holding.matched_blocks:
        return holding
    ids, matched = holding.block_ids, holding.matched_blocks
    kept = [ids[g * matched + p] for g in range(holding.num_groups) for p in range(blocks)]
    return msgspec.structs.replace(
        holding,
        matched_blocks=blocks,
        packed_block_ids=pack_u32(kept),
        tail_token_ids=(),
        tail_block_ids=(),
    )


def fit_windows(
    match: PrefixMatch, windows: Sequence[int], block_size: int, local_blocks: int
) -> PrefixMatch:
    """``match`` with each holding cut to its servable end and the holdings ranked by it (then a
    device run before a host one, then the store's order). Unchanged when the puller has no
    sliding-window group, or when no holding serves anything past ``local_blocks`` (the puller then
    names the group it could not read)."""
    if match.best is None or not any(windows):
        return match
    holdings = [match.best, *match.others]
    reach = [servable_blocks(h, windows, block_size, local_blocks) for h in holdings]
    if max(reach) <= local_blocks:
        return match
    order = sorted(
        (i for i in range(len(holdings)) if reach[i] > local_blocks),
        key=lambda i: (-reach[i], holdings[i].tier != BlockTier.DEVICE, i),
    )
    fitted = [cut(holdings[i], reach[i]) for i in order]
    return PrefixMatch(fitted[0], fitted[1:], match.unservable_reason)
