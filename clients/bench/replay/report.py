"""What `kvloop bench replay` reports: token shares overall and over time, why pulls were missed,
continuation TTFT with and without kvloop from a cost model, and the daemon's figures at that load.

The cost model is the user's (prefill tokens/s, link Gbit/s, setup ms, KV bytes per token) or fitted
to a `kvloop bench multiturn --json` output: the recompute arm's TTFT against prompt tokens gives
prefill tokens/s and the fixed cost per prefill, the kvloop arm's pull time against pulled tokens
gives the transfer time per token and the setup. The same figures are the daemon's cost-model
defaults during the replay, so its transfer-or-recompute verdicts agree with the estimate.

A pull from a decode's host-memory tier moves at the host READ rate (``--host-read-gbps``), never
faster than the link: its bytes cross the holder's host memory path and then the same link. The
default, 64 Gbit/s (8 GB/s), is a conservative PCIe-class figure, a quarter of a PCIe Gen4 x16
link's 32 GB/s per direction, for a pool whose reads share the holder's PCIe with its GPUs' own
traffic; it is not a measurement, so give your fleet's measured host READ rate. The daemon's
verdicts still use the one link rate (it learns no per-tier rate from a replay).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvloop.clients.bench.cpu import CpuMeter, per_request
from kvloop.clients.bench.replay.fleet import TIERS, FleetConfig, FleetResult, RequestRecord

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


DEFAULT_HOST_READ_GBPS = 64.0


class CostModelError(ValueError):
    pass


def _ms_per_token(kv_bytes_per_token: int, gbps: float) -> float:
    return kv_bytes_per_token * 8 / (gbps * 1e9) * 1e3


@dataclass(frozen=True)
class CostModel:
    prefill_tokens_per_s: float = 8000.0
    # Fixed cost of a prefill whatever its length (scheduling, first step).
    overhead_ms: float = 0.0
    transfer_ms_per_token: float = 131_072 * 8 / 100e9 * 1e3  # 128 KiB per token over 100 Gbit/s
    setup_ms: float = 2.0
    basis: str = "user figures"
    # A host-memory READ (module docstring): 128 KiB per token at 64 Gbit/s.
    host_transfer_ms_per_token: float = 131_072 * 8 / (DEFAULT_HOST_READ_GBPS * 1e9) * 1e3

    @classmethod
    def from_figures(
        cls,
        prefill_tokens_per_s: float,
        link_gbps: float,
        setup_ms: float,
        kv_bytes_per_token: int,
        host_read_gbps: float = DEFAULT_HOST_READ_GBPS,
    ) -> CostModel:
        if prefill_tokens_per_s <= 0 or link_gbps <= 0 or setup_ms < 0 or kv_bytes_per_token <= 0:
            raise CostModelError("--prefill-tokens-per-s, --link-gbps and --kv-bytes-per-token must be > 0")
        return cls(
            prefill_tokens_per_s=prefill_tokens_per_s,
            transfer_ms_per_token=_ms_per_token(kv_bytes_per_token, link_gbps),
            setup_ms=setup_ms,
            basis=f"user figures: {prefill_tokens_per_s:g} prefill tokens/s, {link_gbps:g} Gbit/s, "
            f"{setup_ms:g} ms setup, {kv_bytes_per_token:,} KV bytes/token",
        ).with_host_read(host_read_gbps, kv_bytes_per_token)

    def with_host_read(self, gbps: float, kv_bytes_per_token: int) -> CostModel:
        """The same model with host-memory READs at ``gbps``."""
        if gbps <= 0:
            raise CostModelError("--host-read-gbps must be > 0")
        return replace(
            self,
            host_transfer_ms_per_token=_ms_per_token(kv_bytes_per_token, gbps),
            basis=f"{self.basis}; host memory reads {gbps:g} Gbit/s",
        )

    def read_ms_per_token(self, tier: str) -> float:
        """Transfer time per token of a pull from a run on this tier."""
        if tier == "host":
            return max(self.transfer_ms_per_token, self.host_transfer_ms_per_token)
        return self.transfer_ms_per_token

    @classmethod
    def from_multiturn(cls, path: Path) -> CostModel:
        """Fit to the samples of a `kvloop bench multiturn --json` (or -o) file."""
        try:
            samples = json.loads(path.read_text())["samples"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CostModelError(f"{path}: not a `kvloop bench multiturn` results file ({exc})") from None
        recompute = [(s["prompt_tokens"], s["ttft_ms"]) for s in samples if s.get("arm") == "recompute"]
        pulls = [
            (s["cached_tokens"], s["pull_ms"])
            for s in samples
            if s.get("arm") == "kvloop" and s.get("cached_tokens") and s.get("pull_ms") is not None
        ]
        if len({x for x, _ in recompute}) < 2 or len({x for x, _ in pulls}) < 2:
            raise CostModelError(
                f"{path}: needs recompute-arm turns and kvloop-arm pulls of at least two lengths each"
            )
        per_token, overhead = statistics.linear_regression(*zip(*recompute, strict=True))
        transfer, setup = statistics.linear_regression(*zip(*pulls, strict=True))
        if per_token <= 0:
            raise CostModelError(f"{path}: recompute TTFT does not grow with prompt length; cannot fit")
        return cls(
            prefill_tokens_per_s=1000 / per_token,
            overhead_ms=max(0.0, overhead),
            transfer_ms_per_token=max(transfer, 1e-9),
            setup_ms=max(0.0, setup),
            basis=f"fitted to {path.name}: {len(recompute)} recompute turns, {len(pulls)} kvloop pulls",
        )

    def daemon_env(self, kv_bytes_per_token: int) -> dict[str, str]:
        """The daemon's cost-model defaults, so its verdicts follow this model."""
        gbytes_per_s = kv_bytes_per_token / (self.transfer_ms_per_token / 1e3) / 1e9
        return {
            "KVLOOP_POLICY__DEFAULT_PREFILL_TOKENS_PER_S": f"{self.prefill_tokens_per_s:.6g}",
            "KVLOOP_POLICY__DEFAULT_TRANSFER_GBYTES_PER_S": f"{gbytes_per_s:.6g}",
            "KVLOOP_POLICY__DEFAULT_TRANSFER_SETUP_MS": f"{self.setup_ms:.6g}",
        }

    def without_kvloop_ms(self, r: RequestRecord) -> float:
        return self.overhead_ms + (r.prompt_tokens - r.local_tokens) / self.prefill_tokens_per_s * 1e3

    def with_kvloop_ms(self, r: RequestRecord) -> float:
        pull = (
            self.setup_ms + r.pulled_tokens * self.read_ms_per_token(r.pulled_tier)
            if r.pulled_tokens
            else 0.0
        )
        return self.overhead_ms + r.lookup_ms + r.recomputed_tokens / self.prefill_tokens_per_s * 1e3 + pull


def _dist(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 3)

    return {
        "p50": q(0.5),
        "p90": q(0.9),
        "p99": q(0.99),
        "max": q(1.0),
        "mean": round(statistics.fmean(values), 3),
    }


def shares(records: list[RequestRecord]) -> dict[str, float]:
    total = sum(r.prompt_tokens for r in records)
    if not total:
        return {"local_share": 0.0, "pulled_share": 0.0, "recomputed_share": 0.0}
    local = sum(r.local_tokens for r in records) / total
    pulled = sum(r.pulled_tokens for r in records) / total
    return {"local_share": local, "pulled_share": pulled, "recomputed_share": 1.0 - local - pulled}


def pulled_tokens_by_tier(records: list[RequestRecord]) -> dict[str, int]:
    by_tier = dict.fromkeys(TIERS, 0)
    for r in records:
        if r.pulled_tokens:
            by_tier[r.pulled_tier] += r.pulled_tokens
    return by_tier


def _ttft(records: list[RequestRecord], cost: CostModel) -> dict[str, Any]:
    def block(rs: list[RequestRecord]) -> dict[str, Any]:
        without = [cost.without_kvloop_ms(r) for r in rs]
        with_ = [cost.with_kvloop_ms(r) for r in rs]
        out: dict[str, Any] = {
            "requests": len(rs),
            "without_kvloop_ms": _dist(without),
            "with_kvloop_ms": _dist(with_),
        }
        if rs:
            out["saving_share_of_mean"] = round(1 - sum(with_) / sum(without), 4) if sum(without) else 0.0
            out["saving_ms_p50"] = _dist([a - b for a, b in zip(without, with_, strict=True)])["p50"]  # type: ignore[index]
        return out

    # A continuation: part of the prompt had been on a decode, beyond what the prefill kept itself.
    continuation = [r for r in records if r.ever_held_tokens > r.local_tokens]
    return {
        "model": asdict(cost),
        "continuation": block(continuation),
        "all": block(records),
    }


def build_report(
    result: FleetResult,
    fleet: FleetConfig,
    cost: CostModel,
    trace: dict[str, Any],
    buckets: int = 20,
    meter: CpuMeter | None = None,
    store: str = "memory",
) -> dict[str, Any]:
    records = result.records
    prompt_tokens = sum(r.prompt_tokens for r in records)
    missed = Counter[str]()
    for r in records:
        if r.missed_tokens:
            missed[r.missed_reason] += r.missed_tokens
    by_tier = pulled_tokens_by_tier(records)
    report: dict[str, Any] = {
        **shares(records),
        # The pulled share split by the tier of the run pulled from; the parts add up to it.
        "pulled_share_by_tier": {
            tier: n / prompt_tokens if prompt_tokens else 0.0 for tier, n in by_tier.items()
        },
        "requests": len(records),
        "prompt_tokens": prompt_tokens,
        "local_tokens": sum(r.local_tokens for r in records),
        "pulled_tokens": sum(r.pulled_tokens for r in records),
        "pulled_tokens_by_tier": by_tier,
        "recomputed_tokens": sum(r.recomputed_tokens for r in records),
        "trace": trace,
        "fleet": asdict(fleet),
        "paths": dict(Counter(r.path for r in records).most_common()),
        "reasons": dict(Counter(r.reason for r in records).most_common()),
        # Prompt tokens a decode had held but that were recomputed, by why they were not pulled.
        "missed_pull_tokens": dict(missed.most_common()),
        "missed_pull_share": round(sum(missed.values()) / prompt_tokens, 6) if prompt_tokens else 0.0,
        "ttft": _ttft(records, cost),
        "daemon": {
            "lookup_ms": _dist([r.lookup_ms for r in records if r.lookup_ms]),
            "route_ms": _dist([r.route_ms for r in records if r.route_ms]),
            "event_lag_ms": _dist(result.event_lag_ms),
            "rss_mib": {
                "start": round(result.rss_samples[0][1] / 2**20, 1),
                "peak": round(max(b for _, b in result.rss_samples) / 2**20, 1),
                "end": round(result.rss_samples[-1][1] / 2**20, 1),
            }
            if result.rss_samples
            else None,
        },
        "replay": {
            "wall_s": round(result.wall_s, 3),
            "requests_per_s": round(len(records) / result.wall_s, 1) if result.wall_s else None,
            "speedup": fleet.speedup,
            "truncated": result.truncated,
            "behind_schedule_ms_max": round(result.behind_ms_max, 1),
            "trace_span_s": round((records[-1].t_ms - records[0].t_ms) / 1000, 1) if records else 0.0,
        },
        "decodes": result.decodes,
        "over_time": _over_time(result, buckets),
        "published": _by_kind(result),
    }
    if meter is not None:
        report.update(_cpu(result, meter, store))
    return report


def _cpu(result: FleetResult, meter: CpuMeter, store: str) -> dict[str, Any]:
    """CPU per replayed request of kvloopd (and of the Redis server), split into the Route and Lookup
    windows and the rest (ingest: event batches, heartbeats, the reaper)."""
    n = len(result.records)
    events = result.events_ingested
    out: dict[str, Any] = {}
    cpu: dict[str, Any] = {
        "store": store if store in ("memory", "redis-cluster") else "redis",
        "block_events": events,
        "block_events_per_request": round(events / n, 1) if n else None,
    }
    for name, split in (("kvloopd", meter.daemon_split), ("redis", meter.redis_split)):
        if split is None:
            continue
        figures = per_request(split, n, rest="ingest")
        ingest = split.total - sum(split.parts.values())
        figures["ingest_us_per_block_event"] = round(ingest / events * 1e6, 3) if events else None
        cpu[name] = figures
        if figures:
            out[f"{'daemon' if name == 'kvloopd' else name}_cpu_ms_per_request"] = figures[
                "cpu_ms_per_request"
            ]
    if len(meter.redis_node_s) > 1:  # a cluster: each node's share of the servers' CPU
        busiest = max(meter.redis_node_s)
        cpu["redis"]["node_cpu_s"] = [round(s, 3) for s in meter.redis_node_s]
        cpu["redis"]["busiest_node_share"] = round(busiest / sum(meter.redis_node_s), 3) if busiest else None
    if meter.redis is not None:
        cpu["redis_cpu_per_reading_us"] = round(meter.redis.per_reading_s * 1e6, 3)
    out["cpu"] = cpu
    return out


def _by_kind(result: FleetResult) -> dict[str, Any]:
    """The fleet's published events per request by kind, and the blocks they name: what ingest is
    made of (a release names one run, whose blocks the directory then drops)."""
    n = len(result.records)
    if not n:
        return {}
    kinds = sorted(set(result.events_by_kind) | set(result.blocks_by_kind))
    return {
        "events_per_request_by_kind": {k: round(result.events_by_kind.get(k, 0) / n, 2) for k in kinds},
        "block_events_per_request_by_kind": {
            k: round(result.blocks_by_kind.get(k, 0) / n, 1) for k in kinds if k in result.blocks_by_kind
        },
    }


def _over_time(result: FleetResult, buckets: int) -> list[dict[str, Any]]:
    records = result.records
    if not records:
        return []
    t0, t1 = records[0].t_ms, records[-1].t_ms
    width = max((t1 - t0) / buckets, 1e-9)
    groups: list[list[RequestRecord]] = [[] for _ in range(buckets)]
    for r in records:
        groups[min(buckets - 1, int((r.t_ms - t0) / width))].append(r)
    rss = result.rss_samples
    out = []
    for i, group in enumerate(groups):
        start, end = t0 + i * width, t0 + (i + 1) * width
        in_window = [b for t, b in rss if start <= t < end or (i == buckets - 1 and t == end)]
        lookups = [r.lookup_ms for r in group if r.lookup_ms]
        out.append(
            {
                "t_s": round((start - t0) / 1000, 1),
                "requests": len(group),
                **{k: round(v, 4) for k, v in shares(group).items()},
                "lookup_ms_p50": round(statistics.median(lookups), 3) if lookups else None,
                "daemon_rss_mib": round(max(in_window) / 2**20, 1) if in_window else None,
            }
        )
    return out


def print_report(console: Console, result: dict[str, Any]) -> None:
    """The human view of a report (or of a sweep) on a rich console."""
    if "points" in result:
        _print_sweep(console, result)
        return
    _print_summary(console, result)
    _print_token_shares(console, result)
    console.print("paths: " + ", ".join(f"{k} {v:,}" for k, v in result["paths"].items()))
    console.print("reasons: " + ", ".join(f"{k} {v:,}" for k, v in result["reasons"].items()))
    _print_ttft(console, result["ttft"])
    _print_daemon(console, result["daemon"])
    if "cpu" in result:
        _print_cpu(console, result["cpu"])
    _print_published(console, result.get("published") or {})
    _print_over_time(console, result["over_time"])


def _table(title: str, columns: tuple[str, ...]) -> Table:
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def _print_sweep(console: Console, result: dict[str, Any]) -> None:
    keys = list(result["sweep"])
    columns = (*keys, "local", "pulled", "of it from host", "recomputed", "continuation TTFT saved")
    table = _table("kvloop bench replay --sweep", (*columns, "evicted runs", "of them to host"))
    for p in result["points"]:
        saved = p["continuation_ttft_saving_share"]
        table.add_row(
            *(f"{p[k]:g}" for k in keys),
            *(f"{p[k]:.3f}" for k in ("local_share", "pulled_share")),
            f"{p['pulled_share_by_tier']['host']:.3f}",
            f"{p['recomputed_share']:.3f}",
            "-" if saved is None else f"{saved:.1%}",
            str(p["evicted_runs"]),
            str(p["moved_to_host_runs"]),
        )
    console.print(table)
    if result.get("plot"):
        console.print(f"plot: {result['plot']}")


def _print_summary(console: Console, r: dict[str, Any]) -> None:
    replay = r["replay"]
    console.print(
        f"[bold]{r['requests']:,} requests[/bold], {r['prompt_tokens']:,} prompt tokens over "
        f"{replay['trace_span_s']:,} s of trace, replayed in {replay['wall_s']:.1f} s "
        f"({replay['requests_per_s']:,} requests/s with kvloopd on the path"
        + (", stopped early by --max-wall-s" if replay["truncated"] else "")
        + ")"
    )


def _print_token_shares(console: Console, r: dict[str, Any]) -> None:
    table = _table(
        "prompt tokens",
        ("local prefix cache", "reverse pull", "recomputed", "missed pulls (a decode had held them)"),
    )
    missed = ", ".join(f"{k} {v:,}" for k, v in r["missed_pull_tokens"].items()) or "none"
    pulled = f"{r['pulled_share']:.1%}"
    by_tier = r["pulled_share_by_tier"]
    if r["fleet"]["host_retention_blocks"] or by_tier["host"]:
        pulled += f" (device {by_tier['device']:.1%}, host memory {by_tier['host']:.1%})"
    table.add_row(
        f"{r['local_share']:.1%}",
        pulled,
        f"{r['recomputed_share']:.1%}",
        f"{r['missed_pull_share']:.1%} ({missed})",
    )
    console.print(table)


def _print_ttft(console: Console, ttft: dict[str, Any]) -> None:
    table = _table(
        f"estimated TTFT, ms ({ttft['model']['basis']})",
        ("", "requests", "without kvloop p50 / p90", "with kvloop p50 / p90", "saved (mean)"),
    )
    for name in ("continuation", "all"):
        block = ttft[name]
        if not block["requests"]:
            continue
        wo, wi = block["without_kvloop_ms"], block["with_kvloop_ms"]
        table.add_row(
            name,
            f"{block['requests']:,}",
            f"{wo['p50']:,.0f} / {wo['p90']:,.0f}",
            f"{wi['p50']:,.0f} / {wi['p90']:,.0f}",
            f"{block['saving_share_of_mean']:.1%}",
        )
    console.print(table)


def _print_daemon(console: Console, daemon: dict[str, Any]) -> None:
    lk, lag, rss = daemon["lookup_ms"], daemon["event_lag_ms"], daemon["rss_mib"]
    console.print(
        "kvloopd: Lookup (client-side, loopback) "
        + (f"p50 {lk['p50']} / p99 {lk['p99']} ms" if lk else "-")
        + "; event lag (publish -> ack) "
        + (f"p50 {lag['p50']} / p99 {lag['p99']} ms" if lag else "-")
        + "; RSS "
        + (f"{rss['start']} -> peak {rss['peak']} MiB" if rss else "-")
    )


def _print_cpu(console: Console, cpu: dict[str, Any]) -> None:
    for name in ("kvloopd", "redis"):
        figures = cpu.get(name)
        if not figures:
            continue
        by_part = figures["cpu_ms_per_request_by_part"]
        console.print(
            f"{name} CPU: {figures['cpu_ms_per_request']} ms per request "
            f"({figures['requests_per_s_per_core']} requests/s per core): "
            + ", ".join(f"{part} {ms} ms" for part, ms in by_part.items())
            + f"; {cpu['block_events_per_request']} block events per request, "
            f"{figures['ingest_us_per_block_event']} us of ingest each"
        )


def _print_published(console: Console, published: dict[str, Any]) -> None:
    if not published:
        return
    blocks = published["block_events_per_request_by_kind"]
    console.print(
        "published per request: "
        + ", ".join(
            f"{kind} {n} events" + (f" ({blocks[kind]:,} blocks)" if kind in blocks else "")
            for kind, n in published["events_per_request_by_kind"].items()
        )
    )


def _print_over_time(console: Console, over_time: list[dict[str, Any]]) -> None:
    table = _table(
        "over time", ("t (s)", "requests", "local", "pulled", "recomputed", "Lookup p50 ms", "RSS MiB")
    )
    for w in over_time:
        table.add_row(
            f"{w['t_s']:,}",
            str(w["requests"]),
            *(f"{w[k]:.3f}" for k in ("local_share", "pulled_share", "recomputed_share")),
            "-" if w["lookup_ms_p50"] is None else f"{w['lookup_ms_p50']}",
            "-" if w["daemon_rss_mib"] is None else f"{w['daemon_rss_mib']}",
        )
    console.print(table)
