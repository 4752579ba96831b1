"""Spans at a real OTLP receiver, metrics, graceful shutdown, config, auth and TLS."""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvloop.clients.directory_client import DirectoryClient, KvloopError
from kvloop.common.security import ClientSecurity
from kvloop.v1 import directory_pb2 as pb
from tests.conftest import KVLOOPD, free_port, start_daemon
from tests.support import conversation, make_cert, wait_until

ROOT = Path(__file__).resolve().parent.parent


def test_lookup_span_reaches_otlp_receiver_with_kvloop_attributes(daemon_factory, otlp_receiver):
    proc = daemon_factory(
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "kvloopd-under-test",
        }
    )
    with DirectoryClient(proc.address) as client:
        client.lookup("m-traced", conversation("traced", 4), requester="prefill-traced")
    spans = otlp_receiver.wait_for(lambda s: s["attributes"].get("kvloop.requester") == "prefill-traced")
    span = spans[0]
    assert span["service"] == "kvloopd-under-test"
    assert span["name"] == "/kvloop.v1.Directory/Lookup"
    assert span["attributes"]["kvloop.decision"] == "recompute"
    assert span["attributes"]["kvloop.reason"] == "miss"
    assert span["attributes"]["kvloop.matched_tokens"] == 0
    # The store call the decision waited on is a child of the request's span.
    store_spans = otlp_receiver.wait_for(
        lambda s: s["name"] == "kvloop.store.lookup" and s["trace_id"] == span["trace_id"]
    )
    assert store_spans[0]["parent_span_id"] == span["span_id"]
    assert store_spans[0]["attributes"]["kvloop.store.backend"] == "memory"


def test_metrics_endpoint_and_graceful_sigterm(daemon_factory):
    proc = daemon_factory()
    with DirectoryClient(proc.address) as client:
        client.lookup("m-metrics", conversation("x", 2))
    body = urllib.request.urlopen(f"http://{proc.metrics_address}/metrics").read().decode()
    assert 'kvloop_decisions_total{decision="recompute",reason="miss"} 1.0' in body
    assert "kvloop_lookup_latency_seconds_bucket" in body
    proc.process.send_signal(signal.SIGTERM)
    assert proc.process.wait(15) == 0
    assert "kvloopd stopped" in proc.log()


def _young_collections(metrics_address: str) -> float:
    body = urllib.request.urlopen(f"http://{metrics_address}/metrics").read().decode()
    line = next(x for x in body.splitlines() if x.startswith('python_gc_collections_total{generation="0"}'))
    return float(line.split()[-1])


def test_rpcs_rarely_trigger_a_garbage_collection(daemon_factory):
    """grpcio leaves a reference cycle behind every call: at Python's default threshold (700) these
    2,000 Lookups ran 15 young collections inside handlers; kvloopd's threshold keeps it to one."""
    proc = daemon_factory()
    hashes = conversation("gc", 64)
    with DirectoryClient(proc.address) as client:
        client.lookup("m-gc", hashes)
        before = _young_collections(proc.metrics_address)
        for _ in range(2000):
            client.lookup("m-gc", hashes)
        after = _young_collections(proc.metrics_address)
    assert after - before <= 3


def test_config_file_env_and_flags_precedence(tmp_path):
    config = tmp_path / "kvloopd.toml"
    config.write_text('lease_s = 7.0\nlog_level = "debug"\n[policy]\nrecompute_threshold_tokens = 128\n')
    env = {"KVLOOP_LOG_LEVEL": "warning", "PATH": str(Path(sys.executable).parent)}
    out = subprocess.run(
        [KVLOOPD, "--config", str(config), "--check-config", "--listen", "0.0.0.0:6000"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert '"lease_s": 7.0' in out  # file
    assert '"log_level": "warning"' in out  # env beats file
    assert '"listen": "0.0.0.0:6000"' in out  # flag beats all
    assert '"recompute_threshold_tokens": 128' in out


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--listen", "nonsense"], {}, "--listen: listen: must be HOST:PORT"),
        ([], {"KVLOOP_LEASE_S": "-1"}, "lease_s"),
        ([], {"KVLOOP_HEARTBEAT_INTERVAL_S": "20"}, "must be shorter than lease_s"),
        ([], {"KVLOOP_GC_YOUNG_THRESHOLD": "0"}, "gc_young_threshold"),
        (["--config", "/nonexistent/kvloopd.toml"], {}, "does not exist"),
    ],
)
def test_bad_config_is_a_clear_error(args, env, message):
    result = subprocess.run(
        [KVLOOPD, *args, "--check-config"],
        capture_output=True,
        text=True,
        env={"PATH": str(Path(sys.executable).parent), **env},
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr  # one line per problem
    assert "Traceback" not in result.stderr


def test_busy_port_is_a_clear_error(daemon):
    result = subprocess.run(
        [KVLOOPD, "--listen", daemon.address, "--metrics-listen", ""],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert f"cannot listen on {daemon.address}" in result.stderr
    assert "Traceback" not in result.stderr


def test_mutual_tls_and_role_tokens(tmp_path):
    ca = make_cert(tmp_path, "ca")
    server_key, server_crt = make_cert(tmp_path, "server", ca)
    client_key, client_crt = make_cert(tmp_path, "client", ca)
    config = tmp_path / "kvloopd.toml"
    config.write_text(f"""
[tls]
cert_file = "{server_crt}"
key_file = "{server_key}"
client_ca_file = "{ca[1]}"
[[tokens]]
token = "read-token-0123456789"
role = "read"
[[tokens]]
token = "prefill-token-0123456789"
role = "prefill"
[[tokens]]
token = "admin-token-0123456789"
role = "admin"
""")
    creds = grpc.ssl_channel_credentials(ca[1].read_bytes(), client_key.read_bytes(), client_crt.read_bytes())
    proc = start_daemon(tmp_path, "--config", str(config), credentials=creds)
    try:

        def client(token: str | None, cert: bool = True) -> DirectoryClient:
            sec = ClientSecurity(
                token=token,
                ca_file=ca[1],
                cert_file=client_crt if cert else None,
                key_file=client_key if cert else None,
            )
            return DirectoryClient(proc.address.replace("127.0.0.1", "localhost"), sec, timeout=5)

        hashes = conversation("tls", 3)
        with client("read-token-0123456789") as reader:
            assert reader.list_workers() == []
            assert reader.lookup("m", hashes).decision == pb.DECISION_RECOMPUTE  # peek is fine
            with pytest.raises(KvloopError) as denied:
                reader.lookup("m", hashes, claim=True)
            assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(KvloopError) as denied:
                reader.drain("w")
            assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as no_plans:  # Route's plans hold handles: prefills only
                next(iter(reader.plans("p")))
            assert no_plans.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with client("prefill-token-0123456789") as prefill:
            assert prefill.lookup("m", hashes, claim=True).decision == pb.DECISION_RECOMPUTE
            plans = prefill.plans("p")
            plans.initial_metadata()  # subscribed
            assert plans.cancel()
        with client("wrong-token") as stranger:
            with pytest.raises(KvloopError) as denied:
                stranger.stats()
            assert denied.value.code == grpc.StatusCode.UNAUTHENTICATED
        with client("admin-token-0123456789") as admin:
            with pytest.raises(KvloopError) as missing:
                admin.drain("nobody")
            assert missing.value.code == grpc.StatusCode.NOT_FOUND
        with client("admin-token-0123456789", cert=False) as no_cert:  # mutual TLS: no client cert, no entry
            with pytest.raises(KvloopError) as refused:
                no_cert.stats()
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.stop()


def test_agent_health_endpoint_over_mutual_tls(daemon, tmp_path):
    ca = make_cert(tmp_path, "ca")
    server_key, server_crt = make_cert(tmp_path, "agent-server", ca)
    client_key, client_crt = make_cert(tmp_path, "prometheus", ca)
    port = free_port()
    config = tmp_path / "agent.toml"
    config.write_text(f"""
model = "m-health-tls"
block_size = 16
worker_id = "tls-agent"
nixl_endpoint = "127.0.0.1:5999"
daemon = "{daemon.address}"
health_listen = "127.0.0.1:{port}"
kv_events_replay = ""
[health_tls]
cert_file = "{server_crt}"
key_file = "{server_key}"
client_ca_file = "{ca[1]}"
""")
    log = (tmp_path / "agent.log").open("w")
    agent = subprocess.Popen(
        [str(Path(KVLOOPD).parent / "kvloop-agent"), "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        trusted = ssl.create_default_context(cafile=ca[1])
        trusted.load_cert_chain(client_crt, client_key)
        url = f"https://localhost:{port}"

        def scrape() -> str | None:
            try:
                return urllib.request.urlopen(f"{url}/metrics", context=trusted, timeout=5).read().decode()
            except urllib.error.URLError:
                assert agent.poll() is None, (tmp_path / "agent.log").read_text()
                return None

        assert "kvloop_agent" in wait_until(scrape, what="the agent's HTTPS /metrics")

        def streaming() -> dict | None:
            try:
                return json.loads(urllib.request.urlopen(f"{url}/healthz", context=trusted, timeout=5).read())
            except urllib.error.HTTPError as exc:
                if exc.code == 503:  # serving, not yet streaming to kvloopd
                    return None
                raise

        health = wait_until(streaming, what="the agent's HTTPS /healthz to turn 200")
        assert health["worker_id"] == "tls-agent"
        no_client_cert = ssl.create_default_context(cafile=ca[1])
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"{url}/metrics", context=no_client_cert, timeout=5).read()
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()  # plaintext: refused
        # refused clients cost the endpoint nothing: it still serves the trusted one
        assert (
            "kvloop_agent"
            in urllib.request.urlopen(f"{url}/metrics", context=trusted, timeout=5).read().decode()
        )
    finally:
        agent.terminate()
        assert agent.wait(15) == 0
