"""Fan-out of directory changes to ``Watch`` subscribers, across replicas when they share a store."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import structlog

from kvloop.daemon.index import Change

log = structlog.get_logger("kvloop.daemon")


class ChangeRelay(Protocol):
    """A broadcast channel between the replicas of one directory (Redis pub/sub)."""

    async def send(self, payload: bytes) -> None: ...

    def messages(self) -> AsyncIterator[bytes]: ...


class ChangeFeed:
    """Every change goes to every subscriber's bounded queue; a slow subscriber loses its oldest
    change and never blocks ingest.

    With a relay, changes made on this replica are also broadcast to the others, and theirs are
    delivered here, so a Watch on any replica sees the whole directory. Delivery across replicas is
    at most once (pub/sub): a replica that is disconnected from the relay misses changes meanwhile."""

    def __init__(self, queue_size: int = 10_000, relay: ChangeRelay | None = None) -> None:
        self._queues: set[asyncio.Queue[Change]] = set()
        self._queue_size = queue_size
        self._relay = relay
        self._origin = uuid.uuid4().hex
        self._outgoing: deque[Change] = deque(maxlen=queue_size)
        self._pending: asyncio.Event | None = None
        # Called with each change another replica made (a drain for an agent streaming to this one).
        self.on_remote: Callable[[Change], None] | None = None

    def __bool__(self) -> bool:
        """True while anyone may be subscribed (callers skip building changes otherwise)."""
        return bool(self._queues) or self._relay is not None

    def publish(self, change: Change) -> None:
        self._deliver(change)
        if self._relay is not None:
            self._outgoing.append(change)
            if self._pending is not None:
                self._pending.set()

    def _deliver(self, change: Change) -> None:
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(change)

    async def subscribe(self) -> AsyncIterator[Change]:
        queue: asyncio.Queue[Change] = asyncio.Queue(maxsize=self._queue_size)
        self._queues.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)

    async def relay(self) -> None:
        """Run the broadcast both ways until cancelled (only with a relay)."""
        if self._relay is None:
            return
        self._pending = asyncio.Event()
        await asyncio.gather(
            self._send(self._relay, self._pending), listen(self._relay, self._received, "change")
        )

    async def _send(self, relay: ChangeRelay, pending: asyncio.Event) -> None:
        while True:
            await pending.wait()
            pending.clear()
            batch = list(self._outgoing)
            self._outgoing.clear()
            if not batch:
                continue
            payload = json.dumps(
                {"o": self._origin, "c": [[c.kind, c.worker_id, c.model, c.blocks, c.detail] for c in batch]}
            ).encode()
            try:
                await relay.send(payload)
            except Exception as exc:  # the store is away (failover): local Watches still work
                log.warning("change relay: send failed", error=str(exc), changes=len(batch))

    def _received(self, payload: bytes) -> None:
        message = json.loads(payload)
        if message["o"] == self._origin:
            return
        for kind, worker_id, model, blocks, detail in message["c"]:
            change = Change(kind, worker_id, model, blocks, detail)
            if self.on_remote is not None:
                self.on_remote(change)
            self._deliver(change)


async def listen(relay: ChangeRelay, handle: Callable[[bytes], None], what: str) -> None:
    """Hand every message the relay brings to ``handle`` until cancelled; after a failure (the store
    is away, a message ``handle`` refused) subscribe again."""
    while True:
        try:
            async for payload in relay.messages():
                handle(payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(f"{what} relay: receive failed; resubscribing", error=str(exc))
            await asyncio.sleep(1.0)  # back off before resubscribing to a store that is away
