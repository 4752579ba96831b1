"""kvloop-agent settings: defaults < TOML file < KVLOOP_AGENT_* environment < flags."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvloop.common.addresses import DaemonAddresses, OptionalHostPort
from kvloop.common.config_files import ReadableFile, read_secret
from kvloop.common.host_names import host_engine_id
from kvloop.common.security import ClientSecurity, TlsSettings


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVLOOP_AGENT_", extra="forbid")

    # kvloopd: one HOST:PORT, a DNS name with a record per replica, or several IP:PORT (a list, or
    # comma-separated). The stream moves to another replica when one fails and resumes where it was.
    daemon: DaemonAddresses = "127.0.0.1:50051"
    worker_id: str = Field(default_factory=socket.gethostname)
    role: Literal["prefill", "decode", "both"] = "decode"
    model: str
    engine_id: str = ""
    # NIXL side channel of the engine (VLLM_NIXL_SIDE_CHANNEL_HOST:PORT).
    nixl_endpoint: str = ""
    # The worker's host-memory pool, when its connector copies retained runs there (a NIXL engine of
    # its own): its side channel HOST:PORT, and its engine id (default: "<engine_id>@host"). Unset:
    # no host pool, and runs the engine announces in host memory are not forwarded.
    host_nixl_endpoint: OptionalHostPort = ""
    host_engine_id: str = ""
    http_endpoint: str = ""
    block_size: int = Field(gt=0)
    hash_algorithm: str = "sha256_cbor"
    hash_length: int = Field(32, ge=8, le=64)
    # The engine's PYTHONHASHSEED, from which vLLM seeds its block hashes (None: this process's
    # PYTHONHASHSEED, else vLLM's default). Registered so kvloopd can hash token ids for Route.
    hash_seed: str | None = None
    kv_bytes_per_block: int = Field(0, ge=0)
    # The engine's KV-cache element type and tensor-parallel size: the directory pairs a puller only
    # with holders whose KV it can read. "" / 0: unknown (not checked).
    kv_dtype: str = ""
    tensor_parallel_size: int = Field(1, ge=1)
    # Sliding window in tokens of each KV-cache group in vLLM's order (0: full attention); empty:
    # unknown. A hybrid model (e.g. Gemma 3) has several groups.
    kv_group_windows: list[int] = Field(default_factory=list)
    # vLLM's kv_events_config endpoint (PUB) and replay_endpoint (ROUTER), as the agent connects.
    kv_events: str = "tcp://127.0.0.1:5557"
    kv_events_replay: str | None = "tcp://127.0.0.1:5558"
    kv_events_topic: str = ""
    # Say so when no KV event arrives this long after start (engine without kv_events_config?).
    silent_engine_warning_s: float = Field(60.0, gt=0)
    # Poll the engine's /health (beside http_endpoint) this often; 0 disables. Failing this long
    # (refused, reset, error status; not a timeout) after answering once means the engine process
    # ended: its blocks leave the directory.
    engine_health_interval_s: float = Field(0.5, ge=0)
    engine_down_after_s: float = Field(1.0, gt=0)
    # /healthz and /metrics; empty disables.
    health_listen: OptionalHostPort = "127.0.0.1:9470"
    # HTTPS for /healthz and /metrics, as kvloopd's [tls]: a client CA requires client certificates.
    health_tls: TlsSettings | None = None
    log_level: str = "info"
    log_json: bool | None = None
    # Security towards kvloopd: the token inline or in a file of its own (a systemd credential,
    # "${CREDENTIALS_DIRECTORY}/token"); the files are opened at start.
    token: str | None = None
    token_file: ReadableFile | None = None
    ca_file: ReadableFile | None = None
    cert_file: ReadableFile | None = None
    key_file: ReadableFile | None = None

    @field_validator("kv_dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        """vLLM's --dtype spellings, as the connector names the KV cache's torch dtype."""
        value = value.strip().lower().removeprefix("torch.")
        return {
            "half": "float16",
            "fp16": "float16",
            "float": "float32",
            "fp32": "float32",
            "bf16": "bfloat16",
            "auto": "",
        }.get(value, value)

    @field_validator("kv_events")
    @classmethod
    def _zmq(cls, value: str) -> str:
        if not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events must be a ZMQ endpoint such as tcp://127.0.0.1:5557, got {value!r}")
        return value.replace("tcp://*:", "tcp://127.0.0.1:")

    @model_validator(mode="after")
    def _token_file(self) -> AgentSettings:
        if self.token_file is not None:
            if self.token:
                raise ValueError("give token or token_file, not both")
            self.token = read_secret(self.token_file)
        return self

    @model_validator(mode="after")
    def _host_pool(self) -> AgentSettings:
        if self.host_engine_id and not self.host_nixl_endpoint:
            raise ValueError("host_engine_id needs host_nixl_endpoint (the host pool's NIXL side channel)")
        return self

    def registered_engine_id(self) -> str:
        """The engine id the registration names (the worker id when none is configured)."""
        return self.engine_id or self.worker_id

    def registered_host_engine_id(self) -> str:
        """The host pool's engine id ("" without a host pool)."""
        if not self.host_nixl_endpoint:
            return ""
        return self.host_engine_id or host_engine_id(self.registered_engine_id())

    def security(self) -> ClientSecurity:
        return ClientSecurity(
            token=self.token, ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls,
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings,
        file_secret_settings,
    ):
        path = os.environ.get("KVLOOP_AGENT_CONFIG")
        sources: list[Any] = [init_settings, env_settings]
        if path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"{path}: config file does not exist")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(path)))
        return tuple(sources)
