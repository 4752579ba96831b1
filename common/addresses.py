"""HOST:PORT parsing with errors a user can act on, as a function and as pydantic field types."""

from __future__ import annotations

import socket
from typing import Annotated

from pydantic import AfterValidator


def parse_host_port(value: str, what: str = "") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        prefix = f"{what} " if what else ""
        raise ValueError(f"{prefix}must be HOST:PORT (e.g. 127.0.0.1:50051), got {value!r}")
    return host.strip("[]"), int(port)


def _host_port(value: str) -> str:
    parse_host_port(value)
    return value


def _optional_host_port(value: str) -> str:
    return _host_port(value) if value else value


# A settings field holding HOST:PORT; the optional form also accepts "" (turned off).
HostPort = Annotated[str, AfterValidator(_host_port)]
OptionalHostPort = Annotated[str, AfterValidator(_optional_host_port)]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (tests, the demo and benchmarks pick theirs this way)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p+1 free too (vLLM's ZMQ KV-event PUB endpoint and its replay endpoint)."""
    for _ in range(50):
        first = free_port(host)
        with socket.socket() as second:
            try:
                second.bind((host, first + 1))
            except OSError:
                continue
        return first
    raise RuntimeError("no free pair of adjacent ports")
