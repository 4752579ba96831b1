"""HOST:PORT parsing with errors a user can act on."""

from __future__ import annotations


def parse_host_port(value: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:50051), got {value!r}")
    return host.strip("[]"), int(port)
