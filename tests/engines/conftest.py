"""One prefill + one decode engine (real vLLM CPU engines with KvloopConnector) for the session.

Engines run in spawned subprocesses (see engine_harness.py for why), the decode engine publishes
its KV events over vLLM's ZMQ publisher and a fake kvloopd (fake_directory.py) indexes them and
serves the prefill engine's real gRPC lookups.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# the engine tests need the vLLM CPU build and NIXL (checked without importing them: slow)
HAVE_ENGINES = all(importlib.util.find_spec(m) is not None for m in ("vllm", "nixl"))

# Lease of retained runs on the decode engine in these tests (long enough for every test's
# pulls, short enough that test_release can watch one expire).
RETENTION_TTL_S = 40.0
PREFILL_LEASE_S = 8
LOOKUP_BACKOFF_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EnginePair:
    prefill: object
    decode: object
    directory: object
    timings: dict


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_harness import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engines(tiny_model: Path) -> Iterator[EnginePair]:
    if not HAVE_ENGINES:
        pytest.skip("vLLM CPU build / NIXL not installed")
    from engine_harness import EngineHandle, EngineSpec
    from fake_directory import FakeDirectory

    # Same hash seed everywhere (sha256_cbor hashes are seeded by PYTHONHASHSEED's NONE_HASH).
    os.environ["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "0")
    ev_port = _free_port()
    directory = FakeDirectory(f"tcp://127.0.0.1:{ev_port}")
    common = {
        "kvloop_retention_ttl_s": RETENTION_TTL_S,
        "kv_recompute_threshold": 32,
        "kvloop_min_pull_tokens": 32,
    }
    t0 = time.perf_counter()
    decode = EngineHandle(
        EngineSpec(
            "decode",
            str(tiny_model),
            _free_port(),
            "decode-0",
            {**common, "kvloop_worker_id": "decode-0"},
            kv_events_endpoint=f"tcp://*:{ev_port}",
        )
    )
    prefill = EngineHandle(
        EngineSpec(
            "prefill",
            str(tiny_model),
            _free_port(),
            "prefill-0",
            {
                **common,
                "kvloop_worker_id": "prefill-0",
                "kvloop_lookup_timeout_ms": 200,
                "kvloop_lookup_backoff_s": LOOKUP_BACKOFF_S,
                # forward (P->D) leases of this prefill's blocks; short so a test can empty
                # the prefill's prefix cache (reset_prefix_cache needs every block free)
                "kv_lease_duration": PREFILL_LEASE_S,
            },
            directory_target=directory.target,
        )
    )
    try:
        d_info = decode.wait_ready()
        p_info = prefill.wait_ready()
        timings = {
            "start_wall_s": time.perf_counter() - t0,
            "decode_start_s": d_info["start_s"],
            "prefill_start_s": p_info["start_s"],
        }
        # Warm both engines (first request pays one-off kernel/allocator setup).
        for e in (prefill, decode):
            e.generate(list(range(2, 100)), 1, cache_salt="warmup")
        prefill.call("spans")
        yield EnginePair(prefill, decode, directory, timings)
    finally:
        prefill.stop()
        decode.stop()
        directory.close()
