"""A holder whose engine process was replaced: its agent's new epoch empties it in the directory, and a
prefill's peer warmer notices the new epoch (so the worker drops the dead process's NIXL agent)."""

from __future__ import annotations

import asyncio

import pytest

from kvloop.agents.connector.peers import Peer, PeerWarmer
from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, retained, running_agent

MODEL = "m-holder-restart"


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_new_holder_epoch_drops_its_runs_and_is_handed_to_the_warmers_restarted(
    daemon_factory, store, request
):
    daemon = daemon_factory(*(("--store", request.getfixturevalue("redis_url")) if store == "redis" else ()))
    prompt = conversation("holder-restart", 12)
    warmed: list[Peer] = []
    restarted: list[Peer] = []
    async with AsyncDirectoryClient(daemon.address) as client:
        async with (
            running_agent(client, "pre-hr", MODEL, role=pb.WORKER_ROLE_PREFILL),
            running_agent(client, "dec-hr", MODEL, retained(prompt, "old-process-run")) as decode,
        ):
            old_epoch = decode.epoch
            warmer = PeerWarmer(
                daemon.address, "pre-hr", "engine-pre-hr", MODEL, warmed.append, restarted=restarted.append
            )
            with DirectoryClient(daemon.address) as sync_client:
                await asyncio.to_thread(warmer.poll_once, sync_client)
                assert [(p.engine_id, p.epoch) for p in warmed] == [("engine-dec-hr", old_epoch)]
                assert (await client.lookup(MODEL, prompt)).decision == pb.DECISION_TRANSFER

                # The decode's engine ended: its agent registers again, empty, under a new epoch.
                decode.restart_epoch(old_epoch + 2, "engine ended (test)")
                await asyncio.wait_for(decode.wait_sessions(2), 10)

                async def old_run_gone() -> bool:
                    answer = await client.lookup(MODEL, prompt)
                    return answer.reason == pb.DECISION_REASON_MISS

                deadline = asyncio.get_running_loop().time() + 10
                while not await old_run_gone():
                    assert asyncio.get_running_loop().time() < deadline, "old epoch's run still served"
                    await asyncio.sleep(0.05)
                workers = {w.registration.worker_id: w for w in await client.list_workers(MODEL)}
                assert workers["dec-hr"].registration.epoch == old_epoch + 2
                assert workers["dec-hr"].connected and workers["dec-hr"].retained_runs == 0

                # The warmer hands the new process to `restarted` once, and warms nothing twice.
                await asyncio.to_thread(warmer.poll_once, sync_client)
                await asyncio.to_thread(warmer.poll_once, sync_client)
                assert [(p.engine_id, p.epoch) for p in restarted] == [("engine-dec-hr", old_epoch + 2)]
                assert len(warmed) == 1

                # The new epoch's runs are served as usual.
                decode.publish([retained(prompt[:6], "new-process-run")])
                await decode.wait_acked(timeout=5)
                answer = await client.lookup(MODEL, prompt)
                assert answer.holder.retention_handle == "new-process-run"
                assert answer.holder.epoch == old_epoch + 2
