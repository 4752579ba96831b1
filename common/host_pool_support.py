"""Which engine layouts a decode's host retention pool mirrors: one statement of the rules, applied by
the pool when the engine starts (``agents/connector/host/pool.py``, from the worker's own layout) and by
``kvloop doctor`` to a configuration before anything starts (from the options and the model's
``config.json``). No vLLM import: the doctor runs where vLLM may be absent.

A pool region mirrors a KV-cache region block for block, so the pool serves any layout whose blocks
are one scheduler block each in memory of one kind: tensor parallelism (one pool per rank) included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Architectures whose layers keep Mamba / SSM (or other linear-attention) state: a state, not blocks of
# KV the pool can mirror. Matched by substring of config.json's ``architectures``.
STATE_SPACE_ARCHITECTURES = (
    "Mamba",
    "Jamba",
    "Zamba",
    "Bamba",
    "FalconH1",
    "NemotronH",
    "GraniteMoeHybrid",
    "Plamo2",
    "Lfm2",
    "Qwen3Next",
    "MiniMaxText01",
)
STATE_SPACE_LAYER_TYPES = ("mamba", "linear_attention", "conv", "ssm")


@dataclass(frozen=True)
class PoolLayout:
    """What decides whether the pool mirrors an engine's KV cache. ``None``: not known yet (decided
    when the engine starts and vLLM has laid its KV cache out)."""

    pipeline_parallel_size: int = 1
    has_state_space_layers: bool | None = False
    # the KV cache staged through host memory (kv_buffer_device cpu on a GPU)
    host_staging_buffer: bool = False
    mixed_memory_types: bool | None = False
    kernel_blocks_per_block: int | None = 1


@dataclass
class PoolVerdict:
    problems: list[str] = field(default_factory=list)  # refused, each with the reason
    at_start: list[str] = field(default_factory=list)  # decided when the engine starts

    @property
    def available(self) -> bool:
        return not self.problems


def pool_verdict(layout: PoolLayout) -> PoolVerdict:
    verdict = PoolVerdict()
    if layout.pipeline_parallel_size != 1:
        verdict.problems.append("pipeline parallelism")
    if layout.has_state_space_layers:
        verdict.problems.append("Mamba/SSM state")
    elif layout.has_state_space_layers is None:
        verdict.at_start.append("whether the model keeps Mamba/SSM state")
    if layout.host_staging_buffer:
        verdict.problems.append("a host staging buffer (kv_buffer_device cpu on a GPU)")
    if layout.mixed_memory_types:
        verdict.problems.append("KV cache regions of mixed memory types")
    elif layout.mixed_memory_types is None:
        verdict.at_start.append("whether the KV cache regions share one memory type")
    if layout.kernel_blocks_per_block is None:
        verdict.at_start.append("whether the attention backend splits a block into smaller kernel blocks")
    elif layout.kernel_blocks_per_block != 1:
        verdict.problems.append("kernel blocks smaller than the scheduler's")
    return verdict


def refusal(verdict: PoolVerdict) -> str | None:
    """The one line an engine that cannot serve a pool stops with."""
    if verdict.available:
        return None
    return "kvloop_host_retention_gib does not support " + ", ".join(verdict.problems) + ": set it to 0"


def model_layout(
    config_json: dict, *, gpu: bool, pipeline_parallel_size: int = 1, kv_buffer_device: str = ""
) -> PoolLayout:
    """A configuration's layout as far as it is known before the engine starts: from the model's
    ``config.json`` (its text config for multimodal models) and the serving options."""
    text = config_json.get("text_config") or config_json
    architectures = [str(a) for a in config_json.get("architectures") or ()]
    layer_types = [str(t).lower() for t in text.get("layer_types") or ()]
    state_space = any(s in a for a in architectures for s in STATE_SPACE_ARCHITECTURES) or any(
        any(s in t for s in STATE_SPACE_LAYER_TYPES) for t in layer_types
    )
    # sliding-window and full-attention layers side by side: on a GPU some attention backends use
    # kernel blocks smaller than the scheduler's for such models; on the CPU build they never do
    hybrid = len({t for t in layer_types if "attention" in t}) > 1 or bool(
        text.get("sliding_window") and text.get("sliding_window_pattern")
    )
    return PoolLayout(
        pipeline_parallel_size=pipeline_parallel_size,
        has_state_space_layers=state_space,
        host_staging_buffer=gpu and kv_buffer_device == "cpu",
        mixed_memory_types=False,
        kernel_blocks_per_block=None if gpu and hybrid else 1,
    )


def read_model_config(model_dir: Path) -> dict:
    """A local model folder's ``config.json``. ValueError with the reason when it cannot be read."""
    path = model_dir / "config.json"
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} is not a model config (a JSON object)")
    return loaded
