"""Prometheus metrics of kvloopd (names are part of the public interface: keep them stable)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from kvloop.common.outcomes import decision_name, reason_name
from kvloop.daemon.histogram import CounterSeries, LoopCounter, LoopHistogram

LOOKUP_LATENCY = LoopHistogram(
    "kvloop_lookup_latency_seconds",
    "Server-side Lookup time (index probe + policy), excluding gRPC transport",
    buckets=(10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3),
)
DECISIONS = LoopCounter("kvloop_decisions_total", "Lookup decisions", ["decision", "reason"])
EVENTS_INGESTED = Counter("kvloop_block_events_ingested_total", "Block-hash events applied", ["kind"])
BATCHES = Counter("kvloop_event_batches_total", "Event batches received", ["outcome"])
RESYNCS = Counter("kvloop_resyncs_total", "Full-state resyncs requested or performed", ["cause"])
RESYNC_CAUSES = ("register", "snapshot", "sequence_gap", "store_failover")
REJECTED = Counter("kvloop_rejected_messages_total", "Messages refused as bad input", ["rpc", "reason"])
EVICTIONS = Counter("kvloop_evictions_total", "Directory entries evicted by the memory bound")
EXPIRED_RUNS = Counter("kvloop_expired_retentions_total", "Retained runs dropped at lease end")
TRANSFER_REPORTS = Counter(
    "kvloop_transfer_reports_total", "Transfer telemetry reports", ["ok", "first_contact"]
)
# Not labelled by holder: no kvloopd series is per worker (a label value per worker of the fleet);
# each failure's log line names the holder and the puller.
VERIFY_FAILED = Counter(
    "kvloop_verify_failed_total",
    "READs whose blocks failed the holder's digest check (its runs are withheld until it registers again)",
)
ENTRIES = Gauge("kvloop_directory_entries", "Block entries (hash x holder) in the directory")
MAX_ENTRIES = Gauge(
    "kvloop_directory_max_entries",
    "Bound on directory entries (max_entries; on a Redis Cluster, times its buckets): past it, eviction",
)
WORKERS = Gauge("kvloop_workers", "Registered workers by lease state", ["state"])
AGENT_REGISTRATIONS = Counter(
    "kvloop_agent_registrations_total",
    "Agent registrations by the agent's kvloop release ('unknown': an agent that sends none)",
    ["version"],
)
CONNECTED_AGENTS = Gauge("kvloop_connected_agents", "Agents with a live Connect stream")
CLAIMS_RELEASED = Counter(
    "kvloop_claims_released_total", "Single-use runs a TRANSFER answer claimed and the puller gave back"
)
ROUTE_LATENCY = LoopHistogram(
    "kvloop_route_latency_seconds",
    "Server-side Route time (prefix-cache walk, one lookup per candidate, estimates)",
    buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3),
)
ROUTES = Counter("kvloop_routes_total", "Route answers, by whether the best candidates tied", ["outcome"])
ROUTE_PLANS = Counter(
    "kvloop_route_plans_total",
    "Route's pull plans pushed to a subscribed prefill's Plans stream (posted), or dropped unread by a "
    "full subscriber queue (dropped)",
    ["outcome"],
)


class DaemonCounters:
    """This daemon's counters: every count goes to Prometheus and to the totals GetStats reports.

    The Prometheus series are process-global (one registry); the totals belong to one service, so
    several daemons in one process (tests) each report their own."""

    def __init__(self) -> None:
        # Every cause's series from the start, at 0: an alert on increase() then sees 0, not nothing.
        for cause in RESYNC_CAUSES:
            RESYNCS.labels(cause)
        self.lookups = 0
        self.decisions: dict[str, int] = {}
        self.rejected = 0
        self.resyncs = 0
        self._evictions_reported = 0
        # (decision, reason) -> (its labelled counter, its GetStats key): named once per pair,
        # not on every Lookup.
        self._decision_series: dict[tuple[int, int], tuple[CounterSeries, str]] = {}
        self._lookup_latency = LOOKUP_LATENCY.labels()

    def lookup(self, seconds: float, decision: int, reason: int) -> None:
        """One Lookup answered: ``decision`` and ``reason`` are the proto enum values."""
        self._lookup_latency.observe(seconds)
        series = self._decision_series.get((decision, reason))
        if series is None:
            names = decision_name(decision), reason_name(reason)
            series = self._decision_series[decision, reason] = (DECISIONS.labels(*names), "/".join(names))
        counter, key = series
        counter.value += 1
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.lookups += 1

    def route(self, seconds: float, tied: bool) -> None:
        ROUTE_LATENCY.observe(seconds)
        ROUTES.labels("tied" if tied else "ranked").inc()

    def claim_released(self) -> None:
        """A TRANSFER answer the puller did not act on: it no longer counts as a transfer."""
        CLAIMS_RELEASED.inc()

    def rejected_message(self, rpc: str, reason: str) -> None:
        self.rejected += 1
        REJECTED.labels(rpc, reason).inc()

    def resync(self, cause: str) -> None:
        self.resyncs += 1
        RESYNCS.labels(cause).inc()

    def evictions(self, total: int) -> None:
        EVICTIONS.inc(total - self._evictions_reported)
        self._evictions_reported = total
