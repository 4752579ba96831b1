"""Scheduler-side half of the kvloop connector (runs in vLLM's engine-core process).

vLLM calls the hooks below; each hands the work to the role it belongs to: :class:`PrefillSide`
(look up, pull or recompute, record the outcome) or :class:`DecodeSide` (announce and release
retained runs). Only public KV-connector hooks are overridden here; the overrides of vLLM's
private methods are in :mod:`.worker` (NIXL worker) and :mod:`.idle` (the engine loop's idle wait,
installed from here: this half is built in the engine-core process before its loop starts).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, TypeGuard

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.request import RequestStatus

from kvloop.agents.connector import compat, idle
from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.decode import DecodeSide
from kvloop.agents.connector.digest_gate import DigestGate
from kvloop.agents.connector.directory import DirectoryLookups, PullerConstraints
from kvloop.agents.connector.host.pool import pool_slots
from kvloop.agents.connector.host.tier import HostTier
from kvloop.agents.connector.metadata import (
    KvloopConnectorMetadata,
    KvloopHandshakePayload,
    KvloopWorkerMetadata,
    RankTally,
)
from kvloop.agents.connector.plans import PlanInbox
from kvloop.agents.connector.prefill import PrefillSide
from kvloop.agents.connector.yielding import ReleaseConfirmer
from kvloop.common.host_names import host_engine_id
from kvloop.common.tracing import configure_tracing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def kv_bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one logical block occupies over all layers of all KV-cache groups on this worker."""
    return sum(group_bytes_per_block(kv_cache_config))


def group_windows(kv_cache_config: KVCacheConfig) -> list[int]:
    """Each KV-cache group's sliding window in tokens (0: full attention), in vLLM's group order."""
    return [
        int(getattr(g.kv_cache_spec, "sliding_window", None) or 0) for g in kv_cache_config.transfer_groups
    ]


def group_bytes_per_block(kv_cache_config: KVCacheConfig) -> list[int]:
    """Bytes one block of each KV-cache group occupies over the group's layers on this worker."""
    return [g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.transfer_groups]


def kv_dtype_name(kv_cache_config: KVCacheConfig) -> str:
    """The KV cache's element type as kvloop names it ("bfloat16", "float32", ...)."""
    groups = kv_cache_config.kv_cache_groups
    dtype = getattr(groups[0].kv_cache_spec, "dtype", None) if groups else None
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


# kv_transfer_params key a decode request may set to False: its blocks are freed when it finishes
# instead of being retained for reverse pulls (a conversation's last turn; `kvloop bench decode-tpot`
# compares the same decode retaining and not).
RETAIN_PARAM = "kvloop_retain"


def is_decode_side(params: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """A decode-side request (its KV came from a prefill, or none) whose KV is in place: one vLLM's
    NixlConnector retains when it finishes, with bidirectional transfer on."""
    if not params:
        return False
    # still loading (do_remote_prefill): vLLM's own cleanup must run
    return not params.get("do_remote_decode") and not params.get("do_remote_prefill")


def declines_retention(params: dict[str, Any] | None) -> bool:
    """A decode-side request that asked not to be retained."""
    return is_decode_side(params) and params.get(RETAIN_PARAM) is False


class KvloopConnectorScheduler(NixlPullConnectorScheduler):
    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig, cfg: KvloopConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # Spans leave this (engine-core) process over OTLP (OTEL_* env) or to KVLOOP_SPAN_FILE.
        traced = configure_tracing(os.environ.get("OTEL_SERVICE_NAME", f"vllm-{engine_id}"))
        self.cfg = cfg
        self.worker_id = cfg.worker_id or engine_id
        if cfg.retention_ttl_s is not None:
            self.decoder_kv_blocks_ttl = cfg.retention_ttl_s
        self._events: list[Any] = []
        self._host_listener: threading.Thread | None = None
        # every worker rank copies its share of each run into its own pool (host/pool.py)
        self._host_reports = RankTally(vllm_config.parallel_config.world_size)
        # retained runs are announced with their blocks' digests, which every worker rank reports
        self.digests = (
            DigestGate(self._events.append, vllm_config.parallel_config.world_size)
            if cfg.digests and self.is_bidirectional_kv_xfer_enabled
            else None
        )
        self._init_decode(kv_cache_config)
        if cfg.idle_wait and self.is_bidirectional_kv_xfer_enabled:
            idle.install()
        self.prefill: PrefillSide | None = None
        kv_bytes = kv_bytes_per_block(kv_cache_config)
        if cfg.daemon and cfg.lookup and self.is_bidirectional_kv_xfer_enabled:
            self.prefill = self._prefill_side(kv_cache_config, kv_bytes, traced)
        tm.log.info(
            "kvloop.scheduler_init",
            engine_id=engine_id,
            worker_id=self.worker_id,
            nixl_endpoint=f"{self.side_channel_host}:{self.side_channel_port}",
            kv_bytes_per_block=kv_bytes,
            block_size=self.block_size,
            bidirectional=self.is_bidirectional_kv_xfer_enabled,
            retention_ttl_s=self.decoder_kv_blocks_ttl,
            sharing=cfg.sharing,
            lookups=self.prefill is not None,
        )

    def _init_decode(self, kv_cache_config: KVCacheConfig) -> None:
        """The decode role, with its host-memory tier and release confirmations where they apply."""
        cfg = self.cfg
        host_slots = pool_slots(kv_cache_config, cfg.host_retention_gib)
        confirmer = (
            ReleaseConfirmer(cfg.daemon, cfg.model, self.worker_id, cfg.read_margin_s)
            if cfg.daemon
            and cfg.model
            and (cfg.retention_yield or host_slots)
            and self.is_bidirectional_kv_xfer_enabled
            else None
        )
        host = (
            HostTier(
                host_slots,
                cfg.host_retention_ttl_s,
                cfg.read_margin_s,
                self._events.append,
                confirmer,
                cfg.host_eviction,
                ranks=self._host_reports.ranks,
            )
            if host_slots and self.is_bidirectional_kv_xfer_enabled
            else None
        )
        self.decode = DecodeSide(
            cfg,
            self.block_size,
            self.digests.emit if self.digests is not None else self._events.append,
            kv_cache_config.num_blocks,
            confirmer,
            host,
            group_windows(kv_cache_config),
            generation=lambda: compat.registration_generation(self),
        )

    def _prefill_side(self, kv_cache_config: KVCacheConfig, kv_bytes: int, traced: bool) -> PrefillSide:
        """The prefill role: directory lookups and, if enabled, the daemon's route plans."""
        cfg = self.cfg
        constraints = PullerConstraints(
            model=cfg.model,
            requester=self.worker_id,
            block_size=self.block_size,
            # vLLM's own threshold is part of the one decision: the daemon applies the largest.
            min_pull_tokens=max(cfg.min_pull_tokens, self.kv_recompute_threshold),
            lease_margin_ms=int(cfg.expiry_margin_s * 1000),
            tensor_parallel_size=self.transfer_tp_size,
            kv_dtype=kv_dtype_name(kv_cache_config),
            kv_bytes_per_block=kv_bytes,
            kv_group_windows=tuple(group_windows(kv_cache_config)),
        )
        directory = DirectoryLookups(
            cfg.daemon,
            constraints,
            timeout_ms=cfg.lookup_timeout_ms,
            backoff_s=cfg.lookup_backoff_s,
            traced=traced,
        )
        plans = (
            PlanInbox(
                cfg.daemon,
                self.worker_id,
                block_size=self.block_size,
                min_pull_tokens=constraints.min_pull_tokens,
                lease_margin_ms=constraints.lease_margin_ms,
                epoch=lambda: directory.epoch,
            ).start()
            if cfg.route_plans
            else None
        )
        return PrefillSide(
            cfg,
            directory,
            self.block_size,
            kv_bytes,
            self.transfer_tp_size,
            self._events.append,
            group_windows(kv_cache_config),
            group_bytes_per_block(kv_cache_config),
            plans,
        )

    def get_num_new_matched_tokens(  # type: ignore[override]
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # None asks vLLM to call again next step (allowed by the KV-connector API; the NIXL base
        # class never uses it, hence the override's wider type).
        if self.prefill is None or not self.prefill.wants(request.kv_transfer_params):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        return self.prefill.match(request, num_computed_tokens, super().get_num_new_matched_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.prefill is not None:
            self.prefill.allocated(request.request_id, num_external_tokens)
        params = request.kv_transfer_params
        if num_external_tokens > 0 and params and params.get("do_remote_prefill"):
            # a decode request whose prompt KV its prefill sends: its window, for the host tier
            self.decode.capture_window(request.request_id, blocks.get_block_ids(), request.num_prompt_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        try:
            return self._request_finished(request, block_ids)
        finally:
            self.decode.forget_window(request.request_id)

    def _request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if declines_retention(request.kv_transfer_params):
            tm.RETENTION_DECLINED.labels("asked").inc()
            return self._free_at_once(request)
        outcome = self.prefill.finished(request) if self.prefill is not None else None
        if self._would_retain(request, block_ids) and not self.decode.admits(block_ids, request.request_id):
            return self._free_at_once(request)
        delay, out = super().request_finished(request, block_ids)
        if outcome is not None and out is not None:
            out.update(outcome)  # what this prefill did, for the caller: kvloop_path, ...
        if (
            delay
            and out is not None
            and out.get("do_remote_decode")
            and self.is_bidirectional_kv_xfer_enabled
        ):
            # this engine holds the finished request's blocks for a reverse pull
            self.decode.announce(request, out, self.decoder_kv_blocks_ttl, block_ids)
        return delay, out

    def _would_retain(self, request: Request, block_ids: Any) -> bool:
        """Whether vLLM's NixlConnector will keep this finished request's blocks for a reverse pull
        (the conditions of its ``request_finished``, for a decode-side request)."""
        return (
            self.is_bidirectional_kv_xfer_enabled
            and is_decode_side(request.kv_transfer_params)
            and request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            and any(len(g) > 0 for g in block_ids)
        )

    def _free_at_once(self, request: Request) -> tuple[bool, None]:
        # vLLM's own path for a decode that does not retain (bidirectional off)
        self._stop_heartbeat(request.request_id)
        return False, None

    def parked_until(self, request_id: str) -> float | None:
        """For the engine loop's idle wait (idle.py): until when the finished request
        ``request_id``, whose blocks this connector holds, needs no engine step (none while its
        announcement waits for the worker's digests, made at an engine step)."""
        if self.digests is not None and self.digests.holds(request_id):
            return None
        return self.decode.parked_until(request_id)

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        """vLLM's side channel serves the engine's own metadata; the host pool's, when there is one,
        is served the same way on ``kvloop_host_side_channel_port``."""
        own = {rank: m for rank, m in metadata.items()}
        host: dict[tuple[int, int], bytes] = {}
        encoder = msgspec.msgpack.Encoder()
        for rank, m in metadata.items():
            if isinstance(m, KvloopHandshakePayload):
                own[rank] = NixlHandshakePayload(m.compatibility_hash, m.agent_metadata_bytes)
                if m.host is not None:
                    host[rank] = encoder.encode(m.host)
        super().set_xfer_handshake_metadata(own)
        if host and self._host_listener is None:
            ready = threading.Event()
            listener = threading.Thread(
                target=self._nixl_handshake_listener,
                args=(host, ready, self._stop_event, self.side_channel_host, self.cfg.host_side_channel_port),
                daemon=True,
                name="kvloop_host_pool_handshake_listener",
            )
            listener.start()
            ready.wait()
            self._host_listener = listener
            tm.log.info(
                "kvloop.host_pool_serving",
                engine_id=host_engine_id(self.engine_id),
                nixl_endpoint=f"{self.side_channel_host}:{self.cfg.host_side_channel_port}",
            )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        meta = connector_output.kv_connector_worker_meta
        ours = meta if isinstance(meta, KvloopWorkerMetadata) else KvloopWorkerMetadata()
        if ours.host_digests:
            self.decode.host_digested(ours.host_digests)
        if ours.host_copied:
            self.decode.host_copied(self._host_reports.add(ours))
        if ours.digests and self.digests is not None:
            self.digests.digested(ours.digests)
        if self.prefill is not None:
            self.prefill.reads_done(
                set(connector_output.finished_recving or ()),
                set(connector_output.failed_recving or ()),
                ours.reads,
                ours.verified,
            )
        self.decode.released(set(connector_output.finished_sending or ()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvloopConnectorMetadata:
        base = super().build_connector_meta(scheduler_output)
        deadlines: dict[str, float] = {}
        holder_epochs: dict[str, int] = {}
        if self.prefill is not None:
            deadlines, holder_epochs = self.prefill.take_pulls()
            self.prefill.step(
                scheduler_output.num_scheduled_tokens, scheduler_output.total_num_scheduled_tokens
            )
        self.decode.check_generation()
        multi, self.decode.multi_reader_new = self.decode.multi_reader_new, set()
        meta = KvloopConnectorMetadata.extend(
            base, multi, deadlines, holder_epochs, self.decode.take_free_early()
        )
        meta.host_copies = self.decode.take_host_copies()
        meta.host_captures = self.decode.take_host_captures()
        if self.digests is not None:
            meta.digest_runs = self.digests.take_asks()
        if self.prefill is not None:
            meta.pull_checks = self.prefill.take_checks()
        return meta

    def reset_cache(self) -> None:
        """vLLM resets the connector's cache (a sleep's pause, or a reset asked for): see
        :meth:`DecodeSide.cache_reset`."""
        self.decode.cache_reset()

    def take_events(self) -> list[Any]:
        events = self._events[:]
        self._events.clear()
        return events

    def shutdown(self) -> None:
        super().shutdown()
        self.decode.shutdown()
        if self.prefill is not None:
            self.prefill.shutdown()
