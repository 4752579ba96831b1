"""`kvloop bench directory` on a small fleet: its JSON keys (a contract with scripts that read it) and
the relations between its figures."""

from __future__ import annotations

from kvloop.clients.bench.directory import BenchConfig, run_directory_bench


def test_bench_directory_reports_a_paired_floor_and_every_figure():
    config = BenchConfig(
        entries=4096,
        workers=2,
        prompt_blocks=256,
        lookups=100,
        concurrency=2,
        stores=("memory", "redis"),
        route_turns=20,
        route_first_tokens=256,
        route_turn_tokens=32,
    )
    stores = run_directory_bench(config, progress=False)["stores"]
    figures = stores["memory"]
    assert figures["entries"] == 4096
    assert figures["ingest_block_events"] == 4096 and figures["ingest_block_events_per_s"] > 0
    # every Lookup hits a retained run's prefix (of random length), so most are worth a transfer
    assert 0 < figures["transfer_decisions"] <= 100
    assert 0 < figures["lookup_server_p50_us"] <= figures["lookup_server_p99_us"]
    # the server's part of a call is inside its round trip
    assert (
        figures["lookup_server_p50_us"] / 1e3 < figures["lookup_e2e_p50_ms"] <= figures["lookup_e2e_p99_ms"]
    )
    ratio = figures["lookup_e2e_p50_ms"] / figures["grpc_health_check_e2e_p50_ms"]
    assert abs(figures["lookup_e2e_p50_over_health_check"] - ratio) < 0.01
    assert figures["grpc_health_check_alone_e2e_p50_ms"] > 0
    assert figures["lookups_per_s_concurrent"] > 0 and figures["bytes_per_entry"] > 0
    # Route over one conversation's turns: the prefill holding the history always ranks first
    assert figures["route_turns"] == figures["route_ranked_history_holder_first"] == 20
    assert 0 < figures["route_server_p50_us"] <= figures["route_server_p99_us"]
    assert figures["route_server_p50_us"] / 1e3 < figures["route_e2e_p50_ms"]
    assert figures["route_prompt_tokens_mean"] == 256 + 19 * 32 // 2
    # the handler called in-process, hot, on a directory of its own: in memory only
    assert 0 < figures["lookup_handler_hot_p50_us"] <= figures["lookup_handler_hot_p99_us"]
    assert figures["lookup_handler_after_idle_p50_us"] > 0
    # both stores measured in one run: Redis is compared with memory's figures of the same run
    redis = stores["redis"]
    assert redis["entries"] == 4096 and redis["memory_measured"] == "redis used_memory"
    expected = redis["lookup_e2e_p50_ms"] / figures["lookup_e2e_p50_ms"]
    assert abs(redis["lookup_e2e_p50_over_memory"] - expected) < 0.01
    # the same with each store's Lookup over its own interleaved floor
    adjusted = redis["lookup_e2e_p50_over_health_check"] / figures["lookup_e2e_p50_over_health_check"]
    assert abs(redis["lookup_e2e_p50_over_memory_floor_adjusted"] - adjusted) < 0.01
    assert "lookup_e2e_p50_over_memory" not in figures
    assert "lookup_handler_hot_p50_us" not in redis and "lookup_handler_after_idle_p50_us" not in redis
