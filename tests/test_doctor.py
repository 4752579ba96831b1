"""`kvloop doctor` against a real kvloopd, and the supported-vLLM range it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvloop.common.vllm_compat import (
    SUPPORTED_VLLM,
    at_least,
    check_supported,
    detect_platform,
    release_of,
    unsupported_message,
)


def _doctor(daemon: str, *, env: dict[str, str] | None = None) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvloop.clients.cli.main", "--daemon", daemon, "--json", "doctor"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_doctor_json_reports_the_supported_range_and_a_live_daemon(daemon):
    code, found = _doctor(daemon.address)
    for key in ("kvloop", "python", "vllm", "supported_vllm", "nixl", "daemon", "problems"):
        assert key in found
    assert found["supported_vllm"] == ["0.32.0", "0.33.0"]
    assert found["python"]["version"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert found["daemon"]["address"] == daemon.address
    assert found["daemon"]["answers"] is True
    assert isinstance(found["daemon"]["workers"], int)
    assert not any("kvloopd" in p["problem"] for p in found["problems"])
    assert code == (1 if found["problems"] else 0)
    config = found["kv_transfer_config"]
    assert config["kv_connector"] == "KvloopConnector"
    assert config["kv_connector_module_path"] == "kvloop.agents.connector.connector"
    assert config["kv_connector_extra_config"]["kvloop_daemon"] == daemon.address
    if found["vllm"] is not None:
        assert found["vllm"]["supported"] == (release_of(found["vllm"]["version"]) in SUPPORTED_VLLM)


def test_doctor_names_each_problem_with_its_fix(tmp_path: Path):
    # An unsupported vLLM, as its installed metadata says (nothing is imported).
    dist = tmp_path / "vllm-0.34.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.1\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code, found = _doctor("127.0.0.1:1", env={**env, "KVLOOP_PLATFORM": "cuda"})
    assert code == 1
    expected = {"version": "0.34.1", "distribution": "vllm", "supported": False, "platform": "cuda"}
    assert found["vllm"] == expected
    problems = {p["problem"]: p["fix"] for p in found["problems"]}
    assert problems["vLLM 0.34.1 is not supported"] == unsupported_message("0.34.1")
    daemon = next(fix for what, fix in problems.items() if what.startswith("kvloopd does not answer"))
    assert "--daemon" in daemon
    assert found["daemon"]["answers"] is False
    # the GPU platform's connector config reads the KV cache on the device
    assert found["kv_transfer_config"]["kv_buffer_device"] == "cuda"

    human = subprocess.run(
        [sys.executable, "-m", "kvloop.clients.cli.main", "--daemon", "127.0.0.1:1", "doctor"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert human.returncode == 1
    assert "Traceback" not in human.stdout + human.stderr
    assert "NOT supported (supported: 0.32.0, 0.33.0)" in human.stdout
    assert "problem: vLLM 0.34.1 is not supported. Fix: kvloop's connector supports vLLM" in human.stdout


def test_the_supported_range_and_its_one_line_refusal():
    for release in SUPPORTED_VLLM:
        check_supported(release)
        check_supported(release + "+cpu")
    with pytest.raises(ImportError) as refused:
        check_supported("0.31.1")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("kvloop's connector supports vLLM 0.32.0, 0.33.0; vLLM 0.31.1 is installed.")
    assert "pip install vllm==0.33.0" in message
    assert at_least("0.33.0", "0.33.0") and at_least("0.33.1+cu129", "0.33.0") and at_least("1.0", "0.33.0")
    assert not at_least("0.32.0+cpu", "0.33.0")
    assert not at_least("0.9.2", "0.33.0")


def test_platform_can_be_forced(monkeypatch):
    monkeypatch.setenv("KVLOOP_PLATFORM", "cuda")
    assert detect_platform() == "cuda"
    monkeypatch.setenv("KVLOOP_PLATFORM", "cpu")
    assert detect_platform() == "cpu"


def test_whether_a_model_can_keep_a_host_pool(tmp_path: Path, daemon):
    """The host pool's rules (common/host_pool_support.py), as the engine applies them at start and the
    doctor applies them to a configuration ahead of it."""
    from kvloop.common.host_pool_support import PoolLayout, model_layout, pool_verdict, refusal

    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}
    hybrid = {
        "architectures": ["Gemma3ForCausalLM"],
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 128,
    }
    mamba = {"architectures": ["NemotronHForCausalLM"]}
    assert pool_verdict(model_layout(llama, gpu=True)).available
    assert pool_verdict(model_layout(hybrid, gpu=False)).available  # the CPU build keeps one block
    on_gpu = pool_verdict(model_layout(hybrid, gpu=True))
    assert on_gpu.available and any("kernel blocks" in x for x in on_gpu.at_start)
    assert pool_verdict(model_layout(mamba, gpu=True)).problems == ["Mamba/SSM state"]
    staged = pool_verdict(model_layout(llama, gpu=True, pipeline_parallel_size=2, kv_buffer_device="cpu"))
    assert staged.problems == [
        "pipeline parallelism",
        "a host staging buffer (kv_buffer_device cpu on a GPU)",
    ]
    assert refusal(staged) == (
        "kvloop_host_retention_gib does not support pipeline parallelism, a host staging buffer "
        "(kv_buffer_device cpu on a GPU): set it to 0"
    )
    assert refusal(pool_verdict(PoolLayout(kernel_blocks_per_block=2))) is not None

    (tmp_path / "config.json").write_text(json.dumps(mamba))
    proc = subprocess.run(
        [sys.executable, "-m", "kvloop.clients.cli.main", "--daemon", daemon.address, "--json", "doctor",
         "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    found = json.loads(proc.stdout)
    assert found["host_tier"]["available"] is False and found["host_tier"]["problems"] == ["Mamba/SSM state"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvloop.clients.cli.main", "doctor", "--model", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr
