"""`make gpu-check` on a machine without a GPU: it says so, exits 0 and installs or runs nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return any(line.startswith("GPU ") for line in listed.stdout.splitlines())


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: gpu-check would run for real")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path: Path):
    venv = tmp_path / "venv-gpu"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GPU_VENV": str(venv)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "gpu-check: no NVIDIA GPU here (nvidia-smi lists none): nothing installed or run"
    )
    assert not venv.exists()
