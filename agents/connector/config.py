"""Typed kvloop settings parsed from ``kv_transfer_config.kv_connector_extra_config``.

Only keys prefixed ``kvloop_`` belong to kvloop; everything else (``bidirectional_kv_xfer``,
``decoder_kv_blocks_ttl``, ``kv_recompute_threshold``...) is vLLM NixlConnector's and is read by
vLLM itself.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvloop.agents.connector.host.eviction import LRU, POLICIES
from kvloop.common.addresses import daemon_addresses

PREFIX = "kvloop_"


class KvloopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Directory daemon "host:port"; empty -> no lookups (the prefill side never pulls). Several
    # replicas: a DNS name with a record per replica, or "ip:port,ip:port" (lookups go to a live one).
    daemon: str = ""
    # Stable name of this vLLM instance in the directory; defaults to the engine id.
    worker_id: str = ""
    # Served model name sent with lookups (blocks are namespaced by model).
    model: str = ""
    # Deadline of one Lookup RPC; the hook runs in the engine-core loop, keep it short.
    lookup_timeout_ms: float = Field(default=20.0, gt=0, le=5000)
    # How long the engine loop waits for a new request's lookup answer before moving on (and asking
    # again next step). Waiting releases the GIL, so the answer is taken at once. Moving on costs the
    # request a whole engine step, and a step with other prefills running lasts hundreds of ms to
    # seconds, so a wait shorter than a busy host's lookup costs more than it saves. Bounded: a slow
    # daemon still never stalls the loop longer than this per new request.
    lookup_wait_ms: float = Field(default=50.0, ge=0, le=1000)
    # After a failed lookup, skip lookups (recompute) for this long: a dead daemon costs one
    # timeout per half second, not one per request (the lookup runs off the engine loop), and a
    # directory back from a failover is asked again within half a second.
    lookup_backoff_s: float = Field(default=0.5, ge=0)
    # Lease of retained runs announced to the directory. None -> vLLM's decoder_kv_blocks_ttl.
    retention_ttl_s: float | None = Field(default=None, gt=0)
    # Share of this engine's KV-cache blocks that retained runs may pin together. A finished request
    # whose blocks would take retention past it is freed at once and not announced (its next turn
    # recomputes; counted as retention_declined{reason="capped"}). Without a bound, leases
    # (decoder_kv_blocks_ttl: 480 s by default) can pin the whole cache, and new requests wait for
    # leases to end. 1.0 leaves it unbounded, as vLLM does.
    retention_max_share: float = Field(default=0.5, gt=0, le=1)
    # Past 0.9 of that share, give up the oldest retained runs retained longer than
    # retention_yield_after_s, so newer turns fit: each is dropped from the directory, and freed once
    # kvloopd confirms the drop and its read window has passed (yielding.py; needs kvloop_daemon and
    # kvloop_model). False: past the share, finished requests are declined while older runs keep their
    # whole lease.
    retention_yield: bool = True
    # Only runs older than this are given up. A conversation still going on keeps its latest run young
    # (each turn retains a new one), so this gives up what no one came back for; giving up the oldest
    # runs outright would drop, under sessions taking turns in a cycle, the very run whose turn is next
    # (docs/benchmarks.md has the figures).
    retention_yield_after_s: float = Field(default=60.0, ge=0)
    # Host retention tier (decode role): GiB of host memory, registered with NIXL, that retained runs
    # are copied into when they finish (host/tier.py). A run then stays pullable from host memory after
    # its blocks leave the KV cache: a finished run with a host copy is the first given up under
    # pressure, with no age guard. 0: no host tier.
    host_retention_gib: float = Field(default=0.0, ge=0)
    # The host pool's NIXL side channel (it is served as an engine of its own, `<engine id>@host`):
    # a port of this host distinct from every engine's VLLM_NIXL_SIDE_CHANNEL_PORT. Needed with a pool.
    host_side_channel_port: int = Field(default=0, ge=0, le=65535)
    # Lease of a run's host copy, from when its copy is announced.
    host_retention_ttl_s: float = Field(default=1800.0, gt=0)
    # Which copies the host pool gives up first when it needs room (host/eviction.py): "lru" the
    # oldest; "predicted_return" those with the fewest pulls to expect per second held, from each
    # conversation's own gaps between turns (learned from the runs that extend one another) and how
    # long it has been idle.
    host_eviction: str = LRU
    # Give a run's KV-cache blocks up this long after its host copy is announced, pressure or not
    # (None: only under pressure, see retention_yield). 0 frees the KV cache soonest.
    host_demote_after_s: float | None = Field(default=None, ge=0)
    # What the host pool does when vLLM resets the connector's cache (before a sleep discards the KV
    # cache, or when asked to forget cached KV): "keep" serves its copies on (the pool is host memory,
    # not the KV cache, and a sleep that keeps the weights leaves their KV valid); "drop" releases
    # them, for deployments that change the weights while an engine sleeps (KV computed with the old
    # weights is not the new model's).
    host_on_reset: Literal["keep", "drop"] = "keep"
    # "multi": every lookup may read a retained run until the lease ends (blocks are kept until
    # TTL). "single": vLLM's behaviour, freed after the first READ; the directory must claim it.
    sharing: Literal["multi", "single"] = "multi"
    # Sent with every lookup: the directory hands out only runs whose lease outlives this margin
    # (the daemon's own expiry_margin_s applies too). It covers the lookup answer's trip and the
    # engine step before the READ is posted.
    expiry_margin_s: float = Field(default=6.0, ge=0)
    # Checked by the worker when it posts the READ: a run whose lease ends sooner is not read
    # (the holder may free and reuse its blocks under the READ). Smaller than expiry_margin_s.
    read_margin_s: float = Field(default=2.0, ge=0)
    # Sent with every lookup: fewer transferable tokens are recomputed (the daemon's
    # recompute_threshold_tokens and vLLM's kv_recompute_threshold apply too; the largest wins).
    min_pull_tokens: int = Field(default=64, ge=0)
    # Let the engine loop sleep while the engine holds retained multi-reader runs and nothing else,
    # woken when a lease ends (idle.py). False: vLLM's behaviour, an engine step every ~1 ms until
    # every retained run is released (the whole lease).
    idle_wait: bool = True
    # Publish retained/released events (decode role).
    publish_events: bool = True
    # Ask the directory (prefill role).
    lookup: bool = True
    # Prefill role: take the pull Route planned for a request (kvloopd pushes its plans for this
    # worker over a stream, plans.py) instead of asking Lookup on the engine loop.
    route_plans: bool = True
    # Prefill role: how often the worker asks kvloopd for new holders and opens its NIXL connection
    # to each before any turn reads from it (the handshake otherwise lands in a user's
    # first pulled turn). 0 turns it off.
    warm_peers_s: float = Field(default=2.0, ge=0)
    # NIXL progress-thread delay in microseconds (NIXL's Python API hard-codes 0 = busy spin).
    # None leaves NIXL alone.
    nixl_progress_delay_us: int | None = Field(default=1000, ge=0)
    # Decode role: digest each retained run's blocks (digest.py) and announce the digests with it, so
    # a puller can check what its READ brought. A run is announced one engine step after it is
    # retained (the worker digests it at the next step). False: runs go out at once, unchecked.
    digests: bool = True
    # Prefill role: which pulls' READs are checked against the holder's digests before the prefill
    # computes on them: "all", "off", or a share of pulls (0 to 1) for engines where checking every
    # READ costs too much. A pull that fails its check is recomputed (verify_failed).
    verify: str = "all"
    # Fault injection, for tests and `kvloop bench chaos` only (never on by default): the share of
    # retained runs whose tail block is overwritten right after the worker digests it, as a fence bug
    # would. The tail block, because only pullers read it: a full block also serves the holder's own
    # prefix cache, which no real reuse leaves pointing at overwritten memory.
    fault_corrupt_retained: float = Field(default=0.0, ge=0, le=1)
    # ... and the share of host copies (decode role, host pool) whose last slot is overwritten once the
    # copy is made.
    fault_corrupt_host: float = Field(default=0.0, ge=0, le=1)
    # ... and a file that sets both shares while the engine runs (faults.py; `kvloop bench chaos`).
    fault_file: str = ""
    # The connector's own log lines in the engine process (vLLM's logging is vLLM's): "debug" adds a
    # line per retained run and per READ, on the engine loop's path. JSON unless stderr is a terminal.
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("daemon", mode="before")
    @classmethod
    def _check_daemon(cls, v: Any) -> str:
        try:
            return daemon_addresses(v) if v else ""
        except ValueError as exc:
            raise ValueError(f"kvloop_daemon: {exc}") from None

    @field_validator("verify", mode="before")
    @classmethod
    def _check_verify(cls, v: Any) -> str:
        text = str(v).strip().lower()
        if text in ("all", "off"):
            return text
        try:
            share = float(text)
        except ValueError:
            share = -1.0
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"kvloop_verify {v!r}: 'all', 'off' or a share of pulls from 0 to 1")
        return text

    @property
    def verify_share(self) -> float:
        """The share of pulls whose READ is checked."""
        named = {"all": 1.0, "off": 0.0}
        return named[self.verify] if self.verify in named else float(self.verify)

    @field_validator("host_eviction")
    @classmethod
    def _check_host_eviction(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"kvloop_host_eviction {v!r}: choose from {', '.join(POLICIES)}")
        return v

    @model_validator(mode="after")
    def _check_host_tier(self) -> KvloopConfig:
        if self.host_retention_gib > 0:
            if not self.host_side_channel_port:
                raise ValueError("kvloop_host_retention_gib needs kvloop_host_side_channel_port")
            if not (self.daemon and self.model):
                raise ValueError(
                    "kvloop_host_retention_gib needs kvloop_daemon and kvloop_model: a host copy is "
                    "announced to, and its eviction confirmed by, the directory"
                )
            if self.sharing != "multi":
                raise ValueError("kvloop_host_retention_gib needs kvloop_sharing 'multi'")
        return self

    @model_validator(mode="after")
    def _check_margins(self) -> KvloopConfig:
        if self.read_margin_s >= self.expiry_margin_s:
            raise ValueError(
                f"kvloop_read_margin_s ({self.read_margin_s}) must be below kvloop_expiry_margin_s "
                f"({self.expiry_margin_s}): a run handed out near the lookup margin would never be read"
            )
        return self

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> KvloopConfig:
        extra = extra or {}
        return cls(**{k[len(PREFIX) :]: v for k, v in extra.items() if k.startswith(PREFIX)})
