"""What kvloop's two halves tell each other each step, on top of vLLM's NIXL metadata: scheduler ->
worker (:class:`KvloopConnectorMetadata`) and worker -> scheduler (:class:`KvloopWorkerMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    NixlHandshakePayload,
)


class KvloopConnectorMetadata(NixlConnectorMetadata):
    """vLLM's ``NixlConnectorMetadata`` plus kvloop's two per-step additions.

    * ``multi_reader``: retained runs (decode role) the worker keeps until their lease ends
      instead of freeing them after the first READ notice;
    * ``pull_deadlines``: for each pull this step (prefill role), when the holder's lease ends, in
      the scheduler's ``perf_counter`` clock (rebased by the worker like vLLM's ``reqs_to_send``);
    * ``pull_holder_epochs``: for each pull this step, the holder's registration epoch its run was
      announced under (the worker does not read it from a holder process of another epoch);
    * ``free_early``: retained runs given up before their lease ends (decode role, yielding.py) and
      when the worker may free each, in the scheduler's clock (a lease end brought forward);
    * ``host_copies``: retained runs to copy into the host pool this step (decode role, host/tier.py);
    * ``host_captures``: per request whose prompt KV is arriving, the sliding-window blocks to copy
      into the host pool once it has arrived, before the request decodes (decode role, host/tier.py);
    * ``digest_runs``: retained runs to digest (decode role, digest.py);
    * ``pull_checks``: for each pull this step whose READ is to be checked (prefill role), the
      holder's digests and the run's block ids they are indexed by.
    """

    def __init__(self) -> None:
        super().__init__()
        self.multi_reader: set[str] = set()
        self.pull_deadlines: dict[str, float] = {}
        self.pull_holder_epochs: dict[str, int] = {}
        self.free_early: dict[str, float] = {}
        self.host_copies: list[HostCopy] = []
        self.host_captures: dict[str, HostCopy] = {}
        self.digest_runs: dict[str, DigestAsk] = {}
        self.pull_checks: dict[str, PullCheck] = {}

    @classmethod
    def extend(
        cls,
        base: NixlConnectorMetadata,
        multi_reader: set[str],
        pull_deadlines: dict[str, float],
        pull_holder_epochs: dict[str, int] | None = None,
        free_early: dict[str, float] | None = None,
    ) -> KvloopConnectorMetadata:
        """The metadata vLLM's scheduler built, with kvloop's fields added."""
        meta = cls()
        meta.__dict__.update(base.__dict__)
        meta.multi_reader = multi_reader
        meta.pull_deadlines = pull_deadlines
        meta.pull_holder_epochs = pull_holder_epochs or {}
        meta.free_early = free_early or {}
        return meta


@dataclass(frozen=True)
class HostCopy:
    """Copy a retained run's KV-cache blocks into host-pool slots: ``block_ids[g][i]`` goes to
    ``slots[g][i]`` (group-major, as vLLM hands block ids over; null blocks left out)."""

    handle: str
    block_ids: list[list[int]]
    slots: list[list[int]]


@dataclass(frozen=True)
class DigestAsk:
    """Digest a retained run: its block ids per group by position (complete blocks, then its tail
    block when ``tail``)."""

    block_ids: list[list[int]]
    tail: bool


@dataclass(frozen=True)
class PullCheck:
    """What a pull's READ is checked against: the holder's digest blob (common/block_digests.py)
    and the holder's block ids per group it is indexed by (the answer's, tail block last)."""

    digests: bytes
    block_ids: tuple[tuple[int, ...], ...]
    tail_block_ids: tuple[int, ...] = ()


# What a pull's check found (KvloopWorkerMetadata.verified), worst first when ranks disagree.
VERIFY_FAILED, VERIFY_UNCHECKED, VERIFY_PASSED = "failed", "unchecked", "passed"
_VERIFY_ORDER = (VERIFY_FAILED, VERIFY_UNCHECKED, VERIFY_PASSED)


def worse(a: str | None, b: str) -> str:
    return b if a is None or _VERIFY_ORDER.index(b) < _VERIFY_ORDER.index(a) else a


@dataclass(frozen=True)
class ReadTiming:
    """NIXL's own telemetry of one request's READ (all its transfer handles)."""

    xfer_s: float  # transfer time as NIXL measured it (the longest handle: they run side by side)
    post_s: float  # time to post the transfer
    bytes: int
    # The READ waited for a NIXL handshake with its holder (no warm connection): its first transfer
    # may carry connection set-up the steady state does not, so the cost model leaves it out.
    waited_handshake: bool = False

    def merge(self, other: ReadTiming) -> ReadTiming:
        return ReadTiming(
            max(self.xfer_s, other.xfer_s),
            max(self.post_s, other.post_s),
            self.bytes + other.bytes,
            self.waited_handshake or other.waited_handshake,
        )


@dataclass
class KvloopWorkerMetadata(KVConnectorWorkerMetadata):
    """What kvloop's worker side tells its scheduler side after a step: NIXL's timing of each
    finished READ, so the cost model learns from the transfer itself, not from engine steps."""

    reads: dict[str, ReadTiming] = field(default_factory=dict)
    # Host copies finished since the last step (decode role): handle -> whether the copy succeeded,
    # and how many worker ranks' parts that covers (a rank copies its own share of the KV heads).
    host_copied: dict[str, bool] = field(default_factory=dict)
    host_copy_ranks: dict[str, int] = field(default_factory=dict)
    # Decode role: digests of runs retained since the last step, handle -> rank -> per group, per
    # position (each rank digests its own share of the KV heads).
    digests: dict[str, dict[int, list[list[int]]]] = field(default_factory=dict)
    # Decode role: digests of the blocks each host copy wrote, handle -> rank -> per group, aligned
    # with the copy's slots (host/slot_digests.py).
    host_digests: dict[str, dict[int, list[list[int]]]] = field(default_factory=dict)
    # Prefill role: pulls whose READ ended this step and was checked, request id -> what the check
    # found (VERIFY_*; any rank's failure fails the pull).
    verified: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvloopWorkerMetadata):
            for req_id, timing in other.reads.items():
                mine = self.reads.get(req_id)
                self.reads[req_id] = timing if mine is None else mine.merge(timing)
            for handle, ok in other.host_copied.items():  # every rank's copy must succeed
                self.host_copied[handle] = self.host_copied.get(handle, True) and ok
                ranks = other.host_copy_ranks.get(handle, 1)
                self.host_copy_ranks[handle] = self.host_copy_ranks.get(handle, 0) + ranks
            for handle, by_rank in other.digests.items():
                self.digests.setdefault(handle, {}).update(by_rank)
            for handle, by_rank in other.host_digests.items():
                self.host_digests.setdefault(handle, {}).update(by_rank)
            for req_id, found in other.verified.items():
                self.verified[req_id] = worse(self.verified.get(req_id), found)
        return self


class RankTally:
    """Host copies reported by an engine's worker ranks, gathered over steps: vLLM merges the ranks'
    metadata of one step, but ranks finish their parts of a copy in different steps, and a copy is
    made (and may be announced) only once every rank made its part."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._seen: dict[str, tuple[int, bool]] = {}

    def add(self, meta: KvloopWorkerMetadata) -> dict[str, bool]:
        """The copies every rank has now reported, and whether all their parts succeeded."""
        complete: dict[str, bool] = {}
        for handle, ok in meta.host_copied.items():
            count, all_ok = self._seen.pop(handle, (0, True))
            count, all_ok = count + meta.host_copy_ranks.get(handle, 1), all_ok and ok
            if count >= self.ranks:
                complete[handle] = all_ok
            else:
                self._seen[handle] = (count, all_ok)
        return complete


@dataclass
class KvloopHandshakePayload(NixlHandshakePayload):
    """A worker's NIXL handshake metadata, with its host pool's (served on a side channel of its own,
    as the engine ``<engine id>@host``); peers only ever receive the two apart."""

    host: NixlHandshakePayload | None = None
