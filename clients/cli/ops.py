"""`kvloop workers`, `find` (`blocks`), `lookup`, `stats`, `pairs`, `watch`, `drain`, `trace`: a running
loop as kvloopd sees it (workers, blocks, decisions, counters, the cost model) and its turns' traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvloop.clients.cli.output import (
    JsonFlag,
    _as_dict,
    _call,
    _client,
    _emit_json,
    _fail,
    console,
    err_console,
    fail_rpc,
    state,
)
from kvloop.clients.console import make_console
from kvloop.clients.directory_client import KvloopError
from kvloop.common.outcomes import path_name, reason_name, tier_name
from kvloop.v1 import directory_pb2 as pb


def _hex_hash(value: str) -> bytes:
    try:
        return bytes.fromhex(value.removeprefix("0x"))
    except ValueError:
        _fail(f"block hash must be hex, got {value!r}", code=2)
        raise


def _tiers_named(value):
    """A message's dict with every ``tier`` as the CLI names it ("device", "host"), not the enum's
    proto name (an unset tier is "device")."""
    if isinstance(value, list):
        return [_tiers_named(item) for item in value]
    if isinstance(value, dict):
        return {
            key: (tier_name(pb.BlockTier.Value(item) if isinstance(item, str) else item))
            if key == "tier"
            else _tiers_named(item)
            for key, item in value.items()
        }
    return value


_STATE_STYLE = {"ACTIVE": "green", "RESYNCING": "yellow", "EXPIRED": "red", "DRAINING": "magenta"}


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
        "agent",
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
            reg.agent_version or "unknown",
        )
    console.print(table if found else f"no workers registered at {state.daemon}")


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
        _emit_json([_tiers_named(_as_dict(loc)) for loc in found])
        return
    if not found:
        console.print(f"block {block_hash} is not in the directory for model {model!r}")
        return
    table = Table(title=f"block {block_hash[:16]}...")
    for column in ("worker", "kind", "tier", "position", "block ids", "handle", "expires in", "servable"):
        table.add_column(column)
    for loc in found:
        table.add_row(
            loc.worker_id,
            loc.kind,
            tier_name(loc.tier),
            str(loc.position) if loc.position >= 0 else "-",
            ",".join(map(str, loc.block_ids)) or "-",
            loc.retention_handle or "-",
            f"{loc.expires_in_ms / 1000:.1f}s" if loc.kind == "retained" else "-",
            "yes" if loc.servable else "no",
        )
    console.print(table)


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
        _emit_json(_tiers_named(_as_dict(answer)))
        return
    console.print(f"[bold]{path_name(answer.path)}[/bold] ({reason_name(answer.reason)}): {answer.detail}")
    if answer.holder.worker_id:
        h = answer.holder
        console.print(
            f"holder {h.worker_id} ({h.nixl_endpoint}) serves {h.matched_blocks} blocks from "
            f"{tier_name(h.tier)} memory, handle {h.retention_handle}, lease {h.expires_in_ms / 1000:.1f}s"
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
    table.add_row("version", answer.version or "unknown")
    table.add_row("models", ", ".join(answer.models) or "-")
    for release, count in sorted(answer.agent_versions.items()):
        table.add_row(f"agents of {release or 'unknown'}", f"{count:,}")
    for key, count in sorted(answer.decisions.items()):
        table.add_row(f"decisions {key}", f"{count:,}")
    console.print(table)


def pairs(
    model: Annotated[str, typer.Option(help="only this model's workers")] = "",
    json_output: JsonFlag = False,
) -> None:
    """The cost model: per holder (and tier of its runs) -> puller pair its estimate, samples and verdicts
    (why turns recompute)."""
    answer = _call(lambda c: c.pairs(model))
    if state.json:
        _emit_json(_tiers_named(_as_dict(answer)))
        return
    table = Table(title="transfer estimates (READs timed by NIXL)")
    for column in (
        "holder",
        "tier",
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
            tier_name(p.tier),
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
        fail_rpc(exc)
    except KeyboardInterrupt:
        pass


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
