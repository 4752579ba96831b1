"""The cost model: what a pull and a recompute are estimated to cost, learnt from the agents' telemetry.

The transfer side learns from NIXL's own telemetry of each READ (bytes and transfer time, measured by
NIXL on the puller: no engine-step wait in it; the wait is reported apart and shown, never learnt
from). The recompute side learns from each prefill the puller computed itself (tokens over the time
from the engine step that first scheduled it to the end of its prefill, on the engine scheduler's
clock). Estimates are the median of a window of recent samples, the configured default standing in
for the samples a pair still lacks, so a few bad samples never move them alone (policy.py says how
the decision uses them). Transfer estimates are kept per holder -> puller pair and per tier of the
holder's runs (a READ from a host-memory pool and one from a device KV cache are learnt apart).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from kvloop.common.outcomes import reason_name
from kvloop.daemon.index.model import BlockTier
from kvloop.daemon.policy_config import PolicyConfig
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.daemon")


@dataclass
class PairEstimate:
    """What the model has learnt of one (holder, puller, tier) pair, as ListPairs shows it."""

    holder_worker_id: str
    puller_worker_id: str
    tier: int
    transfer_gbytes_per_s: float
    setup_ms: float
    sample_gbytes_per_s: list[float]
    verdicts: dict[str, int]
    last_transfer_s_ago: float  # -1: never transferred
    mean_wait_ms: float


@dataclass
class PullerEstimate:
    """A puller's learnt prefill rate, as ListPairs shows it."""

    worker_id: str
    prefill_tokens_per_s: float
    sample_tokens_per_s: list[float]


@dataclass
class Estimates:
    pairs: list[PairEstimate]
    pullers: list[PullerEstimate]


class SampleWindow:
    """Recent samples of one quantity; its estimate is their median, the prior filling the gap.

    The estimate is kept until the next sample: a Lookup reads three of them (bandwidth, setup, prefill
    rate), and sorting each window again on every Lookup was ~25% of an in-memory Lookup's handler."""

    __slots__ = ("_memo", "samples")

    def __init__(self, size: int) -> None:
        self.samples: deque[float] = deque(maxlen=size)
        self._memo: tuple[float, int, float] | None = None  # (prior, min_samples, estimate)

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        self._memo = None

    def estimate(self, prior: float, min_samples: int) -> float:
        memo = self._memo
        if memo is not None and memo[0] == prior and memo[1] == min_samples:
            return memo[2]
        value = median_with_prior(self.samples, prior, min_samples)
        self._memo = (prior, min_samples, value)
        return value


def median_with_prior(samples: Sequence[float], prior: float, min_samples: int) -> float:
    """The samples' median, the prior standing in for each one short of min_samples."""
    missing = max(0, min_samples - len(samples))
    return statistics.median([*samples, *([prior] * missing)])


def _transfer_rates(pair: PairState | None, config: PolicyConfig) -> tuple[PolicyConfig, float, float, str]:
    """(config, setup seconds, bytes/s, basis) of READs on the pair: measured, or the defaults."""
    setup = config.default_transfer_setup_ms / 1e3
    bandwidth = config.default_transfer_gbytes_per_s * 1e9
    n = len(pair.bandwidth.samples) if pair is not None else 0
    if pair is None or not n:
        return config, setup, bandwidth, "default"
    return (
        config,
        pair.setup.estimate(setup, config.min_samples),
        pair.bandwidth.estimate(bandwidth, config.min_samples),
        f"measured ({n} reads)",
    )


@dataclass(slots=True)
class PairState:
    """What the model knows of reading from one holder's tier into one puller."""

    model: str
    bandwidth: SampleWindow  # bytes/s of NIXL-measured READs
    setup: SampleWindow  # seconds to post a READ
    verdicts: Counter[int] = field(default_factory=Counter)  # by reason (the proto value), named when shown
    recompute_streak: int = 0  # measured "recompute is faster" verdicts in a row
    last_transfer: float | None = None  # monotonic time of the last TRANSFER verdict
    wait_s: float = 0.0  # engine-step waits around READs, summed (not in Lookup's estimate)
    waits: int = 0  # READs reported (those that did not wait included)
    # The latest READs' step waits: Route adds their mean to a pull's cost (a local prefix hit has none).
    recent_waits: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    # (config, setup s, bytes/s, basis) as the Lookups since the last measured READ estimate them.
    rates: tuple[PolicyConfig, float, float, str] | None = None


class Cost(msgspec.Struct, frozen=True, gc=False):
    """A pull's estimated cost against recomputing its tokens: the proto's CostEstimate (same field
    names), made as a message only for the answer."""

    transfer_ms: float
    recompute_ms: float
    transfer_bytes: int
    transfer_basis: str
    recompute_basis: str


class CostModel:
    """Per (holder, puller, tier) transfer and per-worker prefill estimates, fed by agents' telemetry."""

    def __init__(self, config_for, max_pairs: int = 65_536) -> None:
        self._config_for = config_for
        # (holder, puller, tier of the holder's run: BlockTier); read by Policy.decide
        self.pairs: dict[tuple[str, str, int], PairState] = {}
        # A Lookup's requester is the caller's to name: the pairs kept are bounded (see _make_room).
        self.max_pairs = max_pairs
        self.forgotten_pairs = 0
        self._prefill: dict[str, SampleWindow] = {}  # worker -> tokens/s
        # worker -> (config, tokens/s, basis) until its next prefill sample: read on every Lookup
        self._prefill_rates: dict[str, tuple[PolicyConfig, float, str]] = {}

    def pair(self, holder: str, puller: str, model: str, tier: int = BlockTier.DEVICE) -> PairState:
        key = (holder, puller, tier)
        pair = self.pairs.get(key)
        if pair is None:
            if len(self.pairs) >= self.max_pairs:
                self._make_room()
            size = self._config_for(model).window_samples
            pair = self.pairs[key] = PairState(model, SampleWindow(size), SampleWindow(size))
        return pair

    def forget_worker(self, worker: str) -> None:
        """Drop what was measured of a worker the directory dropped (silent past its lease and the
        drop delay): its prefill rate and every pair it is in. Worker ids churn with pods."""
        self._prefill.pop(worker, None)
        self._prefill_rates.pop(worker, None)
        for key in [key for key in self.pairs if worker in key[:2]]:
            del self.pairs[key]

    def _make_room(self) -> None:
        """Forget an eighth of the pairs: first those no READ was ever reported on (verdict counts
        only), oldest first, then the oldest measured ones."""
        drop = max(1, len(self.pairs) // 8)
        unmeasured = [key for key, p in self.pairs.items() if not p.bandwidth.samples and not p.waits]
        victims = unmeasured[:drop]
        if len(victims) < drop:
            chosen = set(victims)
            victims += [key for key in self.pairs if key not in chosen][: drop - len(victims)]
        for key in victims:
            del self.pairs[key]
        self.forgotten_pairs += len(victims)
        log.warning(
            "cost model forgot pairs", forgotten=len(victims), kept=len(self.pairs), limit=self.max_pairs
        )

    def record_transfer(self, puller: str, holder: str, report: pb.TransferReport, model: str) -> None:
        """Learn from a READ measured by NIXL itself; a failed READ says nothing about bandwidth (nor
        does one whose blocks failed their digest check: what it moved was not the run), a first READ
        includes the one-time handshake, and the engine's view includes step waits. The report's
        source tier (UNSPECIFIED: device) selects the estimate it teaches."""
        pair = self.pair(holder, puller, model, report.source_tier or BlockTier.DEVICE)
        if not report.first_contact:  # a handshake's wait is paid once, and no longer at start-up
            pair.wait_s += report.wait_us / 1e6
            pair.waits += 1
            pair.recent_waits.append(report.wait_us / 1e6)
        if (
            not report.ok
            or report.verify_failed
            or report.duration_us <= 0
            or report.first_contact
            or not report.nixl_measured
        ):
            return
        pair.bandwidth.add(report.bytes / (report.duration_us / 1e6))
        pair.setup.add(report.setup_us / 1e6)
        pair.rates = None

    def record_prefill(self, worker: str, tokens: int, duration_us: int, model: str) -> None:
        config = self._config_for(model)
        if tokens < config.min_prefill_sample_tokens or duration_us <= 0:
            return
        window = self._prefill.setdefault(worker, SampleWindow(config.window_samples))
        window.add(tokens / (duration_us / 1e6))
        self._prefill_rates.pop(worker, None)

    def pooled_prefill_rate(self, workers: Sequence[str], config: PolicyConfig) -> tuple[float, str]:
        """One rate for these workers: the median of their latest samples together (the default
        filling a short pool, as for one worker)."""
        samples = [x for w in workers if (window := self._prefill.get(w)) for x in window.samples]
        if not samples:
            return config.default_prefill_tokens_per_s, "default"
        rate = median_with_prior(samples, config.default_prefill_tokens_per_s, config.min_samples)
        return rate, f"pooled ({len(samples)} prefills of {len(workers)} workers)"

    def prefill_tokens_per_s(self, worker: str) -> float:
        window = self._prefill.get(worker)
        return statistics.median(window.samples) if window and window.samples else 0.0

    def step_wait_ms(self, holder: str, puller: str, tier: int = BlockTier.DEVICE) -> float:
        """The engine-step wait a pull adds on this pair: the pulling engine issues a READ at a step
        and schedules the request after the step that saw it done, while a local prefix hit is
        scheduled at once. Lookup leaves it out (recomputing waits for steps too); Route, comparing a
        pull on one prefill with a local hit on another, counts it.

        The lower quartile of the pair's latest waits, not their mean: a READ issued while its engine
        computes other requests' prompts waits out that step, which is the queue Route counts apart
        (a local hit queued behind the same prompts waits as long). The mean of a few such waits
        made every later pull on the pair look hundreds of milliseconds dearer than it is, and sent
        conversations away from the prefill holding their history."""
        pair = self.pairs.get((holder, puller, tier))
        if pair is None or not pair.recent_waits:
            return 0.0
        waits = pair.recent_waits
        if len(waits) == 1:
            return waits[0] * 1e3
        return statistics.quantiles(waits, n=4, method="inclusive")[0] * 1e3

    def estimate_on(
        self,
        pair: PairState | None,
        puller: str,
        bytes_per_block: int,
        blocks: int,
        tokens: int,
        config: PolicyConfig,
    ) -> Cost:
        """The estimate on the pair (None: nothing measured of it) for ``blocks`` blocks and ``tokens``
        tokens; the rates behind it are worked out once per READ sample, not per Lookup."""
        rates = pair.rates if pair is not None else None
        if rates is None or rates[0] is not config:
            rates = _transfer_rates(pair, config)
            if pair is not None:
                pair.rates = rates
        _, setup_s, bytes_per_s, transfer_basis = rates
        tokens_per_s, recompute_basis = self.prefill_rate(puller, config)
        nbytes = bytes_per_block * blocks
        return Cost(
            (setup_s + nbytes / bytes_per_s) * 1e3,
            tokens / tokens_per_s * 1e3,
            nbytes,
            transfer_basis,
            recompute_basis,
        )

    def prefill_rate(self, worker: str, config: PolicyConfig) -> tuple[float, str]:
        """The worker's estimated prefill tokens/s (robust: the default fills a short window) and
        where it came from."""
        memo = self._prefill_rates.get(worker)
        if memo is not None and memo[0] is config:
            return memo[1], memo[2]
        window = self._prefill.get(worker)
        m = len(window.samples) if window else 0
        if window is None or not m:  # not kept: a requester id is the caller's to choose
            return config.default_prefill_tokens_per_s, "default"
        rate = window.estimate(config.default_prefill_tokens_per_s, config.min_samples)
        self._prefill_rates[worker] = (config, rate, f"measured ({m} prefills)")
        return rate, f"measured ({m} prefills)"

    def views(self) -> Estimates:
        now = time.monotonic()
        pairs = []
        for (holder, puller, tier), pair in sorted(self.pairs.items()):
            config = self._config_for(pair.model)
            bandwidth = pair.bandwidth.estimate(
                config.default_transfer_gbytes_per_s * 1e9, config.min_samples
            )
            pairs.append(
                PairEstimate(
                    holder_worker_id=holder,
                    puller_worker_id=puller,
                    tier=tier,
                    transfer_gbytes_per_s=bandwidth / 1e9,
                    setup_ms=pair.setup.estimate(config.default_transfer_setup_ms / 1e3, config.min_samples)
                    * 1e3,
                    sample_gbytes_per_s=[b / 1e9 for b in pair.bandwidth.samples],
                    verdicts={reason_name(reason): n for reason, n in pair.verdicts.items()},
                    last_transfer_s_ago=now - pair.last_transfer if pair.last_transfer is not None else -1.0,
                    mean_wait_ms=pair.wait_s / pair.waits * 1e3 if pair.waits else 0.0,
                )
            )
        pullers = [
            PullerEstimate(
                worker_id=worker,
                prefill_tokens_per_s=self.prefill_tokens_per_s(worker),
                sample_tokens_per_s=list(window.samples),
            )
            for worker, window in sorted(self._prefill.items())
        ]
        return Estimates(pairs, pullers)
