"""The decision's settings (``[policy]`` and ``[models.<name>.policy]`` in kvloopd's config): the cost
model's defaults and windows, the transfer threshold, and Route's tie rule and prefill rate."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
