"""Spans, logs and metrics of the kvloop connector (one set per process)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from opentelemetry import propagate, trace
from prometheus_client import CollectorRegistry, Counter, Histogram

TRACER_NAME = "kvloop.agents.connector"

tracer = trace.get_tracer(TRACER_NAME)


def wall_ns(perf: float) -> int:
    """A perf_counter() reading as epoch nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def child_span(parent, name: str, start_perf: float, end_perf: float, attributes: dict | None = None) -> None:
    """Record a finished step (lookup, NIXL READ) under a turn's kvloop.prefill span."""
    span = tracer.start_span(
        name,
        context=trace.set_span_in_context(parent),
        start_time=wall_ns(start_perf),
        attributes=attributes or {},
    )
    span.end(end_time=wall_ns(end_perf))
    step = STEP_SECONDS.get(name)
    if step is not None and (attributes or {}).get("kvloop.ok", True):
        step.observe(max(0.0, end_perf - start_perf))


def request_context(request):
    """The caller's trace context (W3C traceparent the API server passed down), if any."""
    headers = getattr(request, "trace_headers", None)
    return propagate.extract(dict(headers)) if headers else None


log = structlog.get_logger(TRACER_NAME)

# Metrics. The connector runs in vLLM's engine-core process (and its worker processes), while `vllm
# serve` answers /metrics from its API-server process. So every update below goes to STATS, this
# process's accumulator: the connector hands what it holds to vLLM as KV-connector stats
# (KvloopConnector.get_kv_connector_stats, see stats.py), vLLM carries them to the API server with
# its scheduler stats, and stats.KvloopPromMetrics records them there under the names below (plus
# vLLM's model_name and engine labels). LOCAL keeps this process's running totals as well: it is
# not served, it is for in-process engines (vllm.LLM) and tests.


@dataclass(frozen=True)
class MetricSpec:
    key: str  # key in the stats payload; the Prometheus name is kvloop_connector_<key>
    kind: Literal["counter", "histogram"]
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def name(self) -> str:
        return f"kvloop_connector_{self.key}"


class StatsAccumulator:
    """What this process counted since vLLM last collected it.

    The payload nests one level per label value: a counter's leaves are sums, a histogram's are lists
    of observations (``{"requests": {"transfer": {"pulled": 2}}, "lookup_seconds": [0.001]}``).
    Lookups record from a thread pool, vLLM drains from the engine loop: both under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}

    def record(self, spec: MetricSpec, labels: tuple[str, ...], value: float) -> None:
        path = (spec.key, *labels)
        with self._lock:
            node = self._data
            for key in path[:-1]:
                node = node.setdefault(key, {})
            if spec.kind == "histogram":
                node.setdefault(path[-1], []).append(value)
            else:
                node[path[-1]] = node.get(path[-1], 0) + value

    def drain(self) -> dict[str, Any]:
        with self._lock:
            data, self._data = self._data, {}
        return data


STATS = StatsAccumulator()
LOCAL = CollectorRegistry()


class Metric:
    """A connector metric: ``labels(...).inc(n)`` / ``inc(n)`` / ``observe(s)`` as prometheus_client's."""

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self._local: Counter | Histogram
        if spec.kind == "histogram":
            self._local = Histogram(spec.name, spec.doc, spec.labels, registry=LOCAL, buckets=spec.buckets)
        else:
            self._local = Counter(spec.name, spec.doc, spec.labels, registry=LOCAL)

    def labels(self, *values: str) -> _Child:
        if len(values) != len(self.spec.labels):
            raise ValueError(f"{self.spec.name} takes labels {self.spec.labels}, got {values}")
        return _Child(self, tuple(str(v) for v in values))

    def inc(self, amount: float = 1.0) -> None:
        self._record((), amount)

    def observe(self, value: float) -> None:
        self._record((), value)

    def _record(self, labels: tuple[str, ...], value: float) -> None:
        if len(labels) != len(self.spec.labels):
            raise ValueError(f"{self.spec.name} needs labels {self.spec.labels}")
        local = self._local.labels(*labels) if labels else self._local
        if isinstance(local, Histogram):
            local.observe(value)
        else:
            local.inc(value)  # raises on a negative amount before anything is recorded
        STATS.record(self.spec, labels, value)


@dataclass(frozen=True)
class _Child:
    metric: Metric
    values: tuple[str, ...]

    def inc(self, amount: float = 1.0) -> None:
        self.metric._record(self.values, amount)

    def observe(self, value: float) -> None:
        self.metric._record(self.values, value)


SPECS = (
    MetricSpec("requests", "counter", "Prefill requests by kvloop path", ("path", "reason")),
    # kind: pulled | recomputed | local
    MetricSpec("tokens", "counter", "Prompt tokens by how they were obtained", ("kind",)),
    MetricSpec("pulled_bytes", "counter", "KV bytes pulled from peers"),
    MetricSpec(
        "lookup_seconds",
        "histogram",
        "Directory lookup latency seen by the connector",
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
    ),
    MetricSpec(
        "read_seconds",
        "histogram",
        "Pull time of a successful transfer, from the pull decision until the engine saw the NIXL READ "
        "done (handshake and engine-step waits included; the READ itself: vllm:nixl_xfer_time_seconds)",
        buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    ),
    MetricSpec("lookup_errors", "counter", "Failed directory lookups", ("kind",)),
    MetricSpec("retained_runs", "counter", "Retained runs announced (decode role)"),
    MetricSpec("retained_blocks", "counter", "Blocks in announced retained runs"),
    MetricSpec("released_runs", "counter", "Retained runs released", ("reason",)),
    # reason: asked (kv_transfer_params kvloop_retain false) | capped (retention_max_share reached)
    MetricSpec(
        "retention_declined", "counter", "Finished decode requests freed at once, not retained", ("reason",)
    ),
    # outcome: given_up (its release sent) | confirmed (the directory dropped it: freed a read window
    # later) | unconfirmed (no answer in time: it keeps its lease)
    MetricSpec(
        "yielded_runs",
        "counter",
        "Retained runs given up before their lease ended, to keep retention within its share",
        ("outcome",),
    ),
    MetricSpec("reads_served", "counter", "READ completion notices received for retained runs"),
    # outcome: copied (announced as a host run) | failed (the WRITE failed) | waiting (no free slots
    # yet: released copies' slots are awaited) | waited (it got them) | no_room (the pool could not
    # hold it, or its KV-cache blocks went first: the run stays in the KV cache only)
    MetricSpec("host_copies", "counter", "Retained runs copied into the host pool", ("outcome",)),
    # reason: evicted (the pool needed room) | superseded (a later turn's copy holds it) | expired
    MetricSpec("host_released", "counter", "Host copies released", ("reason",)),
    MetricSpec("host_reads", "counter", "READs of host copies by prefills"),
    MetricSpec(
        "host_shared_blocks",
        "counter",
        "Blocks a host copy named instead of writing them (the pool held them already)",
    ),
    # As NIXL timed each WRITE into the pool (its transfer telemetry): copy GB/s = bytes / seconds.
    MetricSpec("host_copied_bytes", "counter", "KV bytes written into the host pool"),
    MetricSpec(
        "host_copy_seconds",
        "histogram",
        "Duration of each WRITE of a run into the host pool, as NIXL timed it",
        buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    ),
    MetricSpec("claims_released", "counter", "Single-use claims given back unread", ("released",)),
    # outcome: received | used | unmatched (another local prefix or too short a pull) | expired |
    # stale (an older directory epoch) | bad
    MetricSpec(
        "route_plans", "counter", "Route's pull plans for this prefill, by what became of them", ("outcome",)
    ),
    # result: passed | failed (recomputed, verify_failed) | unchecked (this READ's layout is not one the
    # check covers) | no_digests (the holder announced none)
    MetricSpec(
        "verified_pulls", "counter", "Pulls whose READ was checked against the holder's digests", ("result",)
    ),
    # blocks: retained (the holder digesting a run) | pulled (a puller checking its READ)
    MetricSpec(
        "digest_seconds",
        "histogram",
        "Time a worker spent digesting blocks, per run or per READ",
        ("blocks",),
        buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    ),
    MetricSpec(
        "idle_wakeups",
        "counter",
        "Times kvloop woke an engine loop that slept while holding retained runs (a lease ended)",
    ),
)
SPEC_BY_KEY = {spec.key: spec for spec in SPECS}
_METRICS = {spec.key: Metric(spec) for spec in SPECS}

REQUESTS = _METRICS["requests"]
TOKENS = _METRICS["tokens"]
BYTES = _METRICS["pulled_bytes"]
LOOKUP_SECONDS = _METRICS["lookup_seconds"]
READ_SECONDS = _METRICS["read_seconds"]
LOOKUP_ERRORS = _METRICS["lookup_errors"]
RETAINED = _METRICS["retained_runs"]
RETAINED_BLOCKS = _METRICS["retained_blocks"]
RELEASED = _METRICS["released_runs"]
RETENTION_DECLINED = _METRICS["retention_declined"]
YIELDED = _METRICS["yielded_runs"]
READS_SERVED = _METRICS["reads_served"]
HOST_COPIES = _METRICS["host_copies"]
HOST_RELEASED = _METRICS["host_released"]
HOST_READS = _METRICS["host_reads"]
HOST_SHARED_BLOCKS = _METRICS["host_shared_blocks"]
HOST_COPIED_BYTES = _METRICS["host_copied_bytes"]
HOST_COPY_SECONDS = _METRICS["host_copy_seconds"]
CLAIMS_RELEASED = _METRICS["claims_released"]
IDLE_WAKEUPS = _METRICS["idle_wakeups"]
ROUTE_PLANS = _METRICS["route_plans"]
VERIFY = _METRICS["verified_pulls"]
DIGEST_SECONDS = _METRICS["digest_seconds"]

# A finished step recorded with child_span() also feeds its latency histogram (a failed step,
# attribute kvloop.ok false, does not).
STEP_SECONDS: dict[str, Metric] = {"kvloop.nixl_read": READ_SECONDS}
