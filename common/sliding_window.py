"""The one rule for what a sliding-window KV-cache group needs, shared by kvloopd and the connector."""

from __future__ import annotations


def first_needed_block(end_tokens: int, window: int, block_size: int) -> int:
    """The first block a pull (or a prefill) ending at ``end_tokens`` needs in a KV-cache group of
    ``window`` tokens (0: full attention, every block): the blocks holding the last ``window - 1``
    tokens before the end, as vLLM's ``SingleTypeKVCacheManager`` allocates them."""
    return max(0, (end_tokens - window + 1) // block_size) if window else 0
