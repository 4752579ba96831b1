"""Token-sequence comparisons shared by the connector and the benchmark."""

from __future__ import annotations

from collections.abc import Sequence


def agreeing_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share. With causal attention the KV computed for one is
    right for the other at exactly these positions."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
