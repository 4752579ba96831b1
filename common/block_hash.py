"""vLLM's prefix-caching block hashes, computed without importing vLLM (kvloopd hashes token ids for Route).

vLLM (``vllm.v1.core.kv_cache_utils.hash_block_tokens``) chains one hash per full block:
``H((parent, tuple(block_tokens), extra_keys))``, with ``H(seed)`` standing in for the first
block's parent, ``seed`` being PYTHONHASHSEED or, for the sha256 algorithms, ``"vllm-none-hash"``.
``cache_salt`` enters the first block's extra keys only. A LoRA adds its name and adapter path to every
block's extra keys, and multimodal inputs their own hashes: neither is reproduced here.
``tests/test_route.py`` checks the result against vLLM's own function.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

# vLLM's NONE_HASH seed for cryptographic algorithms when PYTHONHASHSEED is unset.
DEFAULT_SEED = "vllm-none-hash"


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


ALGORITHMS: dict[str, Callable[[Any], bytes]] = {"sha256_cbor": _sha256_cbor, "sha256": _sha256_pickle}


class UnsupportedHashing(ValueError):
    """Settings under which kvloop cannot reproduce vLLM's hashes; the message says which."""


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    algorithm: str,
    seed: str = DEFAULT_SEED,
    cache_salt: str = "",
) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids``, as a vLLM engine computes them."""
    hash_fn = ALGORITHMS.get(algorithm)
    if hash_fn is None:
        raise UnsupportedHashing(
            f"hash algorithm {algorithm!r} cannot be reproduced (supported: {', '.join(sorted(ALGORITHMS))})"
        )
    if block_size <= 0:
        raise UnsupportedHashing(f"block size must be positive, got {block_size}")
    parent = hash_fn(seed)
    out = []
    tokens = list(token_ids)
    for i in range(len(tokens) // block_size):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = hash_fn((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra))
        out.append(parent)
    return out
