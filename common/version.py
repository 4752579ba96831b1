"""kvloop's release, as every command, metric endpoint and registration reports it."""

from __future__ import annotations

import platform
from importlib import metadata

import grpc

from kvloop.v1 import directory_pb2 as pb

PROTOCOL = pb.DESCRIPTOR.package  # "kvloop.v1"


def _version() -> str:
    try:
        return metadata.version("kvloop")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


VERSION = _version()
_published = False


def version_line(command: str) -> str:
    """What ``COMMAND --version`` prints."""
    runtime = f"Python {platform.python_version()}, grpcio {grpc.__version__}"
    return f"{command} {VERSION} (protocol {PROTOCOL}, {runtime})"


def publish_build_info(component: str) -> None:
    """``kvloop_build_info{version, component, protocol, python, grpcio} 1`` on this process's
    /metrics (once per process: several components in one process keep the first)."""
    from prometheus_client import Info

    global _published
    if _published:
        return
    _published = True
    Info("kvloop_build", "kvloop release and what it runs on").info(
        {
            "version": VERSION,
            "component": component,
            "protocol": PROTOCOL,
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
        }
    )
