"""Which of a holder's blocks a reverse pull reads, per KV-cache group (no vLLM import: the rule is
the directory's as well, and both are tested side by side without an engine).

vLLM's rules, per group (``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` and
``get_exchange_clipped_blocks``): a full-attention group needs every block past the local prefix; a
sliding-window group of w tokens needs only the blocks holding the last w - 1 tokens before the
pull's end (the engine allocates nothing for earlier ones). The READ end-trims each remote list to
the blocks allocated here, so each list ends at the pull's last block. How far the holder serves is
``kvloop.common.sliding_window.servable_end``, the function kvloopd cut the holder with: a pull is
read to that end, which is shorter than the answer's only when this engine's local prefix or the
tail tokens its prompt agrees with differ from what the directory assumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.agents.connector.directory import HolderInfo
from kvloop.common.sliding_window import first_needed_block, servable_end, shortfall


@dataclass(frozen=True)
class RemoteGroups:
    end_tokens: int  # where the pull ends: the tokens the holder's KV covers, local prefix included
    block_ids: tuple[list[int], ...]  # the holder's blocks to read, per KV-cache group


def remote_groups(
    holder: HolderInfo,
    windows: Sequence[int],
    block_size: int,
    matched_blocks: int,
    tail_tokens: int,
    local_blocks: int,
) -> RemoteGroups | str:
    """The holder's blocks to read per KV-cache group for a pull of at most ``matched_blocks`` blocks
    plus ``tail_tokens`` tokens of its partly filled last block, past this engine's
    ``local_blocks``; or why nothing past them can be read."""
    if len(holder.block_ids) != len(windows):
        return f"the holder has {len(holder.block_ids)} KV-cache groups, this engine {len(windows)}"
    end_tokens = servable_end(
        holder.block_ids,
        windows,
        block_size,
        local_blocks,
        matched_blocks,
        holder.tail_block_ids,
        tail_tokens,
    )
    if end_tokens <= local_blocks * block_size:
        wanted = matched_blocks * block_size + tail_tokens
        lacking = shortfall(
            holder.block_ids, windows, block_size, local_blocks, wanted, holder.tail_block_ids
        )
        return str(lacking) if lacking else f"the holder serves nothing past the local {local_blocks} blocks"
    complete, tail = divmod(end_tokens, block_size)
    out = []
    for g, (ids, window) in enumerate(zip(holder.block_ids, windows, strict=True)):
        by_position = list(ids[:complete]) + ([holder.tail_block_ids[g]] if tail else [])
        first = max(local_blocks, first_needed_block(end_tokens, window, block_size))
        out.append(by_position[first:] if window else by_position)
    return RemoteGroups(end_tokens, tuple(out))
