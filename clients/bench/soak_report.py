"""What `kvloop bench soak` reports besides the directory's verdict: its throughput, event lag and
Lookup latency as the fleet measured them, kvloopd's (and a local redis-server's) CPU and memory over
the run, and what kvloopd logged at warning level or above."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from kvloop.clients.bench.common import percentile

if TYPE_CHECKING:
    from kvloop.clients.bench.soak import SoakConfig


class ProcessWatch:
    """kvloopd's (and a local redis-server's) CPU time and resident memory during the soak."""

    def __init__(self, daemon_pid: int, store_url: str) -> None:
        self.processes = {"kvloopd": psutil.Process(daemon_pid)}
        redis_pid = _redis_pid(store_url) if store_url != "memory" else None
        if redis_pid is not None:
            self.processes["redis-server"] = psutil.Process(redis_pid)
        self._cpu0 = {name: p.cpu_times() for name, p in self.processes.items()}
        self.rss: dict[str, list[tuple[float, float]]] = {name: [] for name in self.processes}

    def sample_rss(self, elapsed_s: float) -> None:
        for name, p in self.processes.items():
            self.rss[name].append((round(elapsed_s, 2), p.memory_info().rss / 2**20))

    def cpu_percent(self, wall: float) -> dict[str, float]:
        """Each process's CPU time (user + system) since this watch began, in % of one core."""
        return {
            name: round((sum(p.cpu_times()[:2]) - sum(self._cpu0[name][:2])) / wall * 100, 1)
            for name, p in self.processes.items()
        }


@dataclass
class SoakOutcome:
    """What the fleet's processes reported once their soak ended."""

    results: list[dict]
    wall: float
    cpu: dict[str, float]
    sent: int
    lookups: int

    @property
    def agents_done(self) -> list[dict]:
        return [r for r in self.results if "expected" in r]

    @property
    def lookups_done(self) -> list[dict]:
        return [r for r in self.results if "lookup_ms" in r]


def _redis_pid(url: str) -> int | None:
    port = url.rsplit(":", 1)[-1].split("/")[0]
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name() == "redis-server" and any(port in arg for arg in proc.cmdline()):
                return proc.pid
        except psutil.Error:
            continue
    return None


def _growth(samples: list[tuple[float, float]]) -> float | None:
    """Resident memory growth over the last half of the run, in % of its value at half time."""
    if len(samples) < 4:
        return None
    end = samples[-1][0]
    half = [rss for t, rss in samples if t >= end / 2]
    return round((max(half) - half[0]) / half[0] * 100, 2)


def build_report(
    config: SoakConfig,
    store_url: str,
    outcome: SoakOutcome,
    verdict: dict,
    rss: dict[str, list[tuple[float, float]]],
    workdir: Path,
) -> dict:
    agents_done, lookups_done, wall = outcome.agents_done, outcome.lookups_done, outcome.wall
    counts: Counter[str] = Counter()
    for r in agents_done:
        counts.update(r["counts"])
    lags = sorted(x for r in lookups_done for x in r["lags_ms"])
    lookup_ms = sorted(x for r in lookups_done for x in r["lookup_ms"])
    events = sum(r["events_sent"] for r in agents_done)
    return {
        "lost_events": verdict["lost_events"],
        "phantom_entries": verdict["phantom_entries"],
        "store": "memory" if store_url == "memory" else "redis",
        "config": asdict(config),
        "wall_s": round(wall, 2),
        "events_sent": events,
        "events_per_s": round(events / wall),
        "batches_sent": sum(r["batches_sent"] for r in agents_done),
        "faults_and_events": dict(sorted(counts.items())),
        "entries_expected": verdict["entries_expected"],
        "entries_found": verdict["entries_found"],
        "count_mismatches": verdict["count_mismatches"],
        "lost_samples": verdict["lost_samples"],
        "phantom_samples": verdict["phantom_samples"],
        "unacked_links": [u for r in agents_done for u in r["unacked"]],
        "event_lag_samples": len(lags),
        "event_lag_p50_ms": round(percentile(lags, 0.5), 2) if lags else None,
        "event_lag_p99_ms": round(percentile(lags, 0.99), 2) if lags else None,
        "probes_not_seen_in_30s": sum(r["probes_unseen"] for r in lookups_done),
        "probes_skipped_busy": sum(r["probes_skipped"] for r in lookups_done),
        "lookups": len(lookup_ms),
        "lookups_per_s": round(len(lookup_ms) / wall),
        "lookup_p50_ms": round(percentile(lookup_ms, 0.5), 2) if lookup_ms else None,
        "lookup_p99_ms": round(percentile(lookup_ms, 0.99), 2) if lookup_ms else None,
        "lookup_errors": dict(sum((Counter(r["lookup_errors"]) for r in lookups_done), Counter())),
        "cpu_percent_of_one_core": outcome.cpu,
        "rss_mib": {name: [(t, round(m, 1)) for t, m in samples] for name, samples in rss.items()},
        "rss_growth_last_half_percent": {name: _growth(samples) for name, samples in rss.items()},
        **_daemon_log_figures(workdir / "kvloopd.log"),
        "cpu_count": psutil.cpu_count(),
    }


def _daemon_log_figures(path: Path) -> dict:
    """kvloopd's errors and warnings over the soak: counts by event, and a few lines of each."""
    log_lines = path.read_text().splitlines()
    log_errors = [line for line in log_lines if '"level": "error"' in line]
    warnings: Counter[str] = Counter()
    warning_samples: dict[str, str] = {}
    for line in log_lines:
        if '"level": "warning"' in line:
            try:
                what = json.loads(line).get("event", "?")
            except json.JSONDecodeError:
                what = line[:80]
            warnings[what] += 1
            warning_samples.setdefault(what, line[:600])
    return {
        "daemon_errors_logged": len(log_errors),
        "daemon_warnings_logged": dict(warnings.most_common()),
        "daemon_warning_samples": list(warning_samples.values())[:5],
        "daemon_error_samples": log_errors[:5],
    }
