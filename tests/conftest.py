"""Shared fixtures: real kvloopd processes on loopback (no gRPC mocks).

Fixtures start processes through kvloop.common.processes (`supervisor().spawn`), like the commands
do: if pytest dies (SIGTERM, SIGHUP, SIGKILL) nothing it started keeps running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloop.common.addresses import free_port
from kvloop.common.processes import supervisor
from tests.store_backends import redis_cluster_url, redis_url  # noqa: F401  (session fixtures shared by store tests)

KVLOOPD = str(Path(sys.executable).parent / "kvloopd")  # this environment's, whatever PATH says


@dataclass
class DaemonProcess:
    address: str
    metrics_address: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        return self.process.returncode


def wait_serving(
    address: str,
    process: subprocess.Popen,
    log_path: Path,
    timeout: float = 20.0,
    credentials: grpc.ChannelCredentials | None = None,
    override: str | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    options = [("grpc.ssl_target_name_override", override)] if override else []
    channel = (
        grpc.secure_channel(address, credentials, options=options)
        if credentials
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"kvloopd exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                time.sleep(0.05)  # polling a condition (health), not synchronising on time
    raise TimeoutError(f"kvloopd at {address} not serving after {timeout}s:\n{log_path.read_text()}")


def start_daemon(
    tmp: Path,
    *args: str,
    env: dict[str, str] | None = None,
    wait: bool = True,
    port: int | None = None,
    **wait_kwargs,
) -> DaemonProcess:
    port, metrics_port = port or free_port(), free_port()
    if os.environ.get("KVLOOP_TEST_STORE"):  # run the daemon suites on a shared store: redis://...
        args = ("--store", os.environ["KVLOOP_TEST_STORE"], *args)
    log_path = tmp / f"kvloopd-{port}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLOOP_", "OTEL_"))}
    full_env.update(env or {})
    process = supervisor().spawn(
        [
            KVLOOPD,
            "--listen",
            f"127.0.0.1:{port}",
            "--metrics-listen",
            f"127.0.0.1:{metrics_port}",
            "--log-json",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("w"),
        env=full_env,
    )
    daemon = DaemonProcess(f"127.0.0.1:{port}", f"127.0.0.1:{metrics_port}", process, log_path)
    if wait:
        wait_serving(daemon.address, process, log_path, **wait_kwargs)
    return daemon


@pytest.fixture(scope="session")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    """One shared kvloopd for tests that only add their own workers and models."""
    proc = start_daemon(
        tmp_path_factory.mktemp("daemon"), env={"KVLOOP_LEASE_S": "5", "KVLOOP_HEARTBEAT_INTERVAL_S": "0.5"}
    )
    yield proc
    proc.stop()


@pytest.fixture
def daemon_factory(tmp_path) -> Iterator:
    started: list[DaemonProcess] = []

    def factory(*args: str, **kwargs) -> DaemonProcess:
        proc = start_daemon(tmp_path, *args, **kwargs)
        started.append(proc)
        return proc

    yield factory
    for proc in started:
        proc.stop()


@dataclass
class OtlpReceiver:
    endpoint: str
    spans_path: Path

    def spans(self) -> list[dict]:
        import json

        if not self.spans_path.exists():
            return []
        return [json.loads(line) for line in self.spans_path.read_text().splitlines() if line]

    def wait_for(self, predicate, timeout: float = 20.0) -> list[dict]:
        """Poll the receiver's file until a received span satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.spans() if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no matching span received within {timeout}s; got {self.spans()}")


@pytest.fixture(scope="session")
def otlp_receiver(tmp_path_factory) -> Iterator[OtlpReceiver]:
    """A real OTLP/gRPC receiver process."""
    port = free_port()
    path = tmp_path_factory.mktemp("otlp") / "spans.jsonl"
    process = supervisor().spawn(
        [sys.executable, "-m", "kvloop.common.otlp_receiver", str(port), str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert process.stdout.readline().strip() == "ready"
    yield OtlpReceiver(f"http://127.0.0.1:{port}", path)
    process.terminate()
    process.wait(10)
