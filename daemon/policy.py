"""Transfer-vs-recompute policy: a recomputation threshold plus a cost model fed by telemetry.

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

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from kvloop.daemon.index.model import PrefixMatch
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


@dataclass(slots=True)
class Verdict:
    decision: int
    reason: int
    detail: str
    cost: pb.CostEstimate | None


_UNSERVABLE = {
    "expired": pb.DECISION_REASON_EXPIRED,
    "claimed": pb.DECISION_REASON_CLAIMED,
    "peer_unavailable": pb.DECISION_REASON_PEER_UNAVAILABLE,
}


class CostModel:
    def __init__(self, default: PolicyConfig, per_model: dict[str, PolicyConfig] | None = None) -> None:
        self.default = default
        self.per_model = per_model or {}
        self._bandwidth: dict[tuple[str, str], _Ewma] = {}  # (holder, puller) -> bytes/s
        self._setup: dict[tuple[str, str], _Ewma] = {}  # (holder, puller) -> seconds
        self._prefill: dict[str, _Ewma] = {}  # worker -> tokens/s
        self._recompute_streak: dict[tuple[str, str], int] = {}  # measured "recompute faster" in a row

    def config_for(self, model: str) -> PolicyConfig:
        return self.per_model.get(model, self.default)

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
        alpha = self.config_for(model).ewma_alpha
        key = (holder, puller)
        data_s = max(duration_us - setup_us, 1) / 1e6
        self._observe(self._bandwidth, key, nbytes / data_s, alpha)
        self._observe(self._setup, key, setup_us / 1e6, alpha)

    def record_prefill(self, worker: str, tokens: int, duration_us: int, model: str) -> None:
        if tokens < self.config_for(model).min_prefill_sample_tokens or duration_us <= 0:
            return
        self._observe(self._prefill, worker, tokens / (duration_us / 1e6), self.config_for(model).ewma_alpha)

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

    def decide(
        self,
        model: str,
        match: PrefixMatch,
        prompt_blocks: int,
        local_blocks: int,
        block_size: int,
        requester: str,
        allow_transfer: bool = True,
    ) -> Verdict:
        config = self.config_for(model)
        best = match.best
        if best is None:
            if match.unservable_reason:
                return Verdict(
                    pb.DECISION_RECOMPUTE,
                    _UNSERVABLE[match.unservable_reason],
                    f"blocks beyond the local prefix are held but not servable: {match.unservable_reason}",
                    None,
                )
            if local_blocks > 0:
                return Verdict(
                    pb.DECISION_LOCAL,
                    pb.DECISION_REASON_LOCAL_PREFIX,
                    f"no peer holds more than the local {local_blocks} blocks",
                    None,
                )
            return Verdict(
                pb.DECISION_RECOMPUTE, pb.DECISION_REASON_MISS, "no peer holds the first block", None
            )
        gain_tokens = (best.matched_blocks - local_blocks) * block_size
        if not (config.enabled and allow_transfer):
            return Verdict(pb.DECISION_RECOMPUTE, pb.DECISION_REASON_DISABLED, "transfer disabled", None)
        cost = self._estimate(
            best.worker.worker_id,
            requester,
            best.worker.kv_bytes_per_block,
            best.matched_blocks - local_blocks,
            gain_tokens,
            config,
        )
        if gain_tokens < config.recompute_threshold_tokens:
            return Verdict(
                pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_BELOW_THRESHOLD,
                f"{gain_tokens} transferable tokens < threshold {config.recompute_threshold_tokens}",
                cost,
            )
        pair = (best.worker.worker_id, requester)
        if cost.transfer_ms <= cost.recompute_ms * config.transfer_cost_ratio:
            self._recompute_streak.pop(pair, None)
            return Verdict(
                pb.DECISION_TRANSFER,
                pb.DECISION_REASON_TRANSFER_FASTER,
                f"transfer ~{cost.transfer_ms:.2f} ms < recompute ~{cost.recompute_ms:.2f} ms",
                cost,
            )
        if pair in self._bandwidth and config.reprobe_every:
            streak = self._recompute_streak.get(pair, 0) + 1
            if streak >= config.reprobe_every:
                self._recompute_streak.pop(pair, None)
                return Verdict(
                    pb.DECISION_TRANSFER,
                    pb.DECISION_REASON_PROBE,
                    f"re-measuring: the last {streak - 1} estimates favoured recompute "
                    f"(~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms)",
                    cost,
                )
            self._recompute_streak[pair] = streak
        return Verdict(
            pb.DECISION_RECOMPUTE,
            pb.DECISION_REASON_RECOMPUTE_FASTER,
            f"recompute ~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms",
            cost,
        )

    def _estimate(
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
