"""`kvloop bench directory`, `fuzz`, `soak`: a kvloopd of the benchmark's own under synthetic load."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table

from kvloop.clients.cli.output import JsonFlag, _emit_json, _fail, console, err_console, state

if TYPE_CHECKING:
    from kvloop.clients.bench.soak import SoakConfig


def bench_directory(
    entries: Annotated[int, typer.Option(help="directory entries to load")] = 1_000_000,
    workers_count: Annotated[int, typer.Option("--workers", help="synthetic decode workers")] = 64,
    prompt_blocks: Annotated[int, typer.Option(help="blocks per lookup prompt")] = 2048,
    lookups: Annotated[int, typer.Option(help="lookups per measurement")] = 2000,
    concurrency: Annotated[int, typer.Option(help="concurrent lookup callers")] = 32,
    batch_hashes: Annotated[int, typer.Option(help="block hashes per ingest event")] = 512,
    daemon_listen: Annotated[
        str, typer.Option(help="where the benchmark's own kvloopd listens")
    ] = "127.0.0.1:0",
    stores: Annotated[
        list[str] | None,
        typer.Option(
            "--store",
            help="store to measure, repeatable: memory (default), redis (a throwaway redis-server "
            "from PATH) or a redis:// URL (its database is flushed)",
        ),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Start a kvloopd process per store and measure ingest, lookup latency/throughput and memory per
    entry."""
    from kvloop.clients.bench.directory import BenchConfig, run_directory_bench
    from kvloop.common.processes import supervisor

    config = BenchConfig(
        entries=entries,
        workers=workers_count,
        prompt_blocks=prompt_blocks,
        lookups=lookups,
        concurrency=concurrency,
        batch_hashes=batch_hashes,
        listen=daemon_listen,
        stores=tuple(stores or ["memory"]),
    )
    with supervisor().stop_on_signals():
        try:
            result = run_directory_bench(config, progress=not state.json)
        except (ValueError, FileNotFoundError) as exc:
            _fail(str(exc))
    if state.json:
        _emit_json(
            {"stores": {n: {k: v for k, v in r.items() if k != "table"} for n, r in result["stores"].items()}}
        )
    else:
        for store, figures in result["stores"].items():
            table = Table(title=f"kvloop bench directory: {store} store", show_header=True)
            table.add_column("figure")
            table.add_column("value", justify="right")
            table.add_column("target", justify="right")
            for name, value, target in figures["table"]:
                table.add_row(name, value, target)
            console.print(table)


def bench_fuzz(
    inputs: Annotated[
        int, typer.Option(min=1, help="inputs (RPC calls or Connect streams) to send")
    ] = 100_000,
    seed: Annotated[int, typer.Option(help="hypothesis seed: the same seed sends the same inputs")] = 0,
    max_seconds: Annotated[
        Optional[float], typer.Option(help="stop early after this long (the figures say how many ran)")
    ] = None,
    daemon_listen: Annotated[
        str, typer.Option(help="where the benchmark's own kvloopd listens")
    ] = "127.0.0.1:0",
    store: Annotated[
        str,
        typer.Option(help="memory, redis (a throwaway redis-server from PATH) or a redis:// URL (flushed)"),
    ] = "memory",
    json_output: JsonFlag = False,
) -> None:
    """Fuzz a kvloopd it starts with well-formed, mutated and random messages on every RPC; exit 1 on a
    crash, an imprecise status (UNKNOWN, INTERNAL...) or a broken invariant."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvloop.clients.bench.fuzz import FuzzConfig, run_fuzz
    from kvloop.common.processes import supervisor

    config = FuzzConfig(inputs=inputs, seed=seed, listen=daemon_listen, max_seconds=max_seconds, store=store)
    with supervisor().stop_on_signals():
        if store not in ("memory", "redis") and not store.startswith(("redis://", "rediss://", "unix://")):
            _fail(f"--store must be memory, redis or a redis:// URL, got {store!r}")
        if state.json:  # stdout keeps the JSON: progress as a line on stderr now and then
            started = time.perf_counter()

            def say(n: int) -> None:
                if n % 5000 == 0:
                    rate = n / (time.perf_counter() - started)
                    err_console.print(f"fuzz: {n:,}/{inputs:,} inputs, {rate:,.0f}/s", highlight=False)

            result = run_fuzz(config, say)
        else:
            with Progress(
                TextColumn("fuzzing kvloopd"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                console=err_console,
                transient=True,
            ) as bar:
                task = bar.add_task("fuzz", total=inputs, rate="")
                started = time.perf_counter()

                def on_input(n: int) -> None:
                    if n % 50 == 0 or n == inputs:
                        elapsed = time.perf_counter() - started
                        bar.update(task, completed=n, rate=f"{n / elapsed:,.0f} inputs/s")

                result = run_fuzz(config, on_input)
    failed = bool(result["crashes"] or result["failure_count"] or result["invariant_violations"])
    if state.json:
        _emit_json(result)
    else:
        table = Table(title=f"kvloop bench fuzz (seed {seed}, {result['store']} store)")
        table.add_column("figure")
        table.add_column("value", justify="right")
        ran = f"{result['inputs']:,}" + (" (stopped at the time limit)" if result["stopped_early"] else "")
        table.add_row("inputs", ran)
        table.add_row("messages (Connect messages count one each)", f"{result['messages']:,}")
        table.add_row("inputs/s", f"{result['inputs_per_s']:,.1f}")
        table.add_row("crashes", str(result["crashes"]))
        table.add_row("imprecise statuses (UNKNOWN, INTERNAL, ...)", str(result["failure_count"]))
        table.add_row("invariant violations", str(len(result["invariant_violations"])))
        for code, count in result["statuses"].items():
            table.add_row(f"  status {code}", f"{count:,}")
        console.print(table)
        for failure in result["failures"][:5]:
            err_console.print(f"[red]{failure['status']}[/red] {failure['details']}\n  {failure['input']}")
        for violation in result["invariant_violations"]:
            err_console.print(f"[red]invariant[/red] {violation}")
    if failed:
        raise typer.Exit(1)


def bench_soak(
    agents: Annotated[int, typer.Option(min=1, help="simulated agents (one Connect stream each)")] = 64,
    callers: Annotated[int, typer.Option(min=0, help="concurrent Lookup callers")] = 32,
    duration: Annotated[float, typer.Option(min=0.1, help="seconds of load")] = 60.0,
    store: Annotated[
        str,
        typer.Option(help="memory, redis (a throwaway redis-server from PATH) or a redis:// URL (flushed)"),
    ] = "memory",
    processes: Annotated[
        int, typer.Option(min=1, help="processes the agents and callers are spread over")
    ] = 2,
    seed: Annotated[int, typer.Option(help="seeds the agents' choices and the block-hash pool")] = 1,
    max_events: Annotated[
        Optional[int],
        typer.Option(min=1, help="stop sending after this many events in all (and the duration)"),
    ] = None,
    daemon_listen: Annotated[
        str, typer.Option(help="where the benchmark's own kvloopd listens")
    ] = "127.0.0.1:0",
    json_output: JsonFlag = False,
) -> None:
    """Stream block events from a fleet of agents (with restarts, gaps and clears) and Lookups into a
    kvloopd it starts, then compare the directory with a reference model; exit 1 on a lost event or a
    phantom entry."""
    from kvloop.clients.bench.soak import SoakConfig, run_soak
    from kvloop.common.processes import supervisor

    config = SoakConfig(
        agents=agents,
        callers=callers,
        duration_s=duration,
        store=store,
        processes=processes,
        seed=seed,
        listen=daemon_listen,
        max_events=max_events,
    )
    with supervisor().stop_on_signals():
        try:
            result = run_soak(config) if state.json else _run_soak_with_progress(config)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            _fail(str(exc))
    failed = bool(result["lost_events"] or result["phantom_entries"] or result["count_mismatches"])
    if state.json:
        _emit_json(result)
    else:
        _print_soak(result, agents, callers)
    if failed:
        raise typer.Exit(1)


def _run_soak_with_progress(config: SoakConfig) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvloop.clients.bench.soak import run_soak

    duration = config.duration_s
    with Progress(
        TextColumn("soak ({task.fields[phase]})"),
        BarColumn(),
        TextColumn("{task.fields[figures]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("soak", total=duration, phase="load", figures="")

        def on_progress(p: dict) -> None:
            bar.update(
                task,
                completed=min(p["elapsed"], duration),
                phase="reading the directory back" if p["settling"] else "load",
                figures=f"{p['events']:,} events, {p['lookups']:,} lookups",
            )

        return run_soak(config, on_progress)


def _print_soak(result: dict, agents: int, callers: int) -> None:
    table = Table(title=f"kvloop bench soak: {result['store']} store, {agents} agents, {callers} callers")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("lost events", str(result["lost_events"]), "0")
    table.add_row("phantom entries", str(result["phantom_entries"]), "0")
    table.add_row("entries at the end", f"{result['entries_found']:,} / {result['entries_expected']:,}", "")
    table.add_row("events sent", f"{result['events_sent']:,} ({result['events_per_s']:,}/s)", "")
    for kind in ("restarts", "gaps", "cleared", "snapshots_sent"):
        table.add_row(f"  {kind}", str(result["faults_and_events"].get(kind, 0)), "")
    table.add_row(
        "event lag p50 / p99 (sent -> served by Lookup)",
        f"{result['event_lag_p50_ms']} / {result['event_lag_p99_ms']} ms",
        "",
    )
    table.add_row(
        f"Lookup p50 / p99 under load ({result['lookups_per_s']:,}/s)",
        f"{result['lookup_p50_ms']} / {result['lookup_p99_ms']} ms",
        "",
    )
    for name, cpu in result["cpu_percent_of_one_core"].items():
        table.add_row(f"{name} CPU (% of one core)", f"{cpu}", "")
    for name, growth in result["rss_growth_last_half_percent"].items():
        last = result["rss_mib"][name][-1][1] if result["rss_mib"][name] else "?"
        table.add_row(f"{name} RSS at the end / growth over the last half", f"{last} MiB / {growth}%", "< 5%")
    console.print(table)
    for line in result["count_mismatches"][:5] + result["lost_samples"] + result["phantom_samples"]:
        err_console.print(f"[red]mismatch[/red] {line}")
