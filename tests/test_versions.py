"""Versions everywhere: --version on the three commands, kvloop_build_info on every /metrics, the
release in GetStats and in a worker's registration (agents of another release are logged and
counted), and the protocol checked by `buf breaking` against the last released copy."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient
from kvloop.common.addresses import free_port
from tests.conftest import KVLOOPD
from tests.support import running_agent, spawn_agent, spawn_proxy, wait_until

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(KVLOOPD).parent
VERSION = metadata.version("kvloop")


@pytest.mark.parametrize("command", ["kvloopd", "kvloop", "kvloop-agent"])
def test_version_flag(command):
    result = subprocess.run([str(BIN / command), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{command} {VERSION} (protocol kvloop.v1, Python 3.")


def _build_info(url: str) -> dict[str, str] | None:
    try:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith("kvloop_build_info{"):
            labels = line[len("kvloop_build_info{") : line.rindex("}")]
            return dict((k, v.strip('"')) for k, v in (p.split("=", 1) for p in labels.split('",')))
    raise AssertionError(f"no kvloop_build_info at {url}")


async def test_kvloopd_reports_its_release_and_its_agents(daemon_factory):
    proc = daemon_factory()
    info = _build_info(f"http://{proc.metrics_address}/metrics")
    assert info is not None
    assert info["version"] == VERSION and info["component"] == "kvloopd" and info["protocol"] == "kvloop.v1"
    async with AsyncDirectoryClient(proc.address) as client:
        async with running_agent(client, "same-release", "m-versions", agent_version=VERSION):
            async with running_agent(client, "older-release", "m-versions", agent_version="0.0.9"):
                async with running_agent(client, "unversioned", "m-versions"):
                    stats = await client.stats()
                    workers = {w.registration.worker_id: w for w in await client.list_workers("m-versions")}
    assert stats.version == VERSION
    assert dict(stats.agent_versions) == {VERSION: 1, "0.0.9": 1, "": 1}
    assert workers["older-release"].registration.agent_version == "0.0.9"
    lines = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
    other = [e for e in lines if e.get("event") == "agent of another kvloop release"]
    assert sorted(e["worker_id"] for e in other) == ["older-release", "unversioned"]
    assert other[0]["kvloopd_version"] == VERSION
    body = urllib.request.urlopen(f"http://{proc.metrics_address}/metrics").read().decode()
    assert 'kvloop_agent_registrations_total{version="0.0.9"} 1.0' in body
    assert 'kvloop_agent_registrations_total{version="unknown"} 1.0' in body


def test_cli_stats_shows_the_release(daemon):
    result = subprocess.run(
        [str(BIN / "kvloop"), "--daemon", daemon.address, "--json", "stats"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["version"] == VERSION


def test_agent_registers_its_release_and_publishes_build_info(tmp_path, daemon):
    port = free_port()
    agent = spawn_agent(tmp_path, daemon.address, "m-agent-version", "versioned-agent", port)
    try:
        info = wait_until(
            lambda: _build_info(f"http://127.0.0.1:{port}/metrics"), what="the agent's /metrics"
        )
        assert info["version"] == VERSION and info["component"] == "kvloop-agent"

        def registered():
            with DirectoryClient(daemon.address) as client:
                found = [w for w in client.list_workers("m-agent-version") if w.connected]
            return found[0] if found else None

        worker = wait_until(registered, what="the agent's registration")
        assert worker.registration.agent_version == VERSION
    finally:
        agent.terminate()
        assert agent.wait(15) == 0, (tmp_path / "agent.log").read_text()


def test_proxy_publishes_build_info(tmp_path):
    port = free_port()
    proxy = spawn_proxy(tmp_path, port)
    try:
        info = wait_until(
            lambda: _build_info(f"http://127.0.0.1:{port}/metrics"), what="the proxy's /metrics"
        )
        assert info["version"] == VERSION and info["component"] == "kvloop-proxy"
    finally:
        proxy.terminate()
        assert proxy.wait(15) == 0


def _buf_breaking(proto: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "buf"), "breaking", "--against", str(ROOT / "proto-released/0.1.0")],
        cwd=proto,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_buf_breaking_against_the_released_protocol_runs_in_lint_and_catches_a_break(tmp_path):
    assert "buf breaking --against ../proto-released/$(PROTOCOL_RELEASE)" in (ROOT / "Makefile").read_text()
    assert "PROTOCOL_RELEASE := 0.1.0" in (ROOT / "Makefile").read_text()
    proto = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", proto, ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    assert _buf_breaking(proto).returncode == 0
    source = proto / "kvloop/v1/directory.proto"
    text = source.read_text()
    assert "  uint32 block_size = 6;" in text
    source.write_text(text.replace("  uint32 block_size = 6;", "  uint64 block_size = 6;", 1))
    broken = _buf_breaking(proto)
    assert broken.returncode != 0
    assert 'changed type from "uint32" to "uint64"' in broken.stdout + broken.stderr
