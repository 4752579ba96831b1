"""The agents' Connect streams: one state machine per stream, and the registry of live ones.

A stream is ``register`` first, then ``batch``es with per-worker sequence numbers, ``heartbeat``s
and ``snapshot_begin`` ... ``snapshot_end`` resyncs. :meth:`AgentSession.handle` applies one
message in turn (a stream's messages never overlap); its replies go to the session's outbox, which
the Connect handler streams back. The one place a block event enters the index is
:meth:`AgentSession._batch` -> ``DirectoryStore.apply``, which the store fences by the worker's
(epoch, sequence): a replayed batch is a no-op, a skipped one is refused, whichever replica applies it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from kvloop.common.outcomes import tier_name
from kvloop.common.security import TokenGrant
from kvloop.common.version import VERSION
from kvloop.daemon import metrics
from kvloop.daemon.convert import BadInput, Refused, events_from_batch, spec_from_registration
from kvloop.daemon.cost_model import CostModel
from kvloop.daemon.index import Change, DirectoryError, DirectoryStore, Fence, StoreUnavailable, WorkerSpec
from kvloop.daemon.metrics import DaemonCounters
from kvloop.daemon.roster import WorkerRoster
from kvloop.daemon.watch import ChangeFeed
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.daemon")

_STATUS = {
    name: getattr(grpc.StatusCode, name)
    for name in ("ALREADY_EXISTS", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE")
}


@dataclass(frozen=True)
class SessionContext:
    """What every session shares: the store, the cost model, counters and the Watch fan-out."""

    store: DirectoryStore
    cost: CostModel
    counters: DaemonCounters
    changes: ChangeFeed
    heartbeat_interval_s: float
    max_hashes: int
    # Route's view of the workers: read again after a registration, disconnect or resync here.
    roster: WorkerRoster
    live: dict[str, AgentSession] = field(default_factory=dict)


@dataclass(eq=False)
class AgentSession:
    ctx: SessionContext
    peer: str
    grant: TokenGrant | None
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    spec: WorkerSpec | None = None
    in_snapshot: bool = False
    awaiting_resync: bool = False

    def send(self, response: pb.ConnectResponse) -> None:
        self.outbox.put_nowait(response)

    async def handle(self, request: pb.ConnectRequest) -> None:
        kind = request.WhichOneof("message")
        store = self.ctx.store
        now = store.clock()
        if kind == "register":
            await self._register(request.register, now)
            return
        spec = self.spec
        if spec is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"first message on Connect must be register, got {kind or 'an empty message'}",
            )
        if self.ctx.live.get(spec.worker_id) is not self:
            raise Refused(
                grpc.StatusCode.ABORTED, "this stream was superseded by a newer one for the same worker"
            )
        # A batch is fenced inside the store's apply (one call, no extra round trip to a networked
        # store); the other messages are checked here.
        current = spec if kind == "batch" else await store.worker_spec(spec.worker_id)
        if current is None or current.epoch != spec.epoch:
            # The reaper dropped the worker (silent past lease_s + drop_after_s) under a stream that
            # is still open: its state is gone, so the agent must register again.
            raise Refused(
                grpc.StatusCode.ABORTED,
                f"worker {spec.worker_id!r} was dropped from the directory after its lease lapsed; "
                "reconnect and register again",
            )
        if kind == "heartbeat":
            await store.heartbeat(spec.worker_id, now)
            self.send(pb.ConnectResponse(heartbeat=pb.HeartbeatAck(sent_at_us=request.heartbeat.sent_at_us)))
        elif kind == "batch":
            await self._batch(request.batch, spec, now)
        elif kind == "snapshot_begin":
            await store.begin_snapshot(spec.worker_id, now)
            self.in_snapshot = True
            self.ctx.counters.resync("snapshot")
            self.ctx.changes.publish(Change("resync", spec.worker_id, spec.model, 0, "snapshot started"))
        elif kind == "snapshot_end":
            if not self.in_snapshot:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "snapshot_end without snapshot_begin")
            sequence = request.snapshot_end.sequence
            await store.end_snapshot(spec.worker_id, sequence, now)
            self.in_snapshot = self.awaiting_resync = False
            self.send(pb.ConnectResponse(ack=pb.BatchAck(sequence=sequence)))
            self.ctx.changes.publish(Change("resync", spec.worker_id, spec.model, 0, "snapshot applied"))
            log.info("snapshot applied", worker_id=spec.worker_id, sequence=sequence)
        else:
            raise BadInput("empty", "ConnectRequest carries no message")

    async def _register(self, reg: pb.WorkerRegistration, now: float) -> None:
        if self.spec is not None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "this stream is already registered")
        spec = spec_from_registration(reg)
        grant = self.grant
        if grant is not None and grant.worker_id and grant.worker_id != spec.worker_id:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this token may only publish for worker {grant.worker_id!r}, not {spec.worker_id!r}",
            )
        try:
            last, resync = await self.ctx.store.register(spec, reg.last_sequence, now)
        except DirectoryError as exc:
            raise Refused(_STATUS[exc.code], str(exc)) from None
        self.ctx.roster.invalidate()
        self.spec = spec
        self.awaiting_resync = resync
        self.ctx.live[spec.worker_id] = self
        metrics.CONNECTED_AGENTS.set(len(self.ctx.live))
        if resync:
            self.ctx.counters.resync("register")
        self.send(
            pb.ConnectResponse(
                registered=pb.RegisterAck(
                    last_applied_sequence=last,
                    resync_required=resync,
                    heartbeat_interval_ms=int(self.ctx.heartbeat_interval_s * 1000),
                    lease_ms=int(self.ctx.store.config.lease_s * 1000),
                    packed_events=True,
                )
            )
        )
        self.ctx.changes.publish(Change("registered", spec.worker_id, spec.model, 0, f"epoch {spec.epoch}"))
        metrics.AGENT_REGISTRATIONS.labels(spec.agent_version or "unknown").inc()
        if spec.agent_version != VERSION:
            # Mixed releases work while the protocol stays compatible, but say so: an upgrade that
            # left an agent behind shows here and in GetStats' agent_versions.
            log.warning(
                "agent of another kvloop release",
                worker_id=spec.worker_id,
                agent_version=spec.agent_version or "unknown",
                kvloopd_version=VERSION,
            )
        log.info(
            "agent registered",
            worker_id=spec.worker_id,
            agent_version=spec.agent_version or "unknown",
            model=spec.model,
            epoch=spec.epoch,
            role=pb.WorkerRole.Name(spec.role),
            resync_required=resync,
            last_sequence=last,
            peer=self.peer,
        )

    async def _batch(self, batch: pb.EventBatch, spec: WorkerSpec, now: float) -> None:
        if not self.in_snapshot and self.awaiting_resync:
            metrics.BATCHES.labels("ignored_awaiting_resync").inc()
            return
        validated = events_from_batch(batch, spec, self.ctx.max_hashes)
        events = validated.events
        # One store call decides and applies: the fence (epoch, next sequence) is checked where the
        # state lives, so two replicas (or a replay after a reconnect) never apply a batch twice.
        applied = await self.ctx.store.apply(
            spec.worker_id, spec.epoch, 0 if self.in_snapshot else batch.sequence, events, now
        )
        if applied.fence is Fence.DUPLICATE:
            metrics.BATCHES.labels("duplicate").inc()
            self.send(pb.ConnectResponse(ack=pb.BatchAck(sequence=applied.last_sequence)))
            return
        if applied.fence is Fence.GAP:
            await self._request_resync(spec, applied.last_sequence + 1, batch.sequence)
            return
        if applied.fence is not Fence.APPLIED:
            raise Refused(
                grpc.StatusCode.ABORTED,
                f"worker {spec.worker_id!r} epoch {spec.epoch} is no longer registered "
                f"({applied.fence.value}): re-register",
            )
        for refused in validated.refused:
            # Left out alone: the rest of the batch is applied and acknowledged, the stream stays up
            # (refusing the batch would refuse it again on every resend).
            self.ctx.counters.rejected_message("Connect", refused.reason)
            log.warning(
                "agent event left out", worker_id=spec.worker_id, reason=refused.reason, error=str(refused)
            )
        for event in validated.telemetry:
            await self._telemetry(event, spec)
        for kind, n in validated.counts.items():
            metrics.EVENTS_INGESTED.labels(kind).inc(n)
        metrics.BATCHES.labels("applied").inc()
        if not self.in_snapshot:
            self.send(pb.ConnectResponse(ack=pb.BatchAck(sequence=batch.sequence)))
        if self.ctx.changes:
            for event in events:
                blocks = len(getattr(event, "hashes", ()))
                self.ctx.changes.publish(
                    Change(type(event).__name__.lower(), spec.worker_id, spec.model, blocks)
                )

    async def _request_resync(self, spec: WorkerSpec, expected: int, received: int) -> None:
        await self.ctx.store.mark_resyncing(spec.worker_id)
        self.ctx.roster.invalidate()
        self.awaiting_resync = True
        self.ctx.counters.resync("sequence_gap")
        metrics.BATCHES.labels("gap").inc()
        log.warning(
            "sequence gap, resync requested", worker_id=spec.worker_id, expected=expected, received=received
        )
        self.send(
            pb.ConnectResponse(
                resync=pb.ResyncRequest(
                    reason=f"sequence gap: expected {expected}, received {received}",
                    expected_sequence=expected,
                    received_sequence=received,
                )
            )
        )

    def resync_after_failover(self, reason: str) -> None:
        """The store failed over and may have lost this worker's latest writes: ask for its whole state
        (the store already stopped serving it)."""
        if self.spec is None:
            return
        self.awaiting_resync = True
        self.ctx.counters.resync("store_failover")
        self.send(pb.ConnectResponse(resync=pb.ResyncRequest(reason=reason)))

    async def _telemetry(self, event: pb.BlockEvent, spec: WorkerSpec) -> None:
        if event.HasField("transfer"):
            t = event.transfer
            self.ctx.cost.record_transfer(spec.worker_id, t.source_worker_id, t, spec.model)
            metrics.TRANSFER_REPORTS.labels(str(t.ok).lower(), str(t.first_contact).lower()).inc()
            if t.verify_failed:
                await self._verify_failed(t, spec)
        else:
            p = event.prefill
            self.ctx.cost.record_prefill(spec.worker_id, p.tokens, p.duration_us, spec.model)

    async def _verify_failed(self, report: pb.TransferReport, puller: WorkerSpec) -> None:
        """A READ brought blocks that are not what the holder digested: whatever the cause (a block
        freed and reused early, a torn host copy), the holder's other runs may be as wrong, so none is
        handed out until it registers again (a new stream, a restarted agent)."""
        holder = report.source_worker_id
        withheld = bool(holder) and await self.ctx.store.set_unverified(holder)
        metrics.VERIFY_FAILED.inc()
        log.warning(
            "pulled blocks failed their digest check",
            holder=holder,
            puller=puller.worker_id,
            model=puller.model,
            blocks=report.blocks,
            source_tier=tier_name(report.source_tier),
            holder_withheld=withheld,
        )
        if withheld:
            self.ctx.changes.publish(
                Change(
                    "unverified",
                    holder,
                    puller.model,
                    0,
                    f"a READ by {puller.worker_id} failed its digest check: runs withheld until it registers",
                )
            )

    async def read(self, requests: AsyncIterator[pb.ConnectRequest]) -> None:
        """Apply the agent's messages until the stream ends or one is refused."""
        try:
            async for request in requests:
                await self.handle(request)
            self.outbox.put_nowait(None)
        except BadInput as exc:
            self.ctx.counters.rejected_message("Connect", exc.reason)
            log.warning(
                "agent message refused",
                peer=self.peer,
                reason=exc.reason,
                error=str(exc),
                worker_id=self.spec.worker_id if self.spec else None,
            )
            self.outbox.put_nowait(Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        except Refused as exc:
            self.ctx.counters.rejected_message("Connect", exc.code.name.lower())
            log.warning("agent refused", peer=self.peer, code=exc.code.name, error=str(exc))
            self.outbox.put_nowait(exc)
        except StoreUnavailable as exc:  # the agent reconnects (to this or another replica) and resumes
            log.warning("directory store unavailable", peer=self.peer, error=str(exc))
            self.outbox.put_nowait(Refused(grpc.StatusCode.UNAVAILABLE, str(exc)))
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must cost one stream, never the daemon
            log.exception("agent stream failed", peer=self.peer)
            self.outbox.put_nowait(Refused(grpc.StatusCode.INTERNAL, "internal error handling agent stream"))

    async def closed(self) -> None:
        """The stream ended: the worker stays registered until its lease lapses."""
        spec = self.spec
        if spec is None or self.ctx.live.get(spec.worker_id) is not self:
            return
        del self.ctx.live[spec.worker_id]
        try:
            await self.ctx.store.disconnect(spec.worker_id, spec.epoch, self.ctx.store.clock())
        except StoreUnavailable:  # its liveness key lapses by itself; its own agent may take over
            log.warning("disconnect not recorded: directory store unavailable", worker_id=spec.worker_id)
        self.ctx.roster.invalidate()
        metrics.CONNECTED_AGENTS.set(len(self.ctx.live))
        self.ctx.changes.publish(Change("disconnected", spec.worker_id, spec.model))
        log.info("agent disconnected", worker_id=spec.worker_id, peer=self.peer)
