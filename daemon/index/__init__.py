"""The block directory: domain types, the storage interface and the in-memory index."""

from kvloop.daemon.index.memory import IndexConfig, MemoryStore
from kvloop.daemon.index.model import (
    Change,
    Cleared,
    Event,
    Holding,
    LeaseState,
    Location,
    Namespace,
    PrefixMatch,
    Released,
    Removed,
    Retained,
    Stored,
    WorkerSpec,
    WorkerView,
)
from kvloop.daemon.index.store import DirectoryError, DirectoryStore

__all__ = [
    "Change",
    "Cleared",
    "DirectoryError",
    "DirectoryStore",
    "Event",
    "Holding",
    "IndexConfig",
    "LeaseState",
    "Location",
    "MemoryStore",
    "Namespace",
    "PrefixMatch",
    "Released",
    "Removed",
    "Retained",
    "Stored",
    "WorkerSpec",
    "WorkerView",
]
