"""The synthetic trace generator (clients/bench/replay/gen.py): its default trace, and the mixed
population's sessions with gap scales of their own."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import statistics
from collections import defaultdict

import pytest

from kvloop.clients.bench.replay.gen import SyntheticConfig, generate


def _session_log_gaps(config: SyntheticConfig) -> list[float]:
    """Each session's mean log gap between turns (sessions with three gaps or more)."""
    at: dict[str, list[int]] = defaultdict(list)
    for record in generate(config):
        at[record["session_id"]].append(record["timestamp"])
    means = []
    for ts in at.values():
        gaps = [max(b - a, 1) / 1000 for a, b in itertools.pairwise(ts)]
        if len(gaps) >= 3:
            means.append(statistics.fmean(math.log(g) for g in gaps))
    return means


def test_the_default_trace_is_the_uniform_population_as_it_was():
    records = list(generate(SyntheticConfig(requests=500, seed=3)))
    digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]
    assert digest == "e3c98201fe26edc0"
    assert records == list(generate(SyntheticConfig(requests=500, seed=3, population="uniform")))


def test_mixed_sessions_come_back_on_scales_of_their_own():
    uniform = _session_log_gaps(SyntheticConfig(requests=4000))
    mixed = _session_log_gaps(SyntheticConfig(requests=4000, population="mixed"))
    # Between sessions, mean log gaps spread far more when agents (3 s) and chats (90 s) mix.
    assert statistics.stdev(mixed) > 1.5 * statistics.stdev(uniform)
    fast = sum(m < math.log(15) for m in mixed) / len(mixed)
    assert 0.6 < fast < 0.95  # most sessions with several turns are agents'
    with pytest.raises(ValueError, match="population 'bursty': choose from uniform, mixed"):
        next(generate(SyntheticConfig(population="bursty")))
