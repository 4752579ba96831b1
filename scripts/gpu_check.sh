#!/usr/bin/env bash
# `make gpu-check`: the demo and the multi-turn benchmark on one GPU (prefill and decode as two
# engines sharing it) with the official vLLM wheel, figures printed. Without an NVIDIA GPU it says so
# and exits 0 having installed and run nothing.
#   GPU_VENV (.venv-gpu), PYTHON (python3), VLLM_GPU (the newest supported release), NIXL (1.5.1)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi lists none): nothing installed or run"
  exit 0
fi
GPU_VENV=${GPU_VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
VLLM_GPU=${VLLM_GPU:-$("$PYTHON" -c 'import sys; sys.path.insert(0, "."); from common.vllm_compat import SUPPORTED_VLLM; print(SUPPORTED_VLLM[-1])')}
NIXL=${NIXL:-1.5.1}
nvidia-smi -L | head -1
if [ ! -x "$GPU_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$GPU_VENV"
  "$GPU_VENV/bin/python" -m pip install -q --upgrade pip
fi
# The official wheel brings its CUDA torch; NIXL's default install brings its CUDA builds.
"$GPU_VENV/bin/python" -m pip install -q "vllm==$VLLM_GPU" "nixl==$NIXL" tokenizers transformers -e '.[bench]'
export KVLOOP_PLATFORM=cuda NIXL_LOG_LEVEL=WARN
# what runs (no kvloopd yet: its problem line is expected)
"$GPU_VENV/bin/kvloop" doctor || true
echo "== kvloop demo (vLLM $VLLM_GPU on the GPU)"
"$GPU_VENV/bin/kvloop" demo --workdir .kvloop-gpu-demo
echo "== kvloop bench multiturn --quick (vLLM $VLLM_GPU on the GPU)"
"$GPU_VENV/bin/kvloop" bench multiturn --quick --workdir .kvloop-gpu-bench
