"""`kvloop`: inspect and exercise a kvloopd directory (human tables, or --json for scripts)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Optional

import typer
from google.protobuf.json_format import MessageToDict
from rich.table import Table

from kvloop.clients.bench.multiturn import ARMS, CPU_ROLES, DEFAULT_WORKLOADS, ROUTING_ARMS, WORKLOADS
from kvloop.clients.console import make_console
from kvloop.clients.directory_client import DirectoryClient, KvloopError, default_target
from kvloop.common.logging import configure_logging
from kvloop.common.outcomes import path_name, reason_name
from kvloop.common.security import ClientSecurity
from kvloop.v1 import directory_pb2 as pb

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Inspect and exercise the kvloop block directory (kvloopd).",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")

console = make_console()
err_console = make_console(stderr=True)


class _State:
    daemon: str = ""
    security: ClientSecurity = ClientSecurity()
    json: bool = False
    timeout: float = 5.0


state = _State()


def _json_flag(value: bool) -> bool:
    if value:
        state.json = True
    return value


# `--json` is accepted before the subcommand (`kvloop --json workers`) and after it (`kvloop workers
# --json`), and means the same everywhere: print JSON on stdout. Every command takes it.
JsonFlag = Annotated[
    bool,
    typer.Option(
        "--json", callback=_json_flag, help="print JSON on stdout (same as `kvloop --json COMMAND`)"
    ),
]


@app.callback()
def _global(
    daemon: Annotated[str, typer.Option(envvar="KVLOOP_DAEMON", help="kvloopd HOST:PORT")] = default_target(),
    token: Annotated[Optional[str], typer.Option(envvar="KVLOOP_TOKEN", help="bearer token")] = None,
    ca_file: Annotated[Optional[Path], typer.Option(help="CA bundle: use TLS")] = None,
    cert_file: Annotated[Optional[Path], typer.Option(help="client certificate (mutual TLS)")] = None,
    key_file: Annotated[Optional[Path], typer.Option(help="client key (mutual TLS)")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
    timeout: Annotated[float, typer.Option(help="seconds per call")] = 5.0,
) -> None:
    configure_logging("warning")
    state.daemon = daemon
    try:
        state.security = ClientSecurity(token=token, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
    except ValueError as exc:
        _fail(str(exc).splitlines()[-1], code=2)
    state.json = json_output
    state.timeout = timeout


def _fail(message: str, code: int = 1) -> None:
    err_console.print(f"[red]kvloop:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _client() -> DirectoryClient:
    return DirectoryClient(state.daemon, state.security, timeout=state.timeout)


def _call(fn):
    try:
        with _client() as client:
            return fn(client)
    except KvloopError as exc:
        _fail(str(exc))


def _emit_json(value) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _as_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _hex_hash(value: str) -> bytes:
    try:
        return bytes.fromhex(value.removeprefix("0x"))
    except ValueError:
        _fail(f"block hash must be hex, got {value!r}", code=2)
        raise


_STATE_STYLE = {"ACTIVE": "green", "RESYNCING": "yellow", "EXPIRED": "red", "DRAINING": "magenta"}


@app.command()
def workers(
    model: Annotated[str, typer.Option(help="only this model")] = "", json_output: JsonFlag = False
) -> None:
    """List registered workers with lease state, epoch and block counts."""
    found = _call(lambda c: c.list_workers(model))
    if state.json:
        _emit_json([_as_dict(w) for w in found])
        return
    table = Table(title=f"workers at {state.daemon}")
    for column in (
        "worker",
        "role",
        "model",
        "lease",
        "epoch",
        "seq",
        "retained blocks",
        "runs",
        "stored blocks",
        "last seen",
        "nixl",
    ):
        table.add_column(column)
    for w in found:
        reg = w.registration
        lease = pb.LeaseState.Name(w.lease_state).removeprefix("LEASE_STATE_")
        table.add_row(
            reg.worker_id,
            pb.WorkerRole.Name(reg.role).removeprefix("WORKER_ROLE_").lower(),
            reg.model,
            f"[{_STATE_STYLE.get(lease, 'white')}]{lease.lower()}[/]" + ("" if w.connected else " (gone)"),
            str(reg.epoch),
            str(w.last_applied_sequence),
            str(w.retained_blocks),
            str(w.retained_runs),
            str(w.stored_blocks),
            f"{w.last_seen_ms_ago / 1000:.1f}s",
            reg.nixl_endpoint,
        )
    console.print(table if found else f"no workers registered at {state.daemon}")


@app.command("find")
def find(
    block_hash: Annotated[str, typer.Argument(help="block hash, hex")],
    model: Annotated[str, typer.Option(help="model the block belongs to")],
    lora: Annotated[str, typer.Option(help="LoRA name")] = "",
    json_output: JsonFlag = False,
) -> None:
    """Show every location of one block hash (alias: blocks)."""
    digest = _hex_hash(block_hash)
    found = _call(lambda c: c.find_block(model, digest, lora))
    if state.json:
        _emit_json([_as_dict(loc) for loc in found])
        return
    if not found:
        console.print(f"block {block_hash} is not in the directory for model {model!r}")
        return
    table = Table(title=f"block {block_hash[:16]}...")
    for column in ("worker", "kind", "position", "block ids", "handle", "expires in", "servable"):
        table.add_column(column)
    for loc in found:
        table.add_row(
            loc.worker_id,
            loc.kind,
            str(loc.position) if loc.position >= 0 else "-",
            ",".join(map(str, loc.block_ids)) or "-",
            loc.retention_handle or "-",
            f"{loc.expires_in_ms / 1000:.1f}s" if loc.kind == "retained" else "-",
            "yes" if loc.servable else "no",
        )
    console.print(table)


app.command("blocks", help="Alias of find.")(find)


@app.command()
def lookup(
    model: Annotated[str, typer.Option(help="model")],
    hashes: Annotated[
        Optional[list[str]], typer.Argument(help="the prompt's block hashes, hex, in order")
    ] = None,
    hashes_file: Annotated[Optional[Path], typer.Option(help="JSON list of hex hashes")] = None,
    local_blocks: Annotated[int, typer.Option(help="leading blocks the caller already has")] = 0,
    requester: Annotated[str, typer.Option(help="asking worker id")] = "",
    lora: Annotated[str, typer.Option(help="LoRA name")] = "",
    json_output: JsonFlag = False,
) -> None:
    """Ask which peer can serve the longest prefix of a prompt, and the decision (never claims)."""
    values = list(hashes or [])
    if hashes_file is not None:
        try:
            values += json.loads(hashes_file.read_text())
        except (OSError, ValueError) as exc:
            _fail(f"cannot read {hashes_file}: {exc}", code=2)
    if not values:
        _fail("give block hashes as arguments or with --hashes-file", code=2)
    digests = [_hex_hash(v) for v in values]
    answer = _call(
        lambda c: c.lookup(model, digests, local_blocks=local_blocks, requester=requester, lora_name=lora)
    )
    if state.json:
        _emit_json(_as_dict(answer))
        return
    console.print(f"[bold]{path_name(answer.path)}[/bold] ({reason_name(answer.reason)}): {answer.detail}")
    if answer.holder.worker_id:
        h = answer.holder
        console.print(
            f"holder {h.worker_id} ({h.nixl_endpoint}) serves {h.matched_blocks} blocks, "
            f"handle {h.retention_handle}, lease {h.expires_in_ms / 1000:.1f}s"
        )
    console.print(
        f"matched tokens {answer.matched_tokens}, to recompute {answer.recompute_tokens}, "
        f"server time {answer.lookup_us} us"
    )
    if answer.HasField("cost"):
        console.print(
            f"cost: transfer ~{answer.cost.transfer_ms:.3f} ms ({answer.cost.transfer_basis}), "
            f"recompute ~{answer.cost.recompute_ms:.3f} ms ({answer.cost.recompute_basis})"
        )


@app.command()
def stats(json_output: JsonFlag = False) -> None:
    """Directory-wide counters."""
    answer = _call(lambda c: c.stats())
    if state.json:
        _emit_json(_as_dict(answer))
        return
    table = Table(title=f"kvloopd at {state.daemon}", show_header=False)
    for field in (
        "workers",
        "entries",
        "retained_runs",
        "events_ingested",
        "lookups",
        "resyncs",
        "evictions",
        "rejected_messages",
        "max_entries",
    ):
        table.add_row(field.replace("_", " "), f"{getattr(answer, field):,}")
    table.add_row("uptime", f"{answer.uptime_seconds:.0f}s")
    table.add_row("models", ", ".join(answer.models) or "-")
    for key, count in sorted(answer.decisions.items()):
        table.add_row(f"decisions {key}", f"{count:,}")
    console.print(table)


@app.command()
def pairs(
    model: Annotated[str, typer.Option(help="only this model's workers")] = "",
    json_output: JsonFlag = False,
) -> None:
    """The cost model: per holder -> puller pair its estimate, samples and verdicts (why turns recompute)."""
    answer = _call(lambda c: c.pairs(model))
    if state.json:
        _emit_json(_as_dict(answer))
        return
    table = Table(title="transfer estimates (READs timed by NIXL)")
    for column in (
        "holder",
        "puller",
        "GB/s",
        "setup ms",
        "samples",
        "verdicts",
        "last transfer",
        "step wait ms",
    ):
        table.add_column(column)
    for p in answer.pairs:
        samples = ", ".join(f"{g:.2f}" for g in p.sample_gbytes_per_s[-6:]) or "-"
        verdicts = ", ".join(f"{k} {v}" for k, v in sorted(p.verdicts.items())) or "-"
        last = f"{p.last_transfer_s_ago:.1f}s ago" if p.last_transfer_s_ago >= 0 else "never"
        table.add_row(
            p.holder_worker_id,
            p.puller_worker_id,
            f"{p.transfer_gbytes_per_s:.2f}",
            f"{p.setup_ms:.2f}",
            f"{len(p.sample_gbytes_per_s)}: {samples}",
            verdicts,
            last,
            f"{p.mean_wait_ms:.1f}",
        )
    console.print(table)
    for w in answer.pullers:
        console.print(
            f"{w.worker_id}: prefill ~{w.prefill_tokens_per_s:,.0f} tokens/s "
            f"({len(w.sample_tokens_per_s)} prefills measured)"
        )


@app.command()
def watch(
    model: Annotated[str, typer.Option(help="only this model")] = "", json_output: JsonFlag = False
) -> None:
    """Stream directory changes until interrupted."""
    try:
        with _client() as client:
            for change in client.watch(model):
                if state.json:
                    sys.stdout.write(json.dumps(_as_dict(change)) + "\n")
                    sys.stdout.flush()
                else:
                    console.print(
                        f"{change.kind:<12} {change.worker_id:<20} {change.model:<20} "
                        f"blocks={change.blocks} {change.detail}",
                        highlight=False,
                    )
    except KvloopError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        pass


@app.command()
def drain(
    worker_id: Annotated[str, typer.Argument(help="worker to drain")],
    reason: Annotated[str, typer.Option(help="why")] = "",
    json_output: JsonFlag = False,
) -> None:
    """Stop serving a worker's blocks and tell its agent to drain (admin)."""
    delivered = _call(lambda c: c.drain(worker_id, reason))
    if state.json:
        _emit_json({"worker_id": worker_id, "delivered": delivered})
    else:
        console.print(f"{worker_id}: draining" + ("" if delivered else " (agent not connected)"))


@bench_app.command("slow-reads")
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


@bench_app.command("chaos")
def bench_chaos(
    store: Annotated[str, typer.Option(help="memory, or redis (replicas, Sentinel failover)")] = "memory",
    quick: Annotated[bool, typer.Option(help="every fault kind once (a few minutes)")] = False,
    duration: Annotated[float, typer.Option(min=60, help="seconds of faults without --quick")] = 600.0,
    conversations: Annotated[int, typer.Option(min=1, help="concurrent agent conversations")] = 3,
    interval: Annotated[float, typer.Option(min=5, help="seconds between faults")] = 20.0,
    seed: Annotated[int, typer.Option(help="the fault schedule's and the conversations' seed")] = 0,
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
            f"near-ties {result['near_ties']}; paths {result['paths']}"
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


@bench_app.command("decode-tpot")
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
    summary = result["summary"]
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
    for c in summary["conditions"]:
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
    table = Table(
        title="paired effects: TPOT ratio per request (same round and slot), and step time at equal batch"
    )
    for column in ("factor", "ratio", "pairs", "median", "95% CI", "step ratio by batch (no arrival)"):
        table.add_column(column)
    for e in summary["effects"]:
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
    if len(result["stacks"]) > 1:
        table = Table(title="each effect over stacks: each stack's paired median, their mean, its 95% CI")
        for column in ("factor", "stack medians", "mean", "95% CI"):
            table.add_column(column)
        for row in result["across_stacks"]:
            table.add_row(
                row["factor"],
                ", ".join(str(m) for m in row["stack_medians"]),
                _blank(row.get("mean")),
                "-".join(str(x) for x in row.get("mean_ci95", ())),
            )
        console.print(table)
    console.print(f"results: {out}")


@bench_app.command("directory")
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


@bench_app.command("fuzz")
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


@bench_app.command("soak")
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
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

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
            if state.json:
                result = run_soak(config)
            else:
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

                    result = run_soak(config, on_progress)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            _fail(str(exc))
    failed = bool(result["lost_events"] or result["phantom_entries"] or result["count_mismatches"])
    if state.json:
        _emit_json(result)
    else:
        table = Table(title=f"kvloop bench soak: {result['store']} store, {agents} agents, {callers} callers")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_column("target", justify="right")
        table.add_row("lost events", str(result["lost_events"]), "0")
        table.add_row("phantom entries", str(result["phantom_entries"]), "0")
        table.add_row(
            "entries at the end", f"{result['entries_found']:,} / {result['entries_expected']:,}", ""
        )
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
            table.add_row(
                f"{name} RSS at the end / growth over the last half", f"{last} MiB / {growth}%", "< 5%"
            )
        console.print(table)
        for line in result["count_mismatches"][:5] + result["lost_samples"] + result["phantom_samples"]:
            err_console.print(f"[red]mismatch[/red] {line}")
    if failed:
        raise typer.Exit(1)


@bench_app.command("proxy-load")
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


@bench_app.command("idle")
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


@bench_app.command("replay")
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
    prefills: Annotated[int, typer.Option(min=1, help="prefill workers")] = 2,
    decodes: Annotated[int, typer.Option(min=1, help="decode workers")] = 4,
    block_size: Annotated[int, typer.Option(min=1, help="vLLM block size (tokens)")] = 16,
    retention_blocks: Annotated[
        int, typer.Option(min=0, help="decode KV memory set aside for retained turns, blocks per decode")
    ] = 50_000,
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
    multiturn_results: Annotated[
        Optional[Path],
        typer.Option(help="cost model fitted to a `kvloop bench multiturn --json` output instead"),
    ] = None,
    sweep: Annotated[
        Optional[list[str]],
        typer.Option(
            help="repeat over settings, e.g. lease=60,240,480,memory=10000,50000 (keys: lease, "
            "memory, prefill_cache, decodes, prefills)"
        ),
    ] = None,
    plot: Annotated[Path, typer.Option(help="--sweep: PNG of the saving against the settings")] = Path(
        "replay-sweep.png"
    ),
    buckets: Annotated[int, typer.Option(min=1, help="windows of the over-time report")] = 10,
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
    from kvloop.clients.bench import replay as rp
    from kvloop.clients.bench.replay_fleet import ROUTINGS, FleetConfig
    from kvloop.clients.bench.replay_gen import SyntheticConfig, describe, generate
    from kvloop.clients.bench.replay_report import CostModel, CostModelError, print_report
    from kvloop.clients.bench.replay_trace import TraceError, read_trace, write_jsonl
    from kvloop.common.processes import supervisor

    if (trace is None) == (synthetic is None):
        _fail("give exactly one of --trace FILE and --synthetic N", code=2)
    if routing not in ROUTINGS:
        _fail(f"--routing {routing!r}: choose from {', '.join(ROUTINGS)}", code=2)
    if trace_format not in ("auto", "mooncake", "chat"):
        _fail(f"--format {trace_format!r}: auto, mooncake or chat", code=2)
    try:
        grid = rp.parse_sweep(sweep or [])
        cost = (
            CostModel.from_multiturn(multiturn_results)
            if multiturn_results
            else CostModel.from_figures(prefill_tokens_per_s, link_gbps, setup_ms, kv_bytes_per_token)
        )
    except (ValueError, CostModelError) as exc:
        _fail(str(exc), code=2)
    info: dict = {}
    try:
        if synthetic is not None:
            gen = SyntheticConfig(requests=synthetic, seed=seed)
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
    )
    config = rp.ReplayConfig(fleet=fleet, cost=cost, buckets=buckets, daemon_args=tuple(daemon_arg or ()))
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


@app.command()
def proxy(
    prefill: Annotated[list[str], typer.Option(help="prefill vLLM server base URL (repeatable)")],
    decode: Annotated[list[str], typer.Option(help="decode vLLM server base URL (repeatable)")],
    listen: Annotated[str, typer.Option(help="HOST:PORT to serve the OpenAI API on")] = "127.0.0.1:8000",
    request_timeout: Annotated[float, typer.Option(help="seconds per upstream request")] = 600.0,
    route: Annotated[
        bool,
        typer.Option(
            "--route/--no-route",
            help="choose each prefill by kvloopd's Route ranking (kvloopd at --daemon); --no-route: by load",
        ),
    ] = False,
    route_timeout: Annotated[
        float, typer.Option(help="seconds for tokenize + Route per request before falling back to load")
    ] = 0.1,
    tokenizer: Annotated[
        str,
        typer.Option(
            help="where --route gets token ids: auto (the model's tokenizer, from the model directory the "
            "servers report, when it is on this host), remote (a prefill's /tokenize), or a tokenizer path "
            "or Hugging Face id"
        ),
    ] = "auto",
    max_attempts: Annotated[
        int,
        typer.Option(
            min=1,
            help="runs of a request on different servers when one fails under it (continuations of a "
            "broken stream included)",
        ),
    ] = 3,
    continuation_ttl: Annotated[
        float,
        typer.Option(
            min=0,
            help="with --route: seconds to keep Route's answer for a conversation whose streamed turn "
            "ended, to route its next turn without tokenizing or asking Route (0: off)",
        ),
    ] = 120.0,
    burst_window: Annotated[
        float,
        typer.Option(
            "--burst-window-ms",
            min=0,
            help="with --route: a request that would leave the prefill holding the longest prefix of its "
            "prompt waits this long for the rest of its burst, then they are placed together (0: off)",
        ),
    ] = 5.0,
    cert_file: Annotated[Optional[Path], typer.Option(help="serve HTTPS with this certificate")] = None,
    key_file: Annotated[Optional[Path], typer.Option(help="key of --cert-file")] = None,
    client_ca_file: Annotated[
        Optional[Path], typer.Option(help="require client certificates signed by this CA (mutual TLS)")
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Serve /v1/chat/completions and /v1/completions over vLLM prefill and decode servers (--json: log
    lines as JSON). Stops on SIGTERM, SIGINT and SIGHUP."""
    import asyncio
    import signal as signals

    from kvloop.clients.proxy.app import ProxyConfig, serve
    from kvloop.common.addresses import parse_host_port
    from kvloop.common.security import TlsSettings
    from kvloop.common.tracing import configure_tracing, shutdown_tracing

    try:
        host, port = parse_host_port(listen, "listen")
    except ValueError as exc:
        _fail(str(exc), code=2)
    tls = None
    if cert_file or key_file or client_ca_file:
        if not (cert_file and key_file):
            _fail("--cert-file and --key-file go together (--client-ca-file adds mutual TLS)", code=2)
        try:
            tls = TlsSettings(
                cert_file=cert_file, key_file=key_file, client_ca_file=client_ca_file
            ).http_server_context()
        except ValueError as exc:
            _fail(str(exc), code=2)
    configure_logging("info", json_logs=True if state.json else None)
    configure_tracing("kvloop-proxy")
    config = ProxyConfig(
        prefill=prefill,
        decode=decode,
        request_timeout_s=request_timeout,
        directory=state.daemon if route else None,
        route_timeout_s=route_timeout,
        tokenizer=tokenizer,
        max_attempts=max_attempts,
        continuation_ttl_s=continuation_ttl,
        burst_window_s=burst_window / 1e3,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signals.SIGTERM, signals.SIGINT, signals.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, host, port, stop, tls)

    try:
        asyncio.run(run())
    except OSError as exc:
        _fail(f"cannot listen on {listen}: {exc}")
    finally:
        shutdown_tracing()


@bench_app.command("multiturn")
def bench_multiturn(
    quick: Annotated[
        bool, typer.Option("--quick", help="a few minutes: 2 sessions x 5 turns, concurrency 1 and 4")
    ] = False,
    sessions_turns: Annotated[int, typer.Option("--turns", min=2, help="turns per session")] = 10,
    concurrency: Annotated[list[int] | None, typer.Option(help="concurrent sessions (repeatable)")] = None,
    workload: Annotated[
        list[str] | None,
        typer.Option(help="plain, shared_prefix, edited, reasoning (repeatable; default: all but reasoning)"),
    ] = None,
    arm: Annotated[
        list[str] | None,
        typer.Option(
            help="recompute, builtin, kvloop, local (repeatable; local is the "
            "ideal reference: a prefill that kept its own cache)"
        ),
    ] = None,
    tool_tokens: Annotated[
        Optional[int],
        typer.Option(min=1, help="words of tool output appended per turn [default: 600, --quick 400]"),
    ] = None,
    system_tokens: Annotated[
        Optional[int], typer.Option(min=1, help="words of system prompt [default: 1500, --quick 800]")
    ] = None,
    answer_tokens: Annotated[
        int,
        typer.Option(
            min=2,
            help="tokens each turn's answer decodes: an agent's tool call (the reasoning workload "
            "decodes 128 tokens of thinking instead)",
        ),
    ] = 128,
    tokenizer: Annotated[
        str,
        typer.Option(
            help="words: answers tokenize back to the ids generated, as a real model's mostly do; "
            "bpe: a random-weight model's answers almost never do (the next turn departs from its KV)"
        ),
    ] = "words",
    retention_ttl: Annotated[
        float,
        typer.Option(
            min=1,
            help="seconds a decode retains a finished turn's KV (vLLM's retention, the builtin arm's, never "
            "yields to new runs: long leases with several sessions fill a decode with runs no one needs)",
        ),
    ] = 90.0,
    retention_max_share: Annotated[
        float,
        typer.Option(
            min=0.01,
            max=1.0,
            help="share of a kvloop decode's KV cache retained runs may pin (kvloop engines default to "
            "0.5; 1: no bound, as vLLM's, and as this bench's figures were taken)",
        ),
    ] = 1.0,
    retention_yield: Annotated[
        bool,
        typer.Option(help="past 0.9 of that share, kvloop decodes give up their oldest runs for newer ones"),
    ] = True,
    prefix_caching: Annotated[bool, typer.Option(help="prefix caching on the prefill engines")] = False,
    ucx_tls: Annotated[
        str,
        typer.Option(
            help="UCX transports of the engines' pulls (UCX_TLS): cma moves KV between processes of this "
            "host at memory speed; tcp,self costs what a pull between hosts over TCP does",
        ),
    ] = "cma,tcp,self",
    prefills: Annotated[
        int,
        typer.Option(
            min=1,
            help="prefill engines; with --prefills or --decodes above 1 the routing bench runs instead: "
            "arms kvloop (Route + pull), load_pull, prefix_route, recompute on one shared fleet",
        ),
    ] = 1,
    decodes: Annotated[int, typer.Option(min=1, help="decode engines (see --prefills)")] = 1,
    pin_engines: Annotated[
        bool,
        typer.Option(
            help="prefill engines compute on the first half of the cores, decodes on the other half "
            "(as on separate hosts): a decode's TPOT without co-located prefill compute"
        ),
    ] = False,
    repeats: Annotated[int, typer.Option(min=1, help="repeat every workload")] = 1,
    seed: Annotated[
        int, typer.Option(help="conversations' seed: runs with other seeds replay other conversations")
    ] = 1,
    dtype: Annotated[
        str,
        typer.Option(
            help="engines' dtype: float32 keeps bf16 rounding from flipping the "
            "random-weight model's greedy near-ties"
        ),
    ] = "float32",
    warmup_turns: Annotated[int, typer.Option(min=0, help="throwaway turns per arm before measuring")] = 2,
    workdir: Annotated[Path, typer.Option(help="engines' logs, results and plots")] = Path(".kvloop-bench"),
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", help="write the results JSON here [default: WORKDIR/multiturn.json]"),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Continuation TTFT: recompute vs vLLM's built-in reverse mode vs kvloop (and the local-cache
    ideal), on real engines; with --prefills/--decodes above 1, prefill routing arms on one fleet.
    --json prints the results JSON on stdout instead of the tables."""
    from kvloop.clients.bench.multiturn import MultiturnConfig, run_multiturn
    from kvloop.clients.fleet.model import DTYPE_BYTES, TOKENIZERS
    from kvloop.common.processes import supervisor

    known_arms = ROUTING_ARMS if prefills > 1 or decodes > 1 else ARMS
    if arm is None:
        arm = list(known_arms)
    if workload is None:
        workload = list(DEFAULT_WORKLOADS)
    if concurrency is None:
        concurrency = [1, 4, 8]
    if dtype not in DTYPE_BYTES:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(DTYPE_BYTES)}", param_hint="--dtype")
    if tokenizer not in TOKENIZERS:
        raise typer.BadParameter(
            f"{tokenizer!r} is not one of {', '.join(TOKENIZERS)}", param_hint="--tokenizer"
        )
    for name, given, known in (("--arm", arm, known_arms), ("--workload", workload, WORKLOADS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise typer.BadParameter(f"{', '.join(unknown)}: choose from {', '.join(known)}", param_hint=name)
    config = MultiturnConfig(
        workdir=workdir.resolve(),
        turns=5 if quick else sessions_turns,
        concurrency=(1, 4) if quick else tuple(concurrency),
        workloads=tuple(workload),
        arms=tuple(a for a in known_arms if a in arm),
        prefill_prefix_caching=prefix_caching,
        prefills=prefills,
        decodes=decodes,
        pin_engines=pin_engines,
        repeats=repeats,
        seed=seed,
        quick=quick,
        system_tokens=system_tokens or (800 if quick else 1500),
        tool_tokens=tool_tokens or (400 if quick else 600),
        answer_tokens=answer_tokens,
        tokenizer=tokenizer,
        retention_ttl_s=retention_ttl,
        retention_max_share=retention_max_share,
        retention_yield=retention_yield,
        dtype=dtype,
        warmup_turns=warmup_turns,
        ucx_tls=ucx_tls,
    )
    with supervisor().stop_on_signals():
        result = run_multiturn(config)  # progress on stderr (a line per stage off a terminal)
    out = output or (config.workdir / "multiturn.json")
    out.write_text(json.dumps(result, indent=2))
    if state.json:
        _emit_json(result)
        return
    _print_multiturn(result["summary"])
    console.print(f"results: {out}; plots: {', '.join(result['plots'])}")


@bench_app.command("multiturn-pool")
def bench_multiturn_pool(
    results: Annotated[
        list[Path], typer.Argument(help="results JSONs of `bench multiturn` runs of one setup (seeds apart)")
    ],
    json_output: JsonFlag = False,
) -> None:
    """The tables of `bench multiturn` over several runs pooled (each run's turns a repeat of their
    own), as seeds run apart instead of --repeats on one fleet. --json prints the pooled summary."""
    from kvloop.clients.bench.multiturn import pooled_summary

    loaded = []
    for path in results:
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            _fail(f"cannot read {path}: {exc}")
    try:
        summary = pooled_summary(loaded)
    except KeyError as exc:
        _fail(f"not results of `kvloop bench multiturn` (no {exc} in one of them)", 2)
    except ValueError as exc:
        _fail(f"cannot pool these results: {exc}", 2)
    if state.json:
        _emit_json(summary)
        return
    _print_multiturn(summary)


def _print_multiturn(summary: dict) -> None:
    table = Table(title="kvloop bench multiturn: continuation turns (TTFT = disaggregated prefill latency)")
    for column in (
        "workload",
        "sessions",
        "arm",
        "turns",
        "p50 ms",
        "p90 ms",
        "p50 per repeat",
        "x recompute",
        "transfer share",
        "pulled tokens",
        "prompt tokens",
        "answers = recompute",
        "wrong blocks",
        "MiB moved",
        "READ ms",
        "lookup ms",
    ):
        table.add_column(column)
    for row in summary["rows"]:
        table.add_row(
            row["workload"],
            str(row["concurrency"]),
            row["arm"],
            str(row["continuation_turns"]),
            f"{row['ttft_p50_ms']:.0f}",
            f"{row['ttft_p90_ms']:.0f}",
            " ".join(f"{v:.0f}" for v in row["ttft_p50_by_repeat_ms"]),
            str(row["ratio_to_recompute_p50"]),
            str(row["transfer_share"]),
            str(row["mean_pulled_tokens"]),
            str(row["mean_prompt_tokens"]),
            _blank(row["answer_agreement_with_recompute"]),
            f"{row['wrong_pulled_blocks']} of {row['pulled_blocks']}",
            _blank(row.get("bytes_moved_mib")),
            _blank(row.get("nixl_read_ms_mean")),
            _blank(row.get("lookup_ms_p50")),
        )
    console.print(table)
    table = Table(
        title="continuation TTFT by context length (nearest 2K tokens): p50 ms (x recompute in that bucket)"
    )
    present = [a for a in dict.fromkeys(ARMS + ROUTING_ARMS) if any(r["arm"] == a for r in summary["rows"])]
    for column in ("workload", "sessions", "context", "turns", *present):
        table.add_column(column)
    cells: dict[tuple, dict[str, dict]] = {}
    for cell in summary["by_context"]:
        cells.setdefault((cell["workload"], cell["concurrency"], cell["context_k"]), {})[cell["arm"]] = cell
    for (workload, concurrency, k), arms in cells.items():
        table.add_row(
            workload,
            str(concurrency),
            f"~{k}K",
            str(max(c["turns"] for c in arms.values())),
            *(
                f"{arms[a]['ttft_p50_ms']:.0f} ({arms[a]['ratio_to_recompute_p50']})" if a in arms else ""
                for a in present
            ),
        )
    console.print(table)
    table = Table(
        title="where a turn's time goes (means over all turns, ms): inside the prefill engine (vLLM's "
        "request metrics) and outside it (HTTP, chat template, tokenizer)"
    )
    for column in (
        "workload",
        "sessions",
        "arm",
        "TTFT",
        "waiting (lookup + READ)",
        "of which READ",
        "prefill compute",
        "outside the engine",
        "decode TPOT",
    ):
        table.add_column(column)
    for row in summary["rows"]:
        if "engine_e2e_ms_mean" in row:
            ttft = row["ttft_mean_all_turns_ms"]
            table.add_row(
                row["workload"],
                str(row["concurrency"]),
                row["arm"],
                f"{ttft:.0f}",
                f"{row['engine_queue_ms_mean']:.0f}",
                _blank(row.get("nixl_read_ms_mean")),
                f"{row['engine_prefill_ms_mean']:.0f}",
                f"{ttft - row['engine_e2e_ms_mean']:.0f}",
                _blank(row.get("decode_tpot_ms_mean")),
            )
    console.print(table)
    decode_rows = [row for row in summary["rows"] if "decode_tpot_ms_mean" in row]
    if decode_rows:
        table = Table(
            title="the decode side: time per output token, mean batch (tokens per engine step) and CPU "
            "seconds each process used in the measured turns"
        )
        cpu_columns = [f"CPU s {role}" for role in CPU_ROLES]
        for column in ("workload", "sessions", "arm", "decode TPOT ms", "decode batch", *cpu_columns):
            table.add_column(column)
        for row in decode_rows:
            cpu = row.get("cpu_s", {})
            table.add_row(
                row["workload"],
                str(row["concurrency"]),
                row["arm"],
                _blank(row.get("decode_tpot_ms_mean")),
                _blank(row.get("decode_batch_mean")),
                *(_blank(cpu.get(role)) for role in CPU_ROLES),
            )
        console.print(table)
    table = Table(title="paired per-turn ratios (same turn, same prompt)")
    for column in ("of", "workload", "sessions", "ratio", "turns", "median", "95% CI of the median", "IQR"):
        table.add_column(column)
    paired = [("TTFT", p) for p in summary["paired"]]
    paired += [("decode TPOT", p) for p in summary.get("paired_decode_tpot", [])]
    for measure, pair in paired:
        low, high = pair["median_ci95"]
        table.add_row(
            measure,
            pair["workload"],
            str(pair["concurrency"]),
            pair["ratio"],
            str(pair["turns"]),
            f"{pair['median']:.3f}",
            f"{low:.2f}-{high:.2f}",
            f"{pair['q1']:.2f}-{pair['q3']:.2f}",
        )
    console.print(table)
    for row in summary.get("decode_step_at_equal_batch", []):
        console.print(
            f"decode step at equal batch (steps without an arrival), {row['ratio']}, {row['workload']}, "
            f"{row['concurrency']} sessions: {row['ratio_weighted']} weighted; by batch "
            + ", ".join(f"{b['batch']}: {b['ratio']}" for b in row["by_batch"])
        )
    for row in summary["shared_prefix_new_conversations"]:
        console.print(
            f"new conversation sharing a long prefix ({row['concurrency']} sessions), {row['arm']}: "
            f"first-turn "
            f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, pulled {row['mean_pulled_tokens']:.0f} of "
            f"{row['mean_prompt_tokens']:.0f} tokens, {row['wrong_pulled_blocks']} wrong blocks"
        )


def _blank(value: object) -> str:
    return "" if value is None else str(value)


@app.command()
def engine(
    role: Annotated[str, typer.Option(help="prefill or decode")],
    model: Annotated[str, typer.Option(help="model directory or name for vllm serve")],
    worker_id: Annotated[str, typer.Option(help="this worker's stable name in the directory")],
    port: Annotated[int, typer.Option(help="OpenAI HTTP port")] = 8000,
    served_model_name: Annotated[str, typer.Option(help="model name clients use")] = "",
    host: Annotated[str, typer.Option(help="address peers reach this host on (HTTP and NIXL)")] = "127.0.0.1",
    nixl_port: Annotated[int, typer.Option(help="NIXL side-channel port")] = 5600,
    kv_events_port: Annotated[int, typer.Option(help="ZMQ KV-event port (replay on +1)")] = 5557,
    block_size: Annotated[int, typer.Option(help="KV block size (a multiple of 32 on CPU)")] = 32,
    kv_cache_gib: Annotated[int, typer.Option(help="CPU KV cache size")] = 2,
    retention_ttl: Annotated[
        float, typer.Option(help="seconds a decode retains finished turns' blocks")
    ] = 480.0,
    retention_max_share: Annotated[
        float,
        typer.Option(min=0.01, max=1.0, help="share of a decode's KV cache its retained runs may pin"),
    ] = 0.5,
    retention_yield: Annotated[
        bool,
        typer.Option(
            help="past 0.9 of that share, give up the oldest retained runs for newer ones (each freed once "
            "kvloopd confirms it dropped the run and its read window has passed)"
        ),
    ] = True,
    retention_yield_after: Annotated[
        float, typer.Option(min=0, help="seconds a run is retained before it may be given up")
    ] = 60.0,
    prefix_caching: Annotated[bool, typer.Option(help="vLLM prefix caching")] = True,
    json_output: JsonFlag = False,
) -> None:
    """Run `vllm serve` with the kvloop connector and KV events, plus its kvloop-agent sidecar; both
    stop with this command (SIGTERM, SIGINT, SIGHUP, or its death). kvloopd is --daemon /
    KVLOOP_DAEMON. --json prints one JSON object when the engine is ready."""
    import time

    from kvloop.agents.engine import Engine, EngineConfig, EngineStartError
    from kvloop.common.processes import Terminated, supervisor

    if role not in ("prefill", "decode"):
        _fail("--role must be prefill or decode", code=2)
    name = served_model_name or model
    config = EngineConfig(
        role=role,
        model=model,
        served_model_name=name,
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
    )
    if Path(model).is_dir():
        from kvloop.clients.fleet.model import kv_bytes_per_block, kv_group_windows

        config.kv_bytes_per_block = kv_bytes_per_block(Path(model), block_size)
        config.kv_group_windows = kv_group_windows(Path(model))
    children = supervisor()
    worker = Engine(config, Path(".kvloop-engine-logs") / worker_id, children)
    with children.stop_on_signals():
        try:
            worker.launch()
            err_console.print(f"starting vllm serve ({role}) and kvloop-agent; logs in {worker.log_dir}")
            while not worker.ready():
                time.sleep(0.5)  # polling /health while vLLM loads
            err_console.print(
                f"{worker_id} ready at {config.url} (NIXL {host}:{nixl_port}) in {worker.started_s:.0f}s"
            )
            if state.json:  # one line, for scripts that wait for it
                ready = {
                    "worker_id": worker_id,
                    "role": role,
                    "url": config.url,
                    "nixl": f"{host}:{nixl_port}",
                    "started_s": round(worker.started_s or 0, 1),
                    "pids": {
                        "vllm": worker.vllm.pid if worker.vllm else None,
                        "agent": worker.agent.pid if worker.agent else None,
                    },
                }
                sys.stdout.write(json.dumps(ready) + "\n")
                sys.stdout.flush()
            while True:
                worker.ready()  # raises when vLLM or the sidecar died
                time.sleep(1)  # until a signal
        except EngineStartError as exc:
            _fail(str(exc))
        except Terminated as exc:
            err_console.print(f"{exc}: stopping {worker_id}")
            raise


class DemoModel(StrEnum):
    llama = "llama"
    hybrid = "hybrid"


@app.command()
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
    agent conversation through it; print each turn's path and TTFT (--json: one JSON line per turn);
    stop everything (also on SIGTERM, SIGINT, SIGHUP, or if this command dies)."""
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
            )
        except EngineStartError as exc:
            _fail(str(exc))
    raise typer.Exit(code)


@app.command("trace")
def trace_cmd(
    spans: Annotated[Path, typer.Option("--spans", help="span file (JSON lines) to read")] = Path(
        ".kvloop-demo/spans.jsonl"
    ),
    listen: Annotated[
        Optional[str],
        typer.Option(help="instead, receive spans over OTLP/gRPC on HOST:PORT and print turns as they end"),
    ] = None,
    last: Annotated[
        Optional[int], typer.Option(min=1, help="only the last N turns (--listen: stop after N)")
    ] = None,
    trace_id: Annotated[Optional[str], typer.Option(help="the trace with this id (or id prefix)")] = None,
    save: Annotated[Optional[Path], typer.Option(help="--listen: also append the spans to this file")] = None,
    json_output: JsonFlag = False,
) -> None:
    """Show turns as waterfalls: proxy -> prefill -> kvloopd Lookup (decision, estimates) -> NIXL READ
    (bytes) -> decode, one time axis per trace (the demo writes .kvloop-demo/spans.jsonl)."""
    from kvloop.clients.cli import trace as tr

    out = make_console(stderr=False)
    if listen:
        try:
            tr.listen(
                listen,
                out,
                state.json,
                last,
                trace_id,
                notice=lambda text: err_console.print(f"[dim]{text}[/dim]", highlight=False),
                spans_out=save,
            )
        except (ValueError, OSError) as exc:
            _fail(str(exc), code=2)
        except KeyboardInterrupt:
            pass
        return
    try:
        traces = tr.select(tr.group_traces(tr.read_span_file(spans)), trace_id=trace_id, last=last)
    except tr.SpanFileError as exc:
        _fail(str(exc))
    if not traces:
        _fail(f"no trace {trace_id!r} in {spans}" if trace_id else f"no turn's trace in {spans}")
    tr.show(traces, out, state.json)


def main() -> None:
    app(prog_name="kvloop")


if __name__ == "__main__":
    main()
