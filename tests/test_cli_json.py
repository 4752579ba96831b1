"""A CLI scripts can trust: with --json every answer and every error is JSON on stdout, 64-bit
counters are numbers, and the exit status says what went wrong (usage 2, unreachable 3, not found
4, refused 5, anything else 1)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

from kvloop.clients.cli.output import ExitCode
from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient
from kvloop.common.addresses import free_port
from tests.conftest import KVLOOPD, start_daemon
from tests.support import conversation, retained, running_agent

BIN = Path(KVLOOPD).parent


def kvloop(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOP_")}
    return subprocess.run(
        [str(BIN / "kvloop"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "COLUMNS": "200"},
    )


def _error(result: subprocess.CompletedProcess) -> dict:
    """The one JSON error object a --json run prints, and nothing on stderr."""
    assert result.stderr == "", result.stderr
    [line] = result.stdout.splitlines()
    error = json.loads(line)["error"]
    assert error["exit_code"] == result.returncode
    return error


def test_exit_codes_are_documented():
    text = (Path(__file__).resolve().parent.parent / "docs/operations.md").read_text()
    for code in ExitCode:
        assert f"| {code.value} |" in text, code


async def test_counters_are_numbers(daemon):
    model = "m-cli-json"
    prompt = conversation("cli-json", 3)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "cli-json-decode", model, retained(prompt, "h-cli")):
            with DirectoryClient(daemon.address) as sync:
                sync.lookup(model, prompt)
            stats, workers, lookup = await asyncio.gather(
                asyncio.to_thread(kvloop, "--daemon", daemon.address, "--json", "stats"),
                asyncio.to_thread(kvloop, "--daemon", daemon.address, "workers", "--model", model, "--json"),
                asyncio.to_thread(
                    kvloop,
                    "--daemon",
                    daemon.address,
                    "--json",
                    "lookup",
                    "--model",
                    model,
                    *[h.hex() for h in prompt],
                ),
            )
    assert stats.returncode == 0, stats.stderr
    answer = json.loads(stats.stdout)
    assert isinstance(answer["lookups"], int) and answer["lookups"] >= 1
    assert isinstance(answer["entries"], int) and isinstance(answer["max_entries"], int)
    assert all(isinstance(v, int) for v in answer["decisions"].values()) and answer["decisions"]
    assert isinstance(answer["uptime_seconds"], float)
    assert workers.returncode == 0, workers.stderr
    [worker] = json.loads(workers.stdout)
    assert isinstance(worker["retained_blocks"], int) and worker["retained_blocks"] == 3
    assert isinstance(worker["registration"]["epoch"], int)
    assert isinstance(worker["registration"]["kv_bytes_per_block"], int)
    assert lookup.returncode == 0, lookup.stderr
    looked = json.loads(lookup.stdout)
    assert isinstance(looked["lookup_us"], int)
    assert looked["matched_blocks"] == 3
    assert isinstance(looked["cost"]["transfer_bytes"], int) and looked["cost"]["transfer_bytes"] > 0
    assert isinstance(looked["holder"]["epoch"], int) and isinstance(looked["holder"]["expires_in_ms"], int)


def test_unreachable_daemon_exits_3_with_the_grpc_status():
    address = f"127.0.0.1:{free_port()}"
    result = kvloop("--daemon", address, "--timeout", "2", "--json", "workers")
    assert result.returncode == ExitCode.UNREACHABLE
    error = _error(result)
    assert error["status"] == "UNAVAILABLE"
    assert error["message"].startswith(f"cannot reach kvloopd at {address}")
    plain = kvloop("--daemon", address, "--timeout", "2", "workers")
    assert plain.returncode == ExitCode.UNREACHABLE and plain.stdout == ""
    assert f"cannot reach kvloopd at {address}" in plain.stderr and "Traceback" not in plain.stderr


def test_not_found_exits_4(daemon):
    result = kvloop("--daemon", daemon.address, "--json", "drain", "nobody-at-all")
    assert result.returncode == ExitCode.NOT_FOUND
    error = _error(result)
    assert error["status"] == "NOT_FOUND" and "nobody-at-all" in error["message"]


def test_refused_exits_5(tmp_path):
    config = tmp_path / "kvloopd.toml"
    config.write_text('[[tokens]]\ntoken = "read-token-0123456789"\nrole = "read"\n')
    proc = start_daemon(tmp_path, "--config", str(config))
    try:
        unknown = kvloop("--daemon", proc.address, "--token", "wrong-token-0123456789", "--json", "stats")
        assert unknown.returncode == ExitCode.REFUSED
        assert _error(unknown)["status"] == "UNAUTHENTICATED"
        reader = kvloop("--daemon", proc.address, "--token", "read-token-0123456789", "--json", "drain", "w")
        assert reader.returncode == ExitCode.REFUSED
        assert _error(reader)["status"] == "PERMISSION_DENIED"
        allowed = kvloop("--daemon", proc.address, "--token", "read-token-0123456789", "--json", "stats")
        assert allowed.returncode == 0 and json.loads(allowed.stdout)["workers"] == 0
    finally:
        proc.stop()


def test_usage_errors_exit_2_and_are_json_with_json():
    unknown = kvloop("--json", "workers", "--no-such-option")
    assert unknown.returncode == ExitCode.USAGE
    assert "No such option: --no-such-option" in _error(unknown)["message"]
    bad_hash = kvloop("lookup", "--model", "m", "not-hex", "--json")
    assert bad_hash.returncode == ExitCode.USAGE
    assert _error(bad_hash)["message"] == "block hash must be hex, got 'not-hex'"
    plain = kvloop("workers", "--no-such-option")
    assert plain.returncode == ExitCode.USAGE and "No such option" in plain.stderr and plain.stdout == ""
