"""vLLM's prefix-caching block hashes, computed without importing vLLM (kvloopd hashes token ids for Route).

vLLM (``vllm.v1.core.kv_cache_utils.hash_block_tokens``) chains one hash per full block:
``H((parent, tuple(block_tokens), extra_keys))``, with ``H(seed)`` standing in for the first
block's parent, ``seed`` being PYTHONHASHSEED or, for the sha256 algorithms, ``"vllm-none-hash"``.
``cache_salt`` enters the first block's extra keys only. A LoRA adds its name and adapter path to every
block's extra keys (``lora``: given both, they are); multimodal inputs add their own hashes, which are
not reproduced here.
``tests/test_route.py`` checks the result against vLLM's own function.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

_ID_BYTES = array("I").itemsize

# vLLM's NONE_HASH seed for cryptographic algorithms when PYTHONHASHSEED is unset.
DEFAULT_SEED = "vllm-none-hash"


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


ALGORITHMS: dict[str, Callable[[Any], bytes]] = {"sha256_cbor": _sha256_cbor, "sha256": _sha256_pickle}


class UnsupportedHashing(ValueError):
    """Settings under which kvloop cannot reproduce vLLM's hashes; the message says which."""


def _hash_fn(algorithm: str, block_size: int) -> Callable[[Any], bytes]:
    hash_fn = ALGORITHMS.get(algorithm)
    if hash_fn is None:
        raise UnsupportedHashing(
            f"hash algorithm {algorithm!r} cannot be reproduced (supported: {', '.join(sorted(ALGORITHMS))})"
        )
    if block_size <= 0:
        raise UnsupportedHashing(f"block size must be positive, got {block_size}")
    return hash_fn


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    algorithm: str,
    seed: str = DEFAULT_SEED,
    cache_salt: str = "",
    lora: tuple[str, str] | None = None,
) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids``, as a vLLM engine computes them;
    ``lora`` is the adapter's (name, path) as the engine was given them, for a LoRA request."""
    hash_fn = _hash_fn(algorithm, block_size)
    parent = hash_fn(seed)
    out = []
    tokens = list(token_ids)
    lora_keys: tuple[tuple[str, ...], ...] = (("lora", *lora),) if lora else ()
    for i in range(len(tokens) // block_size):
        keys = lora_keys + ((("cache_salt", cache_salt),) if i == 0 and cache_salt else ())
        extra = keys or None
        parent = hash_fn((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra))
        out.append(parent)
    return out


class BlockHasher:
    """``block_hashes`` that remembers the chain it computed, for a caller that hashes the same
    prefixes again and again: a conversation resends its whole history every turn, so Route would
    CBOR-encode and hash all of it per request.

    A block's hash is remembered under its parent's hash and its token ids' bytes, which determine it
    exactly (a salted first block, whose extra keys also count, is not remembered; its children are,
    under their own parent). Runs of ``SPAN_BLOCKS`` blocks, aligned from block 0, are remembered the
    same way, under the parent of their first block and all their ids: a history found again costs a
    dictionary probe per span rather than per block (finding block by block was most of a long prompt's
    Route: docs/benchmarks.md, "Smaller measurements"). At most ``max_blocks`` blocks per algorithm at
    each level, least recently used out: about 360 bytes a block, 85 a block in spans. Not for
    concurrent threads: kvloopd calls it from its event loop."""

    SPAN_BLOCKS = 16

    def __init__(self, max_blocks: int = 1 << 16) -> None:
        self.max_blocks = max_blocks
        self._chains: dict[str, OrderedDict[bytes, bytes]] = {}
        self._spans: dict[str, OrderedDict[bytes, tuple[bytes, ...]]] = {}
        self._roots: dict[tuple[str, str], bytes] = {}
        self.hits = self.misses = 0  # blocks found (alone or in a span) / hashed

    def hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        algorithm: str,
        seed: str = DEFAULT_SEED,
        cache_salt: str = "",
    ) -> list[bytes]:
        """What ``block_hashes`` gives for the same arguments."""
        hash_fn = _hash_fn(algorithm, block_size)
        if self.max_blocks <= 0:
            return block_hashes(token_ids, block_size, algorithm, seed, cache_salt)
        tokens: array
        if isinstance(token_ids, array) and token_ids.typecode == "I":
            tokens = token_ids  # kvloopd's Route: decoded once from the request
        else:
            try:
                tokens = array("I", token_ids)
            except (OverflowError, TypeError):  # ids beyond uint32 (a direct caller's): not remembered
                return block_hashes(token_ids, block_size, algorithm, seed, cache_salt)
        raw = tokens.tobytes()
        root = self._roots.get((algorithm, seed))
        if root is None:
            root = self._roots[(algorithm, seed)] = hash_fn(seed)
        chain = self._chains.setdefault(algorithm, OrderedDict())
        spans = self._spans.setdefault(algorithm, OrderedDict())
        max_spans = self.max_blocks // self.SPAN_BLOCKS
        width = _ID_BYTES * block_size  # one block's ids in raw
        span_width = width * self.SPAN_BLOCKS
        n = len(tokens) // block_size
        parent: bytes = root
        out: list[bytes] = []
        i = 0
        while i < n:
            span_key = None
            if (
                i % self.SPAN_BLOCKS == 0
                and i + self.SPAN_BLOCKS <= n
                and max_spans
                and not (i == 0 and cache_salt)
            ):
                span_key = parent + raw[i * width : i * width + span_width]
                span = spans.get(span_key)
                if span is not None:
                    spans.move_to_end(span_key)
                    self.hits += self.SPAN_BLOCKS
                    out += span
                    parent = span[-1]
                    i += self.SPAN_BLOCKS
                    continue
            for j in range(i, i + self.SPAN_BLOCKS if span_key is not None else i + 1):
                if j == 0 and cache_salt:
                    parent = hash_fn((parent, tuple(tokens[:block_size]), (("cache_salt", cache_salt),)))
                    out.append(parent)
                    continue
                key = parent + raw[j * width : (j + 1) * width]
                known = chain.get(key)
                if known is not None:
                    chain.move_to_end(key)
                    self.hits += 1
                else:
                    self.misses += 1
                    block = tuple(tokens[j * block_size : (j + 1) * block_size])
                    known = chain[key] = hash_fn((parent, block, None))
                    if len(chain) > self.max_blocks:
                        chain.popitem(last=False)
                parent = known
                out.append(parent)
            if span_key is not None:
                spans[span_key] = tuple(out[i : i + self.SPAN_BLOCKS])
                if len(spans) > max_spans:
                    spans.popitem(last=False)
                i += self.SPAN_BLOCKS
            else:
                i += 1
        return out
