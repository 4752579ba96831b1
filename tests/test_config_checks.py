"""Configuration that fails early and safely: every file a config names is opened at load time,
each problem is one line naming where the value came from, the key and what is wrong (never the
value), tokens may come from files and may not repeat, and exposure beyond loopback is warned about."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvloop.clients.directory_client import DirectoryClient, KvloopError
from kvloop.common.addresses import free_port
from kvloop.common.security import ClientSecurity
from tests.conftest import KVLOOPD, start_daemon
from tests.support import make_cert, spawn_proxy, wait_until

BIN = Path(KVLOOPD).parent


def _kvloopd(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOP_")}
    return subprocess.run(
        [KVLOOPD, *args], capture_output=True, text=True, env={**base, **(env or {})}, timeout=timeout
    )


def _clean(result: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.splitlines()


@pytest.mark.parametrize("check", [True, False], ids=["check-config", "start"])
def test_missing_key_file_is_one_line_naming_file_and_key(tmp_path, check):
    ca = make_cert(tmp_path, "ca")
    _, crt = make_cert(tmp_path, "server", ca)
    config = tmp_path / "kvloopd.toml"
    config.write_text(f'[tls]\ncert_file = "{crt}"\nkey_file = "{tmp_path}/gone.key"\n')
    args = ["--config", str(config), "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", ""]
    result = _kvloopd(*args, *(["--check-config"] if check else []))
    assert result.returncode == 2
    assert _clean(result) == [
        f"kvloopd: {config}: tls.key_file: cannot read {tmp_path}/gone.key: No such file or directory"
    ]


def test_mismatched_certificate_and_key(tmp_path):
    ca = make_cert(tmp_path, "ca")
    _, crt = make_cert(tmp_path, "server", ca)
    other_key, _ = make_cert(tmp_path, "other", ca)
    config = tmp_path / "kvloopd.toml"
    config.write_text(f'[tls]\ncert_file = "{crt}"\nkey_file = "{other_key}"\n')
    result = _kvloopd("--config", str(config), "--check-config")
    assert result.returncode == 2
    [line] = _clean(result)
    assert line.startswith(f"kvloopd: {config}: tls: cert_file {crt} and key_file {other_key} are not")


def test_toml_syntax_error_names_the_file(tmp_path):
    config = tmp_path / "kvloopd.toml"
    config.write_text("lease_s = 5\n[policy\n")
    result = _kvloopd("--config", str(config), "--check-config")
    assert result.returncode == 2
    [line] = _clean(result)
    assert line.startswith(f"kvloopd: {config}: TOML syntax error:") and "line 2" in line


def test_unknown_table_is_named(tmp_path):
    config = tmp_path / "kvloopd.toml"
    config.write_text('[auth]\ntoken = "x"\n')
    result = _kvloopd("--config", str(config), "--check-config")
    assert result.returncode == 2
    assert _clean(result) == [f"kvloopd: {config}: auth: unknown key"]


def test_short_and_repeated_tokens_are_refused_without_echoing_them(tmp_path):
    short, long = "sh0rt-s3cret", "a-long-secret-token-0123456789"
    config = tmp_path / "kvloopd.toml"
    config.write_text(f'[[tokens]]\ntoken = "{short}"\nrole = "read"\n')
    result = _kvloopd("--config", str(config), "--check-config")
    assert result.returncode == 2
    assert _clean(result) == [f"kvloopd: {config}: tokens[0]: token is shorter than 16 characters"]
    (tmp_path / "admin.token").write_text(long + "\n")
    config.write_text(
        f'[[tokens]]\ntoken = "{long}"\nrole = "read"\n'
        f'[[tokens]]\ntoken_file = "{tmp_path}/admin.token"\nrole = "admin"\n'
    )
    result = _kvloopd("--config", str(config), "--check-config")
    assert result.returncode == 2
    assert _clean(result) == [f"kvloopd: {config}: tokens: tokens[1] repeats the token of tokens[0]"]
    assert long not in result.stderr + result.stdout


def test_token_and_password_files_through_the_credentials_directory(tmp_path):
    """Paths expand environment variables: a systemd unit's credentials are named as
    ${CREDENTIALS_DIRECTORY}/NAME, and the token read from its file authenticates."""
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "read.token").write_text("read-token-from-a-file-0123\n")
    (creds / "redis-password").write_text("hunter2-redis\n")
    config = tmp_path / "kvloopd.toml"
    config.write_text(
        '[[tokens]]\ntoken_file = "${CREDENTIALS_DIRECTORY}/read.token"\nrole = "read"\n'
        '[store]\npassword_file = "${CREDENTIALS_DIRECTORY}/redis-password"\n'
    )
    env = {"CREDENTIALS_DIRECTORY": str(creds)}
    checked = _kvloopd("--config", str(config), "--check-config", env=env)
    assert checked.returncode == 0, checked.stderr
    printed = json.loads(checked.stdout)
    assert printed["store"]["password"] == "**********"
    assert "hunter2" not in checked.stdout and "read-token-from" not in checked.stdout
    missing = _kvloopd("--config", str(config), "--check-config", env={"CREDENTIALS_DIRECTORY": "/nowhere"})
    assert missing.returncode == 2
    gone = "No such file or directory"
    assert sorted(_clean(missing)) == [
        f"kvloopd: {config}: store.password_file: cannot read /nowhere/redis-password: {gone}",
        f"kvloopd: {config}: tokens[0].token_file: cannot read /nowhere/read.token: {gone}",
    ]
    config.write_text('[[tokens]]\ntoken_file = "${CREDENTIALS_DIRECTORY}/read.token"\nrole = "read"\n')
    proc = start_daemon(tmp_path, "--config", str(config), env=env)
    try:
        with DirectoryClient(proc.address, ClientSecurity(token="read-token-from-a-file-0123")) as client:
            assert client.list_workers() == []
        with DirectoryClient(proc.address, ClientSecurity(token="some-other-token-0123456")) as client:
            with pytest.raises(KvloopError):
                client.list_workers()
    finally:
        proc.stop()


def test_listening_beyond_loopback_without_tls_or_tokens_warns(tmp_path):
    checked = _kvloopd("--listen", "0.0.0.0:50051", "--check-config")
    assert checked.returncode == 0
    assert "kvloopd: warning: listen 0.0.0.0:50051 is beyond loopback with neither [tls] nor [[tokens]]" in (
        checked.stderr
    )
    assert _kvloopd("--listen", "127.0.0.1:50051", "--check-config").stderr == ""
    port = free_port()
    proc = start_daemon(tmp_path, port=port, wait=False)  # 127.0.0.1: no warning
    wide = subprocess.Popen(
        [KVLOOPD, "--listen", f"0.0.0.0:{free_port()}", "--metrics-listen", "", "--log-json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVLOOP_")},
    )
    try:
        assert wide.stderr is not None
        for line in wide.stderr:  # until the daemon says it listens
            if "kvloopd is exposed" in line:
                assert json.loads(line)["level"] == "warning"
                break
            assert "kvloopd listening" not in line, "listened without the warning"
        else:
            raise AssertionError("kvloopd ended without the warning")
    finally:
        wide.terminate()
        wide.wait(15)
        proc.stop()
    assert "kvloopd is exposed" not in proc.log()


def test_check_config_connect_reaches_redis(redis_url):
    reached = _kvloopd("--store", redis_url, "--check-config", "--connect")
    assert reached.returncode == 0, reached.stderr
    assert "kvloopd: store reachable (redis)" in reached.stderr
    down = _kvloopd("--store", f"redis://127.0.0.1:{free_port()}/0", "--check-config", "--connect")
    assert down.returncode == 1
    [line] = _clean(down)
    assert line.startswith("kvloopd: cannot use the store at redis://127.0.0.1:")


def test_agent_token_file_errors_are_one_line(tmp_path):
    config = tmp_path / "agent.toml"
    config.write_text('model = "m"\nblock_size = 16\ntoken_file = "/nowhere/agent.token"\n')
    result = subprocess.run(
        [str(BIN / "kvloop-agent"), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(Path(sys.executable).parent)},
    )
    assert result.returncode == 2
    assert _clean(result) == [
        f"kvloop-agent: {config}: token_file: cannot read /nowhere/agent.token: No such file or directory"
    ]


def test_proxy_reads_client_keys_from_a_file(tmp_path):
    """`--api-key-file` (KVLOOP_PROXY_API_KEY_FILE, a systemd credential): one key a line."""
    keys = tmp_path / "api-keys"
    keys.write_text("first-client-key\n\nsecond-client-key\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOP_")}
    proxy = spawn_proxy(tmp_path, port, env={**env, "KVLOOP_PROXY_API_KEY_FILE": str(keys)})

    def status(key: str | None) -> int | None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            return urllib.request.urlopen(request, timeout=5).status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            assert proxy.poll() is None, (tmp_path / "proxy.log").read_text()
            return None

    try:
        assert wait_until(lambda: status(None), what="the proxy to answer") == 401
        assert status("second-client-key") != 401 and status("first-client-key") != 401
        assert status("not-a-key") == 401
    finally:
        proxy.terminate()
        assert proxy.wait(15) == 0
    missing = subprocess.run(
        [
            str(BIN / "kvloop"),
            "proxy",
            "--prefill",
            "http://x",
            "--decode",
            "http://y",
            "--api-key-file",
            "/nope",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert missing.returncode == 2 and "cannot read /nope" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_the_proxys_directory_client_takes_the_global_token_and_tls_flags(tmp_path, monkeypatch):
    """`kvloop --token T --ca-file CA proxy --route` gives its Route client those, each flag falling
    back to its KVLOOP_* variable (before, the proxy read the variables alone)."""
    from typer.testing import CliRunner

    import kvloop.clients.proxy.app as proxy_app
    from kvloop.clients.cli.main import app

    seen = {}

    async def serve(config, *_args):
        seen["security"] = config.directory_security

    monkeypatch.setattr(proxy_app, "serve", serve)
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    monkeypatch.setenv("KVLOOP_TOKEN", "from-env")
    args = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--route"]
    result = CliRunner().invoke(app, ["--token", "from-flag", "--ca-file", str(ca), *args])
    assert result.exit_code == 0, result.output
    assert seen["security"].token == "from-flag" and seen["security"].ca_file == ca
    monkeypatch.setenv("KVLOOP_CA_FILE", str(ca))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen["security"].token == "from-env" and seen["security"].ca_file == ca
