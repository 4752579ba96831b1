"""Route's pull plans, pushed to the prefill workers they were made for (the ``Plans`` stream).

A router asks Route, then sends the request to the prefill it chose; that prefill's connector would then
ask Lookup the same question Route has just answered, on its engine loop (milliseconds per turn under
load: docs/benchmarks.md, "With Route's plans"). Route already ran that lookup for every candidate, so
for each candidate whose pull it judged worth a READ it posts the Lookup answer here, and the
candidate's connector, subscribed over an authenticated stream of its own, takes it when the request
arrives. The plan reaches the connector through kvloopd only: a client can neither forge nor redirect
one.

Only multi-reader runs are planned: a single-use run must be claimed, and Route never claims (the
router may pick another candidate). With replicas sharing a Redis store, a plan for a worker not
subscribed to this replica goes over Redis pub/sub to the others (at most once, like Watch's
changes): a connector may stream from any replica, the router may ask any. Each replica announces on
the same channel, every ``ANNOUNCE_S`` and whenever it changes, the workers whose connectors stream
from it; a plan goes over Redis only for a worker some replica announced within ``ANNOUNCED_FOR_S``
(a fleet whose connectors take no plans pays no serialising and no publish per Route).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence

import structlog

from kvloop.daemon.convert import plan_response
from kvloop.daemon.metrics import ROUTE_PLANS
from kvloop.daemon.queries import RouteScore
from kvloop.daemon.watch import ChangeRelay, listen
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.daemon")

ANNOUNCE_S = 1.0
# A replica that stopped announcing (gone, or cut from Redis) stops drawing plans after this long.
ANNOUNCED_FOR_S = 3.5 * ANNOUNCE_S
# An announcement on the plan channel: this prefix (no worker id is empty, so a replica that reads
# every message as worker id, NUL, plan finds no such worker and drops it), the replica's origin,
# a NUL, its workers joined by newlines.
_ANNOUNCEMENT = b"\0subscribers\0"


class PlanBoard:
    """Per prefill worker id, the queues of its subscribed connectors (normally one). A queue that
    is full loses its oldest plan: a plan is worth something for a second at most, and a slow
    subscriber never holds up Route."""

    def __init__(self, queue_size: int = 256, relay: ChangeRelay | None = None) -> None:
        self._queues: dict[str, set[asyncio.Queue[pb.PlansResponse | None]]] = {}
        self._queue_size = queue_size
        self._relay = relay
        self._outgoing: deque[bytes] = deque(maxlen=queue_size)
        self._pending = asyncio.Event()
        self._closed = False
        self._origin = uuid.uuid4().hex.encode()
        self._announced: dict[bytes, tuple[frozenset[str], float]] = {}  # origin -> workers, until
        self._remote: dict[str, float] = {}  # worker id -> until when another replica streams it
        self._subscribers_changed = asyncio.Event()

    def wants(self, worker_id: str) -> bool:
        """Whether a plan for this worker may reach a subscriber: here, or on a replica that announced
        it lately."""
        return worker_id in self._queues or self._remote.get(worker_id, 0.0) > time.monotonic()

    def post_ranked(
        self,
        hashes: Sequence[bytes],
        block_size: int,
        ranked: Sequence[RouteScore],
        continuation: bool,
        directory_epoch: int,
        read_window_ms: int,
    ) -> None:
        """Each pull Route planned for a candidate, to that candidate's subscribed connector."""
        for score in ranked:
            worker_id = score.candidate.worker_id
            if score.plan is None or not self.wants(worker_id):
                continue
            plan = plan_response(score, hashes, block_size, continuation, directory_epoch, read_window_ms)
            self.post(worker_id, plan)

    def post(self, worker_id: str, plan: pb.PlansResponse) -> None:
        queues = self._queues.get(worker_id)
        if queues:
            self._deliver(queues, plan)
        elif self._relay is not None:
            # Another replica's subscriber, if any: the worker id, a NUL, the plan.
            self._outgoing.append(worker_id.encode() + b"\0" + plan.SerializeToString())
            self._pending.set()

    def _deliver(self, queues: set[asyncio.Queue[pb.PlansResponse | None]], plan: pb.PlansResponse) -> None:
        for queue in queues:
            if queue.full():
                queue.get_nowait()
                ROUTE_PLANS.labels("dropped").inc()
            queue.put_nowait(plan)
            ROUTE_PLANS.labels("posted").inc()

    @contextlib.contextmanager
    def subscription(self, worker_id: str) -> Iterator[asyncio.Queue[pb.PlansResponse | None]]:
        """A queue of the worker's plans, posted to from the moment this returns; None in it ends the
        stream (kvloopd is shutting down)."""
        queue: asyncio.Queue[pb.PlansResponse | None] = asyncio.Queue(maxsize=self._queue_size + 1)
        if self._closed:
            queue.put_nowait(None)
        if worker_id not in self._queues:
            self._subscribers_changed.set()
        self._queues.setdefault(worker_id, set()).add(queue)
        try:
            yield queue
        finally:
            queues = self._queues.get(worker_id)
            if queues is not None:
                queues.discard(queue)
                if not queues:
                    del self._queues[worker_id]
                    self._subscribers_changed.set()

    def close(self) -> None:
        """End every Plans stream now (shutdown need not wait its grace for them): their connectors
        subscribe again, to another replica or to this one restarted."""
        self._closed = True
        for queues in self._queues.values():
            for queue in queues:
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(None)

    async def relay(self) -> None:
        """Plans to and from the other replicas until cancelled (only with a relay)."""
        if self._relay is None:
            return
        await asyncio.gather(
            self._send(self._relay), self._announce(self._relay), listen(self._relay, self._received, "plan")
        )

    async def _announce(self, relay: ChangeRelay) -> None:
        """This replica's subscribed workers to the others: at once when they change, else every
        ANNOUNCE_S (so a replica that joins, or lost a message, learns them within that)."""
        while True:
            self._subscribers_changed.clear()
            workers = "\n".join(sorted(self._queues)).encode()
            try:
                await relay.send(_ANNOUNCEMENT + self._origin + b"\0" + workers)
            except Exception as exc:  # the store is away: the next announcement will do
                log.debug("plan relay: announcement failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._subscribers_changed.wait(), ANNOUNCE_S)

    async def _send(self, relay: ChangeRelay) -> None:
        while True:
            await self._pending.wait()
            self._pending.clear()
            while self._outgoing:
                payload = self._outgoing.popleft()
                try:
                    await relay.send(payload)
                except Exception as exc:  # the store is away: the plan is lost, its Lookup decides
                    log.debug("plan relay: send failed", error=str(exc))

    def _received(self, payload: bytes) -> None:
        payload = bytes(payload)
        if payload.startswith(_ANNOUNCEMENT):
            self._heard(payload[len(_ANNOUNCEMENT) :])
            return
        worker, _, body = payload.partition(b"\0")
        queues = self._queues.get(worker.decode(errors="replace"))
        if queues:
            self._deliver(queues, pb.PlansResponse.FromString(body))

    def _heard(self, announcement: bytes) -> None:
        origin, _, workers = announcement.partition(b"\0")
        if origin == self._origin:
            return
        now = time.monotonic()
        named = frozenset(workers.decode(errors="replace").split("\n")) - {""}
        self._announced[origin] = (named, now + ANNOUNCED_FOR_S)
        remote: dict[str, float] = {}
        for other, (others_workers, until) in list(self._announced.items()):
            if until <= now:
                del self._announced[other]
                continue
            for worker in others_workers:
                remote[worker] = max(until, remote.get(worker, 0.0))
        self._remote = remote
