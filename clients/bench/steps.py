"""A streamed decode's engine steps, timed by the client: vLLM sends one chunk per engine step with that
step's tokens, so the gaps between a request's chunks are its steps, and the requests streaming at the
same time say what each step held (used by `kvloop bench decode-tpot` and `kvloop bench multiturn`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

# Chunks of one engine step reach the client within a few ms of each other (the API server writes
# them one response at a time): a first chunk this close after a gap's end arrived in that step.
SAME_STEP_S = 0.003


@dataclass
class Stream:
    """One streamed decode request: when it was sent and when each chunk carrying tokens arrived."""

    sent: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens in each chunk (1 per engine step)
    where: str = ""  # the engine that decoded it: only streams on one engine share its steps

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def last(self) -> float:
        return self.times[-1]

    def tpot_ms(self) -> float | None:
        """(last token - first token) / tokens after the first, as the client saw them."""
        after_first = sum(self.tokens[1:])
        return (self.last - self.first) * 1e3 / after_first if after_first else None


@dataclass(frozen=True)
class Gap:
    """One step of one request's decode, as the client saw it."""

    step_ms: float
    batch: int  # requests decoding through the whole gap (this one included)
    arrival: bool  # another request's first token came out of this step
    read: bool  # a continuation prefill was in flight (in the reads condition: pulling from this decode)


def step_gaps(
    streams: Sequence[Stream], reads: Sequence[tuple[float, float]] = (), same_step_s: float = SAME_STEP_S
) -> list[Gap]:
    """Every gap between two chunks of a request, classified by what the decode held meanwhile."""
    gaps = []
    for s in streams:
        for i in range(1, len(s.times)):
            start, end = s.times[i - 1], s.times[i]
            batch = sum(
                1
                for u in streams
                if u.times and u.first <= start + same_step_s and u.last >= end - same_step_s
            )
            arrival = any(
                u is not s and u.times and start + same_step_s < u.first <= end + same_step_s for u in streams
            )
            read = any(a < end and b > start for a, b in reads)
            gaps.append(Gap((end - start) * 1e3 / max(s.tokens[i], 1), batch, arrival, read))
    return gaps


@dataclass(frozen=True)
class EqualBatch:
    """Median step time of two sets of steps (e.g. two arms) at one batch size, and their ratio."""

    batch: int
    steps: tuple[int, int]
    step_ms_p50: tuple[float, float]
    ratio: float


def equal_batch(top: dict[int, list[float]], bottom: dict[int, list[float]]) -> list[EqualBatch]:
    """Step times (ms, per batch size) of `top` against `bottom` at every batch size both have."""
    rows = []
    for batch in sorted(set(top) & set(bottom)):
        a, b = statistics.median(top[batch]), statistics.median(bottom[batch])
        rows.append(
            EqualBatch(
                batch, (len(top[batch]), len(bottom[batch])), (round(a, 2), round(b, 2)), round(a / b, 3)
            )
        )
    return rows


def weighted_ratio(rows: Sequence[EqualBatch]) -> float | None:
    """The per-batch ratios weighted by the bottom set's steps at each batch: one figure for a TPOT
    comparison at the bottom set's own mix of batch sizes."""
    weight = sum(r.steps[1] for r in rows)
    return round(sum(r.ratio * r.steps[1] for r in rows) / weight, 3) if weight else None
