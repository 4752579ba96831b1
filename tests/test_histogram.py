"""kvloopd's lock-free histogram and counter expose exactly what prometheus_client's Histogram and
Counter do."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvloop.daemon.histogram import LoopCounter, LoopHistogram

BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 1e-3)


def _exposition(registry: CollectorRegistry) -> list[str]:
    # prometheus_client adds a _created series that LoopHistogram does not keep
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_the_exposition_equals_prometheus_clients_for_the_same_observations():
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("t_seconds", "doc", ["op"], buckets=BUCKETS, registry=theirs_registry)
    ours = LoopHistogram("t_seconds", "doc", ["op"], buckets=BUCKETS, registry=ours_registry)
    rng = random.Random(3)
    # bucket edges themselves included: a value equal to a bound counts in that bucket (le)
    values = [rng.choice(BUCKETS) for _ in range(50)] + [rng.uniform(0, 3e-3) for _ in range(500)]
    for i, value in enumerate(values):
        op = ("lookup", "apply")[i % 2]
        theirs.labels(op).observe(value)
        ours.labels(op).observe(value)
    assert _exposition(ours_registry) == _exposition(theirs_registry)
    assert 'le="+Inf"' in "\n".join(_exposition(ours_registry))


def test_timing_blocks_that_overlap_each_observe_their_own_duration():
    histogram = LoopHistogram("overlap_seconds", "doc", buckets=(1.0,), registry=None)
    first, second = histogram.time(), histogram.time()
    first.__enter__()
    second.__enter__()
    second.__exit__(None, None, None)
    first.__exit__(None, None, None)
    series = histogram.labels()
    assert series.counts == [2, 0] and series.sum > 0


@pytest.mark.parametrize("buckets", [(), (2.0, 1.0), (1.0, 1.0)])
def test_buckets_must_be_distinct_and_increasing(buckets):
    with pytest.raises(ValueError, match="distinct and increasing"):
        LoopHistogram("bad_seconds", "doc", buckets=buckets, registry=None)


def test_labels_must_match_the_label_names():
    histogram = LoopHistogram("labelled_seconds", "doc", ["op"], buckets=(1.0,), registry=None)
    with pytest.raises(ValueError, match="takes labels"):
        histogram.labels("a", "b")


def test_the_counters_exposition_equals_prometheus_clients_for_the_same_counts():
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Counter("decisions_total", "doc", ["decision", "reason"], registry=theirs_registry)
    ours = LoopCounter("decisions_total", "doc", ["decision", "reason"], registry=ours_registry)
    rng = random.Random(5)
    for _ in range(300):
        labels = rng.choice(
            [("transfer", "transfer_faster"), ("recompute", "miss"), ("local", "local_prefix")]
        )
        theirs.labels(*labels).inc()
        ours.labels(*labels).value += 1
    exposed = _exposition(ours_registry)
    assert exposed == _exposition(theirs_registry)
    assert any(line.startswith('decisions_total{decision="recompute",reason="miss"}') for line in exposed)
    with pytest.raises(ValueError, match="takes labels"):
        ours.labels("transfer")
