"""`kvloop bench slow-reads`, `chaos`, `proxy-load`: a served stack under faults (stalled decodes,
killed processes, clients that hang up)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvloop.clients.cli.output import JsonFlag, _emit_json, _fail, console, err_console, state


def bench_slow_reads(
    turns: Annotated[int, typer.Option(min=6, help="turns of the conversation")] = 14,
    stop_s: Annotated[
        float, typer.Option(help="seconds the decode is stopped during each stalled turn")
    ] = 1.0,
    stall: Annotated[
        Optional[list[int]],
        typer.Option(help="turns during which the decode stalls (repeatable) [default: 2 3 4]"),
    ] = None,
    workdir: Annotated[Path, typer.Option(help="model, logs")] = Path(".kvloop-bench/slow-reads"),
    json_output: JsonFlag = False,
) -> None:
    """Can a few slow READs switch transfers off? The cost model's regression run on real engines."""
    from kvloop.clients.bench.slow_reads import SlowReadsConfig, run_slow_reads

    config = SlowReadsConfig(
        workdir=workdir, turns=turns, stop_s=stop_s, stalled_turns=tuple(stall or (2, 3, 4))
    )
    result = run_slow_reads(config, progress=lambda line: err_console.print(line, highlight=False))
    if state.json:
        _emit_json(result)
        return
    table = Table(title=f"slowed reads: decode stopped {stop_s:.1f}s in turns {list(config.stalled_turns)}")
    for column in ("turn", "stalled", "path", "reason", "TTFT ms", "estimate"):
        table.add_column(column)
    for t in result["turns"]:
        table.add_row(
            str(t["turn"]),
            "yes" if t["stalled"] else "",
            t["path"],
            t["reason"],
            f"{t['ttft_ms']:.0f}",
            t["detail"],
        )
    console.print(table)
    fooled, resumed = result["recomputed_though_pull_cheaper"], result["transfers_resumed_after_s"]
    samples = result["pair"]["samples_gbytes_per_s"] if result["pair"] else []
    console.print(
        f"continuation turns recomputed although a pull was cheaper: {fooled} (target <= 2); transfers back "
        f"{resumed} s after the last stall (target < 2 s); NIXL-timed READ samples, GB/s: "
        + ", ".join(f"{g:.3f}" for g in samples)
    )


def bench_chaos(
    store: Annotated[str, typer.Option(help="memory, or redis (replicas, Sentinel failover)")] = "memory",
    quick: Annotated[bool, typer.Option(help="every fault kind once (a few minutes)")] = False,
    duration: Annotated[float, typer.Option(min=60, help="seconds of faults without --quick")] = 600.0,
    conversations: Annotated[int, typer.Option(min=1, help="concurrent agent conversations")] = 3,
    interval: Annotated[float, typer.Option(min=5, help="seconds between faults")] = 20.0,
    seed: Annotated[int, typer.Option(help="the fault schedule's and the conversations' seed")] = 0,
    host_retention_gib: Annotated[
        float,
        typer.Option(
            min=0,
            help="decodes' host pools (GiB); adds the pools' faults: their holder killed, pools exhausted, "
            "a prefill killed",
        ),
    ] = 0.0,
    workdir: Annotated[Path, typer.Option(help="model, logs")] = Path(".kvloop-bench/chaos"),
    json_output: JsonFlag = False,
) -> None:
    """Faults (engines, sidecars, kvloopd, Redis killed; decodes stopped; streams reset) while
    conversations flow; every answer checked against a recompute-only reference."""
    from kvloop.clients.bench.chaos import ChaosConfig, run_chaos

    if store not in ("memory", "redis"):
        _fail(f"--store must be memory or redis, not {store!r}")
    config = ChaosConfig(
        workdir=workdir,
        store=store,
        quick=quick,
        duration_s=duration,
        conversations=conversations,
        fault_interval_s=interval,
        seed=seed,
        host_retention_gib=host_retention_gib,
    )
    result = run_chaos(config, progress=lambda line: err_console.print(line, highlight=False))
    if state.json:
        _emit_json(result)
    else:
        table = Table(title=f"chaos on the {store} store: {result['turns']} turns")
        for column in (
            "fault",
            "target",
            "at s",
            "serving again s",
            "transfer again s",
            "from its worker s",
            "turns",
            "failed",
            "wrong",
        ):
            table.add_column(column)
        for f in result["faults"]:
            table.add_row(
                f["fault"],
                f["target"],
                f"{f['at_s']:.1f}",
                "-" if f["restarted_s"] is None else f"{f['restarted_s']:.1f}",
                "-" if f["transfer_again_s"] is None else f"{f['transfer_again_s']:.1f}",
                "-" if f["worker_transfer_again_s"] is None else f"{f['worker_transfer_again_s']:.1f}",
                str(f["turns"]),
                str(f["failed_requests"]),
                str(f["wrong_answers"]),
            )
        console.print(table)
        console.print(
            f"failed requests {result['failed_requests']}, wrong answers {result['wrong_answers']}, "
            f"near-ties {result['near_ties']}; paths {result['paths']}; pulled from {result['pulled_from']}"
        )
        for failure in result["failures"][:10]:
            console.print(
                f"  failed: conversation {failure['conversation']} turn {failure['turn']}: {failure['error']}"
            )
        for turn in result["wrong"][:10]:
            console.print(
                f"  wrong: conversation {turn['conversation']} turn {turn['turn']}: {turn['detail']}"
            )
    if result["failed_requests"] or result["wrong_answers"]:
        raise typer.Exit(1)


def bench_proxy_load(
    clients: Annotated[int, typer.Option(min=1, help="concurrent streaming clients")] = 64,
    duration: Annotated[float, typer.Option(min=1, help="seconds of load")] = 60.0,
    disconnect_fraction: Annotated[
        float, typer.Option(min=0, max=1, help="share of requests whose client hangs up before the end")
    ] = 0.5,
    seed: Annotated[int, typer.Option(help="seeds prompts, lengths and hang-ups")] = 1,
    workdir: Annotated[
        Optional[Path], typer.Option(help="model and logs (default: a temporary folder)")
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Stream chat completions from many clients that hang up at random through `kvloop proxy` in front of
    real `vllm serve` engines it starts; exit 1 if an upstream request is still running after they left."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from kvloop.clients.bench.proxy_load import ProxyLoadConfig, run_proxy_load
    from kvloop.common.processes import supervisor

    config = ProxyLoadConfig(
        clients=clients, duration_s=duration, disconnect_fraction=disconnect_fraction, seed=seed
    )
    with supervisor().stop_on_signals():
        if state.json:
            result = run_proxy_load(config, workdir)
        else:
            with Progress(
                TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console, transient=True
            ) as bar:
                task = bar.add_task("starting kvloopd, vllm serve (prefill, decode), sidecars, proxy")

                def on_progress(p: dict) -> None:
                    if "outcomes" in p:
                        what = "waiting for the engines to drop every request" if p["draining"] else "load"
                        done = ", ".join(f"{k} {v}" for k, v in sorted(p["outcomes"].items()))
                        bar.update(task, description=f"{what}: {p['elapsed']:.0f}/{duration:.0f} s; {done}")

                result = run_proxy_load(config, workdir, on_progress)
    failed = bool(result["upstream_requests_left_running"] or result["proxy_in_flight_left"])
    if state.json:
        _emit_json(result)
    else:
        table = Table(title=f"kvloop bench proxy-load: {clients} streaming clients, {duration:.0f} s")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_column("target", justify="right")
        table.add_row("upstream requests left running", f"{result['upstream_requests_left_running']:g}", "0")
        table.add_row("proxy in-flight left", str(result["proxy_in_flight_left"]), "0")
        table.add_row("engines drained after the clients left", f"{result['upstream_drained_after_s']} s", "")
        table.add_row("requests", f"{result['requests']:,}", "")
        for outcome, count in sorted(result["outcomes"].items()):
            table.add_row(f"  {outcome}", f"{count:,}", "")
        table.add_row("TTFT p50 / p99", f"{result['ttft_p50_ms']} / {result['ttft_p99_ms']} ms", "")
        table.add_row("proxy CPU (% of one core)", str(result["proxy_cpu_percent_of_one_core"]), "")
        last = result["proxy_rss_mib"][-1][1]
        growth = result["proxy_rss_growth_last_half_percent"]
        table.add_row("proxy RSS at the end / growth over the last half", f"{last} MiB / {growth}%", "< 5%")
        console.print(table)
    if failed:
        raise typer.Exit(1)
