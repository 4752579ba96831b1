"""`kvloop proxy`: an OpenAI-compatible front over vLLM prefill and decode servers.

Per request: the prefill server computes (or pulls, through the kvloop connector) the prompt's KV
and returns a forward handle; a decode server pulls it and streams the answer back. Which decode
worker holds a conversation's blocks is the directory's business (the proxy keeps only Route's
advice for conversations' next turns, continuation.py, which it may lose at any time): the
prefill's connector returns the holder the directory named, with its HTTP endpoint
(`kvloop_holder`, `kvloop_holder_http` in the returned kv_transfer_params), and the proxy prefers
that server for the decode. W3C trace context flows
client -> proxy -> prefill -> decode, so one trace shows the whole turn. A server failing under a
request: the request runs again elsewhere, or its stream continues on another decode (failover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import ssl
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field

import aiohttp
import structlog
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.clients.proxy.backends import Backend, BackendPool, NoBackend
from kvloop.clients.proxy.continuation import ContinuationRoutes
from kvloop.clients.proxy.failover import RETRIES, StreamBroken, StreamState, error_event, sse
from kvloop.clients.proxy.legs import decode_body, prefill_body, whole_request_reason
from kvloop.clients.proxy.prompt_tokens import PromptTokenizers
from kvloop.clients.proxy.routing import Router
from kvloop.common.sd_notify import Notifier
from kvloop.common.security import ClientSecurity
from kvloop.common.tracing import trace_id_hex
from kvloop.common.version import VERSION, publish_build_info

log = structlog.get_logger("kvloop.proxy")
tracer = trace.get_tracer("kvloop.proxy")

REQUESTS = Counter("kvloop_proxy_requests_total", "Proxied requests", ["endpoint", "outcome"])
WHOLE_REQUESTS = Counter(
    "kvloop_proxy_whole_requests_total",
    "Requests sent unchanged to one decode server, which prefills them itself (they cannot be split)",
    ["endpoint", "reason"],
)
TTFT = Histogram(
    "kvloop_proxy_ttft_seconds",
    "Request arrival to first streamed token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PREFILL_SECONDS = Histogram(
    "kvloop_proxy_prefill_seconds",
    "Prefill step duration",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
KVLOOP_PREFIX = "kvloop_"


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    # kvloopd HOST:PORT to rank prefills with (Route); None: the load rule alone.
    directory: str | None = None
    # Its token and TLS (the CLI's --token / --ca-file / --cert-file / --key-file); None: KVLOOP_* env.
    directory_security: ClientSecurity | None = None
    # Deadline of tokenize + Route per request; past it the load rule decides.
    route_timeout_s: float = 0.1
    # Where Route's token ids come from: auto (the model's tokenizer from the directory the servers
    # report as its root, when it is on this host), remote (a prefill's /tokenize), or a tokenizer
    # path or Hugging Face id.
    tokenizer: str = "auto"
    # Runs of one request (prefill + decode) on different servers when a server fails under it,
    # continuations of a broken stream included.
    max_attempts: int = 3
    # With a directory: when a chat turn ends (streamed or not), ask Route about the conversation as it now
    # stands, after this delay (the decode's retention reaches kvloopd meanwhile), and rank its next
    # turn from that answer (routing.py, continuation.py); kept this long. 0: every turn asks Route.
    continuation_delay_s: float = 0.2
    continuation_ttl_s: float = 120.0
    # With a directory: a request that would leave the prefill holding the longest prefix of its
    # prompt waits this long for the rest of its burst, then they are placed together (burst.py).
    # 0: every request is placed as it comes.
    burst_window_s: float = 0.005
    # With a directory: "cost" ranks prefills by Route's expected TTFT (own prefix, the pull it would
    # add, queue); "prefix" sends each request to the prefill holding the longest prefix of its prompt
    # in its own cache, as routers that know only the prefills' caches do (no continuation routes,
    # no burst window).
    route_by: str = "cost"
    # False: prefills use their own prefix cache only, never pulling from a peer (kvloop_pull: false).
    pull: bool = True
    # Keys a client may present (`Authorization: Bearer KEY`) on /v1/* paths, as `vllm serve --api-key`
    # checks them; empty: no check.
    api_keys: list[str] = field(default_factory=list)
    # Keys the prefill and decode servers were started with (`vllm serve --api-key`).
    prefill_api_key: str = field(default="", repr=False)
    decode_api_key: str = field(default="", repr=False)


@dataclass
class _State:
    config: ProxyConfig
    prefill: BackendPool
    decode: BackendPool
    router: Router
    session: aiohttp.ClientSession | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    after_turns: set[asyncio.Task] = field(default_factory=set)  # continuation Routes in flight


class UpstreamError(Exception):
    """A prefill or decode request that failed. `retryable`: the server failed (unreachable, dropped the
    connection, answered 5xx), so another server may succeed; `reason` labels the retry metric.
    `answer`: the server's own error body when it refused the request (4xx), relayed to the client as
    vLLM wrote it."""

    def __init__(
        self,
        status: int,
        message: str,
        backend: Backend | None = None,
        reason: str = "http_4xx",
        retryable: bool = False,
        answer: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.backend = backend
        self.reason = reason
        self.retryable = retryable
        self.answer = answer


def _status_error(backend: Backend, status: int, text: str) -> UpstreamError:
    server_failed = status >= 500
    return UpstreamError(
        502 if server_failed else status,
        f"{backend.role} server {backend.url} answered {status}: {text[:500]}",
        backend,
        reason="http_5xx" if server_failed else "http_4xx",
        retryable=server_failed,
        answer=None if server_failed else text.encode(),
    )


def _connection_error(backend: Backend, exc: Exception) -> UpstreamError:
    reason = "refused" if isinstance(exc, aiohttp.ClientConnectorError) else "disconnected"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        reason = "connect_timeout"
    return UpstreamError(
        502, f"{backend.role} server {backend.url} failed: {exc}", backend, reason=reason, retryable=True
    )


# vLLM's error types by status, for the proxy's own errors
_ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 503: "ServiceUnavailable"}


def _error(status: int, message: str, kind: str | None = None) -> web.Response:
    """An error of the proxy's own, in the shape vLLM's OpenAI server answers errors in."""
    body = {"message": message, "type": kind or _ERROR_TYPES.get(status, "UpstreamError"), "param": None}
    return web.json_response({"error": {**body, "code": status}}, status=status)


def _upstream_error(exc: UpstreamError) -> web.Response:
    """A server's refusal as it wrote it (vLLM's own error object and status), or the proxy's error
    naming the leg that failed."""
    if exc.answer is not None:
        try:
            answer = json.loads(exc.answer)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "error" in answer:
            return web.Response(body=exc.answer, status=exc.status, content_type="application/json")
    return _error(exc.status, str(exc))


async def _post_json(state: _State, backend: Backend, path: str, body: dict, headers: dict) -> dict:
    assert state.session is not None
    try:
        async with state.session.post(
            f"{backend.url}{path}", json=body, headers=backend.headers(headers)
        ) as r:
            text = await r.text()
            if r.status != 200:
                raise _status_error(backend, r.status, text)
            return json.loads(text)
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        raise _connection_error(backend, exc) from None
    except TimeoutError:
        # the whole request's time is spent: not worth another server's
        raise UpstreamError(504, f"{backend.role} server {backend.url} timed out", backend) from None


def _holder_backend(state: _State, kv: dict) -> Backend | None:
    """The decode server holding the conversation's KV, as the prefill's connector reported it
    (the directory's answer carries the holder's HTTP endpoint)."""
    url = kv.get("kvloop_holder_http")
    return state.decode.by_url(url) if isinstance(url, str) and url else None


@dataclass
class _Leg:
    """One placement of a request: the prefill that ran it, the decode to finish it."""

    prefill: Backend
    decode: Backend
    decode_body: dict
    headers: dict[str, str]  # what the client is told about it (x-kvloop-*)


async def _place(state: _State, span: trace.Span, path: str, body: dict, chat: bool) -> _Leg:
    """Route the request to a prefill, run the prefill step, pick the decode (the holder if healthy)."""
    assert state.session is not None
    started = time.perf_counter()
    with tracer.start_as_current_span("kvloop.proxy.route") as rspan:
        choice = await state.router.choose(state.session, body, chat)
        rspan.set_attributes(_route_attributes(choice))
    route_s = time.perf_counter() - started
    prefill = choice.backend
    span.set_attributes(_route_attributes(choice))
    try:
        with tracer.start_as_current_span("kvloop.proxy.prefill", kind=SpanKind.CLIENT) as pspan:
            pspan.set_attribute("kvloop.backend", prefill.url)
            headers: dict[str, str] = {}
            propagate.inject(headers)
            answer = await _post_json(
                state, prefill, path, prefill_body(body, chat, choice.settled, state.config.pull), headers
            )
    finally:
        choice.release()
    prefill_s = time.perf_counter() - started
    PREFILL_SECONDS.observe(prefill_s)
    kv = answer.get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv:
        raise UpstreamError(
            502,
            f"prefill server {prefill.url} returned no kv_transfer_params: is it "
            "started with the kvloop connector (kv_role kv_both)?",
            prefill,
        )
    info = {k: v for k, v in kv.items() if k.startswith(KVLOOP_PREFIX)}
    decode = state.decode.pick(prefer=_holder_backend(state, kv))
    span.set_attributes(
        {
            "kvloop.prefill_backend": prefill.url,
            "kvloop.decode_backend": decode.url,
            "kvloop.prefill_ms": round(prefill_s * 1e3, 3),
            **{
                f"kvloop.{k[len(KVLOOP_PREFIX) :]}": v
                for k, v in info.items()
                if isinstance(v, (str, int, float, bool))
            },
        }
    )
    response_headers = {
        "x-kvloop-route": choice.outcome,
        "x-kvloop-prefill": prefill.url,
        "x-kvloop-decode": decode.url,
        "x-kvloop-prefill-ms": f"{prefill_s * 1e3:.3f}",
        "x-kvloop-route-ms": f"{route_s * 1e3:.3f}",
    }
    if choice.burst_wait_ms:
        response_headers["x-kvloop-burst-wait-ms"] = f"{choice.burst_wait_ms:.3f}"
    if trace_id := trace_id_hex(span):  # so a client can find its turn's trace
        response_headers["x-kvloop-trace-id"] = trace_id
    response_headers.update({f"x-{k.replace('_', '-')}": str(v) for k, v in info.items()})
    # this prefill's handle goes to this decode only: a retry runs its own prefill
    handle = {k: v for k, v in kv.items() if not k.startswith(KVLOOP_PREFIX)}
    return _Leg(prefill, decode, decode_body(body, handle), response_headers)


def _mark_failed(state: _State, exc: UpstreamError) -> None:
    if exc.backend is not None and exc.status in (502, 504):
        pool = state.prefill if exc.backend.role == "prefill" else state.decode
        pool.mark_failed(exc.backend, str(exc))


def _may_retry(state: _State, exc: UpstreamError, attempts: int, stage: str) -> bool:
    """Mark the failed server; True when the request may run again elsewhere (counted and logged)."""
    _mark_failed(state, exc)
    if not exc.retryable or attempts >= state.config.max_attempts:
        return False
    if not any(b.healthy for b in state.prefill.backends) or not any(
        b.healthy for b in state.decode.backends
    ):
        return False
    RETRIES.labels(stage, exc.reason).inc()
    trace.get_current_span().add_event(
        "kvloop.proxy.retry",
        {
            "kvloop.stage": stage,
            "kvloop.reason": exc.reason,
            "kvloop.backend": exc.backend.url if exc.backend else "",
        },
    )
    log.warning(
        "upstream failed; retrying on another server",
        stage=stage,
        reason=exc.reason,
        attempt=attempts,
        error=str(exc),
    )
    return True


@contextlib.contextmanager
def _decoding(decode: Backend) -> Iterator[trace.Span]:
    decode.in_flight += 1
    try:
        with tracer.start_as_current_span("kvloop.proxy.decode", kind=SpanKind.CLIENT) as dspan:
            dspan.set_attribute("kvloop.backend", decode.url)
            yield dspan
    finally:
        decode.in_flight -= 1


async def _handle(request: web.Request, chat: bool) -> web.StreamResponse:
    state: _State = request.app["state"]
    endpoint = "chat" if chat else "completions"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = await request.read()
    try:
        body = json.loads(raw)
        whole = whole_request_reason(body, chat)
    except (ValueError, UnicodeDecodeError):
        whole = "the body is not valid JSON"
    if whole is not None:
        # vLLM judges (and refuses) it exactly as an aggregated server would
        return await _relay(request, state, state.decode, path, raw, endpoint, whole)
    stream = bool(body.get("stream"))
    started = time.perf_counter()
    parent = propagate.extract(request.headers)
    with tracer.start_as_current_span(f"kvloop.proxy {path}", context=parent, kind=SpanKind.SERVER) as span:
        span.set_attributes(
            {"http.route": path, "kvloop.stream": stream, "gen_ai.request.model": str(body.get("model", ""))}
        )
        attempts = 0
        try:
            while True:
                attempts += 1
                span.set_attribute("kvloop.proxy.attempts", attempts)
                stage = "prefill"
                try:
                    leg = await _place(state, span, path, body, chat)
                    leg.headers["x-kvloop-attempts"] = str(attempts)
                    stage = "decode"
                    if stream:
                        return await _stream(
                            request,
                            state,
                            span,
                            leg,
                            path,
                            StreamState(chat, body),
                            started,
                            endpoint,
                            attempts,
                        )
                    keeps = chat and state.router.keeps_turns
                    with _decoding(leg.decode):
                        headers: dict[str, str] = {}
                        propagate.inject(headers)
                        decode_body = (
                            {**leg.decode_body, "return_token_ids": True} if keeps else leg.decode_body
                        )
                        result = await _post_json(state, leg.decode, path, decode_body, headers)
                    if keeps:
                        result = _after_answer(state, body, result)
                    if result.get("kv_transfer_params") is not None:
                        # the decode's retention handle is the proxy's business: a plain server answers none
                        result = {**result, "kv_transfer_params": None}
                    REQUESTS.labels(endpoint, "ok").inc()
                    return web.json_response(result, headers=leg.headers)
                except UpstreamError as exc:
                    if not _may_retry(state, exc, attempts, stage):
                        raise
        except NoBackend as exc:
            REQUESTS.labels(endpoint, "no_backend").inc()
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            return _error(503, str(exc))
        except UpstreamError as exc:
            REQUESTS.labels(endpoint, f"upstream_{exc.status}").inc()
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            log.warning("upstream failed", error=str(exc), status=exc.status, attempts=attempts)
            return _upstream_error(exc)


async def _relay(
    request: web.Request,
    state: _State,
    pool: BackendPool,
    path: str,
    raw: bytes,
    endpoint: str,
    why: str,
) -> web.StreamResponse:
    """Send the client's request unchanged to one server of `pool` and relay its answer as it comes
    (status, body, streamed chunks). While nothing has reached the client, a server that fails
    (unreachable, 5xx) is replaced by another; a stream that breaks later ends there."""
    assert state.session is not None
    parent = propagate.extract(request.headers)
    with tracer.start_as_current_span(f"kvloop.proxy {path}", context=parent, kind=SpanKind.SERVER) as span:
        span.set_attributes({"http.route": path, "kvloop.route": "whole", "kvloop.whole_reason": why})
        if endpoint in ("chat", "completions"):
            WHOLE_REQUESTS.labels(endpoint, why).inc()
        attempts = 0
        while True:
            attempts += 1
            try:
                backend = pool.pick()
            except NoBackend as exc:
                REQUESTS.labels(endpoint, "no_backend").inc()
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                return _error(503, str(exc))
            headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
            propagate.inject(headers)
            backend.in_flight += 1
            try:
                try:
                    upstream = await state.session.post(
                        f"{backend.url}{path}", data=raw, headers=backend.headers(headers)
                    )
                except aiohttp.ClientConnectionError as exc:
                    failed = _connection_error(backend, exc)
                    pool.mark_failed(backend, str(failed))
                    if attempts < state.config.max_attempts:
                        RETRIES.labels("whole", failed.reason).inc()
                        continue
                    return _upstream_error(failed)
                async with upstream:
                    if upstream.status >= 500 and attempts < state.config.max_attempts:
                        pool.mark_failed(backend, f"{path} answered {upstream.status}")
                        RETRIES.labels("whole", "http_5xx").inc()
                        continue
                    response = web.StreamResponse(
                        status=upstream.status,
                        headers={
                            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                            "x-kvloop-route": "whole",
                            f"x-kvloop-{pool.role}": backend.url,
                            "x-kvloop-attempts": str(attempts),
                        },
                    )
                    await response.prepare(request)
                    try:
                        async for chunk in upstream.content.iter_any():
                            await response.write(chunk)
                    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                        log.warning("server broke a relayed answer", backend=backend.url, error=str(exc))
                        REQUESTS.labels(endpoint, "stream_failed").inc()
                        return response
                    await response.write_eof()
                    outcome = "ok" if upstream.status == 200 else f"upstream_{upstream.status}"
                    REQUESTS.labels(endpoint, outcome).inc()
                    return response
            finally:
                backend.in_flight -= 1


def _route_attributes(choice) -> dict[str, str | int | float]:
    attributes: dict[str, str | int | float] = {"kvloop.route": choice.outcome}
    if choice.score is not None:
        attributes.update(
            {
                "kvloop.route.expected_ttft_ms": round(choice.expected_ttft_ms, 3),
                "kvloop.route.local_blocks": choice.score.local_blocks,
                "kvloop.route.pull_blocks": choice.score.pull_blocks,
                "kvloop.route.compute_tokens": choice.score.compute_tokens,
                "kvloop.route.pull_wait_ms": round(choice.score.pull_wait_ms, 3),
                "kvloop.route.prefill_tokens_per_s": round(choice.score.prefill_tokens_per_s, 1),
            }
        )
        if choice.settled is not None:
            attributes["kvloop.route.settled"] = choice.settled
        if choice.burst_wait_ms:
            attributes["kvloop.route.burst_wait_ms"] = round(choice.burst_wait_ms, 3)
    return attributes


async def _events(state: _State, backend: Backend, path: str, body: dict) -> AsyncGenerator[dict, None]:
    """The chunks of a streamed decode, parsed. UpstreamError: it never started (no chunk yet: the
    request can run again elsewhere); StreamBroken: it ended before `data: [DONE]`."""
    assert state.session is not None
    headers: dict[str, str] = {}
    propagate.inject(headers)
    try:
        upstream = await state.session.post(
            f"{backend.url}{path}", json=body, headers=backend.headers(headers)
        )
    except aiohttp.ClientConnectionError as exc:
        raise _connection_error(backend, exc) from None
    except TimeoutError:
        raise UpstreamError(504, f"decode server {backend.url} timed out", backend) from None
    async with upstream:
        if upstream.status != 200:
            raise _status_error(backend, upstream.status, await upstream.text())
        try:
            async for line in upstream.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise StreamBroken(
                "disconnected", f"decode server {backend.url} broke the stream: {exc}"
            ) from None
        except TimeoutError:
            raise StreamBroken("timeout", f"decode server {backend.url} timed out mid-stream") from None
        except BaseException:
            # the client left (GeneratorExit, cancellation): dropping the connection makes vLLM abort
            upstream.close()
            raise
    raise StreamBroken("disconnected", f"decode server {backend.url} ended the stream without [DONE]")


async def _stream(
    request: web.Request,
    state: _State,
    span: trace.Span,
    leg: _Leg,
    path: str,
    stream: StreamState,
    started: float,
    endpoint: str,
    attempts: int,
) -> web.StreamResponse:
    """Stream the decode's answer. Until its first chunk nothing has reached the client and a failure
    is the caller's to retry; after it, a broken stream continues on another decode."""
    broken: StreamBroken | None = None
    try:
        with _decoding(leg.decode):
            async with contextlib.aclosing(
                _events(state, leg.decode, path, stream.upstream_body(leg.decode_body))
            ) as events:
                try:
                    first = await anext(events)
                except (StopAsyncIteration, StreamBroken) as exc:
                    reason = exc.reason if isinstance(exc, StreamBroken) else "disconnected"
                    raise UpstreamError(
                        502,
                        f"decode server {leg.decode.url} failed before its first chunk: {exc}",
                        leg.decode,
                        reason=reason,
                        retryable=True,
                    ) from None
                response = web.StreamResponse(
                    headers={**leg.headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
                TTFT.observe(time.perf_counter() - started)
                span.add_event("first_chunk")
                if (out := stream.forward(first)) is not None:
                    await response.write(sse(out))
                try:
                    async for chunk in events:
                        if (out := stream.forward(chunk)) is not None:
                            await response.write(sse(out))
                except StreamBroken as exc:
                    broken = exc
        if broken is not None:
            _mark_failed(state, UpstreamError(502, str(broken), leg.decode))
            if not await _resume(request, response, state, span, stream, broken, attempts):
                REQUESTS.labels(endpoint, "stream_failed").inc()
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
        await response.write(b"data: [DONE]\n\n")
        _after_turn(state, stream)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
        # The client went away: closing the upstream response (aclosing above) makes vLLM abort the request.
        REQUESTS.labels(endpoint, "client_disconnected").inc()
        log.info("client disconnected mid-stream; upstream request cancelled", decode=leg.decode.url)
        raise
    await response.write_eof()
    REQUESTS.labels(endpoint, "ok").inc()
    return response


def _after_turn(state: _State, stream: StreamState) -> None:
    """A chat stream answered whole by one decode: Route about the conversation, ahead of its next
    turn (in the background)."""
    if not (stream.chat and stream.finished and not stream.resumed and stream.prompt_token_ids):
        return
    _turn_ended(
        state, stream.body, "".join(stream.answer_parts), [*stream.prompt_token_ids, *stream.sent_token_ids]
    )


def _after_answer(state: _State, body: dict, result: dict) -> dict:
    """A chat turn answered whole (not streamed), its token ids asked of the decode: Route about the
    conversation ahead of its next turn, as after a stream. The answer the client gets has token ids
    only if it asked for them."""
    choices = result.get("choices")
    choice = choices[0] if isinstance(choices, list) and len(choices) == 1 else None
    message = choice.get("message") if isinstance(choice, dict) else None
    prompt_ids = result.get("prompt_token_ids")
    answer_ids = choice.get("token_ids") if isinstance(choice, dict) else None
    if (
        isinstance(message, dict)
        and isinstance(message.get("content"), str)
        and not message.get("tool_calls")
        and isinstance(prompt_ids, list)
        and isinstance(answer_ids, list)
    ):
        _turn_ended(state, body, message["content"], [*prompt_ids, *answer_ids])
    if body.get("return_token_ids"):
        return result
    # as the decode answers without them
    out = {**result, "prompt_token_ids": None} if "prompt_token_ids" in result else dict(result)
    if isinstance(choices, list):
        out["choices"] = [
            {**c, "token_ids": None} if isinstance(c, dict) and "token_ids" in c else c for c in choices
        ]
    return out


def _turn_ended(state: _State, body: dict, answer: str, token_ids: list[int]) -> None:
    task = asyncio.create_task(
        state.router.turn_ended(body, answer, token_ids, state.config.continuation_delay_s)
    )
    state.after_turns.add(task)
    task.add_done_callback(state.after_turns.discard)


async def _resume(
    request: web.Request,
    response: web.StreamResponse,
    state: _State,
    span: trace.Span,
    stream: StreamState,
    broken: StreamBroken,
    attempts: int,
) -> bool:
    """Finish a stream whose decode broke after the client got part of it: continue the answer on
    another decode (again if that one breaks too, within max_attempts). False: it ended with an error
    event instead."""
    while True:
        log.warning(
            "decode stream broke mid-answer",
            reason=broken.reason,
            error=str(broken),
            tokens_sent=len(stream.sent_token_ids),
            attempt=attempts,
        )
        span.add_event("kvloop.proxy.stream_broken", {"kvloop.reason": broken.reason})
        if stream.finished or stream.remaining_tokens() == 0:
            if not stream.finished:
                await response.write(sse(stream.length_finish()))
            break
        why = stream.unresumable_reason()
        if why is None and attempts >= state.config.max_attempts:
            why = f"{attempts} attempts made"
        if why is not None:
            return await _give_up(response, span, stream, f"cannot continue the answer: {why}")
        RETRIES.labels("resume", broken.reason).inc()
        attempts += 1
        stream.resumed += 1
        span.set_attributes({"kvloop.proxy.attempts": attempts, "kvloop.proxy.resumed": stream.resumed})
        try:
            leg = await _place(state, span, "/v1/completions", stream.resume_body(), chat=False)
            log.info(
                "continuing the answer",
                decode=leg.decode.url,
                prefill=leg.prefill.url,
                attempt=attempts,
                tokens_sent=len(stream.sent_token_ids),
            )
            with _decoding(leg.decode):
                async with contextlib.aclosing(
                    _events(state, leg.decode, "/v1/completions", leg.decode_body)
                ) as events:
                    async for chunk in events:
                        if (out := stream.translate(chunk)) is not None:
                            await response.write(sse(out))
            break
        except StreamBroken as exc:
            _mark_failed(state, UpstreamError(502, str(exc), leg.decode))
            broken = exc
        except UpstreamError as exc:
            _mark_failed(state, exc)
            if not exc.retryable:
                return await _give_up(response, span, stream, str(exc), exc.status)
            broken = StreamBroken(exc.reason, str(exc))
        except NoBackend as exc:
            return await _give_up(response, span, stream, str(exc), 503)
    if stream.client_wants_usage and not stream.usage_sent:
        await response.write(sse(stream.usage_chunk()))
    log.info("stream completed after a break", attempts=attempts, resumed=stream.resumed)
    return True


async def _give_up(
    response: web.StreamResponse, span: trace.Span, stream: StreamState, message: str, status: int = 502
) -> bool:
    span.set_status(Status(StatusCode.ERROR, message))
    log.error("stream ended with an error", error=message, tokens_sent=len(stream.sent_token_ids))
    await response.write(error_event(message, status))
    return False


async def _models(request: web.Request) -> web.Response:
    """The served models as the servers list them (max_model_len, root, parent and the rest), each once."""
    state: _State = request.app["state"]
    cards: dict[str, dict] = {}
    for pool in (state.prefill, state.decode):
        for backend in pool.backends:
            for card in backend.cards:
                cards.setdefault(str(card.get("id")), card)
    return web.json_response({"object": "list", "data": [cards[k] for k in sorted(cards)]})


async def _tokens(request: web.Request) -> web.StreamResponse:
    """vLLM's /tokenize and /detokenize, answered by a prefill server."""
    state: _State = request.app["state"]
    endpoint = request.path.strip("/")
    return await _relay(request, state, state.prefill, request.path, await request.read(), endpoint, "")


# Paths `vllm serve --api-key` guards (vllm/entrypoints/serve/middleware/authenticate.py).
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")


def _key_digests(keys: list[str]) -> list[bytes]:
    return [hashlib.sha256(k.encode()).digest() for k in keys if k]


@web.middleware
async def _authenticate(request: web.Request, handler) -> web.StreamResponse:
    """`Authorization: Bearer KEY` on the paths vLLM guards, answered as vLLM answers a wrong key."""
    digests: list[bytes] = request.app["api_key_digests"]
    if digests and request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIX):
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        given = hashlib.sha256(key.encode()).digest()
        matched = False
        for digest in digests:
            matched |= hmac.compare_digest(given, digest)
        if scheme.lower() != "bearer" or not matched:
            REQUESTS.labels("auth", "unauthorized").inc()
            return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


async def _health(request: web.Request) -> web.Response:
    state: _State = request.app["state"]
    detail = {
        pool.role: [
            {"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "error": b.last_error}
            for b in pool.backends
        ]
        for pool in (state.prefill, state.decode)
    }
    ok = any(b.healthy for b in state.prefill.backends) and any(b.healthy for b in state.decode.backends)
    body = {"status": "ok" if ok else "unavailable", **detail}
    if state.router.directory is not None:  # --route: where its token ids come from, per model
        body["tokenizers"] = state.router.tokenizers.status()
    return web.json_response(body, status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


ROUTE_BY = ("cost", "prefix")


def build_app(config: ProxyConfig) -> web.Application:
    if not config.prefill or not config.decode:
        raise ValueError("the proxy needs at least one prefill and one decode server")
    if config.route_by not in ROUTE_BY:
        raise ValueError(f"route_by {config.route_by!r} is not one of {', '.join(ROUTE_BY)}")
    by_cost = config.route_by == "cost"
    keeps_turns = by_cost and config.continuation_ttl_s > 0
    prefill = BackendPool("prefill", config.prefill, config.health_interval_s, config.prefill_api_key)
    state = _State(
        config,
        prefill,
        BackendPool("decode", config.decode, config.health_interval_s, config.decode_api_key),
        Router(
            prefill,
            None,
            config.route_timeout_s,
            PromptTokenizers(config.tokenizer),
            ContinuationRoutes(config.continuation_ttl_s) if keeps_turns else None,
            config.burst_window_s if by_cost else 0.0,
            by_prefix=not by_cost,
        ),
    )
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_authenticate])
    app["state"] = state
    app["api_key_digests"] = _key_digests(config.api_keys)

    async def lifecycle(app: web.Application):
        state.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=config.request_timeout_s, sock_connect=config.connect_timeout_s
            )
        )
        if config.directory:
            state.router.directory = AsyncDirectoryClient(
                config.directory, config.directory_security, timeout=config.route_timeout_s
            )
        if state.router.directory is not None:
            # Load the served models' tokenizers before requests come: as soon as a prefill names its
            # models, at start-up or at a later health check when it was not up (or too slow) then.
            def load_tokenizers(backend: Backend) -> None:
                for model, root in backend.roots.items():
                    state.router.tokenizers.get(model, root)

            state.prefill.on_models = load_tokenizers
        await asyncio.gather(state.prefill.check_all(state.session), state.decode.check_all(state.session))
        state.tasks = [
            asyncio.create_task(state.prefill.keep_checking(state.session)),
            asyncio.create_task(state.decode.keep_checking(state.session)),
        ]
        yield
        for task in [*state.tasks, *state.after_turns]:
            task.cancel()
        await state.session.close()
        if state.router.directory is not None:
            await state.router.directory.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", lambda r: _handle(r, chat=True))
    app.router.add_post("/v1/completions", lambda r: _handle(r, chat=False))
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", _tokens)
    app.router.add_post("/detokenize", _tokens)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def serve(
    config: ProxyConfig, host: str, port: int, stop: asyncio.Event, tls: ssl.SSLContext | None = None
) -> None:
    publish_build_info("kvloop-proxy")
    runner = web.AppRunner(build_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    await site.start()
    log.info(
        "kvloop proxy listening",
        version=VERSION,
        listen=f"{host}:{port}",
        tls=tls is not None,
        prefill=config.prefill,
        decode=config.decode,
        directory=config.directory,
    )
    # systemd (Type=notify): ready once the port accepts; the watchdog is pinged from this loop.
    notifier = Notifier()
    notifier.ready(f"serving on {host}:{port}")
    pinging = notifier.start_watchdog()
    try:
        await stop.wait()
    finally:
        notifier.stopping()
        pinging.cancel()
        await runner.cleanup()
        notifier.close()
