"""A throwaway redis-server on loopback (tests, benchmarks): no persistence, killed on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
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
def local_redis(workdir: Path, timeout_s: float = 10.0, port: int | None = None) -> Iterator[str]:
    """Start ``redis-server`` on a loopback port (a free one by default); yields its ``redis://`` URL."""
    port = port or free_port()
    log_path = workdir / f"redis-{port}.log"
    process = supervisor().spawn(
        [
            redis_server_binary(),
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
