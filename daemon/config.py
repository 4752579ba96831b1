"""kvloopd settings: defaults < TOML file < KVLOOP_* environment < command-line flags."""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvloop.common.addresses import HostPort, OptionalHostPort, parse_host_port
from kvloop.common.config_files import ReadableFile, error_lines, read_secret
from kvloop.common.security import TlsSettings, TokenGrant
from kvloop.daemon.index import IndexConfig
from kvloop.daemon.policy_config import PolicyConfig

DEFAULT_CONFIG_PATH = Path("/etc/kvloop/kvloopd.toml")


class StoreSettings(BaseModel):
    """Where the directory lives: this process's memory (the default), or a Redis (>= 7.0, or Valkey)
    that any number of kvloopd replicas share. ``[store]`` in TOML, KVLOOP_STORE__* in the environment."""

    model_config = ConfigDict(extra="forbid")

    # "memory", or redis://[user:password@]host:port/db, rediss://... (TLS), unix:///path?db=0
    url: str = "memory"
    # Redis Sentinel (HOST:PORT of each): kvloopd follows the primary they elect, and takes the
    # directory's epoch from their quorum-agreed config epoch. ``url`` then names only the database
    # (redis:///0, rediss:///0 for TLS to the primary).
    sentinels: list[HostPort] = []
    sentinel_master: str = "kvloop"
    # A Redis Cluster: ``url`` names any of its nodes, and each model's index is spread over
    # ``cluster_buckets`` hash tags, in columns of ``cluster_spread`` that a chain's first block picks
    # (see kvloop.daemon.index.cluster_layout): a Lookup or a Route asks a column's buckets side by
    # side. 1 keeps a chain in one bucket: one call each, but conversations that share a system
    # prompt share a primary.
    cluster: bool = False
    cluster_buckets: int = Field(default=64, ge=1, le=16384)
    cluster_spread: int = Field(default=3, ge=1, le=16384)
    # ACL user and password; kept out of the URL so they stay out of process listings.
    username: str | None = None
    password: SecretStr | None = None
    # ...or the password in a file of its own (a systemd credential: "${CREDENTIALS_DIRECTORY}/...").
    password_file: ReadableFile | None = None
    # TLS (rediss://): the CA that signs the server's certificate, and a client certificate if the
    # server asks for one.
    tls_ca_file: ReadableFile | None = None
    tls_cert_file: ReadableFile | None = None
    tls_key_file: ReadableFile | None = None

    @model_validator(mode="after")
    def _one_topology(self) -> StoreSettings:
        if self.cluster and self.sentinels:
            raise ValueError("give cluster or sentinels, not both: a Redis Cluster fails over by itself")
        if self.cluster and self.url == "memory":
            raise ValueError("cluster = true needs url to name a node of the cluster (redis://HOST:PORT)")
        return self

    @model_validator(mode="after")
    def _password_file(self) -> StoreSettings:
        if self.password_file is not None:
            if self.password is not None:
                raise ValueError("give password or password_file, not both")
            self.password = SecretStr(read_secret(self.password_file))
        return self

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if value != "memory" and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"store url must be 'memory' or redis://, rediss://, unix://, got {value!r}")
        return value

    @field_serializer("url")
    def _redacted(self, value: str) -> str:
        from kvloop.daemon.index.redis_wire import redacted

        return redacted(value)

    def redis_options(self) -> dict[str, Any]:
        """redis-py connection options beyond the URL."""
        options: dict[str, Any] = {}
        if self.username:
            options["username"] = self.username
        if self.password is not None:
            options["password"] = self.password.get_secret_value()
        if self.tls_ca_file:
            options["ssl_ca_certs"] = str(self.tls_ca_file)
        if self.tls_cert_file:
            options["ssl_certfile"] = str(self.tls_cert_file)
        if self.tls_key_file:
            options["ssl_keyfile"] = str(self.tls_key_file)
        return options


class DaemonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVLOOP_", env_nested_delimiter="__", extra="forbid")

    listen: HostPort = "127.0.0.1:50051"
    # Prometheus /metrics; empty string turns it off.
    metrics_listen: OptionalHostPort = "127.0.0.1:9464"
    log_level: str = "info"
    log_json: bool | None = None
    # Also write spans as JSON lines here (besides OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set).
    span_file: str | None = None

    lease_s: float = Field(10.0, gt=0)
    heartbeat_interval_s: float = Field(2.0, gt=0)
    drop_after_s: float = Field(60.0, gt=0)
    expiry_margin_s: float = Field(2.0, ge=0)
    # A puller reads a run it is handed (Lookup, Route plans) within this long, or recomputes: a
    # decode that gives up a retained run early (its retention share is full) frees the blocks this
    # long after the directory dropped the run. At least 10 s: a connector keeps a Route plan for
    # the window less its own expiry margin (6 s by default), and reads within the window less its
    # READ margin (2 s). Replicas over one Redis must share it: a decode takes the window from the
    # replica that confirms its drop.
    read_window_s: float = Field(30.0, ge=10)
    max_entries: int = Field(4_000_000, gt=0)
    reap_interval_s: float = Field(0.5, gt=0)
    # Largest accepted gRPC message and most block hashes in one message.
    max_message_bytes: int = Field(16 * 1024 * 1024, gt=1024)
    max_hashes_per_message: int = Field(262_144, gt=0)
    # Block hashes Route remembers of the token ids it hashed (about 360 bytes each; 0: none).
    route_hash_cache_blocks: int = Field(65_536, ge=0)
    shutdown_grace_s: float = Field(5.0, ge=0)
    # Objects allocated between young-generation garbage collections (Python's default is 700; see
    # kvloop.daemon.gc_tuning for why kvloopd collects less often).
    gc_young_threshold: int = Field(10_000, gt=0)

    store: StoreSettings = StoreSettings()
    policy: PolicyConfig = PolicyConfig()
    # Per-model policy overrides: [models."Qwen/Qwen3-32B"] recompute_threshold_tokens = 256
    models: dict[str, PolicyConfig] = {}

    tls: TlsSettings | None = None
    # Bearer tokens; none configured = no authentication (loopback development).
    tokens: list[TokenGrant] = []

    @field_validator("tokens")
    @classmethod
    def _distinct_tokens(cls, value: list[TokenGrant]) -> list[TokenGrant]:
        """A token given twice would carry whichever grant came last: refuse it (naming the entries,
        not the token)."""
        seen: dict[str, int] = {}
        for i, grant in enumerate(value):
            if grant.token in seen:
                raise ValueError(f"tokens[{i}] repeats the token of tokens[{seen[grant.token]}]")
            seen[grant.token] = i
        return value

    @field_validator("heartbeat_interval_s")
    @classmethod
    def _heartbeat(cls, value: float, info: Any) -> float:
        lease = info.data.get("lease_s")
        if lease is not None and value >= lease:
            raise ValueError(f"heartbeat_interval_s ({value}) must be shorter than lease_s ({lease})")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=_config_path()))

    def exposure_warnings(self) -> list[str]:
        """What is open to the network: kvloopd beyond loopback without TLS or tokens."""
        if _loopback(self.listen):
            return []
        if self.tls is None and not self.tokens:
            return [
                f"listen {self.listen} is beyond loopback with neither [tls] nor [[tokens]]: anyone who "
                "reaches it can read the directory, claim runs and drain workers"
            ]
        if self.tls is None:
            return [f"listen {self.listen} is beyond loopback without [tls]: bearer tokens travel in clear"]
        if not self.tokens:
            return [f"listen {self.listen} is beyond loopback without [[tokens]]: every caller is admin"]
        return []

    def index_config(self) -> IndexConfig:
        return IndexConfig(
            lease_s=self.lease_s,
            drop_after_s=self.drop_after_s,
            expiry_margin_s=self.expiry_margin_s,
            read_window_s=self.read_window_s,
            max_entries=self.max_entries,
        )


def _loopback(listen: str) -> bool:
    host, _ = parse_host_port(listen, "listen")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it resolves beyond loopback
        return False


class ConfigError(Exception):
    """Invalid configuration: one line per problem, each naming where the value came from, the key
    and what is wrong (never the value: it may be a secret)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


_explicit_config: Path | None = None


def _config_path() -> Path | None:
    path = _explicit_config or (
        Path(os.environ["KVLOOP_CONFIG"]) if os.environ.get("KVLOOP_CONFIG") else None
    )
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: config file does not exist")
        return path
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None


def load_settings(config_file: Path | None = None, **flags: Any) -> DaemonSettings:
    """Build settings; flags that are None are left to the file, environment and defaults.

    Raises ConfigError (one line per problem) for anything wrong, the TOML's syntax included."""
    global _explicit_config
    _explicit_config = config_file
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        path = _config_path()
        file_keys: set[str] = set()
        if path is not None:
            try:
                file_keys = set(tomllib.loads(path.read_text()))
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError([f"{path}: TOML syntax error: {exc}"]) from None
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError([f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}"]) from None

        def origin(key: str) -> str:
            if key in given:
                return "--" + key.replace("_", "-")
            env = f"KVLOOP_{key.upper()}"
            named = sorted(k for k in os.environ if k.upper() == env or k.upper().startswith(env + "__"))
            if named:
                return "environment " + named[0]
            if path is not None and key in file_keys:
                return str(path)
            return str(path) if path is not None else "settings"

        try:
            return DaemonSettings(**given)
        except ValidationError as exc:
            raise ConfigError(error_lines(exc, origin)) from None
    except FileNotFoundError as exc:
        raise ConfigError([str(exc)]) from None
    finally:
        _explicit_config = None
