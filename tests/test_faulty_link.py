"""The relay `bench chaos` puts between the agents and kvloopd: its faults are real TCP events that a
real agent's Connect stream and a real client's calls see, and they recover from."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvloop.clients.bench.faulty_link import FaultyLink
from kvloop.clients.directory_client import AsyncDirectoryClient, DaemonUnavailable, DirectoryClient
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, retained, running_agent, wait_until

MODEL = "m-faulty-link"


@pytest.fixture
def link(daemon):
    relay = FaultyLink(daemon.address)
    relay.start()
    yield relay
    relay.stop()


async def test_a_reset_stream_reconnects_and_keeps_the_agents_state(daemon, link):
    prompt = conversation("link", 8)
    async with AsyncDirectoryClient(link.address) as client:
        async with running_agent(client, "dec-link", MODEL, retained(prompt, "req-link")) as agent:
            sessions = agent.sessions
            assert link.reset() >= 1  # the Connect stream's connection, at least
            await asyncio.wait_for(_until(lambda: agent.sessions > sessions and agent.connected.is_set()), 20)
            answer = await client.lookup(MODEL, prompt, requester="pre-link", block_size=16)
    assert answer.decision == pb.DECISION_TRANSFER, answer
    assert answer.holder.worker_id == "dec-link"


def test_refused_connections_fail_fast_and_come_back(daemon, link):
    with DirectoryClient(link.address, timeout=1) as client:
        client.stats()
        link.refuse(1.5)
        refused_at = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            client.stats()
        # back once the drop ends: the client's reconnect backoff is at most a second
        wait_until(lambda: _healthy(client), timeout=10, what="health through the relay again")
    assert time.monotonic() - refused_at >= 1.5


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.02)  # polling the agent's session counter


def _healthy(client: DirectoryClient) -> bool:
    try:
        client.stats()
        return True
    except DaemonUnavailable:
        return False
