"""Ids as little-endian uint32s, 4 bytes each: how block ids and token ids travel packed in kvloop's
messages and Redis values (a bytes field decodes without a Python object per id)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_LITTLE = sys.byteorder == "little"


def pack_u32(values: Iterable[int]) -> bytes:
    """The values packed; OverflowError when one is not a uint32."""
    packed = array("I", values)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def unpack_u32(raw: bytes) -> array:
    """The ids of ``raw`` (native order, typecode "I"); ValueError when its length is not a multiple of 4."""
    out = array("I")
    out.frombytes(raw)
    if not _LITTLE:
        out.byteswap()
    return out
