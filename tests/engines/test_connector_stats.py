"""The connector's metrics path to `/metrics`: telemetry's accumulator, the KV-connector stats object
vLLM carries from engine core to the API server (aggregate / reduce / reset / payload round trip) and
the Prometheus recording there, NIXL's own stats alongside. No engine: the objects vLLM calls."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (make setup-engines)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.stats import KvloopKVConnectorStats, KvloopPromMetrics, collect


@pytest.fixture(autouse=True)
def _drained():
    tm.STATS.drain()
    yield
    tm.STATS.drain()


def nixl_transfer(nbytes: int = 4096, seconds: float = 0.002) -> NixlKVConnectorStats:
    nixl = NixlKVConnectorStats()
    nixl.record_transfer(
        SimpleNamespace(xferDuration=seconds * 1e6, postDuration=50, totalBytes=nbytes, descCount=4)
    )
    return nixl


def a_pull() -> None:
    """What the scheduler and directory record for one transferring prefill."""
    tm.LOOKUP_SECONDS.observe(0.0015)
    tm.REQUESTS.labels("transfer", "transfer_faster").inc()
    tm.TOKENS.labels("pulled").inc(640)
    tm.TOKENS.labels("recomputed").inc(12)
    tm.BYTES.inc(2**20)
    span = tm.tracer.start_span("kvloop.prefill")
    tm.child_span(span, "kvloop.nixl_read", 10.0, 10.04, {"kvloop.ok": True})
    tm.child_span(span, "kvloop.nixl_read", 10.0, 10.5, {"kvloop.ok": False})  # a failed READ: no sample
    span.end()


def test_metrics_accumulate_per_process_and_drain_once():
    a_pull()
    a_pull()
    tm.REQUESTS.labels("miss", "miss").inc()
    data = tm.STATS.drain()
    assert data["requests"] == {"transfer": {"transfer_faster": 2}, "miss": {"miss": 1}}
    assert data["tokens"] == {"pulled": 1280, "recomputed": 24}
    assert data["pulled_bytes"] == 2 * 2**20
    assert data["lookup_seconds"] == [0.0015, 0.0015]
    assert data["read_seconds"] == pytest.approx([0.04, 0.04])
    assert tm.STATS.drain() == {}  # handed over once
    # this process's running totals stay readable (in-process engines)
    assert tm.LOCAL.get_sample_value("kvloop_connector_tokens_total", {"kind": "pulled"}) >= 1280
    with pytest.raises(ValueError):
        tm.REQUESTS.inc()  # labels missing
    with pytest.raises(ValueError):
        tm.BYTES.inc(-1)
    assert tm.STATS.drain() == {}  # a rejected update records nothing


def test_collect_combines_nixl_and_kvloop_and_is_none_when_idle():
    assert collect(None) is None
    assert collect(NixlKVConnectorStats()) is None
    nixl_only = collect(nixl_transfer())
    assert nixl_only is not None and nixl_only.nixl.num_successful_transfers == 1 and not nixl_only.kvloop
    tm.RETAINED.inc()
    kvloop_only = collect(None)
    assert kvloop_only is not None and kvloop_only.kvloop == {"retained_runs": 1}
    assert not kvloop_only.is_empty() and kvloop_only.nixl.is_empty()


def test_aggregate_round_trip_reduce_and_reset():
    # worker half (NIXL's READ) and scheduler half (kvloop's counts), as Scheduler.update_from_output
    # aggregates them, then the payload crosses to the API server (msgpack) and is rebuilt there
    worker = collect(nixl_transfer(nbytes=2**20))
    a_pull()
    scheduler = collect(None)
    assert worker is not None and scheduler is not None
    combined = worker.aggregate(scheduler)
    a_pull()
    tm.RELEASED.labels("read").inc()
    combined = combined.aggregate(collect(nixl_transfer(nbytes=2**20)))
    payload = msgspec.msgpack.decode(msgspec.msgpack.encode(combined.to_dict()))
    rebuilt = KvloopKVConnectorStats(data=payload)
    assert rebuilt.nixl.num_successful_transfers == 2
    assert rebuilt.kvloop["requests"] == {"transfer": {"transfer_faster": 2}}
    assert rebuilt.kvloop["released_runs"] == {"read": 1}
    # aggregating never changes what was aggregated in, nor the payload it was built from
    rebuilt.aggregate(KvloopKVConnectorStats(data=payload))
    assert rebuilt.kvloop["requests"]["transfer"]["transfer_faster"] == 4
    assert payload["kvloop"]["requests"]["transfer"]["transfer_faster"] == 2
    assert len(payload["nixl"]["transfer_duration"]) == 2
    # a plain NIXL stats object aggregates in too
    rebuilt.aggregate(nixl_transfer())
    assert rebuilt.nixl.num_successful_transfers == 5
    summary = rebuilt.reduce()
    assert summary["Num successful transfers"] == 5  # NIXL's own line items stay
    assert summary["kvloop transfer prefills"] == 4
    assert summary["kvloop pulled tokens"] == 4 * 640
    assert summary["kvloop avg lookup (ms)"] == pytest.approx(1.5)
    assert summary["kvloop avg pull (ms)"] == pytest.approx(40.0)
    assert summary["kvloop released runs"] == 2
    rebuilt.reset()
    assert rebuilt.is_empty() and rebuilt.reduce() == {}
    assert KvloopKVConnectorStats().is_empty()


def test_prometheus_metrics_on_the_api_server_side():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = KvloopPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    a_pull()
    stats = collect(nixl_transfer(nbytes=2**20))
    assert stats is not None
    prom.observe(msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict())), engine_idx=1)
    tm.LOOKUP_ERRORS.labels("unavailable").inc()
    prom.observe(collect(None).to_dict(), engine_idx=1)  # type: ignore[union-attr]

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "1", **labels})

    assert value("kvloop_connector_requests_total", path="transfer", reason="transfer_faster") == 1
    assert value("kvloop_connector_tokens_total", kind="pulled") == 640
    assert value("kvloop_connector_pulled_bytes_total") == 2**20
    assert value("kvloop_connector_lookup_seconds_count") == 1
    assert value("kvloop_connector_read_seconds_count") == 1
    assert value("kvloop_connector_lookup_errors_total", kind="unavailable") == 1
    assert value("vllm:nixl_xfer_time_seconds_count") == 1  # NIXL's metrics keep working
    assert value("vllm:nixl_bytes_transferred_sum") == 2**20
    # unlabeled series exist from the start for every engine, as vLLM's own
    assert (
        registry.get_sample_value("kvloop_connector_reads_served_total", {"model_name": "m", "engine": "0"})
        == 0
    )
