"""Builders for protocol messages and chained block hashes used across tests."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import subprocess
import time
from contextlib import asynccontextmanager
from pathlib import Path

from kvloop.v1 import directory_pb2 as pb

_epochs = itertools.count(1000)


def wait_until(condition, timeout: float = 20.0, what: str = "condition", interval: float = 0.05):
    """Poll `condition` until it returns something truthy (polling a condition, not sleeping)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def chain(tokens_per_block: list[bytes], parent: bytes = b"") -> list[bytes]:
    """Chained 32-byte hashes like vLLM's: each block's hash covers its parent hash."""
    hashes = []
    for block in tokens_per_block:
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


def conversation(name: str, blocks: int, start: int = 0) -> list[bytes]:
    return chain([f"{name}:{i}".encode() for i in range(start, start + blocks)])


def named_hash(name: str, i: int) -> bytes:
    """A 32-byte block hash readable in a failure message (``name/i`` padded)."""
    return f"{name}/{i}".encode().ljust(32, b".")


class RecordingConfirmer:
    """A host tier's release confirmer that records what it was asked; the test answers."""

    def __init__(self) -> None:
        self.asked: list = []

    def submit(self, run) -> None:
        self.asked.append(run)


def registration(
    worker_id: str,
    model: str = "test-model",
    role: int = pb.WORKER_ROLE_DECODE,
    epoch: int | None = None,
    block_size: int = 16,
    **extra,
) -> pb.WorkerRegistration:
    fields = dict(
        worker_id=worker_id,
        role=role,
        model=model,
        engine_id=f"engine-{worker_id}",
        nixl_endpoint=f"127.0.0.1:{5600 + hash(worker_id) % 100}",
        block_size=block_size,
        hash_algorithm="sha256_cbor",
        hash_length=32,
        epoch=epoch or next(_epochs),
        kv_bytes_per_block=65536,
    )
    fields.update(extra)
    return pb.WorkerRegistration(**fields)


def retained(
    hashes: list[bytes],
    handle: str,
    expires_in_ms: int = 60_000,
    single_use: bool = False,
    groups: int = 1,
    tier: int = pb.BLOCK_TIER_UNSPECIFIED,
    first_id: int = 1000,
) -> pb.BlockEvent:
    ids = [first_id + g * 10_000 + i for g in range(groups) for i in range(len(hashes))]
    return pb.BlockEvent(
        retained=pb.BlocksRetained(
            block_hashes=hashes,
            block_ids=ids,
            num_groups=groups,
            retention_handle=handle,
            expires_in_ms=expires_in_ms,
            single_use=single_use,
            tier=tier,
        )
    )


@asynccontextmanager
async def running_agent(client, worker_id: str, model: str, *events: pb.BlockEvent, snapshot=None, **reg):
    """A real DirectoryLink registered and (if events are given) acknowledged, cancelled on exit."""
    from kvloop.agents.sidecar.link import DirectoryLink

    link = DirectoryLink(
        client, registration(worker_id, model=model, **reg), snapshot=snapshot or (lambda: [])
    )
    runner = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.connected.wait(), 10)
        if events:
            link.publish(list(events))
            await link.wait_acked(timeout=5)
        yield link
    finally:
        runner.cancel()


def make_cert(tmp: Path, name: str, ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """A self-signed CA (no ca given) or a certificate it signs for localhost / 127.0.0.1: (key, crt)."""
    key, crt = tmp / f"{name}.key", tmp / f"{name}.crt"
    subj = f"/CN={name}"
    if ca is None:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-keyout",
                key,
                "-out",
                crt,
                "-subj",
                subj,
            ],
            check=True,
            capture_output=True,
        )
    else:
        csr = tmp / f"{name}.csr"
        ext = tmp / f"{name}.ext"
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        subprocess.run(
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", subj],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                csr,
                "-CA",
                ca[1],
                "-CAkey",
                ca[0],
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                crt,
                "-extfile",
                ext,
            ],
            check=True,
            capture_output=True,
        )
    return key, crt


def spawn_agent(tmp: Path, daemon_address: str, model: str, worker_id: str, health_port: int, env=None):
    """A real kvloop-agent process from a TOML config (no engine: it registers and serves its health
    and metrics endpoints); its output goes to ``tmp/agent.log``."""
    from kvloop.common.processes import supervisor
    from tests.conftest import KVLOOPD

    config = tmp / "agent.toml"
    config.write_text(
        f'model = "{model}"\nblock_size = 16\nworker_id = "{worker_id}"\nnixl_endpoint = "127.0.0.1:5999"\n'
        f'daemon = "{daemon_address}"\nhealth_listen = "127.0.0.1:{health_port}"\nkv_events_replay = ""\n'
    )
    log = tmp / "agent.log"
    return supervisor().spawn(
        [str(Path(KVLOOPD).parent / "kvloop-agent"), "--config", str(config)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def spawn_proxy(tmp: Path, port: int, env=None):
    """A real `kvloop proxy` on ``port`` over a prefill and a decode that do not exist (it serves its
    own endpoints: /metrics, health, auth refusals); its output goes to ``tmp/proxy.log``."""
    from kvloop.common.addresses import free_port
    from kvloop.common.processes import supervisor
    from tests.conftest import KVLOOPD

    log = tmp / "proxy.log"
    return supervisor().spawn(
        [
            str(Path(KVLOOPD).parent / "kvloop"),
            "proxy",
            "--listen",
            f"127.0.0.1:{port}",
            "--prefill",
            f"http://127.0.0.1:{free_port()}",
            "--decode",
            f"http://127.0.0.1:{free_port()}",
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
