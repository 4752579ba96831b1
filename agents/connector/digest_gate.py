"""Retained runs wait for their digests before they are announced (decode role, scheduler side).

A run's blocks are digested where they live, by the worker (digest.py), at the engine step after
vLLM retains the run; the announcement then carries the digests (common/block_digests.py), so every
puller the directory hands the run to can check its READ. The gate sits between the decode side
and the event stream: a device run's announcement is held until every worker rank has reported its
digests; a run released before that was never announced, and its release is not sent either.
Host-copy announcements pass through as they are (their copies carry no digests yet).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.connector.metadata import DigestAsk
from kvloop.common import block_digests

# A run whose digests have not come this long after it was retained is announced without them: a
# worker that cannot digest (or whose report was lost) never keeps a run from being pulled.
DIGEST_WAIT_S = 5.0


class DigestGate:
    def __init__(self, emit: Callable[[Any], None], ranks: int, wait_s: float = DIGEST_WAIT_S) -> None:
        self._emit = emit
        self.ranks = max(1, ranks)
        self.wait_s = wait_s
        self._held: dict[str, KvloopBlocksRetained] = {}
        self._since: dict[str, float] = {}
        self._reported: dict[str, dict[int, list[list[int]]]] = {}
        self._asks: dict[str, DigestAsk] = {}

    def emit(self, event: Any) -> None:
        if isinstance(event, KvloopBlocksRetained) and event.tier == "device" and event.block_hashes:
            handle = event.retention_handle
            self._held[handle] = event
            self._since[handle] = time.monotonic()
            tail = event.tail_block_ids
            self._asks[handle] = DigestAsk(block_digests.positions(event.block_ids, tail), bool(tail))
            return
        if isinstance(event, KvloopRetentionReleased) and event.retention_handle in self._held:
            # never announced: nothing to withdraw
            self._drop(event.retention_handle)
            return
        self._emit(event)

    def take_asks(self) -> dict[str, DigestAsk]:
        """The runs for the worker to digest this step (once a step: runs waiting too long for their
        digests are announced without them here)."""
        now = time.monotonic()
        for handle, since in list(self._since.items()):
            if handle not in self._asks and now - since >= self.wait_s:  # asked, and waited
                tm.log.warning("kvloop.digests_overdue", handle=handle, after_s=self.wait_s)
                event = self._held[handle]
                self._drop(handle)
                self._emit(event)
        asks, self._asks = self._asks, {}
        return asks

    def digested(self, reports: dict[str, dict[int, list[list[int]]]]) -> None:
        """Digests the worker ranks reported; a run every rank has reported is announced with them."""
        for handle, by_rank in reports.items():
            event = self._held.get(handle)
            if event is None:
                continue
            got = self._reported.setdefault(handle, {})
            got.update(by_rank)
            if len(got) < self.ranks:
                continue
            self._drop(handle)
            try:
                blob = block_digests.pack([got[r] for r in range(self.ranks)])
            except (KeyError, ValueError) as exc:  # a rank's report does not fit: announce unchecked
                tm.log.warning("kvloop.digests_unusable", handle=handle, error=str(exc))
                blob = b""
            event.block_digests = blob
            self._emit(event)

    def _drop(self, handle: str) -> None:
        self._held.pop(handle, None)
        self._since.pop(handle, None)
        self._reported.pop(handle, None)
        self._asks.pop(handle, None)

    @property
    def held(self) -> int:
        return len(self._held)

    def holds(self, handle: str) -> bool:
        """The run's announcement waits for its digests (the engine must step for them)."""
        return handle in self._held
