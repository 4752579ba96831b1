"""A throwaway redis-server on loopback (tests, benchmarks): no persistence, killed on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
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


@dataclass
class LocalCluster:
    """A Redis Cluster on loopback: ``url`` names one node (a cluster client finds the rest)."""

    url: str
    ports: list[int]

    def roles(self, asked: int | None = None) -> dict[int, str]:
        """Each connected node's role ("master", "slave"), as a running node reports them."""
        return _roles(asked or self.ports[-1])

    def stop_node(self, port: int) -> None:
        """Shut one node down without saving (its process ends as after a crash of its host)."""
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=10)


def _roles(port: int) -> dict[int, str]:
    """Each connected node's role, as CLUSTER NODES on ``port`` reports them."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "cluster", "nodes"], capture_output=True, text=True, timeout=10
    ).stdout
    roles = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 7 and "fail" not in fields[2] and fields[7] == "connected":
            roles[int(fields[1].split("@")[0].rsplit(":", 1)[1])] = (
                "master" if "master" in fields[2] else "slave"
            )
    return roles


def _cluster_ok(port: int) -> bool:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=10
    ).stdout
    return "cluster_state:ok" in out


@contextmanager
def local_redis_cluster(
    workdir: Path, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000, timeout_s: float = 30.0
) -> Iterator[LocalCluster]:
    """Start ``primaries * (1 + replicas)`` cluster-enabled redis-servers on loopback and join them with
    ``redis-cli --cluster create``; yields the cluster once every node reports it ok."""
    if shutil.which("redis-cli") is None:
        raise FileNotFoundError("redis-cli is not on PATH (Debian/Ubuntu: apt-get install redis-tools)")
    # a node listens on its port and on port + 10000 (the cluster bus)
    ports = [free_port(also=10000) for _ in range(primaries * (1 + replicas))]
    with ExitStack() as stack:
        cluster = LocalCluster(f"redis://127.0.0.1:{ports[0]}/0", ports)
        for port in ports:
            extra = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(workdir / f"nodes-{port}.conf"),
                "--cluster-node-timeout",
                str(node_timeout_ms),
            )
            stack.enter_context(local_redis(workdir, port=port, extra=extra))
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while not all(_cluster_ok(p) for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)  # polling a condition (CLUSTER INFO), not synchronising on time
        yield cluster
