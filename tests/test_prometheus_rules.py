"""The shipped alerting rules pass `promtool check rules`, `promtool test rules` shows each alert
firing on its condition, and the rules and dashboard only read metrics kvloop documents (the live
check against a real Prometheus is tests/e2e/test_prometheus.py)."""

from __future__ import annotations

import shutil
import subprocess

from tests.prometheus_rules import (
    ALERT_TESTS,
    ALERTS,
    ROOT,
    alert_signal,
    alerts,
    dashboard_queries,
    metric_names,
)


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=ALERTS.parent)


def test_rules_are_valid():
    result = _promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_every_alert_fires_on_its_condition():
    result = _promtool("test", "rules", ALERT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = ALERT_TESTS.read_text()
    for name in alerts():
        assert f"alertname: {name}" in tested, f"{name} has no promtool test"


def test_alerts_cover_what_operators_must_hear_about():
    assert set(alerts()) == {
        "KvloopDirectoryDown",
        "KvloopAgentDisconnected",
        "KvloopLookupsFailing",
        "KvloopEventLag",
        "KvloopResyncsFrequent",
        "KvloopStoreFailover",
        "KvloopDirectoryNearCapacity",
        "KvloopRecomputingCheaperPulls",
    }


def test_rules_and_dashboard_read_documented_metrics():
    documented = (ROOT / "docs/metrics.md").read_text()
    exprs = [*alerts().values(), *dashboard_queries().values()]
    for expr in exprs:
        for name in metric_names(expr):
            base = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
            assert f"`{base}`" in documented, f"{name} (in {expr!r}) is not in docs/metrics.md"
    for expr in alerts().values():
        alert_signal(expr)  # each is `<signal> <comparison> <threshold>`
