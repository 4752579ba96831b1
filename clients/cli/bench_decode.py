"""`kvloop bench decode-tpot`, `idle`: what a decode pays for kvloop (time per output token, CPU at rest
while it holds retained runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvloop.clients.cli.output import JsonFlag, _blank, _emit_json, console, err_console, state


def bench_decode_tpot(
    rounds: Annotated[int, typer.Option(min=1, help="rounds (each runs every condition once)")] = 12,
    stacks: Annotated[
        int,
        typer.Option(
            min=1, help="fresh stacks in turn, each running every round: effects get an error bar over stacks"
        ),
    ] = 1,
    sessions: Annotated[int, typer.Option(min=1, help="requests decoded together per condition")] = 4,
    prompt_tokens: Annotated[int, typer.Option(min=64, help="tokens per prompt")] = 1536,
    answer_tokens: Annotated[int, typer.Option(min=2, help="tokens each request decodes")] = 16,
    stagger_ms: Annotated[
        float, typer.Option(min=0, help="gap between arrivals in the staggered conditions")
    ] = 100.0,
    condition: Annotated[
        list[str] | None, typer.Option(help="conditions to run (repeatable) [default: all]")
    ] = None,
    pin_engines: Annotated[
        bool, typer.Option(help="prefill and decode compute on cores of their own")
    ] = False,
    workdir: Annotated[Path, typer.Option(help="model, logs")] = Path(".kvloop-bench/decode-tpot"),
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output", "-o", help="write the results JSON here [default: WORKDIR/decode-tpot.json]"
        ),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Where a kvloop decode's time per output token goes: the same decode with and without retention,
    incoming READs and staggered arrivals, interleaved and paired, its steps timed by what they held."""
    from kvloop.clients.bench.decode_tpot import CONDITIONS, DecodeTpotConfig, run_decode_tpot
    from kvloop.common.processes import supervisor

    unknown = sorted(set(condition or ()) - set(CONDITIONS))
    if unknown:
        raise typer.BadParameter(
            f"{', '.join(unknown)}: choose from {', '.join(CONDITIONS)}", param_hint="--condition"
        )
    config = DecodeTpotConfig(
        workdir=workdir.resolve(),
        rounds=rounds,
        stacks=stacks,
        sessions=sessions,
        prompt_tokens=prompt_tokens,
        answer_tokens=answer_tokens,
        stagger_ms=stagger_ms,
        conditions=tuple(c for c in CONDITIONS if c in (condition or CONDITIONS)),
        pin_engines=pin_engines,
    )
    with supervisor().stop_on_signals():
        result = run_decode_tpot(config, progress=lambda line: err_console.print(line, highlight=False))
    out = output or (config.workdir / "decode-tpot.json")
    out.write_text(json.dumps(result, indent=2))
    if state.json:
        _emit_json(result)
        return
    _print_decode_tpot(result)
    console.print(f"results: {out}")


def _print_decode_tpot(result: dict) -> None:
    _print_conditions(result["summary"]["conditions"])
    _print_paired_effects(result["summary"]["effects"])
    if len(result["stacks"]) > 1:
        _print_effects_over_stacks(result["across_stacks"])


def _print_conditions(conditions: list[dict]) -> None:
    table = Table(title="kvloop bench decode-tpot: the same decode under each condition")
    for column in (
        "condition",
        "requests",
        "TPOT ms p50 / mean",
        "vLLM TPOT ms mean",
        "batch (vLLM)",
        "batch (client)",
        "arrival steps",
        "steps beside a prefill",
        "retained runs",
        "continuation prefills",
    ):
        table.add_column(column)
    for c in conditions:
        table.add_row(
            c["condition"],
            str(c["requests"]),
            f"{_blank(c['tpot_ms_p50'])} / {_blank(c['tpot_ms_mean'])}",
            _blank(c["vllm_tpot_ms_mean"]),
            _blank(c["vllm_batch_mean"]),
            _blank(c["client_batch_mean"]),
            _blank(c["arrival_step_share"]),
            _blank(c["read_step_share"]),
            str(c["retained_runs"]),
            str(c["reads"]),
        )
    console.print(table)


def _print_paired_effects(effects: list[dict]) -> None:
    table = Table(
        title="paired effects: TPOT ratio per request (same round and slot), and step time at equal batch"
    )
    for column in ("factor", "ratio", "pairs", "median", "95% CI", "step ratio by batch (no arrival)"):
        table.add_column(column)
    for e in effects:
        t = e["tpot"] or {}
        table.add_row(
            e["factor"],
            e["ratio"],
            str(t.get("pairs", 0)),
            _blank(t.get("median")),
            "-".join(str(x) for x in t.get("median_ci95", ())),
            ", ".join(f"{b['batch']}: {b['ratio']}" for b in e["step_at_equal_batch"]),
        )
    console.print(table)


def _print_effects_over_stacks(across_stacks: list[dict]) -> None:
    table = Table(title="each effect over stacks: each stack's paired median, their mean, its 95% CI")
    for column in ("factor", "stack medians", "mean", "95% CI"):
        table.add_column(column)
    for row in across_stacks:
        table.add_row(
            row["factor"],
            ", ".join(str(m) for m in row["stack_medians"]),
            _blank(row.get("mean")),
            "-".join(str(x) for x in row.get("mean_ci95", ())),
        )
    console.print(table)


def bench_idle(
    runs: Annotated[
        list[int] | None, typer.Option("--runs", help="retained runs held on the decode (repeatable)")
    ] = None,
    window: Annotated[float, typer.Option(min=1, help="seconds at rest measured per N")] = 20.0,
    tpot_tokens: Annotated[int, typer.Option(min=2, help="tokens per TPOT request")] = 64,
    tpot_repeats: Annotated[int, typer.Option(min=1, help="TPOT requests per measurement")] = 7,
    mode: Annotated[str, typer.Option(help="kvloop, builtin or recompute (see `kvloop engine`)")] = "kvloop",
    workdir: Annotated[Path, typer.Option(help="engines' logs and results")] = Path(".kvloop-bench-idle"),
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", help="write the results JSON here [default: WORKDIR/idle.json]"),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """CPU of a served prefill + decode pair at rest while the decode holds N retained runs, per
    process, and the decode's time per output token with 0 and with the most retained runs."""
    from kvloop.clients.bench.idle import IdleConfig, run_idle_bench

    if mode not in ("kvloop", "builtin", "recompute"):
        raise typer.BadParameter(f"{mode!r}: choose kvloop, builtin or recompute", param_hint="--mode")
    config = IdleConfig(
        workdir=workdir.resolve(),
        runs=tuple(runs or (0, 10, 100)),
        window_s=window,
        tpot_tokens=tpot_tokens,
        tpot_repeats=tpot_repeats,
        mode=mode,
    )
    result = run_idle_bench(config, progress=lambda line: err_console.print(f"[dim]{line}[/dim]"))
    out = output or (config.workdir / "idle.json")
    out.write_text(json.dumps(result, indent=2))
    if state.json:
        _emit_json(result)
        return
    groups = list(result["windows"][0]["cpu_percent"]) if result["windows"] else []
    table = Table(title=f"kvloop bench idle ({mode}): % of one core at rest, {window:.0f} s per row")
    table.add_column("retained runs", justify="right")
    for g in groups:
        table.add_column(g, justify="right")
    for column in ("decode", "prefill", "all"):
        table.add_column(column, justify="right")
    for w in result["windows"]:
        table.add_row(
            str(w["runs"]),
            *(f"{w['cpu_percent'].get(g, 0.0):.1f}" for g in groups),
            *(f"{w[c]:.1f}" for c in ("decode", "prefill", "all")),
        )
    console.print(table)
    for n, t in result["tpot_ms"].items():
        samples = ", ".join(f"{s:.2f}" for s in t["samples"])
        console.print(f"decode TPOT with {n} retained runs: median {t['median']:.2f} ms ({samples})")
    if result["pull_from_resting_decode"]:
        p = result["pull_from_resting_decode"]
        console.print(
            f"next turn of a run the resting decode holds: {p['path']} ({p['reason']}), "
            f"{p['pulled_tokens']} of {p['prompt_tokens']} tokens pulled, prefill {p['prefill_ms']:.0f} ms"
        )
    console.print(f"results: {out}")
