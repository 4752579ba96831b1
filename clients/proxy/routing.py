"""The proxy's prefill choice: kvloopd's Route ranking when it answers in time, the load rule otherwise.

Per request the proxy tokenizes the prompt on a prefill server (vLLM's ``/tokenize``, the same
rendering the completion will use), asks Route with the token ids and every healthy prefill with its
in-flight requests and the prompt tokens they still compute (as this proxy estimated them), and takes
the best. Ties (Route's ``tied`` > 1) are decided by the load rule among the tied; no directory, an
error, a deadline missed or a prefill Route does not know fall back to the load rule over all, and
the outcome names which (``kvloop_proxy_route_total{outcome}``, span attribute ``kvloop.route``,
header ``x-kvloop-route``).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import aiohttp
import structlog
from prometheus_client import Counter, Histogram

from kvloop.clients.client import AsyncDirectoryClient, DaemonUnavailable, KvloopError
from kvloop.clients.proxy.backends import Backend, BackendPool
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.proxy")

ROUTES = Counter(
    "kvloop_proxy_route_total",
    "How the proxy chose each request's prefill: route (Route's best), tie (the load rule among Route's "
    "tied best), or load_<why> (the load rule: no_directory, single_candidate, tokenize_failed, timeout, "
    "unavailable, error, unknown_candidate)",
    ["outcome"],
)
ROUTE_SECONDS = Histogram(
    "kvloop_proxy_route_seconds",
    "Tokenize + Route time per request, as the proxy waited for it",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
)


@dataclass
class Choice:
    backend: Backend
    outcome: str  # "route", "tie" or "load_<why>"
    score: pb.RouteScore | None = None  # Route's estimate for the chosen backend
    prompt_tokens: int = 0

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens this request adds to its prefill's queue (what it will compute there)."""
        return self.score.compute_tokens if self.score is not None else self.prompt_tokens


class Router:
    def __init__(self, pool: BackendPool, directory: AsyncDirectoryClient | None, timeout_s: float) -> None:
        self.pool = pool
        self.directory = directory
        self.timeout_s = timeout_s
        self._tokenize_turn = itertools.count()

    def _load(self, why: str, among: list[Backend] | None = None, prompt_tokens: int = 0) -> Choice:
        backend = self.pool.pick(among=among)
        outcome = why if why == "tie" else f"load_{why}"
        ROUTES.labels(outcome).inc()
        return Choice(backend, outcome, prompt_tokens=prompt_tokens)

    async def choose(self, session: aiohttp.ClientSession, body: dict, chat: bool) -> Choice:
        if self.directory is None:
            return self._load("no_directory")
        healthy = [b for b in self.pool.backends if b.healthy]
        if len(healthy) < 2:
            return self._load("single_candidate")
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(self.timeout_s):
                tokens = await self._tokenize(session, healthy, body, chat)
                if tokens is None:
                    return self._load("tokenize_failed")
                answer = await self.directory.route(
                    str(body.get("model", "")),
                    [
                        pb.RouteCandidate(
                            http_endpoint=b.url, in_flight_requests=b.in_flight, queued_tokens=b.queued_tokens
                        )
                        for b in healthy
                    ],
                    token_ids=tokens,
                    cache_salt=str(body.get("cache_salt") or ""),
                    timeout=max(0.001, self.timeout_s - (loop.time() - started)),
                )
        except TimeoutError:
            return self._load("timeout")
        except DaemonUnavailable as exc:
            log.debug("route unavailable", error=str(exc))
            return self._load("unavailable")
        except KvloopError as exc:
            log.warning("route refused", error=str(exc))
            return self._load("error")
        finally:
            ROUTE_SECONDS.observe(loop.time() - started)
        by_url = {b.url: b for b in healthy}
        tied = [by_url.get(s.http_endpoint.rstrip("/")) for s in answer.ranked[: max(answer.tied, 1)]]
        if any(b is None for b in tied):
            return self._load("unknown_candidate", prompt_tokens=len(tokens))
        scores = {s.http_endpoint.rstrip("/"): s for s in answer.ranked}
        if len(tied) > 1:
            choice = self._load("tie", among=[b for b in tied if b is not None], prompt_tokens=len(tokens))
            choice.score = scores[choice.backend.url]
            return choice
        best = tied[0]
        assert best is not None
        ROUTES.labels("route").inc()
        return Choice(best, "route", scores[best.url], len(tokens))

    async def _tokenize(
        self, session: aiohttp.ClientSession, healthy: list[Backend], body: dict, chat: bool
    ) -> list[int] | None:
        """The prompt's token ids from a prefill server's /tokenize (vLLM renders chat messages with
        the model's template there, as for the completion)."""
        # Round-robin of its own: taking the pool's would make every tie-break after it land on the
        # same server.
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt  # already token ids (a continuation of a broken stream)
        backend = healthy[next(self._tokenize_turn) % len(healthy)]
        request = {"model": body.get("model")}
        if chat:
            request.update(
                {k: body[k] for k in ("messages", "chat_template_kwargs", "tools") if body.get(k) is not None}
            )
        else:
            request["prompt"] = body.get("prompt")
        try:
            async with session.post(f"{backend.url}/tokenize", json=request) as r:
                if r.status != 200:
                    log.warning("tokenize failed", backend=backend.url, status=r.status)
                    return None
                tokens = (await r.json()).get("tokens")
        except (aiohttp.ClientError, ValueError) as exc:
            log.warning("tokenize failed", backend=backend.url, error=str(exc))
            return None
        return tokens if isinstance(tokens, list) and tokens else None
