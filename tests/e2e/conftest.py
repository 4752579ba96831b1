"""The served loop (kvloopd, prefill + 2 decode `vllm serve` with the kvloop connector, sidecars,
proxy) started once for the e2e tests, exporting spans to a real OTLP receiver."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

LORAS = ("tenant-a-lora", "tenant-b-lora")
HAVE_ENGINES = all(importlib.util.find_spec(m) is not None for m in ("vllm", "nixl"))


@pytest.fixture(scope="session")
def served_stack(tmp_path_factory, otlp_receiver) -> Iterator:
    if not HAVE_ENGINES:
        pytest.fail("the e2e tests need vLLM's CPU build and NIXL: run `make setup-engines` (make test does)")
    from kvloop.clients.fleet.model import build_tiny_llama, build_tiny_lora
    from kvloop.clients.fleet.stack import Stack, StackConfig

    workdir = tmp_path_factory.mktemp("stack")
    model = build_tiny_llama(workdir / "model")
    # two tenants' adapters (tests/e2e/test_tenant_isolation.py)
    adapters = {name: build_tiny_lora(model, workdir / name, seed=i) for i, name in enumerate(LORAS, 1)}
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_BSP_SCHEDULE_DELAY")}
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_receiver.endpoint
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    stack = Stack(
        StackConfig(
            model_dir=model,
            workdir=workdir,
            decode_servers=2,
            kv_cache_gib=1,
            lora_modules=adapters,
            # named and required tool choices (tests/e2e/test_proxy_conformance.py); pythonic needs no
            # special tokens in the tiny model's vocabulary
            extra_vllm_args=["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"],
        )
    )
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
