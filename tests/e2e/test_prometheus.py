"""A real Prometheus (Debian's package) scrapes the served stack (kvloopd, the sidecars, the proxy and
the vLLM engines, where the connector's series live) with the shipped alerting rules loaded: every
dashboard query and every alert's signal returns a series, and every rule evaluates without error."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request

import yaml

from kvloop.clients.demo.conversation import AgentConversation, chat_turn
from kvloop.common.addresses import free_port
from kvloop.common.processes import supervisor
from tests.prometheus_rules import ALERTS, alert_signal, alerts, dashboard_queries
from tests.support import wait_until

MODEL = "kvloop-tiny"


def _api(base: str, path: str, **params: str) -> dict:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    answer = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert answer["status"] == "success", answer
    return answer["data"]


def _hostport(url: str) -> str:
    return url.removeprefix("http://").removeprefix("https://").rstrip("/")


def test_prometheus_scrapes_the_stack_and_every_query_has_a_series(served_stack, tmp_path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is missing: apt-get install prometheus (.ci/run does)"

    # traffic first: a conversation whose second turn pulls, so every family has its series
    conversation = AgentConversation(seed=53, system_words=400, tool_words=200)
    first = chat_turn(served_stack.proxy_url, MODEL, conversation.messages, 8, 1)
    conversation.record(first.answer)
    assert served_stack.wait_turn_retained(conversation.messages[:-2]), (
        "the decode's retained run never reached kvloopd"
    )
    chat_turn(served_stack.proxy_url, MODEL, conversation.messages, 8, 2)

    engines = served_stack.engines
    jobs = {
        "kvloopd": list(served_stack.daemon_metrics.values()),
        "kvloop-agent": [f"127.0.0.1:{e.config.agent_health_port}" for e in engines],
        "kvloop-proxy": [_hostport(served_stack.proxy_url)],
        "vllm": [_hostport(e.config.url) for e in engines],
    }
    rules = tmp_path / ALERTS.name
    shutil.copy(ALERTS, rules)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {"job_name": job, "static_configs": [{"targets": targets}]}
                    for job, targets in jobs.items()
                ],
            }
        )
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "prometheus.log"
    server = supervisor().spawn(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:

        def all_targets_up() -> list | None:
            try:
                active = _api(base, "targets")["activeTargets"]
            except OSError:
                assert server.poll() is None, log.read_text()
                return None
            expected = sum(len(t) for t in jobs.values())
            up = [t for t in active if t["health"] == "up"]
            return active if len(up) == expected else None

        targets = wait_until(all_targets_up, timeout=60, what="every target up in Prometheus", interval=0.5)
        assert {t["labels"]["job"] for t in targets} == set(jobs)

        queries = {f"dashboard: {name}": expr for name, expr in dashboard_queries().items()}
        queries |= {f"alert {name}": alert_signal(expr) for name, expr in alerts().items()}

        def empty() -> list[str]:
            return [name for name, expr in queries.items() if not _api(base, "query", query=expr)["result"]]

        # rates need two samples of each series: poll until every query has one (or report which not)
        missing: list[str] = []

        def all_answered() -> bool:
            missing[:] = empty()
            return not missing

        try:
            wait_until(all_answered, timeout=60, what="a series for every query", interval=1.0)
        except (AssertionError, TimeoutError):
            raise AssertionError(f"queries with no series: {missing}") from None

        def rules_evaluated() -> list | None:
            groups = _api(base, "rules")["groups"]
            evaluated = [r for g in groups for r in g["rules"] if r.get("lastEvaluation", "").startswith("2")]
            return groups if len(evaluated) == len(alerts()) else None

        groups = wait_until(rules_evaluated, timeout=30, what="every rule evaluated", interval=0.5)
        unhealthy = {r["name"]: r.get("lastError") for g in groups for r in g["rules"] if r["health"] != "ok"}
        assert not unhealthy, unhealthy
    finally:
        server.terminate()
        server.wait(30)
