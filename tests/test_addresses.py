"""HOST:PORT parsing and the port picker the demo, benchmarks and tests start servers with."""

from __future__ import annotations

import socket

import pytest

from kvloop.common.addresses import _ephemeral_low, free_port, free_port_pair, parse_host_port


def test_parse_host_port_accepts_hosts_and_ipv6_and_explains_mistakes():
    assert parse_host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_host_port("[::1]:9000") == ("::1", 9000)
    for bad in ("50051", "host:", ":80", "host:99999", "host:http"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_host_port(bad, "--listen")


def test_picked_ports_avoid_the_ephemeral_range_and_are_never_handed_out_twice():
    # a port from the ephemeral range can be re-taken by any process's bind(0) before our server binds it
    pairs = [free_port_pair() for _ in range(20)]
    singles = [free_port() for _ in range(20)]
    handed = [p for first in pairs for p in (first, first + 1)] + singles
    assert len(set(handed)) == len(handed)
    assert all(p + 1 < _ephemeral_low() for p in handed)
    for port in handed[:6]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out
