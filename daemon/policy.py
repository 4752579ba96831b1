"""Whether a turn pulls, and why: the one place kvloop decides (``Policy.answer``).

The puller states its constraints in the Lookup (its minimum pull, its lease margin, its KV layout);
``Policy.answer`` asks the store for the longest servable prefix under them, weighs moving it
against recomputing it, claims a single-use run only when it answers TRANSFER, and names the turn's
path and reason in the proto's vocabulary. The connector applies the answer and adds only what it
alone can know (the READ's own outcome, a lease that ran out before the READ was posted).

The cost model compares like with like. The transfer side learns from NIXL's own telemetry of each
READ (bytes and transfer time, measured by NIXL on the puller: no engine-step wait in it; the wait is
reported apart and shown, never learnt from). The recompute side learns from each prefill the puller
computed itself (tokens over the time from the engine step that first scheduled it to the end of
its prefill, on the engine scheduler's clock).

Real traffic cannot fool it with a few bad samples:

* estimates are the median of a window of recent samples (``window_samples``), and until a pair has
  ``min_samples`` of them the configured default stands in for the missing ones, so one or two slow
  READs (a cold page cache, a stopped peer) never flip the decision alone;
* a pair's first READ also pays the NIXL handshake, a one-time cost: it is never charged to later
  transfers;
* transfer estimates are only refreshed by transfers, so a pair whose estimate says "recompute" is
  re-measured (reason PROBE) every ``reprobe_every`` verdicts and at least every
  ``reprobe_interval_s`` while lookups arrive: a probe is always correct, only possibly slower.

Transfer estimates are kept per holder -> puller pair and per tier of the holder's runs: a READ from a
holder's host-memory pool and one from its device KV cache are different transfers, learnt apart
(``TransferReport.source_tier``), and each Lookup estimates a pull with its holder's tier. A fleet
without host pools has only device estimates, as before.

``Policy.pairs`` shows all of it per holder -> puller pair and tier (``ListPairs``, ``kvloop pairs``).
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import structlog
from pydantic import BaseModel, ConfigDict, Field

from kvloop.common.outcomes import reason_name
from kvloop.common.route_estimate import queue_ms, tie_margin_ms
from kvloop.daemon.index.model import BlockTier, Namespace, PrefixMatch, WorkerSpec
from kvloop.daemon.index.store import BlockIndex
from kvloop.daemon.windows import WINDOW_NOT_HELD, fit_windows
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.daemon")


class PolicyConfig(BaseModel):
    # Frozen: the cost model keeps estimates per config object (a reload makes new ones).
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Like vLLM's kv_recompute_threshold: fewer transferable tokens than this are recomputed.
    recompute_threshold_tokens: int = Field(64, ge=0)
    default_transfer_gbytes_per_s: float = Field(8.0, gt=0)
    default_transfer_setup_ms: float = Field(0.5, ge=0)
    default_prefill_tokens_per_s: float = Field(4000.0, gt=0)
    # Shorter prefills are not measured: their fixed per-step cost would understate the marginal
    # tokens/s that recomputing a matched prefix costs.
    min_prefill_sample_tokens: int = Field(256, ge=1)
    # Transfer only when it is estimated at most this fraction of recompute time.
    transfer_cost_ratio: float = Field(1.0, gt=0)
    # Estimates are the median of the last window_samples samples; with fewer than min_samples the
    # default fills the gap, so min_samples // 2 outliers in a row cannot move the estimate.
    window_samples: int = Field(16, ge=1)
    min_samples: int = Field(5, ge=1)
    # After this many consecutive measured "recompute is faster" verdicts for a pair, or this long
    # since its last transfer, transfer once to re-measure it (0: never).
    reprobe_every: int = Field(16, ge=0)
    reprobe_interval_s: float = Field(2.0, ge=0)
    enabled: bool = True
    # Route: candidates whose expected TTFT is within max(route_tie_ms, route_tie_ratio x the best)
    # of the best are tied (the router picks among them by load).
    route_tie_ms: float = Field(1.0, ge=0)
    route_tie_ratio: float = Field(0.05, ge=0)
    # Route's prefill rate. "pooled": one rate for every registered candidate, the median of their
    # latest samples together (a pool of like prefills: a worker's own median moves with its recent
    # batch-mates and co-tenants, noise that would decide rankings, and its queue is counted apart).
    # "per_worker": each candidate's own (a pool mixing prefills of different speeds).
    route_prefill_rate: Literal["pooled", "per_worker"] = "pooled"


class _Window:
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
        value = _median_with_prior(self.samples, prior, min_samples)
        self._memo = (prior, min_samples, value)
        return value


def _median_with_prior(samples: Sequence[float], prior: float, min_samples: int) -> float:
    """The samples' median, the prior standing in for each one short of min_samples."""
    missing = max(0, min_samples - len(samples))
    return statistics.median([*samples, *([prior] * missing)])


def _transfer_rates(pair: _Pair | None, config: PolicyConfig) -> tuple[PolicyConfig, float, float, str]:
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
class _Pair:
    """What the model knows of reading from one holder's tier into one puller."""

    model: str
    bandwidth: _Window  # bytes/s of NIXL-measured READs
    setup: _Window  # seconds to post a READ
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


class KvLayout(msgspec.Struct, frozen=True, gc=False):
    """What decides whether one worker's KV can be READ into another's (0 / "" / (): unknown).

    Each Lookup's layout is a key of the acceptor cache: a frozen msgspec struct, hashed in C."""

    tensor_parallel_size: int = 0
    pipeline_parallel_size: int = 0
    kv_dtype: str = ""
    kv_bytes_per_block: int = 0
    # Sliding window in tokens of each KV-cache group, in vLLM's group order (0: full attention).
    kv_group_windows: tuple[int, ...] = ()

    @classmethod
    def of(cls, spec: WorkerSpec) -> KvLayout:
        tp, pp, _, _ = spec.parallel
        return cls(tp, pp, spec.kv_dtype, spec.kv_bytes_per_block, tuple(spec.kv_group_windows))


UNKNOWN_LAYOUT = KvLayout()


def layout_mismatch(holder: KvLayout, puller: KvLayout) -> str | None:
    """Why vLLM's NIXL connector cannot READ the holder's KV into the puller (None: it can).

    Its rules (vllm 0.32 ``TransferTopology.tp_ratio`` and the NIXL worker's handshake checks): one TP
    size must divide the other; the element types must agree; the KV-cache groups must be the same
    ones (a block id is read into the same group on the other side, and a sliding-window group only
    holds its window). With equal TP sizes the bytes per block must agree too (a different
    model or KV layout); across TP sizes a rank holds a share of the heads, so they are not compared.
    """
    if holder.kv_dtype and puller.kv_dtype and holder.kv_dtype != puller.kv_dtype:
        return f"KV dtype {holder.kv_dtype} cannot be read into {puller.kv_dtype}"
    hg, pg = holder.kv_group_windows, puller.kv_group_windows
    if hg and pg and hg != pg:
        return f"KV-cache groups differ (sliding windows {list(hg)} on the holder, {list(pg)} on the puller)"
    htp, ptp = holder.tensor_parallel_size, puller.tensor_parallel_size
    if htp and ptp and max(htp, ptp) % min(htp, ptp):
        return f"tensor-parallel sizes {htp} (holder) and {ptp} (puller) do not divide each other"
    hpp, ppp = holder.pipeline_parallel_size, puller.pipeline_parallel_size
    if hpp and ppp and hpp != ppp:
        return f"pipeline-parallel sizes {hpp} (holder) and {ppp} (puller) differ"
    hb, pb_ = holder.kv_bytes_per_block, puller.kv_bytes_per_block
    if htp == ptp and hb and pb_ and hb != pb_:
        return f"a block is {hb} bytes on the holder and {pb_} bytes on the puller at the same TP size"
    return None


class LookupQuery(msgspec.Struct, gc=False):  # request-path values are msgspec structs (model.py)
    """A Lookup in domain terms: the prompt and the puller's constraints."""

    namespace: Namespace
    hashes: Sequence[bytes]
    local_blocks: int
    requester: str
    block_size: int
    claim: bool = False
    min_pull_tokens: int = 0
    lease_margin_s: float = 0.0
    layout: KvLayout = UNKNOWN_LAYOUT


@dataclass(frozen=True, slots=True)
class RouteCandidate:
    """A prefill a router could send the prompt to, with its queue as the router knows it."""

    worker_id: str
    http_endpoint: str
    spec: WorkerSpec | None  # None: not an active, registered worker of the model
    in_flight_requests: int = 0
    queued_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteQuery:
    namespace: Namespace
    hashes: Sequence[bytes]
    block_size: int
    prompt_tokens: int
    candidates: Sequence[RouteCandidate]


@dataclass(slots=True)
class RouteScore:
    candidate: RouteCandidate
    local_blocks: int = 0
    pull_blocks: int = 0
    pull_holder: str = ""
    pull_holder_blocks: int = 0
    pull_holder_tier: int = 0  # the tier of the run the pull would read (set with pull_holder)
    pull_reason: int = pb.DECISION_REASON_MISS
    pull_cost: Cost | None = None
    compute_tokens: int = 0
    queue_ms: float = 0.0
    transfer_ms: float = 0.0
    pull_wait_ms: float = 0.0
    compute_ms: float = 0.0
    expected_ttft_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0
    prefill_basis: str = ""
    # The answer the candidate's own Lookup would get now, when Route judged its pull worth a READ
    # of a multi-reader run (see plans.py; a single-use run needs a claim, which Route never makes).
    plan: Answer | None = None


class Answer(msgspec.Struct, gc=False):
    decision: int
    reason: int
    path: int
    detail: str
    cost: Cost | None
    match: PrefixMatch
    # Leading blocks the best holder serves, pulled or not (0 when none); with the local ones.
    matched_blocks: int
    # Prompt blocks the caller computes under this decision.
    recompute_blocks: int


_UNSERVABLE = {
    "expired": pb.DECISION_REASON_EXPIRED,
    "claimed": pb.DECISION_REASON_CLAIMED,
    "peer_unavailable": pb.DECISION_REASON_PEER_UNAVAILABLE,
    "incompatible_layout": pb.DECISION_REASON_INCOMPATIBLE_LAYOUT,
    "directory_resyncing": pb.DECISION_REASON_DIRECTORY_RESYNCING,
    WINDOW_NOT_HELD: pb.DECISION_REASON_WINDOW_NOT_HELD,
}


def _same_holding(a: PrefixMatch, b: PrefixMatch) -> bool:
    if a.best is None or b.best is None:
        return a.best is b.best
    return (a.best.worker.worker_id, a.best.handle, a.best.matched_blocks) == (
        b.best.worker.worker_id,
        b.best.handle,
        b.best.matched_blocks,
    )


class _ReadableInto:
    """A store lookup's ``accept``: whether a holder's KV can be READ into the puller's layout.

    The verdict is kept per holder spec: a worker's layout changes only when it registers again,
    which makes a new spec object (kept here, so its id is not reused while its verdict is)."""

    __slots__ = ("_puller", "_verdicts")

    def __init__(self, puller: KvLayout) -> None:
        self._puller = puller
        self._verdicts: dict[int, tuple[WorkerSpec, bool]] = {}

    def __call__(self, spec: WorkerSpec) -> bool:
        seen = self._verdicts.get(id(spec))
        if seen is not None and seen[0] is spec:
            return seen[1]
        readable = layout_mismatch(KvLayout.of(spec), self._puller) is None
        if len(self._verdicts) >= _MAX_VERDICTS:  # workers re-registering over a long life
            self._verdicts.clear()
        self._verdicts[id(spec)] = (spec, readable)
        return readable


_MAX_VERDICTS = 4096


@functools.lru_cache(maxsize=256)
def _readable_into(puller: KvLayout) -> Callable[[WorkerSpec], bool] | None:
    """The ``accept`` of a puller's lookups, one per layout a puller states; None when it states
    none (every check needs both sides' values, so every holder passes)."""
    if puller == UNKNOWN_LAYOUT:
        return None
    return _ReadableInto(puller)


def _answer(query: LookupQuery, match: PrefixMatch, verdict: _Verdict) -> Answer:
    """What the query's puller is told of the verdict on a match (Lookup's answer, Route's plan)."""
    matched = match.best.matched_blocks if match.best else 0
    pulled = matched if verdict.decision == pb.DECISION_TRANSFER else 0
    return Answer(
        decision=verdict.decision,
        reason=verdict.reason,
        path=path_of(verdict.decision, verdict.reason),
        detail=verdict.detail,
        cost=verdict.cost,
        match=match,
        matched_blocks=matched,
        recompute_blocks=len(query.hashes) - max(pulled, query.local_blocks),
    )


def _fitted(query: LookupQuery, match: PrefixMatch) -> PrefixMatch:
    """The match as the puller can read it: each holder cut to the end its sliding-window groups
    serve (windows.py); unchanged for a puller without sliding windows."""
    windows = query.layout.kv_group_windows
    if not any(windows):
        return match
    return fit_windows(match, windows, query.block_size, query.local_blocks)


def path_of(decision: int, reason: int) -> int:
    """The turn path a daemon answer sends the turn on."""
    if decision == pb.DECISION_TRANSFER:
        return pb.TURN_PATH_TRANSFER
    if decision == pb.DECISION_LOCAL:
        return pb.TURN_PATH_LOCAL
    if reason == pb.DECISION_REASON_MISS:
        return pb.TURN_PATH_MISS
    if reason == pb.DECISION_REASON_EXPIRED:
        return pb.TURN_PATH_EXPIRED
    return pb.TURN_PATH_RECOMPUTE


class _Verdict(msgspec.Struct, gc=False):
    decision: int
    reason: int
    detail: str
    cost: Cost | None = None


class CostModel:
    """Per (holder, puller, tier) transfer and per-worker prefill estimates, fed by agents' telemetry."""

    def __init__(self, config_for, max_pairs: int = 65_536) -> None:
        self._config_for = config_for
        # (holder, puller, tier of the holder's run: BlockTier); read by Policy.decide
        self.pairs: dict[tuple[str, str, int], _Pair] = {}
        # A Lookup's requester is the caller's to name: the pairs kept are bounded (see _make_room).
        self.max_pairs = max_pairs
        self.forgotten_pairs = 0
        self._prefill: dict[str, _Window] = {}  # worker -> tokens/s
        # worker -> (config, tokens/s, basis) until its next prefill sample: read on every Lookup
        self._prefill_rates: dict[str, tuple[PolicyConfig, float, str]] = {}

    def pair(self, holder: str, puller: str, model: str, tier: int = BlockTier.DEVICE) -> _Pair:
        key = (holder, puller, tier)
        pair = self.pairs.get(key)
        if pair is None:
            if len(self.pairs) >= self.max_pairs:
                self._make_room()
            size = self._config_for(model).window_samples
            pair = self.pairs[key] = _Pair(model, _Window(size), _Window(size))
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
        """Learn from a READ measured by NIXL itself; a failed READ says nothing about bandwidth, a
        first READ includes the one-time handshake, and the engine's view includes step waits. The
        report's source tier (UNSPECIFIED: device) selects the estimate it teaches."""
        pair = self.pair(holder, puller, model, report.source_tier or BlockTier.DEVICE)
        if not report.first_contact:  # a handshake's wait is paid once, and no longer at start-up
            pair.wait_s += report.wait_us / 1e6
            pair.waits += 1
            pair.recent_waits.append(report.wait_us / 1e6)
        if not report.ok or report.duration_us <= 0 or report.first_contact or not report.nixl_measured:
            return
        pair.bandwidth.add(report.bytes / (report.duration_us / 1e6))
        pair.setup.add(report.setup_us / 1e6)
        pair.rates = None

    def record_prefill(self, worker: str, tokens: int, duration_us: int, model: str) -> None:
        config = self._config_for(model)
        if tokens < config.min_prefill_sample_tokens or duration_us <= 0:
            return
        window = self._prefill.setdefault(worker, _Window(config.window_samples))
        window.add(tokens / (duration_us / 1e6))
        self._prefill_rates.pop(worker, None)

    def pooled_prefill_rate(self, workers: Sequence[str], config: PolicyConfig) -> tuple[float, str]:
        """One rate for these workers: the median of their latest samples together (the default
        filling a short pool, as for one worker)."""
        samples = [x for w in workers if (window := self._prefill.get(w)) for x in window.samples]
        if not samples:
            return config.default_prefill_tokens_per_s, "default"
        rate = _median_with_prior(samples, config.default_prefill_tokens_per_s, config.min_samples)
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
        pair: _Pair | None,
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

    def views(self) -> tuple[list[pb.PairEstimate], list[pb.PullerEstimate]]:
        now = time.monotonic()
        pairs = []
        for (holder, puller, tier), pair in sorted(self.pairs.items()):
            config = self._config_for(pair.model)
            bandwidth = pair.bandwidth.estimate(
                config.default_transfer_gbytes_per_s * 1e9, config.min_samples
            )
            pairs.append(
                pb.PairEstimate(
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
            pb.PullerEstimate(
                worker_id=worker,
                prefill_tokens_per_s=self.prefill_tokens_per_s(worker),
                sample_tokens_per_s=list(window.samples),
            )
            for worker, window in sorted(self._prefill.items())
        ]
        return pairs, pullers


class Policy:
    def __init__(self, default: PolicyConfig, per_model: dict[str, PolicyConfig] | None = None) -> None:
        self.default = default
        self.per_model = per_model or {}
        self.cost = CostModel(self.config_for)

    def config_for(self, model: str) -> PolicyConfig:
        return self.per_model.get(model, self.default)

    async def answer(self, store: BlockIndex, query: LookupQuery, now: float) -> Answer:
        """The one function that decides a turn's path."""
        margin_s, accept = query.lease_margin_s, _readable_into(query.layout)
        match = await store.lookup(
            query.namespace,
            query.hashes,
            query.local_blocks,
            query.requester,
            now,
            False,
            margin_s=margin_s,
            accept=accept,
        )
        match = _fitted(query, match)
        verdict = self.decide(query, match, now)
        if verdict.decision == pb.DECISION_TRANSFER and query.claim and match.best and match.best.single_use:
            # Claim only what is handed out: the same query again, now claiming in one store step.
            # Another puller may have claimed the run in between; then judge what is left.
            claimed = await store.lookup(
                query.namespace,
                query.hashes,
                query.local_blocks,
                query.requester,
                now,
                True,
                margin_s=margin_s,
                accept=accept,
            )
            raw, claimed = claimed.best, _fitted(query, claimed)
            if (
                raw is not None
                and raw.single_use
                and (claimed.best is None or claimed.best.handle != raw.handle)
            ):
                # the store claimed the run it ranks first, and a sliding window serves another one further
                await store.release_claim(query.namespace, raw.worker.worker_id, raw.handle, query.requester)
            if not _same_holding(claimed, match):
                verdict = self.decide(query, claimed, now)
                best = claimed.best
                if verdict.decision != pb.DECISION_TRANSFER and best is not None and best.single_use:
                    await store.release_claim(
                        query.namespace, best.worker.worker_id, best.handle, query.requester
                    )
            match = claimed
        return _answer(query, match, verdict)

    def decide(
        self, query: LookupQuery, match: PrefixMatch, now: float | None = None, *, peek: bool = False
    ) -> _Verdict:
        """The verdict on a match; ``peek`` (Route) judges by the estimates alone and records nothing
        (no verdict counts, no probe)."""
        config = self.per_model.get(query.namespace.model, self.default)  # config_for, on every Lookup
        local_blocks = query.local_blocks
        best = match.best
        if best is None:
            if match.unservable_reason == "directory_resyncing":
                return _Verdict(
                    pb.DECISION_RECOMPUTE,
                    pb.DECISION_REASON_DIRECTORY_RESYNCING,
                    "the directory store failed over: nothing is handed out until its workers have "
                    "re-pushed their state",
                )
            if match.unservable_reason:
                detail = (
                    f"blocks beyond the local prefix are held but not servable: {match.unservable_reason}"
                )
                if match.unservable_detail:
                    detail += f" ({match.unservable_detail})"
                return _Verdict(pb.DECISION_RECOMPUTE, _UNSERVABLE[match.unservable_reason], detail)
            if local_blocks > 0:
                return _Verdict(
                    pb.DECISION_LOCAL,
                    pb.DECISION_REASON_LOCAL_PREFIX,
                    f"no peer holds more than the local {local_blocks} blocks",
                )
            return _Verdict(pb.DECISION_RECOMPUTE, pb.DECISION_REASON_MISS, "no peer holds the first block")
        if not config.enabled:
            return _Verdict(pb.DECISION_RECOMPUTE, pb.DECISION_REASON_DISABLED, "transfer disabled")
        blocks = best.matched_blocks - local_blocks
        gain_tokens = blocks * query.block_size
        holder, puller, tier = best.worker.worker_id, query.requester, best.tier
        pair = self.cost.pairs.get((holder, puller, tier))
        cost = self.cost.estimate_on(
            pair, puller, best.worker.kv_bytes_per_block, blocks, gain_tokens, config
        )
        threshold = max(config.recompute_threshold_tokens, query.min_pull_tokens)
        if gain_tokens < threshold:
            return _Verdict(
                pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_BELOW_THRESHOLD,
                f"{gain_tokens} transferable tokens < threshold {threshold}",
                cost,
            )
        if peek:
            faster = cost.transfer_ms <= cost.recompute_ms * config.transfer_cost_ratio
            return _Verdict(
                pb.DECISION_TRANSFER if faster else pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_TRANSFER_FASTER if faster else pb.DECISION_REASON_RECOMPUTE_FASTER,
                "",
                cost,
            )
        if pair is None:  # kept from the first verdict on: ListPairs shows its verdicts
            pair = self.cost.pair(holder, puller, query.namespace.model, tier)
        return self._weigh(cost, pair, config, now)

    def _weigh(self, cost: Cost, pair: _Pair, config: PolicyConfig, now: float | None) -> _Verdict:
        now = time.monotonic() if now is None else now
        if cost.transfer_ms <= cost.recompute_ms * config.transfer_cost_ratio:
            verdict = _Verdict(
                pb.DECISION_TRANSFER,
                pb.DECISION_REASON_TRANSFER_FASTER,
                f"transfer ~{cost.transfer_ms:.2f} ms < recompute ~{cost.recompute_ms:.2f} ms",
                cost,
            )
        elif pair.bandwidth.samples and self._reprobe_due(pair, config, now):
            verdict = _Verdict(
                pb.DECISION_TRANSFER,
                pb.DECISION_REASON_PROBE,
                f"re-measuring after {pair.recompute_streak} estimates favoured recompute "
                f"(~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms)",
                cost,
            )
        else:
            pair.recompute_streak += 1
            verdict = _Verdict(
                pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_RECOMPUTE_FASTER,
                f"recompute ~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms",
                cost,
            )
        if verdict.decision == pb.DECISION_TRANSFER:
            pair.recompute_streak = 0
            pair.last_transfer = now
        pair.verdicts[verdict.reason] += 1
        return verdict

    @staticmethod
    def _reprobe_due(pair: _Pair, config: PolicyConfig, now: float) -> bool:
        """A pair that keeps losing to recompute is re-measured every reprobe_every verdicts and at
        least every reprobe_interval_s while lookups arrive (its estimate only moves with READs)."""
        if config.reprobe_every and pair.recompute_streak + 1 >= config.reprobe_every:
            return True
        since = now - pair.last_transfer if pair.last_transfer is not None else None
        return bool(config.reprobe_interval_s) and (since is None or since >= config.reprobe_interval_s)

    async def route(self, store: BlockIndex, query: RouteQuery, now: float) -> list[RouteScore]:
        """Candidates ranked by expected time to first token (best first); read-only.

        Per candidate: its own prefix-cache blocks from block 0, then the pull Lookup would decide on
        top of them (same store query, same estimates, no claim, no probe), then what is left to
        compute at its measured prefill rate, after its queue."""
        config = self.config_for(query.namespace.model)
        n = len(query.hashes)
        registered = [c.worker_id for c in query.candidates if c.spec is not None]
        local = await store.stored_prefixes(query.namespace, query.hashes, registered, now)
        pooled = (
            self.cost.pooled_prefill_rate(registered, config)
            if config.route_prefill_rate == "pooled"
            else None
        )
        scores = []
        pulls: list[tuple[RouteScore, LookupQuery]] = []
        for c in query.candidates:
            score = RouteScore(c, local_blocks=local.get(c.worker_id, 0) if c.spec is not None else 0)
            if c.spec is None:  # not a worker of the model: nothing measured of it
                rate, score.prefill_basis = config.default_prefill_tokens_per_s, "default"
            elif pooled is not None:
                rate, score.prefill_basis = pooled
            else:
                rate, score.prefill_basis = self.cost.prefill_rate(c.worker_id, config)
            score.prefill_tokens_per_s = rate
            if c.spec is not None and score.local_blocks < n:
                lookup = LookupQuery(
                    query.namespace,
                    query.hashes,
                    score.local_blocks,
                    c.worker_id,
                    query.block_size,
                    layout=KvLayout.of(c.spec),
                )
                pulls.append((score, lookup))
            elif score.local_blocks:
                score.pull_reason = pb.DECISION_REASON_LOCAL_PREFIX
            scores.append(score)
        # The candidates' pull lookups at once: on a networked store their round trips overlap.
        matches = await asyncio.gather(
            *(
                store.lookup(
                    lookup.namespace,
                    lookup.hashes,
                    lookup.local_blocks,
                    lookup.requester,
                    now,
                    claim=False,
                    accept=_readable_into(lookup.layout),
                )
                for _, lookup in pulls
            )
        )
        for (score, lookup), found in zip(pulls, matches, strict=True):
            match = _fitted(lookup, found)
            verdict = self.decide(lookup, match, now, peek=True)
            score.pull_reason, score.pull_cost = verdict.reason, verdict.cost
            if match.best is not None:
                score.pull_holder = match.best.worker.worker_id
                score.pull_holder_blocks = match.best.matched_blocks
                score.pull_holder_tier = match.best.tier
            if verdict.decision == pb.DECISION_TRANSFER and match.best is not None:
                score.pull_blocks = match.best.matched_blocks - score.local_blocks
                assert verdict.cost is not None
                score.transfer_ms = verdict.cost.transfer_ms
                score.pull_wait_ms = self.cost.step_wait_ms(
                    score.pull_holder, lookup.requester, score.pull_holder_tier
                )
                if not match.best.single_use:
                    score.plan = _answer(lookup, match, verdict)
        for score in scores:
            c, rate = score.candidate, score.prefill_tokens_per_s
            covered = (score.local_blocks + score.pull_blocks) * query.block_size
            score.compute_tokens = max(0, query.prompt_tokens - covered)
            score.compute_ms = score.compute_tokens / rate * 1e3
            score.queue_ms = queue_ms(c.queued_tokens, c.in_flight_requests, query.prompt_tokens, rate)
            score.expected_ttft_ms = (
                score.queue_ms + score.transfer_ms + score.pull_wait_ms + score.compute_ms
            )
        # Stable: equal estimates keep the caller's order (its own tie-break).
        scores.sort(key=lambda s: s.expected_ttft_ms)
        return scores

    def tie_rule(self, model: str) -> tuple[float, float]:
        """The model's (route_tie_ms, route_tie_ratio): Route answers them, so a router that re-ranks
        ties as kvloopd does."""
        config = self.config_for(model)
        return config.route_tie_ms, config.route_tie_ratio

    def tied(self, model: str, ranked: Sequence[RouteScore]) -> int:
        """How many leading candidates are within the model's tie margin of the best."""
        if not ranked:
            return 0
        best = ranked[0].expected_ttft_ms
        margin = tie_margin_ms(best, *self.tie_rule(model))
        return sum(1 for s in ranked if s.expected_ttft_ms - best <= margin)

    def pairs(self) -> pb.ListPairsResponse:
        pairs, pullers = self.cost.views()
        return pb.ListPairsResponse(pairs=pairs, pullers=pullers)
