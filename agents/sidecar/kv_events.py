"""Subscriber of vLLM's ZMQ KV-event publisher, with gap repair from its replay endpoint.

Messages are (topic, seq: 8-byte big-endian, msgpack KVEventBatch). A gap in seq is filled by
asking the ROUTER replay socket for everything from the first missing seq; if the publisher's
buffer no longer reaches back that far the gap is unrecoverable and the caller is told so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog
import zmq
import zmq.asyncio

log = structlog.get_logger("kvloop.agent.zmq")

END_SEQ = -1


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

    async def batches(self) -> AsyncIterator[tuple[int, bytes, bool]]:
        """Yield (seq, payload, gap_before) in order, forever.

        gap_before is True when batches before this one were lost for good: the caller must not
        trust state (a release may be among the lost batches).
        """
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self._endpoint)
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
                    self.last_seq = seq
                    self.messages += 1
                    yield seq, payload, gap
                    gap = False
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if self.last_seq is not None and seq <= self.last_seq:
                    continue
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
                        self.last_seq = replayed_seq
                        self.messages += 1
                        yield replayed_seq, replayed_payload, False
                self.last_seq = seq
                self.messages += 1
                yield seq, payload, gap
                gap = False
        finally:
            sub.close()
