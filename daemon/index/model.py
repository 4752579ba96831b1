"""Domain types of the block directory (protocol-independent, so another store can share them)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import msgspec
import numpy as np

from kvloop.common.packed_ids import pack_u32, unpack_u32


class LeaseState(IntEnum):
    # Values equal kvloop.v1.LeaseState.
    ACTIVE = 1
    RESYNCING = 2
    EXPIRED = 3
    DRAINING = 4


class BlockTier(IntEnum):
    """Where a run's blocks live on its worker. Values equal kvloop.v1.BlockTier; a run announced
    without a tier (UNSPECIFIED, 0) is a DEVICE run, and the directory stores it as one."""

    DEVICE = 1  # the engine's KV cache
    HOST = 2  # the worker's host-memory pool (WorkerSpec.host_engine_id), a NIXL engine of its own
    DISK = 3


class PackedHashes(Sequence[bytes]):
    """A view of concatenated fixed-length hashes (a Lookup's prompt, an event's blocks): the
    in-memory index slices only the hashes its search probes, or takes them all at once
    (:meth:`keys`); a store that ships them elsewhere takes :attr:`data` whole (a per-item walk
    through ``__getitem__`` costs per block)."""

    __slots__ = ("data", "n", "width")

    def __init__(self, data: bytes, width: int) -> None:
        # plain attributes, not properties: the in-memory lookup reads them on every Lookup
        self.width, self.n = width, len(data) // width  # n: len(self) without a Python call
        self.data = data if len(data) == self.n * width else data[: self.n * width]  # len(self) * width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            w = self.width
            if step == 1:
                return PackedHashes(self.data[start * w : max(start, stop) * w], w)
            return [self[j] for j in range(start, stop, step)]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        w = self.width
        return self.data[i * w : (i + 1) * w]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    def keys(self) -> list[bytes]:
        """Every hash as its own bytes object, cut in one pass in C (numpy's view of the buffer as
        fixed-width records: no Python work per block)."""
        if not self.n:
            return []
        return np.frombuffer(self.data, np.dtype((np.void, self.width))).tolist()


def hash_list(hashes: Sequence[bytes]) -> list[bytes]:
    """Hashes as a list, cut at once when they come packed."""
    if isinstance(hashes, PackedHashes):
        return hashes.keys()
    return hashes if isinstance(hashes, list) else list(hashes)


def packed(hashes: Sequence[bytes]) -> tuple[bytes, int]:
    """Hashes concatenated, and their width (0 when there are none); ValueError when their widths differ."""
    if isinstance(hashes, PackedHashes):
        return hashes.data, hashes.width
    if not hashes:
        return b"", 0
    data, width = b"".join(hashes), len(hashes[0])
    if len(data) != len(hashes) * width:
        raise ValueError("block hashes of one event must all have one length")
    return data, width


def packed_block_ids(ids: Sequence[int] | bytes) -> bytes:
    """Block ids as little-endian uint32s (kvloop.common.packed_ids), however an event carries them."""
    return bytes(ids) if isinstance(ids, (bytes, bytearray)) else pack_u32(ids)


class Namespace(msgspec.Struct, frozen=True, gc=False):
    """Blocks are only comparable within one model and LoRA (cache salt is inside the hash).

    Every Lookup builds one and hashes it as a dict key: a msgspec struct is made, hashed and
    compared in C (a frozen dataclass ran its hash and equality in Python)."""

    model: str
    lora_name: str = ""


@dataclass(slots=True)
class WorkerSpec:
    worker_id: str
    role: int
    model: str
    engine_id: str
    nixl_endpoint: str
    block_size: int
    hash_algorithm: str
    hash_length: int
    epoch: int
    kv_bytes_per_block: int = 0
    http_endpoint: str = ""
    # (tensor, pipeline, data parallel size, data parallel rank)
    parallel: tuple[int, int, int, int] = (1, 1, 1, 0)
    labels: dict[str, str] = field(default_factory=dict)
    kv_dtype: str = ""  # empty: unknown
    kv_group_windows: tuple[int, ...] = ()  # per KV-cache group, 0 = full attention; empty: unknown
    hash_seed: str = ""  # vLLM's block-hash seed (PYTHONHASHSEED); empty: unknown
    # The worker's host-memory pool, registered with NIXL as an engine of its own: a HOST-tier run is
    # read from this engine over this side channel (both empty: the worker has no host pool).
    host_engine_id: str = ""
    host_nixl_endpoint: str = ""
    agent_version: str = ""  # the kvloop release of the agent that registered it; empty: older agent


# An event's hashes: a list, or (as kvloopd builds them from a batch) one PackedHashes.
@dataclass(slots=True)
class Stored:
    hashes: Sequence[bytes]
    lora_name: str = ""
    tier: int = 0
    # The key of the chain's first block (a sharded store places the blocks by it): hashes[0]'s own
    # when the blocks start the sequence; None when they extend one whose root is not known.
    root: bytes | None = None


@dataclass(slots=True)
class Retained:
    hashes: Sequence[bytes]
    # group-major; as ints, or packed (little-endian uint32s, kvloop.common.packed_ids)
    block_ids: Sequence[int] | bytes
    num_groups: int
    handle: str
    expires_in_ms: int
    single_use: bool = False
    lora_name: str = ""
    tier: int = 0
    tail_token_ids: Sequence[int] = ()
    tail_block_ids: Sequence[int] = ()  # one per group, when tail_token_ids is set
    # The holder engine's KV-cache registration generation when it retained the run (vLLM >= 0.33;
    # BlocksRetained.registration_generation): a newer one withdraws the worker's older runs.
    registration_generation: int = 0
    # The run's block digests (kvloop.common.block_digests' blob, its header checked against the
    # run): stored with the run and handed out whole with every holding of it; b"": none sent.
    digests: bytes = b""


@dataclass(slots=True)
class Removed:
    hashes: Sequence[bytes]
    lora_name: str = ""
    roots: Sequence[bytes] | None = None  # each hash's root key (as Stored.root); None: not known


@dataclass(slots=True)
class Released:
    handle: str


@dataclass(slots=True)
class Cleared:
    pass


Event = Stored | Retained | Removed | Released | Cleared


class Holding(msgspec.Struct, gc=False):
    """One worker's servable prefix of a prompt (a msgspec struct, as every request-path value here:
    built in C, and not tracked by the garbage collector, since none can be part of a cycle)."""

    worker: WorkerSpec
    matched_blocks: int
    handle: str
    expires_in_ms: int
    # Physical ids of blocks [0, matched_blocks), group-major, as little-endian uint32s
    # (kvloop.common.packed_ids): how both stores keep them and a Lookup sends them.
    packed_block_ids: bytes
    num_groups: int
    single_use: bool
    # The run's partly filled last block, when matched_blocks is the whole run.
    tail_token_ids: Sequence[int] = ()
    tail_block_ids: Sequence[int] = ()
    # Where the run lives (BlockTier): a HOST run is read from the worker's host pool.
    tier: int = BlockTier.DEVICE
    registration_generation: int = 0  # the run's (Retained.registration_generation)
    # The whole run's digests (Retained.digests), however few of its blocks this holding serves: the
    # puller indexes them by position.
    digests: bytes = b""

    @property
    def block_ids(self) -> array:
        return unpack_u32(self.packed_block_ids)


class PrefixMatch(msgspec.Struct, gc=False):
    """What a lookup found: the best holder, others of the same length, and why none if none."""

    best: Holding | None
    others: list[Holding]
    # Set when blocks beyond the caller's local prefix exist but none is servable:
    # "expired", "claimed", "peer_unavailable" (a holder not live, or unverified: a puller's READ
    # from it failed its digest check since it registered), "incompatible_layout",
    # "directory_resyncing" or "window_not_held" (daemon/windows.py).
    unservable_reason: str | None = None
    # What exactly is not servable, when the reason alone does not say (the answer's detail).
    unservable_detail: str = ""


@dataclass(slots=True)
class Location:
    worker_id: str
    kind: str  # "stored" | "retained"
    position: int
    block_ids: list[int]
    handle: str
    expires_in_ms: int
    servable: bool
    tier: int


@dataclass(slots=True)
class WorkerView:
    spec: WorkerSpec
    state: LeaseState
    connected: bool
    last_applied_sequence: int
    stored_blocks: int
    retained_blocks: int
    retained_runs: int
    last_seen_s_ago: float
    events_ingested: int
    resyncs: int


@dataclass(slots=True)
class Change:
    """A directory change, for Watch subscribers."""

    kind: str
    worker_id: str
    model: str
    blocks: int = 0
    detail: str = ""
