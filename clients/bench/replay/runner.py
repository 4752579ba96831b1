"""`kvloop bench replay`: what reverse transfer would save on a given request log.

Replays a trace (Mooncake format, an OpenAI-style chat log, or a seeded synthetic one) through a real
kvloopd process started for the purpose, with a simulated fleet speaking its gRPC protocol
(`fleet`), and reports token shares, missed pulls, estimated continuation TTFT and the
daemon's figures (`report`). `run_sweep` repeats it over retention settings and plots the
saving against them.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvloop.clients.bench.common import start_daemon
from kvloop.clients.bench.cpu import CpuMeter
from kvloop.clients.bench.replay.fleet import Fleet, FleetConfig
from kvloop.clients.bench.replay.report import CostModel, build_report
from kvloop.clients.bench.replay.trace import TraceRequest
from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.common.processes import supervisor

# --sweep keys -> FleetConfig fields.
SWEEP_KEYS = {
    "lease": "lease_s",
    "memory": "retention_blocks",
    "host_memory": "host_retention_blocks",
    "prefill_cache": "prefill_cache_blocks",
    "decodes": "decodes",
    "prefills": "prefills",
}


class ReplayError(RuntimeError):
    pass


@dataclass(frozen=True)
class ReplayConfig:
    fleet: FleetConfig = field(default_factory=FleetConfig)
    cost: CostModel = field(default_factory=CostModel)
    buckets: int = 20
    # Passed to kvloopd as they are.
    daemon_args: tuple[str, ...] = ()
    # kvloopd's store: "memory", "redis" (a redis-server of the replay's own), "redis-cluster" (a
    # 3-primary Redis Cluster of its own) or a redis:// URL, whose server's CPU the report then counts
    # too (a dedicated server: all its CPU is charged).
    store: str = "memory"
    # kvloopd processes sharing the store (a shared store only): workers spread over them in turn.
    replicas: int = 1


def replay(
    requests: list[TraceRequest],
    config: ReplayConfig,
    trace: dict[str, Any],
    progress: Callable[[int], None] = lambda done: None,
) -> dict[str, Any]:
    """One replay through a fresh kvloopd; the report (see `report.build_report`)."""
    if not requests:
        raise ReplayError("the trace has no requests")
    workdir = Path(tempfile.mkdtemp(prefix="kvloop-replay-"))
    env = {
        **config.cost.daemon_env(config.fleet.kv_bytes_per_token),
        # The puller's lease margin is applied in trace time by the fleet (the fleet module's docstring).
        "KVLOOP_EXPIRY_MARGIN_S": "0",
    }
    if config.replicas > 1 and config.store == "memory":
        raise ReplayError("several kvloopd replicas need a shared store (--store redis or redis-cluster)")
    try:
        with ExitStack() as stack:
            redis_url, redis_nodes, store_env = _store(config.store, workdir, stack)
            args = config.daemon_args if redis_url is None else ("--store", redis_url, *config.daemon_args)
            daemons: list[tuple[Any, str]] = []
            stack.callback(lambda: supervisor().stop(*(daemon for daemon, _ in daemons), grace_s=10))
            for n in range(config.replicas):
                home = workdir / f"kvloopd-{n}"
                home.mkdir()
                try:
                    daemons.append(start_daemon("127.0.0.1:0", home, args, {**env, **store_env}))
                except Exception as exc:
                    log = (home / "kvloopd.log").read_text(errors="replace").strip().splitlines()[-5:]
                    raise ReplayError(f"kvloopd did not start ({exc}): " + " | ".join(log)) from None
            meter = CpuMeter([daemon.pid for daemon, _ in daemons], redis_nodes or None)
            stack.callback(meter.close)
            if meter.redis is not None:
                meter.redis.calibrate()

            async def go():
                async with AsyncExitStack() as clients:
                    replicas = [
                        (
                            await clients.enter_async_context(
                                AsyncDirectoryClient(target, timeout=60, max_message_bytes=64 * 1024 * 1024)
                            ),
                            target,
                        )
                        for _, target in daemons
                    ]
                    fleet = Fleet(config.fleet, replicas, daemons[0][0].pid, progress, meter)
                    return await fleet.run(requests)

            result = asyncio.run(go())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return build_report(result, config.fleet, config.cost, trace, config.buckets, meter, config.store)


def _store(store: str, workdir: Path, stack: ExitStack) -> tuple[str | None, list[str], dict[str, str]]:
    """kvloopd's store URL (None: in memory), the Redis servers whose CPU is charged, and the
    KVLOOP_* settings the store needs."""
    if store == "memory":
        return None, [], {}
    if store == "redis":
        from kvloop.clients.fleet.redis_local import local_redis

        url = stack.enter_context(local_redis(workdir))
        return url, [url], {}
    if store == "redis-cluster":
        from kvloop.clients.fleet.redis_local import local_redis_cluster

        cluster = stack.enter_context(local_redis_cluster(workdir, primaries=3, replicas=0))
        nodes = [f"redis://127.0.0.1:{port}/0" for port in cluster.ports]
        return cluster.url, nodes, {"KVLOOP_STORE__CLUSTER": "true"}
    if store.startswith(("redis://", "rediss://", "unix://")):
        return store, [store], {}
    raise ReplayError(f"store must be memory, redis, redis-cluster or a redis:// URL, got {store!r}")


def parse_sweep(specs: Sequence[str]) -> dict[str, list[float]]:
    """``lease=60,300,memory=20000,80000`` (or one key per --sweep) -> {"lease": [...], ...}."""
    grid: dict[str, list[float]] = {}
    key: str | None = None
    for spec in specs:
        for token in spec.replace(";", ",").split(","):
            token = token.strip()
            if not token:
                continue
            if "=" in token:
                key, _, token = token.partition("=")
                key = key.strip()
                if key not in SWEEP_KEYS:
                    raise ValueError(f"unknown sweep key {key!r}: {', '.join(SWEEP_KEYS)}")
                if key in grid:
                    raise ValueError(f"sweep key {key!r} given twice")
                grid[key] = []
            if key is None:
                raise ValueError(f"sweep value {token!r} before any key=")
            try:
                value = float(token)
            except ValueError:
                raise ValueError(f"sweep {key}: {token!r} is not a number") from None
            if value < 0:
                raise ValueError(f"sweep {key}: {token} must not be negative")
            grid[key].append(value)
    for k, values in grid.items():
        if not values:
            raise ValueError(f"sweep key {k!r} has no values")
    return grid


def sweep(
    requests: list[TraceRequest],
    config: ReplayConfig,
    trace: dict[str, Any],
    grid: dict[str, list[float]],
    png: Path | None,
    progress: Callable[[str, int], None] = lambda label, done: None,
) -> dict[str, Any]:
    """The replay at every point of the grid; a PNG of the saving against the first key, one line
    per value of the others (the pulled share's part from host memory dashed, where there is one)."""
    keys = list(grid)
    points = []
    for values in itertools.product(*(grid[k] for k in keys)):
        setting = dict(zip(keys, values, strict=True))
        fleet = replace(
            config.fleet,
            **{SWEEP_KEYS[k]: (v if k == "lease" else int(v)) for k, v in setting.items()},
        )
        label = ", ".join(f"{k}={v:g}" for k, v in setting.items())

        def point_progress(done: int, label: str = label) -> None:
            progress(label, done)

        report = replay(requests, replace(config, fleet=fleet), trace, point_progress)
        cont = report["ttft"]["continuation"]
        points.append(
            {
                **setting,
                "local_share": report["local_share"],
                "pulled_share": report["pulled_share"],
                "pulled_share_by_tier": report["pulled_share_by_tier"],
                "recomputed_share": report["recomputed_share"],
                "continuation_requests": cont["requests"],
                "continuation_ttft_saving_share": cont.get("saving_share_of_mean"),
                "missed_pull_tokens": report["missed_pull_tokens"],
                "evicted_runs": sum(d["evicted_runs"] for d in report["decodes"].values()),
                "moved_to_host_runs": sum(d["moved_to_host_runs"] for d in report["decodes"].values()),
                "lookup_ms_p50": (report["daemon"]["lookup_ms"] or {}).get("p50"),
                "daemon_cpu_ms_per_request": report.get("daemon_cpu_ms_per_request"),
                "daemon_rss_mib_peak": (report["daemon"]["rss_mib"] or {}).get("peak"),
                "replay_requests_per_s": report["replay"]["requests_per_s"],
            }
        )
    out: dict[str, Any] = {"sweep": grid, "points": points}
    if png is not None:
        out["plot"] = str(plot_sweep(points, keys, png))
    return out


def plot_sweep(points: list[dict[str, Any]], keys: list[str], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, others = keys[0], keys[1:]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines: dict[tuple, list[dict[str, Any]]] = {}
    for p in points:
        lines.setdefault(tuple(p[k] for k in others), []).append(p)
    for series, ps in lines.items():
        ps.sort(key=lambda p: p[x_key])
        label = ", ".join(f"{k}={v:g}" for k, v in zip(others, series, strict=True)) or None
        xs = [p[x_key] for p in ps]
        (line,) = axes[0].plot(xs, [p["pulled_share"] for p in ps], marker="o", label=label)
        host = [p["pulled_share_by_tier"]["host"] for p in ps]
        if any(host):
            axes[0].plot(xs, host, linestyle="--", marker=".", color=line.get_color())
        axes[1].plot(xs, [p["continuation_ttft_saving_share"] or 0.0 for p in ps], marker="o", label=label)
    unit = {
        "lease": "lease (s)",
        "memory": "retention memory per decode (blocks)",
        "host_memory": "host retention memory per decode (blocks)",
    }.get(x_key, x_key)
    axes[0].set(
        xlabel=unit,
        ylabel="share of prompt tokens pulled",
        title="prompt tokens served by reverse pull (dashed: from host memory)",
    )
    axes[1].set(
        xlabel=unit, ylabel="1 - TTFT with / without (mean)", title="continuation TTFT saved (cost model)"
    )
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if others:
            ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
