"""The multiturn benchmark's bookkeeping: wrong-KV block counting and the per-arm summary."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest

from kvloop.clients.bench.multiturn.arms import ArmClient, TurnOutcome, engine_totals
from kvloop.clients.bench.multiturn.plot import plot
from kvloop.clients.bench.multiturn.runner import run_workload
from kvloop.clients.bench.multiturn.setup import (
    ARMS,
    ROUTING_PAIRED_RATIOS,
    WORKLOADS,
    MultiturnConfig,
    Session,
    TurnSample,
    arm_order,
    build_sessions,
    session_seed_base,
)
from kvloop.clients.bench.multiturn.summary import (
    context_bucket,
    median_ci95,
    pooled_summary,
    summarize,
    wrong_pulled_blocks,
)
from tests.support import wait_until

BS = 4


def test_pulled_blocks_past_the_first_differing_token_are_wrong():
    held = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert wrong_pulled_blocks([held], [*held, 11, 12], 8, BS) == 0  # a true prefix
    edited = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # token 6 dropped: positions 5.. differ
    assert wrong_pulled_blocks([held], edited, 8, BS) == 1  # block 1 (positions 4-7) is wrong
    assert wrong_pulled_blocks([held], edited, 10, BS) == 2  # and the partial block 2
    assert wrong_pulled_blocks([held], edited, 4, BS) == 0
    assert wrong_pulled_blocks([[9, 9], held], edited, 10, BS) == 2  # best agreeing source counts
    assert wrong_pulled_blocks([], edited, 4, BS) == 1  # pulled from nothing known
    assert wrong_pulled_blocks([held], edited, 0, BS) == 0


def sample(arm: str, turn: int, ttft: float, cached: int, answer: str, wrong: int = 0) -> TurnSample:
    return TurnSample(
        arm, "edited", 1, 0, turn, 100, ttft, cached, "transfer" if cached else "recompute", answer, 0, wrong
    )


def test_summary_ratios_agreement_and_wrong_blocks():
    samples = [sample("recompute", t, 100.0 * t, 0, f"a{t}") for t in (1, 2, 3)]
    samples += [
        sample("kvloop", 1, 100, 0, "a1"),
        sample("kvloop", 2, 20, 8, "a2"),
        sample("kvloop", 3, 40, 9, "a3"),
    ]
    samples += [
        sample("builtin", 1, 100, 0, "a1"),
        sample("builtin", 2, 10, 12, "x", 2),
        sample("builtin", 3, 30, 12, "a3", 1),
    ]
    rows = {r["arm"]: r for r in summarize(samples, BS)["rows"]}
    assert rows["recompute"]["continuation_turns"] == 2 and rows["recompute"]["ratio_to_recompute_p50"] == 1.0
    assert rows["kvloop"]["ratio_to_recompute_p50"] == round(30 / 250, 3)
    assert rows["kvloop"]["answer_agreement_with_recompute"] == 1.0
    assert (rows["kvloop"]["pulled_blocks"], rows["kvloop"]["wrong_pulled_blocks"]) == (2 + 3, 0)
    assert rows["builtin"]["answer_agreement_with_recompute"] == 0.5
    assert (rows["builtin"]["pulled_blocks"], rows["builtin"]["wrong_pulled_blocks"]) == (6, 3)
    assert rows["builtin"]["transfer_share"] == 1.0


def test_summary_reports_nixl_totals_and_connector_timings():
    samples = [sample("recompute", t, 100.0, 0, "a") for t in (1, 2, 3)]
    samples += [
        sample("kvloop", 1, 100, 0, "a"),
        sample("kvloop", 2, 20, 8, "a"),
        sample("kvloop", 3, 40, 8, "a"),
    ]
    samples[-1].lookup_ms, samples[-1].pull_ms = 1.5, 12.0
    transfers = {
        ("edited", 1, "kvloop"): {
            "bytes": 3 * 2**20,
            "xfer_s": 0.006,
            "reads": 2,
            "queue_s": 0.05,
            "prefill_s": 0.3,
            "e2e_s": 0.4,
            "requests": 2,
        }
    }
    rows = {r["arm"]: r for r in summarize(samples, BS, transfers)["rows"]}
    kvloop = rows["kvloop"]
    assert (kvloop["nixl_reads"], kvloop["bytes_moved_mib"], kvloop["nixl_read_ms_mean"]) == (2, 3.0, 3.0)
    assert (kvloop["lookup_ms_p50"], kvloop["lookup_to_pulled_ms_p50"]) == (1.5, 12.0)
    assert (
        kvloop["engine_queue_ms_mean"],
        kvloop["engine_prefill_ms_mean"],
        kvloop["engine_e2e_ms_mean"],
    ) == (25.0, 150.0, 200.0)
    assert "nixl_reads" not in rows["recompute"]


def test_engine_totals_sum_vllms_histograms_over_engines():
    page = """# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01"} 1.0
vllm:nixl_xfer_time_seconds_count{engine="0"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.25
vllm:nixl_xfer_time_seconds_count{engine="1"} 1.0
vllm:nixl_xfer_time_seconds_sum{engine="1"} 0.5
# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_sum{engine="0"} 4096.0
vllm:nixl_bytes_transferred_count{engine="0"} 2.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.125
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 2.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3.0
"""
    assert engine_totals(page) == {
        "bytes": 4096.0,
        "xfer_s": 0.75,
        "reads": 3.0,
        "queue_s": 0.125,
        "prefill_s": 0.0,
        "e2e_s": 1.5,
        "requests": 2.0,
    }
    assert set(engine_totals("").values()) == {0.0}


def test_decode_tpot_is_read_from_the_decode_engine():
    from kvloop.clients.bench.multiturn.arms import DECODE_SERIES
    from kvloop.clients.bench.multiturn.summary import _transfer_columns

    page = """# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.06
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="m"} 4.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 30.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 12.0
"""
    decode = engine_totals(page, DECODE_SERIES)
    assert decode == {
        "decode_tpot_s": 0.06,
        "decode_requests": 4.0,
        "decode_step_tokens": 30.0,
        "decode_steps": 12.0,
    }
    prefill = dict.fromkeys(("bytes", "xfer_s", "reads", "queue_s", "prefill_s", "e2e_s", "requests"), 0.0)
    columns = _transfer_columns(prefill | decode)
    assert columns["decode_tpot_ms_mean"] == 15.0
    assert columns["decode_batch_mean"] == 2.5


def test_the_local_arm_reads_its_one_engine_and_no_decode(tmp_path: Path):
    """The local arm has no decode engine (decode_url ""): its totals are its prefill's alone."""
    import http.server
    import threading

    page = b"""# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 2.0
"""

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        local = ArmClient("local", f"http://127.0.0.1:{server.server_address[1]}", "", [])
        totals = local.engine_totals()
    finally:
        server.shutdown()
    assert (totals["e2e_s"], totals["requests"]) == (1.5, 2.0)
    assert "decode_tpot_s" not in totals


def test_cpu_seconds_are_counted_per_role_and_a_gone_process_counts_nothing():
    from kvloop.clients.bench.multiturn.arms import ArmClient

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    busy += "import sys; sys.stdin.read()"
    with subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE) as p:
        client = ArmClient("kvloop", "", "", [("decode", p), ("sidecars", done)])
        wait_until(lambda: client.cpu_seconds()["decode"] >= 0.3, timeout=30, what="the child's CPU time")
        cpu = client.cpu_seconds()
        assert cpu["sidecars"] == 0.0 and cpu["prefill"] == 0.0 and cpu["kvloopd"] == 0.0
        p.stdin.close()


def timed(arm: str, repeat: int, turn: int, ttft: float, prompt_tokens: int = 100) -> TurnSample:
    return TurnSample(arm, "plain", 1, 0, turn, prompt_tokens, ttft, 0, "recompute", "", repeat)


def test_summary_spread_per_repeat_and_paired_per_turn_ratios():
    samples = []
    # kvloop is 1.1x builtin on every turn but one, where a noisy builtin turn took 3x as long.
    for repeat, scale in ((0, 1.0), (1, 2.0)):
        for turn in (2, 3, 4):
            builtin = 100.0 * scale * turn * (3 if (repeat, turn) == (1, 4) else 1)
            samples += [
                timed("builtin", repeat, turn, builtin),
                timed("kvloop", repeat, turn, 110.0 * scale * turn),
                timed("local", repeat, turn, 50.0 * scale * turn),
            ]
    summary = summarize(samples, BS)
    rows = {r["arm"]: r for r in summary["rows"]}
    assert rows["kvloop"]["ttft_p50_by_repeat_ms"] == [330.0, 660.0]
    assert rows["local"]["answer_agreement_with_recompute"] is None  # the floor arm stops at the first token
    paired = {p["ratio"]: p for p in summary["paired"]}
    assert paired["kvloop/builtin"]["turns"] == 6
    # One noisy turn in six moves neither the median nor the quartiles.
    assert (paired["kvloop/builtin"]["median"], paired["kvloop/builtin"]["q1"]) == (1.1, 1.1)
    assert paired["kvloop/local"] == {
        "workload": "plain",
        "concurrency": 1,
        "ratio": "kvloop/local",
        "turns": 6,
        "median": 2.2,
        "q1": 2.2,
        "q3": 2.2,
        "median_ci95": [2.2, 2.2],
    }


def test_routing_summary_pairs_kvloop_with_every_other_arm_and_counts_how_prefills_were_chosen():
    samples = []
    for turn in (2, 3, 4):
        for arm, ms, how in (
            ("kvloop", 100.0, "continuation" if turn < 4 else "continuation_tie"),
            ("load_pull", 125.0, "load_no_directory"),
            ("prefix_route", 200.0, "prefix"),
            ("recompute", 400.0, "load_no_directory"),
        ):
            sample = timed(arm, 0, turn, ms * turn)
            sample.route, sample.route_ms, sample.prefill_worker = how, 2.0 * turn, f"prefill-{turn % 2}"
            sample.prefill_leg_ms = ms * turn - 10.0
            sample.burst_wait_ms = 5.0 if (arm, turn) == ("kvloop", 3) else None
            samples.append(sample)
    summary = summarize(samples, BS, pairs=ROUTING_PAIRED_RATIOS)
    paired = {p["ratio"]: p["median"] for p in summary["paired"]}
    assert paired == {"kvloop/load_pull": 0.8, "kvloop/prefix_route": 0.5, "kvloop/recompute": 0.25}
    kvloop = next(r for r in summary["rows"] if r["arm"] == "kvloop")
    assert kvloop["route_outcomes"] == {"continuation": 2, "continuation_tie": 1}
    assert kvloop["route_ms_p50"] == 6.0 and kvloop["prefill_leg_ms_p50"] == 290.0
    assert kvloop["prefills_used"] == {"prefill-0": 2, "prefill-1": 1}
    assert kvloop["burst_waits"] == 1
    assert kvloop["ratio_to_recompute_p50"] == 0.25
    recompute = next(r for r in summary["rows"] if r["arm"] == "recompute")
    assert recompute["route_outcomes"] == {"load_no_directory": 3} and recompute["burst_waits"] == 0


def test_every_routing_arm_runs_a_proxy_whose_options_the_cli_takes():
    """Each routing arm is a `kvloop proxy` with options of its own, parsed here by the real CLI: by
    Route, by own prefix or by load, pulling or not."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from kvloop.clients.bench.multiturn.setup import ROUTING_ARMS, ROUTING_PROXY_OPTIONS
    from kvloop.clients.cli.main import app

    proxy = get_command(app).commands["proxy"]  # type: ignore[attr-defined]
    parsed = {}
    for arm in ROUTING_ARMS:
        options = [*ROUTING_PROXY_OPTIONS[arm], "--prefill", "http://p", "--decode", "http://d"]
        params = proxy.make_context("proxy", options).params
        parsed[arm] = (params["route"], params["route_by"], params["pull"])
    assert parsed == {
        "kvloop": (True, "cost", True),
        "load_pull": (False, "cost", True),
        "prefix_route": (True, "prefix", False),
        "recompute": (False, "cost", False),
    }
    refused = CliRunner().invoke(
        app, ["proxy", "--route-by", "nearest", "--prefill", "http://p", "--decode", "http://d"]
    )
    assert refused.exit_code == 2 and "choose from cost, prefix" in refused.output


def _routing_run(seed_scale: float, config: dict | None = None) -> dict:
    """A results JSON as `bench multiturn --prefills 2` writes it: kvloop at 0.8x load_pull each turn."""
    samples = [
        timed(arm, 0, turn, ms * turn * seed_scale)
        for turn in (2, 3)
        for arm, ms in (("kvloop", 80.0), ("load_pull", 100.0), ("prefix_route", 100.0), ("recompute", 200.0))
    ]
    setup = {"arms": ["kvloop", "load_pull", "prefix_route", "recompute"], "prefills": 2, "decodes": 2}
    setup["block_size"] = BS
    return {"config": {**setup, **(config or {})}, "samples": [asdict(s) for s in samples]}


def test_runs_of_one_setup_pool_into_one_summary_each_run_a_repeat_of_its_own():
    summary = pooled_summary([_routing_run(1.0), _routing_run(2.0), _routing_run(4.0)])
    kvloop = next(r for r in summary["rows"] if r["arm"] == "kvloop")
    assert kvloop["continuation_turns"] == 6  # every run's turns, none merged as the same turn
    assert kvloop["ttft_p50_by_repeat_ms"] == [200.0, 400.0, 800.0]
    paired = {p["ratio"]: p for p in summary["paired"]}
    assert paired["kvloop/load_pull"]["turns"] == 6 and paired["kvloop/load_pull"]["median"] == 0.8


def test_runs_of_other_setups_are_refused_by_the_setting_that_differs():
    with pytest.raises(ValueError, match="answer_tokens=16, run 1 128"):
        pooled_summary([_routing_run(1.0, {"answer_tokens": 128}), _routing_run(1.0, {"answer_tokens": 16})])
    with pytest.raises(ValueError, match="ucx_tls='tcp,self', run 1 'cma,tcp,self'"):
        pooled_summary(
            [_routing_run(1.0, {"ucx_tls": "cma,tcp,self"}), _routing_run(1.0, {"ucx_tls": "tcp,self"})]
        )
    with pytest.raises(ValueError, match="no results"):
        pooled_summary([])


def test_the_cli_pools_results_files_and_refuses_what_is_not_one(tmp_path: Path):
    from typer.testing import CliRunner

    from kvloop.clients.cli.main import app

    paths = []
    for i, scale in enumerate((1.0, 2.0)):
        paths.append(tmp_path / f"seed{i}.json")
        paths[-1].write_text(json.dumps(_routing_run(scale)))
    pooled = CliRunner().invoke(app, ["--json", "bench", "multiturn-pool", *map(str, paths)])
    assert pooled.exit_code == 0, pooled.output
    rows = json.loads(pooled.stdout)["rows"]
    assert next(r for r in rows if r["arm"] == "kvloop")["continuation_turns"] == 4
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"summary": {}}))
    refused = CliRunner().invoke(app, ["bench", "multiturn-pool", str(paths[0]), str(other)])
    assert refused.exit_code == 2 and "not results of `kvloop bench multiturn`" in refused.stderr
    missing = CliRunner().invoke(app, ["bench", "multiturn-pool", str(tmp_path / "none.json")])
    assert missing.exit_code == 1 and "cannot read" in missing.stderr and "Traceback" not in missing.stderr


def test_median_confidence_interval_narrows_with_more_turns():
    noisy = [0.7, 1.4, 0.9, 1.2, 1.0, 1.3, 0.8, 1.1]
    few_low, few_high = median_ci95(noisy)
    many_low, many_high = median_ci95(noisy * 8)
    assert few_low <= statistics.median(noisy) <= few_high
    assert many_high - many_low < few_high - few_low
    assert median_ci95(noisy) == (few_low, few_high)  # seeded: reproducible


def test_context_buckets_compare_each_arm_with_recompute_at_the_same_length():
    assert [context_bucket(n) for n in (999, 1000, 2999, 3001, 7000, 8999, 9001)] == [0, 2, 2, 4, 8, 8, 10]
    samples = [
        timed("recompute", 0, 2, 400, 2100),
        timed("recompute", 0, 3, 3000, 7800),
        timed("recompute", 0, 4, 3400, 8600),
        timed("kvloop", 0, 2, 100, 2100),
        timed("kvloop", 0, 3, 300, 7800),
        timed("kvloop", 0, 4, 500, 8600),
    ]
    cells = {(c["context_k"], c["arm"]): c for c in summarize(samples, BS)["by_context"]}
    assert cells[(2, "kvloop")]["ratio_to_recompute_p50"] == 0.25
    assert cells[(8, "kvloop")]["turns"] == 2
    assert cells[(8, "kvloop")]["ratio_to_recompute_p50"] == round(400 / 3200, 3)
    assert cells[(8, "recompute")]["ratio_to_recompute_p50"] == 1.0


class RecordingArm(ArmClient):
    """An arm whose turns are recorded instead of sent to engines (the order is what is under test)."""

    def __init__(self, arm: str, log: list[tuple[int, str, list[str]]]) -> None:
        super().__init__(arm, "", "")
        self.log = log

    def turn(self, session: Session, max_tokens: int) -> TurnOutcome:
        answers = [m["content"] for m in session.messages if m["role"] == "assistant"]
        turn = len(answers) + 1
        self.log.append((turn, self.arm, answers))
        ids = list(range(len(session.messages)))
        return TurnOutcome(1.0, len(ids), 0, "recompute", f"{self.arm}-{turn}", ids, ids)


def test_arms_take_turns_in_a_rotating_order_and_share_the_reference_history():
    log: list[tuple[int, str, list[str]]] = []
    clients = {arm: RecordingArm(arm, log) for arm in ARMS}
    config = MultiturnConfig(workdir=Path("."), turns=4, system_tokens=5, tool_tokens=3)
    samples = run_workload(clients, "plain", 1, config, lambda: None)
    assert len(samples) == 4 * len(ARMS)
    firsts = [next(arm for t, arm, _ in log if t == turn) for turn in (1, 2, 3, 4)]
    assert sorted(firsts) == sorted(ARMS)  # every arm goes first once in four turns
    for turn, arm, answers in log:  # every arm's history carries the recompute arm's answers, not its own
        assert answers == [f"recompute-{t}" for t in range(1, turn)], arm


def test_every_workload_concurrency_and_repeat_replays_conversations_of_its_own():
    combos = [(w, c, r) for w in WORKLOADS for c in (1, 4, 8) for r in (-1, 0, 1, 2)]
    config = MultiturnConfig(workdir=Path("."), system_tokens=5)
    seeds = [
        s.seed
        for w, c, r in combos
        for s in build_sessions(w, c, config, session_seed_base(config.seed, w, c, r))
    ]
    assert len(seeds) == len(set(seeds))


def test_plots_draw_a_panel_per_workload_and_sessions(tmp_path: Path):
    import matplotlib.image

    samples = [
        TurnSample(arm, workload, concurrency, 0, turn, 1000 * turn, 100.0 * turn, 0, "transfer", "a")
        for arm in ("recompute", "kvloop")
        for workload in ("plain", "edited")
        for concurrency in (1, 8)
        for turn in (1, 2, 3)
    ]
    samples.append(
        TurnSample("builtin", "plain", 1, 0, 2, 2000, 50.0, 0, "transfer", "a")
    )  # one arm in one group
    paths = plot(samples, summarize(samples, BS)["by_context"], tmp_path)
    assert [Path(p).name for p in paths] == ["ttft_vs_context.png", "ttft_distribution.png"]
    for path in paths:
        height, width, _ = matplotlib.image.imread(path).shape
        assert width > 1.5 * height  # 4 groups: 3 panels by 2 (a single panel is 5.5 x 4.2)
    assert plot([s for s in samples if s.turn == 1], [], tmp_path / "none") == []  # no continuation turns
    # the host-pool arm alone (`--arm kvloop_host`): plotted like any other
    host = [
        TurnSample("kvloop_host", "plain", 8, 0, t, 1000 * t, 10.0 * t, 0, "transfer", "a") for t in (1, 2)
    ]
    (tmp_path / "host").mkdir()
    assert len(plot(host, summarize(host, BS)["by_context"], tmp_path / "host")) == 2


def test_decode_tpot_is_paired_per_turn_on_every_turn_it_was_measured():
    samples = []
    for turn in (1, 2, 3):
        for arm, tpot in (("kvloop", 21.0), ("recompute", 20.0)):
            sample = timed(arm, 0, turn, 100.0)
            sample.decode_tpot_ms = tpot if turn != 3 or arm == "kvloop" else None
            samples.append(sample)
    summary = summarize(samples, BS)
    (pair,) = summary["paired_decode_tpot"]
    # turn 3's recompute answer was not timed: two pairs, the first turn included
    assert (pair["ratio"], pair["turns"], pair["median"]) == ("kvloop/recompute", 2, 1.05)
    rows = {r["arm"]: r for r in summary["rows"]}
    assert rows["kvloop"]["decode_tpot_p50_ms"] == 21.0


def test_pinned_engines_split_the_cores_between_prefill_and_decode():
    from kvloop.clients.fleet.stack import engine_cores

    assert (engine_cores("prefill", 2), engine_cores("decode", 2)) == ("0", "1")
    assert (engine_cores("prefill", 16), engine_cores("decode", 16)) == ("0-7", "8-15")
    assert (engine_cores("prefill", 1), engine_cores("decode", 1)) == ("0", "0")  # nothing to split


def test_the_engines_transport_and_cores_reach_their_environment(tmp_path: Path):
    from kvloop.clients.fleet.stack import Stack, StackConfig, engine_cores

    tcp = Stack(StackConfig(tmp_path, tmp_path, ucx_tls="tcp,self", pin_engines=True))
    assert tcp.engine_env("decode") == {
        "UCX_TLS": "tcp,self",
        "VLLM_CPU_OMP_THREADS_BIND": engine_cores("decode"),
    }
    assert Stack(StackConfig(tmp_path, tmp_path)).engine_env("prefill") == {}  # the environment's own


def test_decode_steps_are_compared_at_equal_batch_without_arrival_steps():
    from kvloop.clients.bench.multiturn.summary import decode_steps_of
    from kvloop.clients.bench.steps import Stream

    alone = Stream(0.0, [0.0, 0.010, 0.020, 0.030], [1, 1, 1, 1])
    joiner = Stream(0.0, [0.0203, 0.032], [1, 1])  # came out of alone's second step
    assert decode_steps_of(alone, [alone, joiner]) == [[1, False, 10.0], [1, True, 10.0], [2, False, 10.0]]
    assert decode_steps_of(None, [alone]) == []
    elsewhere = Stream(0.0, [0.0203, 0.032], [1, 1], where="http://other-decode")
    assert [b for b, _, _ in decode_steps_of(alone, [alone, elsewhere])] == [1, 1, 1]
    samples = []
    for arm, steps in (
        ("kvloop", [[1, False, 11.0], [2, False, 16.0], [2, True, 40.0]]),
        ("recompute", [[2, False, 16.0], [2, False, 16.0], [2, False, 16.0], [1, False, 10.0]]),
    ):
        s = timed(arm, 0, 1, 100.0)
        s.decode_steps = steps
        samples.append(s)
    (row,) = summarize(samples, BS)["decode_step_at_equal_batch"]
    assert [(b["batch"], b["ratio"]) for b in row["by_batch"]] == [(1, 1.1), (2, 1.0)]  # the arrival left out
    assert row["ratio_weighted"] == pytest.approx((1.1 * 1 + 1.0 * 3) / 4, abs=1e-3)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_the_arms_order_balances_positions_and_predecessors(n):
    arms = [f"arm{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rows = [arm_order(arms, turn) for turn in range(1, cycle + 1)]
    assert all(sorted(row) == arms for row in rows)
    positions = Counter((position, arm) for row in rows for position, arm in enumerate(row))
    assert set(positions.values()) == {cycle // n}  # every arm in every position equally often
    follows = Counter(pair for row in rows for pair in itertools.pairwise(row))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1  # every ordered pair alike


def _span(trace: str, name: str, start_ms: float, end_ms: float, **attributes) -> dict:
    return {
        "trace_id": trace,
        "span_id": f"{trace}-{name}-{start_ms}",
        "name": name,
        "start_unix_nano": int(start_ms * 1e6),
        "end_unix_nano": int(end_ms * 1e6),
        "attributes": attributes,
    }


def _traced_sample(arm: str, turn: int, trace: str, ttft_ms: float) -> TurnSample:
    sample = TurnSample(arm, "plain", 4, 0, turn, 1000, ttft_ms, 0, "transfer", "")
    sample.trace_id = trace
    return sample


def test_a_turns_time_is_split_into_queue_lookup_read_steps_compute_and_outside(tmp_path: Path):
    from kvloop.clients.bench.multiturn.breakdown import breakdown

    queue, compute, first = (
        f"gen_ai.latency.{x}" for x in ("time_in_queue", "time_in_model_prefill", "time_to_first_token")
    )
    lines = [
        # kvloop turn: 40 ms in vLLM's queue, of which a 4 ms lookup and a 30 ms READ; 200 ms compute
        _span("a", "llm_request", 0, 260, **{queue: 0.040, compute: 0.2}),
        _span("a", "kvloop.lookup", 1, 5),
        _span("a", "kvloop.nixl_read", 5, 35, **{"kvloop.nixl_xfer_ms": 12.5}),
        # its decode, later: its first token 50 ms after it arrived
        _span("a", "llm_request", 300, 900, **{first: 0.05}),
        # builtin turn: no kvloop spans; its READ is part of the queue
        _span("b", "llm_request", 0, 280, **{queue: 0.030, compute: 0.22}),
    ]
    (tmp_path / "kvloop.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:4]) + "\n{cut short")
    (tmp_path / "builtin.jsonl").write_text(json.dumps(lines[4]))
    samples = [
        _traced_sample("kvloop", 2, "a", 270.0),
        _traced_sample("builtin", 2, "b", 265.0),
        _traced_sample("builtin", 3, "gone", 300.0),  # its spans never arrived: counted apart
        _traced_sample("builtin", 1, "b", 999.0),  # a first turn: not a continuation
    ]
    rows = {r["arm"]: r for r in breakdown(samples, [tmp_path / "kvloop.jsonl", tmp_path / "builtin.jsonl"])}
    k, b = rows["kvloop"], rows["builtin"]
    assert (k["queue_ms"], k["lookup_ms"], k["read_ms"], k["xfer_ms"]) == (40.0, 4.0, 30.0, 12.5)
    assert k["steps_ms"] == 6.0 and k["compute_ms"] == 200.0 and k["outside_ms"] == 30.0
    assert k["decode_first_ms"] == 50.0 and k["turns"] == 1
    assert (b["lookup_ms"], b["read_ms"], b["steps_ms"], b["outside_ms"]) == (0.0, 0.0, 30.0, 15.0)
    assert b["decode_first_ms"] is None and b["turns"] == 1 and b["turns_without_spans"] == 1


@pytest.mark.parametrize(
    ("arms", "asked", "streamed"),
    [
        (("recompute", "kvloop"), None, True),
        (("builtin", "kvloop"), None, False),  # builtin answers whole: so does every arm
        (("builtin", "kvloop"), True, True),
        (("recompute", "kvloop"), False, False),
    ],
)
def test_decode_legs_are_answered_whole_when_the_builtin_arm_runs_unless_asked(arms, asked, streamed):
    config = MultiturnConfig(workdir=Path("."), arms=arms, stream_decodes=asked)
    assert config.streams_decodes is streamed


class _PausableEngine:
    def __init__(self, arm: str, events: list[tuple]) -> None:
        self.arm, self.events, self.paused = arm, events, False

    def pause(self, paused: bool) -> None:
        self.paused = paused
        self.events.append(("paused" if paused else "resumed", self.arm))


def test_each_arms_turns_run_with_the_others_paused_and_settled_before_they_pause():
    events: list[tuple] = []
    log: list[tuple[int, str, list[str]]] = []
    engines = {arm: _PausableEngine(arm, events) for arm in ("recompute", "builtin", "kvloop")}

    class Arm(RecordingArm):
        def turn(self, session: Session, max_tokens: int) -> TurnOutcome:
            running = [a for a, e in engines.items() if not e.paused]
            assert running == [self.arm], f"{self.arm}'s turn ran beside {running}"
            events.append(("turn", self.arm))
            return super().turn(session, max_tokens)

    clients = {}
    for arm in engines:
        clients[arm] = Arm(arm, log)
        clients[arm].engines = [engines[arm]]
        clients[arm]._settle = lambda sessions, arm=arm: events.append(("settled", arm, len(sessions)))
    config = MultiturnConfig(
        workdir=Path("."), turns=3, system_tokens=5, tool_tokens=3, pause_other_arms=True
    )
    run_workload(clients, "plain", 2, config, lambda: None)
    assert not any(e.paused for e in engines.values())  # all running again once the workload is over
    settled = [e for e in events if e[0] == "settled"]
    assert len(settled) == 3 * 3 and all(e[2] == 2 for e in settled)
    unsettled: set[str] = set()  # an arm is paused only once what its turn left is in place
    for event in events:
        if event[0] == "turn":
            unsettled.add(event[1])
        elif event[0] == "settled":
            unsettled.discard(event[1])
        elif event[0] == "paused":
            assert event[1] not in unsettled, events
