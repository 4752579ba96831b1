"""The sidecar's event pump: the engine's KV events into the directory link, one engine process at a
time.

Each engine process ends with its publisher (the ZMQ stream restarts) or its ``/health`` (the watch
says it is gone); either way the directory must drop every block that process announced (their ids
mean other data in a relaunched engine), so the pump restarts the link under a new epoch with an
empty mirror, and reads the next engine from a fresh subscription and replay from seq 0. A gap in
the engine's events, or a batch it cannot read, loses releases like any lost event: the retained runs
are forgotten and a snapshot is asked for.
"""

from __future__ import annotations

import asyncio
import random

import structlog
from prometheus_client import Counter

from kvloop.agents.sidecar.engine_watch import EngineIncarnation
from kvloop.agents.sidecar.kv_events import KvEventSubscriber, PublisherRestarted, read_or_count
from kvloop.agents.sidecar.link import DirectoryLink
from kvloop.agents.sidecar.mirror import WorkerMirror
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.agent")

FORWARDED = Counter("kvloop_agent_events_forwarded_total", "Block events forwarded to kvloopd", ["kind"])
ENGINE_GAPS = Counter("kvloop_agent_engine_event_gaps_total", "Unrecoverable gaps in the engine's KV events")


class EventPump:
    def __init__(
        self,
        subscriber: KvEventSubscriber,
        mirror: WorkerMirror,
        link: DirectoryLink,
        registration: pb.WorkerRegistration,
        engine: EngineIncarnation,
    ) -> None:
        self.subscriber = subscriber
        self.mirror = mirror
        self.link = link
        self.registration = registration
        self.engine = engine
        self._gone = asyncio.Event()  # set by the health watch; the pump drops the engine's state
        self._gone_reason = ""

    async def run(self) -> None:
        """The engine's events, one engine process at a time (see the module's docstring)."""
        while True:
            consumer = asyncio.create_task(self._take_engine_events(), name="engine events")
            gone = asyncio.create_task(self._gone.wait())
            try:
                await asyncio.wait({consumer, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                consumer.cancel()
                outcome = (await asyncio.gather(consumer, return_exceptions=True))[0]
            # Only now, with no batch of the old engine left in flight, is its state dropped.
            if self._gone.is_set():
                self._gone.clear()
                self._forget_engine("health", self._gone_reason)
            elif isinstance(outcome, PublisherRestarted):
                if self.engine.mark_down("publisher", str(outcome)):
                    self._forget_engine("publisher", str(outcome))
            elif isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome

    def engine_down(self, reason: str) -> None:
        """The health watch found the engine gone: the pump drops its state once no batch of it is in
        flight."""
        if self.engine.mark_down("health", reason):
            self._gone_reason = reason
            self._gone.set()

    async def _take_engine_events(self) -> None:
        mirror, link = self.mirror, self.link
        async for seq, payload, gap in self.subscriber.batches():
            self.engine.batch_taken()
            if gap:
                ENGINE_GAPS.inc()
                mirror.forget_retained()
                link.request_snapshot("engine event gap")
            decoded = read_or_count(payload, seq)
            if decoded is None:
                # Its events are lost like a gap's: a release may be among them.
                mirror.forget_retained()
                link.request_snapshot("unreadable engine event batch")
                continue
            events = mirror.convert_batch(decoded.vllm, decoded.kvloop)
            for event in events:
                FORWARDED.labels(event.WhichOneof("event")).inc()
            if events:
                link.publish(events)

    def _forget_engine(self, signal: str, reason: str) -> None:
        """The engine process ended: the directory must drop every block it announced. A new epoch
        replaces the worker with an empty one."""
        old_epoch = self.registration.epoch
        self.mirror.clear()
        self.link.restart_epoch(random.getrandbits(63) | 1, f"engine ended ({signal})")
        log.warning(
            "engine process ended: its blocks are dropped from the directory",
            worker_id=self.registration.worker_id,
            signal=signal,
            reason=reason,
            old_epoch=old_epoch,
            epoch=self.registration.epoch,
            engine_restarts=self.engine.restarts,
        )

    async def warn_if_silent(self, after_s: float, endpoint: str) -> None:
        """A warning when the engine sent no event at all within ``after_s``: a vLLM started without
        KV events is the usual mistake."""
        await asyncio.sleep(after_s)
        if self.subscriber.messages == 0:
            log.warning(
                "no KV events from the engine yet: is vLLM started with kv_events_config "
                "(enable_kv_cache_events, publisher zmq) on this endpoint?",
                endpoint=endpoint,
                waited_s=after_s,
            )
