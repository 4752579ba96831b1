"""The shipped alerting rules and dashboard, read for the tests: each alert's signal (its expression
without the final comparison) and every dashboard query."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy/prometheus/kvloop-alerts.yml"
ALERT_TESTS = ROOT / "deploy/prometheus/kvloop-alerts.test.yml"
DASHBOARD = ROOT / "deploy/grafana/kvloop-dashboard.json"
# every alert is `<signal> <comparison> <threshold>`
_CONDITION = re.compile(r"^(?P<signal>.+?)\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9][0-9.e-]*\s*$", re.S)


def alerts() -> dict[str, str]:
    rules = [r for group in yaml.safe_load(ALERTS.read_text())["groups"] for r in group["rules"]]
    return {r["alert"]: r["expr"].strip() for r in rules if "alert" in r}


def alert_signal(expr: str) -> str:
    found = _CONDITION.match(expr)
    assert found, f"not `<signal> <comparison> <threshold>`: {expr}"
    return found.group("signal")


def dashboard_queries() -> dict[str, str]:
    """refId-qualified panel title -> PromQL."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        f"{panel['title']} [{target['refId']}]": target["expr"]
        for panel in dashboard["panels"]
        for target in panel["targets"]
    }


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(kvloop_[a-z0-9_]+)", expr))
