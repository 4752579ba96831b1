"""Whether a turn pulls, and why: the one place kvloop decides (``Policy.answer``).

The puller states its constraints in the Lookup (its minimum pull, its lease margin, its KV layout);
``Policy.answer`` asks the store for the longest servable prefix under them, weighs moving it
against recomputing it, claims a single-use run only when it answers TRANSFER, and names the turn's
path and reason in the proto's vocabulary. The connector applies the answer and adds only what it
alone can know (the READ's own outcome, a lease that ran out before the READ was posted).

Agents report every NIXL READ (bytes, duration, setup) and every prefill (tokens, duration). The
model keeps exponentially weighted estimates per (holder, puller) pair and per prefill worker and
falls back to configured defaults until it has measurements; each decision says which it used.

Two things keep one bad sample from deciding forever. A pair's first READ also pays the NIXL
handshake (hundreds of ms on a busy host), a one-time cost: it is kept apart and never charged to
later transfers. And transfer estimates are only refreshed by transfers, so a pair whose estimate
says "recompute" would never be measured again: every ``reprobe_every``-th such verdict transfers
anyway (reason PROBE), which is always correct, only possibly slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from kvloop.daemon.index.model import Namespace, PrefixMatch, WorkerSpec
from kvloop.daemon.index.store import DirectoryStore
from kvloop.v1 import directory_pb2 as pb


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
    ewma_alpha: float = Field(0.2, gt=0, le=1)
    # After this many consecutive measured "recompute is faster" verdicts for a pair, transfer once
    # to re-measure it (0: never).
    reprobe_every: int = Field(16, ge=0)
    enabled: bool = True


@dataclass(slots=True)
class _Ewma:
    value: float
    samples: int = 1

    def update(self, sample: float, alpha: float) -> None:
        self.value += alpha * (sample - self.value)
        self.samples += 1


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What decides whether one worker's KV can be READ into another's (0 / "": unknown)."""

    tensor_parallel_size: int = 0
    pipeline_parallel_size: int = 0
    kv_dtype: str = ""
    kv_bytes_per_block: int = 0

    @classmethod
    def of(cls, spec: WorkerSpec) -> KvLayout:
        tp, pp, _, _ = spec.parallel
        return cls(tp, pp, spec.kv_dtype, spec.kv_bytes_per_block)


def layout_mismatch(holder: KvLayout, puller: KvLayout) -> str | None:
    """Why vLLM's NIXL connector cannot READ the holder's KV into the puller (None: it can).

    Its rules (vllm 0.32 ``TransferTopology.tp_ratio``): one TP size must divide the other; the
    element types must agree. With equal TP sizes the bytes per block must agree too (a different
    model or KV layout); across TP sizes a rank holds a share of the heads, so they are not compared.
    """
    if holder.kv_dtype and puller.kv_dtype and holder.kv_dtype != puller.kv_dtype:
        return f"KV dtype {holder.kv_dtype} cannot be read into {puller.kv_dtype}"
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


@dataclass(frozen=True, slots=True)
class LookupQuery:
    """A Lookup in domain terms: the prompt and the puller's constraints."""

    namespace: Namespace
    hashes: Sequence[bytes]
    local_blocks: int
    requester: str
    block_size: int
    claim: bool = False
    min_pull_tokens: int = 0
    lease_margin_s: float = 0.0
    layout: KvLayout = field(default_factory=KvLayout)


@dataclass(slots=True)
class Answer:
    decision: int
    reason: int
    path: int
    detail: str
    cost: pb.CostEstimate | None
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
}


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


@dataclass(slots=True)
class _Verdict:
    decision: int
    reason: int
    detail: str
    cost: pb.CostEstimate | None = None


class CostModel:
    """Per (holder, puller) transfer and per-worker prefill estimates, fed by agents' telemetry."""

    def __init__(self, config_for) -> None:
        self._config_for = config_for
        self._bandwidth: dict[tuple[str, str], _Ewma] = {}  # (holder, puller) -> bytes/s
        self._setup: dict[tuple[str, str], _Ewma] = {}  # (holder, puller) -> seconds
        self._prefill: dict[str, _Ewma] = {}  # worker -> tokens/s

    def record_transfer(
        self,
        puller: str,
        holder: str,
        nbytes: int,
        duration_us: int,
        setup_us: int,
        ok: bool,
        model: str,
        first_contact: bool = False,
    ) -> None:
        # A failed READ says nothing about bandwidth; a first READ includes the one-time handshake
        # (the caller's metrics count it, the estimate does not).
        if not ok or duration_us <= 0 or first_contact:
            return
        alpha = self._config_for(model).ewma_alpha
        key = (holder, puller)
        data_s = max(duration_us - setup_us, 1) / 1e6
        self._observe(self._bandwidth, key, nbytes / data_s, alpha)
        self._observe(self._setup, key, setup_us / 1e6, alpha)

    def record_prefill(self, worker: str, tokens: int, duration_us: int, model: str) -> None:
        config = self._config_for(model)
        if tokens < config.min_prefill_sample_tokens or duration_us <= 0:
            return
        self._observe(self._prefill, worker, tokens / (duration_us / 1e6), config.ewma_alpha)

    @staticmethod
    def _observe(table: dict, key, sample: float, alpha: float) -> None:
        current = table.get(key)
        if current is None:
            table[key] = _Ewma(sample)
        else:
            current.update(sample, alpha)

    def prefill_tokens_per_s(self, worker: str) -> float:
        measured = self._prefill.get(worker)
        return measured.value if measured else 0.0

    def measured(self, holder: str, puller: str) -> bool:
        return (holder, puller) in self._bandwidth

    def estimate(
        self, holder: str, puller: str, bytes_per_block: int, blocks: int, tokens: int, config: PolicyConfig
    ) -> pb.CostEstimate:
        nbytes = bytes_per_block * blocks
        bandwidth = self._bandwidth.get((holder, puller))
        setup = self._setup.get((holder, puller))
        if bandwidth is not None and setup is not None:
            transfer_s = setup.value + nbytes / bandwidth.value
            transfer_basis = f"measured ({bandwidth.samples} reads)"
        else:
            transfer_s = config.default_transfer_setup_ms / 1e3 + nbytes / (
                config.default_transfer_gbytes_per_s * 1e9
            )
            transfer_basis = "default"
        prefill = self._prefill.get(puller)
        tokens_per_s = prefill.value if prefill else config.default_prefill_tokens_per_s
        return pb.CostEstimate(
            transfer_ms=transfer_s * 1e3,
            recompute_ms=tokens / tokens_per_s * 1e3,
            transfer_bytes=nbytes,
            transfer_basis=transfer_basis,
            recompute_basis=f"measured ({prefill.samples} prefills)" if prefill else "default",
        )


class Policy:
    def __init__(self, default: PolicyConfig, per_model: dict[str, PolicyConfig] | None = None) -> None:
        self.default = default
        self.per_model = per_model or {}
        self.cost = CostModel(self.config_for)
        self._recompute_streak: dict[tuple[str, str], int] = {}  # measured "recompute faster" in a row

    def config_for(self, model: str) -> PolicyConfig:
        return self.per_model.get(model, self.default)

    def answer(self, store: DirectoryStore, query: LookupQuery, now: float) -> Answer:
        """The one function that decides a turn's path."""
        lookup = {
            "margin_s": query.lease_margin_s,
            "accept": lambda spec: layout_mismatch(KvLayout.of(spec), query.layout) is None,
        }
        match = store.lookup(
            query.namespace, query.hashes, query.local_blocks, query.requester, now, claim=False, **lookup
        )
        verdict = self.decide(query, match)
        if verdict.decision == pb.DECISION_TRANSFER and query.claim and match.best and match.best.single_use:
            # Claim only what is handed out; the same query again, now claiming (no await between).
            match = store.lookup(
                query.namespace, query.hashes, query.local_blocks, query.requester, now, claim=True, **lookup
            )
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

    def decide(self, query: LookupQuery, match: PrefixMatch) -> _Verdict:
        config = self.config_for(query.namespace.model)
        local_blocks = query.local_blocks
        best = match.best
        if best is None:
            if match.unservable_reason:
                return _Verdict(
                    pb.DECISION_RECOMPUTE,
                    _UNSERVABLE[match.unservable_reason],
                    f"blocks beyond the local prefix are held but not servable: {match.unservable_reason}",
                )
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
        holder, puller = best.worker.worker_id, query.requester
        cost = self.cost.estimate(holder, puller, best.worker.kv_bytes_per_block, blocks, gain_tokens, config)
        threshold = max(config.recompute_threshold_tokens, query.min_pull_tokens)
        if gain_tokens < threshold:
            return _Verdict(
                pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_BELOW_THRESHOLD,
                f"{gain_tokens} transferable tokens < threshold {threshold}",
                cost,
            )
        pair = (holder, puller)
        if cost.transfer_ms <= cost.recompute_ms * config.transfer_cost_ratio:
            self._recompute_streak.pop(pair, None)
            return _Verdict(
                pb.DECISION_TRANSFER,
                pb.DECISION_REASON_TRANSFER_FASTER,
                f"transfer ~{cost.transfer_ms:.2f} ms < recompute ~{cost.recompute_ms:.2f} ms",
                cost,
            )
        if self.cost.measured(holder, puller) and config.reprobe_every:
            streak = self._recompute_streak.get(pair, 0) + 1
            if streak >= config.reprobe_every:
                self._recompute_streak.pop(pair, None)
                return _Verdict(
                    pb.DECISION_TRANSFER,
                    pb.DECISION_REASON_PROBE,
                    f"re-measuring: the last {streak - 1} estimates favoured recompute "
                    f"(~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms)",
                    cost,
                )
            self._recompute_streak[pair] = streak
        return _Verdict(
            pb.DECISION_RECOMPUTE,
            pb.DECISION_REASON_RECOMPUTE_FASTER,
            f"recompute ~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms",
            cost,
        )
