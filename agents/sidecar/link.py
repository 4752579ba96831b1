"""The agent's end of the Connect stream: registration, sequence numbers, acks, heartbeats,
resync snapshots, reconnects with backoff.

Batches get consecutive sequence numbers and stay buffered until the daemon acks them, so a
reconnect within one epoch resends only what the daemon lacks. When the daemon lost our state
(restart), asks for a resync (sequence gap) or the buffer overflowed, the link sends a full
snapshot from `snapshot()` instead. `snapshot()` must describe exactly the state after the last
published batch; callers keep it in step by updating their mirror in the same loop turn as
`publish()`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import grpc
import structlog

from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.common.packed_ids import unpack_u32
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.agent.link")

SNAPSHOT_EVENTS_PER_BATCH = 256


class RegistrationRefused(Exception):
    """The daemon refused the registration itself (bad config): retrying cannot help."""


class DirectoryLink:
    def __init__(
        self,
        client: AsyncDirectoryClient,
        registration: pb.WorkerRegistration,
        snapshot: Callable[[], Sequence[pb.BlockEvent]],
        *,
        max_unacked_batches: int = 4096,
        backoff_initial_s: float = 0.1,
        # At most a second between attempts: a directory back from a failover waits for every agent
        # to re-push its state before it serves transfers again, and one stream a second is nothing.
        backoff_max_s: float = 1.0,
        on_drain: Callable[[str], None] | None = None,
    ) -> None:
        self._client = client
        self._registration = registration
        self._snapshot = snapshot
        self._max_unacked = max_unacked_batches
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._on_drain = on_drain
        self._sequence = 0
        self._acked = 0
        self._pending: OrderedDict[int, pb.EventBatch] = OrderedDict()
        self._overflowed = False
        self._outbox: asyncio.Queue[pb.ConnectRequest] | None = None
        self._acked_changed = asyncio.Event()
        self.connected = asyncio.Event()
        self._session_started = asyncio.Event()
        self.registered_once = asyncio.Event()
        self.drain_reason: str | None = None
        self.sessions = 0
        self.snapshots_sent = 0
        self.last_error: str | None = None
        self._session_task: asyncio.Task | None = None
        self._new_epoch_pending = False
        # The daemon of the current session reads events' packed fields (RegisterAck.packed_events).
        self._packed_events = True

    @property
    def worker_id(self) -> str:
        return self._registration.worker_id

    @property
    def epoch(self) -> int:
        return self._registration.epoch

    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def acked(self) -> int:
        return self._acked

    def publish(self, events: Sequence[pb.BlockEvent]) -> int:
        """Queue one batch; returns its sequence number. Never blocks: buffered while disconnected."""
        self._sequence += 1
        batch = pb.EventBatch(sequence=self._sequence, events=events)
        if len(self._pending) >= self._max_unacked:
            # Too far behind: stop buffering and send the state as a snapshot instead (it covers this
            # batch: callers update the mirror before publishing). Connected, that is now: waiting
            # for a next session would drop every event while this one stays up.
            if self._outbox is not None:
                self._queue_snapshot(self._outbox, f"over {self._max_unacked} batches unacknowledged")
                return self._sequence
            self._pending.clear()
            self._overflowed = True
        if not self._overflowed:
            self._pending[self._sequence] = batch
        if self._outbox is not None and not self._overflowed:
            self._outbox.put_nowait(pb.ConnectRequest(batch=batch))
        return self._sequence

    def request_snapshot(self, why: str) -> None:
        """Resend the full state (e.g. after the engine's own events had a gap)."""
        if self._outbox is not None:
            self._queue_snapshot(self._outbox, why)
        else:
            self._overflowed = True  # the next session snapshots

    def restart_epoch(self, epoch: int, why: str) -> None:
        """Register again under `epoch` with an empty state: kvloopd drops everything the old epoch
        published (a new epoch replaces the worker) and the first batch of the new one is 1.

        Callers empty their mirror first: ``snapshot()`` must describe the new epoch's state.
        """
        old = self._registration.epoch
        self._registration.epoch = epoch
        self._sequence = 0
        self._acked = 0
        self._pending.clear()
        self._overflowed = False
        self._outbox = None  # batches published from now on wait for the new session
        self.connected.clear()
        log.info("registering under a new epoch", worker_id=self.worker_id, old=old, new=epoch, reason=why)
        if self._session_task is not None and not self._session_task.done():
            self._new_epoch_pending = True
            self._session_task.cancel()

    async def wait_acked(self, sequence: int | None = None, timeout: float | None = None) -> None:
        target = self._sequence if sequence is None else sequence

        async def until() -> None:
            while self._acked < target:
                self._acked_changed.clear()
                await self._acked_changed.wait()

        await asyncio.wait_for(until(), timeout)

    async def wait_sessions(self, count: int, timeout: float | None = None) -> None:
        """Wait until the `count`-th session is registered and connected."""

        async def until() -> None:
            while self.sessions < count or not self.connected.is_set():
                self._session_started.clear()
                await self._session_started.wait()

        await asyncio.wait_for(until(), timeout)

    async def run(self) -> None:
        """Keep a session up until cancelled (reconnecting with jittered exponential backoff)."""
        delay = self._backoff_initial
        while True:
            started = time.monotonic()
            self._session_task = asyncio.create_task(self._session())
            try:
                await self._session_task
            except RegistrationRefused:
                raise
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not self._new_epoch_pending or (current is not None and current.cancelling()):
                    self._session_task.cancel()
                    raise
                # restart_epoch() ended the session: register the new epoch at once.
                self._new_epoch_pending = False
                self.connected.clear()
                self._outbox = None
                delay = self._backoff_initial
                continue
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"{exc.code().name}: {exc.details()}"
                if (
                    exc.code()
                    in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.PERMISSION_DENIED,
                        grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.FAILED_PRECONDITION,
                    )
                    and not self.registered_once.is_set()
                ):
                    raise RegistrationRefused(self.last_error) from None
                log.warning(
                    "directory stream lost",
                    worker_id=self.worker_id,
                    error=self.last_error,
                    retry_in_s=round(delay, 2),
                )
            except Exception as exc:  # keep the agent alive whatever the transport does
                self.last_error = repr(exc)
                log.warning("directory stream failed", worker_id=self.worker_id, error=self.last_error)
            finally:
                self.connected.clear()
                self._outbox = None
            if time.monotonic() - started > 10:
                delay = self._backoff_initial
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self._backoff_max)

    async def _session(self) -> None:
        call = self._client.stub.Connect(metadata=self._client.security.call_metadata())
        registration = pb.WorkerRegistration()
        registration.CopyFrom(self._registration)
        registration.last_sequence = self._sequence
        await call.write(pb.ConnectRequest(register=registration))
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("message") != "registered":
            raise ConnectionError("daemon closed the stream before acknowledging the registration")
        ack = first.registered
        self._packed_events = ack.packed_events
        self.sessions += 1
        outbox: asyncio.Queue[pb.ConnectRequest] = asyncio.Queue()
        needs_snapshot = (
            ack.resync_required
            or self._overflowed
            or (
                ack.last_applied_sequence < self._sequence
                and (not self._pending or next(iter(self._pending)) > ack.last_applied_sequence + 1)
            )
        )
        # The daemon's word is authoritative: after a daemon restart it has applied nothing.
        self._acked = ack.last_applied_sequence
        self._mark_acked(ack.last_applied_sequence)
        if needs_snapshot:
            self._queue_snapshot(outbox, f"resync_required={ack.resync_required}")
        else:
            for batch in self._pending.values():
                outbox.put_nowait(pb.ConnectRequest(batch=batch))
        self._outbox = outbox
        self.connected.set()
        self.registered_once.set()
        self._session_started.set()
        log.info(
            "registered with directory",
            worker_id=self.worker_id,
            epoch=registration.epoch,
            last_applied=ack.last_applied_sequence,
            resync=needs_snapshot,
            target=self._client.target,
        )
        heartbeat_s = max(ack.heartbeat_interval_ms, 100) / 1000
        writer = asyncio.create_task(self._write(call, outbox, heartbeat_s))
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("daemon closed the stream")
                kind = response.WhichOneof("message")
                if kind == "ack":
                    self._mark_acked(response.ack.sequence)
                elif kind == "resync":
                    log.warning(
                        "daemon requested resync", worker_id=self.worker_id, reason=response.resync.reason
                    )
                    self._queue_snapshot(outbox, response.resync.reason)
                elif kind == "drain":
                    self.drain_reason = response.drain.reason
                    log.warning("drain requested", worker_id=self.worker_id, reason=response.drain.reason)
                    if self._on_drain is not None:
                        self._on_drain(response.drain.reason)
        finally:
            writer.cancel()
            call.cancel()

    async def _write(
        self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue, heartbeat_s: float
    ) -> None:
        while True:
            try:
                request = await asyncio.wait_for(outbox.get(), heartbeat_s)
            except TimeoutError:
                request = pb.ConnectRequest(heartbeat=pb.Heartbeat(sent_at_us=int(time.monotonic() * 1e6)))
            if not self._packed_events and request.HasField("batch"):
                request = pb.ConnectRequest(batch=unpacked(request.batch, self._registration.hash_length))
            try:
                await call.write(request)
            except asyncio.InvalidStateError:  # the call ended; the reader reports why
                return

    def _queue_snapshot(self, outbox: asyncio.Queue, why: str) -> None:
        """Replace whatever is queued with a full snapshot at the current sequence."""
        while not outbox.empty():
            outbox.get_nowait()
        events = list(self._snapshot())
        outbox.put_nowait(pb.ConnectRequest(snapshot_begin=pb.SnapshotBegin()))
        for start in range(0, len(events), SNAPSHOT_EVENTS_PER_BATCH):
            outbox.put_nowait(
                pb.ConnectRequest(
                    batch=pb.EventBatch(sequence=0, events=events[start : start + SNAPSHOT_EVENTS_PER_BATCH])
                )
            )
        outbox.put_nowait(pb.ConnectRequest(snapshot_end=pb.SnapshotEnd(sequence=self._sequence)))
        self._pending.clear()
        self._overflowed = False
        self.snapshots_sent += 1
        log.info(
            "sending snapshot",
            worker_id=self.worker_id,
            events=len(events),
            sequence=self._sequence,
            reason=why,
        )

    def _mark_acked(self, sequence: int) -> None:
        if sequence > self._acked:
            self._acked = sequence
        while self._pending and next(iter(self._pending)) <= sequence:
            self._pending.popitem(last=False)
        self._acked_changed.set()


def unpacked(batch: pb.EventBatch, width: int) -> pb.EventBatch:
    """The batch for a kvloopd that does not read packed events: every packed field moved to its
    repeated twin (one field per hash or id), the rest as it is."""
    if not any(_packed(event) for event in batch.events):
        return batch
    out = pb.EventBatch()
    out.CopyFrom(batch)
    for event in out.events:
        kind = event.WhichOneof("event")
        if kind == "stored" and event.stored.packed_block_hashes:
            stored = event.stored
            stored.block_hashes.extend(_cut(stored.packed_block_hashes, width))
            stored.ClearField("packed_block_hashes")
        elif kind == "removed":
            removed = event.removed
            removed.block_hashes.extend(_cut(removed.packed_block_hashes, width))
            removed.root_block_hashes.extend(_cut(removed.packed_root_block_hashes, width))
            removed.ClearField("packed_block_hashes")
            removed.ClearField("packed_root_block_hashes")
        elif kind == "retained":
            retained = event.retained
            retained.block_hashes.extend(_cut(retained.packed_block_hashes, width))
            retained.block_ids.extend(unpack_u32(retained.packed_block_ids))
            retained.ClearField("packed_block_hashes")
            retained.ClearField("packed_block_ids")
    return out


def _packed(event: pb.BlockEvent) -> bool:
    kind = event.WhichOneof("event")
    if kind == "stored":
        return bool(event.stored.packed_block_hashes)
    if kind == "removed":
        return bool(event.removed.packed_block_hashes or event.removed.packed_root_block_hashes)
    if kind == "retained":
        return bool(event.retained.packed_block_hashes or event.retained.packed_block_ids)
    return False


def _cut(data: bytes, width: int) -> list[bytes]:
    return [data[i : i + width] for i in range(0, len(data), width)]
