"""What each host-pool slot holds, as digests (decode role, scheduler side): the digests a host run is
announced with, so a puller checks a READ of the pool as it checks one of the KV cache.

A slot's digest is its source block's, taken by the worker when the run was retained (or, for a
block no announcement digested, when its copy started): what the slot is meant to hold, not what the
WRITE left there, so a torn or overwritten copy fails the puller's check. The worker reports them per
copy, aligned with the copy's slots; a host run names slots several copies wrote (the pool holds a
block once), so its digests are read from this table when it is announced. A slot written again
later gets the new block's digest here; a run announced before keeps the digests it went out with,
which the new content no longer matches.
"""

from __future__ import annotations

from kvloop.agents.connector.events import KvloopBlocksRetained
from kvloop.agents.connector.metadata import HostCopy
from kvloop.common import block_digests
from kvloop.common.sliding_window import NULL_BLOCK


class SlotDigests:
    def __init__(self, ranks: int) -> None:
        self.ranks = max(1, ranks)
        self._slots: dict[str, list[list[int]]] = {}  # copy handle -> its slots, per group
        self._at: dict[tuple[int, int], dict[int, int]] = {}  # (group, slot) -> rank -> digest

    def expect(self, copy: HostCopy) -> None:
        """The worker is to write ``copy``: its report of digests is read against these slots."""
        self._slots[copy.handle] = copy.slots

    def reported(self, reports: dict[str, dict[int, list[list[int]]]]) -> None:
        """Worker ranks' digests of the blocks each copy wrote, aligned with its slots."""
        for handle, by_rank in reports.items():
            slots = self._slots.get(handle)
            if slots is None:
                continue
            for rank, groups in by_rank.items():
                if len(groups) != len(slots):
                    continue
                for g, (slots_g, digests_g) in enumerate(zip(slots, groups, strict=True)):
                    for slot, digest in zip(slots_g, digests_g, strict=False):
                        self._at.setdefault((g, slot), {})[rank] = digest

    def done(self, handle: str) -> None:
        """The copy's WRITE ended (made or not): its slots' digests stand as reported."""
        self._slots.pop(handle, None)

    def blob(self, event: KvloopBlocksRetained) -> bytes:
        """The digests of a host run's slots by position (common/block_digests.py), or b"" when a
        slot's digest is not known on every rank (the run then goes out unchecked)."""
        per_rank: list[list[list[int]]] = [[] for _ in range(self.ranks)]
        for g, by_position in enumerate(block_digests.positions(event.block_ids, event.tail_block_ids)):
            for rank in range(self.ranks):
                row = []
                for slot in by_position:
                    if slot == NULL_BLOCK:
                        row.append(0)
                        continue
                    digest = self._at.get((g, slot), {}).get(rank)
                    if digest is None:
                        return b""
                    row.append(digest)
                per_rank[rank].append(row)
        return block_digests.pack(per_rank) if event.block_ids else b""
