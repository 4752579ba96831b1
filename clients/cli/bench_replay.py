"""`kvloop bench replay`: a request log replayed through a real kvloopd with a simulated fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from kvloop.clients.cli.output import JsonFlag, _emit_json, _fail, console, err_console, state
from kvloop.clients.cli.replay_options import ReplayInputs, ReplayOptions, replay_inputs

if TYPE_CHECKING:
    from rich.progress import TaskID

_Trace = Annotated[
    Optional[Path],
    typer.Option(help="request log: Mooncake trace JSONL or OpenAI-style chat requests JSONL"),
]
_Synthetic = Annotated[
    Optional[int], typer.Option(min=1, help="replay a seeded synthetic trace of N requests instead")
]
_Tokenizer = Annotated[
    Optional[str],
    typer.Option(help="chat logs: local tokenizer (directory) whose chat template renders them"),
]
_WriteTrace = Annotated[
    Optional[Path], typer.Option(help="--synthetic: also write the generated trace here (JSONL)")
]
_Population = Annotated[
    str,
    typer.Option(
        help="--synthetic: uniform (every session's gaps alike) or mixed (agent sessions back within "
        "seconds, chat sessions after minutes)"
    ),
]
_AgentShare = Annotated[float, typer.Option(min=0, max=1, help="--population mixed: share of agent sessions")]
_AgentGap = Annotated[
    float, typer.Option(min=0, help="--population mixed: median gap between an agent's turns, s")
]
_ChatGap = Annotated[
    float, typer.Option(min=0, help="--population mixed: median gap between a chat's turns, s")
]
_SystemTokens = Annotated[
    str,
    typer.Option(
        help="--synthetic: tokens of each shared system prompt, MIN,MAX (drawn uniformly; "
        "6000,12000 with --tool-tokens 1000: long prompts, ~13K tokens on average)"
    ),
]
_ToolTokens = Annotated[
    float, typer.Option(min=1, help="--synthetic: median tokens a tool's output appends per turn")
]
_RetentionBlocks = Annotated[
    int, typer.Option(min=0, help="decode KV memory set aside for retained turns, blocks per decode")
]
_HostRetentionBlocks = Annotated[
    int,
    typer.Option(
        min=0,
        help="decode host memory that takes the turns the KV memory evicts, blocks per decode (0: none)",
    ),
]
_HostEviction = Annotated[
    str,
    typer.Option(
        help="which runs the host memory evicts first (kvloop_host_eviction): lru or predicted_return"
    ),
]
_HostPoolPerCopy = Annotated[
    bool,
    typer.Option(
        help="host memory holds each run's blocks apart (a pool that copies every run whole), "
        "not each block once as the connector's does: for comparison"
    ),
]
_Lease = Annotated[float, typer.Option(min=0, help="retention lease, s (vLLM decoder_kv_blocks_ttl)")]
_ExpiryMargin = Annotated[
    float, typer.Option(min=0, help="puller's lease margin, s (kvloop_expiry_margin_s)")
]
_PrefillCacheBlocks = Annotated[
    int, typer.Option(min=0, help="prefill prefix-cache capacity, blocks per prefill (0: off)")
]
_Routing = Annotated[
    str, typer.Option(help="kvloop (decode = holder, else least loaded), round_robin or random")
]
_KvBytesPerToken = Annotated[
    int, typer.Option(min=1, help="KV bytes per token of the model (all layers, K and V)")
]
_DecodeMsPerToken = Annotated[float, typer.Option(min=0, help="decode time per output token, ms")]
_LookupTimeoutMs = Annotated[
    float,
    typer.Option(
        min=1, help="deadline of each Lookup (the connector's: 20; a miss is directory_unavailable)"
    ),
]
_DecodeFailures = Annotated[
    int, typer.Option(min=0, help="decode crashes spread over the trace (runs lost, new epoch)")
]
_Speedup = Annotated[float, typer.Option(min=0, help="trace time x this = wall time; 0: as fast as possible")]
_MaxWallS = Annotated[
    float, typer.Option(min=0, help="stop replaying after this many s (the report says truncated)")
]
_LinkGbps = Annotated[float, typer.Option(help="cost model: link Gbit/s between decode and prefill")]
_HostReadGbps = Annotated[
    float,
    typer.Option(
        help="cost model: Gbit/s of a pull from a decode's host memory (PCIe-class; never above the link)"
    ),
]
_MultiturnResults = Annotated[
    Optional[Path],
    typer.Option(help="cost model fitted to a `kvloop bench multiturn --json` output instead"),
]
_Sweep = Annotated[
    Optional[list[str]],
    typer.Option(
        help="repeat over settings, e.g. lease=60,240,480,memory=10000,50000 (keys: lease, "
        "memory, host_memory, prefill_cache, decodes, prefills)"
    ),
]
_Plot = Annotated[Path, typer.Option(help="--sweep: PNG of the saving against the settings")]
_Store = Annotated[
    str,
    typer.Option(
        help="kvloopd's store: memory, redis (a redis-server of its own), redis-cluster (a 3-primary "
        "Redis Cluster of its own) or a redis:// URL"
    ),
]
_Replicas = Annotated[
    int, typer.Option(min=1, help="kvloopd processes sharing the store; the workers spread over them")
]
_NoRoute = Annotated[bool, typer.Option("--no-route", help="skip the Route call per request (the proxy's)")]
_DaemonArg = Annotated[
    Optional[list[str]], typer.Option(help="extra kvloopd flag (repeatable), e.g. a store option")
]
_Output = Annotated[Optional[Path], typer.Option("--output", "-o", help="also write the report JSON here")]


def bench_replay(
    trace: _Trace = None,
    synthetic: _Synthetic = None,
    trace_format: Annotated[str, typer.Option("--format", help="auto, mooncake or chat")] = "auto",
    tokenizer: _Tokenizer = None,
    trace_block_size: Annotated[int, typer.Option(min=1, help="Mooncake trace: tokens per hash_id")] = 512,
    limit: Annotated[Optional[int], typer.Option(min=1, help="replay only the first N requests")] = None,
    seed: Annotated[int, typer.Option(help="synthetic trace and random routing seed")] = 1,
    write_trace: _WriteTrace = None,
    population: _Population = "uniform",
    agent_share: _AgentShare = 0.7,
    agent_gap: _AgentGap = 3.0,
    chat_gap: _ChatGap = 90.0,
    system_tokens: _SystemTokens = "800,6000",
    tool_tokens: _ToolTokens = 700.0,
    turns: Annotated[float, typer.Option(min=1, help="--synthetic: mean turns per session")] = 6.0,
    prefills: Annotated[int, typer.Option(min=1, help="prefill workers")] = 2,
    decodes: Annotated[int, typer.Option(min=1, help="decode workers")] = 4,
    block_size: Annotated[int, typer.Option(min=1, help="vLLM block size (tokens)")] = 16,
    retention_blocks: _RetentionBlocks = 50_000,
    host_retention_blocks: _HostRetentionBlocks = 0,
    host_eviction: _HostEviction = "lru",
    host_pool_per_copy: _HostPoolPerCopy = False,
    lease: _Lease = 480.0,
    expiry_margin: _ExpiryMargin = 6.0,
    prefill_cache_blocks: _PrefillCacheBlocks = 20_000,
    routing: _Routing = "kvloop",
    min_pull_tokens: Annotated[int, typer.Option(min=0, help="kvloop_min_pull_tokens")] = 64,
    kv_bytes_per_token: _KvBytesPerToken = 131_072,
    decode_ms_per_token: _DecodeMsPerToken = 20.0,
    lookup_timeout_ms: _LookupTimeoutMs = 10_000.0,
    decode_failures: _DecodeFailures = 0,
    failure_downtime: Annotated[float, typer.Option(min=0, help="s a crashed decode stays down")] = 60.0,
    speedup: _Speedup = 0.0,
    max_wall_s: _MaxWallS = 3600.0,
    prefill_tokens_per_s: Annotated[float, typer.Option(help="cost model: prefill throughput")] = 8000.0,
    link_gbps: _LinkGbps = 100.0,
    setup_ms: Annotated[float, typer.Option(help="cost model: fixed cost of one pull, ms")] = 2.0,
    host_read_gbps: _HostReadGbps = 64.0,
    multiturn_results: _MultiturnResults = None,
    sweep: _Sweep = None,
    plot: _Plot = Path("replay-sweep.png"),
    buckets: Annotated[int, typer.Option(min=1, help="windows of the over-time report")] = 10,
    store: _Store = "memory",
    replicas: _Replicas = 1,
    no_route: _NoRoute = False,
    daemon_arg: _DaemonArg = None,
    output: _Output = None,
    json_output: JsonFlag = False,
) -> None:
    """What reverse transfer would save on a request log: replays it through a real kvloopd with a
    simulated prefill/decode fleet; token shares, missed pulls, estimated continuation TTFT."""
    # First, while the only locals are the parameters: each is a field of ReplayOptions.
    options = ReplayOptions(**locals())
    result = _replay_with_progress(replay_inputs(options), options.plot)
    _report(result, options.output)


def _replay_with_progress(inputs: ReplayInputs, plot: Path) -> dict[str, Any]:
    """One replay, or one per point of the sweep grid, with a progress bar per replay on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvloop.clients.bench.replay import runner as rp
    from kvloop.common.processes import supervisor

    requests, config, info, grid = inputs.requests, inputs.config, inputs.info, inputs.grid
    with (
        supervisor().stop_on_signals(),
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
            disable=state.json,
            console=err_console,
        ) as bar,
    ):
        try:
            if grid:
                tasks: dict[str, TaskID] = {}

                def sweep_progress(label: str, done: int) -> None:
                    if label not in tasks:
                        tasks[label] = bar.add_task(f"replay {label}", total=len(requests))
                    bar.update(tasks[label], completed=done)

                result = rp.sweep(requests, config, info, grid, plot, sweep_progress)
            else:
                task = bar.add_task("replay", total=len(requests))
                result = rp.replay(requests, config, info, lambda done: bar.update(task, completed=done))
        except rp.ReplayError as exc:
            _fail(str(exc))
    return result


def _report(result: dict[str, Any], output: Path | None) -> None:
    from kvloop.clients.bench.replay.report import print_report

    if output:
        output.write_text(json.dumps(result, indent=2, sort_keys=True))
    if state.json:
        _emit_json(result)
    else:
        print_report(console, result)
