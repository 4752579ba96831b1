"""Subscriber of vLLM's ZMQ KV-event publisher, with gap repair from its replay endpoint.

Messages are (topic, seq: 8-byte big-endian, msgpack KVEventBatch). A gap in seq is filled by
asking the ROUTER replay socket for everything from the first missing seq; if the publisher's
buffer no longer reaches back that far the gap is unrecoverable and the caller is told so.

:func:`read_engine_batch` reads a payload strictly: anything in a shape kvloop does not know (not
msgpack, a batch that is not ``[ts, [events], dp_rank]``, events as arrays - vLLM's older format - a
known event with fields of the wrong type) is refused with :class:`EngineEventError`, counted in
``kvloop_agent_engine_event_errors_total{reason}`` and logged; never half-read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio
from prometheus_client import Counter
from zmq.utils.monitor import parse_monitor_message

from kvloop.agents.connector.events import KVLOOP_EVENT_TYPES, DecodedBatch, KvloopEvents

log = structlog.get_logger("kvloop.agent.zmq")

END_SEQ = -1

ENGINE_EVENT_ERRORS = Counter(
    "kvloop_agent_engine_event_errors_total",
    "Engine KV-event payloads (or events in them) in a format the sidecar does not read, by reason",
    ["reason"],
)


class EngineEventError(ValueError):
    """A payload kvloop cannot read; ``reason`` is the counter's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Batch(msgspec.Struct, array_like=True):
    """vLLM's ``KVEventBatch`` frame: ``[ts, [event, ...], data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# The fields of vLLM's own events that the sidecar reads, with their types (vllm/distributed/
# kv_events.py: hashes are bytes, or ints with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). Fields added by
# later vLLMs are ignored; a field of the wrong type is an error, not a guess.
class _BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    lora_name: str | None = None


class _BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[bytes | int]
    lora_name: str | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


_VLLM_EVENTS = {
    "BlockStored": _BlockStored,
    "BlockRemoved": _BlockRemoved,
    "AllBlocksCleared": _AllBlocksCleared,
}
_batch_decoder = msgspec.msgpack.Decoder(_Batch)
_warned_unknown: set[str] = set()


def read_engine_batch(payload: bytes) -> DecodedBatch:
    """The third frame of a vLLM KV-event message, read strictly (raises EngineEventError).

    Events of a type neither vLLM's nor kvloop's are skipped (a newer vLLM may add some), counted under
    ``unknown_type`` and logged once per type."""
    try:
        batch = _batch_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise EngineEventError(
            "batch_shape", f"not a KV-event batch [ts, [events], dp_rank]: {exc}"
        ) from None
    except msgspec.DecodeError as exc:
        raise EngineEventError("msgpack", f"not msgpack: {exc}") from None
    ours: list[KvloopEvents] = []
    theirs: list[dict[str, Any]] = []
    for position, event in enumerate(batch.events):
        where = f"event {position}"
        if isinstance(event, list):
            raise EngineEventError(
                "event_is_array",
                f"{where} is an array: this vLLM publishes KV events in a format kvloop does not read "
                "(kvloop reads events as maps tagged with 'type')",
            )
        kind = event.get("type") if isinstance(event, dict) else None
        if not isinstance(kind, str):
            raise EngineEventError(
                "event_shape", f"{where} is not a map with a string 'type': {event!r:.120}"
            )
        try:
            if kind in KVLOOP_EVENT_TYPES:
                ours.append(msgspec.convert(event, KVLOOP_EVENT_TYPES[kind]))
            elif kind in _VLLM_EVENTS:
                msgspec.convert(event, _VLLM_EVENTS[kind])
                theirs.append(event)
            else:
                ENGINE_EVENT_ERRORS.labels("unknown_type").inc()
                if kind not in _warned_unknown:
                    _warned_unknown.add(kind)
                    log.warning("engine KV event of an unknown type skipped", type=kind)
        except msgspec.ValidationError as exc:
            raise EngineEventError("malformed_event", f"{where} ({kind}): {exc}") from None
    return DecodedBatch(ts=batch.ts, kvloop=ours, vllm=theirs, data_parallel_rank=batch.data_parallel_rank)


def read_or_count(payload: bytes, seq: int) -> DecodedBatch | None:
    """read_engine_batch, with a refused payload counted and logged (None): the caller treats the
    batch as lost."""
    try:
        return read_engine_batch(payload)
    except EngineEventError as exc:
        ENGINE_EVENT_ERRORS.labels(exc.reason).inc()
        log.error("engine KV-event batch not readable, dropped", seq=seq, reason=exc.reason, error=str(exc))
        return None


class PublisherRestarted(Exception):
    """The engine's publisher went away (its connection closed) or started a new sequence: what
    follows is another engine process's, and nothing the old one announced can be trusted."""


# Batches kept to tell a replayed duplicate (same seq, same bytes) from a restarted publisher's
# reused seq; duplicates only arrive right after a replay, so a short window covers them.
_RECENT_BATCHES = 4096


class KvEventSubscriber:
    def __init__(
        self, endpoint: str, replay_endpoint: str | None, topic: str = "", replay_timeout_s: float = 2.0
    ) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> hash of its payload
        self.messages = 0
        self.unrecoverable_gaps = 0

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Batches from `start` on, or None when no replay endpoint answered."""
        if not self._replay_endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            batches: list[tuple[int, bytes]] = []
            while True:
                if not await sock.poll(self._replay_timeout_s * 1000):
                    return None
                frames = await sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return batches
                batches.append((seq, frames[-1]))
        finally:
            sock.close()

    def _taken(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.messages += 1
        self._recent[seq] = hash(payload)
        if len(self._recent) > _RECENT_BATCHES:
            self._recent.popitem(last=False)

    async def batches(self) -> AsyncIterator[tuple[int, bytes, bool]]:
        """Yield (seq, payload, gap_before) in order, until the publisher restarts.

        gap_before is True when batches before this one were lost for good: the caller must not
        trust state (a release may be among the lost batches).

        Raises PublisherRestarted when the publisher's connection closes (its process ended: vLLM
        binds the PUB socket for its whole life) or a seq arrives again with other contents (a new
        publisher counts from 0 again). A new call starts over: fresh socket, the new engine's
        history replayed from 0.
        """
        self.last_seq = None
        self._recent.clear()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        # Before connect: the monitor must see this connection's disconnect.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self._endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        gap = False
        try:
            # Catch up on what the engine published before we started; live messages arriving
            # meanwhile are deduplicated by seq below.
            history = await self._replay(0)
            if history:
                log.info(
                    "replayed engine history", batches=len(history), first=history[0][0], last=history[-1][0]
                )
                gap = history[0][0] != 0
                for seq, payload in history:
                    self._taken(seq, payload)
                    yield seq, payload, gap
                    gap = False
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        raise PublisherRestarted(f"KV-event publisher disconnected ({self._endpoint})")
                if sub not in ready:
                    continue
                _topic, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if self.last_seq is not None and seq <= self.last_seq:
                    if self._recent.get(seq) == hash(payload):
                        continue  # replayed, then received live as well
                    raise PublisherRestarted(f"KV-event seq went back from {self.last_seq} to {seq}")
                expected = 0 if self.last_seq is None else self.last_seq + 1
                if seq != expected:
                    replayed = [
                        (s, p) for s, p in (await self._replay(expected) or []) if expected <= s < seq
                    ]
                    if [s for s, _ in replayed] != list(range(expected, seq)):
                        gap = True
                        self.unrecoverable_gaps += 1
                        log.warning("kv-event gap could not be replayed", missing_from=expected, received=seq)
                        replayed = []
                    for replayed_seq, replayed_payload in replayed:
                        self._taken(replayed_seq, replayed_payload)
                        yield replayed_seq, replayed_payload, False
                self._taken(seq, payload)
                yield seq, payload, gap
                gap = False
        finally:
            sub.disable_monitor()
            monitor.close()
            sub.close()
