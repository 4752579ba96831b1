"""Typed Python client of kvloopd, sync and asyncio (see `client`)."""

from kvloop.clients.directory_client.client import (
    AsyncDirectoryClient,
    DaemonUnavailable,
    DirectoryClient,
    KvloopError,
    default_target,
    holder_block_ids,
)

__all__ = [
    "AsyncDirectoryClient",
    "DaemonUnavailable",
    "DirectoryClient",
    "KvloopError",
    "default_target",
    "holder_block_ids",
]
