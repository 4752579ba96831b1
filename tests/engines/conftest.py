"""One prefill + one decode engine (real vLLM CPU engines with KvloopConnector) for the session,
wired through the real kvloop control plane.

Engines run in spawned subprocesses (see engine_harness.py for why). The decode engine publishes
its KV events (vLLM's BlockStored/BlockRemoved plus the connector's retained/released events) over
vLLM's ZMQ publisher with a replay endpoint; a real ``kvloop-agent`` process streams them to a real
``kvloopd`` process, and the prefill engine's connector asks that kvloopd over gRPC. Tests observe
the directory only through kvloopd's public API (``DirectoryClient``) and produce failures for real
(kvloopd killed or restarted with other settings, the agent restarted, the decode engine killed).
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvloop.clients.directory_client import DaemonUnavailable
from kvloop.common.addresses import free_port_pair
from kvloop.common.processes import supervisor
from tests.conftest import KVLOOPD, DaemonProcess, free_port, start_daemon
from tests.support import wait_until

# the engine tests need the vLLM CPU build and NIXL (checked without importing them: slow)
HAVE_ENGINES = all(importlib.util.find_spec(m) is not None for m in ("vllm", "nixl"))

# Lease of retained runs on the decode engine in these tests (long enough for every test's
# pulls, short enough that test_release can watch one expire).
RETENTION_TTL_S = 40.0
PREFILL_LEASE_S = 8
LOOKUP_BACKOFF_S = 0.5
MODEL = "tiny-llama"
DECODE_WORKER = "decode-0"
BS = 32
# 2 (K, V) x 32 tokens x 6 heads x 64 dims x 2 bytes (bf16) x 4 layers
KV_BYTES_PER_BLOCK = 2 * 32 * 6 * 64 * 2 * 4
AGENT = str(Path(KVLOOPD).parent / "kvloop-agent")
# kvloopd for these tests: quick shutdown (tests kill and restart it)
DAEMON_ENV = {"KVLOOP_SHUTDOWN_GRACE_S": "0.5"}


@dataclass
class Run:
    """A retained run announced by the decode engine (as the tests know it)."""

    handle: str
    hashes: list[bytes]  # chained hashes of the full blocks of the decode's prompt
    created: float  # time.monotonic()


@dataclass
class KvloopStack:
    """The real kvloopd + decode-side kvloop-agent processes of the session."""

    tmp: Path
    port: int
    ev_port: int
    side_channel_port: int
    model: str = MODEL
    kv_bytes_per_block: int = KV_BYTES_PER_BLOCK
    decode_tp: int = 1
    daemon: DaemonProcess | None = None
    daemon_env: dict[str, str] = field(default_factory=dict)
    agent: subprocess.Popen | None = None
    agent_logs: list[Path] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    # More kvloop-agent arguments for the decode's agent (its host pool's engine, ...).
    agent_args: list[str] = field(default_factory=list)
    _client: object = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def client(self):
        from kvloop.clients.directory_client import DirectoryClient

        if self._client is None:
            self._client = DirectoryClient(self.address, timeout=5.0)
        return self._client

    # ---- kvloopd ----------------------------------------------------------------------------

    def start_daemon(self, env: dict[str, str] | None = None) -> None:
        assert self.daemon is None or self.daemon.process.poll() is not None
        self.daemon_env = {**DAEMON_ENV, **(env or {})}
        self.daemon = start_daemon(self.tmp, env=self.daemon_env, port=self.port)

    def kill_daemon(self) -> None:
        """Crash kvloopd (SIGKILL): its whole directory state is lost."""
        assert self.daemon is not None
        self.daemon.process.kill()
        self.daemon.process.wait(10)

    def restart_daemon(self, env: dict[str, str] | None = None) -> None:
        self.kill_daemon()
        self.start_daemon(env)
        self.wait_agent_connected()

    def daemon_default(self) -> bool:
        return (
            self.daemon is not None and self.daemon.process.poll() is None and self.daemon_env == DAEMON_ENV
        )

    # ---- kvloop-agent -----------------------------------------------------------------------

    def start_agent(self) -> None:
        assert self.agent is None or self.agent.poll() is not None
        log = self.tmp / f"agent-{len(self.agent_logs)}.log"
        self.agent_logs.append(log)
        self.agent = self.spawn_agent(
            DECODE_WORKER, "decode", self.side_channel_port, self.ev_port, log, extra=self.agent_args
        )

    def spawn_agent(
        self,
        worker_id: str,
        role: str,
        side_channel_port: int,
        ev_port: int,
        log: Path,
        tp: int | None = None,
        extra: list[str] | None = None,
    ) -> subprocess.Popen:
        """A kvloop-agent for one engine of this stack (its KV events on ``ev_port``, replay on the next)."""
        return supervisor().spawn(
            [
                AGENT,
                "--daemon",
                self.address,
                "--worker-id",
                worker_id,
                "--role",
                role,
                "--model",
                self.model,
                "--engine-id",
                worker_id,
                "--nixl-endpoint",
                f"127.0.0.1:{side_channel_port}",
                "--block-size",
                str(BS),
                "--kv-bytes-per-block",
                str(self.kv_bytes_per_block),
                "--tensor-parallel-size",
                str(self.decode_tp if tp is None else tp),
                "--kv-events",
                f"tcp://127.0.0.1:{ev_port}",
                "--kv-events-replay",
                f"tcp://127.0.0.1:{ev_port + 1}",
                "--health-listen",
                "",
                *(extra or []),
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVLOOP_")},
        )

    def stop_agent(self, sig: int = signal.SIGTERM) -> int:
        assert self.agent is not None
        self.agent.send_signal(sig)
        return self.agent.wait(15)

    def agent_log(self) -> str:
        return "\n".join(p.read_text() for p in self.agent_logs if p.exists())

    def wait_agent_connected(self, timeout: float = 30.0) -> None:
        def connected():
            if self.agent is None or self.agent.poll() is not None:
                raise AssertionError(f"kvloop-agent exited:\n{self.agent_log()}")
            try:
                return any(
                    w.registration.worker_id == DECODE_WORKER and w.connected
                    for w in self.client.list_workers(self.model)
                )
            except Exception:
                return False

        wait_until(connected, timeout, "kvloop-agent registered with kvloopd", interval=0.1)

    # ---- directory observations -------------------------------------------------------------

    def locations(self, block_hash: bytes, kind: str | None = None, handle: str | None = None) -> list:
        return [
            loc
            for loc in self.client.find_block(self.model, block_hash)
            if (kind is None or loc.kind == kind) and (handle is None or loc.retention_handle == handle)
        ]

    def wait_for_run(self, run: Run, timeout: float = 20.0, servable: bool | None = None) -> object:
        """Until kvloopd lists the retained run (its first block, under its handle), and, when
        `servable` is given, judges it servable or not."""

        def listed():
            try:
                found = self.locations(run.hashes[0], "retained", run.handle)
            except DaemonUnavailable:  # a kvloopd just restarted: the client reconnects within a second
                return []
            return [loc for loc in found if servable is None or loc.servable == servable]

        return wait_until(listed, timeout, f"retained run {run.handle} in kvloopd (servable={servable})")[0]


@dataclass
class EnginePair:
    prefill: object
    decode: object
    kvloop: KvloopStack
    timings: dict

    def probe_directory(self, timeout: float = 30.0) -> None:
        """Until the prefill engine's connector gets answers from kvloopd again (after a daemon
        restart its gRPC channel reconnects with backoff): a short prompt nobody holds -> 'miss'."""
        rnd = random.Random(time.monotonic_ns())

        def answered():
            out = self.prefill.generate(
                [rnd.randrange(2, 1024) for _ in range(2 * BS)], 1, {"do_remote_decode": True}
            )
            rid = out["kv_transfer_params"]["remote_request_id"]
            (span,) = [s for s in self.prefill.call("spans") if s.get("kvloop.request_id") == rid]
            if span["kvloop.path"] == "miss":
                return True
            assert span.get("kvloop.reason") == "directory_unavailable", span
            return False

        wait_until(answered, timeout, "the prefill connector to reach kvloopd", interval=LOOKUP_BACKOFF_S)

    def ensure_default_stack(self) -> None:
        """kvloopd (default settings) and the agent running, and the prefill connector reaching kvloopd."""
        k = self.kvloop
        restarted = False
        if not k.daemon_default():
            if k.daemon is not None and k.daemon.process.poll() is None:
                k.kill_daemon()
            k.start_daemon()
            restarted = True
        if k.agent is None or k.agent.poll() is not None:
            k.start_agent()
        k.wait_agent_connected()
        if restarted:
            self.probe_directory()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvloop.clients.fleet.model import build_tiny_llama

    # the product's builder, as the demo and benchmarks use it: hidden 384, 4 layers, 6 heads, vocab 1024
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def start_pair(
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    otlp_endpoint: str,
    model: str = MODEL,
    kv_bytes_per_block: int = KV_BYTES_PER_BLOCK,
    decode_tp: int = 1,
    host_retention_gib: float = 0.0,
    prefill_tp: int = 1,
) -> EnginePair:
    """kvloopd, a decode engine with its kvloop-agent and a prefill engine, all serving ``model_dir``;
    with ``host_retention_gib``, the decode copies retained runs into a host pool of that size."""
    from engine_harness import EngineHandle, EngineSpec

    # Same hash seed everywhere (sha256_cbor hashes are seeded by PYTHONHASHSEED's NONE_HASH).
    os.environ["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "0")
    ev_port = free_port_pair()  # the replay endpoint is ev_port + 1
    kvloop = KvloopStack(
        tmp_path_factory.mktemp("kvloop"),
        free_port(),
        ev_port,
        free_port(),
        model,
        kv_bytes_per_block,
        decode_tp,
    )
    kvloop.start_daemon()
    decode_extra: dict[str, Any] = {}
    if host_retention_gib:
        host_port = free_port()
        decode_extra = {
            "kvloop_host_retention_gib": host_retention_gib,
            "kvloop_host_side_channel_port": host_port,
            # give a run's KV-cache blocks up as soon as its host copy exists: pulls then read the pool
            "kvloop_host_demote_after_s": 0,
            "kvloop_daemon": kvloop.address,
            "kvloop_model": model,
        }
        kvloop.agent_args = [
            "--host-engine-id",
            f"{DECODE_WORKER}@host",
            "--host-nixl-endpoint",
            f"127.0.0.1:{host_port}",
        ]
    common = {
        "kvloop_retention_ttl_s": RETENTION_TTL_S,
        "kv_recompute_threshold": 32,
        "kvloop_min_pull_tokens": 32,
    }
    t0 = time.perf_counter()
    decode = EngineHandle(
        EngineSpec(
            "decode",
            str(model_dir),
            kvloop.side_channel_port,
            DECODE_WORKER,
            {**common, "kvloop_worker_id": DECODE_WORKER, **decode_extra},
            kv_events_endpoint=f"tcp://*:{ev_port}",
            kv_events_replay_endpoint=f"tcp://*:{ev_port + 1}",
            otlp_endpoint=otlp_endpoint,
            tensor_parallel_size=decode_tp,
            executor="mp" if decode_tp > 1 else "uni",
            multiprocessing=decode_tp > 1,
        ),
        timeout_s=600.0 if decode_tp > 1 else 300.0,  # a process per rank: slow to start on 2 cores
    )
    prefill = EngineHandle(
        EngineSpec(
            "prefill",
            str(model_dir),
            free_port(),
            "prefill-0",
            {
                **common,
                "kvloop_worker_id": "prefill-0",
                "kvloop_model": model,
                "kvloop_lookup_timeout_ms": 200,
                "kvloop_lookup_backoff_s": LOOKUP_BACKOFF_S,
                # forward (P->D) leases of this prefill's blocks; short so a test can empty
                # the prefill's prefix cache (reset_prefix_cache needs every block free)
                "kv_lease_duration": PREFILL_LEASE_S,
            },
            directory_target=kvloop.address,
            otlp_endpoint=otlp_endpoint,
            tensor_parallel_size=prefill_tp,
            executor="mp" if prefill_tp > 1 else "uni",
            multiprocessing=prefill_tp > 1,
        ),
        timeout_s=600.0 if prefill_tp > 1 else 300.0,
    )
    pair = EnginePair(prefill, decode, kvloop, {})
    try:
        d_info = decode.wait_ready()
        kvloop.start_agent()
        p_info = prefill.wait_ready()
        kvloop.wait_agent_connected()
        pair.timings = {
            "start_wall_s": time.perf_counter() - t0,
            "decode_start_s": d_info["start_s"],
            "prefill_start_s": p_info["start_s"],
        }
        # Warm both engines (first request pays one-off kernel/allocator setup).
        for e in (prefill, decode):
            e.generate(list(range(2, 100)), 1, cache_salt="warmup")
        prefill.call("spans")
    except BaseException:
        stop_pair(pair)
        raise
    return pair


def stop_pair(pair: EnginePair) -> None:
    kvloop = pair.kvloop
    pair.prefill.stop()
    pair.decode.stop()
    if kvloop.agent is not None and kvloop.agent.poll() is None:
        kvloop.stop_agent()
    if kvloop.daemon is not None:
        kvloop.daemon.stop()
    if kvloop._client is not None:
        kvloop.client.close()


class EngineSlot:
    """The session's one engine pair at a time: asking for another model's pair stops the current one
    (two pairs would be four engines on a 2-core host). Tests of the other models run last (see
    pytest_collection_modifyitems), so the tiny-Llama pair starts once."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, otlp_endpoint: str) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.otlp_endpoint = otlp_endpoint
        self.key: str | None = None
        self.pair: EnginePair | None = None

    def get(
        self,
        key: str,
        model_dir: Path,
        model: str,
        kv_bytes_per_block: int,
        decode_tp: int = 1,
        host_retention_gib: float = 0.0,
        prefill_tp: int = 1,
    ) -> EnginePair:
        if self.key != key or self.pair is None:
            self.close()
            self.pair = start_pair(
                model_dir,
                self.tmp_path_factory,
                self.otlp_endpoint,
                model,
                kv_bytes_per_block,
                decode_tp,
                host_retention_gib,
                prefill_tp,
            )
            self.key = key
        return self.pair

    def close(self) -> None:
        if self.pair is not None:
            pair, self.pair, self.key = self.pair, None, None
            stop_pair(pair)


# Modules whose engine pair serves another model than the tiny Llama: they run after every other
# engine test, so the session switches pairs once.
OTHER_MODEL_MODULES = (
    "test_host_tier.py",
    "test_host_tier_sharing.py",
    "test_hybrid.py",
    "test_hybrid_host.py",
    "test_tp.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in OTHER_MODEL_MODULES)


@pytest.fixture(scope="session")
def engine_slot(tmp_path_factory: pytest.TempPathFactory, otlp_receiver) -> Iterator[EngineSlot]:
    if not HAVE_ENGINES:
        pytest.skip("vLLM CPU build / NIXL not installed")
    slot = EngineSlot(tmp_path_factory, otlp_receiver.endpoint)
    try:
        yield slot
    finally:
        slot.close()


@pytest.fixture(scope="session")
def engines(tiny_model: Path, engine_slot: EngineSlot) -> EnginePair:
    return engine_slot.get("llama", tiny_model, MODEL, KV_BYTES_PER_BLOCK)


@pytest.fixture
def host_pair(engine_slot: EngineSlot, tiny_model: Path) -> EnginePair:
    """The tiny-Llama pair whose decode has a host pool (272 slots)."""
    return engine_slot.get("llama-host", tiny_model, MODEL, KV_BYTES_PER_BLOCK, host_retention_gib=0.05)
