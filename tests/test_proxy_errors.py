"""The proxy as a process with its backends down: clear 503s and 400s, never a hang or a traceback."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.support import make_cert

BIN = Path(sys.executable).parent


def start_proxy(tmp_path: Path, *extra: str, context: ssl.SSLContext | None = None):
    """A proxy process over two dead backends, once it answers (503: no backend)."""
    port = free_port()
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    process = subprocess.Popen(
        [
            str(BIN / "kvloop"),
            "proxy",
            "--listen",
            f"127.0.0.1:{port}",
            "--prefill",
            dead[0],
            "--decode",
            dead[1],
            *extra,
        ],
        stderr=(tmp_path / "proxy.log").open("w"),
    )
    # the test certificates name localhost
    url = f"https://localhost:{port}" if context else f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1, context=context)
        except urllib.error.HTTPError:
            break  # answering (503: no backend)
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None, (
                tmp_path / "proxy.log"
            ).read_text()
            time.sleep(0.1)  # polling until the proxy listens
    return process, url, dead


@pytest.fixture
def lonely_proxy(tmp_path):
    process, url, dead = start_proxy(tmp_path)
    yield url, dead
    process.terminate()
    process.wait(10)


def call(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_backend_down_is_503_with_reason(lonely_proxy):
    url, dead = lonely_proxy
    status, body = call(
        f"{url}/v1/chat/completions",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    )
    assert status == 503
    assert "no healthy prefill server" in body["error"]["message"] and dead[0] in body["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"{url}/health", timeout=5)
    assert health.value.code == 503


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/completions", b'{"model": "m"}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
    ],
)
def test_bad_requests_are_vllms_to_judge(lonely_proxy, path, body):
    """vLLM refuses an invalid request through the proxy as it would alone
    (tests/e2e/test_proxy_conformance.py); with no server up the proxy says so, in vLLM's error shape."""
    url, _ = lonely_proxy
    status, answer = call(f"{url}{path}", body)
    assert status == 503
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert "no healthy" in answer["error"]["message"]


def test_proxy_serves_https_with_mutual_tls(tmp_path):
    ca = make_cert(tmp_path, "ca")
    server_key, server_crt = make_cert(tmp_path, "proxy", ca)
    client_key, client_crt = make_cert(tmp_path, "client", ca)
    trusted = ssl.create_default_context(cafile=ca[1])
    trusted.load_cert_chain(client_crt, client_key)
    process, url, _ = start_proxy(
        tmp_path,
        "--cert-file",
        str(server_crt),
        "--key-file",
        str(server_key),
        "--client-ca-file",
        str(ca[1]),
        context=trusted,
    )
    try:
        with pytest.raises(urllib.error.HTTPError) as health:  # over mutual TLS: the proxy's own answer
            urllib.request.urlopen(f"{url}/health", timeout=5, context=trusted)
        assert health.value.code == 503
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)) as refused:
            urllib.request.urlopen(
                f"{url}/health", timeout=5, context=ssl.create_default_context(cafile=ca[1])
            )
        assert not isinstance(refused.value, urllib.error.HTTPError)  # refused in the handshake, not answered
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(10)
