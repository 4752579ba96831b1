"""The proxy over real vLLM engines: chat with and without streaming, continuation turns that transfer,
routing to the decode server holding the prefix, client disconnects, one trace per turn."""

from __future__ import annotations

import http.client
import json
import secrets
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

from kvloop.clients.demo.conversation import AgentConversation, chat_turn
from kvloop.clients.directory_client import DirectoryClient
from kvloop.clients.fleet.model import random_text
from tests.e2e.traces import check_turn_trace

MODEL = "kvloop-tiny"


def post(url: str, body: dict, headers: dict | None = None):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    return urllib.request.urlopen(request, timeout=300)


def test_chat_without_and_with_streaming(served_stack):
    messages = [{"role": "user", "content": random_text(200, 1)}]
    with post(
        f"{served_stack.proxy_url}/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
    ) as r:
        plain = json.loads(r.read())
        assert r.headers["x-kvloop-prefill"] == served_stack.prefill.config.url
    assert plain["choices"][0]["message"]["content"]
    assert plain["usage"]["completion_tokens"] == 8
    with post(
        f"{served_stack.proxy_url}/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True},
    ) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().strip() for line in r if line.strip()]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(
        json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
        for line in lines[:-1]
        if json.loads(line[5:])["choices"]
    )
    assert streamed == plain["choices"][0]["message"]["content"]  # greedy: same answer either way


def test_continuation_turns_transfer_and_go_to_the_holder(served_stack):
    by_worker = {e.config.worker_id: e.config.url for e in served_stack.decodes}
    for seed in (21, 22):  # two conversations: round-robin alone would split their turns across decoders
        conversation = AgentConversation(seed=seed, system_words=500, tool_words=250)
        results = []
        for turn in range(1, 5):
            result = chat_turn(served_stack.proxy_url, MODEL, conversation.messages, 8, turn)
            conversation.record(result.answer)
            results.append(result)
            # as while an agent's tool runs: the finished turn's retention reaches the directory
            assert served_stack.wait_turn_retained(conversation.messages[:-2]), (
                "the decode's retained run never reached kvloopd"
            )
        assert results[0].path in ("miss", "recompute")
        for r in results[1:]:
            assert r.path == "transfer", f"turn {r.turn}: {r.path}/{r.reason} ({r.detail})"
            assert r.matched_tokens >= 512 and r.bytes_moved > 0
            assert r.decode_server == by_worker[r.holder], "decode must go to the server holding the prefix"
    # the prefill's own (first-turn) prefills reached the cost model through its sidecar
    with DirectoryClient(served_stack.daemon_address) as directory:
        prefill = next(
            w
            for w in directory.list_workers(MODEL)
            if w.registration.worker_id == served_stack.prefill.config.worker_id
        )
    assert prefill.prefill_tokens_per_second > 0


def test_client_disconnect_frees_the_decode_request(served_stack):
    url = urlparse(served_stack.proxy_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": random_text(100, 5)}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    decode_url = response.getheader("x-kvloop-decode")
    assert response.readline().startswith(b"data:")  # streaming has begun
    conn.close()  # the client goes away mid-stream

    def running() -> float:
        text = urllib.request.urlopen(f"{decode_url}/metrics", timeout=10).read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )

    deadline = time.monotonic() + 60
    while running() > 0:
        assert time.monotonic() < deadline, "decode kept generating after the client left"
        time.sleep(0.2)  # polling the decode server's gauge


def test_one_trace_spans_proxy_prefill_and_decode(served_stack, otlp_receiver):
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    conversation = AgentConversation(seed=31, system_words=400, tool_words=200)
    with post(
        f"{served_stack.proxy_url}/v1/chat/completions",
        {"model": MODEL, "messages": conversation.messages, "max_tokens": 4},
        {"traceparent": traceparent},
    ) as r:
        conversation.record(json.loads(r.read())["choices"][0]["message"]["content"])
    # the next turn can pull only once the decode's retention of this one has reached the directory
    assert served_stack.wait_turn_retained(conversation.messages[:-2]), (
        "the decode's retained run never reached kvloopd"
    )
    trace_id2 = secrets.token_hex(16)
    with post(
        f"{served_stack.proxy_url}/v1/chat/completions",
        {"model": MODEL, "messages": conversation.messages, "max_tokens": 4},
        {"traceparent": f"00-{trace_id2}-{secrets.token_hex(8)}-01"},
    ) as r:
        r.read()

    def complete(spans):
        # every span the checks below read: each process exports in batches of its own, and the
        # proxy's root span ends (and is exported) only after the client has read the answer
        names = {(s["service"], s["name"]) for s in spans}
        return {
            ("kvloop-proxy", "kvloop.proxy /v1/chat/completions"),
            ("vllm-prefill", "llm_request"),
            ("vllm-decode", "llm_request"),
            ("vllm-prefill", "kvloop.prefill"),
            ("vllm-prefill", "kvloop.nixl_read"),
            ("kvloopd", "/kvloop.v1.Directory/Lookup"),
        } <= names

    deadline = time.monotonic() + 30
    while not complete(spans := [s for s in otlp_receiver.spans() if s["trace_id"] == trace_id2]):
        assert time.monotonic() < deadline, f"incomplete trace: {[(s['service'], s['name']) for s in spans]}"
        time.sleep(0.2)  # polling the receiver's file
    check_turn_trace(spans, trace_id2, pulled=True)
    kvloop_span = next(s for s in spans if s["name"] == "kvloop.prefill")
    assert kvloop_span["attributes"]["kvloop.path"] == "transfer", kvloop_span["attributes"]
    assert kvloop_span["attributes"]["kvloop.matched_tokens"] > 0
    assert kvloop_span["attributes"]["kvloop.bytes"] > 0
    # the first turn had nothing worth pulling (at most the chat template's first block, shared by
    # every conversation, which is below the threshold): its trace says so
    first = [s for s in otlp_receiver.spans() if s["trace_id"] == trace_id and s["name"] == "kvloop.prefill"]
    assert first and first[0]["attributes"]["kvloop.path"] in ("miss", "recompute"), first
    assert first[0]["attributes"]["kvloop.reason"] in ("miss", "below_threshold")
    assert (
        first[0]["attributes"]["kvloop.bytes"] == 0 and first[0]["attributes"]["kvloop.recompute_tokens"] > 0
    )


def test_clients_hanging_up_under_load_leave_no_upstream_request(served_stack):
    """`kvloop bench proxy-load`, small: 8 streaming clients, most hanging up before the first byte
    (prefill step) or mid-stream, then all leaving at once: the engines' own running + waiting gauges
    and the proxy's in-flight counters fall to 0."""
    import asyncio

    from kvloop.clients.bench.proxy_load import ProxyLoadConfig, load_proxy

    config = ProxyLoadConfig(clients=8, duration_s=4, disconnect_fraction=0.75, max_tokens=(64, 512))
    engines = [served_stack.prefill.config.url, *(d.config.url for d in served_stack.decodes)]
    result = asyncio.run(
        load_proxy(config, served_stack.proxy_url, engines, served_stack.proxy.pid, lambda p: None)
    )
    assert result["hung_up"] > 0 and result["upstream_requests_peak"] > 0, result["outcomes"]
    assert result["errors"] == 0, result["outcomes"]
    assert result["upstream_requests_left_running"] == 0
    assert result["proxy_in_flight_left"] == 0
