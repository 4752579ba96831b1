"""The storage interfaces the service layer talks to.

Two halves, both asynchronous so a networked backend fits behind them:

* :class:`WorkerRegistry`: who publishes (registration, leases, epochs, sequences, drain, reaping);
* :class:`BlockIndex`: what they hold (applying event batches, longest-prefix lookup, find,
  single-use claims, expiry and counts).

A backend implements both over one shared state (:class:`DirectoryStore`): the in-memory index
(:mod:`.memory`) and Redis (:mod:`.redis`). Metrics and tracing wrap any backend
(:mod:`.instrumented`) rather than living inside one.

Times are seconds on the store's own clock (:meth:`WorkerRegistry.clock`), supplied by the caller
so stores stay deterministic under test: the in-memory store uses the process's monotonic clock;
a store shared by several processes needs one they all agree on (wall time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from kvloop.daemon.index.model import (
    Change,
    Event,
    Location,
    Namespace,
    PrefixMatch,
    WorkerSpec,
    WorkerView,
)


@dataclass(frozen=True, slots=True)
class IndexConfig:
    lease_s: float = 10.0
    # A worker whose lease lapsed (or whose stream closed) is dropped after this long.
    drop_after_s: float = 60.0
    # Never hand out a retained run whose lease ends sooner than this.
    expiry_margin_s: float = 2.0
    # A handed-out run may be read for at most this long (Holder.expires_in_ms is capped at it):
    # how long a holder that dropped a run before its lease ended keeps the blocks for old handouts.
    read_window_s: float = 30.0
    max_entries: int = 4_000_000


class DirectoryError(Exception):
    """A request the directory refuses; `code` names the gRPC status the service maps it to."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class StoreUnavailable(DirectoryError):
    """The store could not be reached (a networked backend's connection failed or timed out)."""

    def __init__(self, message: str) -> None:
        super().__init__("UNAVAILABLE", message)


class Fence(Enum):
    """What :meth:`BlockIndex.apply` did with a batch, judged against the worker's (epoch, sequence)."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # sequence already applied: a replay, a no-op
    GAP = "gap"  # sequence skips ahead: nothing applied, the agent must resync
    STALE_EPOCH = "stale_epoch"  # the worker re-registered under another epoch since
    UNKNOWN_WORKER = "unknown_worker"


@dataclass(frozen=True, slots=True)
class Applied:
    fence: Fence
    last_sequence: int  # the worker's last applied sequence after this call
    touched: int = 0  # block entries touched


@dataclass(frozen=True, slots=True)
class StoreCounts:
    entries: int  # block entries (hash x holder)
    retained_runs: int
    events_ingested: int  # block events applied so far
    evictions: int  # entries evicted by the memory bound so far
    expired_runs: int  # retained runs dropped at lease end so far


class WorkerRegistry(Protocol):
    config: IndexConfig
    # The directory epoch answers are minted under: grows with each failover of the store (Redis
    # Sentinel's config epoch); 0 for a store that cannot fail over.
    epoch: int
    # True when every call answers from this process's memory, without I/O (the in-memory store).
    in_process: bool

    def clock(self) -> float:
        """Now, in the seconds every call of this store takes."""

    async def register(self, spec: WorkerSpec, last_sequence: int, now: float) -> tuple[int, bool]:
        """Register or re-register a worker. Returns (last applied sequence, resync required).

        A new epoch atomically drops the worker's previous state."""

    async def disconnect(self, worker_id: str, epoch: int, now: float) -> None: ...

    async def heartbeat(self, worker_id: str, now: float) -> None: ...

    async def last_sequence(self, worker_id: str) -> int: ...

    async def model_spec(self, model: str) -> WorkerSpec | None: ...

    async def worker_spec(self, worker_id: str) -> WorkerSpec | None: ...

    async def mark_resyncing(self, worker_id: str) -> None: ...

    async def set_draining(self, worker_id: str) -> bool: ...

    async def set_unverified(self, worker_id: str) -> bool:
        """A puller's READ from the worker failed its digest check: none of its runs is handed out
        (lookups answer "peer_unavailable") until it registers again, in any epoch. False when no such
        worker is registered."""

    async def workers(self, now: float, model: str = "") -> list[WorkerView]: ...

    async def models(self) -> list[str]: ...

    async def reap(self, now: float) -> list[Change]:
        """Expire retained runs and worker leases, drop long-dead workers; returns what changed."""


class BlockIndex(Protocol):
    async def apply(
        self, worker_id: str, epoch: int, sequence: int, events: Sequence[Event], now: float
    ) -> Applied:
        """Apply one validated batch if ``sequence`` is the worker's next one under ``epoch``.

        ``sequence`` 0 applies unconditionally (a snapshot's batches); a replayed batch is a no-op."""

    async def begin_snapshot(self, worker_id: str, now: float) -> None: ...

    async def end_snapshot(self, worker_id: str, sequence: int, now: float) -> None: ...

    async def lookup(
        self,
        namespace: Namespace,
        hashes: Sequence[bytes],
        local_blocks: int,
        requester: str,
        now: float,
        claim: bool,
        *,
        margin_s: float = 0.0,
        accept: Callable[[WorkerSpec], bool] | None = None,
    ) -> PrefixMatch:
        """The longest prefix one servable run holds beyond ``local_blocks``.

        A run is servable when its lease outlives ``max(expiry_margin_s, margin_s)``, it is not
        claimed, its worker is live and not the requester, and ``accept`` (the caller's layout
        check) takes its worker. With ``claim`` a single-use best run is claimed in the same step."""

    async def stored_prefixes(
        self, namespace: Namespace, hashes: Sequence[bytes], workers: Sequence[str], now: float
    ) -> dict[str, int]:
        """How many leading blocks of the prompt each of ``workers`` holds in its prefix cache
        (BlockStored, not yet BlockRemoved), counted from block 0 as vLLM's own prefix hit is. Workers
        that hold none, are unknown or not active count 0. Read-only."""

    async def release_claim(self, namespace: Namespace, holder: str, handle: str, requester: str) -> bool:
        """Give back a single-use run claimed by ``requester``; False when it holds no such claim."""

    async def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]: ...

    async def counts(self) -> StoreCounts: ...


class DirectoryStore(WorkerRegistry, BlockIndex, Protocol):
    """One backend: both halves over one state."""

    name: str  # "memory", "redis": the label metrics and spans carry

    async def close(self) -> None: ...


def entry_bound(store: WorkerRegistry) -> int:
    """The entries a model may hold before eviction: ``max_entries``, or on a Redis Cluster that many
    in each of its buckets."""
    return store.config.max_entries * getattr(store, "buckets", 1)
