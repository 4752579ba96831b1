"""HOST:PORT parsing with errors a user can act on, as a function and as pydantic field types."""

from __future__ import annotations

import ipaddress
import random
import socket
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator


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


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


_URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")


def grpc_target(value: str) -> str:
    """kvloopd's address(es) as one gRPC target: calls go to any replica that answers and move to
    another when one fails (the channel balances round robin over the live ones).

    * ``HOST:PORT``: gRPC resolves the name and uses every record it has (one DNS name for all
      replicas, e.g. a headless Kubernetes service), re-resolving when a connection fails;
    * ``IP:PORT,IP:PORT,...``: one address per replica (IP literals: gRPC has no resolver for a
      list of names);
    * a gRPC target URI (``dns:///``, ``ipv4:``, ``ipv6:``, ``unix:``) is taken as it is.
    """
    value = value.strip()
    if "," not in value or value.startswith(_URI_SCHEMES):
        return value
    parts = [p.strip() for p in value.split(",") if p.strip()]
    parsed = [parse_host_port(p, "each kvloopd address") for p in parts]
    names = [p for p, (host, _) in zip(parts, parsed, strict=True) if not _is_ip(host)]
    if names:
        raise ValueError(
            f"several kvloopd addresses must be IP:PORT each (got {', '.join(names)}); for host names "
            "give one DNS name with a record per replica"
        )
    families = {ipaddress.ip_address(host).version for host, _ in parsed}
    if len(families) > 1:
        raise ValueError(f"kvloopd addresses mix IPv4 and IPv6: {value!r}")
    if families == {6}:
        return "ipv6:" + ",".join(f"[{host}]:{port}" for host, port in parsed)
    return "ipv4:" + ",".join(f"{host}:{port}" for host, port in parsed)


def daemon_addresses(value: str | list[str]) -> str:
    """kvloopd's address(es) checked, as one string (a list joined with commas)."""
    joined = ",".join(value) if isinstance(value, list) else str(value)
    if "," not in joined and not joined.startswith(_URI_SCHEMES):
        parse_host_port(joined, "the kvloopd address")
    grpc_target(joined)
    return joined


# kvloopd's address: one HOST:PORT, a DNS name with a record per replica, or several IP:PORT
# (comma-separated, or a TOML list): see grpc_target.
DaemonAddresses = Annotated[str, BeforeValidator(daemon_addresses)]


_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", span: int = 1, also: int = 0) -> int:
    """A port p (with p+1 .. p+span-1, and p+also when ``also`` is set: a Redis Cluster node's bus
    port) nothing listens on, for tests, the demo and benchmarks.

    Chosen below the kernel's ephemeral range, never from it: a port the kernel hands out for
    bind(host, 0) can be taken again by any process's next bind(0) or outgoing connection (vLLM's
    own ZMQ sockets bind that way) between our pick and the server binding it. Ports already handed
    out by this process are not handed out twice.
    """
    low = _ephemeral_low()
    first = max(1024, low - 16384)
    rnd = random.SystemRandom()
    if low - first - also >= 1024:
        for _ in range(500):
            port = rnd.randrange(first, low - span - also + 1)
            ports = [*range(port, port + span), *([port + also] if also else [])]
            if any(p in _handed_out for p in ports) or not all(_bindable(host, p) for p in ports):
                continue
            _handed_out.update(ports)
            return port
    for _ in range(50):  # no room below the ephemeral range: take what the kernel gives
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if all(_bindable(host, p) for p in [*range(port + 1, port + span), *([port + also] if also else [])]):
            _handed_out.update(range(port, port + span))
            return port
    raise RuntimeError(f"no {span} free adjacent port(s) on {host}")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p+1 free too (vLLM's ZMQ KV-event PUB endpoint and its replay endpoint)."""
    return free_port(host, span=2)
