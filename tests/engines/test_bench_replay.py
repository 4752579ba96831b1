"""`kvloop bench replay`: traces through a real kvloopd (started by the command) and a simulated fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("vllm")  # the replay hashes blocks with vLLM's own helpers

from kvloop.clients.bench.replay.gen import SyntheticConfig, generate
from kvloop.clients.bench.replay.runner import parse_sweep
from kvloop.clients.cli.main import app

BS = 16  # vLLM block size in these tests; a 512-token trace block is 32 vLLM blocks


def replay(*args: str) -> dict:
    result = CliRunner().invoke(app, ["--json", "bench", "replay", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_synthetic_trace_through_a_real_daemon(tmp_path):
    out = tmp_path / "trace.jsonl"
    report = replay("--synthetic", "300", "--decodes", "2", "--prefills", "2", "--write-trace", str(out))
    assert report["requests"] == 300 == len(out.read_text().splitlines())
    total = report["local_share"] + report["pulled_share"] + report["recomputed_share"]
    assert total == pytest.approx(1.0, abs=1e-12)
    assert (
        report["local_tokens"] + report["pulled_tokens"] + report["recomputed_tokens"]
        == report["prompt_tokens"]
    )
    # Sessions resend their history: some of it comes back from the decodes, decided by kvloopd.
    assert report["pulled_share"] > 0.01 and report["paths"]["transfer"] > 0
    assert report["reasons"]["transfer_faster"] == report["paths"]["transfer"]
    cont = report["ttft"]["continuation"]
    assert cont["requests"] > 0 and cont["with_kvloop_ms"]["mean"] < cont["without_kvloop_ms"]["mean"]
    assert report["daemon"]["lookup_ms"]["p50"] > 0 and report["daemon"]["event_lag_ms"]["p50"] > 0
    assert report["daemon"]["rss_mib"]["peak"] > 10
    assert sum(w["requests"] for w in report["over_time"]) == 300
    # The written trace replays to the same figures (seeded generator, deterministic replay).
    again = replay("--trace", str(out), "--decodes", "2", "--prefills", "2")
    assert again["pulled_tokens"] == report["pulled_tokens"]
    assert again["local_tokens"] == report["local_tokens"]


def test_no_repeated_prefix_pulls_nothing(tmp_path):
    trace = write(
        tmp_path / "unique.jsonl",
        [
            {
                "timestamp": i * 1000,
                "input_length": 1500,
                "output_length": 50,
                "hash_ids": [3 * i, 3 * i + 1, 3 * i + 2],
            }
            for i in range(40)
        ],
    )
    report = replay("--trace", str(trace))
    assert report["pulled_share"] == 0 and report["local_share"] == 0
    assert report["recomputed_share"] == pytest.approx(1.0)
    assert report["paths"] == {"miss": 40}
    assert report["missed_pull_tokens"] == {}
    assert report["ttft"]["continuation"]["requests"] == 0


def _session(lease_gap_s: float) -> list[dict]:
    """Turn 1: 1,024 tokens (2 trace blocks), 100 answered; turn 2 resends them + 924 new; turn 3
    comes after `lease_gap_s`. Another session's turn in between makes noise on another prefix."""
    return [
        {"timestamp": 0, "input_length": 1024, "output_length": 100, "hash_ids": [1, 2], "session_id": "a"},
        {
            "timestamp": 5_000,
            "input_length": 700,
            "output_length": 10,
            "hash_ids": [90, 91],
            "session_id": "b",
        },
        {
            "timestamp": 10_000,
            "input_length": 2048,
            "output_length": 30,
            "hash_ids": [1, 2, 3, 4],
            "session_id": "a",
        },
        {
            "timestamp": 10_000 + lease_gap_s * 1000,
            "input_length": 2600,
            "output_length": 30,
            "hash_ids": [1, 2, 3, 4, 5, 6],
            "session_id": "a",
        },
    ]


def test_crafted_session_pulls_exactly_what_the_decode_holds(tmp_path):
    trace = write(tmp_path / "session.jsonl", _session(lease_gap_s=200))
    # No prefix cache on the prefill: turn 2 pulls all the decode holds of turn 1: the prompt and
    # the answer's complete blocks, (1024 + 100 - 1) // 16 = 70 blocks; the rest is recomputed.
    # Turn 3 comes after the 60 s lease: turn 2 had held (2048 + 30 - 1) // 16 = 129 blocks of it
    # (turn 3 resends turn 2's answer), all expired.
    report = replay("--trace", str(trace), "--prefill-cache-blocks", "0", "--lease", "60", "--decodes", "2")
    assert report["pulled_tokens"] == 70 * BS
    assert report["paths"] == {"miss": 3, "transfer": 1}
    assert report["missed_pull_tokens"] == {"expired": 129 * BS}
    # With the lease outliving the gap, turn 3 pulls those 129 blocks.
    long = replay("--trace", str(trace), "--prefill-cache-blocks", "0", "--lease", "480", "--decodes", "2")
    assert long["pulled_tokens"] == 70 * BS + 129 * BS
    assert long["missed_pull_tokens"] == {}
    # A prefix cache on the single prefill serves each earlier prompt locally; turn 2 pulls turn 1's
    # answer (6 blocks), turn 3's one answer block is below the 64-token minimum pull.
    cached = replay("--trace", str(trace), "--prefills", "1", "--lease", "480")
    assert cached["local_tokens"] == 64 * BS + 128 * BS
    assert cached["pulled_tokens"] == 6 * BS
    assert cached["missed_pull_tokens"] == {"below_threshold": 1 * BS}


def test_eviction_is_named(tmp_path):
    trace = write(tmp_path / "session.jsonl", _session(lease_gap_s=30))
    # One decode with room for one short turn: session b's run evicts session a's first turn (70
    # blocks, missed by turns 2 and 3), and turn 2's 130 blocks never fit.
    report = replay(
        "--trace", str(trace), "--prefill-cache-blocks", "0", "--decodes", "1", "--retention-blocks", "80"
    )
    assert report["pulled_tokens"] == 0
    assert report["missed_pull_tokens"] == {"evicted": 2 * 70 * BS}
    assert report["decodes"]["replay-decode-0"]["evicted_runs"] == 1
    assert report["decodes"]["replay-decode-0"]["not_retained_too_large"] == 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        (
            '{"timestamp": 1, "input_length": -3, "output_length": 1, "hash_ids": []}',
            "'input_length' must be",
        ),
        ('{"timestamp": 1, "input_length": 2048, "output_length": 1, "hash_ids": [1]}', "cannot cover"),
        ('{"timestamp": 1, "input_length": 20, "output_length": 1, "hash_ids": ["x"]}', "list of integers"),
    ],
)
def test_bad_trace_lines_give_a_clear_error(tmp_path, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n' + line + "\n"
    )
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(trace)])
    assert result.exit_code == 2
    assert f"{trace}:2: " in result.stderr and message in result.stderr
    assert "Traceback" not in result.output


def test_cli_refuses_bad_options(tmp_path):
    for args, message in (
        ([], "exactly one of --trace FILE and --synthetic N"),
        (["--synthetic", "5", "--sweep", "lease=5,bogus=3"], "unknown sweep key 'bogus'"),
        (["--synthetic", "5", "--routing", "nearest"], "--routing 'nearest'"),
        (
            ["--synthetic", "5", "--multiturn-results", str(tmp_path / "none.json")],
            "not a `kvloop bench multiturn`",
        ),
    ):
        result = CliRunner().invoke(app, ["bench", "replay", *args])
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)


def test_sweep_keys_and_values():
    assert parse_sweep(["lease=60,300,memory=1000,2000"]) == {"lease": [60, 300], "memory": [1000, 2000]}
    assert parse_sweep(["lease=60", "memory=5"]) == {"lease": [60], "memory": [5]}
    assert parse_sweep(["memory=5000,50000", "host_memory=0,200000"]) == {
        "memory": [5000, 50000],
        "host_memory": [0, 200000],
    }
    with pytest.raises(ValueError, match="given twice"):
        parse_sweep(["lease=1,lease=2"])
    with pytest.raises(ValueError, match="not a number"):
        parse_sweep(["lease=soon"])


def test_sweep_writes_a_plot(tmp_path):
    png = tmp_path / "sweep.png"
    result = replay("--synthetic", "120", "--decodes", "2", "--sweep", "lease=20,480", "--plot", str(png))
    assert [p["lease"] for p in result["points"]] == [20, 480]
    # A longer lease keeps more runs to pull from.
    assert result["points"][1]["pulled_share"] >= result["points"][0]["pulled_share"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# A small synthetic trace whose decodes evict runs; without a host tier the replay gives these figures.
SMALL = ("--synthetic", "300", "--decodes", "2", "--retention-blocks", "2000", "--prefill-cache-blocks", "0")
SMALL_FIGURES = {
    "local_tokens": 0,
    "pulled_tokens": 861_952,
    "recomputed_tokens": 710_850,
    "missed_pull_tokens": {"evicted": 334_192},
    "paths": {"miss": 17, "transfer": 283},
}
SMALL_DECODES = {"replay-decode-0": (179, 175, 1376), "replay-decode-1": (102, 96, 1510)}


def _figures(report: dict) -> dict:
    return {k: report[k] for k in SMALL_FIGURES}


def _decodes(report: dict) -> dict:
    return {
        w: (d["retained_runs"], d["evicted_runs"], d["blocks_in_use_at_end"])
        for w, d in report["decodes"].items()
    }


def test_host_tier_off_gives_the_same_report_and_on_turns_evictions_into_host_pulls():
    off = replay(*SMALL, "--host-retention-blocks", "0")
    assert _figures(off) == SMALL_FIGURES and _decodes(off) == SMALL_DECODES
    assert off["pulled_tokens_by_tier"] == {"device": SMALL_FIGURES["pulled_tokens"], "host": 0}
    assert off["pulled_share_by_tier"] == {"device": off["pulled_share"], "host": 0.0}
    assert all(d["moved_to_host_runs"] == 0 for d in off["decodes"].values())
    assert off["ttft"]["continuation"]["without_kvloop_ms"]["mean"] == 662.489
    assert _figures(replay(*SMALL)) == SMALL_FIGURES  # the default is no host tier

    on = replay(*SMALL, "--host-retention-blocks", "20000")
    by_tier = on["pulled_tokens_by_tier"]
    assert by_tier["host"] > 0 and by_tier["device"] + by_tier["host"] == on["pulled_tokens"]
    assert on["pulled_share_by_tier"]["device"] + on["pulled_share_by_tier"]["host"] == pytest.approx(
        on["pulled_share"], abs=1e-12
    )
    assert on["pulled_share"] > off["pulled_share"]
    # Every run the device evicted went to host memory, which had room for all of them: nothing
    # the decodes held was missed.
    for worker, d in on["decodes"].items():
        assert d["moved_to_host_runs"] == d["evicted_runs"] > 0, worker
        assert d["host_evicted_runs"] == 0 and d["host_blocks_in_use_at_end"] > 0
    assert on["missed_pull_tokens"] == {}
    assert on["local_tokens"] + on["pulled_tokens"] + on["recomputed_tokens"] == on["prompt_tokens"]


def _host_tier_sessions() -> list[dict]:
    """`_session` plus session c at 12 s, a short turn whose retention makes the device evict
    session b's run."""
    records = _session(lease_gap_s=30)
    c = {
        "timestamp": 12_000,
        "input_length": 700,
        "output_length": 10,
        "hash_ids": [80, 81],
        "session_id": "c",
    }
    return [*records[:3], c, records[3]]


# One decode with room for one short turn on the device and one long turn in host memory.
TIGHT = ("--prefill-cache-blocks", "0", "--decodes", "1", "--retention-blocks", "80")


def test_host_tier_serves_device_evictions_until_it_evicts_them(tmp_path):
    trace = write(tmp_path / "sessions.jsonl", _host_tier_sessions())
    # Device only: session b's run evicts session a's first turn (70 blocks), missed by turns 2 and 3.
    off = replay("--trace", str(trace), *TIGHT)
    assert off["pulled_tokens"] == 0
    assert off["missed_pull_tokens"] == {"evicted": 2 * 70 * BS}
    # With host memory the evicted turn moves there: turn 2 pulls its 70 blocks from host memory.
    # Session c's run then evicts b's run from the device, b's takes the host pool's room, and the
    # host pool evicts turn 1's run: turn 3 misses it, evicted from both tiers.
    on = replay("--trace", str(trace), *TIGHT, "--host-retention-blocks", "80")
    assert on["pulled_tokens_by_tier"] == {"device": 0, "host": 70 * BS}
    assert on["pulled_share_by_tier"]["host"] == on["pulled_share"] > 0
    assert on["missed_pull_tokens"] == {"evicted": 70 * BS}
    decode = on["decodes"]["replay-decode-0"]
    assert (decode["evicted_runs"], decode["moved_to_host_runs"], decode["host_evicted_runs"]) == (2, 2, 1)
    assert decode["not_retained_too_large"] == 1  # turn 2's 130 blocks never fit the device
    # A host pull costs more than a device pull of the same tokens (a slower READ), less than none.
    cont = on["ttft"]["continuation"]
    assert cont["with_kvloop_ms"]["mean"] < cont["without_kvloop_ms"]["mean"]


def test_host_copy_is_a_host_tier_run_of_its_own_in_kvloopd(tmp_path):
    """While host memory holds the evicted turn, kvloopd lists it under its `@host` handle with the
    host tier, and no longer the device run; after the host pool evicts it, neither."""
    import asyncio

    from kvloop.clients.bench.common import start_daemon
    from kvloop.clients.bench.replay.fleet import MODEL, Fleet, FleetConfig
    from kvloop.clients.bench.replay.trace import read_trace
    from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient
    from kvloop.common.processes import supervisor
    from kvloop.v1 import directory_pb2 as pb

    requests = read_trace(write(tmp_path / "s.jsonl", _host_tier_sessions()), BS, "mooncake")
    probe = requests[0].held[-1]  # the last block of turn 1's run (its answer)
    config = FleetConfig(
        decodes=1, block_size=BS, retention_blocks=80, host_retention_blocks=80, prefill_cache_blocks=0
    )
    seen: dict[int, list[tuple[str, int, bool]]] = {}
    daemon, target = start_daemon("127.0.0.1:0", tmp_path, (), {"KVLOOP_EXPIRY_MARGIN_S": "0"})
    try:
        with DirectoryClient(target, timeout=30) as directory:

            def progress(done: int) -> None:
                # Each request's Lookup waited for the decodes' events to be acknowledged.
                locations = directory.find_block(MODEL, probe)
                seen[done] = [(loc.retention_handle, loc.tier, loc.servable) for loc in locations]

            async def go() -> None:
                async with AsyncDirectoryClient(target, timeout=30) as client:
                    await Fleet(config, [(client, target)], None, progress).run(requests)

            asyncio.run(go())
    finally:
        supervisor().stop(daemon, grace_s=10)
    assert seen[1] == []  # turn 1 still decoding
    # Session b's turn arrived after turn 1 ended (2 s) and before b's ended: turn 1 on the device.
    assert seen[2] == [("replay-decode-0/r0", pb.BLOCK_TIER_DEVICE, True)]
    # Turn 2 (10 s) came after b's run evicted turn 1's from the device (5.2 s).
    assert seen[3] == [("replay-decode-0/r0@host", pb.BLOCK_TIER_HOST, True)]
    # Turn 3 (40 s) came after c's run (12.2 s) pushed b's to host memory, evicting turn 1's.
    assert seen[5] == []


def test_host_reads_cost_the_host_rate_never_less_than_the_link():
    from kvloop.clients.bench.replay.fleet import RequestRecord
    from kvloop.clients.bench.replay.report import CostModel, CostModelError

    def pull(tier: str) -> RequestRecord:
        return RequestRecord(
            index=0, t_ms=0, prefill="p", decode="d", prompt_tokens=10_000, local_tokens=0,
            pulled_tokens=8_000, recomputed_tokens=2_000, path="transfer", reason="transfer_faster",
            missed_tokens=0, missed_reason="", ever_held_tokens=8_000, lookup_ms=1.0, pulled_tier=tier,
        )  # fmt: skip

    model = CostModel.from_figures(8000, 100, 2, 131_072, host_read_gbps=50)
    # 128 KiB per token: 0.0105 ms at 100 Gbit/s, twice that at 50.
    assert model.read_ms_per_token("device") == pytest.approx(131_072 * 8 / 100e6)
    assert model.read_ms_per_token("host") == pytest.approx(2 * model.read_ms_per_token("device"))
    gap = model.with_kvloop_ms(pull("host")) - model.with_kvloop_ms(pull("device"))
    assert gap == pytest.approx(8_000 * model.read_ms_per_token("device"))
    # A host READ still crosses the link: a faster host path does not beat it.
    fast_host = CostModel.from_figures(8000, 100, 2, 131_072, host_read_gbps=400)
    assert fast_host.read_ms_per_token("host") == fast_host.read_ms_per_token("device")
    assert "host memory reads 50 Gbit/s" in model.basis
    with pytest.raises(CostModelError):
        model.with_host_read(0, 131_072)


def test_sweep_over_both_memories(tmp_path):
    png = tmp_path / "memories.png"
    args = ("--synthetic", "120", "--decodes", "2", "--prefill-cache-blocks", "0")
    result = replay(*args, "--sweep", "memory=300,3000", "--sweep", "host_memory=0,20000", "--plot", str(png))
    points = {(p["memory"], p["host_memory"]): p for p in result["points"]}
    assert set(points) == {(300, 0), (300, 20000), (3000, 0), (3000, 20000)}
    for (memory, host_memory), p in points.items():
        host = p["pulled_share_by_tier"]["host"]
        assert (host > 0) == (host_memory > 0 and p["moved_to_host_runs"] > 0), (memory, host_memory)
        assert p["pulled_share_by_tier"]["device"] + host == pytest.approx(p["pulled_share"], abs=1e-12)
    # Little device memory: host memory takes what it evicts and more is pulled.
    assert points[300, 20000]["pulled_share"] > points[300, 0]["pulled_share"]
    assert points[300, 20000]["moved_to_host_runs"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generator_is_seeded_and_shares_prefixes():
    a = list(generate(SyntheticConfig(requests=200, seed=3)))
    assert a == list(generate(SyntheticConfig(requests=200, seed=3)))
    assert a != list(generate(SyntheticConfig(requests=200, seed=4)))
    assert [r["timestamp"] for r in a] == sorted(r["timestamp"] for r in a)
    for r in a:
        assert len(r["hash_ids"]) == -(-r["input_length"] // 512)
    # Sessions with one system prompt share its leading blocks; a session's turns extend each other.
    firsts = {r["hash_ids"][0] for r in a}
    assert len(firsts) < len({r["session_id"] for r in a})
    by_session: dict[str, list[dict]] = {}
    for r in a:
        by_session.setdefault(r["session_id"], []).append(r)
    turns = next(t for t in by_session.values() if len(t) >= 2)
    full = turns[0]["input_length"] // 512
    assert turns[1]["hash_ids"][:full] == turns[0]["hash_ids"][:full]


def test_paced_replay_takes_the_trace_time_and_pulls_the_same(tmp_path):
    trace = write(tmp_path / "session.jsonl", _session(lease_gap_s=30))
    args = ("--trace", str(trace), "--prefill-cache-blocks", "0")
    fast = replay(*args)
    paced = replay(*args, "--speedup", "100")  # 40 s of trace in 0.4 s
    assert paced["replay"]["wall_s"] >= 0.39 > fast["replay"]["wall_s"]
    assert paced["pulled_tokens"] == fast["pulled_tokens"] == 70 * BS + 129 * BS


def test_chat_log_tokenized_and_hashed_like_vllm(tmp_path):
    from transformers import AutoTokenizer

    from kvloop.clients.fleet.model import WORDS, build_tiny_llama

    model = build_tiny_llama(tmp_path / "model", hidden_size=64, layers=1, heads=2, intermediate_size=64)
    system = {"role": "system", "content": " ".join(WORDS[i % len(WORDS)] for i in range(300))}
    user1 = {"role": "user", "content": "first task " + " ".join(WORDS[:20])}
    answer = {"role": "assistant", "content": " ".join(WORDS[5:45])}
    user2 = {"role": "user", "content": "tool output " + " ".join(WORDS[10:90])}
    log = write(
        tmp_path / "chat.jsonl",
        [
            {"session_id": "c", "request": {"model": "m", "messages": [system, user1], "max_tokens": 64}},
            {"session_id": "c", "request": {"model": "m", "messages": [system, user1, answer, user2]}},
        ],
    )
    report = replay("--trace", str(log), "--tokenizer", str(model), "--prefill-cache-blocks", "0")
    tok = AutoTokenizer.from_pretrained(model)

    def tokens(messages: list[dict]) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    first, second = tokens([system, user1]), tokens([system, user1, answer, user2])
    assert len(first) > 300
    full = len(first) // BS * BS
    assert second[:full] == first[:full]  # the second turn resends the first over its full blocks
    # The decode held the first prompt and its answer (the answer's tokens and end of turn, as the
    # second turn renders them), less the last sampled token; the second turn pulls its full blocks.
    held = len(first) + len(tok.encode(answer["content"], add_special_tokens=False)) + 1 - 1
    assert report["prompt_tokens"] == len(first) + len(second)
    assert report["pulled_tokens"] == held // BS * BS
    assert report["paths"] == {"miss": 1, "transfer": 1}


def test_cost_model_fitted_to_a_multiturn_run(tmp_path):
    from kvloop.clients.bench.replay.report import CostModel

    samples = [
        {"arm": "recompute", "prompt_tokens": 1000, "ttft_ms": 300.0, "cached_tokens": 0},
        {"arm": "recompute", "prompt_tokens": 2000, "ttft_ms": 550.0, "cached_tokens": 0},
        {"arm": "kvloop", "prompt_tokens": 1100, "ttft_ms": 90.0, "cached_tokens": 1000, "pull_ms": 12.0},
        {"arm": "kvloop", "prompt_tokens": 2100, "ttft_ms": 95.0, "cached_tokens": 2000, "pull_ms": 22.0},
        {"arm": "kvloop", "prompt_tokens": 200, "ttft_ms": 80.0, "cached_tokens": 0, "pull_ms": None},
    ]
    path = tmp_path / "multiturn.json"
    path.write_text(json.dumps({"samples": samples}))
    model = CostModel.from_multiturn(path)
    assert model.prefill_tokens_per_s == pytest.approx(4000)
    assert model.overhead_ms == pytest.approx(50)
    assert model.transfer_ms_per_token == pytest.approx(0.01)
    assert model.setup_ms == pytest.approx(2)
    # The daemon decides with the same figures: 0.01 ms per 128 KiB token is 13.1 GB/s.
    env = model.daemon_env(131_072)
    assert float(env["KVLOOP_POLICY__DEFAULT_TRANSFER_GBYTES_PER_S"]) == pytest.approx(13.1072)
    assert float(env["KVLOOP_POLICY__DEFAULT_PREFILL_TOKENS_PER_S"]) == pytest.approx(4000)


@pytest.mark.parametrize("downtime", ["60", "5"])
def test_a_crashed_holder_is_named(tmp_path, downtime):
    # decode-0 holds session a (turns 1 and 2) and crashes half-way through the trace (20 s). Turn 3
    # (40 s) finds it still down (kvloopd: peer_unavailable) or back with an empty cache (a miss):
    # either way the 129 blocks it held are missed because their holder went away.
    trace = write(tmp_path / "session.jsonl", _session(lease_gap_s=30))
    report = replay(
        "--trace", str(trace), "--prefill-cache-blocks", "0", "--decodes", "2",
        "--decode-failures", "1", "--failure-downtime", downtime,
    )  # fmt: skip
    assert report["pulled_tokens"] == 70 * BS
    assert report["missed_pull_tokens"] == {"peer_unavailable": 129 * BS}
    assert report["decodes"]["replay-decode-0"]["failures"] == 1
    assert report["reasons"].get("peer_unavailable", 0) == (1 if downtime == "60" else 0)


def test_cpu_per_request_is_split_on_both_stores_and_the_store_changes_no_share():
    memory = replay("--synthetic", "200", "--decodes", "2")
    on_redis = replay("--synthetic", "200", "--decodes", "2", "--store", "redis")
    for report in (memory, on_redis):
        cpu = report["cpu"]["kvloopd"]
        assert report["daemon_cpu_ms_per_request"] == cpu["cpu_ms_per_request"] > 0
        parts = cpu["cpu_ms_per_request_by_part"]
        assert set(parts) == {"ingest", "lookup", "route"} and all(v > 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(cpu["cpu_ms_per_request"], abs=1e-3)
        assert report["cpu"]["block_events"] > report["requests"]  # hundreds of block events a request
        assert cpu["ingest_us_per_block_event"] > 0
        assert report["daemon"]["route_ms"]["p50"] > 0
    assert memory["cpu"]["store"] == "memory" and "redis_cpu_ms_per_request" not in memory
    assert on_redis["cpu"]["store"] == "redis" and on_redis["redis_cpu_ms_per_request"] > 0
    assert all(v > 0 for v in on_redis["cpu"]["redis"]["cpu_ms_per_request_by_part"].values())
    # the same directory answers on either store: the same tokens local, pulled and recomputed
    for key in ("local_tokens", "pulled_tokens", "recomputed_tokens"):
        assert on_redis[key] == memory[key]
    assert on_redis["cpu"]["block_events"] == memory["cpu"]["block_events"]
    no_route = replay("--synthetic", "200", "--decodes", "2", "--no-route")
    assert "route" not in no_route["cpu"]["kvloopd"]["cpu_ms_per_request_by_part"]
    assert no_route["daemon"]["route_ms"] is None and no_route["pulled_tokens"] == memory["pulled_tokens"]


def test_two_replicas_on_a_redis_cluster_give_the_shares_of_one_in_memory_kvloopd():
    memory = replay("--synthetic", "150", "--decodes", "2")
    cluster = replay("--synthetic", "150", "--decodes", "2", "--store", "redis-cluster", "--replicas", "2")
    for key in ("local_tokens", "pulled_tokens", "recomputed_tokens", "missed_pull_tokens"):
        assert cluster[key] == memory[key], key
    assert cluster["pulled_tokens"] > 0
    assert cluster["cpu"]["block_events"] == memory["cpu"]["block_events"]
    redis_cpu = cluster["cpu"]["redis"]
    assert cluster["cpu"]["store"] == "redis-cluster" and cluster["redis_cpu_ms_per_request"] > 0
    assert cluster["daemon_cpu_ms_per_request"] == cluster["cpu"]["kvloopd"]["cpu_ms_per_request"] > 0
    # three primaries, each doing part of the work
    assert len(redis_cpu["node_cpu_s"]) == 3 and all(s > 0 for s in redis_cpu["node_cpu_s"])
    assert 1 / 3 <= redis_cpu["busiest_node_share"] < 1


def test_several_replicas_need_a_shared_store():
    result = CliRunner().invoke(app, ["bench", "replay", "--synthetic", "10", "--replicas", "2"])
    assert result.exit_code == 2 and "--replicas needs a shared store" in result.output


def _superseded_in_host_memory() -> list[dict]:
    """Session x's turn, then a's, y's and z's; a's second turn pulls its first from host memory, and
    its retention pushes y's and z's runs there too: the host pool (room for three one-block turns)
    must give one up. Then x comes back."""

    def turn(t_s: float, session: str, blocks: list[int]) -> dict:
        return {
            "timestamp": int(t_s * 1000),
            "input_length": 512 * len(blocks),
            "output_length": 10,
            "hash_ids": blocks,
            "session_id": session,
        }

    return [
        turn(0, "x", [50]),
        turn(1, "a", [1]),
        turn(2, "y", [60]),
        turn(3, "z", [70]),
        turn(4, "a", [1, 2]),
        turn(6, "x", [50, 51]),
    ]


def test_host_eviction_policy_is_honoured(tmp_path):
    trace = write(tmp_path / "superseded.jsonl", _superseded_in_host_memory())
    # One decode whose device holds two one-block turns, whose host pool holds three.
    args = ("--trace", str(trace), "--prefill-cache-blocks", "0", "--decodes", "1")
    args += ("--retention-blocks", "70", "--host-retention-blocks", "100")
    lru = replay(*args)
    assert lru["fleet"]["host_eviction"] == "lru"  # the default
    assert replay(*args, "--host-eviction", "lru")["pulled_tokens"] == lru["pulled_tokens"]
    # lru gives up the oldest run in host memory, x's: x's second turn misses it.
    assert lru["pulled_tokens_by_tier"] == {"device": 0, "host": 32 * BS}
    assert lru["missed_pull_tokens"] == {"evicted": 32 * BS}
    # predicted_return gives up a's first turn, which a's second turn (retained on the device)
    # holds all of: x's second turn pulls its first from host memory.
    predicted = replay(*args, "--host-eviction", "predicted_return")
    assert predicted["fleet"]["host_eviction"] == "predicted_return"
    assert predicted["pulled_tokens_by_tier"] == {"device": 0, "host": 2 * 32 * BS}
    assert predicted["missed_pull_tokens"] == {}
    for decode in (lru, predicted):
        (d,) = decode["decodes"].values()
        assert (d["moved_to_host_runs"], d["host_evicted_runs"]) == (4, 1)


def test_an_unknown_host_eviction_policy_is_refused():
    result = CliRunner().invoke(app, ["bench", "replay", "--synthetic", "10", "--host-eviction", "mru"])
    assert result.exit_code == 2
    assert "--host-eviction 'mru': choose from lru, predicted_return" in result.output
