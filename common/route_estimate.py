"""Route's expected-TTFT arithmetic, shared by kvloopd, which ranks the candidates, and the routers
that re-rank its answer with their queues as they are at the moment they decide."""

from __future__ import annotations

from kvloop.v1 import directory_pb2 as pb


def queue_ms(queued_tokens: int, in_flight_requests: int, prompt_tokens: int, tokens_per_s: float) -> float:
    """Time a candidate's queue takes before this prompt's compute starts: the prompt tokens its
    in-flight requests still compute, or, when the router does not know them, each in-flight request
    counted as long as this prompt."""
    queued = queued_tokens or in_flight_requests * prompt_tokens
    if not queued:
        return 0.0
    return queued / tokens_per_s * 1e3 if tokens_per_s > 0 else float("inf")  # no rate: unknown, last


def tie_margin_ms(best_ms: float, floor_ms: float, ratio: float) -> float:
    """Candidates within this of the best are tied: estimates closer than this are noise."""
    return max(floor_ms, best_ms * ratio)


# A prefill request's kv_transfer_params key: the router's Route already found that no peer holds
# more of the prompt than the chosen prefill's own prefix cache, so its connector skips the Lookup
# (which would find the same, a few milliseconds and possibly an engine step later). The value names
# Route's reason, "local_prefix" or "miss".
ROUTE_SETTLED_KEY = "kvloop_route_settled"
# A prefill request's kv_transfer_params key: false asks its connector for the prefill's own prefix
# cache only, no Lookup and no pull from a peer (a router that ranks by own prefix alone, or one
# that measures what pulling adds).
PULL_KEY = "kvloop_pull"
SETTLED_REASONS = {pb.DECISION_REASON_LOCAL_PREFIX: "local_prefix", pb.DECISION_REASON_MISS: "miss"}


def settled_without_pull(score: pb.RouteScore) -> str | None:
    """Route's reason when its estimate for this candidate leaves nothing a Lookup could pull: no
    servable peer holds a block beyond the candidate's own prefix. A peer that holds more but is not
    worth pulling from is still left to the connector's Lookup, whose occasional re-measuring READ
    keeps that pair's estimate honest."""
    if not score.registered or score.pull_holder_worker_id:
        return None
    return SETTLED_REASONS.get(score.pull_reason)
