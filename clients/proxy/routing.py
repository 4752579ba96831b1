"""The proxy's prefill choice: kvloopd's Route ranking when it answers in time, the load rule otherwise.

Per request the proxy tokenizes the prompt (with the model's own tokenizer in this process when it
can, see prompt_tokens; else on a prefill server, vLLM's ``/tokenize``), asks Route with the token ids
and every healthy prefill with its in-flight requests and the prompt tokens they still compute (as
this proxy estimated them), re-ranks the answer with those queues as they are when it arrives
(``rank_now``) and counts the request into its prefill's queue before another request is ranked.
Ties are decided by the load rule among the tied; no directory, an error, a deadline missed or a
prefill Route does not know fall back to the load rule over all, and the outcome names which
(``kvloop_proxy_route_total{outcome}``, span attribute ``kvloop.route``, header ``x-kvloop-route``).

A chat request that continues a conversation whose last turn went through this proxy is ranked
from the answer Route gave for that conversation when the turn ended (continuation.py): no
tokenizing and no Route on its path (outcomes ``continuation`` and ``continuation_tie``). One that
edited that conversation's history is ranked from the same answer shortened to the messages it
kept (``history_prefix``, ``history_prefix_tie``).

A request that would leave the prefill holding the longest prefix of its prompt waits a few
milliseconds for the rest of its burst, and those that waited are placed together (burst.py).

Ranked by prefix instead (``by_prefix``, `kvloop proxy --route-by prefix`), a request goes to the
prefill whose own cache holds the longest prefix of its prompt, as routers that know only the
prefills' caches choose (llm-d's, Dynamo's), the load rule deciding among equals (outcomes
``prefix``, ``prefix_tie``, and ``prefix_miss`` when no prefill holds any of it): the same Route
call answers it, its pull estimates unused.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog
from prometheus_client import Counter, Histogram

from kvloop.clients.directory_client import AsyncDirectoryClient, DaemonUnavailable, KvloopError
from kvloop.clients.proxy.backends import Backend, BackendPool
from kvloop.clients.proxy.burst import BurstWindow, holds_longest_prefix, place_together
from kvloop.clients.proxy.continuation import CONTINUATION_ROUTES, ContinuationRoutes
from kvloop.clients.proxy.prompt_tokens import PromptTokenizers
from kvloop.common.route_estimate import queue_ms, settled_without_pull, tie_margin_ms
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.proxy")

ROUTES = Counter(
    "kvloop_proxy_route_total",
    "How the proxy chose each request's prefill: route (Route's best), tie (the load rule among Route's "
    "tied best), prefix / prefix_tie / prefix_miss (the longest own prefix, --route-by prefix), "
    "continuation / continuation_tie (the same from Route's answer for the conversation "
    "the request continues, asked when its last turn ended), history_prefix / history_prefix_tie (that "
    "answer shortened to the messages a request that edited the history shares with it), or "
    "load_<why> (the load rule: "
    "no_directory, single_candidate, tokenize_failed, timeout, unavailable, error, unknown_candidate)",
    ["outcome"],
)
TOKENIZED = Counter(
    "kvloop_proxy_tokenized_total",
    "Where the proxy tokenized prompts for Route: local (the model's tokenizer in the proxy) or server "
    "(a prefill's /tokenize: no local tokenizer, or a prompt it does not render as vLLM would)",
    ["where"],
)
CONTINUATIONS = Counter(
    "kvloop_proxy_continuation_routes_total",
    "Route answers asked for conversations when a chat turn ended: kept, used by the next turn, "
    "used_prefix (shortened, by a turn that edited the history), or failed (Route refused or "
    "unreachable; the next turn asks Route itself)",
    ["outcome"],
)
BURST_WAITS = Counter(
    "kvloop_proxy_burst_waits_total",
    "Requests whose best prefill by the queues would not have been one holding the longest prefix of "
    "their prompt, so they waited for the rest of their burst, by where they were placed then: home "
    "(a prefill holding that prefix after all) or away",
    ["placed"],
)
ROUTE_SECONDS = Histogram(
    "kvloop_proxy_route_seconds",
    "Tokenize + Route time per request, as the proxy waited for it",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
)


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    score: pb.RouteScore
    expected_ttft_ms: float  # Route's transfer + pull wait + compute, after the candidate's queue now


def rank_now(
    answer: pb.RouteResponse, queue: Callable[[str], tuple[int, int]]
) -> tuple[list[RankedCandidate], int]:
    """Route's ranking again with each candidate's queue as the router knows it now, and how many
    lead within Route's tie margin. kvloopd ranked with the queues the request was sent with; the
    requests routed while it was in flight are not in them, so every request of a burst (sessions
    that send together) would go to the same best candidate. `queue(http_endpoint)` gives (requests
    in flight, prompt tokens they still compute)."""
    prompt_tokens = answer.prompt_tokens
    ranked = []
    for score in answer.ranked:
        in_flight, queued = queue(score.http_endpoint)
        waiting = queue_ms(queued, in_flight, prompt_tokens, score.prefill_tokens_per_s)
        ranked.append(
            RankedCandidate(score, waiting + score.transfer_ms + score.pull_wait_ms + score.compute_ms)
        )
    ranked.sort(key=lambda r: r.expected_ttft_ms)  # stable: equal estimates keep Route's order
    if not ranked:
        return ranked, 0
    best = ranked[0].expected_ttft_ms
    margin = tie_margin_ms(best, answer.tie_floor_ms, answer.tie_ratio)
    return ranked, sum(1 for r in ranked if r.expected_ttft_ms - best <= margin)


def among_tied(tied: list[RankedCandidate], in_flight: Callable[[str], int]) -> list[RankedCandidate]:
    """Of candidates Route cannot tell apart, those to pick from round-robin: the least loaded, then
    of those the ones that pull the fewest blocks (a READ also costs the holder's decode time, which
    the estimate leaves out, and a local prefix keeps the conversation where its cache is)."""
    least = min(in_flight(r.score.http_endpoint) for r in tied)
    idle = [r for r in tied if in_flight(r.score.http_endpoint) == least]
    fewest = min(r.score.pull_blocks for r in idle)
    return [r for r in idle if r.score.pull_blocks == fewest]


@dataclass
class Choice:
    backend: Backend
    # "route", "tie", "continuation", "history_prefix" (or either's "_tie"), "prefix", "prefix_tie",
    # "prefix_miss" or "load_<why>"
    outcome: str
    score: pb.RouteScore | None = None  # Route's estimate for the chosen backend
    prompt_tokens: int = 0
    expected_ttft_ms: float = 0.0  # with the queue as it was when chosen
    # Tokens beyond the history Route scored (a continuation: the new messages, estimated)
    new_tokens: int = 0
    burst_wait_ms: float = 0.0  # waited for the rest of its burst before it was placed (burst.py)
    # A prefix choice counts on no pull: it computes all its own cache lacks, not Route's estimate.
    compute_tokens: int | None = None
    reserved: bool = False

    @property
    def settled(self) -> str | None:
        """Route's reason when it left nothing to pull for the chosen prefill: its connector then
        skips the Lookup (see route_estimate.ROUTE_SETTLED_KEY). Not for a continuation: its answer
        is as old as the turn before, and a decode's retention may have landed after it. A history
        prefix may settle: what follows its shared messages is new, so no peer's retention holds it."""
        if self.score is None or self.outcome in CONTINUATION_ROUTES:
            return None
        return settled_without_pull(self.score)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens this request adds to its prefill's queue (what it will compute there)."""
        if self.compute_tokens is not None:
            return self.compute_tokens
        if self.score is None:
            return self.prompt_tokens
        return self.score.compute_tokens + self.new_tokens

    def reserve(self) -> None:
        assert not self.reserved, "a choice is counted into its prefill's queue once"
        self.reserved = True
        self.backend.in_flight += 1
        self.backend.queued_tokens += self.queued_tokens

    def release(self) -> None:
        """The request's prefill step is over (done or failed): out of its prefill's queue."""
        self.reserved = False
        self.backend.in_flight -= 1
        self.backend.queued_tokens -= self.queued_tokens


@dataclass
class _Waiting:
    """A request waiting for the rest of its burst, and its choice once the window closed (None: its
    Route answer no longer ranks the healthy prefills)."""

    answer: pb.RouteResponse
    outcome: str
    prompt_tokens: int
    new_tokens: int
    started: float
    choice: Choice | None = None


class Router:
    def __init__(
        self,
        pool: BackendPool,
        directory: AsyncDirectoryClient | None,
        timeout_s: float,
        tokenizers: PromptTokenizers | None = None,
        continuations: ContinuationRoutes | None = None,
        burst_window_s: float = 0.0,
        by_prefix: bool = False,
    ) -> None:
        self.pool = pool
        self.by_prefix = by_prefix
        self.directory = directory
        self.timeout_s = timeout_s
        self.tokenizers = tokenizers or PromptTokenizers()
        self.continuations = continuations
        # 0: every request is placed as it comes (burst.py)
        self.burst = BurstWindow(burst_window_s, self._place_waiting) if burst_window_s > 0 else None
        self._tokenize_turn = itertools.count()

    @property
    def keeps_turns(self) -> bool:
        """Whether a chat turn's answer is kept for the conversation's next turn (turn_ended): that
        needs the continuation table and a directory to ask Route, and ranking by Route's estimates
        (a prefix choice asks Route on every request's path)."""
        return self.continuations is not None and self.directory is not None and not self.by_prefix

    def _load(self, why: str, among: list[Backend] | None = None, prompt_tokens: int = 0) -> Choice:
        backend = self.pool.pick(among=among)
        outcome = why if why.endswith("tie") else f"load_{why}"
        return Choice(backend, outcome, prompt_tokens=prompt_tokens)

    async def choose(self, session: aiohttp.ClientSession, body: dict, chat: bool) -> Choice:
        """The request's prefill, already counted into that prefill's queue (in-flight requests and
        the tokens it computes there) when this returns, so the next request is ranked with it; the
        caller releases it when the prefill step ends."""
        choice = await self._choose(session, body, chat)
        if not choice.reserved:  # a burst's placement reserved it already
            choice.reserve()  # no await since the choice: no other request was ranked in between
        ROUTES.labels(choice.outcome).inc()
        return choice

    async def _choose(self, session: aiohttp.ClientSession, body: dict, chat: bool) -> Choice:
        if self.directory is None:
            return self._load("no_directory")
        healthy = [b for b in self.pool.backends if b.healthy]
        if len(healthy) < 2:
            return self._load("single_candidate")
        if chat and self.keeps_turns:
            assert self.continuations is not None  # keeps_turns, narrowed
            continued = self.continuations.take(
                str(body.get("model", "")), str(body.get("cache_salt") or ""), body["messages"]
            )
            if continued is not None:
                prompt_tokens = continued.answer.prompt_tokens + continued.new_tokens  # as the bench counts
                choice = await self._placed(
                    continued.answer, healthy, continued.outcome, prompt_tokens, continued.new_tokens
                )
                if choice is not None:  # else a prefill came or went since: ask Route
                    CONTINUATIONS.labels(
                        "used" if continued.outcome == "continuation" else "used_prefix"
                    ).inc()
                    return choice
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
        if self.by_prefix:
            choice = self._longest_prefix(answer, healthy, len(tokens))
        else:
            choice = await self._placed(answer, healthy, "route", len(tokens))
        return choice if choice is not None else self._load("unknown_candidate", prompt_tokens=len(tokens))

    async def _placed(
        self,
        answer: pb.RouteResponse,
        healthy: list[Backend],
        outcome: str,
        prompt_tokens: int,
        new_tokens: int = 0,
    ) -> Choice | None:
        """The choice from a Route answer, made now; or, when it would leave the prefills holding the
        longest prefix of the prompt, made with the rest of its burst (then already reserved). None
        when the answer ranks other prefills than the healthy ones."""
        best = self._best(answer, healthy)
        if best is None:
            return None
        if self.burst is None or holds_longest_prefix(best[0], (b.url for b in best[1])):
            # From here to the caller's reservation of the chosen backend nothing awaits: the queues
            # this ranks with are the ones the choice is counted into.
            return self._chosen(*best, outcome, prompt_tokens, new_tokens)
        waiting = _Waiting(answer, outcome, prompt_tokens, new_tokens, asyncio.get_running_loop().time())
        try:
            await self.burst.wait(waiting)
        except asyncio.CancelledError:
            if waiting.choice is not None and waiting.choice.reserved:
                waiting.choice.release()
            raise
        return waiting.choice

    def _longest_prefix(
        self, answer: pb.RouteResponse, healthy: list[Backend], prompt_tokens: int
    ) -> Choice | None:
        """The prefill holding the longest prefix of the prompt in its own cache, the load rule among
        equals; None when the answer ranks other prefills than the healthy ones."""
        by_url = {b.url: b for b in healthy}
        scores = {s.http_endpoint.rstrip("/"): s for s in answer.ranked}
        if len(answer.ranked) != len(healthy) or scores.keys() != by_url.keys():
            return None
        longest = max(s.local_blocks for s in scores.values())
        among = [by_url[url] for url, s in scores.items() if s.local_blocks == longest]
        outcome = "prefix_miss" if not longest else "prefix" if len(among) == 1 else "prefix_tie"
        choice = Choice(self.pool.pick(among=among), outcome, prompt_tokens=prompt_tokens)
        choice.score = scores[choice.backend.url]
        choice.expected_ttft_ms = choice.score.expected_ttft_ms
        choice.compute_tokens = max(prompt_tokens - choice.score.local_blocks * answer.block_size, 0)
        return choice

    def _place_waiting(self, waiting: list[_Waiting]) -> None:
        """The burst window closed: place the requests that waited (burst.py), each reserved before
        the next is ranked."""
        healthy = [b for b in self.pool.backends if b.healthy]
        now = asyncio.get_running_loop().time()

        def rank(w: _Waiting) -> list[RankedCandidate]:
            best = self._best(w.answer, healthy)
            return best[0] if best is not None else []

        def place(w: _Waiting) -> None:
            best = self._best(w.answer, healthy)
            if best is None:
                return
            w.choice = self._chosen(*best, w.outcome, w.prompt_tokens, w.new_tokens)
            w.choice.burst_wait_ms = (now - w.started) * 1e3
            w.choice.reserve()
            home = holds_longest_prefix(best[0], [w.choice.backend.url])
            BURST_WAITS.labels("home" if home else "away").inc()

        place_together(waiting, rank, place)

    def _best(
        self, answer: pb.RouteResponse, healthy: list[Backend]
    ) -> tuple[list[RankedCandidate], list[Backend], bool] | None:
        """A Route answer re-ranked with the queues now, the backends a request is placed among (its
        best, or its tied best the load rule picks from) and whether they tied; None when the answer
        ranks other prefills than the healthy ones."""
        by_url = {b.url: b for b in healthy}
        if len(answer.ranked) != len(healthy) or any(
            by_url.get(s.http_endpoint.rstrip("/")) is None for s in answer.ranked
        ):
            return None

        def backend(endpoint: str) -> Backend:
            return by_url[endpoint.rstrip("/")]

        ranked, tied = rank_now(answer, lambda e: (backend(e).in_flight, backend(e).queued_tokens))
        if tied > 1:
            among = among_tied(ranked[:tied], lambda e: backend(e).in_flight)
            return ranked, [backend(r.score.http_endpoint) for r in among], True
        return ranked, [backend(ranked[0].score.http_endpoint)], False

    def _chosen(
        self,
        ranked: list[RankedCandidate],
        among: list[Backend],
        tied: bool,
        outcome: str,
        prompt_tokens: int,
        new_tokens: int,
    ) -> Choice:
        """The choice among `among` (outcome ``route``, ``continuation`` or ``history_prefix``, or the
        same with ``_tie``)."""
        if tied:
            choice = self._load(
                "tie" if outcome == "route" else f"{outcome}_tie", among=among, prompt_tokens=prompt_tokens
            )
        else:
            choice = Choice(among[0], outcome, prompt_tokens=prompt_tokens)
        chosen = next(r for r in ranked if r.score.http_endpoint.rstrip("/") == choice.backend.url)
        choice.score, choice.expected_ttft_ms = chosen.score, chosen.expected_ttft_ms
        choice.new_tokens = new_tokens
        return choice

    async def turn_ended(self, body: dict, answer: str, token_ids: list[int], delay_s: float) -> None:
        """A chat turn ended with `answer`; `token_ids` are its prompt's and its answer's, as
        the decode computed them. After `delay_s` (the decode's retention reaches kvloopd through its
        KV events meanwhile), ask Route about the conversation as it now stands and keep the answer
        for its next turn."""
        continuations, directory = self.continuations, self.directory  # keeps_turns, narrowed
        if not self.keeps_turns or continuations is None or directory is None or not token_ids:
            return
        healthy = [b for b in self.pool.backends if b.healthy]
        if len(healthy) < 2:
            return
        await asyncio.sleep(delay_s)
        model, salt = str(body.get("model", "")), str(body.get("cache_salt") or "")
        try:
            route = await directory.route(
                model,
                [pb.RouteCandidate(http_endpoint=b.url) for b in healthy],
                token_ids=token_ids,
                cache_salt=salt,
                continuation=True,
                timeout=max(self.timeout_s, 1.0),  # off every request's path: no reason to give up early
            )
        except KvloopError as exc:
            CONTINUATIONS.labels("failed").inc()
            log.debug("continuation route failed", error=str(exc))
            return
        continuations.keep(model, salt, body["messages"], answer, len(token_ids), route)
        CONTINUATIONS.labels("kept").inc()

    async def _tokenize(
        self, session: aiohttp.ClientSession, healthy: list[Backend], body: dict, chat: bool
    ) -> list[int] | None:
        """The prompt's token ids: rendered here with the model's tokenizer when it can be (see
        prompt_tokens), else from a prefill server's /tokenize (vLLM renders chat messages with the
        model's template there, as for the completion)."""
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt  # already token ids (a continuation of a broken stream)
        model = str(body.get("model", ""))
        root = next((b.roots[model] for b in healthy if model in b.roots), None)
        tokenizer = self.tokenizers.get(model, root)
        if tokenizer is not None:
            local = await asyncio.to_thread(tokenizer.tokens, body, chat)
            if local:
                TOKENIZED.labels("local").inc()
                return local
        TOKENIZED.labels("server").inc()
        # Round-robin of its own: taking the pool's would make every tie-break after it land on the
        # same server.
        backend = healthy[next(self._tokenize_turn) % len(healthy)]
        request = {"model": body.get("model")}
        if chat:
            request.update(
                {k: body[k] for k in ("messages", "chat_template_kwargs", "tools") if body.get(k) is not None}
            )
        else:
            request["prompt"] = body.get("prompt")
        try:
            async with session.post(f"{backend.url}/tokenize", json=request, headers=backend.headers()) as r:
                if r.status != 200:
                    log.warning("tokenize failed", backend=backend.url, status=r.status)
                    return None
                tokens = (await r.json()).get("tokens")
        except (aiohttp.ClientError, ValueError) as exc:
            log.warning("tokenize failed", backend=backend.url, error=str(exc))
            return None
        return tokens if isinstance(tokens, list) and tokens else None
