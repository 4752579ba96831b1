"""The multiturn benchmark's bookkeeping: wrong-KV block counting and the per-arm summary."""

from __future__ import annotations

from kvloop.clients.bench.multiturn import TurnSample, nixl_totals, summarize, wrong_pulled_blocks

BS = 4


def test_pulled_blocks_past_the_first_differing_token_are_wrong():
    held = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert wrong_pulled_blocks([held], held + [11, 12], 8, BS) == 0  # a true prefix
    edited = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # token 6 dropped: positions 5.. differ
    assert wrong_pulled_blocks([held], edited, 8, BS) == 1  # block 1 (positions 4-7) is wrong
    assert wrong_pulled_blocks([held], edited, 10, BS) == 2  # and the partial block 2
    assert wrong_pulled_blocks([held], edited, 4, BS) == 0
    assert wrong_pulled_blocks([[9, 9], held], edited, 10, BS) == 2  # best agreeing source counts
    assert wrong_pulled_blocks([], edited, 4, BS) == 1  # pulled from nothing known
    assert wrong_pulled_blocks([held], edited, 0, BS) == 0


def sample(arm: str, turn: int, ttft: float, cached: int, answer: str, wrong: int = 0) -> TurnSample:
    return TurnSample(arm, "edited", 1, 0, turn, 100, ttft, cached, "transfer" if cached else "recompute",
                      answer, 0, wrong)


def test_summary_ratios_agreement_and_wrong_blocks():
    samples = [sample("recompute", t, 100.0 * t, 0, f"a{t}") for t in (1, 2, 3)]
    samples += [sample("kvloop", 1, 100, 0, "a1"), sample("kvloop", 2, 20, 8, "a2"), sample("kvloop", 3, 40, 9, "a3")]
    samples += [sample("builtin", 1, 100, 0, "a1"), sample("builtin", 2, 10, 12, "x", 2),
                sample("builtin", 3, 30, 12, "a3", 1)]
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
    samples += [sample("kvloop", 1, 100, 0, "a"), sample("kvloop", 2, 20, 8, "a"), sample("kvloop", 3, 40, 8, "a")]
    samples[-1].lookup_ms, samples[-1].pull_ms = 1.5, 12.0
    transfers = {("edited", 1, "kvloop"): {"bytes": 3 * 2**20, "xfer_s": 0.006, "reads": 2}}
    rows = {r["arm"]: r for r in summarize(samples, BS, transfers)["rows"]}
    kvloop = rows["kvloop"]
    assert (kvloop["nixl_reads"], kvloop["bytes_moved_mib"], kvloop["nixl_read_ms_mean"]) == (2, 3.0, 3.0)
    assert (kvloop["lookup_ms_p50"], kvloop["lookup_to_pulled_ms_p50"]) == (1.5, 12.0)
    assert "nixl_reads" not in rows["recompute"]


def test_nixl_totals_sum_vllms_histograms_over_engines():
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
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3.0
"""
    assert nixl_totals(page) == {"bytes": 4096.0, "xfer_s": 0.75, "reads": 3.0}
    assert nixl_totals("") == {"bytes": 0.0, "xfer_s": 0.0, "reads": 0.0}
