"""Prefix comparisons of token sequences and of chained block-hash sequences, shared by the connector
and the benchmarks."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def agreeing_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading items two sequences share. For tokens: with causal attention the KV computed
    for one is right for the other at exactly these positions. For chained block hashes: the blocks
    two runs hold alike."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
