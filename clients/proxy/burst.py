"""Requests that arrive together are placed together.

The sessions of an agent fleet often send at once (a batch of tool calls returns, a step of a
multi-agent loop starts). Ranked one at a time, each request is greedy against the queues the ones
before it reserved. When two conversations whose history one prefill holds arrive first, the second
goes to the other prefill, since pulling its whole history there looks cheaper than waiting behind
the first. That in turn sends one of the other prefill's own conversations away, which pulls its
whole history back, and the conversations' caches keep trading places turn after turn.

So a request whose best prefill by the queues now is not one holding the longest local prefix of its
prompt (it would leave its cache) waits a few milliseconds for the rest of its burst. When the window
closes, the requests that waited are placed, the one that loses most by not getting its best first
(the gap between its best and second-best expected TTFT), each against the queues reserved by the
requests placed before it, those that did not wait included. A request that stays with its cache is
placed at once: it is where a joint placement would put it too, unless another request has more to
lose there, and that one can still pull. A lone request leaving its cache pays the window and goes
where it would have gone.

``BurstWindow`` collects the waiting requests; ``place_together`` orders and places them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import structlog

if TYPE_CHECKING:
    from kvloop.clients.proxy.routing import RankedCandidate

log = structlog.get_logger("kvloop.proxy")

T = TypeVar("T")


def holds_longest_prefix(ranked: Sequence[RankedCandidate], endpoints: Iterable[str]) -> bool:
    """Whether one of `endpoints` (the candidates a request would be placed among) has the longest
    local prefix of the prompt among all `ranked` candidates."""
    if not ranked:
        return True
    longest = max(r.score.local_blocks for r in ranked)
    among = {e.rstrip("/") for e in endpoints}
    return any(r.score.local_blocks == longest for r in ranked if r.score.http_endpoint.rstrip("/") in among)


def loss_if_not_best(ranked: Sequence[RankedCandidate]) -> float:
    """What a request loses, in expected TTFT, if it does not get its best candidate."""
    return ranked[1].expected_ttft_ms - ranked[0].expected_ttft_ms if len(ranked) > 1 else 0.0


def place_together(
    waiting: list[T], rank: Callable[[T], Sequence[RankedCandidate]], place: Callable[[T], None]
) -> None:
    """Place every waiting request, the one that loses most by not getting its best first. They are
    ordered once, by the queues as the window closed; each is then placed (`place` chooses and
    reserves) against the queues as the ones before it left them."""
    for item in sorted(waiting, key=lambda w: loss_if_not_best(rank(w)), reverse=True):
        place(item)


class BurstWindow(Generic[T]):
    """Requests that wait for the rest of their burst (asyncio). The first to wait opens a window of
    `window_s`; when it closes, `place_all` places every request that waited and was not cancelled
    meanwhile (the caller of ``wait`` releases a placement it is cancelled after)."""

    def __init__(self, window_s: float, place_all: Callable[[list[T]], None]) -> None:
        self.window_s = window_s
        self._place_all = place_all
        self._waiting: list[tuple[T, asyncio.Future[None]]] | None = None

    @property
    def waiting(self) -> int:
        """Requests waiting for the window to close."""
        return len(self._waiting or ())

    async def wait(self, item: T) -> None:
        loop = asyncio.get_running_loop()
        if self._waiting is None:
            self._waiting = []
            loop.call_later(self.window_s, self._close)
        done: asyncio.Future[None] = loop.create_future()
        self._waiting.append((item, done))
        await done

    def _close(self) -> None:
        waiting, self._waiting = self._waiting or [], None
        live = [(item, done) for item, done in waiting if not done.done()]
        try:
            self._place_all([item for item, _ in live])
        except Exception:  # the requests fall back to the load rule; the window must not stay shut
            log.exception("placing a burst failed")
        finally:
            for _, done in live:
                if not done.done():
                    done.set_result(None)
