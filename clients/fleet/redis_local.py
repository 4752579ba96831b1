"""A throwaway redis-server on loopback (tests, benchmarks): no persistence, killed on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvloop.common.addresses import free_port
from kvloop.common.processes import supervisor


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError(
            "redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server; any Redis >= 7.0 "
            "or Valkey works)"
        )
    return found


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def local_redis(
    workdir: Path, timeout_s: float = 10.0, port: int | None = None, extra: Sequence[str] = ()
) -> Iterator[str]:
    """Start ``redis-server`` on a loopback port (a free one by default); yields its ``redis://`` URL.
    ``extra``: more server options (``--replicaof 127.0.0.1 PORT``)."""
    port = port or free_port()
    log_path = workdir / f"redis-{port}.log"
    process = supervisor().spawn(
        [
            redis_server_binary(),
            *extra,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{log_path.read_text()}")
            time.sleep(0.02)  # polling a condition (PING), not synchronising on time
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        supervisor().stop(process, grace_s=5)


@contextmanager
def local_sentinel(
    workdir: Path,
    master_port: int,
    master: str = "kvloop",
    down_after_ms: int = 1000,
    timeout_s: float = 10.0,
    quorum: int = 1,
) -> Iterator[str]:
    """Start one ``redis-sentinel`` watching the primary on ``master_port`` (``quorum`` sentinels must
    agree it is down); yields its HOST:PORT. Sentinel rewrites its config file, so each gets its own."""
    port = free_port()
    config = workdir / f"sentinel-{port}.conf"
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
        f"sentinel monitor {master} 127.0.0.1 {master_port} {quorum}\n"
        f"sentinel down-after-milliseconds {master} {down_after_ms}\n"
        f"sentinel failover-timeout {master} {max(3 * down_after_ms, 3000)}\n"
    )
    binary = shutil.which("redis-sentinel")
    if binary is None:
        raise FileNotFoundError(
            "redis-sentinel is not on PATH (Debian/Ubuntu: apt-get install redis-sentinel)"
        )
    log_path = workdir / f"sentinel-{port}.log"
    process = supervisor().spawn([binary, str(config)], stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-sentinel did not start:\n{log_path.read_text()}")
            time.sleep(0.02)  # polling a condition (PING), not synchronising on time
        yield f"127.0.0.1:{port}"
    finally:
        supervisor().stop(process, grace_s=5)
