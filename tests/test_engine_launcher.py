"""`kvloop engine`'s platforms: the CPU build keeps its small-host settings, CUDA gets vLLM's GPU
defaults; --tensor-parallel-size and arguments after `--` reach `vllm serve`; an unsupported vLLM is
refused with one line before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvloop.agents.engine import EngineConfig


def config(**fields) -> EngineConfig:
    base = dict(
        role="decode",
        model="/models/m",
        served_model_name="m",
        worker_id="d0",
        port=8100,
        nixl_port=5601,
        kv_events_port=5557,
        daemon="127.0.0.1:50051",
    )
    return EngineConfig(**{**base, **fields})


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cpu_keeps_the_cpu_builds_settings(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    cpu = config(platform="cpu")
    cmd, env = cpu.vllm_command(), cpu.vllm_env()
    assert "--enforce-eager" in cmd
    assert flag(cmd, "--max-model-len") == "16384"
    assert flag(cmd, "--distributed-executor-backend") == "uni"
    assert json.loads(flag(cmd, "--kv-transfer-config") or "")["kv_buffer_device"] == "cpu"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["UCX_TLS"] == "cma,tcp,self"


def test_cuda_uses_vllms_gpu_defaults(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    gpu = config(platform="cuda", tensor_parallel_size=2, extra_vllm_args=["--gpu-memory-utilization", "0.4"])
    cmd, env = gpu.vllm_command(), gpu.vllm_env()
    for cpu_only in (
        "--enforce-eager",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--distributed-executor-backend",
    ):
        assert cpu_only not in cmd  # CUDA graphs, the model's context length, vLLM's executor
    assert json.loads(flag(cmd, "--kv-transfer-config") or "")["kv_buffer_device"] == "cuda"
    assert flag(cmd, "--tensor-parallel-size") == "2"
    assert cmd[-2:] == ["--gpu-memory-utilization", "0.4"]
    for cpu_only in (
        "VLLM_TARGET_DEVICE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_CPU_KVCACHE_SPACE",
        "UCX_TLS",
    ):
        assert cpu_only not in env  # the environment's UCX transports, vLLM's own engine processes
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601" and env["PYTHONHASHSEED"]
    monkeypatch.setenv("UCX_TLS", "rc,cuda_copy,cuda_ipc")
    assert gpu.vllm_env()["UCX_TLS"] == "rc,cuda_copy,cuda_ipc"


def test_an_unsupported_vllm_is_refused_in_one_line(tmp_path: Path):
    dist = tmp_path / "vllm-0.31.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = ["engine", "--role", "decode", "--model", "m", "--worker-id", "d0", "--", "--enforce-eager"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvloop.clients.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "kvloop's connector supports vLLM 0.32.0, 0.33.0; vLLM 0.31.0 is installed." in lines[0]
    assert not (tmp_path / ".kvloop-engine-logs").exists()  # nothing was started


def test_a_paused_engine_stops_its_whole_process_group_until_it_continues(tmp_path: Path):
    """What `bench multiturn --pause-other-arms` does to the arms not taking their turn."""
    from kvloop.agents.engine import Engine
    from kvloop.common.processes import supervisor
    from tests.support import wait_until

    engine = Engine(config(), tmp_path)
    # a leader and a child of its group, as `vllm serve` and its engine core are
    engine.vllm = supervisor().spawn(["bash", "-c", "sleep 60 & wait"])
    try:
        wait_until(lambda: _children(engine.vllm.pid))

        def states() -> set[str]:
            pids = [engine.vllm.pid, *_children(engine.vllm.pid)]
            return {Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in pids}

        engine.pause(True)
        wait_until(lambda: states() == {"T"})
        engine.pause(False)
        wait_until(lambda: "T" not in states())
    finally:
        engine.pause(False)
        os.killpg(engine.vllm.pid, 9)
        engine.vllm.wait()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found += [int(c) for c in children]
    return found
