#!/usr/bin/env bash
# `make gpu-check`: kvloop on one GPU (prefill and decode as two engines sharing it) with the official
# vLLM wheel, in three steps, their figures in one JSON ($GPU_CHECK_JSON, gpu-check.json):
#   1. the KV-equality engine tests on the GPU: a pull from a decode's KV cache and one from its host
#      pool give, block by block, the KV a recompute gives (random-weight model built here);
#   2. `kvloop demo` with a host pool, every run given up from the KV cache once copied: turns 2-6
#      pull from the pool;
#   3. `kvloop bench gpu`: continuation TTFT against recompute at 8K, 16K and 24K-token prompts, from
#      the KV cache and from the pool, with READ and copy GB/s as NIXL timed them.
# Without an NVIDIA GPU it says so and exits 0 having installed and run nothing.
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
RESULTS=.kvloop-gpu
JSON=${GPU_CHECK_JSON:-gpu-check.json}
nvidia-smi -L | head -1
if [ ! -x "$GPU_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$GPU_VENV"
  "$GPU_VENV/bin/python" -m pip install -q --upgrade pip
fi
# The official wheel brings its CUDA torch; NIXL's default install brings its CUDA builds.
"$GPU_VENV/bin/python" -m pip install -q "vllm==$VLLM_GPU" "nixl==$NIXL" tokenizers transformers -e '.[bench,test]'
export KVLOOP_PLATFORM=cuda NIXL_LOG_LEVEL=WARN
mkdir -p "$RESULTS"
# what runs (no kvloopd yet: its problem line is expected)
"$GPU_VENV/bin/kvloop" doctor || true
echo "== KV equality on the GPU (engine tests)"
kv_rc=0
"$GPU_VENV/bin/python" -m pytest -q -p no:cacheprovider --junitxml "$RESULTS/kv-equality.xml" \
  "tests/engines/test_reverse_pull.py::test_four_turn_conversation_transfers_each_turn" \
  "tests/engines/test_host_tier.py::test_a_pull_from_the_host_pool_gives_the_kv_a_recompute_gives" || kv_rc=$?
echo "== kvloop demo with a host pool (vLLM $VLLM_GPU on the GPU)"
"$GPU_VENV/bin/kvloop" demo --workdir .kvloop-gpu-demo --host-retention-gib 4 --host-demote-after-s 0 --json \
  > "$RESULTS/demo.jsonl"
echo "== kvloop bench gpu (vLLM $VLLM_GPU on the GPU)"
"$GPU_VENV/bin/kvloop" bench gpu --workdir .kvloop-gpu-bench --output "$RESULTS/bench.json"
"$GPU_VENV/bin/python" -m kvloop.clients.bench.gpu_check_report "$RESULTS" "$kv_rc" "$VLLM_GPU" > "$JSON"
echo "gpu-check: figures in $JSON"
[ "$kv_rc" -eq 0 ]
