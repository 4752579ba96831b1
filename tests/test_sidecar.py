"""kvloop-agent as a process between vLLM's own ZMQ KV-event publisher and a real kvloopd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvloop.agents.connector.events import (
    KvloopBlocksRetained,
    KvloopPrefillReport,
    KvloopRetentionReleased,
    KvloopTransferReport,
)
from kvloop.clients.client import DirectoryClient
from kvloop.v1 import directory_pb2 as pb
from tests.conftest import free_port
from tests.support import conversation, wait_until

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM is installed by `make setup-engines`"
)
MODEL = "m-sidecar"
BIN = Path(sys.executable).parent


def retained_event(hashes: list[bytes], handle: str, lease_ms: int = 120_000) -> KvloopBlocksRetained:
    return KvloopBlocksRetained(
        block_hashes=hashes,
        block_ids=[list(range(100, 100 + len(hashes)))],
        retention_handle=handle,
        lease_ms=lease_ms,
        single_use=False,
        ts=time.time(),
    )


@pytest.fixture
def publisher():
    import zmq

    for _ in range(5):  # a port free on loopback may still be taken on another interface: pick again
        ports = free_port(""), free_port("")
        try:
            pub = kv_events.ZmqEventPublisher(
                0, endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}"
            )
            break
        except zmq.error.ZMQError:
            continue
    yield pub, ports
    pub.shutdown()


def start_agent(daemon_address: str, ports, tmp_path: Path, health_port: int) -> subprocess.Popen:
    log = (tmp_path / f"agent-{time.monotonic_ns()}.log").open("w")
    return subprocess.Popen(
        [
            str(BIN / "kvloop-agent"),
            "--daemon",
            daemon_address,
            "--worker-id",
            "dec-s",
            "--role",
            "decode",
            "--model",
            MODEL,
            "--nixl-endpoint",
            "127.0.0.1:5999",
            "--block-size",
            "16",
            "--kv-events",
            f"tcp://127.0.0.1:{ports[0]}",
            "--kv-events-replay",
            f"tcp://127.0.0.1:{ports[1]}",
            "--health-listen",
            f"127.0.0.1:{health_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        # a short silence warning: the agent must warn and keep running (it once exited instead)
        env={**os.environ, "KVLOOP_AGENT_SILENT_ENGINE_WARNING_S": "0.2"},
    )


def test_agent_forwards_engine_events_and_recovers_after_restart(daemon, publisher, tmp_path):
    pub, ports = publisher
    first = conversation("side-a", 12)
    second = conversation("side-b", 9)
    # Published before the agent runs: the agent must recover it from the replay buffer.
    pub.publish(
        kv_events.KVEventBatch(
            ts=time.time(),
            events=[
                kv_events.BlockStored(
                    block_hashes=first,
                    parent_block_hash=None,
                    token_ids=[1] * 192,
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                retained_event(first, "req-a"),
            ],
        )
    )
    health_port = free_port()
    agent = start_agent(daemon.address, ports, tmp_path, health_port)
    try:
        with DirectoryClient(daemon.address) as client:
            answer = wait_until(
                lambda: (a := client.lookup(MODEL, first)).decision == pb.DECISION_TRANSFER and a,
                what="replayed retention to be served",
            )
            assert answer.matched_blocks == 12 and answer.holder.retention_handle == "req-a"
            assert list(answer.holder.block_ids) == list(range(100, 112))
            kinds = {loc.kind for loc in client.find_block(MODEL, first[0])}
            assert kinds == {"stored", "retained"}
            health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz").read())
            assert health["connected"] and health["retained_runs"] == 1
            # live events: a release, a new retention
            pub.publish(
                kv_events.KVEventBatch(
                    ts=time.time(),
                    events=[
                        KvloopRetentionReleased(retention_handle="req-a"),
                        retained_event(second, "req-b"),
                    ],
                )
            )
            wait_until(lambda: client.lookup(MODEL, first).reason == pb.DECISION_REASON_MISS, what="release")
            # the puller's transfer telemetry reaches the daemon's cost model
            pub.publish(
                kv_events.KVEventBatch(
                    ts=time.time(),
                    events=[
                        KvloopTransferReport(
                            source_worker_id="dec-other",
                            bytes=1 << 20,
                            blocks=8,
                            duration_us=900,
                            ok=True,
                            first_contact=True,
                        )
                    ],
                )
            )
            wait_until(
                lambda: (
                    'kvloop_transfer_reports_total{first_contact="true",ok="true"}'
                    in urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics").read().decode()
                ),
                what="transfer report",
            )
            # ... and so does its own prefill speed (1,000 tokens in 250 ms)
            pub.publish(
                kv_events.KVEventBatch(
                    ts=time.time(), events=[KvloopPrefillReport(tokens=1000, duration_us=250_000)]
                )
            )
            wait_until(
                lambda: client.list_workers(MODEL)[0].prefill_tokens_per_second == 4000.0,
                what="prefill report",
            )
            wait_until(
                lambda: client.lookup(MODEL, second).decision == pb.DECISION_TRANSFER, what="live retention"
            )
            # SIGTERM: clean exit, and the worker's blocks stop being served at once
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(15) == 0
            assert client.lookup(MODEL, second).reason == pb.DECISION_REASON_PEER_UNAVAILABLE
            # a restarted agent (new epoch) rebuilds the state from the engine's replay buffer
            agent = start_agent(daemon.address, ports, tmp_path, free_port())
            wait_until(
                lambda: client.lookup(MODEL, second).decision == pb.DECISION_TRANSFER,
                what="state rebuilt after agent restart",
            )
            assert (
                client.lookup(MODEL, first).reason == pb.DECISION_REASON_MISS
            )  # the release was replayed too
            (worker,) = [w for w in client.list_workers(MODEL) if w.registration.worker_id == "dec-s"]
            assert worker.retained_runs == 1
    finally:
        agent.terminate()
        agent.wait(15)


def test_agent_refuses_bad_configuration_clearly():
    result = subprocess.run(
        [str(BIN / "kvloop-agent"), "--model", "m", "--block-size", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "block_size" in result.stderr and "Traceback" not in result.stderr
