"""`kvloop bench gpu`: the host tier's figures on this machine's engines (`make gpu-check` on a GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvloop.clients.cli.output import JsonFlag, _emit_json, console, err_console, state


def bench_gpu(
    prompt_tokens: Annotated[
        Optional[list[int]],
        typer.Option(min=64, help="prompt sizes in tokens (repeatable) [default: 8192 16384 24576]"),
    ] = None,
    hidden_size: Annotated[int, typer.Option(min=64, help="random-weight Llama's hidden size")] = 2048,
    layers: Annotated[int, typer.Option(min=1, help="its layers")] = 16,
    heads: Annotated[int, typer.Option(min=1, help="its attention heads (as many KV heads)")] = 16,
    intermediate_size: Annotated[int, typer.Option(min=64, help="its MLP width")] = 5632,
    host_retention_gib: Annotated[float, typer.Option(min=0.01, help="the decode's host pool (GiB)")] = 8.0,
    kv_cache_gib: Annotated[int, typer.Option(min=1, help="KV cache of CPU engines (GiB)")] = 16,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="write the figures' JSON here too")
    ] = None,
    workdir: Annotated[Path, typer.Option(help="model, logs")] = Path(".kvloop-bench/gpu"),
    json_output: JsonFlag = False,
) -> None:
    """Continuation TTFT against recompute per prompt size, pulling from the decode's KV cache and
    from its host pool, with READ and copy GB/s as NIXL timed them."""
    from kvloop.clients.bench.gpu_check import GpuCheckConfig, run_gpu_check, write

    config = GpuCheckConfig(
        workdir=workdir,
        prompt_tokens=tuple(prompt_tokens or (8192, 16384, 24576)),
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        intermediate_size=intermediate_size,
        host_retention_gib=host_retention_gib,
        kv_cache_gib=kv_cache_gib,
    )
    result = run_gpu_check(config, progress=lambda line: err_console.print(line, highlight=False))
    if output is not None:
        write(result, output)
    if state.json:
        _emit_json(result)
        return
    table = Table(title=f"continuation TTFT on {result['accelerator']} ({result['host']})")
    for column in ("pulled from", "prompt tokens", "path", "TTFT ms", "recompute ms", "x faster"):
        table.add_column(column)
    for tier in result["tiers"]:
        for size in tier["sizes"]:
            recompute = size["recompute_ttft_ms"]
            ratio = size["saving_ratio"]
            table.add_row(
                tier["tier"],
                str(size["prompt_tokens"]),
                f"{size['path']} ({size['pulled_tier'] or '-'})",
                f"{size['ttft_ms']:.0f}",
                "-" if recompute is None else f"{recompute:.0f}",
                "-" if ratio is None else f"{ratio:.2f}",
            )
    console.print(table)
    for tier in result["tiers"]:
        console.print(
            f"{tier['tier']}: READ {tier['read_gbytes_per_s'] or '-'} GB/s (NIXL-timed, median of "
            f"{len(tier['read_samples_gbytes_per_s'])}), "
            f"copy into the pool {tier['copy_gbytes_per_s'] or '-'} GB/s"
        )
