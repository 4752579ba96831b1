"""Fan-out of directory changes to ``Watch`` subscribers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvloop.daemon.index import Change


class ChangeFeed:
    """Every change goes to every subscriber's bounded queue; a slow subscriber loses its oldest
    change and never blocks ingest."""

    def __init__(self, queue_size: int = 10_000) -> None:
        self._queues: set[asyncio.Queue[Change]] = set()
        self._queue_size = queue_size

    def __bool__(self) -> bool:
        """True while anyone is subscribed (callers skip building changes otherwise)."""
        return bool(self._queues)

    def publish(self, change: Change) -> None:
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
