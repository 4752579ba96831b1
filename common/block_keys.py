"""Block keys: the leading 8 bytes of a block hash, which is all the directory compares.

The directory (either store) keys every block by the first ``KEY_BYTES`` of its hash, and a Lookup or
Route may send only those: a quarter of a 32-byte digest's bytes on every round trip, which a long
prompt pays in full (a 2,048-block Lookup carried 64 KiB; docs/benchmarks.md, "The request's size"). A
false match needs two of a model's distinct blocks to agree on 64 bits: about 1e-13 per probe with a
million entries. Finding a second block whose SHA-256 starts like a given one takes ~2^64 work, and
cache salts keep tenants' hashes apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KEY_BYTES = 8


def packed_keys(data: bytes, width: int) -> bytes:
    """The keys of ``len(data) // width`` concatenated hashes, concatenated (KEY_BYTES each)."""
    if width < KEY_BYTES:
        raise ValueError(f"a block hash of {width} bytes is shorter than a key ({KEY_BYTES})")
    n = len(data) // width
    if width == KEY_BYTES:
        return data if len(data) == n * width else data[: n * width]
    # Every hash's first 8 bytes in one strided copy in C: a strided view straight onto the hashes
    # (no reshape or slice between), then a contiguous copy; faster than array slicing, and far faster
    # than a Python loop per block (docs/benchmarks.md, "Where a Lookup's time goes").
    rows: np.ndarray
    if width % KEY_BYTES == 0:
        rows = np.ndarray((n,), _U64, data, 0, (width,))
    else:
        rows = np.ndarray((n, KEY_BYTES), _U8, data, 0, (width, 1))
    return np.ascontiguousarray(rows).tobytes()


_U64, _U8 = np.dtype(np.uint64), np.dtype(np.uint8)


def block_keys(hashes: Sequence[bytes]) -> list[bytes]:
    """Each hash's key (hashes of KEY_BYTES or more)."""
    return [h[:KEY_BYTES] for h in hashes]
