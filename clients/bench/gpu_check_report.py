"""`make gpu-check`'s one JSON: its three steps' results (scripts/gpu_check.sh) put together.

Usage: ``python -m kvloop.clients.bench.gpu_check_report RESULTS_DIR KV_TESTS_EXIT VLLM_VERSION``;
RESULTS_DIR holds ``kv-equality.xml`` (pytest's JUnit report), ``demo.jsonl`` (`kvloop demo --json`)
and ``bench.json`` (`kvloop bench gpu --output`). Prints the JSON on stdout.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def kv_equality(report: Path, exit_code: int) -> dict[str, Any]:
    """Each engine test's outcome, from pytest's JUnit report."""
    tests: dict[str, str] = {}
    if report.exists():
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                if case.find(kind) is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
            tests[case.get("name", "")] = outcome
    return {"passed": exit_code == 0 and bool(tests), "exit_code": exit_code, "tests": tests}


DEMO_FIELDS = (
    "turn",
    "path",
    "tier",
    "prompt_tokens",
    "matched_tokens",
    "ttft_ms",
    "recompute_ttft_ms",
    "saving_ratio",
)


def demo_turns(lines: Path) -> list[dict[str, Any]]:
    """The demo's turns: path, tier, prompt tokens, TTFT and the recompute's."""
    keep = DEMO_FIELDS
    turns = []
    if lines.exists():
        for line in lines.read_text().splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if "turn" in record:
                turns.append({k: record.get(k) for k in keep})
    return turns


def report(results: Path, kv_exit: int, vllm_version: str) -> dict[str, Any]:
    bench = results / "bench.json"
    return {
        "vllm": vllm_version,
        "kv_equality": kv_equality(results / "kv-equality.xml", kv_exit),
        "demo_host_pool": demo_turns(results / "demo.jsonl"),
        "bench": json.loads(bench.read_text()) if bench.exists() else None,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    results, kv_exit, vllm_version = Path(argv[0]), int(argv[1]), argv[2]
    print(json.dumps(report(results, kv_exit, vllm_version), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
