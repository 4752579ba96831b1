"""The kvloop.v1.Directory gRPC service: each RPC's handler, on top of the store and the policy.

Authentication and per-role authorization run before any handler (:mod:`.auth`); the Connect
stream's state machine is :mod:`.session`; proto <-> domain conversion and input validation are
:mod:`.convert`; the path decision is ``Policy.answer`` (:mod:`.policy`); counters are
:mod:`.metrics`. Every handler runs on one asyncio loop and never awaits between reading and
changing the index inside one store call, and the store makes each call atomic (a single-use claim
cannot be handed out twice, on one replica or several).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog
from opentelemetry import trace

from kvloop.common.block_hash import BlockHasher
from kvloop.common.block_keys import KEY_BYTES
from kvloop.common.security import Role
from kvloop.common.version import VERSION
from kvloop.daemon import convert, metrics
from kvloop.daemon.auth import current_grant
from kvloop.daemon.convert import BadInput, Refused
from kvloop.daemon.index import Change, DirectoryStore, LeaseState, Namespace
from kvloop.daemon.index.store import entry_bound
from kvloop.daemon.metrics import DaemonCounters
from kvloop.daemon.plans import PlanBoard
from kvloop.daemon.policy import Policy
from kvloop.daemon.roster import WorkerRoster
from kvloop.daemon.session import AgentSession, SessionContext
from kvloop.daemon.spans import annotate_lookup
from kvloop.daemon.watch import ChangeFeed
from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pb_grpc

log = structlog.get_logger("kvloop.daemon")


_CLAIMERS = (Role.PREFILL, Role.ADMIN)


class DirectoryService(pb_grpc.DirectoryServicer):
    def __init__(
        self,
        store: DirectoryStore,
        policy: Policy,
        *,
        heartbeat_interval_s: float,
        max_hashes: int,
        route_hash_cache_blocks: int = 1 << 16,
        counters: DaemonCounters | None = None,
        changes: ChangeFeed | None = None,
        plans: PlanBoard | None = None,
        traced: bool = True,
    ) -> None:
        self.store = store
        self._read_window_ms = int(store.config.read_window_s * 1000)
        # False when this process exports no spans: no request span is ever recorded, so the
        # handlers skip asking for the current one (a context-variable walk per call)
        self.traced = traced
        self.policy = policy
        self.max_hashes = max_hashes
        # Route's token ids are mostly a conversation's history again: its block hashes are remembered.
        self.hasher = BlockHasher(route_hash_cache_blocks)
        self.counters = counters or DaemonCounters()
        self.changes = changes or ChangeFeed()
        self.roster = WorkerRoster(store)
        self.plans = plans or PlanBoard()
        self.sessions = SessionContext(
            store, policy.cost, self.counters, self.changes, heartbeat_interval_s, max_hashes, self.roster
        )
        self._started = time.monotonic()
        self.changes.on_remote = self._remote_change

    async def _refuse(self, context: grpc.aio.ServicerContext, rpc: str, exc: Exception) -> None:
        if isinstance(exc, BadInput):
            self.counters.rejected_message(rpc, exc.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        assert isinstance(exc, Refused)
        self.counters.rejected_message(rpc, exc.code.name.lower())
        await context.abort(exc.code, str(exc))

    # ---- Connect -----------------------------------------------------------------------------

    async def Connect(
        self, request_iterator: AsyncIterator[pb.ConnectRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ConnectResponse]:
        session = AgentSession(self.sessions, peer=context.peer(), grant=current_grant())
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while True:
                item = await session.outbox.get()
                if item is None:
                    break
                if isinstance(item, Refused):
                    await context.abort(item.code, str(item))
                yield item
        finally:
            reader.cancel()
            await session.closed()

    # ---- Lookup ------------------------------------------------------------------------------

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        if request.claim and (grant := current_grant()) is not None and grant.role not in _CLAIMERS:
            self.counters.rejected_message("Lookup", "permission_denied")
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {grant.role.value!r} may not claim retained runs (claim needs prefill)",
            )
        started = time.perf_counter()
        model_spec = await self.store.model_spec(request.model) if request.model else None
        try:
            query = convert.lookup_query(request, model_spec, self.max_hashes)
        except (BadInput, Refused) as exc:
            await self._refuse(context, "Lookup", exc)
        answer = await self.policy.answer(self.store, query, self.store.clock())
        response = convert.lookup_response(
            answer, query.block_size, request.pack_block_ids, self._read_window_ms
        )
        if not self.store.in_process:  # 0 in one process: left unset
            response.directory_epoch = self.store.epoch  # read after the lookup: it may have moved it
        elapsed = time.perf_counter() - started
        response.lookup_us = int(elapsed * 1e6)
        self.counters.lookup(elapsed, answer.decision, answer.reason)
        if self.traced:
            annotate_lookup(trace.get_current_span(), request, response)
        return response

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        started = time.perf_counter()
        now = self.store.clock()
        model_spec = await self.store.model_spec(request.model) if request.model else None
        workers = await self.roster.workers(request.model) if request.model else []
        try:
            query = convert.route_query(request, model_spec, workers, self.max_hashes, self.hasher)
        except (BadInput, Refused) as exc:
            await self._refuse(context, "Route", exc)
        ranked = await self.policy.route(self.store, query, now)
        # Posted after the answer is on its way: the plan has the router's whole hop to the prefill
        # (and the engine's to its scheduler) to arrive in, and is not the router's wait.
        asyncio.get_running_loop().call_soon(
            self.plans.post_ranked,
            query.hashes,
            query.block_size,
            ranked,
            request.continuation,
            self.store.epoch,
            self._read_window_ms,
        )
        tied = self.policy.tied(request.model, ranked)
        response = convert.route_response(query, ranked, tied)
        response.tie_floor_ms, response.tie_ratio = self.policy.tie_rule(request.model)
        elapsed = time.perf_counter() - started
        response.route_us = int(elapsed * 1e6)
        self.counters.route(elapsed, tied > 1)
        best = response.ranked[0]
        span = trace.get_current_span() if self.traced else trace.INVALID_SPAN
        if span.is_recording():
            span.set_attributes(
                {
                    "kvloop.model": request.model,
                    "kvloop.route.candidates": len(response.ranked),
                    "kvloop.route.best": best.worker_id,
                    "kvloop.route.tied": tied,
                    "kvloop.route.prompt_blocks": response.prompt_blocks,
                    "kvloop.route.local_blocks": best.local_blocks,
                    "kvloop.route.pull_blocks": best.pull_blocks,
                    "kvloop.route.expected_ttft_ms": best.expected_ttft_ms,
                    "kvloop.route.continuation": request.continuation,
                    "kvloop.route_us": response.route_us,
                }
            )
        log.debug(
            "route",
            model=request.model,
            best=best.worker_id,
            tied=tied,
            ranked=[(s.worker_id, round(s.expected_ttft_ms, 3)) for s in response.ranked],
        )
        return response

    async def ReleaseClaim(
        self, request: pb.ReleaseClaimRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseClaimResponse:
        if not (request.model and request.holder_worker_id and request.retention_handle):
            self.counters.rejected_message("ReleaseClaim", "missing_field")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "model, holder_worker_id and retention_handle must be set"
            )
        epoch = self.store.epoch
        if request.directory_epoch and request.directory_epoch < epoch:
            # Claimed in the store a failover replaced: the claim went with it, and the run, if the
            # holder re-pushes it, is a new one this puller never held.
            self.counters.rejected_message("ReleaseClaim", "stale_epoch")
            log.info(
                "stale claim not released",
                holder=request.holder_worker_id,
                handle=request.retention_handle,
                claim_epoch=request.directory_epoch,
                directory_epoch=epoch,
            )
            return pb.ReleaseClaimResponse(released=False, directory_epoch=epoch)
        released = await self.store.release_claim(
            Namespace(request.model, request.lora_name),
            request.holder_worker_id,
            request.retention_handle,
            request.requester_worker_id,
        )
        if released:
            self.counters.claim_released()
            log.info(
                "claim released",
                holder=request.holder_worker_id,
                handle=request.retention_handle,
                requester=request.requester_worker_id,
            )
        return pb.ReleaseClaimResponse(released=released, directory_epoch=epoch)

    # ---- introspection -----------------------------------------------------------------------

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        cost = self.policy.cost
        return pb.ListWorkersResponse(
            workers=[
                convert.worker_info(view, cost.prefill_tokens_per_s(view.spec.worker_id))
                for view in await self.store.workers(self.store.clock(), request.model)
            ]
        )

    async def ListPairs(
        self, request: pb.ListPairsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPairsResponse:
        keep = None
        if request.model:
            keep = {w.spec.worker_id for w in await self.store.workers(self.store.clock(), request.model)}
        return convert.pairs_response(self.policy.pairs(), keep)

    async def FindBlock(
        self, request: pb.FindBlockRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindBlockResponse:
        if not request.model or not request.block_hash:
            self.counters.rejected_message("FindBlock", "missing_field")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model and block_hash must be set")
        namespace = Namespace(request.model, request.lora_name)
        if len(request.block_hash) < KEY_BYTES:
            self.counters.rejected_message("FindBlock", "hash_length")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_hash is {len(request.block_hash)} bytes; a block hash has at least {KEY_BYTES}",
            )
        found = await self.store.find(namespace, request.block_hash[:KEY_BYTES], self.store.clock())
        return pb.FindBlockResponse(
            locations=[convert.block_location(loc) for loc in found], read_window_ms=self._read_window_ms
        )

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        counters = self.counters
        counts = await self.store.counts()
        workers = await self.store.workers(self.store.clock())
        agent_versions: dict[str, int] = {}
        for worker in workers:
            agent_versions[worker.spec.agent_version] = agent_versions.get(worker.spec.agent_version, 0) + 1
        return pb.GetStatsResponse(
            workers=len(workers),
            entries=counts.entries,
            retained_runs=counts.retained_runs,
            events_ingested=counts.events_ingested,
            lookups=counters.lookups,
            decisions=counters.decisions,
            resyncs=counters.resyncs,
            evictions=counts.evictions,
            rejected_messages=counters.rejected,
            max_entries=entry_bound(self.store),
            uptime_seconds=time.monotonic() - self._started,
            models=await self.store.models(),
            version=VERSION,
            agent_versions=agent_versions,
        )

    async def Plans(
        self, request: pb.PlansRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PlansResponse]:
        if not request.worker_id:
            self.counters.rejected_message("Plans", "worker_id")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id must be set")
        with self.plans.subscription(request.worker_id) as queue:
            # Headers once subscribed: a subscriber that waits for them misses no plan made after.
            await context.send_initial_metadata(())
            while (plan := await queue.get()) is not None:
                yield plan

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        async for change in self.changes.subscribe():
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

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainWorkerResponse:
        if not await self.store.set_draining(request.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {request.worker_id!r}")
        self.roster.invalidate()
        session = self.sessions.live.get(request.worker_id)
        if session is not None:
            session.send(
                pb.ConnectResponse(drain=pb.DrainRequest(reason=request.reason or "drained by admin"))
            )
        spec = await self.store.worker_spec(request.worker_id)
        self.changes.publish(
            Change("drain", request.worker_id, spec.model if spec else "", 0, request.reason)
        )
        log.info(
            "worker draining",
            worker_id=request.worker_id,
            reason=request.reason,
            delivered=session is not None,
        )
        return pb.DrainWorkerResponse(delivered=session is not None)

    def _remote_change(self, change: Change) -> None:
        """Another replica drained a worker whose agent streams to this one: tell the agent."""
        if change.kind == "failover":
            self._resync_all(change.detail)
        session = self.sessions.live.get(change.worker_id) if change.kind == "drain" else None
        if session is not None:
            session.send(
                pb.ConnectResponse(drain=pb.DrainRequest(reason=change.detail or "drained by admin"))
            )

    def _resync_all(self, reason: str) -> None:
        self.roster.invalidate()
        for session in list(self.sessions.live.values()):
            session.resync_after_failover(reason)

    # ---- maintenance -------------------------------------------------------------------------

    async def reap(self) -> None:
        for change in await self.store.reap(self.store.clock()):
            if change.kind == "dropped":
                self.policy.cost.forget_worker(change.worker_id)
            if change.kind == "expired":
                metrics.EXPIRED_RUNS.inc()
            elif change.kind in ("failover", "primary_moved"):
                log.warning("directory store failed over", detail=change.detail)
                self._resync_all(change.detail)
            else:
                log.info(
                    "directory change", kind=change.kind, worker_id=change.worker_id, detail=change.detail
                )
            self.changes.publish(change)
        counts = await self.store.counts()
        metrics.ENTRIES.set(counts.entries)
        self.counters.evictions(counts.evictions)
        states: dict[str, int] = {s.name.lower(): 0 for s in LeaseState}
        for view in await self.store.workers(self.store.clock()):
            states[view.state.name.lower()] += 1
        for state, count in states.items():
            metrics.WORKERS.labels(state).set(count)

    def close_streams(self) -> None:
        self.plans.close()
        for session in list(self.sessions.live.values()):
            session.send(pb.ConnectResponse(drain=pb.DrainRequest(reason="daemon shutting down")))
            session.outbox.put_nowait(None)
