"""What a new user types: grpcurl against a live daemon (no proto files), the kvloop CLI, and the
protocol's own checks (generated code fresh, buf lint clean)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, retained, running_agent

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def grpcurl(address: str, *args: str, data: str | None = None) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "grpcurl"), "-plaintext"]
    if data is not None:
        cmd += ["-d", data]
    return subprocess.run([*cmd, address, *args], capture_output=True, text=True, timeout=30, cwd="/")


def kvloop(*args: str, daemon: str | None = None) -> subprocess.CompletedProcess:
    prefix = ["--daemon", daemon] if daemon else []
    env = {**os.environ, "COLUMNS": "200"}  # a wide terminal: rich shortens cells to fit 80 columns
    return subprocess.run(
        [str(BIN / "kvloop"), *prefix, *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_grpcurl_list_describe_health_and_lookup(daemon):
    listed = grpcurl(daemon.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= {"kvloop.v1.Directory", "grpc.health.v1.Health"}
    described = grpcurl(daemon.address, "describe", "kvloop.v1.Directory")
    assert "rpc Lookup ( .kvloop.v1.LookupRequest ) returns ( .kvloop.v1.LookupResponse )" in described.stdout
    assert (
        "rpc Connect ( stream .kvloop.v1.ConnectRequest ) returns ( stream .kvloop.v1.ConnectResponse )"
        in described.stdout
    )
    health = grpcurl(daemon.address, "grpc.health.v1.Health/Check", data='{"service": "kvloop.v1.Directory"}')
    assert json.loads(health.stdout) == {"status": "SERVING"}
    import base64

    hashes = [base64.b64encode(h).decode() for h in conversation("grpcurl", 3)]
    answer = grpcurl(
        daemon.address,
        "kvloop.v1.Directory/Lookup",
        data=json.dumps({"model": "m-grpcurl", "block_hashes": hashes}),
    )
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["decision"] == "DECISION_RECOMPUTE"
    bad = grpcurl(daemon.address, "kvloop.v1.Directory/Lookup", data='{"block_hashes": []}')
    assert "InvalidArgument" in bad.stderr and "model must be set" in bad.stderr


@pytest.fixture
async def populated(daemon):
    prompt = conversation("cli", 20)
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-cli", "m-cli", retained(prompt[:12], "cli-handle")):
            yield prompt


async def test_cli_tables_and_json(daemon, populated):
    prompt = populated
    loop = asyncio.get_running_loop()

    async def run(*args):
        return await loop.run_in_executor(None, lambda: kvloop(*args, daemon=daemon.address))

    workers = await run("workers", "--model", "m-cli")
    assert workers.returncode == 0 and "dec-cli" in workers.stdout and "active" in workers.stdout
    as_json = json.loads((await run("--json", "workers", "--model", "m-cli")).stdout)
    assert as_json[0]["registration"]["worker_id"] == "dec-cli"
    assert as_json[0]["retained_blocks"] == 12
    hexes = [h.hex() for h in prompt]
    looked = json.loads((await run("--json", "lookup", "--model", "m-cli", *hexes)).stdout)
    assert looked["decision"] == "DECISION_TRANSFER" and looked["matched_blocks"] == 12
    assert looked["path"] == "TURN_PATH_TRANSFER" and looked["holder"]["tier"] == "device"
    human = await run("lookup", "--model", "m-cli", *hexes)
    assert "transfer (transfer_faster)" in human.stdout and "dec-cli" in human.stdout
    assert "from device memory" in human.stdout
    found = json.loads((await run("--json", "find", hexes[3], "--model", "m-cli")).stdout)
    assert found[0]["position"] == 3 and found[0]["retention_handle"] == "cli-handle"
    assert found[0]["tier"] == "device"
    blocks = await run("blocks", hexes[3], "--model", "m-cli")
    assert "cli-handle" in blocks.stdout
    stats = json.loads((await run("--json", "stats")).stdout)
    assert int(stats["retained_runs"]) >= 1 and "m-cli" in stats["models"]
    # the lookups above asked as requester "" : the cost model shows the pair and its verdicts
    pairs = json.loads((await run("pairs", "--model", "m-cli", "--json")).stdout)
    pair = next(p for p in pairs["pairs"] if p["holder_worker_id"] == "dec-cli")
    assert int(pair["verdicts"]["transfer_faster"]) >= 2 and pair["tier"] == "device"
    shown = await run("pairs")
    assert shown.returncode == 0 and "dec-cli" in shown.stdout and "transfer_faster" in shown.stdout


async def test_cli_shows_a_run_held_in_host_memory(daemon):
    prompt = conversation("cli-host", 10)
    copy = retained(prompt, "cli-handle@host", tier=pb.BLOCK_TIER_HOST)
    pool = dict(host_engine_id="engine-dec-cli-host@host", host_nixl_endpoint="127.0.0.1:5990")
    loop = asyncio.get_running_loop()

    async def run(*args):
        return await loop.run_in_executor(None, lambda: kvloop(*args, daemon=daemon.address))

    hexes = [h.hex() for h in prompt]
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "dec-cli-host", "m-cli-host", copy, **pool):
            looked = json.loads((await run("--json", "lookup", "--model", "m-cli-host", *hexes)).stdout)
            human = await run("lookup", "--model", "m-cli-host", *hexes)
            found = json.loads((await run("--json", "find", hexes[2], "--model", "m-cli-host")).stdout)
            table = await run("find", hexes[2], "--model", "m-cli-host")
            pairs = json.loads((await run("--json", "pairs", "--model", "m-cli-host")).stdout)
            pairs_table = await run("pairs", "--model", "m-cli-host")
    assert looked["holder"]["tier"] == "host" and looked["holder"]["engine_id"] == "engine-dec-cli-host@host"
    assert "(127.0.0.1:5990) serves 10 blocks from host memory" in human.stdout
    assert [(loc["tier"], loc["retention_handle"]) for loc in found] == [("host", "cli-handle@host")]
    (row,) = [line for line in table.stdout.splitlines() if "dec-cli-host" in line]
    assert "host" in row.split("│")[3]  # the tier column, after worker and kind
    (pair,) = [p for p in pairs["pairs"] if p["holder_worker_id"] == "dec-cli-host"]
    assert pair["tier"] == "host"
    (row,) = [line for line in pairs_table.stdout.splitlines() if "dec-cli-host" in line]
    assert row.split("│")[2].strip() == "host"  # the tier column, after the holder


async def test_json_before_or_after_the_command(daemon, populated):
    loop = asyncio.get_running_loop()

    async def run(*args):
        return await loop.run_in_executor(None, lambda: kvloop(*args, daemon=daemon.address))

    before = await run("--json", "workers", "--model", "m-cli")
    after = await run("workers", "--model", "m-cli", "--json")
    assert before.returncode == 0 and after.returncode == 0, before.stderr + after.stderr
    for result in (before, after):
        (worker,) = json.loads(result.stdout)
        assert worker["registration"]["worker_id"] == "dec-cli"
    assert "retained_runs" in json.loads((await run("stats", "--json")).stdout)


def test_every_command_takes_json_and_bench_multiturn_writes_to_output():
    import typer

    from kvloop.clients.cli.main import app

    def leaves(command, path=()):
        for name, sub in getattr(command, "commands", {}).items():
            yield from leaves(sub, (*path, name))
        if not hasattr(command, "commands"):
            yield path, command

    commands = dict(leaves(typer.main.get_command(app)))
    assert {("workers",), ("demo",), ("engine",), ("bench", "multiturn"), ("bench", "directory")} <= set(
        commands
    )
    for path, command in commands.items():
        options = {opt for param in command.params for opt in param.opts}
        assert "--json" in options, path
    multiturn = {opt for param in commands["bench", "multiturn"].params for opt in param.opts}
    assert {"--output", "-o"} <= multiturn


def test_bench_multiturn_refuses_an_unknown_tokenizer_before_starting_anything(tmp_path):
    refused = kvloop("bench", "multiturn", "--tokenizer", "sentencepiece", "--workdir", str(tmp_path))
    assert refused.returncode == 2 and "'sentencepiece' is not one of bpe, words" in refused.stderr
    assert "Traceback" not in refused.stderr and not any(tmp_path.iterdir())


def test_cli_errors_are_messages_not_tracebacks():
    unreachable = kvloop("workers", daemon="127.0.0.1:1")
    assert unreachable.returncode == 3  # ExitCode.UNREACHABLE
    assert "cannot reach kvloopd at 127.0.0.1:1" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr
    bad_hash = kvloop("lookup", "--model", "m", "not-hex", daemon="127.0.0.1:1")
    assert bad_hash.returncode == 2 and "block hash must be hex" in bad_hash.stderr


def test_generated_code_is_fresh_and_buf_lint_is_clean():
    fresh = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    buf = str(BIN / "buf")
    lint = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
