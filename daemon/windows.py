"""Sliding-window coverage: how far each holder of a prompt can actually be pulled.

A store's match says how many leading blocks of the prompt a run holds by hash. On a hybrid model
(sliding-window and full-attention layers, one KV-cache group each) that is not what can be read: a
pull needs, in every sliding-window group, the blocks holding the last window's tokens before its
end, and a holder keeps only some of them (a decode frees a window's blocks as it generates past
them; its host copy keeps the window at the prompt's end as well). How far a holder serves is
decided by ``kvloop.common.sliding_window.servable_end``, the function the connector checks the
pull with, so the directory never hands out a block range the puller would have to decline.

:func:`fit_windows` cuts each holding back to its longest servable end and ranks the holdings by it,
so the directory hands out the holder that serves the most of the prompt (a host copy holding the
previous prompt's window before a KV-cache run that kept only the last one); when none serves
anything past the puller's local prefix, the match says so (:data:`WINDOW_NOT_HELD`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvloop.common.packed_ids import pack_u32
from kvloop.common.sliding_window import servable_end, shortfall
from kvloop.daemon.index.model import BlockTier, Holding, PrefixMatch

# PrefixMatch.unservable_reason when holders match past the local prefix but none keeps the
# sliding-window blocks a pull ending there needs.
WINDOW_NOT_HELD = "window_not_held"


def _groups(holding: Holding) -> list[Sequence[int]]:
    ids, matched = holding.block_ids, holding.matched_blocks
    return [ids[g * matched : (g + 1) * matched] for g in range(holding.num_groups)]


def servable_tokens(
    holding: Holding, windows: Sequence[int], block_size: int, local_blocks: int, with_tail: bool = True
) -> int:
    """The longest pull end, in tokens, ``holding`` serves past the puller's ``local_blocks``
    (``local_blocks * block_size``: none). The directory does not see the prompt's tokens past its
    full blocks, so ``with_tail`` counts the whole tail as agreeing (as a continuation of the whole
    history does); without it, the end it serves whatever tail tokens the prompt agrees with."""
    matched = holding.matched_blocks
    tail = len(holding.tail_token_ids) if with_tail else 0
    if not any(windows) or len(windows) != holding.num_groups:
        # nothing windowed to check, or a layout mismatch the layout check answers
        return matched * block_size + tail
    return servable_end(
        _groups(holding), windows, block_size, local_blocks, matched, holding.tail_block_ids, tail
    )


def why_unservable(holding: Holding, windows: Sequence[int], block_size: int, local_blocks: int) -> str:
    """Which group lacks which block for a pull of the whole of ``holding``."""
    end = holding.matched_blocks * block_size + len(holding.tail_token_ids)
    lacking = shortfall(_groups(holding), windows, block_size, local_blocks, end, holding.tail_block_ids)
    return str(lacking) if lacking is not None else "no block past the local prefix"


def cut(holding: Holding, blocks: int) -> Holding:
    """``holding`` serving only its first ``blocks`` blocks (its partly filled tail dropped)."""
    if blocks == holding.matched_blocks and not holding.tail_token_ids:
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


def _cut_to(holding: Holding, end_tokens: int, block_size: int) -> Holding:
    """``holding`` serving a pull up to ``end_tokens``: whole, or cut to a block end."""
    if end_tokens == holding.matched_blocks * block_size + len(holding.tail_token_ids):
        return holding
    return cut(holding, end_tokens // block_size)


def fit_windows(
    match: PrefixMatch, windows: Sequence[int], block_size: int, local_blocks: int
) -> PrefixMatch:
    """``match`` with each holding cut to its servable end and the holdings ranked by it; at equal
    ends, the one that serves more whatever tokens of its tail the prompt agrees with, then a device
    run before a host one, then the store's order. Unchanged when the puller has no sliding-window
    group; no holding, with :data:`WINDOW_NOT_HELD` and the best holding's shortfall, when none
    serves anything past ``local_blocks``."""
    if match.best is None or not any(windows):
        return match
    holdings = [match.best, *match.others]
    local_tokens = local_blocks * block_size
    reach = [servable_tokens(h, windows, block_size, local_blocks) for h in holdings]
    servable = [i for i in range(len(holdings)) if reach[i] > local_tokens]
    if not servable:
        detail = why_unservable(match.best, windows, block_size, local_blocks)
        return PrefixMatch(None, [], WINDOW_NOT_HELD, detail)
    sure = {
        i: servable_tokens(holdings[i], windows, block_size, local_blocks, with_tail=False)
        if holdings[i].tail_token_ids
        else reach[i]
        for i in servable
    }
    order = sorted(servable, key=lambda i: (-reach[i], -sure[i], holdings[i].tier != BlockTier.DEVICE, i))
    fitted = [_cut_to(holdings[i], reach[i], block_size) for i in order]
    return PrefixMatch(fitted[0], fitted[1:], match.unservable_reason)
