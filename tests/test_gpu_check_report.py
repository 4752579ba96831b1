"""`make gpu-check`'s one JSON, put together from its steps' own outputs."""

from __future__ import annotations

import json
from pathlib import Path

from kvloop.clients.bench.gpu_check_report import report

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="2" failures="1">
<testcase classname="tests.engines.test_reverse_pull" name="test_four_turn_conversation_transfers_each_turn"/>
<testcase classname="tests.engines.test_host_tier"
 name="test_a_pull_from_the_host_pool_gives_the_kv_a_recompute_gives">
<failure message="KV differs">KV differs from recompute</failure></testcase>
</testsuite></testsuites>
"""


def _results(tmp_path: Path, junit: str | None) -> Path:
    if junit is not None:
        (tmp_path / "kv-equality.xml").write_text(junit)
    turns = [
        {"turn": 1, "path": "miss", "tier": "", "prompt_tokens": 900, "ttft_ms": 50.0, "answer": "a"},
        {
            "turn": 2,
            "path": "transfer",
            "tier": "host",
            "prompt_tokens": 1200,
            "ttft_ms": 20.0,
            "recompute_ttft_ms": 60.0,
            "saving_ratio": 3.0,
            "answer": "b",
        },
    ]
    (tmp_path / "demo.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    (tmp_path / "bench.json").write_text(json.dumps({"tiers": [{"tier": "host", "copy_gbytes_per_s": 12.5}]}))
    return tmp_path


def test_the_report_keeps_each_tests_outcome_the_demos_turns_and_the_bench(tmp_path):
    out = report(_results(tmp_path, JUNIT), 1, "0.33.0")
    assert out["vllm"] == "0.33.0"
    assert out["kv_equality"] == {
        "passed": False,
        "exit_code": 1,
        "tests": {
            "test_four_turn_conversation_transfers_each_turn": "passed",
            "test_a_pull_from_the_host_pool_gives_the_kv_a_recompute_gives": "failed",
        },
    }
    assert [t["tier"] for t in out["demo_host_pool"]] == ["", "host"]
    assert out["demo_host_pool"][1]["saving_ratio"] == 3.0 and "answer" not in out["demo_host_pool"][1]
    assert out["bench"]["tiers"][0]["copy_gbytes_per_s"] == 12.5


def test_tests_that_never_ran_do_not_pass(tmp_path):
    out = report(_results(tmp_path, None), 0, "0.33.0")
    assert out["kv_equality"]["passed"] is False and out["kv_equality"]["tests"] == {}
