"""`kvloop bench replay`'s options as one value, and the replay's inputs built from them: the request
log (read or generated), the simulated fleet, the cost model and the sweep grid."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvloop.clients.cli.output import _fail

if TYPE_CHECKING:
    from kvloop.clients.bench.replay.fleet import FleetConfig
    from kvloop.clients.bench.replay.gen import SyntheticConfig
    from kvloop.clients.bench.replay.report import CostModel
    from kvloop.clients.bench.replay.runner import ReplayConfig
    from kvloop.clients.bench.replay.trace import TraceRequest


@dataclass(frozen=True)
class ReplayOptions:
    """One field per option of `kvloop bench replay`, named as the command's parameters are."""

    trace: Path | None
    synthetic: int | None
    trace_format: str
    tokenizer: str | None
    trace_block_size: int
    limit: int | None
    seed: int
    write_trace: Path | None
    population: str
    agent_share: float
    agent_gap: float
    chat_gap: float
    system_tokens: str
    tool_tokens: float
    turns: float
    prefills: int
    decodes: int
    block_size: int
    retention_blocks: int
    host_retention_blocks: int
    host_eviction: str
    host_pool_per_copy: bool
    lease: float
    expiry_margin: float
    prefill_cache_blocks: int
    routing: str
    min_pull_tokens: int
    kv_bytes_per_token: int
    decode_ms_per_token: float
    lookup_timeout_ms: float
    decode_failures: int
    failure_downtime: float
    speedup: float
    max_wall_s: float
    prefill_tokens_per_s: float
    link_gbps: float
    setup_ms: float
    host_read_gbps: float
    multiturn_results: Path | None
    sweep: list[str] | None
    plot: Path
    buckets: int
    store: str
    replicas: int
    no_route: bool
    daemon_arg: list[str] | None
    output: Path | None
    json_output: bool


@dataclass(frozen=True)
class ReplayInputs:
    requests: list[TraceRequest]
    config: ReplayConfig
    # What the report says of the request log (its source, and the generator's settings if synthetic).
    info: dict
    grid: dict[str, list[float]]


def replay_inputs(options: ReplayOptions) -> ReplayInputs:
    """The replay's inputs; a usage error (exit 2) on the first option found wrong: the choices, then
    the figures, then the request log, then the store."""
    from kvloop.clients.bench.replay import runner as rp
    from kvloop.clients.bench.replay.report import CostModelError

    _check_choices(options)
    system_range = _system_token_range(options.system_tokens)
    try:
        grid = rp.parse_sweep(options.sweep or [])
        cost = _cost_model(options)
    except (ValueError, CostModelError) as exc:
        _fail(str(exc), code=2)
    requests, info = _requests(options, system_range)
    _check_store(options.store, options.replicas)
    config = rp.ReplayConfig(
        fleet=_fleet_config(options),
        cost=cost,
        buckets=options.buckets,
        daemon_args=tuple(options.daemon_arg or ()),
        store=options.store,
        replicas=options.replicas,
    )
    return ReplayInputs(requests, config, info, grid)


def _check_choices(options: ReplayOptions) -> None:
    from kvloop.agents.connector.host.eviction import POLICIES
    from kvloop.clients.bench.replay.fleet import ROUTINGS
    from kvloop.clients.bench.replay.gen import POPULATIONS

    if (options.trace is None) == (options.synthetic is None):
        _fail("give exactly one of --trace FILE and --synthetic N", code=2)
    if options.routing not in ROUTINGS:
        _fail(f"--routing {options.routing!r}: choose from {', '.join(ROUTINGS)}", code=2)
    if options.host_eviction not in POLICIES:
        _fail(f"--host-eviction {options.host_eviction!r}: choose from {', '.join(POLICIES)}", code=2)
    if options.population not in POPULATIONS:
        _fail(f"--population {options.population!r}: choose from {', '.join(POPULATIONS)}", code=2)
    if options.trace_format not in ("auto", "mooncake", "chat"):
        _fail(f"--format {options.trace_format!r}: auto, mooncake or chat", code=2)


def _system_token_range(system_tokens: str) -> tuple[int, int]:
    try:
        low, _, high = system_tokens.partition(",")
        system_range = (int(low), int(high or low))
        if not 1 <= system_range[0] <= system_range[1]:
            raise ValueError
    except ValueError:
        _fail(f"--system-tokens {system_tokens!r}: MIN,MAX with 1 <= MIN <= MAX", code=2)
    return system_range


def _cost_model(options: ReplayOptions) -> CostModel:
    from kvloop.clients.bench.replay.report import CostModel

    if options.multiturn_results:
        return CostModel.from_multiturn(options.multiturn_results).with_host_read(
            options.host_read_gbps, options.kv_bytes_per_token
        )
    return CostModel.from_figures(
        options.prefill_tokens_per_s,
        options.link_gbps,
        options.setup_ms,
        options.kv_bytes_per_token,
        options.host_read_gbps,
    )


def _requests(options: ReplayOptions, system_range: tuple[int, int]) -> tuple[list[TraceRequest], dict]:
    """The requests to replay, and what the report says of them."""
    from kvloop.clients.bench.replay.trace import TraceError, read_trace

    try:
        if options.synthetic is not None:
            requests, info = _synthetic_requests(options, _synthetic_config(options, system_range))
        else:
            assert options.trace is not None
            requests = read_trace(
                options.trace,
                options.block_size,
                options.trace_format,
                options.tokenizer,
                options.trace_block_size,
                options.limit,
            )
            info = {"source": str(options.trace)}
    except TraceError as exc:
        _fail(str(exc), code=2)
    info["requests"] = len(requests)
    info["sessions"] = len({r.session for r in requests if r.session is not None})
    return requests, info


def _synthetic_config(options: ReplayOptions, system_range: tuple[int, int]) -> SyntheticConfig:
    from kvloop.clients.bench.replay.gen import SyntheticConfig

    return SyntheticConfig(
        requests=options.synthetic,
        seed=options.seed,
        population=options.population,
        agent_share=options.agent_share,
        agent_gap_s_median=options.agent_gap,
        chat_gap_s_median=options.chat_gap,
        system_tokens=system_range,
        tool_tokens_median=options.tool_tokens,
        mean_turns=options.turns,
    )


def _synthetic_requests(options: ReplayOptions, gen: SyntheticConfig) -> tuple[list[TraceRequest], dict]:
    """A generated trace, read back as a logged one is: through a file (--write-trace, or a temporary
    one removed once read)."""
    from kvloop.clients.bench.replay.gen import describe, generate
    from kvloop.clients.bench.replay.trace import read_trace, write_jsonl

    path = options.write_trace
    if path is None:
        fd, name = tempfile.mkstemp(prefix="kvloop-replay-", suffix=".jsonl")
        os.close(fd)
        path = Path(name)
    write_jsonl(path, generate(gen))
    info = {
        "source": "synthetic",
        "generator": describe(gen),
        "written_to": str(options.write_trace) if options.write_trace else None,
    }
    requests = read_trace(path, options.block_size, "mooncake", None, gen.block_size, options.limit)
    if options.write_trace is None:
        path.unlink()
    return requests, info


def _fleet_config(options: ReplayOptions) -> FleetConfig:
    from kvloop.clients.bench.replay.fleet import FleetConfig

    return FleetConfig(
        prefills=options.prefills,
        decodes=options.decodes,
        block_size=options.block_size,
        retention_blocks=options.retention_blocks,
        host_retention_blocks=options.host_retention_blocks,
        host_eviction=options.host_eviction,
        host_pool_shared=not options.host_pool_per_copy,
        lease_s=options.lease,
        expiry_margin_s=options.expiry_margin,
        prefill_cache_blocks=options.prefill_cache_blocks,
        routing=options.routing,
        min_pull_tokens=options.min_pull_tokens,
        kv_bytes_per_token=options.kv_bytes_per_token,
        decode_ms_per_token=options.decode_ms_per_token,
        speedup=options.speedup,
        max_wall_s=options.max_wall_s,
        lookup_timeout_ms=options.lookup_timeout_ms,
        decode_failures=options.decode_failures,
        failure_downtime_s=options.failure_downtime,
        seed=options.seed,
        route=not options.no_route,
    )


def _check_store(store: str, replicas: int) -> None:
    if store not in ("memory", "redis", "redis-cluster") and not store.startswith(
        ("redis://", "rediss://", "unix://")
    ):
        _fail(f"--store must be memory, redis, redis-cluster or a redis:// URL, got {store!r}", code=2)
    if replicas > 1 and store == "memory":
        _fail("--replicas needs a shared store: --store redis or redis-cluster", code=2)
