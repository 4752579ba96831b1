"""A retained run's block digests as they travel: from the holder's worker (which computes them over
the bytes a puller will READ, agents/connector/digest.py) with the run's announcement, through kvloopd
(which stores the blob with the run and hands it out whole with every holder of it, never reading
more than its header), to the puller's worker, which checks what its READ brought against them.

The blob, little-endian: a header (version u8, worker ranks u8, KV-cache groups u16, positions u32),
then one u64 digest per (rank, group, position), rank-major. Positions are the run's complete
blocks, then its partly filled tail block when it has one. A digest of 0 stands for a position with
no block (a sliding-window group's freed block, vLLM's null block): nothing is read from it.

A digest names content at one moment: the puller compares it with what arrived, so a block
overwritten after it was digested (freed and reused early, a torn host copy) fails the check, and
a block that was digested again after reuse carries another run's digests, never this run's.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

VERSION = 1
_HEADER = struct.Struct("<BBHI")
HEADER_BYTES = _HEADER.size
DIGEST_BYTES = 8
# kvloopd refuses a larger blob: 16 MiB is 2M digests, past any run a directory hands out.
MAX_BLOB_BYTES = 16 << 20
_LITTLE = sys.byteorder == "little"
NULL_BLOCK = 0


@dataclass(frozen=True)
class RunDigests:
    ranks: int
    groups: int
    positions: int
    values: array  # u64, rank-major: [rank][group][position]

    def of(self, rank: int, group: int, position: int) -> int:
        return self.values[(rank * self.groups + group) * self.positions + position]


def pack(per_rank: Sequence[Sequence[Sequence[int]]]) -> bytes:
    """``per_rank[rank][group][position]`` as a blob; every rank and group must have as many
    positions (ValueError otherwise)."""
    ranks = len(per_rank)
    groups = len(per_rank[0]) if ranks else 0
    positions = len(per_rank[0][0]) if groups else 0
    values = array("Q")
    for rank in per_rank:
        if len(rank) != groups or any(len(g) != positions for g in rank):
            raise ValueError("every rank and KV-cache group needs a digest per position")
        for group in rank:
            values.extend(group)
    if not _LITTLE:
        values.byteswap()
    return _HEADER.pack(VERSION, ranks, groups, positions) + values.tobytes()


def header(blob: bytes) -> tuple[int, int, int]:
    """(ranks, groups, positions) of a blob; ValueError naming what is wrong with a malformed one."""
    if len(blob) > MAX_BLOB_BYTES:
        raise ValueError(f"block_digests is {len(blob)} bytes; at most {MAX_BLOB_BYTES}")
    if len(blob) < HEADER_BYTES:
        raise ValueError(f"block_digests is {len(blob)} bytes, shorter than its {HEADER_BYTES}-byte header")
    version, ranks, groups, positions = _HEADER.unpack_from(blob)
    if version != VERSION:
        raise ValueError(f"block_digests version {version}; this release reads version {VERSION}")
    expected = HEADER_BYTES + ranks * groups * positions * DIGEST_BYTES
    if ranks == 0 or len(blob) != expected:
        raise ValueError(
            f"block_digests is {len(blob)} bytes; its header ({ranks} ranks, {groups} groups, "
            f"{positions} positions) says {expected}"
        )
    return ranks, groups, positions


def check_run(blob: bytes, num_groups: int, blocks: int, has_tail: bool) -> None:
    """ValueError unless ``blob`` describes a run of ``blocks`` complete blocks (and a tail) in
    ``num_groups`` KV-cache groups (what kvloopd checks before storing it with the run)."""
    _, groups, positions = header(blob)
    want = blocks + int(has_tail)
    if groups != num_groups or positions != want:
        raise ValueError(
            f"block_digests covers {groups} groups x {positions} positions; the run has "
            f"{num_groups} groups x {want} positions"
        )


def unpack(blob: bytes) -> RunDigests:
    ranks, groups, positions = header(blob)
    values = array("Q")
    values.frombytes(blob[HEADER_BYTES:])
    if not _LITTLE:
        values.byteswap()
    return RunDigests(ranks, groups, positions, values)


def positions(block_ids: Sequence[Sequence[int]], tail_block_ids: Sequence[int] = ()) -> list[list[int]]:
    """A run's block ids per group by position, as its digests are laid out: its complete blocks,
    then its tail block when it has one."""
    return [list(ids) + ([tail_block_ids[g]] if tail_block_ids else []) for g, ids in enumerate(block_ids)]


def by_block_id(
    digests: RunDigests,
    rank: int,
    block_ids: Sequence[Sequence[int]],
    tail_block_ids: Sequence[int] = (),
) -> list[dict[int, int]] | None:
    """Per KV-cache group, each of the holder's block ids (a run's complete blocks, then its tail)
    mapped to the digest rank ``rank`` computed for it; None when the digests do not cover the run as
    the puller knows it (another rank count, group count or length: nothing can be checked)."""
    if rank >= digests.ranks or len(block_ids) != digests.groups:
        return None
    out: list[dict[int, int]] = []
    for g, by_position in enumerate(positions(block_ids, tail_block_ids)):
        if len(by_position) > digests.positions:
            return None
        out.append(
            {
                block: digests.of(rank, g, position)
                for position, block in enumerate(by_position)
                if block != NULL_BLOCK
            }
        )
    return out
