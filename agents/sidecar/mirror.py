"""The agent's view of its engine's blocks: converts vLLM/kvloop KV events into protocol events
and keeps the state a resync snapshot must describe."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import Counter

from kvloop.agents.connector.events import (
    KvloopEvents,
    KvloopPrefillReport,
    KvloopRetentionReleased,
    KvloopTransferReport,
)
from kvloop.common.outcomes import tier_value
from kvloop.common.packed_ids import pack_u32
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.agent")

SKIPPED = Counter("kvloop_agent_skipped_events_total", "Engine events not forwarded", ["reason"])


@dataclass(slots=True)
class _Run:
    event: pb.BlocksRetained
    deadline: float  # monotonic


@dataclass(slots=True)
class _Pending:
    """Consecutive engine events of one kind being merged into one protocol event."""

    kind: str  # "stored" or "removed"
    lora: str
    root: bytes  # a stored run's chain root
    parent: bytes  # a stored run's first block's parent
    hashes: list[bytes] = field(default_factory=list)
    roots: list[bytes] = field(default_factory=list)  # a removal's, one per hash

    def takes(self, kind: str, lora: str, root: bytes) -> bool:
        return kind == self.kind and lora == self.lora and root == self.root

    def event(self) -> pb.BlockEvent:
        if self.kind == "removed":
            return pb.BlockEvent(
                removed=pb.BlocksRemoved(
                    packed_block_hashes=b"".join(self.hashes),
                    lora_name=self.lora,
                    packed_root_block_hashes=b"".join(self.roots),
                )
            )
        return pb.BlockEvent(
            stored=pb.BlocksStored(
                packed_block_hashes=b"".join(self.hashes),
                parent_block_hash=self.parent,
                lora_name=self.lora,
                tier=pb.BLOCK_TIER_DEVICE,
                root_block_hash=self.root,
            )
        )


class WorkerMirror:
    def __init__(self, hash_length: int, host_pool: bool = False) -> None:
        self.hash_length = hash_length
        # The registration names a host-memory pool: runs announced in host memory can be read.
        self.host_pool = host_pool
        self.retained: dict[str, _Run] = {}
        # lora -> hash -> the first block of its chain (insertion-ordered): a sharded directory places
        # a chain's blocks by that root, so every event names it.
        self.stored: dict[str, dict[bytes, bytes]] = {}
        self._warned_int_hashes = False
        self._warned: set[str] = set()  # skip reasons already logged (each once)

    def _tier(self, name: str, what: str) -> int | None:
        """A connector event's tier ("device", "host") as the protocol's, or None (counted, logged
        once) for a name the protocol does not know."""
        try:
            return tier_value(name)
        except ValueError:
            self._skip("unknown_tier", f"a {what} names an unknown tier: not forwarded", tier=name)
            return None

    def _skip(self, reason: str, message: str, **fields: Any) -> None:
        """Count an event not forwarded; say why in the log the first time."""
        SKIPPED.labels(reason).inc()
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(message, **fields)

    def _hashes(self, raw: Iterable[Any]) -> list[bytes] | None:
        hashes = list(raw)
        # A hybrid model's sliding-window group publishes events of no block at all; kvloopd refuses
        # an event without hashes (and with it the whole batch), and it says nothing anyway.
        if not hashes:
            SKIPPED.labels("no_hashes").inc()
            return None
        if any(not isinstance(h, bytes) or len(h) != self.hash_length for h in hashes):
            SKIPPED.labels("hash_form").inc()
            if not self._warned_int_hashes:
                self._warned_int_hashes = True
                log.warning(
                    "engine publishes block hashes that are not full digests; start vLLM with "
                    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 so prefix-cache events can be indexed",
                    expected_bytes=self.hash_length,
                    sample=repr(hashes[:1]),
                )
            return None
        return hashes

    def convert_vllm(self, event: dict[str, Any]) -> pb.BlockEvent | None:
        """vLLM's own BlockStored / BlockRemoved / AllBlocksCleared (raw msgpack maps), one
        protocol event each, hashes one field apiece (what any kvloopd reads)."""
        kind = event.get("type")
        if kind == "BlockStored":
            stored = self._stored(event)
            if stored is None:
                return None
            lora, hashes, parent, root = stored
            return pb.BlockEvent(
                stored=pb.BlocksStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    lora_name=lora,
                    tier=pb.BLOCK_TIER_DEVICE,
                    root_block_hash=root,
                )
            )
        if kind == "BlockRemoved":
            removed = self._removed(event)
            if removed is None:
                return None
            lora, hashes, roots = removed
            return pb.BlockEvent(
                removed=pb.BlocksRemoved(block_hashes=hashes, lora_name=lora, root_block_hashes=roots)
            )
        if kind == "AllBlocksCleared":
            self.stored.clear()
            self.retained.clear()
            return pb.BlockEvent(cleared=pb.AllBlocksCleared())
        SKIPPED.labels("unknown_type").inc()
        return None

    def _stored(self, event: dict[str, Any]) -> tuple[str, list[bytes], bytes, bytes] | None:
        """A BlockStored's (lora, blocks not held yet, parent, chain root), taken into the mirror."""
        hashes = self._hashes(event.get("block_hashes", []))
        if hashes is None:
            return None
        lora = event.get("lora_name") or ""
        # An int parent (vLLM's int hashes) is no digest: sent as unknown.
        parent = event.get("parent_block_hash")
        parent = parent if isinstance(parent, bytes) else b""
        mine = self.stored.setdefault(lora, {})
        # A parent this mirror does not hold (evicted first) stands in for the root: the blocks'
        # later removal names the same root, so they are found where they were put. A block
        # reported again keeps the root it was sent with (it is not sent again): a second root
        # would leave it where its removal does not look.
        root = mine.get(parent, parent) if parent else mine.get(hashes[0], hashes[0])
        hashes = [h for h in hashes if h not in mine]
        if not hashes:
            SKIPPED.labels("already_stored").inc()
            return None
        mine.update(dict.fromkeys(hashes, root))
        return lora, hashes, parent, root

    def _removed(self, event: dict[str, Any]) -> tuple[str, list[bytes], list[bytes]] | None:
        """A BlockRemoved's (lora, blocks, each one's chain root), taken out of the mirror."""
        hashes = self._hashes(event.get("block_hashes", []))
        if hashes is None:
            return None
        lora = event.get("lora_name") or ""
        mine = self.stored.get(lora, {})
        return lora, hashes, [mine.pop(h, h) for h in hashes]  # one never stored: not indexed anywhere

    def convert_kvloop(self, event: KvloopEvents, packed: bool = False) -> pb.BlockEvent | None:
        """One connector event as a protocol event; ``packed``: a retained run's hashes and block ids
        in its packed fields (for a kvloopd that reads them, see :meth:`convert_batch`)."""
        if isinstance(event, KvloopPrefillReport):
            return pb.BlockEvent(prefill=pb.PrefillReport(tokens=event.tokens, duration_us=event.duration_us))
        if isinstance(event, KvloopTransferReport):  # telemetry for the cost model, not state
            source_tier = self._tier(event.source_tier, "transfer report")
            if source_tier is None:
                return None
            return pb.BlockEvent(
                transfer=pb.TransferReport(
                    source_worker_id=event.source_worker_id,
                    bytes=event.bytes,
                    blocks=event.blocks,
                    duration_us=event.duration_us,
                    setup_us=event.setup_us,
                    ok=event.ok,
                    first_contact=event.first_contact,
                    nixl_measured=event.nixl_measured,
                    wait_us=event.wait_us,
                    source_tier=source_tier,
                    verify_failed=event.verify_failed,
                )
            )
        if isinstance(event, KvloopRetentionReleased):
            self.retained.pop(event.retention_handle, None)
            return pb.BlockEvent(released=pb.RetentionReleased(retention_handle=event.retention_handle))
        hashes = self._hashes(event.block_hashes)
        if hashes is None:
            return None
        tier = self._tier(event.tier, "retained run")
        if tier is None:
            return None
        if tier == pb.BLOCK_TIER_HOST and not self.host_pool:  # kvloopd would refuse it
            self._skip(
                "no_host_pool",
                "the engine announces runs in host memory, but this agent registers no host pool "
                "(--host-nixl-endpoint): they are not forwarded",
            )
            return None
        age_ms = max(0.0, (time.time() - event.ts) * 1000) if event.ts else 0.0
        remaining = int(event.lease_ms - age_ms)
        if remaining <= 0:
            SKIPPED.labels("expired_in_transit").inc()
            return None
        retained = pb.BlocksRetained(
            num_groups=len(event.block_ids),
            retention_handle=event.retention_handle,
            expires_in_ms=remaining,
            single_use=event.single_use,
            lora_name=event.lora_name or "",
            tier=tier,
            tail_token_ids=event.tail_token_ids,
            tail_block_ids=event.tail_block_ids,
            registration_generation=event.registration_generation,
            block_digests=event.block_digests,
        )
        ids = itertools.chain.from_iterable(event.block_ids)  # group-major
        if packed:
            retained.packed_block_hashes = b"".join(hashes)
            retained.packed_block_ids = pack_u32(ids)
        else:
            retained.block_hashes.extend(hashes)
            retained.block_ids.extend(ids)
        self.retained[event.retention_handle] = _Run(retained, time.monotonic() + remaining / 1000)
        return pb.BlockEvent(retained=retained)

    def convert_batch(
        self, vllm_events: Iterable[dict[str, Any]], kvloop_events: Iterable[KvloopEvents]
    ) -> list[pb.BlockEvent]:
        """One engine batch's events as protocol events, vLLM's own first (the order the engine
        publishes them in), for a kvloopd that reads packed events (RegisterAck.packed_events; the
        link unpacks them for an older one).

        Nothing that needs no event per block gets one: vLLM announces each block it evicts on its
        own, so a run of consecutive BlockRemoved events (of one LoRA) goes as one event, as does a
        run of BlockStored events of one chain; every event's hashes (and a retained run's block
        ids) travel packed in one field, which kvloopd reads without an object per block."""
        events: list[pb.BlockEvent] = []
        pending: _Pending | None = None  # the run of vLLM events being merged
        for raw in vllm_events:
            kind = raw.get("type")
            if kind == "BlockRemoved":
                removed = self._removed(raw)
                if removed is None:
                    continue
                lora, hashes, roots = removed
                if pending is None or not pending.takes("removed", lora, b""):
                    if pending is not None:
                        events.append(pending.event())
                    pending = _Pending("removed", lora, b"", b"")
                pending.hashes += hashes
                pending.roots += roots
            elif kind == "BlockStored":
                stored = self._stored(raw)
                if stored is None:
                    continue
                lora, hashes, parent, root = stored
                if pending is None or not pending.takes("stored", lora, root):
                    if pending is not None:
                        events.append(pending.event())
                    pending = _Pending("stored", lora, root, parent)
                pending.hashes += hashes
            else:
                if pending is not None:
                    events.append(pending.event())
                    pending = None
                converted = self.convert_vllm(raw)
                if converted is not None:
                    events.append(converted)
        if pending is not None:
            events.append(pending.event())
        for ours in kvloop_events:
            converted = self.convert_kvloop(ours, packed=True)
            if converted is not None:
                events.append(converted)
        return events

    def forget_retained(self) -> None:
        """After an unrecoverable event gap a release may have been missed: serve nothing older."""
        self.retained.clear()

    def clear(self) -> None:
        """The engine process ended: none of its blocks exist any more."""
        self.retained.clear()
        self.stored.clear()

    def snapshot(self) -> list[pb.BlockEvent]:
        """The full state, with leases recomputed for now (expired runs left out); a chain's stored
        blocks in one event, packed (the link unpacks them for a kvloopd that does not read that)."""
        now = time.monotonic()
        events = []
        for handle, run in list(self.retained.items()):
            remaining = int((run.deadline - now) * 1000)
            if remaining <= 0:
                del self.retained[handle]
                continue
            event = pb.BlocksRetained()
            event.CopyFrom(run.event)
            event.expires_in_ms = remaining
            events.append(pb.BlockEvent(retained=event))
        for lora, roots in self.stored.items():
            chains: dict[bytes, list[bytes]] = {}
            for h, root in roots.items():
                chains.setdefault(root, []).append(h)
            for root, hashes in chains.items():
                events.append(
                    pb.BlockEvent(
                        stored=pb.BlocksStored(
                            packed_block_hashes=b"".join(hashes),
                            lora_name=lora,
                            tier=pb.BLOCK_TIER_DEVICE,
                            root_block_hash=root,
                        )
                    )
                )
        return events
