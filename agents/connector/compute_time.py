"""Each prefill's own compute time, from the engine steps that computed it.

The prefill rate the cost model learns is tokens per second of compute. A request's wall time from
the decision to its end is not that: it includes steps it waited through (queued behind others) and
steps it shared with other requests (batched), so under load it halves and the model would count
the queue twice (Route adds the queue on top). Here each step's time is charged to the requests it
computed, in proportion to the tokens it scheduled for each: a request alone gets the whole step,
two batched equally get half each, and a request waiting gets nothing.

Runs on the scheduler side, in the engine-core loop: ``step`` when the scheduler builds a step's
connector metadata (the step starts), ``finish`` when a request is freed after its last step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping


class ComputeTime:
    def __init__(self) -> None:
        self._charged: dict[str, float] = {}  # tracked request -> seconds of steps charged to it
        self._step_started: float | None = None
        self._step_tokens: dict[str, int] = {}  # tracked requests in the open step -> their tokens
        self._step_total = 0  # every request's tokens in the open step

    def track(self, request_id: str) -> None:
        self._charged.setdefault(request_id, 0.0)

    def step(self, scheduled: Mapping[str, int], total_tokens: int, now: float | None = None) -> None:
        """A step starts with these tokens scheduled per request: the one before it is over."""
        now = time.perf_counter() if now is None else now
        self._close(now)
        self._step_started = now
        self._step_total = total_tokens
        self._step_tokens = {r: n for r, n in scheduled.items() if r in self._charged and n > 0}

    def finish(self, request_id: str, now: float | None = None) -> float:
        """The request's compute seconds, its share of the step it ended in included; it is
        forgotten (0.0 for a request never tracked or never scheduled)."""
        now = time.perf_counter() if now is None else now
        charged = self._charged.pop(request_id, 0.0)
        tokens = self._step_tokens.pop(request_id, 0)
        if tokens and self._step_started is not None and self._step_total:
            charged += (now - self._step_started) * tokens / self._step_total
        return charged

    def _close(self, now: float) -> None:
        if self._step_started is None or not self._step_total:
            return
        elapsed = now - self._step_started
        for request_id, tokens in self._step_tokens.items():
            self._charged[request_id] += elapsed * tokens / self._step_total
