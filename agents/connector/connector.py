"""``KvloopConnector``: vLLM's NixlConnector (pull mode, reverse transfers) plus kvloop.

Load it with::

    kv_transfer_config = {
        "kv_connector": "KvloopConnector",
        "kv_connector_module_path": "kvloop.agents.connector.connector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "kvloop_daemon": "127.0.0.1:50051",
            ...
        },
    }

The scheduler-side logic lives in :mod:`.scheduler`, the worker-side logic in :mod:`.worker`;
this facade only picks them (vLLM instantiates one connector per role).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.metadata import KvloopHandshakePayload
from kvloop.agents.connector.scheduler import KvloopConnectorScheduler
from kvloop.agents.connector.stats import KvloopKVConnectorStats, KvloopPromMetrics, collect
from kvloop.agents.connector.worker import KvloopConnectorWorker
from kvloop.common.logging import configure_logging

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KvloopConnector(NixlPullConnector):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        # Skip NixlPullConnector.__init__ (it builds vLLM's own scheduler/worker halves).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        self.kvloop_config = KvloopConfig.from_extra_config(tc.kv_connector_extra_config)
        # structlog unconfigured prints every debug line, unfiltered, on the engine loop's path
        # (a line per retained run, not as JSON): filter and format as kvloop's
        # other processes do, leaving vLLM's own logging alone.
        configure_logging(self.kvloop_config.log_level, stdlib=False)
        if tc.kv_load_failure_policy != "recompute":
            tm.log.warning(
                "kvloop.failure_policy",
                detail="kv_load_failure_policy should be 'recompute': a failed pull then "
                "recomputes instead of failing the request",
                policy=tc.kv_load_failure_policy,
            )
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvloopConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config, self.kvloop_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvloopConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config, self.kvloop_config
            )
        else:
            raise ValueError(f"unsupported role {role}")

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33 asks before it serves with --enable-sleep-mode; NixlConnector's answer holds
        (UCX only). A sleep resets the connector's cache first (:meth:`reset_cache`: runs in the KV
        cache leave the directory before their memory goes, host copies stay served); at wake the
        engine registers its KV cache again under a new generation (compat.py)."""
        supported = getattr(super(), "supports_sleep_mode", None)
        return bool(supported(kv_transfer_config)) if supported is not None else False

    def reset_cache(self) -> bool | None:
        if isinstance(self.connector_scheduler, KvloopConnectorScheduler):
            self.connector_scheduler.reset_cache()
        return super().reset_cache()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        own = super().get_handshake_metadata()
        worker = self.connector_worker
        if not isinstance(own, NixlHandshakePayload) or not isinstance(worker, KvloopConnectorWorker):
            return own
        if worker.host_pool is None:
            return own
        return KvloopHandshakePayload(
            own.compatibility_hash, own.agent_metadata_bytes, worker.host_pool.handshake
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if isinstance(self.connector_worker, KvloopConnectorWorker):
            return self.connector_worker.take_worker_meta()
        return None

    def take_events(self) -> Iterable[Any]:
        if isinstance(self.connector_scheduler, KvloopConnectorScheduler):
            return self.connector_scheduler.take_events()
        return ()

    # Metrics: vLLM asks both halves for stats (the worker after each model step, the scheduler after
    # each step's output) and carries them to the API server's /metrics (see stats.py). Either half
    # hands over everything kvloop counted in its process since the last call, with NIXL's own
    # transfer stats (worker half); an in-process engine has both halves in one process: each count
    # goes to whichever asks first, once.
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return collect(super().get_kv_connector_stats())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvloopKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KvloopPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = ["KvloopConnector"]
