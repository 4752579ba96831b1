"""The kvloop.v1.Directory gRPC service: validation, sequencing, auth, metrics; the index does the rest.

Every handler runs on one asyncio loop and never awaits between reading and changing the index, so
each message is applied atomically (a single-use claim cannot be handed out twice).
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from opentelemetry import trace

from kvloop.common.security import Role, TokenGrant
from kvloop.daemon import metrics
from kvloop.daemon.index import (
    Change,
    Cleared,
    DirectoryError,
    DirectoryStore,
    Event,
    Holding,
    LeaseState,
    Namespace,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
)
from kvloop.daemon.policy import CostModel
from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pb_grpc

log = structlog.get_logger("kvloop.daemon")

MAX_ID_LENGTH = 256
_STATUS = {
    name: getattr(grpc.StatusCode, name)
    for name in ("ALREADY_EXISTS", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "NOT_FOUND")
}
_DECISION_NAMES = {v: pb.Decision.Name(v).removeprefix("DECISION_").lower() for v in pb.Decision.values()}
_REASON_NAMES = {
    v: pb.DecisionReason.Name(v).removeprefix("DECISION_REASON_").lower() for v in pb.DecisionReason.values()
}


class BadInput(Exception):
    """A message that is refused: INVALID_ARGUMENT with this text, counted under `reason`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PackedHashes(Sequence[bytes]):
    """A view of concatenated fixed-length hashes; slices only the hashes a lookup probes."""

    __slots__ = ("_data", "_n", "_width")

    def __init__(self, data: bytes, width: int) -> None:
        self._data, self._width, self._n = data, width, len(data) // width

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        w = self._width
        return self._data[i * w : (i + 1) * w]


@dataclass(eq=False)
class _AgentSession:
    peer: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    spec: WorkerSpec | None = None
    in_snapshot: bool = False
    awaiting_resync: bool = False


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _check_hashes(hashes: Sequence[bytes], width: int, limit: int, where: str) -> None:
    if not hashes:
        raise BadInput("empty", f"{where}: no block hashes")
    if len(hashes) > limit:
        raise BadInput("too_many_hashes", f"{where}: {len(hashes)} block hashes exceed the limit of {limit}")
    lengths = set(map(len, hashes))
    if lengths != {width}:
        bad = sorted(lengths - {width})
        raise BadInput(
            "hash_length",
            f"{where}: block hashes must be {width} bytes (registered hash_length), got lengths {bad}",
        )


def _spec_from(reg: pb.WorkerRegistration) -> WorkerSpec:
    problems = []
    if not reg.worker_id or len(reg.worker_id) > MAX_ID_LENGTH:
        problems.append(f"worker_id must be 1-{MAX_ID_LENGTH} characters")
    if reg.role == pb.WORKER_ROLE_UNSPECIFIED:
        problems.append("role must be set (PREFILL, DECODE or BOTH)")
    if not reg.model:
        problems.append("model must be set")
    if reg.block_size == 0:
        problems.append("block_size must be > 0")
    if not reg.hash_algorithm:
        problems.append("hash_algorithm must be set (e.g. sha256_cbor)")
    if not 8 <= reg.hash_length <= 64:
        problems.append(f"hash_length must be 8..64 bytes, got {reg.hash_length}")
    if reg.epoch == 0:
        problems.append("epoch must be non-zero (new on every agent restart)")
    if reg.role in (pb.WORKER_ROLE_DECODE, pb.WORKER_ROLE_BOTH) and not reg.nixl_endpoint:
        problems.append("nixl_endpoint must be set for a decode worker (pullers connect to it)")
    if problems:
        raise BadInput("registration", "invalid registration: " + "; ".join(problems))
    p = reg.parallel
    return WorkerSpec(
        worker_id=reg.worker_id,
        role=reg.role,
        model=reg.model,
        engine_id=reg.engine_id,
        nixl_endpoint=reg.nixl_endpoint,
        block_size=reg.block_size,
        hash_algorithm=reg.hash_algorithm,
        hash_length=reg.hash_length,
        epoch=reg.epoch,
        kv_bytes_per_block=reg.kv_bytes_per_block,
        http_endpoint=reg.http_endpoint,
        parallel=(
            p.tensor_parallel_size or 1,
            p.pipeline_parallel_size or 1,
            p.data_parallel_size or 1,
            p.data_parallel_rank,
        ),
        labels=dict(reg.labels),
    )


def _registration(spec: WorkerSpec) -> pb.WorkerRegistration:
    tp, pp, dp, rank = spec.parallel
    return pb.WorkerRegistration(
        worker_id=spec.worker_id,
        role=spec.role,
        model=spec.model,
        engine_id=spec.engine_id,
        nixl_endpoint=spec.nixl_endpoint,
        block_size=spec.block_size,
        hash_algorithm=spec.hash_algorithm,
        hash_length=spec.hash_length,
        epoch=spec.epoch,
        kv_bytes_per_block=spec.kv_bytes_per_block,
        http_endpoint=spec.http_endpoint,
        labels=spec.labels,
        parallel=pb.ParallelLayout(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, data_parallel_rank=rank
        ),
    )


class DirectoryService(pb_grpc.DirectoryServicer):
    def __init__(
        self,
        store: DirectoryStore,
        cost: CostModel,
        *,
        heartbeat_interval_s: float,
        max_hashes: int,
        tokens: Sequence[TokenGrant] = (),
    ) -> None:
        self.store = store
        self.cost = cost
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_hashes = max_hashes
        self._tokens = {t.token: t for t in tokens}
        self._sessions: dict[str, _AgentSession] = {}
        self._watchers: set[asyncio.Queue] = set()
        self._started = time.monotonic()
        self.lookups = 0
        self.decisions: dict[str, int] = {}
        self.rejected = 0
        self.resyncs = 0
        self._evictions_reported = 0

    # ---- auth --------------------------------------------------------------------------------

    async def _authorize(
        self, context: grpc.aio.ServicerContext, rpc: str, *allowed: Role
    ) -> TokenGrant | None:
        if not self._tokens:
            return None
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = header.partition(" ")
        grant = self._tokens.get(token) if scheme.lower() == "bearer" else None
        if grant is None:
            self._reject(rpc, "unauthenticated")
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or unknown bearer token (metadata 'authorization: Bearer <token>')",
            )
        if grant.role is not Role.ADMIN and grant.role not in allowed:
            self._reject(rpc, "permission_denied")
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {grant.role.value!r} may not call {rpc} (needs {', '.join(a.value for a in allowed)})",
            )
        return grant

    def _reject(self, rpc: str, reason: str) -> None:
        self.rejected += 1
        metrics.REJECTED.labels(rpc, reason).inc()

    # ---- Connect -----------------------------------------------------------------------------

    async def Connect(
        self, request_iterator: AsyncIterator[pb.ConnectRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ConnectResponse]:
        grant = await self._authorize(context, "Connect", Role.AGENT)
        session = _AgentSession(peer=context.peer())
        reader = asyncio.create_task(self._read_agent(request_iterator, session, grant))
        try:
            while True:
                item = await session.outbox.get()
                if item is None:
                    break
                if isinstance(item, _Refused):
                    await context.abort(item.code, str(item))
                yield item
        finally:
            reader.cancel()
            if session.spec is not None:
                if self._sessions.get(session.spec.worker_id) is session:
                    del self._sessions[session.spec.worker_id]
                    self.store.disconnect(session.spec.worker_id, session.spec.epoch, time.monotonic())
                    metrics.CONNECTED_AGENTS.set(len(self._sessions))
                    self._publish(Change("disconnected", session.spec.worker_id, session.spec.model))
                    log.info("agent disconnected", worker_id=session.spec.worker_id, peer=session.peer)

    async def _read_agent(
        self, requests: AsyncIterator[pb.ConnectRequest], session: _AgentSession, grant: TokenGrant | None
    ) -> None:
        try:
            async for request in requests:
                self._handle_agent_message(request, session, grant)
            session.outbox.put_nowait(None)
        except BadInput as exc:
            self._reject("Connect", exc.reason)
            log.warning(
                "agent message refused",
                peer=session.peer,
                reason=exc.reason,
                error=str(exc),
                worker_id=session.spec.worker_id if session.spec else None,
            )
            session.outbox.put_nowait(_Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        except _Refused as exc:
            self._reject("Connect", exc.code.name.lower())
            log.warning("agent refused", peer=session.peer, code=exc.code.name, error=str(exc))
            session.outbox.put_nowait(exc)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must cost one stream, never the daemon
            log.exception("agent stream failed", peer=session.peer)
            session.outbox.put_nowait(
                _Refused(grpc.StatusCode.INTERNAL, "internal error handling agent stream")
            )

    def _handle_agent_message(
        self, request: pb.ConnectRequest, session: _AgentSession, grant: TokenGrant | None
    ) -> None:
        kind = request.WhichOneof("message")
        now = time.monotonic()
        if kind == "register":
            self._register(request.register, session, grant, now)
            return
        if session.spec is None:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"first message on Connect must be register, got {kind or 'an empty message'}",
            )
        if self._sessions.get(session.spec.worker_id) is not session:
            raise _Refused(
                grpc.StatusCode.ABORTED, "this stream was superseded by a newer one for the same worker"
            )
        worker_id = session.spec.worker_id
        if kind == "heartbeat":
            self.store.heartbeat(worker_id, now)
            session.outbox.put_nowait(
                pb.ConnectResponse(heartbeat=pb.HeartbeatAck(sent_at_us=request.heartbeat.sent_at_us))
            )
        elif kind == "batch":
            self._batch(request.batch, session, now)
        elif kind == "snapshot_begin":
            self.store.begin_snapshot(worker_id, now)
            session.in_snapshot = True
            self.resyncs += 1
            metrics.RESYNCS.labels("snapshot").inc()
            self._publish(Change("resync", worker_id, session.spec.model, 0, "snapshot started"))
        elif kind == "snapshot_end":
            if not session.in_snapshot:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "snapshot_end without snapshot_begin")
            self.store.end_snapshot(worker_id, request.snapshot_end.sequence, now)
            session.in_snapshot = session.awaiting_resync = False
            session.outbox.put_nowait(
                pb.ConnectResponse(ack=pb.BatchAck(sequence=request.snapshot_end.sequence))
            )
            self._publish(Change("resync", worker_id, session.spec.model, 0, "snapshot applied"))
            log.info("snapshot applied", worker_id=worker_id, sequence=request.snapshot_end.sequence)
        else:
            raise BadInput("empty", "ConnectRequest carries no message")

    def _register(
        self, reg: pb.WorkerRegistration, session: _AgentSession, grant: TokenGrant | None, now: float
    ) -> None:
        if session.spec is not None:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "this stream is already registered")
        spec = _spec_from(reg)
        if grant is not None and grant.worker_id and grant.worker_id != spec.worker_id:
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this token may only publish for worker {grant.worker_id!r}, not {spec.worker_id!r}",
            )
        try:
            last, resync = self.store.register(spec, reg.last_sequence, now)
        except DirectoryError as exc:
            raise _Refused(_STATUS[exc.code], str(exc)) from None
        session.spec = spec
        session.awaiting_resync = resync
        self._sessions[spec.worker_id] = session
        metrics.CONNECTED_AGENTS.set(len(self._sessions))
        if resync:
            self.resyncs += 1
            metrics.RESYNCS.labels("register").inc()
        session.outbox.put_nowait(
            pb.ConnectResponse(
                registered=pb.RegisterAck(
                    last_applied_sequence=last,
                    resync_required=resync,
                    heartbeat_interval_ms=int(self.heartbeat_interval_s * 1000),
                    lease_ms=int(self.store.config.lease_s * 1000),
                )
            )
        )
        self._publish(Change("registered", spec.worker_id, spec.model, 0, f"epoch {spec.epoch}"))
        log.info(
            "agent registered",
            worker_id=spec.worker_id,
            model=spec.model,
            epoch=spec.epoch,
            role=pb.WorkerRole.Name(spec.role),
            resync_required=resync,
            last_sequence=last,
            peer=session.peer,
        )

    def _batch(self, batch: pb.EventBatch, session: _AgentSession, now: float) -> None:
        spec = session.spec
        assert spec is not None
        if not session.in_snapshot:
            last = self.store.last_sequence(spec.worker_id)
            if session.awaiting_resync:
                metrics.BATCHES.labels("ignored_awaiting_resync").inc()
                return
            if batch.sequence <= last:
                metrics.BATCHES.labels("duplicate").inc()
                session.outbox.put_nowait(pb.ConnectResponse(ack=pb.BatchAck(sequence=last)))
                return
            if batch.sequence != last + 1:
                self.store.mark_resyncing(spec.worker_id)
                session.awaiting_resync = True
                self.resyncs += 1
                metrics.RESYNCS.labels("sequence_gap").inc()
                metrics.BATCHES.labels("gap").inc()
                log.warning(
                    "sequence gap, resync requested",
                    worker_id=spec.worker_id,
                    expected=last + 1,
                    received=batch.sequence,
                )
                session.outbox.put_nowait(
                    pb.ConnectResponse(
                        resync=pb.ResyncRequest(
                            reason=f"sequence gap: expected {last + 1}, received {batch.sequence}",
                            expected_sequence=last + 1,
                            received_sequence=batch.sequence,
                        )
                    )
                )
                return
        events = self._decode_events(batch, spec)
        self.store.apply(spec.worker_id, 0 if session.in_snapshot else batch.sequence, events, now)
        metrics.BATCHES.labels("applied").inc()
        if not session.in_snapshot:
            session.outbox.put_nowait(pb.ConnectResponse(ack=pb.BatchAck(sequence=batch.sequence)))
        if self._watchers:
            for event in events:
                self._publish(
                    Change(
                        type(event).__name__.lower(),
                        spec.worker_id,
                        spec.model,
                        len(getattr(event, "hashes", ())),
                    )
                )

    def _decode_events(self, batch: pb.EventBatch, spec: WorkerSpec) -> list[Event]:
        """Validate the whole batch before anything is applied: a bad batch changes nothing."""
        width, limit = spec.hash_length, self.max_hashes
        events: list[Event] = []
        telemetry = []
        counts: dict[str, int] = {}
        for position, event in enumerate(batch.events):
            kind = event.WhichOneof("event")
            where = f"batch {batch.sequence} event {position} ({kind})"
            if kind == "retained":
                r = event.retained
                hashes = list(r.block_hashes)
                _check_hashes(hashes, width, limit, where)
                groups = r.num_groups or 1
                if len(r.block_ids) != len(hashes) * groups:
                    raise BadInput(
                        "block_ids",
                        f"{where}: {len(r.block_ids)} block_ids for {len(hashes)} hashes x {groups} groups",
                    )
                if not r.retention_handle:
                    raise BadInput("handle", f"{where}: retention_handle must be set")
                if r.expires_in_ms == 0:
                    raise BadInput("expiry", f"{where}: expires_in_ms must be > 0")
                if r.tail_token_ids or r.tail_block_ids:
                    if not 0 < len(r.tail_token_ids) < spec.block_size:
                        raise BadInput(
                            "tail",
                            f"{where}: {len(r.tail_token_ids)} tail_token_ids; a partly filled "
                            f"block holds 1 to {spec.block_size - 1}",
                        )
                    if len(r.tail_block_ids) != groups:
                        raise BadInput(
                            "tail", f"{where}: {len(r.tail_block_ids)} tail_block_ids for {groups} groups"
                        )
                events.append(
                    Retained(
                        hashes,
                        list(r.block_ids),
                        groups,
                        r.retention_handle,
                        r.expires_in_ms,
                        r.single_use,
                        r.lora_name,
                        r.tier,
                        list(r.tail_token_ids),
                        list(r.tail_block_ids),
                    )
                )
            elif kind == "stored":
                hashes = list(event.stored.block_hashes)
                _check_hashes(hashes, width, limit, where)
                events.append(Stored(hashes, event.stored.lora_name, event.stored.tier))
            elif kind == "removed":
                hashes = list(event.removed.block_hashes)
                _check_hashes(hashes, width, limit, where)
                events.append(Removed(hashes, event.removed.lora_name))
            elif kind == "released":
                if not event.released.retention_handle:
                    raise BadInput("handle", f"{where}: retention_handle must be set")
                events.append(Released(event.released.retention_handle))
            elif kind == "cleared":
                events.append(Cleared())
            elif kind in ("transfer", "prefill"):
                telemetry.append(event)
            else:
                raise BadInput("empty", f"{where}: event carries nothing")
            counts[kind] = counts.get(kind, 0) + (
                1 if kind in ("transfer", "prefill", "released", "cleared") else len(events[-1].hashes)
            )
        for event in telemetry:
            self._telemetry(event, spec)
        for kind, n in counts.items():
            metrics.EVENTS_INGESTED.labels(kind).inc(n)
        return events

    def _telemetry(self, event: pb.BlockEvent, spec: WorkerSpec) -> None:
        if event.HasField("transfer"):
            t = event.transfer
            self.cost.record_transfer(
                spec.worker_id,
                t.source_worker_id,
                t.bytes,
                t.duration_us,
                t.setup_us,
                t.ok,
                spec.model,
                first_contact=t.first_contact,
            )
            metrics.TRANSFER_REPORTS.labels(str(t.ok).lower(), str(t.first_contact).lower()).inc()
        else:
            p = event.prefill
            self.cost.record_prefill(spec.worker_id, p.tokens, p.duration_us, spec.model)

    # ---- Lookup ------------------------------------------------------------------------------

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        if self._tokens:
            await self._authorize(context, "Lookup", Role.PREFILL, *(() if request.claim else (Role.READ,)))
        started = time.perf_counter()
        try:
            response = self._lookup(request)
        except BadInput as exc:
            self._reject("Lookup", exc.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except _Refused as exc:
            self._reject("Lookup", exc.code.name.lower())
            await context.abort(exc.code, str(exc))
        elapsed = time.perf_counter() - started
        response.lookup_us = int(elapsed * 1e6)
        metrics.LOOKUP_LATENCY.observe(elapsed)
        decision = _DECISION_NAMES[response.decision]
        reason = _REASON_NAMES[response.reason]
        metrics.DECISIONS.labels(decision, reason).inc()
        key = f"{decision}/{reason}"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.lookups += 1
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                {
                    "kvloop.model": request.model,
                    "kvloop.decision": decision,
                    "kvloop.reason": reason,
                    "kvloop.matched_blocks": response.matched_blocks,
                    "kvloop.matched_tokens": response.matched_tokens,
                    "kvloop.recompute_tokens": response.recompute_tokens,
                    "kvloop.holder": response.holder.worker_id,
                    "kvloop.requester": request.requester_worker_id,
                    "kvloop.lookup_us": response.lookup_us,
                }
            )
            if response.HasField("cost"):
                span.set_attributes(
                    {
                        "kvloop.estimated_transfer_ms": response.cost.transfer_ms,
                        "kvloop.estimated_recompute_ms": response.cost.recompute_ms,
                        "kvloop.detail": response.detail,
                    }
                )
        return response

    def _lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        if not request.model:
            raise BadInput("model", "model must be set")
        layout = self.store.model_spec(request.model)
        width = layout.hash_length if layout else 0
        block_size = layout.block_size if layout else request.block_size
        packed = request.packed_block_hashes  # read once: each access copies the bytes out of the message
        if packed and len(request.block_hashes):
            raise BadInput("hashes", "give block_hashes or packed_block_hashes, not both")
        if packed:
            if width and len(packed) % width:
                raise BadInput(
                    "hash_length",
                    f"packed_block_hashes is {len(packed)} bytes, "
                    f"not a multiple of the model's hash_length {width}",
                )
            hashes: Sequence[bytes] = PackedHashes(packed, width or 32)
            if len(hashes) > self.max_hashes:
                raise BadInput(
                    "too_many_hashes", f"{len(hashes)} block hashes exceed the limit of {self.max_hashes}"
                )
        else:
            hashes = list(request.block_hashes)
            if hashes and width:
                _check_hashes(hashes, width, self.max_hashes, "Lookup")
        if request.block_size and block_size and request.block_size != block_size:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model {request.model!r} uses block_size {block_size}; the lookup hashed with "
                f"{request.block_size}: the hashes cannot match",
            )
        n = len(hashes)
        if request.local_blocks > n:
            raise BadInput(
                "local_blocks", f"local_blocks {request.local_blocks} exceeds the {n} hashes given"
            )
        now = time.monotonic()
        match = self.store.lookup(
            Namespace(request.model, request.lora_name),
            hashes,
            request.local_blocks,
            request.requester_worker_id,
            now,
            claim=False,
        )
        verdict = self.cost.decide(
            request.model, match, n, request.local_blocks, block_size or 0, request.requester_worker_id
        )
        if (
            verdict.decision == pb.DECISION_TRANSFER
            and request.claim
            and match.best
            and match.best.single_use
        ):
            # Claim only what is actually handed out; re-run the lookup with claim (no await in between).
            match = self.store.lookup(
                Namespace(request.model, request.lora_name),
                hashes,
                request.local_blocks,
                request.requester_worker_id,
                now,
                claim=True,
            )
        response = pb.LookupResponse(decision=verdict.decision, reason=verdict.reason, detail=verdict.detail)
        if verdict.cost is not None:
            response.cost.CopyFrom(verdict.cost)
        if match.best is not None:
            _fill_holder(response.holder, match.best, request.pack_block_ids)
            for other in match.others:
                _fill_holder(response.other_holders.add(), other, request.pack_block_ids)
        matched = match.best.matched_blocks if match.best and verdict.decision == pb.DECISION_TRANSFER else 0
        have = max(matched, request.local_blocks)
        response.matched_blocks = matched
        response.matched_tokens = matched * (block_size or 0)
        response.recompute_tokens = (n - have) * (block_size or 0)
        return response

    # ---- introspection -----------------------------------------------------------------------

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        await self._authorize(context, "ListWorkers", Role.READ, Role.PREFILL)
        response = pb.ListWorkersResponse()
        for view in self.store.workers(time.monotonic(), request.model):
            response.workers.add(
                registration=_registration(view.spec),
                lease_state=int(view.state),
                connected=view.connected,
                last_applied_sequence=view.last_applied_sequence,
                stored_blocks=view.stored_blocks,
                retained_blocks=view.retained_blocks,
                retained_runs=view.retained_runs,
                last_seen_ms_ago=int(view.last_seen_s_ago * 1000),
                events_ingested=view.events_ingested,
                resyncs=view.resyncs,
                prefill_tokens_per_second=self.cost.prefill_tokens_per_s(view.spec.worker_id),
            )
        return response

    async def FindBlock(
        self, request: pb.FindBlockRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindBlockResponse:
        await self._authorize(context, "FindBlock", Role.READ, Role.PREFILL)
        if not request.model or not request.block_hash:
            self._reject("FindBlock", "missing_field")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model and block_hash must be set")
        response = pb.FindBlockResponse()
        for loc in self.store.find(
            Namespace(request.model, request.lora_name), request.block_hash, time.monotonic()
        ):
            response.locations.add(
                worker_id=loc.worker_id,
                kind=loc.kind,
                position=loc.position,
                block_ids=loc.block_ids,
                retention_handle=loc.handle,
                expires_in_ms=loc.expires_in_ms,
                servable=loc.servable,
                tier=loc.tier,
            )
        return response

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        await self._authorize(context, "GetStats", Role.READ, Role.PREFILL)
        return pb.GetStatsResponse(
            workers=len(self.store.workers(time.monotonic())),
            entries=self.store.entry_count(),
            retained_runs=self.store.retained_run_count(),
            events_ingested=self.store.events_ingested,
            lookups=self.lookups,
            decisions=self.decisions,
            resyncs=self.resyncs,
            evictions=self.store.evictions,
            rejected_messages=self.rejected,
            max_entries=self.store.config.max_entries,
            uptime_seconds=time.monotonic() - self._started,
            models=self.store.models(),
        )

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        await self._authorize(context, "Watch", Role.READ)
        queue: asyncio.Queue = asyncio.Queue(maxsize=10_000)
        self._watchers.add(queue)
        try:
            while True:
                change: Change = await queue.get()
                if request.model and change.model != request.model:
                    continue
                yield pb.WatchResponse(
                    kind=change.kind,
                    worker_id=change.worker_id,
                    model=change.model,
                    blocks=change.blocks,
                    detail=change.detail,
                    time_unix_us=int(time.time() * 1e6),
                )
        finally:
            self._watchers.discard(queue)

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainWorkerResponse:
        await self._authorize(context, "DrainWorker")
        if not self.store.set_draining(request.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {request.worker_id!r}")
        session = self._sessions.get(request.worker_id)
        if session is not None:
            session.outbox.put_nowait(
                pb.ConnectResponse(drain=pb.DrainRequest(reason=request.reason or "drained by admin"))
            )
        spec = self.store.worker_spec(request.worker_id)
        self._publish(Change("drain", request.worker_id, spec.model if spec else "", 0, request.reason))
        log.info(
            "worker draining",
            worker_id=request.worker_id,
            reason=request.reason,
            delivered=session is not None,
        )
        return pb.DrainWorkerResponse(delivered=session is not None)

    # ---- maintenance -------------------------------------------------------------------------

    def _publish(self, change: Change) -> None:
        for queue in self._watchers:
            if queue.full():
                queue.get_nowait()  # a slow watcher loses its oldest change, never blocks ingest
            queue.put_nowait(change)

    def reap(self) -> None:
        for change in self.store.reap(time.monotonic()):
            if change.kind == "expired":
                metrics.EXPIRED_RUNS.inc()
            else:
                log.info(
                    "directory change", kind=change.kind, worker_id=change.worker_id, detail=change.detail
                )
            self._publish(change)
        metrics.ENTRIES.set(self.store.entry_count())
        metrics.EVICTIONS.inc(self.store.evictions - self._evictions_reported)
        self._evictions_reported = self.store.evictions
        states: dict[str, int] = {s.name.lower(): 0 for s in LeaseState}
        for view in self.store.workers(time.monotonic()):
            states[view.state.name.lower()] += 1
        for state, count in states.items():
            metrics.WORKERS.labels(state).set(count)

    def close_streams(self) -> None:
        for session in list(self._sessions.values()):
            session.outbox.put_nowait(
                pb.ConnectResponse(drain=pb.DrainRequest(reason="daemon shutting down"))
            )
            session.outbox.put_nowait(None)


def _fill_holder(message: pb.Holder, holding: Holding, packed: bool) -> None:
    spec = holding.worker
    message.worker_id = spec.worker_id
    message.engine_id = spec.engine_id
    message.nixl_endpoint = spec.nixl_endpoint
    message.http_endpoint = spec.http_endpoint
    message.matched_blocks = holding.matched_blocks
    message.retention_handle = holding.handle
    message.expires_in_ms = holding.expires_in_ms
    if packed:
        ids = array("I", holding.block_ids)
        if sys.byteorder != "little":
            ids.byteswap()
        message.packed_block_ids = ids.tobytes()
    else:
        message.block_ids.extend(holding.block_ids)
    message.num_groups = holding.num_groups
    message.single_use = holding.single_use
    if holding.tail_token_ids:
        message.tail_token_ids.extend(holding.tail_token_ids)
        message.tail_block_ids.extend(holding.tail_block_ids)
    message.kv_bytes_per_block = spec.kv_bytes_per_block
    message.epoch = spec.epoch
