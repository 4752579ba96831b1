"""Helpers the benchmarks share: a kvloopd of their own, percentiles, and a process's memory and CPU
time read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvloop.clients.directory_client import DaemonUnavailable, DirectoryClient
from kvloop.common.addresses import free_port
from kvloop.common.processes import supervisor

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_daemon(
    listen: str, workdir: Path, extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """A kvloopd of the bench's own (`extra_args`: more flags, e.g. a store option; `extra_env`:
    KVLOOP_* settings), ready to answer."""
    host, _, port = listen.rpartition(":")
    if port == "0":
        listen = f"{host}:{free_port()}"
    kvloopd = str(Path(sys.executable).parent / "kvloopd")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLOOP_", "OTEL_"))}
    env["KVLOOP_MAX_ENTRIES"] = "100000000"
    env.update(extra_env or {})
    with (workdir / "kvloopd.log").open("w") as log:
        process = supervisor().spawn(
            [kvloopd, "--listen", listen, "--metrics-listen", "", "--log-json", *extra_args],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
        )
    with DirectoryClient(listen, timeout=2) as client:
        for attempt in range(30):
            try:
                client.wait_ready(1)
                break
            except DaemonUnavailable:
                if process.poll() is not None:  # refused its flags or config: say so now
                    raise RuntimeError(f"kvloopd exited with status {process.returncode}") from None
                if attempt == 29:
                    raise
    return process, listen


def ticks(pid: int) -> int | None:
    """utime + stime of the process (all its threads), in clock ticks; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])
