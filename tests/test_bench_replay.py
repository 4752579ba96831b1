"""`kvloop bench replay`: traces through a real kvloopd (started by the command) and a simulated fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("vllm")  # the replay hashes blocks with vLLM's own helpers

from kvloop.clients.bench.replay import parse_sweep
from kvloop.clients.bench.replay_gen import SyntheticConfig, generate
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
    from kvloop.clients.bench.replay_report import CostModel

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
