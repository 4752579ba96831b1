"""The proxy when a decode server dies under its requests (kill -9 of its `vllm serve`): requests that
had no response byte yet run again on the other decode, a stream the client was reading continues on
the other decode with exactly the greedy tokens an uninterrupted run gives, and the server, relaunched
on the same port, serves again. One kill and one relaunch of the shared stack's decode (15-40 s)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from kvloop.clients.fleet.model import random_text
from tests.e2e.test_proxy import MODEL, post
from tests.support import wait_until

# Long enough that the decode is still generating when the test has read a few chunks and kills it.
LONG_ANSWER_TOKENS = 300


def metric_total(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def running_requests(engine_url: str) -> float:
    return metric_total(engine_url, "vllm:num_requests_running")


def events(response) -> Iterator[dict | str]:
    """The SSE payloads of a streamed answer, parsed (`[DONE]` as the string)."""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            yield data if data == "[DONE]" else json.loads(data)


class StreamedAnswer:
    """A streamed chat answer read to its end, checked for the shape of one uninterrupted stream."""

    def __init__(self, payloads: list[dict | str], headers) -> None:
        assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
        chunks = [p for p in payloads[:-1] if isinstance(p, dict)]
        assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
        assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
        roles = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
        assert len(roles) == 1 and chunks[0] is roles[0], "one role chunk, first"
        for chunk in chunks:
            # token ids were not asked for: null, as a plain server streams them, continuations included
            assert chunk.get("prompt_token_ids") is None and all(
                c.get("token_ids") is None for c in chunk["choices"]
            )
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] is not None and all(f is None for f in finishes[:-1])
        self.text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        self.usage = chunks[-1].get("usage")
        self.headers = headers


class ReadingStream:
    """A streamed request read to its end in a thread; `read_some` is set once a few chunks are in."""

    def __init__(self, proxy_url: str, body: dict) -> None:
        self.proxy_url, self.body = proxy_url, body
        self.read_some = threading.Event()

    def read(self) -> tuple[list[dict | str], dict]:
        with post(f"{self.proxy_url}/v1/chat/completions", self.body) as r:
            payloads = []
            for payload in events(r):
                payloads.append(payload)
                if len(payloads) == 5:
                    self.read_some.set()
            return payloads, dict(r.headers)


def chat_body(messages: list[dict], max_tokens: int, stream: bool) -> dict:
    body: dict = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        # with logprobs every token is a chunk: the tiny model's tokens are often no text yet, and vLLM's
        # chat stream (so the proxy's too) leaves out chunks that carry nothing else
        body.update({"stream": True, "stream_options": {"include_usage": True}, "logprobs": True})
    return body


def ask(proxy_url: str, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    with post(f"{proxy_url}/v1/chat/completions", chat_body(messages, max_tokens, stream=False)) as r:
        answer = json.loads(r.read())
        return answer["choices"][0]["message"]["content"], dict(r.headers)


def ask_streaming(proxy_url: str, messages: list[dict], max_tokens: int) -> StreamedAnswer:
    with post(f"{proxy_url}/v1/chat/completions", chat_body(messages, max_tokens, stream=True)) as r:
        return StreamedAnswer(list(events(r)), dict(r.headers))


def wait_proxy_sees(proxy_url: str, decode_url: str, healthy: bool) -> None:
    def seen() -> bool:
        try:
            detail = json.loads(urllib.request.urlopen(f"{proxy_url}/health", timeout=5).read())
        except urllib.error.HTTPError as exc:
            detail = json.loads(exc.read())
        return any(b["url"] == decode_url and b["healthy"] == healthy for b in detail["decode"])

    wait_until(seen, timeout=30, what=f"the proxy to see {decode_url} {'up' if healthy else 'down'}")


def test_a_decode_killed_under_its_requests_then_relaunched(served_stack, otlp_receiver):
    proxy = served_stack.proxy_url
    # turn 1 leaves the conversation's blocks on one decode: the proxy sends turn 2 there (the holder)
    messages = [{"role": "user", "content": random_text(300, 41)}]
    first, headers = ask(proxy, messages, 8)
    holder_url = headers["x-kvloop-decode"]
    victim = next(d for d in served_stack.decodes if d.config.url == holder_url)
    survivor_url = next(d.config.url for d in served_stack.decodes if d is not victim)
    messages += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": random_text(60, 42)},
    ]
    short_before, headers = ask(proxy, messages, 16)
    assert headers["x-kvloop-decode"] == holder_url and headers["x-kvloop-attempts"] == "1"
    long_before = ask_streaming(proxy, messages, LONG_ANSWER_TOKENS)
    assert long_before.headers["x-kvloop-decode"] == holder_url
    assert long_before.usage["completion_tokens"] == LONG_ANSWER_TOKENS
    resumes = metric_total(proxy, "kvloop_proxy_retries_total", stage="resume")
    retries = metric_total(proxy, "kvloop_proxy_retries_total", stage="decode")

    failed_streams = metric_total(proxy, "kvloop_proxy_requests_total", outcome="stream_failed")
    try:
        with ThreadPoolExecutor(3) as pool:
            # on the holder: a non-streamed answer (no byte sent yet when its decode dies: the proxy runs
            # it again), a greedy stream the client is reading (it continues elsewhere) and a sampled
            # one (no exact continuation exists: it ends with an error event)
            plain: Future = pool.submit(ask, proxy, messages, LONG_ANSWER_TOKENS)
            wait_until(
                lambda: running_requests(holder_url) >= 1, timeout=60, what="the plain request running"
            )
            greedy = chat_body(messages, LONG_ANSWER_TOKENS, stream=True)
            streams = [ReadingStream(proxy, greedy), ReadingStream(proxy, {**greedy, "temperature": 0.8})]
            reading = [pool.submit(s.read) for s in streams]
            for stream in streams:
                wait_until(stream.read_some.is_set, timeout=60, what="the first chunks of a stream")
            assert running_requests(holder_url) >= 3, "the requests must still be on the decode"
            victim.kill(vllm=True)
            resumed = StreamedAnswer(*reading[0].result(timeout=300))
            sampled, _ = reading[1].result(timeout=300)
            plain_text, plain_headers = plain.result(timeout=300)
        assert sampled[-1] == "[DONE]" and "temperature" in sampled[-2]["error"]["message"], sampled[-2:]
        assert (
            metric_total(proxy, "kvloop_proxy_requests_total", outcome="stream_failed") == failed_streams + 1
        )
        assert resumed.headers["x-kvloop-decode"] == holder_url
        assert resumed.text == long_before.text  # token-exact continuation: the same greedy answer
        for count in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert resumed.usage[count] == long_before.usage[count], (resumed.usage, long_before.usage)
        assert metric_total(proxy, "kvloop_proxy_retries_total", stage="resume") == resumes + 1
        proxy_span = wait_until(
            lambda: next(
                (
                    span
                    for span in otlp_receiver.spans()
                    if span["trace_id"] == resumed.headers["x-kvloop-trace-id"]
                    and span["service"] == "kvloop-proxy"
                    and "kvloop.proxy.resumed" in span["attributes"]
                ),
                None,
            ),
            timeout=30,
            what="the resumed stream's proxy span",
        )
        assert proxy_span["attributes"]["kvloop.proxy.attempts"] == 2
        assert proxy_span["attributes"]["kvloop.proxy.resumed"] == 1
        assert plain_text == long_before.text
        assert plain_headers["x-kvloop-decode"] == survivor_url and plain_headers["x-kvloop-attempts"] == "2"
        assert metric_total(proxy, "kvloop_proxy_retries_total", stage="decode") == retries + 1

        # with the holder gone, the conversation's next requests go to the other decode
        wait_proxy_sees(proxy, holder_url, healthy=False)
        short_after, headers = ask(proxy, messages, 16)
        assert short_after == short_before and headers["x-kvloop-decode"] == survivor_url
        streamed_after = ask_streaming(proxy, messages, 16)
        assert (
            streamed_after.text == short_before and streamed_after.headers["x-kvloop-decode"] == survivor_url
        )
    finally:
        if victim.vllm is None or victim.vllm.poll() is not None:
            victim.relaunch()
        wait_until(victim.ready, timeout=240, what="the relaunched decode", interval=0.5)
        wait_proxy_sees(proxy, holder_url, healthy=True)

    # relaunched on the same port, the proxy uses it again: new conversations (no holder yet) go to
    # the least-loaded decode, round-robin among ties
    served_by: dict[str, int] = {}
    for seed in range(43, 47):
        with post(
            f"{proxy}/v1/chat/completions",
            chat_body([{"role": "user", "content": random_text(100, seed)}], 8, stream=False),
        ) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 8
            decode = r.headers["x-kvloop-decode"]
            served_by[decode] = served_by.get(decode, 0) + 1
    assert set(served_by) == {holder_url, survivor_url}, served_by
