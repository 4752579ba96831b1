"""Prometheus histograms and counters cheap enough for kvloopd's per-request path.

prometheus_client's ``Histogram.observe`` takes a lock and walks the bucket bounds in Python, and a
Lookup made three observations (its own latency, and two store calls): a sizeable share of an in-memory
Lookup's handler (docs/benchmarks.md, "Metrics"). kvloopd observes only from its event-loop thread, so a
series here is a list of per-bucket counts found by ``bisect`` (C) with no lock; the scrape (another
thread) turns them into the usual cumulative ``_bucket``/``_sum``/``_count`` series. A scrape that lands
between the two updates of one observation may see ``_sum`` one observation ahead of ``_count``, never a
torn value.

:class:`LoopCounter` does the same for a counter: prometheus_client's ``inc`` is four calls and a lock;
a series here is one integer the handler adds to in place. Each Lookup counts its decision.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from time import perf_counter
from typing import Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

_S = TypeVar("_S")


class _Timing:
    """``with series.time():`` observes the block's duration (a fresh object per use, so
    coroutines timing the same series at once do not share a start time)."""

    __slots__ = ("_series", "_started")

    def __init__(self, series: HistogramSeries) -> None:
        self._series = series
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._series.observe(perf_counter() - self._started)


class HistogramSeries:
    """One labelled series: counts per bucket (``le`` bound i counts values in (bound i-1, bound i])."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value

    def time(self) -> _Timing:
        return _Timing(self)


class _LoopMetric(Generic[_S]):
    """A metric family with labels, exposed like prometheus_client's; updated from one thread only."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry | None
    ) -> None:
        self._name, self._documentation = name, documentation
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], _S] = {}
        if registry is not None:
            registry.register(self)

    def _new_series(self) -> _S:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def labels(self, *values: str) -> _S:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, got {values}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = self._new_series()
        return series


class LoopHistogram(_LoopMetric[HistogramSeries]):
    """A histogram with labels, exposed like prometheus_client's; observe from one thread only."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"{name}: buckets must be distinct and increasing, got {buckets}")
        self._bounds = bounds
        super().__init__(name, documentation, labelnames, registry)
        if not self._labelnames:
            self._series[()] = HistogramSeries(bounds)

    def _new_series(self) -> HistogramSeries:
        return HistogramSeries(self._bounds)

    def observe(self, value: float) -> None:
        """Observe on the unlabelled series."""
        self._series[()].observe(value)

    def time(self) -> _Timing:
        return self._series[()].time()

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        edges = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for values, series in list(self._series.items()):
            total, cumulative = series.sum, []
            running = 0
            for edge, count in zip(edges, list(series.counts), strict=True):
                running += count
                cumulative.append((edge, running))
            family.add_metric(list(values), cumulative, total)
        yield family


class CounterSeries:
    """One labelled counter series: add to ``value`` in place (``series.value += 1``)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class LoopCounter(_LoopMetric[CounterSeries]):
    """A counter with labels, exposed like prometheus_client's; count from one thread only."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        # prometheus_client's Counter takes the name with or without "_total" and exposes "_total"
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_series(self) -> CounterSeries:
        return CounterSeries()

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, series in list(self._series.items()):
            family.add_metric(list(values), series.value)
        yield family
