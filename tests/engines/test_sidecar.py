"""kvloop-agent as a process between vLLM's own ZMQ KV-event publisher and a real kvloopd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvloop.agents.connector.events import (
    KvloopBlocksRetained,
    KvloopPrefillReport,
    KvloopRetentionReleased,
    KvloopTransferReport,
)
from kvloop.clients.directory_client import DirectoryClient
from kvloop.v1 import directory_pb2 as pb
from tests.conftest import free_port
from tests.support import conversation, wait_until

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM is installed by `make setup-engines`"
)
MODEL = "m-sidecar"
BIN = Path(sys.executable).parent


def retained_event(
    hashes: list[bytes], handle: str, lease_ms: int = 120_000, tier: str = "device"
) -> KvloopBlocksRetained:
    return KvloopBlocksRetained(
        block_hashes=hashes,
        block_ids=[list(range(100, 100 + len(hashes)))],
        retention_handle=handle,
        lease_ms=lease_ms,
        single_use=False,
        ts=time.time(),
        tier=tier,
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


def start_agent(
    daemon_address: str, ports, tmp_path: Path, health_port: int, *extra_args: str
) -> subprocess.Popen:
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
            *extra_args,
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


def test_agent_registers_its_host_pool_and_forwards_host_runs_and_reads(daemon, publisher, tmp_path):
    """--host-nixl-endpoint names the worker's host-memory pool (its engine id defaults to
    ENGINE_ID@host): a run the connector announces in host memory is served from the pool, and a
    READ's source tier reaches the cost model."""
    pub, ports = publisher
    copy = conversation("side-host", 8)
    agent = start_agent(
        daemon.address,
        ports,
        tmp_path,
        free_port(),
        *("--worker-id", "dec-h", "--engine-id", "eng-h", "--host-nixl-endpoint", "127.0.0.1:6001"),
    )
    report = KvloopTransferReport(
        source_worker_id="dec-other", bytes=1 << 20, blocks=8, duration_us=900, ok=True, source_tier="host"
    )
    try:
        with DirectoryClient(daemon.address) as client:
            wait_until(
                lambda: any(w.registration.worker_id == "dec-h" for w in client.list_workers(MODEL)),
                what="the agent registered",
            )
            pub.publish(
                kv_events.KVEventBatch(
                    ts=time.time(), events=[retained_event(copy, "req-h@host", tier="host"), report]
                )
            )
            answer = wait_until(
                lambda: (a := client.lookup(MODEL, copy)).decision == pb.DECISION_TRANSFER and a,
                what="the host copy served",
            )
            holder = answer.holder
            assert (holder.worker_id, holder.retention_handle, holder.tier) == (
                "dec-h",
                "req-h@host",
                pb.BLOCK_TIER_HOST,
            )
            assert (holder.engine_id, holder.nixl_endpoint) == ("eng-h@host", "127.0.0.1:6001")
            (worker,) = [w for w in client.list_workers(MODEL) if w.registration.worker_id == "dec-h"]
            assert (worker.registration.host_engine_id, worker.registration.engine_id) == (
                "eng-h@host",
                "eng-h",
            )
            (pair,) = [p for p in client.pairs(MODEL).pairs if p.puller_worker_id == "dec-h"]
            assert (pair.holder_worker_id, pair.tier) == ("dec-other", pb.BLOCK_TIER_HOST)
    finally:
        agent.terminate()
        agent.wait(15)


class EngineHealthStandIn:
    """The engine's HTTP /health: a real HTTP server on a fixed port that can go away and come back."""

    def __init__(self) -> None:
        self.port = free_port()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        class Health(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Health)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()  # from now on: connection refused, as after kill -9


def stored_and_retained(hashes: list[bytes], handle: str):
    return kv_events.KVEventBatch(
        ts=time.time(),
        events=[
            kv_events.BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[1] * 16 * len(hashes),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            retained_event(hashes, handle),
        ],
    )


def test_engine_restarted_under_the_agent_never_leaves_its_old_blocks_served(daemon, publisher, tmp_path):
    """kill -9 of the engine, relaunched on the same ports: the directory drops every block the dead
    process announced (a relaunched engine keeps other data at those block ids) and then serves
    the new process's, although the new publisher counts its seq from 0 again."""
    pub, ports = publisher
    old_run, new_run = conversation("restart-old", 10), conversation("restart-new", 6)
    engine_health = EngineHealthStandIn()
    engine_health.start()
    agent_health_port = free_port()
    agent = start_agent(
        daemon.address,
        ports,
        tmp_path,
        agent_health_port,
        "--http-endpoint",
        f"http://127.0.0.1:{engine_health.port}",
    )

    def agent_health() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{agent_health_port}/healthz") as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as unhealthy:  # 503 while not streaming to kvloopd
            return json.loads(unhealthy.read())
        except urllib.error.URLError:  # the agent is still starting
            return {}

    def epoch(client: DirectoryClient) -> int:
        (worker,) = [w for w in client.list_workers(MODEL) if w.registration.worker_id == "dec-s"]
        return worker.registration.epoch

    replacement = None
    try:
        with DirectoryClient(daemon.address) as client:
            # A few batches first, so the new publisher's seq 0..1 are below the old one's last seq.
            for n in range(3):
                pub.publish(stored_and_retained(old_run, f"old-{n}"))
            wait_until(lambda: agent_health().get("engine_batches") == 3, what="old engine's events taken")
            # taken from the engine is not yet in the directory: wait for kvloopd's acknowledgement too
            wait_until(
                lambda: (h := agent_health()).get("sequence", 0) > 0 and h.get("acked") == h.get("sequence"),
                what="old engine's events acknowledged by kvloopd",
            )
            answer = client.lookup(MODEL, old_run)
            assert answer.decision == pb.DECISION_TRANSFER
            assert answer.holder.retention_handle.startswith("old")
            wait_until(lambda: agent_health().get("engine") == "up", what="engine health seen")
            first_epoch = epoch(client)

            # kill -9: the publisher's sockets close and /health refuses connections.
            pub.shutdown()
            engine_health.stop()
            killed = time.perf_counter()
            wait_until(
                lambda: (
                    client.lookup(MODEL, old_run).reason == pb.DECISION_REASON_MISS
                    and not client.find_block(MODEL, old_run[0])
                ),
                what="the dead engine's runs and stored blocks dropped",
            )
            print(f"engine ended -> its blocks dropped: {(time.perf_counter() - killed) * 1000:.0f} ms")
            assert epoch(client) != first_epoch
            wait_until(lambda: agent_health().get("engine") == "down", what="engine health failing")
            assert agent_health()["engine_restarts"] == 1  # both signals fired: one restart

            # Relaunch on the same ports; its publisher starts again at seq 0.
            replacement = kv_events.ZmqEventPublisher(
                0, endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}"
            )
            engine_health.start()
            replacement.publish(stored_and_retained(new_run, "new-0"))
            answer = wait_until(
                lambda: (a := client.lookup(MODEL, new_run)).decision == pb.DECISION_TRANSFER and a,
                what="the relaunched engine's run served",
            )
            assert answer.holder.retention_handle == "new-0" and answer.holder.epoch == epoch(client)
            assert client.lookup(MODEL, old_run).reason == pb.DECISION_REASON_MISS
            wait_until(lambda: agent_health().get("engine") == "up", what="relaunched engine healthy")
            health = agent_health()
            assert health["engine_restarts"] == 1 and health["retained_runs"] == 1 and health["connected"]
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{agent_health_port}/metrics").read().decode()
            assert 'kvloop_agent_engine_restarts_total{signal="publisher"} 1.0' in metrics

            # /health alone failing ends the engine too (a host gone without closing its sockets
            # looks like this): everything is dropped under a new epoch. This publisher still
            # answers its replay, so it is alive and its history (valid runs) is read again at once.
            second_epoch = epoch(client)
            engine_health.stop()
            health_gone = time.perf_counter()
            wait_until(lambda: epoch(client) != second_epoch, what="a new epoch on /health failing")
            print(f"/health refused -> new epoch: {(time.perf_counter() - health_gone) * 1000:.0f} ms")
            assert agent_health()["engine_restarts"] == 2
            answer = wait_until(
                lambda: (a := client.lookup(MODEL, new_run)).decision == pb.DECISION_TRANSFER and a,
                what="the live publisher's runs read again",
            )
            assert answer.holder.epoch == epoch(client) != second_epoch
            engine_health.start()
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{agent_health_port}/metrics").read().decode()
            assert 'kvloop_agent_engine_restarts_total{signal="health"} 1.0' in metrics
    finally:
        agent.terminate()
        agent.wait(15)
        if replacement is not None:
            replacement.shutdown()


def test_agent_refuses_bad_configuration_clearly():
    result = subprocess.run(
        [str(BIN / "kvloop-agent"), "--model", "m", "--block-size", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "block_size" in result.stderr and "Traceback" not in result.stderr


def test_engine_health_probe_tells_dead_from_busy():
    """Refused or not HTTP at all: the engine is gone (False). No answer in time: inconclusive (None),
    a busy engine on a small host answers late and must not lose its blocks for it."""
    from kvloop.agents.sidecar.engine_watch import engine_healthy, health_url

    def listener(reply: bytes | None) -> int:
        sock = socket.create_server(("127.0.0.1", 0))

        def serve() -> None:
            while True:
                conn, _ = sock.accept()
                conn.recv(1024)
                if reply is not None:
                    conn.sendall(reply)
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return sock.getsockname()[1]

    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    ok = listener(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    failing = listener(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
    not_http = listener(b"not http\r\n\r\n")
    assert engine_healthy(f"http://127.0.0.1:{ok}/health", 2) is True
    assert engine_healthy(f"http://127.0.0.1:{failing}/health", 2) is False
    assert engine_healthy(f"http://127.0.0.1:{not_http}/health", 2) is False
    assert engine_healthy(f"http://127.0.0.1:{closed_port}/health", 2) is False
    assert engine_healthy(f"http://127.0.0.1:{listener(None)}/health", 0.3) is None
    assert (
        health_url("http://10.0.0.1:8000/v1/") == health_url("10.0.0.1:8000") == "http://10.0.0.1:8000/health"
    )
    assert health_url("") is None
