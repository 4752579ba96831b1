"""The connector's metrics where users scrape them: the served engines' own `/metrics` (vLLM's API
server), after a turn that transferred. The counts are made in the engine-core process and reach the
API server as vLLM KV-connector stats."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvloop.clients.demo.conversation import AgentConversation, chat_turn

MODEL = "kvloop-tiny"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_connector_metrics_on_served_metrics_after_a_transfer(served_stack):
    prefill_url = served_stack.prefill.config.url
    decode_urls = [d.config.url for d in served_stack.decodes]
    before = scrape(prefill_url)
    decodes_before = [scrape(u) for u in decode_urls]
    # vLLM's labels on every kvloop series; the unlabeled ones exist before anything happened
    engine = {"model_name": MODEL, "engine": "0"}
    assert (
        "kvloop_connector_pulled_bytes_total",
        tuple(sorted(engine.items())),
    ) in before, sorted(n for n, _ in before if n.startswith("kvloop"))

    conversation = AgentConversation(seed=41, system_words=500, tool_words=250)
    first = chat_turn(served_stack.proxy_url, MODEL, conversation.messages, 8, 1)
    conversation.record(first.answer)
    assert served_stack.wait_turn_retained(conversation.messages[:-2]), (
        "the decode's retained run never reached kvloopd"
    )
    second = chat_turn(served_stack.proxy_url, MODEL, conversation.messages, 8, 2)
    assert second.path == "transfer", f"{second.path}/{second.reason} ({second.detail})"

    def grew(samples: dict, name: str, **labels: str) -> float:
        return total(samples, name, **labels) - total(before, name, **labels)

    checks = {
        "transfers": ("kvloop_connector_requests_total", {"path": "transfer", **engine}),
        "pulled tokens": ("kvloop_connector_tokens_total", {"kind": "pulled", **engine}),
        "pulled bytes": ("kvloop_connector_pulled_bytes_total", engine),
        "lookups": ("kvloop_connector_lookup_seconds_count", engine),
        "pull times": ("kvloop_connector_read_seconds_count", engine),
        "NIXL READs": ("vllm:nixl_xfer_time_seconds_count", engine),
        "NIXL bytes": ("vllm:nixl_bytes_transferred_sum", engine),
    }
    # the stats of the step that ended the READ travel with that step's output: normally already
    # recorded when the response came back; allow the API server a moment anyway
    deadline = time.monotonic() + 15
    while True:
        after = scrape(prefill_url)
        missing = [what for what, (name, labels) in checks.items() if grew(after, name, **labels) <= 0]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polling the prefill's /metrics
    assert not missing, f"did not grow on the prefill's /metrics: {missing}"
    assert grew(after, "kvloop_connector_pulled_bytes_total") >= second.bytes_moved

    # decode side: the finished turn's retained run, and the prefill's READ of it
    deadline = time.monotonic() + 15
    while True:
        decodes_after = [scrape(u) for u in decode_urls]
        retained_runs, reads = (
            sum(total(a, name) - total(b, name) for a, b in zip(decodes_after, decodes_before, strict=True))
            for name in ("kvloop_connector_retained_runs_total", "kvloop_connector_reads_served_total")
        )
        if (retained_runs >= 2 and reads >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polling the decodes' /metrics
    assert retained_runs >= 2 and reads >= 1, (retained_runs, reads)
