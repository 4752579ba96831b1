"""`kvloop demo`'s recompute measurement without engines: the request it sends for a turn's prompt
recomputed, what it records, and the table's columns (tests/e2e/test_demo.py runs it on real engines)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from rich.console import Console

from kvloop.clients.demo.conversation import AgentConversation, TurnResult, recompute_turn
from kvloop.clients.demo.run import NOT_MEASURED, measure_recompute, turn_table


class FakeProxy:
    """Answers every chat request with one streamed chunk and the proxy's headers; keeps what came."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.requests: list[tuple[dict, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((body, {k.lower(): v for k, v in self.headers.items()}))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                chunk = {"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 700}}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def miss_proxy() -> Iterator[FakeProxy]:
    proxy = FakeProxy({"x-kvloop-path": "miss", "x-kvloop-reason": "miss"})
    yield proxy
    proxy.close()


def _turn(turn: int, ttft_ms: float, path: str = "transfer") -> TurnResult:
    return TurnResult(
        turn=turn,
        prompt_tokens=700 * turn,
        path=path,
        reason="transfer_faster" if path == "transfer" else "miss",
        matched_tokens=600 * (turn - 1),
        recompute_tokens=100,
        bytes_moved=1_000_000 * (turn - 1),
        holder="decode-0" if turn > 1 else "",
        ttft_ms=ttft_ms,
        prefill_ms=ttft_ms / 2,
        total_ms=ttft_ms * 2,
        answer="",
        decode_server="",
        trace_id=f"{turn:032x}",
    )


def test_the_recompute_request_is_the_turns_prompt_salted_afresh_untraced_and_one_token(miss_proxy):
    messages = AgentConversation(seed=3).messages
    first = recompute_turn(miss_proxy.url, "m", messages, 2)
    recompute_turn(miss_proxy.url, "m", messages, 2)
    assert first.path == "miss" and first.prompt_tokens == 700 and first.ttft_ms > 0
    (body, headers), (again, _) = miss_proxy.requests
    assert body["messages"] == messages and body["model"] == "m"
    assert body["max_tokens"] == 1 and body["stream"] is True
    # a fresh random salt per request: nothing any engine holds matches its block hashes
    assert re.fullmatch(r"[0-9a-f]{32}", body["cache_salt"]) and again["cache_salt"] != body["cache_salt"]
    assert "kv_transfer_params" not in body
    # a W3C trace context with the sampled flag off: no process records a span for it
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00", headers["traceparent"])


def test_a_recompute_is_recorded_beside_the_turn_with_the_ratio(miss_proxy):
    stack = SimpleNamespace(proxy_url=miss_proxy.url, config=SimpleNamespace(served_model_name="m"))
    turn = _turn(2, ttft_ms=0.001)  # below any real request's time: the ratio is above 1
    measured = measure_recompute(stack, [], turn, lambda what, state: None)
    ms, ratio = measured["recompute_ttft_ms"], measured["saving_ratio"]
    assert ms is not None and ms > 0
    assert ratio is not None and ratio == round(ms / turn.ttft_ms, 2) and ratio > 1


def test_a_recompute_request_that_reused_blocks_or_failed_is_not_counted():
    pulled = FakeProxy(
        {"x-kvloop-path": "transfer", "x-kvloop-matched-tokens": "64", "x-kvloop-bytes": "4096"}
    )
    said: list[str] = []

    def progress(what: str, state: str) -> None:
        said.append(state)

    try:
        stack = SimpleNamespace(proxy_url=pulled.url, config=SimpleNamespace(served_model_name="m"))
        assert measure_recompute(stack, [], _turn(2, 100.0), progress) is NOT_MEASURED
        assert "reused 64 tokens" in said[-1]
    finally:
        pulled.close()
    gone = SimpleNamespace(proxy_url=pulled.url, config=SimpleNamespace(served_model_name="m"))
    assert measure_recompute(gone, [], _turn(2, 100.0), progress) is NOT_MEASURED
    assert "failed" in said[-1]


def test_the_table_shows_the_recompute_ttft_and_ratio_beside_continuation_turns():
    recomputed = {2: {"recompute_ttft_ms": 480.0, "saving_ratio": 4.0}}
    console = Console(record=True, width=300)
    console.print(turn_table([_turn(1, 366.0, "miss"), _turn(2, 120.0)], recomputed))
    text = console.export_text()
    assert "recompute TTFT ms" in text and "saving" in text
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
        for line in text.splitlines()
        if re.match(r"│\s+\d", line)
    }
    header = [
        c.strip() for c in next(line for line in text.splitlines() if "TTFT ms" in line).split("┃")[1:-1]
    ]
    first, second = (dict(zip(header, rows[t], strict=True)) for t in ("1", "2"))
    assert (first["TTFT ms"], first["recompute TTFT ms"], first["saving"]) == ("366", "-", "-")
    assert (second["TTFT ms"], second["recompute TTFT ms"], second["saving"]) == ("120", "480", "4.00x")
