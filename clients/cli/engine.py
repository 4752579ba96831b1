"""`kvloop engine`: one host's `vllm serve` with the kvloop connector and its sidecar
(kvloop.agents.engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvloop.clients.cli.output import JsonFlag, _fail, err_console, state

if TYPE_CHECKING:
    from kvloop.agents.engine import Engine
    from kvloop.common.processes import ChildProcesses
    from kvloop.common.vllm_compat import InstalledVllm

_Platform = Annotated[
    str,
    typer.Option(
        help="auto (cuda when the official vLLM wheel sees a GPU, else cpu: the CPU build's settings), "
        "cpu or cuda"
    ),
]
_RetentionTtl = Annotated[float, typer.Option(help="seconds a decode retains finished turns' blocks")]
_RetentionMaxShare = Annotated[
    float,
    typer.Option(min=0.01, max=1.0, help="share of a decode's KV cache its retained runs may pin"),
]
_RetentionYield = Annotated[
    bool,
    typer.Option(
        help="past 0.9 of that share, give up the oldest retained runs for newer ones (each freed once "
        "kvloopd confirms it dropped the run and its read window has passed)"
    ),
]
_RetentionYieldAfter = Annotated[
    float, typer.Option(min=0, help="seconds a run is retained before it may be given up")
]
_HostRetentionGib = Annotated[
    float,
    typer.Option(
        min=0,
        help="decode: GiB of host memory retained runs are copied into, pullable after their blocks "
        "leave the KV cache (0: none)",
    ),
]
_HostNixlPort = Annotated[
    int, typer.Option(help="the host pool's NIXL side-channel port (0: --nixl-port + 1000)")
]
_HostEviction = Annotated[
    str,
    typer.Option(
        help="decode: which host copies go first when the pool needs room: lru (the oldest) or "
        "predicted_return (the fewest pulls expected per second held, from each conversation's gaps)"
    ),
]


def engine(
    ctx: typer.Context,
    role: Annotated[str, typer.Option(help="prefill or decode")],
    model: Annotated[str, typer.Option(help="model directory or name for vllm serve")],
    worker_id: Annotated[str, typer.Option(help="this worker's stable name in the directory")],
    port: Annotated[int, typer.Option(help="OpenAI HTTP port")] = 8000,
    served_model_name: Annotated[str, typer.Option(help="model name clients use")] = "",
    host: Annotated[str, typer.Option(help="address peers reach this host on (HTTP and NIXL)")] = "127.0.0.1",
    nixl_port: Annotated[int, typer.Option(help="NIXL side-channel port")] = 5600,
    kv_events_port: Annotated[int, typer.Option(help="ZMQ KV-event port (replay on +1)")] = 5557,
    block_size: Annotated[int, typer.Option(help="KV block size (a multiple of 32 on CPU)")] = 32,
    kv_cache_gib: Annotated[int, typer.Option(help="CPU KV cache size (CPU build only)")] = 2,
    tensor_parallel_size: Annotated[int, typer.Option(min=1, help="vLLM --tensor-parallel-size")] = 1,
    platform: _Platform = "auto",
    retention_ttl: _RetentionTtl = 480.0,
    retention_max_share: _RetentionMaxShare = 0.5,
    retention_yield: _RetentionYield = True,
    retention_yield_after: _RetentionYieldAfter = 60.0,
    prefix_caching: Annotated[bool, typer.Option(help="vLLM prefix caching")] = True,
    host_retention_gib: _HostRetentionGib = 0.0,
    host_nixl_port: _HostNixlPort = 0,
    host_eviction: _HostEviction = "lru",
    json_output: JsonFlag = False,
) -> None:
    """Run `vllm serve` with the kvloop connector and KV events, plus its kvloop-agent sidecar; both
    stop with this command (SIGTERM, SIGINT, SIGHUP, or its death). kvloopd is --daemon /
    KVLOOP_DAEMON. --json prints one JSON object when the engine is ready. Arguments after `--` go
    to `vllm serve` as they are (e.g. `-- --gpu-memory-utilization 0.4`)."""
    from kvloop.agents.engine import Engine, EngineConfig
    from kvloop.common.processes import supervisor
    from kvloop.common.vllm_compat import detect_platform

    vllm = _checked_vllm(role, platform, host_eviction)
    chosen = detect_platform(vllm) if platform == "auto" else platform
    config = EngineConfig(
        role=role,
        model=model,
        served_model_name=served_model_name or model,
        worker_id=worker_id,
        port=port,
        nixl_port=nixl_port,
        kv_events_port=kv_events_port,
        daemon=state.daemon,
        host=host,
        block_size=block_size,
        kv_cache_gib=kv_cache_gib,
        retention_ttl_s=retention_ttl,
        retention_max_share=retention_max_share,
        retention_yield=retention_yield,
        retention_yield_after_s=retention_yield_after,
        prefix_caching=prefix_caching,
        host_retention_gib=host_retention_gib,
        host_nixl_port=host_nixl_port or nixl_port + 1000,
        host_eviction=host_eviction,
        tensor_parallel_size=tensor_parallel_size,
        platform=chosen,
        extra_vllm_args=list(ctx.args),
    )
    if Path(model).is_dir():
        from kvloop.clients.fleet.model import kv_bytes_per_block, kv_group_windows

        config.kv_bytes_per_block = kv_bytes_per_block(Path(model), block_size)
        config.kv_group_windows = kv_group_windows(Path(model))
    children = supervisor()
    _serve_until_stopped(Engine(config, Path(".kvloop-engine-logs") / worker_id, children), children)


def _checked_vllm(role: str, platform: str, host_eviction: str) -> InstalledVllm:
    """The installed vLLM, once the options and the vLLM version are known to be usable."""
    from kvloop.agents.connector.host.eviction import POLICIES
    from kvloop.common.vllm_compat import installed_vllm, unsupported_message

    if role not in ("prefill", "decode"):
        _fail("--role must be prefill or decode", code=2)
    if platform not in ("auto", "cpu", "cuda"):
        _fail("--platform must be auto, cpu or cuda", code=2)
    if host_eviction not in POLICIES:
        _fail(f"--host-eviction {host_eviction!r}: choose from {', '.join(POLICIES)}", code=2)
    vllm = installed_vllm()
    if vllm is None:
        _fail("vLLM is not installed: see `kvloop doctor`")
    elif not vllm.supported:
        _fail(unsupported_message(vllm.version))
    return vllm


def _serve_until_stopped(worker: Engine, children: ChildProcesses) -> None:
    import time

    from kvloop.agents.engine import EngineStartError
    from kvloop.common.processes import Terminated

    config = worker.config
    with children.stop_on_signals():
        try:
            worker.launch()
            err_console.print(
                f"starting vllm serve ({config.role}, {config.platform}) and kvloop-agent; "
                f"logs in {worker.log_dir}"
            )
            while not worker.ready():
                time.sleep(0.5)  # polling /health while vLLM loads
            err_console.print(
                f"{config.worker_id} ready at {config.url} (NIXL {config.host}:{config.nixl_port}) in "
                f"{worker.started_s:.0f}s"
            )
            if state.json:  # one line, for scripts that wait for it
                sys.stdout.write(json.dumps(_ready_line(worker)) + "\n")
                sys.stdout.flush()
            while True:
                worker.ready()  # raises when vLLM or the sidecar died
                time.sleep(1)  # until a signal
        except EngineStartError as exc:
            _fail(str(exc))
        except Terminated as exc:
            err_console.print(f"{exc}: stopping {config.worker_id}")
            raise


def _ready_line(worker: Engine) -> dict:
    config = worker.config
    return {
        "worker_id": config.worker_id,
        "role": config.role,
        "url": config.url,
        "nixl": f"{config.host}:{config.nixl_port}",
        "started_s": round(worker.started_s or 0, 1),
        "pids": {
            "vllm": worker.vllm.pid if worker.vllm else None,
            "agent": worker.agent.pid if worker.agent else None,
        },
    }
