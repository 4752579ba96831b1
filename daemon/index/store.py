"""The storage interface the service layer talks to.

The in-memory index implements it today; a replicated backend (Valkey, etcd + oplog) can implement
the same calls without touching the gRPC service. All times are monotonic seconds supplied by the
caller, so stores stay deterministic under test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvloop.daemon.index.memory import IndexConfig

from kvloop.daemon.index.model import (
    Change,
    Event,
    Location,
    Namespace,
    PrefixMatch,
    WorkerSpec,
    WorkerView,
)


class DirectoryError(Exception):
    """A request the directory refuses; `code` names the gRPC status the service maps it to."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class DirectoryStore(Protocol):
    config: IndexConfig
    evictions: int  # entries evicted by the memory bound so far
    events_ingested: int  # block events applied so far

    def register(self, spec: WorkerSpec, last_sequence: int, now: float) -> tuple[int, bool]:
        """Register or re-register a worker. Returns (last applied sequence, resync required).

        A new epoch atomically drops the worker's previous state.
        """

    def disconnect(self, worker_id: str, epoch: int, now: float) -> None: ...

    def heartbeat(self, worker_id: str, now: float) -> None: ...

    def apply(self, worker_id: str, sequence: int, events: Sequence[Event], now: float) -> int:
        """Apply one validated batch; returns block entries touched."""

    def begin_snapshot(self, worker_id: str, now: float) -> None: ...

    def end_snapshot(self, worker_id: str, sequence: int, now: float) -> None: ...

    def last_sequence(self, worker_id: str) -> int: ...

    def model_spec(self, model: str) -> WorkerSpec | None: ...

    def worker_spec(self, worker_id: str) -> WorkerSpec | None: ...

    def mark_resyncing(self, worker_id: str) -> None: ...

    def set_draining(self, worker_id: str) -> bool: ...

    def lookup(
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
    ) -> PrefixMatch: ...

    def release_claim(self, namespace: Namespace, holder: str, handle: str, requester: str) -> bool:
        """Give back a single-use run claimed by ``requester``; False when it holds no such claim."""

    def find(self, namespace: Namespace, block_hash: bytes, now: float) -> list[Location]: ...

    def workers(self, now: float, model: str = "") -> list[WorkerView]: ...

    def reap(self, now: float) -> list[Change]:
        """Expire leases and retained runs, drop long-dead workers; returns what changed."""

    def entry_count(self) -> int: ...

    def retained_run_count(self) -> int: ...

    def models(self) -> list[str]: ...
