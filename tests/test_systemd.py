"""systemd: the shipped units verify and rate 2.5 or better in `systemd-analyze security`, and
kvloopd, kvloop-agent and kvloop proxy speak the notification protocol (READY, WATCHDOG, STOPPING)
to a NOTIFY_SOCKET the test listens on."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloop.common.addresses import free_port
from kvloop.common.processes import supervisor
from tests.conftest import KVLOOPD
from tests.support import spawn_agent, spawn_proxy

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "daemon/systemd"
BIN = Path(KVLOOPD).parent
# (unit file, the instance name systemd-analyze loads it as)
SHIPPED = [
    ("kvloopd.service", "kvloopd.service"),
    ("kvloopd@.service", "kvloopd@replica-a.service"),
    ("kvloop-agent@.service", "kvloop-agent@decode-0.service"),
    ("kvloop-proxy.service", "kvloop-proxy.service"),
]


def test_every_unit_ships():
    assert sorted(p.name for p in UNITS.glob("*.service")) == sorted(unit for unit, _ in SHIPPED)


def _installed(tmp_path: Path, unit_file: str) -> Path:
    """The unit with ExecStart pointing at this installation (it must exist on the checking machine)."""
    text = (UNITS / unit_file).read_text().replace("/usr/local/bin/", f"{BIN}/")
    (tmp_path / unit_file).write_text(text)
    return tmp_path


@pytest.mark.parametrize(("unit_file", "instance"), SHIPPED)
def test_unit_verifies_is_notify_with_a_watchdog(tmp_path, unit_file, instance):
    folder = _installed(tmp_path, unit_file)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(folder / instance)], capture_output=True, text=True
    )
    # an unknown key is only a warning (exit 0): any line about our unit is a failure
    problems = [line for line in result.stderr.splitlines() if unit_file.split("@")[0] in line]
    assert result.returncode == 0 and not problems, result.stderr
    text = (UNITS / unit_file).read_text()
    assert re.search(r"^Type=notify$", text, re.M)
    assert re.search(r"^WatchdogSec=\d+", text, re.M)
    assert "[auth]" not in text  # kvloopd has no such table


@pytest.mark.parametrize(("unit_file", "instance"), SHIPPED)
def test_unit_exposure_is_2_5_or_better(tmp_path, unit_file, instance):
    folder = _installed(tmp_path, unit_file)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(folder / instance)],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout + result.stderr)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= 2.5, result.stdout


@dataclass
class NotifyListener:
    """A datagram socket standing in for systemd's notification socket; a thread timestamps each
    message as it arrives."""

    path: Path
    sock: socket.socket
    messages: list[tuple[float, str]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:  # closed
                return
            with self.arrived:
                self.messages.append((time.monotonic(), data.decode()))
                self.arrived.notify_all()

    def wait_for(self, line: str, count: int = 1, timeout: float = 30.0, after: float = 0.0) -> float:
        """Block until `count` messages carrying `line` arrived after `after`; the last one's time."""

        def times() -> list[float]:
            return [t for t, m in self.messages if t > after and line in m.splitlines()]

        with self.arrived:
            if not self.arrived.wait_for(lambda: len(times()) >= count, timeout):
                raise AssertionError(f"{count} x {line!r} not received in {timeout}s: {self.messages}")
            return times()[count - 1]

    def count(self, line: str, start: float, end: float) -> int:
        with self.arrived:
            return sum(1 for t, m in self.messages if start < t < end and line in m.splitlines())


@pytest.fixture
def notify_socket(tmp_path) -> Iterator[NotifyListener]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    listener = NotifyListener(path, sock)
    thread = threading.Thread(target=listener._receive, daemon=True)
    thread.start()
    yield listener
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    thread.join(5)


def _notify_env(listener: NotifyListener, watchdog_usec: int = 200_000) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLOOP_", "OTEL_", "WATCHDOG_"))}
    return {**env, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": str(watchdog_usec)}


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_kvloopd_notifies_ready_watchdog_and_stopping(tmp_path, notify_socket):
    port = free_port()
    log = tmp_path / "kvloopd.log"
    proc = supervisor().spawn(
        [KVLOOPD, "--listen", f"127.0.0.1:{port}", "--metrics-listen", "", "--log-json"],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=_notify_env(notify_socket),
    )
    try:
        notify_socket.wait_for("READY=1")
        # READY means serving: the first health check after it succeeds, no retry
        assert _health(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
        assert any(m.startswith("READY=1\nSTATUS=serving on") for _, m in notify_socket.messages)
        notify_socket.wait_for("WATCHDOG=1", count=3)
        proc.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1")
        assert proc.wait(20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kvloopd_watchdog_stops_while_its_event_loop_is_stalled(tmp_path, notify_socket, monkeypatch):
    """The pings come from the serving loop: while a callback blocks the loop, none arrive (systemd
    would kill the service after WatchdogSec); once it turns again, they resume. kvloopd runs in this
    process so the test can block its loop."""
    from kvloop.daemon.config import load_settings
    from kvloop.daemon.server import serve

    for key in [k for k in os.environ if k.startswith(("KVLOOP_", "WATCHDOG_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify_socket.path))
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms
    (tmp_path / "empty.toml").write_text("")
    monkeypatch.setenv("KVLOOP_CONFIG", str(tmp_path / "empty.toml"))  # not this machine's /etc/kvloop

    async def scenario() -> None:
        stop = asyncio.Event()
        settings = load_settings(None, listen=f"127.0.0.1:{free_port()}", metrics_listen="")
        serving = asyncio.create_task(serve(settings, stop))
        try:
            await asyncio.to_thread(notify_socket.wait_for, "READY=1")
            await asyncio.to_thread(notify_socket.wait_for, "WATCHDOG=1", 3)
            stalled_at = time.monotonic()
            threading.Event().wait(1.0)  # the stall itself: a blocking call on the event loop
            resumed_at = time.monotonic()
            # a ping already in flight when the stall began may land just after it
            assert notify_socket.count("WATCHDOG=1", stalled_at + 0.05, resumed_at) == 0
            await asyncio.to_thread(notify_socket.wait_for, "WATCHDOG=1", 2, 10.0, resumed_at)
        finally:
            stop.set()
            await serving
        await asyncio.to_thread(notify_socket.wait_for, "STOPPING=1")

    asyncio.run(scenario())


def test_agent_notifies_ready_watchdog_and_stopping(tmp_path, daemon, notify_socket):
    agent = spawn_agent(
        tmp_path, daemon.address, "m-notify", "notify-agent", free_port(), env=_notify_env(notify_socket)
    )
    log = tmp_path / "agent.log"
    try:
        notify_socket.wait_for("READY=1")
        notify_socket.wait_for("WATCHDOG=1", count=3)
        agent.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1")
        assert agent.wait(20) == 0, log.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_proxy_notifies_ready_watchdog_and_stopping(tmp_path, notify_socket):
    port = free_port()
    log = tmp_path / "proxy.log"
    proxy = spawn_proxy(tmp_path, port, env=_notify_env(notify_socket))
    try:
        notify_socket.wait_for("READY=1")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # READY means the port accepts
        notify_socket.wait_for("WATCHDOG=1", count=3)
        proxy.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1")
        assert proxy.wait(20) == 0, log.read_text()
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()


def test_notifier_is_silent_without_systemd_and_honours_watchdog_pid(monkeypatch):
    from kvloop.common.sd_notify import Notifier

    assert not Notifier({}).enabled and not Notifier({}).ready()
    # a watchdog meant for another process (a parent that exec'd us would have set our pid)
    other = Notifier({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None
    mine = Notifier({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_interval_s == 0.5
