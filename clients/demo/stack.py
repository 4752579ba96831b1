"""Start and stop the whole loop on one machine: kvloopd, a prefill and a decode `vllm serve` with
the kvloop connector and their sidecars, and the proxy. Used by `kvloop demo`, the benchmarks and
the end-to-end tests."""

from __future__ import annotations

import functools
import operator
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvloop.agents.engine import Engine, EngineConfig, EngineStartError
from kvloop.clients.client import DirectoryClient
from kvloop.common.addresses import free_port, free_port_pair
from kvloop.common.otlp_receiver import OtlpReceiver, SpanFile
from kvloop.common.processes import ChildProcesses, supervisor


@dataclass
class StackConfig:
    model_dir: Path
    workdir: Path
    served_model_name: str = "kvloop-tiny"
    decode_servers: int = 1
    prefill_servers: int = 1
    prefill_prefix_caching: bool = False  # off: emulates a fleet of prefill workers losing their cache
    mode: str = "kvloop"  # "kvloop" | "builtin" | "recompute" (see EngineConfig.mode)
    kv_cache_gib: int = 2
    block_size: int = 32
    dtype: str = "bfloat16"
    retention_ttl_s: float = 480.0
    # Where spans go when no OTLP endpoint is configured: the stack then runs an OTLP receiver
    # writing this file and points every process at it (vLLM exports its request spans only over OTLP).
    span_file: Path | None = None
    start_timeout_s: float = 240.0
    # The benchmark talks to the engines directly; a proxy would only take CPU from them.
    with_proxy: bool = True
    # Compute threads of prefill engines on the first half of the host's cores, decodes' on the other
    # half (vLLM's VLLM_CPU_OMP_THREADS_BIND): on one small host, what a disaggregated fleet has by
    # construction - a prefill's compute never takes a core from a decode's steps.
    pin_engines: bool = False
    decode_tp: int = 1  # tensor-parallel size of the decode servers


def engine_cores(role: str, cores: int | None = None) -> str:
    """The cores (a vLLM CPU binding such as "0-3") a pinned engine of `role` computes on."""
    cores = cores or os.cpu_count() or 1
    half = max(cores // 2, 1)
    first, last = (0, half - 1) if role == "prefill" else (min(half, cores - 1), cores - 1)
    return str(first) if first == last else f"{first}-{last}"


@dataclass
class Stack:
    config: StackConfig
    daemon_address: str = ""
    proxy_url: str = ""
    daemon: subprocess.Popen | None = None
    proxy: subprocess.Popen | None = None
    engines: list[Engine] = field(default_factory=list)
    # Every process of the stack is started and stopped through this (see kvloop.common.processes).
    children: ChildProcesses = field(default_factory=supervisor)
    receiver: OtlpReceiver | None = None

    @property
    def prefill(self) -> Engine:
        return self.engines[0]

    @property
    def prefills(self) -> list[Engine]:
        return self.engines[: self.config.prefill_servers]

    @property
    def decodes(self) -> list[Engine]:
        return self.engines[self.config.prefill_servers :]

    def _tracing_env(self) -> dict[str, str]:
        if self.receiver is None:
            return {}
        # Short export batches: a turn's spans reach the file while the user looks at the table.
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}

    def _env(self, service: str) -> dict[str, str]:
        return {**os.environ, "OTEL_SERVICE_NAME": service, **self._tracing_env()}

    def start(self, progress: Callable[[str, str], None] = lambda what, state: None) -> None:
        cfg = self.config
        logs = cfg.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if cfg.span_file and not _otlp_configured():
            self.receiver = OtlpReceiver(SpanFile(cfg.span_file).write).start()
            progress("traces", f"OTLP receiver at {self.receiver.endpoint} writing {cfg.span_file}")
        bin_dir = Path(sys.executable).parent
        daemon_port = free_port()
        self.daemon_address = f"127.0.0.1:{daemon_port}"
        progress("kvloopd", "starting")
        with (logs / "kvloopd.log").open("w") as log:
            self.daemon = self.children.spawn(
                [
                    str(bin_dir / "kvloopd"),
                    "--listen",
                    self.daemon_address,
                    "--metrics-listen",
                    f"127.0.0.1:{free_port()}",
                    "--log-json",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=self._env("kvloopd"),
            )
        with DirectoryClient(self.daemon_address, timeout=2) as client:
            client.wait_ready(30)
        progress("kvloopd", f"ready on {self.daemon_address}")
        from kvloop.clients.demo.model import DTYPE_BYTES, kv_bytes_per_block, kv_group_windows

        bytes_per_block = kv_bytes_per_block(
            cfg.model_dir, cfg.block_size, dtype_bytes=DTYPE_BYTES[cfg.dtype]
        )
        roles = ["prefill"] * cfg.prefill_servers + ["decode"] * cfg.decode_servers
        for i, role in enumerate(roles):
            name = f"prefill-{i}" if role == "prefill" else f"decode-{i - cfg.prefill_servers}"
            engine_env = self._tracing_env()
            if cfg.pin_engines:
                engine_env["VLLM_CPU_OMP_THREADS_BIND"] = engine_cores(role)
            self.engines.append(
                Engine(
                    EngineConfig(
                        role=role,
                        model=str(cfg.model_dir),
                        served_model_name=cfg.served_model_name,
                        worker_id=name,
                        port=free_port(),
                        nixl_port=free_port(),
                        kv_events_port=free_port_pair(),
                        daemon=self.daemon_address,
                        block_size=cfg.block_size,
                        dtype=cfg.dtype,
                        kv_cache_gib=cfg.kv_cache_gib,
                        retention_ttl_s=cfg.retention_ttl_s,
                        kv_bytes_per_block=bytes_per_block // (cfg.decode_tp if role == "decode" else 1),
                        tensor_parallel_size=cfg.decode_tp if role == "decode" else 1,
                        kv_group_windows=kv_group_windows(cfg.model_dir),
                        agent_health_port=free_port(),
                        prefix_caching=cfg.prefill_prefix_caching if role == "prefill" else True,
                        mode=cfg.mode,
                        env=engine_env,
                    ),
                    logs,
                    self.children,
                )
            )
        for engine in self.engines:
            engine.launch()
            progress(engine.config.worker_id, "starting vllm serve")
        deadline = time.monotonic() + cfg.start_timeout_s
        pending = list(self.engines)
        while pending:
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engines not ready after {cfg.start_timeout_s:.0f}s: "
                    f"{[e.config.worker_id for e in pending]} (logs in {logs})"
                )
            for engine in list(pending):
                if engine.ready():
                    pending.remove(engine)
                    progress(
                        engine.config.worker_id, f"ready in {engine.started_s:.0f}s at {engine.config.url}"
                    )
            time.sleep(0.5)  # polling engine health while they load
        if not cfg.with_proxy:
            return
        proxy_port = free_port()
        self.proxy_url = f"http://127.0.0.1:{proxy_port}"
        progress("proxy", "starting")
        with (logs / "proxy.log").open("w") as log:
            self.proxy = self.children.spawn(
                [
                    str(bin_dir / "kvloop"),
                    "--daemon",
                    self.daemon_address,
                    "proxy",
                    "--route",
                    "--listen",
                    f"127.0.0.1:{proxy_port}",
                    *functools.reduce(
                        operator.iadd, (["--prefill", p.config.url] for p in self.prefills), []
                    ),
                    *functools.reduce(operator.iadd, (["--decode", d.config.url] for d in self.decodes), []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=self._env("kvloop-proxy"),
            )
        _wait_http(f"{self.proxy_url}/health", self.proxy, logs / "proxy.log", 60)
        progress("proxy", f"ready at {self.proxy_url}")

    def wait_retained(self, runs: int, timeout_s: float = 5.0) -> bool:
        """Wait until the directory lists at least `runs` retained runs (the decode's announcement of a
        finished turn travels engine -> ZMQ -> sidecar -> kvloopd while the client prepares its next turn)."""
        deadline = time.monotonic() + timeout_s
        with DirectoryClient(self.daemon_address, timeout=2) as client:
            while time.monotonic() < deadline:
                if client.stats().retained_runs >= runs:
                    return True
                time.sleep(0.02)  # polling the directory
        return False

    def stop(self) -> None:
        """Stop the stack front to back: the proxy, then the engines and their sidecars together, then
        kvloopd (each process group: SIGTERM, a grace period, SIGKILL)."""
        self.children.stop(self.proxy, grace_s=10)
        self.children.stop(*(p for e in self.engines for p in (e.agent, e.vllm)))
        self.children.stop(self.daemon, grace_s=10)
        if self.receiver is not None:  # last: the processes flush their spans to it as they exit
            self.receiver.stop()
            self.receiver = None


def _otlp_configured() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _wait_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EngineStartError(f"{url} process exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code == 503:  # up, backends not yet checked
                time.sleep(0.2)
                continue
            raise
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)  # polling a health endpoint while the process starts
    raise EngineStartError(f"{url} not healthy after {timeout_s:.0f}s")
