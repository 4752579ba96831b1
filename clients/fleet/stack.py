"""Start and stop the whole loop on one machine: kvloopd, a prefill and a decode `vllm serve` with
the kvloop connector and their sidecars, and the proxy. Used by `kvloop demo`, the benchmarks and
the end-to-end tests."""

from __future__ import annotations

import functools
import json
import operator
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from kvloop.agents.connector.directory import TracedDirectoryClient
from kvloop.agents.engine import Engine, EngineConfig, EngineStartError
from kvloop.clients.directory_client import DaemonUnavailable, DirectoryClient, KvloopError
from kvloop.common.addresses import free_port, free_port_pair
from kvloop.common.block_hash import block_hashes
from kvloop.common.otlp_receiver import OtlpReceiver, SpanFile
from kvloop.common.processes import ChildProcesses, supervisor
from kvloop.common.tracing import not_sampled
from kvloop.v1 import directory_pb2 as pb


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
    max_model_len: int = 16384  # every engine's (vLLM --max-model-len)
    # Decodes: GiB of host memory retained runs are copied into (see EngineConfig.host_retention_gib).
    host_retention_gib: float = 0.0
    host_demote_after_s: float | None = None  # see EngineConfig.host_demote_after_s
    verify: str = "all"  # prefills: which pulls' READs are checked (see EngineConfig.verify)
    # Decodes: a fault file each (EngineConfig.fault_file, `<workdir>/faults-<worker>`), for bench chaos.
    fault_files: bool = False
    block_size: int = 32
    dtype: str = "bfloat16"
    retention_ttl_s: float = 480.0
    retention_max_share: float = 0.5  # see EngineConfig
    retention_yield: bool = True  # see EngineConfig
    # Where spans go when no OTLP endpoint is configured: the stack then runs an OTLP receiver
    # writing this file and points every process at it (vLLM exports its request spans only over OTLP).
    span_file: Path | None = None
    start_timeout_s: float = 240.0
    # The stack's own proxy (`--route`); off where a benchmark talks to the engines directly or starts
    # proxies of its own (start_proxy).
    with_proxy: bool = True
    # Compute threads of prefill engines on the first half of the host's cores, decodes' on the other
    # half (vLLM's VLLM_CPU_OMP_THREADS_BIND): on one small host, what a disaggregated fleet has by
    # construction - a prefill's compute never takes a core from a decode's steps.
    pin_engines: bool = False
    decode_tp: int = 1  # tensor-parallel size of the decode servers
    # UCX transports of the engines' NIXL READs (UCX_TLS); None: the environment's, else cma,tcp,self.
    ucx_tls: str | None = None
    # High availability on loopback: a Redis primary and replica, three Sentinels and two kvloopd
    # replicas sharing them; engines, sidecars and the proxy are given both replicas' addresses.
    ha: bool = False
    # Maps each kvloopd address to the one engines, sidecars and the proxy are given (`bench chaos`
    # puts a relay there that can cut or refuse their connections); None: the address itself.
    daemon_front: Callable[[str], str] | None = None
    # LoRA adapters every engine serves (name -> directory), as models of their own through the proxy.
    lora_modules: dict[str, Path] = field(default_factory=dict)
    # More `vllm serve` arguments for every engine (a tool-call parser, ...).
    extra_vllm_args: list[str] = field(default_factory=list)
    # "cpu" or "cuda" (EngineConfig.platform); "": detected (KVLOOP_PLATFORM, the installed vLLM, a GPU).
    platform: str = ""


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
    # Every proxy started (start_proxy) by name; the stack's own is "proxy".
    proxies: dict[str, subprocess.Popen] = field(default_factory=dict)
    engines: list[Engine] = field(default_factory=list)
    # Every process of the stack is started and stopped through this (see kvloop.common.processes).
    children: ChildProcesses = field(default_factory=supervisor)
    receiver: OtlpReceiver | None = None
    # Every kvloopd (address, process, log): the one daemon, or with --ha each replica.
    replicas: list[tuple[str, subprocess.Popen, Path]] = field(default_factory=list)
    # --ha: each redis-server by port (a fault stops the one Sentinel names primary), the Sentinels.
    _redis_servers: dict[int, ExitStack] = field(default_factory=dict)
    _redis: ExitStack = field(default_factory=ExitStack)
    sentinels: list[str] = field(default_factory=list)
    # What engines, sidecars and the proxy dial (daemon_address, or its fronts).
    agent_daemon_address: str = ""
    _daemon_args: tuple[str, ...] = ()
    # Each kvloopd's /metrics HOST:PORT by its gRPC address.
    daemon_metrics: dict[str, str] = field(default_factory=dict)

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

    def engine_env(self, role: str) -> dict[str, str]:
        """What an engine's environment adds to this process's: tracing, transports, cores."""
        env = self._tracing_env()
        if self.platform == "cuda":
            return env  # the environment's UCX transports (they must include CUDA ones), no CPU binding
        if self.config.ucx_tls:
            env["UCX_TLS"] = self.config.ucx_tls
        if self.config.pin_engines:
            env["VLLM_CPU_OMP_THREADS_BIND"] = engine_cores(role)
        return env

    def _env(self, service: str) -> dict[str, str]:
        return {**os.environ, "OTEL_SERVICE_NAME": service, **self._tracing_env()}

    @property
    def platform(self) -> str:
        if not self.config.platform:
            from kvloop.common.vllm_compat import detect_platform

            self.config.platform = detect_platform()
        return self.config.platform

    def start(self, progress: Callable[[str, str], None] = lambda what, state: None) -> None:
        cfg = self.config
        logs = cfg.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if cfg.span_file and not _otlp_configured():
            self.receiver = OtlpReceiver(SpanFile(cfg.span_file).write).start()
            progress("traces", f"OTLP receiver at {self.receiver.endpoint} writing {cfg.span_file}")
        if cfg.ha:
            self._daemon_args = ("--config", str(self._start_redis(progress)))
            for name in ("kvloopd-a", "kvloopd-b"):
                address = f"127.0.0.1:{free_port()}"
                log_path = logs / f"{name}.log"
                self.replicas.append((address, self._spawn_daemon(address, log_path), log_path))
            self.daemon = self.replicas[0][1]
            self.daemon_address = ",".join(address for address, _, _ in self.replicas)
        else:
            self.daemon_address = f"127.0.0.1:{free_port()}"
            self.daemon = self._spawn_daemon(self.daemon_address, logs / "kvloopd.log")
            self.replicas.append((self.daemon_address, self.daemon, logs / "kvloopd.log"))
        front = cfg.daemon_front or (lambda address: address)
        self.agent_daemon_address = ",".join(front(a) for a in self.daemon_address.split(","))
        for address in self.daemon_address.split(","):
            with DirectoryClient(address, timeout=2) as client:
                client.wait_ready(30)
            progress("kvloopd", f"ready on {address}")
        from kvloop.clients.fleet.model import DTYPE_BYTES, kv_bytes_per_block, kv_group_windows

        bytes_per_block = kv_bytes_per_block(
            cfg.model_dir, cfg.block_size, dtype_bytes=DTYPE_BYTES[cfg.dtype]
        )
        roles = ["prefill"] * cfg.prefill_servers + ["decode"] * cfg.decode_servers
        shared_gpu: list[str] = []
        if self.platform == "cuda" and "--gpu-memory-utilization" not in cfg.extra_vllm_args:
            # every engine of the stack shares the host's GPU(s): split vLLM's default 0.9 between them
            shared_gpu = ["--gpu-memory-utilization", f"{0.9 / len(roles):.2f}"]
        progress("platform", self.platform)
        for i, role in enumerate(roles):
            name = f"prefill-{i}" if role == "prefill" else f"decode-{i - cfg.prefill_servers}"
            engine_env = self.engine_env(role)
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
                        daemon=self.agent_daemon_address,
                        block_size=cfg.block_size,
                        dtype=cfg.dtype,
                        kv_cache_gib=cfg.kv_cache_gib,
                        max_model_len=cfg.max_model_len,
                        host_retention_gib=cfg.host_retention_gib if role == "decode" else 0.0,
                        host_nixl_port=free_port() if role == "decode" and cfg.host_retention_gib else 0,
                        host_demote_after_s=cfg.host_demote_after_s,
                        verify=cfg.verify,
                        fault_file=str(cfg.workdir / f"faults-{name}")
                        if cfg.fault_files and role == "decode"
                        else "",
                        retention_ttl_s=cfg.retention_ttl_s,
                        retention_max_share=cfg.retention_max_share,
                        retention_yield=cfg.retention_yield,
                        kv_bytes_per_block=bytes_per_block // (cfg.decode_tp if role == "decode" else 1),
                        tensor_parallel_size=cfg.decode_tp if role == "decode" else 1,
                        kv_group_windows=kv_group_windows(cfg.model_dir),
                        agent_health_port=free_port(),
                        prefix_caching=cfg.prefill_prefix_caching if role == "prefill" else True,
                        mode=cfg.mode,
                        platform=self.platform,
                        env=engine_env,
                        extra_vllm_args=[*_lora_args(cfg.lora_modules), *shared_gpu, *cfg.extra_vllm_args],
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
        self.proxy_url = self.start_proxy("proxy", ["--route"], progress)
        self.proxy = self.proxies["proxy"]

    def start_proxy(
        self,
        name: str,
        options: list[str],
        progress: Callable[[str, str], None] = lambda what, state: None,
    ) -> str:
        """Start a `kvloop proxy` with `options` in front of every engine of the stack, its log at
        logs/NAME.log; returns its URL once it answers healthy. Stopped with the stack."""
        logs = self.config.workdir / "logs"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        progress(name, f"starting kvloop proxy {' '.join(options)}")
        with (logs / f"{name}.log").open("w") as log:
            process = self.children.spawn(
                [
                    str(Path(sys.executable).parent / "kvloop"),
                    "--daemon",
                    self.agent_daemon_address,
                    "proxy",
                    *options,
                    "--listen",
                    f"127.0.0.1:{port}",
                    *functools.reduce(
                        operator.iadd, (["--prefill", p.config.url] for p in self.prefills), []
                    ),
                    *functools.reduce(operator.iadd, (["--decode", d.config.url] for d in self.decodes), []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=self._env("kvloop-proxy"),
            )
        self.proxies[name] = process
        _wait_http(f"{url}/health", process, logs / f"{name}.log", 60)
        progress(name, f"ready at {url}")
        return url

    def _spawn_daemon(self, address: str, log_path: Path) -> subprocess.Popen:
        self.daemon_metrics[address] = f"127.0.0.1:{free_port()}"
        with log_path.open("a") as log:
            return self.children.spawn(
                [
                    str(Path(sys.executable).parent / "kvloopd"),
                    "--listen",
                    address,
                    "--metrics-listen",
                    self.daemon_metrics[address],
                    "--log-json",
                    *self._daemon_args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=self._env("kvloopd"),
            )

    def _start_redis(self, progress: Callable[[str, str], None]) -> Path:
        """A Redis primary and replica and three Sentinels (quorum 2) on loopback; returns the kvloopd
        config that points at the Sentinels."""
        import redis

        from kvloop.clients.fleet.redis_local import local_redis, local_sentinel

        workdir = self.config.workdir / "redis"
        workdir.mkdir(parents=True, exist_ok=True)
        primary_port, replica_port = free_port(), free_port()
        progress("redis", "starting a primary, a replica and three sentinels")
        for port, extra in (
            (primary_port, []),
            (replica_port, ["--replicaof", "127.0.0.1", str(primary_port)]),
        ):
            self._redis_servers[port] = ExitStack()
            url = self._redis_servers[port].enter_context(local_redis(workdir, port=port, extra=extra))
        replica = url
        # down after 5 s: engines loading on a small host can starve Redis of CPU for a second or two,
        # and a Sentinel as quick as the tests' (1 s) then fails over a primary that is only slow
        sentinels = [
            self._redis.enter_context(local_sentinel(workdir, primary_port, quorum=2, down_after_ms=5000))
            for _ in range(3)
        ]
        self.sentinels = sentinels
        deadline = time.monotonic() + 30
        with redis.Redis.from_url(replica) as client:
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the Redis replica did not sync (logs in {workdir})")
                time.sleep(0.05)  # polling the replica's link state
        progress("redis", f"primary 127.0.0.1:{primary_port}, replica {replica}, sentinels {sentinels}")
        config = self.config.workdir / "kvloopd-ha.toml"
        quoted = ", ".join(f'"{s}"' for s in sentinels)
        config.write_text(
            f'[store]\nurl = "redis:///0"\nsentinels = [{quoted}]\nsentinel_master = "kvloop"\n'
        )
        return config

    def replica_of(self, worker_id: str) -> int | None:
        """The index of the live kvloopd replica whose log last registered ``worker_id`` (--ha)."""
        import json

        found: tuple[str, int] | None = None
        for i, (_, process, log_path) in enumerate(self.replicas):
            if process.poll() is not None:
                continue
            for line in log_path.read_text().splitlines():
                if '"agent registered"' not in line or worker_id not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("worker_id") == worker_id and (found is None or record["timestamp"] > found[0]):
                    found = (record["timestamp"], i)
        return found[1] if found else None

    def kill_replica(self, index: int) -> str:
        """Kill a kvloopd replica outright (no drain, no goodbye on its streams); returns its address."""
        address, process, _ = self.replicas[index]
        process.kill()
        process.wait()
        return address

    def restart_replica(self, index: int) -> subprocess.Popen:
        """Start a killed kvloopd (replica) again on its address; returns the new process."""
        address, _, log_path = self.replicas[index]
        process = self._spawn_daemon(address, log_path)
        self.replicas[index] = (address, process, log_path)
        if index == 0:
            self.daemon = process
        return process

    def kill_redis_primary(self) -> str:
        """Stop the redis-server the Sentinels currently name primary; returns its address."""
        primary = self.primary()
        self._redis_servers.pop(int(primary.rsplit(":", 1)[1])).close()
        return primary

    def primary(self) -> str:
        """HOST:PORT of the Redis primary, as the first Sentinel names it (--ha)."""
        import redis

        host, port = self.sentinels[0].rsplit(":", 1)
        with redis.Redis(host=host, port=int(port)) as sentinel:
            primary_host, primary_port = sentinel.sentinel_get_master_addr_by_name("kvloop")
        host_text = primary_host.decode() if isinstance(primary_host, bytes) else primary_host
        return f"{host_text}:{primary_port}"

    def rejoin_redis(self, old_primary: str, timeout_s: float = 60.0) -> str:
        """Once Sentinel has promoted another server, start the stopped ``old_primary`` again as a
        replica of the new one (so a later failover has somewhere to go); returns the new primary."""
        from kvloop.clients.fleet.redis_local import local_redis

        deadline = time.monotonic() + timeout_s
        while (primary := self.primary()) == old_primary:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Sentinel named no new primary within {timeout_s:.0f}s")
            time.sleep(0.1)  # polling Sentinel for the failover
        new_host, new_port = primary.rsplit(":", 1)
        port = int(old_primary.rsplit(":", 1)[1])
        self._redis_servers[port] = ExitStack()
        self._redis_servers[port].enter_context(
            local_redis(self.config.workdir / "redis", port=port, extra=["--replicaof", new_host, new_port])
        )
        return primary

    def directory_epochs(self) -> list[tuple[int, bool]] | None:
        """Per live kvloopd replica, its directory epoch and whether it waits for agents to re-push
        (a probe Lookup answered RECOMPUTE ``directory_resyncing``); None when one does not answer."""
        answers = []
        for address, process, _ in self.replicas:
            if process.poll() is not None:
                continue
            try:
                with DirectoryClient(address, timeout=2) as client:
                    answer = client.lookup(self.config.served_model_name, [bytes(32)])
            except KvloopError:
                return None
            answers.append((answer.directory_epoch, answer.reason == pb.DECISION_REASON_DIRECTORY_RESYNCING))
        return answers

    def directory_epoch(self, timeout_s: float = 10.0) -> int:
        """The newest directory epoch the live replicas serve, once every one of them answers (a
        failover is judged against it: with a replica silent the epoch read would be too old)."""
        deadline = time.monotonic() + timeout_s
        while (answers := self.directory_epochs()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a kvloopd replica did not answer within {timeout_s:.0f}s")
            time.sleep(0.05)  # polling the replicas
        return max((epoch for epoch, _ in answers), default=0)

    def settled(self, past_epoch: int = -1) -> bool:
        """Every live replica serves one directory epoch, newer than ``past_epoch``, and none waits for
        its agents to re-push: a failover's resync wave, which reaches each replica when that replica
        sees the primary move, is over."""
        answers = self.directory_epochs()
        if not answers:
            return False
        return (
            len({epoch for epoch, _ in answers}) == 1
            and answers[0][0] > past_epoch
            and not any(resyncing for _, resyncing in answers)
        )

    def wait_failed_over(self, old_primary: str, past_epoch: int, timeout_s: float = 60.0) -> bool:
        """Wait until Sentinel names a primary other than ``old_primary`` and every replica has moved
        past ``past_epoch`` with its agents' state re-pushed (--ha)."""
        from redis.exceptions import RedisError

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.primary() != old_primary and self.settled(past_epoch):
                    return True
            except RedisError:  # a Sentinel between answers
                pass
            time.sleep(0.05)  # polling Sentinel and the replicas
        return False

    def wait_retained(self, runs: int, timeout_s: float = 5.0) -> bool:
        """Wait until the directory lists at least `runs` retained runs (the decode's announcement of a
        finished turn travels engine -> ZMQ -> sidecar -> kvloopd while the client prepares its next turn)."""
        deadline = time.monotonic() + timeout_s
        with DirectoryClient(self.daemon_address, timeout=2) as client:
            while time.monotonic() < deadline:
                try:
                    if client.stats().retained_runs >= runs:
                        return True
                except DaemonUnavailable:  # --ha: a replica or the Redis primary is failing over
                    pass
                time.sleep(0.02)  # polling the directory
        return False

    def tokenize(self, messages: list[dict], model: str = "") -> list[int]:
        """The token ids of the chat prompt ``messages``, rendered by a decode's ``/tokenize``."""
        request = json.dumps({"model": model or self.config.served_model_name, "messages": messages})
        url = f"{self.decodes[0].config.url}/tokenize"
        headers = {"Content-Type": "application/json"}
        post = urllib.request.Request(url, request.encode(), headers)
        with urllib.request.urlopen(post, timeout=30) as answer:
            return list(json.loads(answer.read())["tokens"])

    def wait_turn_retained(
        self,
        messages: list[dict],
        model: str = "",
        cache_salt: str = "",
        timeout_s: float = 60.0,
        tier: int = 0,
        only: bool = False,
    ) -> bool:
        """Wait until a decode's retained run holds the last full block of the chat prompt ``messages``
        (a turn that sent them ended; its retention travels engine -> ZMQ -> sidecar -> kvloopd). Exact
        where a count of runs is not: other runs come and go meanwhile. ``model`` may name a LoRA
        adapter of the stack's. With ``tier`` (a pb.BlockTier), until a run of that tier holds it; with
        ``only`` too, until every run holding it is of that tier (the host: its copy announced and the
        KV cache's run given up)."""
        model = model or self.config.served_model_name
        adapter = self.config.lora_modules.get(model)
        tokens = self.tokenize(messages, model)
        base = self.config.served_model_name
        # a poll, not a turn: its calls carry an unsampled trace context, so kvloopd records no trace
        with not_sampled(), TracedDirectoryClient(self.daemon_address, timeout=5) as client:
            spec = client.list_workers(base)[0].registration
            hashes = block_hashes(
                tokens,
                spec.block_size,
                spec.hash_algorithm,
                spec.hash_seed,
                cache_salt,
                lora=(model, str(adapter)) if adapter is not None else None,
            )
            if not hashes:
                raise ValueError(f"a prompt of {len(tokens)} tokens has no full block of {spec.block_size}")
            lora_name = model if adapter is not None else ""
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    found = client.find_block(base, hashes[-1], lora_name=lora_name)
                except DaemonUnavailable:  # --ha: a replica or the Redis primary is failing over
                    found = []
                tiers = {loc.tier for loc in found if loc.kind == "retained"}
                if tiers and (not tier or (tiers == {tier} if only else tier in tiers)):
                    return True
                time.sleep(0.02)  # polling the directory
        return False

    def stop(self) -> None:
        """Stop the stack front to back: the proxy, then the engines and their sidecars together, then
        kvloopd (each process group: SIGTERM, a grace period, SIGKILL)."""
        self.children.stop(*self.proxies.values(), grace_s=10)
        self.children.stop(*(p for e in self.engines for p in (e.agent, e.vllm)))
        self.children.stop(*(process for _, process, _ in self.replicas), grace_s=10)
        for server in self._redis_servers.values():
            server.close()
        self._redis.close()
        if self.receiver is not None:  # last: the processes flush their spans to it as they exit
            self.receiver.stop()
            self.receiver = None


def _lora_args(modules: dict[str, Path], max_rank: int = 8) -> list[str]:
    if not modules:
        return []
    served = [f"{name}={path}" for name, path in modules.items()]
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(max_rank),
        "--max-loras",
        str(len(modules)),
        "--lora-modules",
        *served,
    ]


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
