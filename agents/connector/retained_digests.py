"""A holder's digests of what it retains (decode role, worker side): each retained run's blocks,
digested at the engine step after the run is retained, for its announcement (digest_gate.py), and
for its host copy, whose slots are meant to hold what the run held then (host/slot_digests.py)."""

from __future__ import annotations

import time
from collections import OrderedDict

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.digest import BlockDigester
from kvloop.agents.connector.faults import FaultSwitch
from kvloop.agents.connector.metadata import DigestAsk, HostCopy
from kvloop.common.host_names import HOST_SUFFIX

# Retained runs whose digests are kept for their host copies (the most recent ones).
RUNS_KEPT = 4096


class RetainedDigests:
    def __init__(self, faults: FaultSwitch) -> None:
        self.digester: BlockDigester | None = None  # once the KV cache is registered
        self.faults = faults
        self._digested: dict[str, list[list[int]]] = {}  # for the scheduler, since the last step
        self._runs: OrderedDict[str, dict[tuple[int, int], int]] = OrderedDict()  # (group, block) -> digest

    def run(self, handle: str, ask: DigestAsk) -> None:
        """Digest a retained run's blocks for its announcement (an empty report if this worker cannot:
        the run then goes out unchecked)."""
        if self.digester is None:
            self._digested[handle] = []
            return
        started = time.perf_counter()
        try:
            digests = self.digester.run(ask.block_ids)
        except Exception as exc:  # never the engine's failure: the run goes out unchecked
            tm.log.warning("kvloop.digest_failed", handle=handle, error=repr(exc))
            self._digested[handle] = []
            return
        self._digested[handle] = digests
        tm.DIGEST_SECONDS.labels("retained").observe(time.perf_counter() - started)
        self._runs[handle] = {
            (g, b): d
            for g, (ids, ds) in enumerate(zip(ask.block_ids, digests, strict=True))
            for b, d in zip(ids, ds, strict=True)
        }
        while len(self._runs) > RUNS_KEPT:
            self._runs.popitem(last=False)
        if ask.tail and self.faults.fires("device"):
            group = len(ask.block_ids) - 1
            self.digester.corrupt(group, ask.block_ids[group][-1])
            tm.log.warning("kvloop.fault_corrupted_block", handle=handle, group=group)

    def of_copy(self, copy: HostCopy) -> list[list[int]] | None:
        """The digests of a host copy's source blocks, aligned with its slots: the run's, as digested
        when it was retained, else (a window capture, a run never announced from here) taken now."""
        if self.digester is None:
            return None
        known = self._runs.get(copy.handle.removesuffix(HOST_SUFFIX), {})
        out = []
        try:
            for g, ids in enumerate(copy.block_ids):
                missing = [b for b in ids if (g, b) not in known]
                fresh = dict(zip(missing, self.digester.group(g, missing), strict=True))
                out.append([known[(g, b)] if (g, b) in known else fresh[b] for b in ids])
        except Exception as exc:  # the copy is made all the same; its host run goes out unchecked
            tm.log.warning("kvloop.digest_failed", handle=copy.handle, error=repr(exc))
            return None
        return out

    def take(self) -> dict[str, list[list[int]]]:
        """The runs digested since the last call."""
        digested, self._digested = self._digested, {}
        return digested
