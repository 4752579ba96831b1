"""Route's pull plans, pushed to the prefill workers they were made for (the ``Plans`` stream).

A router asks Route, then sends the request to the prefill it chose; that prefill's connector would
then ask Lookup the same question Route has just answered, on its engine loop (1-2 ms per turn
measured at two to four sessions). Route already ran that lookup for every candidate, so for each
candidate whose pull it judged worth a READ it posts the Lookup answer here, and the candidate's
connector, subscribed over an authenticated stream of its own, takes it when the request arrives.
The plan reaches the connector through kvloopd only: a client can neither forge nor redirect one.

Only multi-reader runs are planned: a single-use run must be claimed, and Route never claims (the
router may pick another candidate). Plans are pushed to subscribers on this replica; a connector
subscribed to another replica misses them and looks up as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from kvloop.daemon.metrics import ROUTE_PLANS
from kvloop.v1 import directory_pb2 as pb


class PlanBoard:
    """Per prefill worker id, the queues of its subscribed connectors (normally one). A queue that
    is full loses its oldest plan: a plan is worth something for a second at most, and a slow
    subscriber never holds up Route."""

    def __init__(self, queue_size: int = 256) -> None:
        self._queues: dict[str, set[asyncio.Queue[pb.PlansResponse]]] = {}
        self._queue_size = queue_size

    def wants(self, worker_id: str) -> bool:
        return worker_id in self._queues

    def post(self, worker_id: str, plan: pb.PlansResponse) -> None:
        for queue in self._queues.get(worker_id, ()):
            if queue.full():
                queue.get_nowait()
                ROUTE_PLANS.labels("dropped").inc()
            queue.put_nowait(plan)
            ROUTE_PLANS.labels("posted").inc()

    @contextlib.contextmanager
    def subscription(self, worker_id: str) -> Iterator[asyncio.Queue[pb.PlansResponse]]:
        """A queue of the worker's plans, posted to from the moment this returns."""
        queue: asyncio.Queue[pb.PlansResponse] = asyncio.Queue(maxsize=self._queue_size)
        self._queues.setdefault(worker_id, set()).add(queue)
        try:
            yield queue
        finally:
            queues = self._queues.get(worker_id)
            if queues is not None:
                queues.discard(queue)
                if not queues:
                    del self._queues[worker_id]
