"""`kvloop demo`: the whole loop on one machine (kvloop.clients.demo)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from kvloop.clients.cli.output import JsonFlag, _fail, state


class DemoModel(StrEnum):
    llama = "llama"
    hybrid = "hybrid"


def default_host_gib(model: DemoModel) -> float:
    """A hybrid model's chat continuation pulls the previous prompt only from a host pool: by the time
    the answer is done the decode has freed the sliding-window blocks before the answer's last window."""
    return 0.25 if model == DemoModel.hybrid else 0.0


def demo(
    turns: Annotated[int, typer.Option(min=2, help="conversation turns")] = 6,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens generated per turn")] = 16,
    workdir: Annotated[Path, typer.Option(help="model, logs and spans go here")] = Path(".kvloop-demo"),
    hidden_size: Annotated[int, typer.Option(help="random-weight model hidden size")] = 384,
    layers: Annotated[int, typer.Option(help="random-weight model layers")] = 4,
    model: Annotated[
        DemoModel,
        typer.Option(help="llama, or hybrid: a Gemma-3-like model, sliding-window + full attention layers"),
    ] = DemoModel.llama,
    decode_tp: Annotated[
        int, typer.Option(min=1, help="tensor-parallel size of the decode (a worker process per rank)")
    ] = 1,
    host_retention_gib: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="GiB of host memory per decode that retained runs are copied into, so they stay pullable "
            "after they leave the KV cache (default: 0.25 with --model hybrid, whose decode frees a prompt's "
            "sliding-window blocks while it answers; else 0, none)",
        ),
    ] = None,
    host_demote_after_s: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="give a retained run's KV-cache blocks up this long after its host copy exists (0: the "
            "next turn reads the pool; default: only when retention needs the room)",
        ),
    ] = None,
    keep_running: Annotated[
        bool,
        typer.Option(help="keep everything up after the conversation (Ctrl-C, SIGTERM or SIGHUP stops)"),
    ] = False,
    ha: Annotated[
        bool,
        typer.Option(
            "--ha",
            help="two kvloopd replicas on Redis (primary, replica, three Sentinels, on loopback); kill the "
            "replica the decode's sidecar streams to, later the Redis primary, and show what recovered when",
        ),
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Start kvloopd, a prefill and a decode vLLM with the kvloop connector, sidecars and the proxy; run an
    agent conversation through it; print each turn's path and TTFT, and from the second turn on the TTFT
    of the same prompt recomputed (--json: one JSON line per turn); stop everything (also on SIGTERM,
    SIGINT, SIGHUP, or if this command dies)."""
    from kvloop.agents.engine import EngineStartError
    from kvloop.clients.demo.run import run_demo
    from kvloop.common.processes import supervisor

    with supervisor().stop_on_signals():
        try:
            code = run_demo(
                workdir.resolve(),
                turns,
                max_tokens,
                state.json,
                hidden_size,
                layers,
                keep_running,
                model.value,
                decode_tp,
                ha,
                default_host_gib(model) if host_retention_gib is None else host_retention_gib,
                host_demote_after_s,
            )
        except EngineStartError as exc:
            _fail(str(exc))
    raise typer.Exit(code)
