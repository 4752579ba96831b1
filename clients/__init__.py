"""kvloop clients: the typed directory client, the `kvloop` CLI, benchmarks."""

from kvloop.clients.client import AsyncDirectoryClient, DaemonUnavailable, DirectoryClient, KvloopError

__all__ = ["AsyncDirectoryClient", "DaemonUnavailable", "DirectoryClient", "KvloopError"]
