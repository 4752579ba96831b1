"""`kvloop bench replay`: a request log replayed through a real kvloopd with a simulated fleet."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvloop.clients.cli.output import JsonFlag, _emit_json, _fail, console, err_console, state


def bench_replay(
    trace: Annotated[
        Optional[Path],
        typer.Option(help="request log: Mooncake trace JSONL or OpenAI-style chat requests JSONL"),
    ] = None,
    synthetic: Annotated[
        Optional[int], typer.Option(min=1, help="replay a seeded synthetic trace of N requests instead")
    ] = None,
    trace_format: Annotated[str, typer.Option("--format", help="auto, mooncake or chat")] = "auto",
    tokenizer: Annotated[
        Optional[str],
        typer.Option(help="chat logs: local tokenizer (directory) whose chat template renders them"),
    ] = None,
    trace_block_size: Annotated[int, typer.Option(min=1, help="Mooncake trace: tokens per hash_id")] = 512,
    limit: Annotated[Optional[int], typer.Option(min=1, help="replay only the first N requests")] = None,
    seed: Annotated[int, typer.Option(help="synthetic trace and random routing seed")] = 1,
    write_trace: Annotated[
        Optional[Path], typer.Option(help="--synthetic: also write the generated trace here (JSONL)")
    ] = None,
    population: Annotated[
        str,
        typer.Option(
            help="--synthetic: uniform (every session's gaps alike) or mixed (agent sessions back within "
            "seconds, chat sessions after minutes)"
        ),
    ] = "uniform",
    agent_share: Annotated[
        float, typer.Option(min=0, max=1, help="--population mixed: share of agent sessions")
    ] = 0.7,
    agent_gap: Annotated[
        float, typer.Option(min=0, help="--population mixed: median gap between an agent's turns, s")
    ] = 3.0,
    chat_gap: Annotated[
        float, typer.Option(min=0, help="--population mixed: median gap between a chat's turns, s")
    ] = 90.0,
    system_tokens: Annotated[
        str,
        typer.Option(
            help="--synthetic: tokens of each shared system prompt, MIN,MAX (drawn uniformly; "
            "6000,12000 with --tool-tokens 1000: long prompts, ~13K tokens on average)"
        ),
    ] = "800,6000",
    tool_tokens: Annotated[
        float, typer.Option(min=1, help="--synthetic: median tokens a tool's output appends per turn")
    ] = 700.0,
    turns: Annotated[float, typer.Option(min=1, help="--synthetic: mean turns per session")] = 6.0,
    prefills: Annotated[int, typer.Option(min=1, help="prefill workers")] = 2,
    decodes: Annotated[int, typer.Option(min=1, help="decode workers")] = 4,
    block_size: Annotated[int, typer.Option(min=1, help="vLLM block size (tokens)")] = 16,
    retention_blocks: Annotated[
        int, typer.Option(min=0, help="decode KV memory set aside for retained turns, blocks per decode")
    ] = 50_000,
    host_retention_blocks: Annotated[
        int,
        typer.Option(
            min=0,
            help="decode host memory that takes the turns the KV memory evicts, blocks per decode (0: none)",
        ),
    ] = 0,
    host_eviction: Annotated[
        str,
        typer.Option(
            help="which runs the host memory evicts first (kvloop_host_eviction): lru or predicted_return"
        ),
    ] = "lru",
    host_pool_per_copy: Annotated[
        bool,
        typer.Option(
            help="host memory holds each run's blocks apart (a pool that copies every run whole), "
            "not each block once as the connector's does: for comparison"
        ),
    ] = False,
    lease: Annotated[
        float, typer.Option(min=0, help="retention lease, s (vLLM decoder_kv_blocks_ttl)")
    ] = 480.0,
    expiry_margin: Annotated[
        float, typer.Option(min=0, help="puller's lease margin, s (kvloop_expiry_margin_s)")
    ] = 6.0,
    prefill_cache_blocks: Annotated[
        int, typer.Option(min=0, help="prefill prefix-cache capacity, blocks per prefill (0: off)")
    ] = 20_000,
    routing: Annotated[
        str, typer.Option(help="kvloop (decode = holder, else least loaded), round_robin or random")
    ] = "kvloop",
    min_pull_tokens: Annotated[int, typer.Option(min=0, help="kvloop_min_pull_tokens")] = 64,
    kv_bytes_per_token: Annotated[
        int, typer.Option(min=1, help="KV bytes per token of the model (all layers, K and V)")
    ] = 131_072,
    decode_ms_per_token: Annotated[
        float, typer.Option(min=0, help="decode time per output token, ms")
    ] = 20.0,
    lookup_timeout_ms: Annotated[
        float,
        typer.Option(
            min=1, help="deadline of each Lookup (the connector's: 20; a miss is directory_unavailable)"
        ),
    ] = 10_000.0,
    decode_failures: Annotated[
        int, typer.Option(min=0, help="decode crashes spread over the trace (runs lost, new epoch)")
    ] = 0,
    failure_downtime: Annotated[float, typer.Option(min=0, help="s a crashed decode stays down")] = 60.0,
    speedup: Annotated[
        float, typer.Option(min=0, help="trace time x this = wall time; 0: as fast as possible")
    ] = 0.0,
    max_wall_s: Annotated[
        float, typer.Option(min=0, help="stop replaying after this many s (the report says truncated)")
    ] = 3600.0,
    prefill_tokens_per_s: Annotated[float, typer.Option(help="cost model: prefill throughput")] = 8000.0,
    link_gbps: Annotated[
        float, typer.Option(help="cost model: link Gbit/s between decode and prefill")
    ] = 100.0,
    setup_ms: Annotated[float, typer.Option(help="cost model: fixed cost of one pull, ms")] = 2.0,
    host_read_gbps: Annotated[
        float,
        typer.Option(
            help="cost model: Gbit/s of a pull from a decode's host memory (PCIe-class; never above the link)"
        ),
    ] = 64.0,
    multiturn_results: Annotated[
        Optional[Path],
        typer.Option(help="cost model fitted to a `kvloop bench multiturn --json` output instead"),
    ] = None,
    sweep: Annotated[
        Optional[list[str]],
        typer.Option(
            help="repeat over settings, e.g. lease=60,240,480,memory=10000,50000 (keys: lease, "
            "memory, host_memory, prefill_cache, decodes, prefills)"
        ),
    ] = None,
    plot: Annotated[Path, typer.Option(help="--sweep: PNG of the saving against the settings")] = Path(
        "replay-sweep.png"
    ),
    buckets: Annotated[int, typer.Option(min=1, help="windows of the over-time report")] = 10,
    store: Annotated[
        str,
        typer.Option(
            help="kvloopd's store: memory, redis (a redis-server of its own), redis-cluster (a 3-primary "
            "Redis Cluster of its own) or a redis:// URL"
        ),
    ] = "memory",
    replicas: Annotated[
        int, typer.Option(min=1, help="kvloopd processes sharing the store; the workers spread over them")
    ] = 1,
    no_route: Annotated[
        bool, typer.Option("--no-route", help="skip the Route call per request (the proxy's)")
    ] = False,
    daemon_arg: Annotated[
        Optional[list[str]], typer.Option(help="extra kvloopd flag (repeatable), e.g. a store option")
    ] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="also write the report JSON here")
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """What reverse transfer would save on a request log: replays it through a real kvloopd with a
    simulated prefill/decode fleet; token shares, missed pulls, estimated continuation TTFT."""
    from kvloop.agents.connector.host.eviction import POLICIES
    from kvloop.clients.bench import replay as rp
    from kvloop.clients.bench.replay_fleet import ROUTINGS, FleetConfig
    from kvloop.clients.bench.replay_gen import POPULATIONS, SyntheticConfig, describe, generate
    from kvloop.clients.bench.replay_report import CostModel, CostModelError, print_report
    from kvloop.clients.bench.replay_trace import TraceError, read_trace, write_jsonl
    from kvloop.common.processes import supervisor

    if (trace is None) == (synthetic is None):
        _fail("give exactly one of --trace FILE and --synthetic N", code=2)
    if routing not in ROUTINGS:
        _fail(f"--routing {routing!r}: choose from {', '.join(ROUTINGS)}", code=2)
    if host_eviction not in POLICIES:
        _fail(f"--host-eviction {host_eviction!r}: choose from {', '.join(POLICIES)}", code=2)
    if population not in POPULATIONS:
        _fail(f"--population {population!r}: choose from {', '.join(POPULATIONS)}", code=2)
    if trace_format not in ("auto", "mooncake", "chat"):
        _fail(f"--format {trace_format!r}: auto, mooncake or chat", code=2)
    try:
        low, _, high = system_tokens.partition(",")
        system_range = (int(low), int(high or low))
        if not 1 <= system_range[0] <= system_range[1]:
            raise ValueError
    except ValueError:
        _fail(f"--system-tokens {system_tokens!r}: MIN,MAX with 1 <= MIN <= MAX", code=2)
    try:
        grid = rp.parse_sweep(sweep or [])
        cost = (
            CostModel.from_multiturn(multiturn_results).with_host_read(host_read_gbps, kv_bytes_per_token)
            if multiturn_results
            else CostModel.from_figures(
                prefill_tokens_per_s, link_gbps, setup_ms, kv_bytes_per_token, host_read_gbps
            )
        )
    except (ValueError, CostModelError) as exc:
        _fail(str(exc), code=2)
    info: dict = {}
    try:
        if synthetic is not None:
            gen = SyntheticConfig(
                requests=synthetic,
                seed=seed,
                population=population,
                agent_share=agent_share,
                agent_gap_s_median=agent_gap,
                chat_gap_s_median=chat_gap,
                system_tokens=system_range,
                tool_tokens_median=tool_tokens,
                mean_turns=turns,
            )
            path = write_trace
            if path is None:
                fd, name = tempfile.mkstemp(prefix="kvloop-replay-", suffix=".jsonl")
                os.close(fd)
                path = Path(name)
            write_jsonl(path, generate(gen))
            info = {
                "source": "synthetic",
                "generator": describe(gen),
                "written_to": str(write_trace) if write_trace else None,
            }
            requests = read_trace(path, block_size, "mooncake", None, gen.block_size, limit)
            if write_trace is None:
                path.unlink()
        else:
            assert trace is not None
            requests = read_trace(trace, block_size, trace_format, tokenizer, trace_block_size, limit)
            info = {"source": str(trace)}
    except TraceError as exc:
        _fail(str(exc), code=2)
    info["requests"] = len(requests)
    info["sessions"] = len({r.session for r in requests if r.session is not None})
    fleet = FleetConfig(
        prefills=prefills,
        decodes=decodes,
        block_size=block_size,
        retention_blocks=retention_blocks,
        host_retention_blocks=host_retention_blocks,
        host_eviction=host_eviction,
        host_pool_shared=not host_pool_per_copy,
        lease_s=lease,
        expiry_margin_s=expiry_margin,
        prefill_cache_blocks=prefill_cache_blocks,
        routing=routing,
        min_pull_tokens=min_pull_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        decode_ms_per_token=decode_ms_per_token,
        speedup=speedup,
        max_wall_s=max_wall_s,
        lookup_timeout_ms=lookup_timeout_ms,
        decode_failures=decode_failures,
        failure_downtime_s=failure_downtime,
        seed=seed,
        route=not no_route,
    )
    if store not in ("memory", "redis", "redis-cluster") and not store.startswith(
        ("redis://", "rediss://", "unix://")
    ):
        _fail(f"--store must be memory, redis, redis-cluster or a redis:// URL, got {store!r}", code=2)
    if replicas > 1 and store == "memory":
        _fail("--replicas needs a shared store: --store redis or redis-cluster", code=2)
    config = rp.ReplayConfig(
        fleet=fleet,
        cost=cost,
        buckets=buckets,
        daemon_args=tuple(daemon_arg or ()),
        store=store,
        replicas=replicas,
    )
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
                tasks: dict[str, object] = {}

                def sweep_progress(label: str, done: int) -> None:
                    if label not in tasks:
                        tasks[label] = bar.add_task(f"replay {label}", total=len(requests))
                    bar.update(tasks[label], completed=done)  # type: ignore[arg-type]

                result = rp.sweep(requests, config, info, grid, plot, sweep_progress)
            else:
                task = bar.add_task("replay", total=len(requests))
                result = rp.replay(requests, config, info, lambda done: bar.update(task, completed=done))
        except rp.ReplayError as exc:
            _fail(str(exc))
    if output:
        output.write_text(json.dumps(result, indent=2, sort_keys=True))
    if state.json:
        _emit_json(result)
    else:
        print_report(console, result)
