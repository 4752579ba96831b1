"""CPU time of the processes a benchmark drives, read between two points of the benchmark so that each
stretch (a Lookup, a Route, the ingest between them) is charged what it cost.

* kvloopd: the sum of its threads' run time from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, the
  scheduler's own accounting). ``/proc/<pid>/stat`` counts 10 ms ticks, coarser than one Lookup.
* Redis: ``INFO cpu`` (``used_cpu_sys`` + ``used_cpu_user``, microseconds, the whole server process).
  Asking costs the server a little CPU itself; :meth:`RedisCpu.calibrate` measures how much, so a
  stretch between two readings can be charged without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class ProcessCpu:
    """Run time of every thread of one process, in seconds."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._tasks = f"/proc/{pid}/task"

    def seconds(self) -> float:
        total = 0
        try:
            tids = os.listdir(self._tasks)
        except OSError:
            return float("nan")  # gone
        for tid in tids:
            try:
                with open(f"{self._tasks}/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended between the listing and the read
        # Threads that ended took their time with them from the listing; the process-wide counter in
        # /proc/<pid>/stat keeps it. Use it when it is ahead (ticks are coarse but never lose time).
        return max(total / 1e9, _stat_seconds(self.pid))


def _stat_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])  # incl. reaped children
    return ticks / os.sysconf("SC_CLK_TCK")


class RedisCpu:
    """CPU seconds of Redis servers (every node of a cluster, summed), from ``INFO cpu``."""

    def __init__(self, url: str | Sequence[str]) -> None:
        import redis

        urls = [url] if isinstance(url, str) else list(url)
        self._clients: list[Any] = [redis.Redis.from_url(u) for u in urls]
        self.per_reading_s = 0.0

    def seconds(self) -> float:
        return sum(self.node_seconds())

    def node_seconds(self) -> list[float]:
        """Each server's own CPU seconds (a cluster's nodes: how evenly its shards share the work)."""
        out = []
        for client in self._clients:
            info = client.info("cpu")
            out.append(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]))
        return out

    def calibrate(self, readings: int = 300) -> float:
        """The server's CPU per reading (one ``INFO cpu``): measured over ``readings`` back to back."""
        start = self.seconds()
        for _ in range(readings):
            self.seconds()
        self.per_reading_s = max(0.0, (self.seconds() - start) / (readings + 1))
        return self.per_reading_s

    def close(self) -> None:
        for client in self._clients:
            client.close()


@dataclass
class CpuSplit:
    """Seconds of CPU charged to each kind of work, for one process."""

    total: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def charge(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds


class CpuMeter:
    """kvloopd's (and optionally Redis's) CPU, read at the edges of the stretches a replay measures.

    ``start()`` and ``stop()`` bound the whole run; ``window(part)`` returns a context whose stretch
    is charged to ``part``. Whatever is not inside a window is the remainder (see :func:`per_request`)."""

    def __init__(self, daemon_pid: int | Sequence[int], redis_url: str | Sequence[str] | None = None) -> None:
        # several kvloopd replicas (and a cluster's nodes) are charged together
        self.daemons = [
            ProcessCpu(pid) for pid in ([daemon_pid] if isinstance(daemon_pid, int) else daemon_pid)
        ]
        self.redis = RedisCpu(redis_url) if redis_url else None
        self.daemon_split = CpuSplit()
        self.redis_split = CpuSplit() if self.redis else None
        self._start: tuple[float, float] | None = None
        self._readings = 0  # Redis readings taken between start and stop (their cost is subtracted)
        self._nodes: list[float] = []  # each Redis server's CPU at the last reading
        self._nodes_start: list[float] = []
        self.redis_node_s: list[float] = []  # each Redis server's CPU over the run (stop() fills it)

    def _read(self) -> tuple[float, float]:
        if self.redis is not None:
            self._nodes = self.redis.node_seconds()
            self._readings += 1
        return sum(daemon.seconds() for daemon in self.daemons), sum(self._nodes)

    def start(self) -> None:
        self._readings = 0
        self._start = self._read()
        self._nodes_start = self._nodes

    def stop(self) -> None:
        assert self._start is not None, "stop() before start()"
        end = self._read()
        self.redis_node_s = [b - a for a, b in zip(self._nodes_start, self._nodes, strict=True)]
        self.daemon_split.total = end[0] - self._start[0]
        if self.redis_split is not None and self.redis is not None:
            # every reading inside the run cost the server about per_reading_s; none is the product's
            self.redis_split.total = end[1] - self._start[1] - (self._readings - 1) * self.redis.per_reading_s

    def window(self, part: str) -> _Window:
        return _Window(self, part)

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()


class _Window:
    def __init__(self, meter: CpuMeter, part: str) -> None:
        self.meter, self.part = meter, part
        self._begin = (0.0, 0.0)

    def __enter__(self) -> _Window:
        self._begin = self.meter._read()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self.meter._read()
        meter = self.meter
        meter.daemon_split.charge(self.part, end[0] - self._begin[0])
        if meter.redis_split is not None and meter.redis is not None:
            # a window holds about one reading's cost: the end of the first and the start of the last
            meter.redis_split.charge(self.part, end[1] - self._begin[1] - meter.redis.per_reading_s)


def per_request(split: CpuSplit, requests: int, rest: str = "rest") -> dict[str, Any]:
    """The split as milliseconds per request and the requests/s one core of it would sustain; the
    time outside every window is charged to ``rest``."""
    if requests <= 0:
        return {}
    parts = {rest: split.total - sum(split.parts.values()), **split.parts}
    ms = {name: round(seconds / requests * 1000, 4) for name, seconds in parts.items()}
    total_ms = split.total / requests * 1000
    return {
        "cpu_s": round(split.total, 3),
        "cpu_ms_per_request": round(total_ms, 4),
        "cpu_ms_per_request_by_part": ms,
        "requests_per_s_per_core": round(1000 / total_ms, 1) if total_ms > 0 else None,
        "requests_per_s_per_core_by_part": {
            name: (round(1000 / v, 1) if v > 0 else None) for name, v in ms.items()
        },
    }
