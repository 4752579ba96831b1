"""Route's expected-TTFT arithmetic, shared by kvloopd, which ranks the candidates, and the routers
that re-rank its answer with their queues as they are at the moment they decide."""

from __future__ import annotations


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
