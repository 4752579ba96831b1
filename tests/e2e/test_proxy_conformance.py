"""`kvloop proxy` against a plain aggregated `vllm serve` of the same model: the same request gets the same
answer through the proxy (over a prefill and a decode) as from vLLM alone - greedy tokens, logprobs,
finish reasons, usage, and a stream as a client reads it whatever its chunk boundaries (which follow
timing in vLLM's output loop) - and the proxy relays its decode's chunks one for one. An invalid
request gets the same status and error shape. API keys are checked as `vllm serve --api-key` checks
them, and the proxy presents the keys its servers were started with."""

from __future__ import annotations

import http.server
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloop.agents.engine import Engine, EngineConfig
from kvloop.clients.fleet.model import random_text
from kvloop.common.addresses import free_port
from tests.sse_stream import VOLATILE, check_relayed, check_well_formed, chunks, key_sets, read, usage

MODEL = "kvloop-tiny"
PLAIN_KEY = "plain-server-key-0123456789"
PROXY_KEY = "proxy-client-key-0123456789"
BIN = Path(sys.executable).parent
# Logprobs of the same greedy token differ by bf16 rounding between one prefill pass and a decode that
# continues from pulled KV; the tokens themselves must agree.
LOGPROB_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def plain(served_stack) -> Iterator[str]:
    """An aggregated `vllm serve` of the stack's model, started with --api-key, without a connector."""
    engine = _plain_engine(served_stack)
    engine.launch()
    try:
        engine.wait_ready(240)
        yield engine.config.url
    finally:
        engine.stop()


def _plain_engine(stack) -> Engine:
    first = stack.decodes[0].config
    config = EngineConfig(
        role="decode",
        model=first.model,
        served_model_name=first.served_model_name,
        worker_id="plain-0",
        port=free_port(),
        nixl_port=free_port(),
        kv_events_port=free_port(),
        daemon="",
        block_size=first.block_size,
        dtype=first.dtype,
        kv_cache_gib=1,
        max_model_len=first.max_model_len,
        max_num_batched_tokens=first.max_num_batched_tokens,
        mode="plain",
        extra_vllm_args=["--api-key", PLAIN_KEY, *first.extra_vllm_args],
    )
    return Engine(config, stack.config.workdir / "logs")


def call(url: str, body: bytes | dict | None = None, key: str | None = None) -> tuple[int, dict, str]:
    """(status, headers, body text) of a POST (a GET without a body)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def both(stack, plain_url: str, path: str, body: bytes | dict | None = None):
    """The same request through the proxy and to the plain server."""
    return call(f"{stack.proxy_url}{path}", body), call(f"{plain_url}{path}", body, PLAIN_KEY)


def _close(a: float | None, b: float | None) -> bool:
    return (a is None) == (b is None) and (a is None or abs(a - b) <= LOGPROB_TOLERANCE)  # type: ignore[operator]


def _same_logprobs(a, b) -> None:
    """Equal logprob structures: the same tokens everywhere, values within bf16 rounding."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys()
        for key in a:
            if key == "logprob":
                assert _close(a[key], b[key]), (a, b)
            elif (
                key == "top_logprobs"
                and isinstance(a[key], list)
                and a[key]
                and isinstance(a[key][0], dict)
                and "token" in a[key][0]
            ):
                # near-ties among the runners-up may swap: the best one agrees, the rest by count
                assert a[key][0]["token"] == b[key][0]["token"] and len(a[key]) == len(b[key])
            elif key == "top_logprobs" and isinstance(a[key], list):  # completions: [{token: logprob} | None]
                assert [len(x or ()) for x in a[key]] == [len(x or ()) for x in b[key]]
            elif key == "token_logprobs" and isinstance(a[key], list):
                assert all(_close(x, y) for x, y in zip(a[key], b[key], strict=True))
            else:
                _same_logprobs(a[key], b[key])
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_logprobs(x, y)
    else:
        assert a == b


def same_answer(proxied: dict, direct: dict) -> None:
    assert {k: v for k, v in proxied.items() if k not in VOLATILE and k != "choices" and k != "usage"} == {
        k: v for k, v in direct.items() if k not in VOLATILE and k != "choices" and k != "usage"
    }
    assert usage(proxied) == usage(direct)
    assert len(proxied["choices"]) == len(direct["choices"])
    for mine, theirs in zip(proxied["choices"], direct["choices"], strict=True):
        assert mine.keys() == theirs.keys()
        for key in mine:
            if key == "logprobs":
                _same_logprobs(mine[key], theirs[key])
            elif key == "message" and mine[key].get("tool_calls"):  # tool call ids are drawn at random
                assert _without_ids(mine[key]) == _without_ids(theirs[key])
            else:
                assert mine[key] == theirs[key], key


def _without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls") or []]}


def _same_token_logprobs(mine: list[dict], theirs: list[dict], chat: bool) -> None:
    """Per-token logprobs as a client assembles them from the chunks."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        if chat:
            _same_logprobs(a, b)
            continue
        assert a["token"] == b["token"] and _close(a["logprob"], b["logprob"]), (a, b)
        assert len(a["top_logprobs"] or ()) == len(b["top_logprobs"] or ())


def same_stream(proxied: str, direct: str, chat: bool, sampled: bool = False) -> None:
    """The same answer as a client reads it, whatever the chunk boundaries (tests/sse_stream.py)."""
    mine, theirs = chunks(proxied), chunks(direct)
    check_well_formed(mine, chat)
    check_well_formed(theirs, chat)
    assert key_sets(mine) == key_sets(theirs), "the same fields in the chunks and their choices"
    a, b = read(mine, chat), read(theirs, chat)
    assert a["done"] and b["done"]
    assert (a["model"], a["object"], a["usage"]) == (b["model"], b["object"], b["usage"])
    assert a["answers"].keys() == b["answers"].keys()
    for index, answer in a["answers"].items():
        other = b["answers"][index]
        assert answer["role"] == other["role"]
        if sampled:  # drawn at random: each answer finished, the same way as a plain server's fields
            assert answer["finish_reason"] is not None and other["finish_reason"] is not None
            continue
        for key in ("text", "reasoning", "token_ids", "finish_reason", "stop_reason"):
            assert answer[key] == other[key], key
        # tool call ids are drawn at random; the assembled calls agree
        assert answer["tool_calls"] == other["tool_calls"]
        _same_token_logprobs(answer["logprobs"], other["logprobs"], chat)


def _prompt(seed: int) -> str:
    return random_text(60, seed)


TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
}

CHAT_CASES = {
    "plain": {},
    "min_tokens": {"min_tokens": 12, "max_tokens": 12},
    "min_tokens_ignore_eos": {"min_tokens": 6, "max_completion_tokens": 10, "ignore_eos": True},
    "logprobs": {"logprobs": True, "top_logprobs": 3},
    "stop": {"stop": ["e"], "include_stop_str_in_output": True},
    "json_object": {"response_format": {"type": "json_object"}, "max_tokens": 20},
    "json_schema": {"response_format": SCHEMA, "max_tokens": 20},
    "logit_bias": {"logit_bias": {"100": 100}},
    "named_tool": {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
    "required_tool": {"tools": [TOOL], "tool_choice": "required", "max_tokens": 30},
    "echo": {"echo": True},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "n_sampled": {"n": 2, "temperature": 0.8, "seed": 5},
}
TOKEN_IDS = [0]  # stands for a prompt of token ids made from the case's seed
COMPLETION_CASES = {
    "plain": {},
    "min_tokens": {"min_tokens": 12, "max_tokens": 12},
    "logprobs": {"logprobs": 3},
    "echo": {"echo": True},
    "echo_logprobs": {"echo": True, "logprobs": 1},
    "stop": {"stop": ["a"]},
    "json_object": {"response_format": {"type": "json_object"}, "max_tokens": 20},
    "token_ids_prompt": {"prompt": TOKEN_IDS},
    "n_sampled": {"n": 2, "temperature": 0.8, "seed": 5},
}
SAMPLED = {"n_sampled"}  # answers drawn at random: the same shape, not the same text


def _body(chat: bool, case: str, fields: dict, seed: int, stream: bool) -> dict:
    body: dict = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(seed)}]
    else:
        body["prompt"] = _prompt(seed)
    body.update(fields)
    if body.get("prompt") == TOKEN_IDS:
        body["prompt"] = [100 + (seed + i) % 800 for i in range(48)]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _cases():
    for chat, table in ((True, CHAT_CASES), (False, COMPLETION_CASES)):
        for case, fields in table.items():
            for stream in (False, True):
                if stream and case in ("prompt_logprobs", "echo_logprobs"):
                    continue  # refused streamed by vLLM: covered by the error cases
                name = f"{'chat' if chat else 'completions'}-{case}{'-stream' if stream else ''}"
                yield pytest.param(chat, case, fields, stream, id=name)


@pytest.mark.parametrize("chat, case, fields, stream", list(_cases()))
def test_the_same_request_gets_the_same_answer(served_stack, plain, chat, case, fields, stream):
    seed = zlib.crc32(f"{chat}-{case}-{stream}".encode())  # a prompt of its own: nothing cached anywhere
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(chat, case, fields, seed, stream)
    (status, headers, proxied), (plain_status, _, direct) = both(served_stack, plain, path, body)
    assert status == plain_status == 200, (proxied, direct)
    if stream:
        assert headers["Content-Type"].startswith("text/event-stream")
        same_stream(proxied, direct, chat, sampled=case in SAMPLED)
        if case in SAMPLED:
            assert len(read(chunks(proxied), chat)["answers"]) == fields["n"]
        return
    mine, theirs = json.loads(proxied), json.loads(direct)
    if case in SAMPLED:
        assert len(mine["choices"]) == len(theirs["choices"]) == 2
        assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
        return
    same_answer(mine, theirs)
    if case.startswith("min_tokens"):
        assert mine["usage"]["completion_tokens"] >= fields["min_tokens"]


@pytest.mark.parametrize(
    "path, body",
    [
        pytest.param("/v1/chat/completions", b"{not json", id="not-json"),
        pytest.param("/v1/chat/completions", [1], id="not-an-object"),
        pytest.param("/v1/chat/completions", {"model": MODEL}, id="no-messages"),
        pytest.param("/v1/chat/completions", {"model": MODEL, "messages": []}, id="empty-messages"),
        pytest.param(
            "/v1/chat/completions", {"model": MODEL, "messages": [{"x": 1}]}, id="message-without-role"
        ),
        pytest.param(
            "/v1/chat/completions",
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            id="unknown-model",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0},
            id="n-zero",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0},
            id="greedy-n-2",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
            id="too-long",
        ),
        pytest.param(
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "min_tokens": 9,
                "max_tokens": 3,
            },
            id="min-above-max",
        ),
        pytest.param("/v1/completions", {"model": MODEL}, id="no-prompt"),
        pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, id="negative-max"),
        pytest.param(
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True},
            id="streamed-prompt-logprobs",
        ),
        pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, id="suffix"),
    ],
)
def test_an_invalid_request_fails_the_same_way(served_stack, plain, path, body):
    (status, _, proxied), (plain_status, _, direct) = both(served_stack, plain, path, body)
    assert status == plain_status and status >= 400, (proxied, direct)
    mine, theirs = json.loads(proxied), json.loads(direct)
    assert mine == theirs, "the proxy relays vLLM's own error object"
    assert set(mine["error"]) == {"message", "type", "param", "code"}


def test_models_list_as_vllm_lists_them(served_stack, plain):
    (status, _, proxied), (_, _, direct) = both(served_stack, plain, "/v1/models")
    assert status == 200
    mine = {m["id"]: m for m in json.loads(proxied)["data"]}
    theirs = {m["id"]: m for m in json.loads(direct)["data"]}
    assert MODEL in mine
    for key in ("object", "owned_by", "root", "parent", "max_model_len"):
        assert mine[MODEL][key] == theirs[MODEL][key], key
    assert mine[MODEL].keys() == theirs[MODEL].keys()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"model": MODEL, "prompt": "hello there"}),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}),
        ("/detokenize", {"model": MODEL, "tokens": [100, 200, 300]}),
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}),
    ],
)
def test_tokenize_and_detokenize_as_vllm_serves_them(served_stack, plain, path, body):
    (status, _, proxied), (plain_status, _, direct) = both(served_stack, plain, path, body)
    assert status == plain_status
    assert json.loads(proxied) == json.loads(direct)


def _start_proxy(tmp_path: Path, prefill: str, decode: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tmp_path / "proxy.log"
    process = subprocess.Popen(
        [str(BIN / "kvloop"), "proxy", "--listen", f"127.0.0.1:{port}", "--prefill", prefill,
         "--decode", decode, *extra],
        stderr=log.open("w"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return process, url
        except urllib.error.HTTPError:
            return process, url  # answering (503 while a backend is down)
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            time.sleep(0.1)  # polling until the proxy listens


def test_api_keys_as_vllm_checks_them(served_stack, plain, tmp_path):
    """The proxy checks its clients' key as vLLM does, and presents the decode server's own key."""
    process, url = _start_proxy(
        tmp_path,
        served_stack.prefill.config.url,
        plain,
        "--api-key",
        PROXY_KEY,
        "--decode-api-key",
        PLAIN_KEY,
    )
    try:
        body = _body(True, "plain", {}, 4242, stream=False)
        for key in (None, "wrong-key-0123456789"):
            status, _, proxied = call(f"{url}/v1/chat/completions", body, key)
            plain_status, _, direct = call(f"{plain}/v1/chat/completions", body, key)
            assert status == plain_status == 401
            assert json.loads(proxied) == json.loads(direct) == {"error": "Unauthorized"}
        assert call(f"{url}/health")[0] == 200  # unguarded, as vLLM's
        deadline = time.monotonic() + 30
        while (answer := call(f"{url}/v1/chat/completions", body, PROXY_KEY))[0] == 503:
            assert time.monotonic() < deadline, answer  # until the first health check saw the decode
            time.sleep(0.2)  # the proxy checks its servers every 2 s
        status, _, proxied = answer
        assert status == 200, proxied
        assert (
            json.loads(proxied)["choices"][0]["message"]["content"]
            == json.loads(call(f"{plain}/v1/chat/completions", body, PLAIN_KEY)[2])["choices"][0]["message"][
                "content"
            ]
        )
        log = (tmp_path / "proxy.log").read_text()
        assert PLAIN_KEY not in log and PROXY_KEY not in log
    finally:
        process.terminate()
        process.wait(10)


def test_a_wrong_server_key_is_named_not_forwarded(served_stack, plain, tmp_path):
    process, url = _start_proxy(
        tmp_path, served_stack.prefill.config.url, plain, "--decode-api-key", "not-the-key-0123456789"
    )
    try:
        deadline = time.monotonic() + 30
        while "wrong key" not in (health := call(f"{url}/health"))[2]:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)  # the proxy checks its servers every 2 s
        assert health[0] == 503
        status, _, answer = call(f"{url}/v1/chat/completions", _body(True, "plain", {}, 4343, False))
        assert status == 503 and "no healthy decode server" in json.loads(answer)["error"]["message"]
        assert "not-the-key" not in (tmp_path / "proxy.log").read_text()
    finally:
        process.terminate()
        process.wait(10)


class _Tap:
    """A recording relay in front of a decode server: what the proxy's decode leg really received."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        # each decode leg's stream once it ended (a queue: the proxy may answer its client first)
        self.streams: queue.Queue[str] = queue.Queue()
        tap = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _forward(self, body: bytes | None) -> None:
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                request = urllib.request.Request(f"{tap.upstream}{self.path}", data=body, headers=headers)
                try:
                    upstream = urllib.request.urlopen(request, timeout=300)
                except urllib.error.HTTPError as exc:
                    upstream = exc
                with upstream:
                    self.send_response(upstream.status)
                    for key, value in upstream.headers.items():
                        if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(key, value)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    seen = bytearray()
                    while piece := upstream.read1(65536):
                        seen += piece
                        self.wfile.write(piece)
                        self.wfile.flush()
                if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    tap.streams.put(seen.decode())
                self.close_connection = True

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tapped_proxy(served_stack, tmp_path_factory) -> Iterator[tuple[str, _Tap]]:
    """A kvloop proxy whose decode is reached through a tap that records the decode leg's stream."""
    decode = served_stack.decodes[0].config.url
    tap = _Tap(decode)
    process, url = _start_proxy(tmp_path_factory.mktemp("tapped"), served_stack.prefill.config.url, tap.url)
    try:
        deadline = time.monotonic() + 30
        while call(f"{url}/health")[0] != 200:
            assert time.monotonic() < deadline, "the tapped proxy never saw its servers healthy"
            time.sleep(0.2)  # the proxy checks its servers every 2 s
        yield url, tap
    finally:
        process.terminate()
        process.wait(10)
        tap.close()


@pytest.mark.parametrize(
    "chat, case",
    [(True, "logprobs"), (True, "named_tool"), (True, "json_object"), (False, "echo"), (False, "plain")],
    ids=["chat-logprobs", "chat-named_tool", "chat-json_object", "completions-echo", "completions-plain"],
)
def test_the_proxy_relays_the_decode_chunks_one_for_one(tapped_proxy, chat, case):
    url, tap = tapped_proxy
    table = CHAT_CASES if chat else COMPLETION_CASES
    body = _body(chat, case, table[case], zlib.crc32(f"relay-{chat}-{case}".encode()), stream=True)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, _, proxied = call(f"{url}{path}", body)
    assert status == 200, proxied
    leg = tap.streams.get(timeout=60)
    assert tap.streams.empty(), "one decode leg per request"
    check_relayed(chunks(leg), chunks(proxied), chat)
    check_well_formed(chunks(proxied), chat)
