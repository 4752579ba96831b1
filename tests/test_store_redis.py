"""kvloopd on a shared Redis store, as real processes: replicas share one directory, an ACL user's
password never reaches a log, a bad store refuses to start with a precise message."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import grpc
import pytest
import redis

from kvloop.agents.connector.directory import DirectoryLookups, PullerConstraints
from kvloop.clients.directory_client import AsyncDirectoryClient, KvloopError
from kvloop.clients.fleet.redis_local import local_redis, local_sentinel
from kvloop.common.addresses import free_port
from kvloop.common.block_keys import block_keys, packed_keys
from kvloop.daemon.index import PackedHashes
from kvloop.daemon.index.redis_wire import key_bytes
from kvloop.v1 import directory_pb2 as pb
from tests.conftest import KVLOOPD
from tests.support import conversation, retained, running_agent, wait_until

SECRET = "s3cr3t-pa55word-for-kvloop"


async def wait_for_async(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)  # polling a condition, not synchronising on time


async def test_two_replicas_share_one_directory_and_the_password_stays_out_of_logs(
    redis_url, daemon_factory, tmp_path
):
    admin = redis.Redis.from_url(redis_url)
    admin.flushdb()
    admin.acl_setuser("kvloopd", enabled=True, passwords=[f"+{SECRET}"], keys=["*"], commands=["+@all"])
    config = tmp_path / "kvloopd.toml"
    config.write_text(f'[store]\nurl = "{redis_url}"\nusername = "kvloopd"\npassword = "{SECRET}"\n')
    a = daemon_factory("--config", str(config), "--log-level", "debug")
    b = daemon_factory("--config", str(config), "--log-level", "debug")
    model, prompt = "m-shared", conversation("shared", 48)
    try:
        async with AsyncDirectoryClient(a.address) as on_a, AsyncDirectoryClient(b.address) as on_b:
            async with running_agent(on_a, "dec-shared", model, retained(prompt[:32], "h1", single_use=True)):
                # the worker streams to replica A; replica B answers from the same directory
                answer = await on_b.lookup(model, prompt, requester="pre", claim=True, block_size=16)
                assert answer.decision == pb.DECISION_TRANSFER and answer.matched_blocks == 32
                assert answer.holder.worker_id == "dec-shared" and answer.holder.retention_handle == "h1"
                # the claim made through B holds on A: a single-use run is handed out once
                again = await on_a.lookup(model, prompt, requester="pre2", claim=True, block_size=16)
                assert again.decision == pb.DECISION_RECOMPUTE
                assert again.reason == pb.DECISION_REASON_CLAIMED
                workers = await on_b.list_workers(model)
                assert [w.registration.worker_id for w in workers] == ["dec-shared"]
                assert (await on_b.stats()).entries == 32
    finally:
        admin.acl_deluser("kvloopd")
    for daemon in (a, b):
        daemon.stop()
        assert SECRET not in daemon.log()
        assert '"store": "redis"' in daemon.log() or "store=redis" in daemon.log()


def test_an_unreachable_or_refusing_store_stops_startup_with_a_message(redis_url, tmp_path):
    import subprocess

    denied = subprocess.run(
        [
            KVLOOPD,
            "--store",
            redis_url.replace("redis://", f"redis://nobody:{SECRET}@"),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert denied.returncode == 1, denied.stderr
    assert "cannot use the store at redis://nobody:***@127.0.0.1" in denied.stderr
    assert SECRET not in denied.stderr + denied.stdout
    bad = subprocess.run([KVLOOPD, "--store", "mysql://x", "--check-config"], capture_output=True, text=True)
    assert bad.returncode == 2 and "store url must be 'memory' or redis://" in bad.stderr


async def test_watch_and_drain_work_on_a_replica_the_agent_is_not_attached_to(redis_url, daemon_factory):
    a = daemon_factory("--store", redis_url)
    b = daemon_factory("--store", redis_url)
    async with AsyncDirectoryClient(a.address) as on_a, AsyncDirectoryClient(b.address) as on_b:
        seen: asyncio.Queue[pb.WatchResponse] = asyncio.Queue()

        async def watch() -> None:
            async for change in on_b.watch("m-watch"):
                seen.put_nowait(change)

        watcher = asyncio.create_task(watch())
        try:
            # B's Watch may start a moment after the stream opens: each try is a new worker on A
            for attempt in range(20):
                worker = f"dec-watch-{attempt}"
                async with running_agent(
                    on_a, worker, "m-watch", retained(conversation("w", 4), "h")
                ) as link:
                    # only this try's worker counts; a Watch that began after its registration
                    # (it saw "retained" first) cannot prove anything: the next try does
                    kinds: list[str] = []
                    try:
                        while "retained" not in kinds:
                            change = await asyncio.wait_for(seen.get(), 1.0)
                            if change.worker_id == worker:
                                assert change.model == "m-watch"
                                kinds.append(change.kind)
                    except TimeoutError:
                        continue
                    if kinds[0] != "registered":
                        continue
                    # drained through B, the agent streaming to A is told
                    await on_b.drain(worker, "maintenance via replica b")
                    await wait_for_async(lambda: link.drain_reason == "maintenance via replica b")
                    break
            else:
                raise AssertionError("replica B's Watch never saw a change made through replica A")
        finally:
            watcher.cancel()


async def test_a_store_that_goes_away_answers_unavailable_and_comes_back_with_its_functions(
    daemon_factory, tmp_path
):
    port = free_port()
    with local_redis(tmp_path, port=port) as url:
        daemon = daemon_factory("--store", url)
        async with AsyncDirectoryClient(daemon.address) as client:
            assert (await client.lookup("m-away", conversation("x", 4))).reason == pb.DECISION_REASON_MISS
    with pytest.raises(KvloopError) as away:  # the server is gone: a precise status, not UNKNOWN
        async with AsyncDirectoryClient(daemon.address) as client:
            await client.lookup("m-away", conversation("x", 4))
    assert away.value.code == grpc.StatusCode.UNAVAILABLE and "directory store (redis)" in str(away.value)
    # a new, empty server on the same address: kvloopd loads its function library again by itself
    with local_redis(tmp_path, port=port):
        async with AsyncDirectoryClient(daemon.address) as client:
            prompt = conversation("back", 8)
            async with running_agent(client, "dec-back", "m-away", retained(prompt, "h")):
                answer = await client.lookup("m-away", prompt, requester="pre", block_size=16)
    assert answer.decision == pb.DECISION_TRANSFER and answer.matched_blocks == 8
    assert "loading them again" in daemon.log()


async def lookup_through_failover(client, *args, **kwargs) -> pb.LookupResponse:
    """A Lookup, retried while kvloopd's store client finds the new primary (UNAVAILABLE)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return await client.lookup(*args, **kwargs)
        except KvloopError as exc:
            assert exc.code == grpc.StatusCode.UNAVAILABLE, exc
        assert time.monotonic() < deadline, "kvloopd did not reach the new primary"
        await asyncio.sleep(0.1)  # polling a condition, not synchronising on time


async def test_sentinel_failover_fences_the_old_state_until_agents_have_re_pushed_it(
    daemon_factory, tmp_path
):
    primary_port, replica_port = free_port(), free_port()
    with ExitStack() as stack, ExitStack() as primary:
        primary.enter_context(local_redis(tmp_path, port=primary_port))
        replica = stack.enter_context(
            local_redis(tmp_path, port=replica_port, extra=["--replicaof", "127.0.0.1", str(primary_port)])
        )
        sentinel = stack.enter_context(local_sentinel(tmp_path, primary_port))
        replica_client = redis.Redis.from_url(replica)
        wait_until(
            lambda: replica_client.info("replication")["master_link_status"] == "up", what="replica sync"
        )
        config = tmp_path / "kvloopd.toml"
        # a lease longer than the failover: the agent below stays registered while it is away
        config.write_text(
            'lease_s = 60.0\n[store]\nurl = "redis:///0"\n'
            f'sentinels = ["{sentinel}"]\nsentinel_master = "kvloop"\n'
        )
        daemon = daemon_factory("--config", str(config), "--log-level", "debug")
        model, prompt = "m-failover", conversation("failover", 16)
        # the connector's own client, as a prefill engine holds it
        puller = DirectoryLookups(
            daemon.address, PullerConstraints(model, "pre", 16, 0, 0, 0, "", 0), timeout_ms=5000, backoff_s=0
        )
        held = [retained(prompt, "h", single_use=True)]
        epoch = 424242
        async with AsyncDirectoryClient(daemon.address) as client:
            async with running_agent(client, "dec-fo", model, *held, snapshot=lambda: held, epoch=epoch):
                before = await asyncio.to_thread(puller.lookup, prompt, 0)
                assert before is not None and before.path == pb.TURN_PATH_TRANSFER and before.holder
                minted = before.holder  # claimed for "pre", not read yet
                assert minted.directory_epoch >= 1 and not puller.stale(minted)
            # the agent is away (registered, its lease running) when the primary dies; Sentinel
            # promotes the replica under a new config epoch
            primary.close()
            wait_until(
                lambda: "every worker must resync" in daemon.log(),
                timeout=30,
                what="kvloopd to see the failover",
            )
            # until the worker has re-pushed its state nothing is handed out, under the new epoch
            during = await lookup_through_failover(client, model, prompt, requester="pre2", block_size=16)
            assert during.decision == pb.DECISION_RECOMPUTE, during
            assert during.reason == pb.DECISION_REASON_DIRECTORY_RESYNCING
            assert during.path == pb.TURN_PATH_RECOMPUTE
            assert during.directory_epoch > minted.directory_epoch
            # the connector learns the new epoch from any answer: the handle minted before is refused
            answer = await asyncio.to_thread(puller.lookup, prompt, 0)
            assert answer is not None and answer.reason == pb.DECISION_REASON_DIRECTORY_RESYNCING
            assert puller.stale(minted)
            # and kvloopd does not release a claim made in the store the failover replaced
            released = await client.release_claim(
                model, "dec-fo", "h", requester="pre", directory_epoch=minted.directory_epoch
            )
            assert not released and "stale claim not released" in daemon.log()
            # the agent comes back under its epoch: asked for its whole state, it re-pushes it, and
            # the run is served again from the new primary, under the new epoch
            async with running_agent(client, "dec-fo", model, snapshot=lambda: held, epoch=epoch) as link:
                await wait_for_async(lambda: link.snapshots_sent >= 1, timeout=20)
                deadline = time.monotonic() + 20
                while True:
                    after = await lookup_through_failover(
                        client, model, prompt, requester="pre", block_size=16
                    )
                    if after.decision == pb.DECISION_TRANSFER:
                        break
                    assert time.monotonic() < deadline, (
                        f"transfers did not resume after the failover: {after}"
                    )
                    await asyncio.sleep(0.1)  # polling a condition, not synchronising on time
                assert after.directory_epoch == during.directory_epoch
        puller.close()
        assert redis.Redis.from_url(replica).info("replication")["role"] == "master"


async def test_an_agent_and_a_puller_move_to_another_replica_when_theirs_dies(redis_url, daemon_factory):
    redis.Redis.from_url(redis_url).flushdb()
    a = daemon_factory("--store", redis_url)
    b = daemon_factory("--store", redis_url)
    replicas = f"{a.address},{b.address}"  # as the agent's and the connector's settings give them
    model, prompt = "m-move", conversation("move", 16)
    puller = DirectoryLookups(
        replicas, PullerConstraints(model, "pre", 16, 0, 0, 0, "", 0), timeout_ms=2000, backoff_s=0
    )
    async with AsyncDirectoryClient(replicas) as client:
        async with running_agent(client, "dec-move", model, retained(prompt[:8], "h1")) as link:
            [attached] = [d for d in (a, b) if "agent registered" in d.log()]
            survivor = b if attached is a else a
            first = await asyncio.to_thread(puller.lookup, prompt, 0)
            assert first is not None and first.path == pb.TURN_PATH_TRANSFER and first.matched_blocks == 8
            acked = link.acked
            attached.process.kill()  # a crash: no drain, no goodbye on the stream
            attached.process.wait()
            await link.wait_sessions(2, timeout=10)
            assert "agent registered" in survivor.log()
            # resumed at its last acknowledged sequence: no snapshot, the directory kept its state
            assert link.snapshots_sent == 0 and link.acked == acked
            link.publish([retained(prompt, "h2")])
            await link.wait_acked(timeout=5)
            [worker] = await client.list_workers(model)
            assert worker.connected and worker.resyncs == 0
            assert worker.last_applied_sequence == link.sequence == acked + 1
            # the connector's lookups go to the live replica, state included
            answer = await asyncio.to_thread(puller.lookup, prompt, 0)
            assert answer is not None and answer.path == pb.TURN_PATH_TRANSFER, answer
            assert answer.matched_blocks == 16 and answer.holder and answer.holder.retention_handle == "h2"
    puller.close()


def test_daemon_addresses_name_one_replica_or_several():
    from pydantic import ValidationError

    from kvloop.agents.connector.config import KvloopConfig
    from kvloop.agents.sidecar.config import AgentSettings
    from kvloop.common.addresses import grpc_target

    assert grpc_target("kvloopd.svc:50051") == "kvloopd.svc:50051"  # every DNS record is a replica
    assert grpc_target("10.0.0.1:1, 10.0.0.2:2") == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert grpc_target("[::1]:1,[::2]:2") == "ipv6:[::1]:1,[::2]:2"
    settings = AgentSettings(model="m", block_size=16, daemon=["10.0.0.1:1", "10.0.0.2:2"])
    assert settings.daemon == "10.0.0.1:1,10.0.0.2:2"
    assert KvloopConfig(daemon="10.0.0.1:1,10.0.0.2:2").daemon == "10.0.0.1:1,10.0.0.2:2"
    with pytest.raises(ValidationError, match=r"must be IP:PORT each .*give one DNS name"):
        AgentSettings(model="m", block_size=16, daemon="a.example:1,b.example:2")
    with pytest.raises(ValidationError, match=r"kvloop_daemon: .*must be HOST:PORT"):
        KvloopConfig(daemon="nohost")


@pytest.mark.parametrize("through", ["url", "sentinel"])
async def test_more_concurrent_calls_than_pooled_connections_wait_instead_of_failing(
    through, redis_url, tmp_path
):
    """Found by `kvloop bench soak --store redis` (64 agents, 32 callers): redis-py's asyncio pool
    holds at most 100 connections and refuses the 101st call at once ("Too many connections"), so
    under load Lookups answered UNAVAILABLE and closed streams went unrecorded. Calls beyond the pool
    now wait for a connection, on a plain URL and on the primary Sentinel names alike."""
    from kvloop.daemon.index import IndexConfig, Namespace
    from kvloop.daemon.index.redis_store import RedisStore

    with ExitStack() as stack:
        if through == "url":
            store = await RedisStore.connect(redis_url, IndexConfig())
        else:
            port = free_port()
            stack.enter_context(local_redis(tmp_path, port=port))
            sentinel = stack.enter_context(local_sentinel(tmp_path, port))
            store = await RedisStore.connect_sentinel([sentinel], "kvloop", "redis:///0", IndexConfig())
        try:
            await store.flush()
            prompt = conversation("pool", 8)
            answers = await asyncio.gather(
                *(store.lookup(Namespace("m"), prompt, 0, "p", store.clock(), False) for _ in range(400))
            )
            assert len(answers) == 400 and all(a.best is None for a in answers)
        finally:
            await store.close()


@pytest.mark.parametrize("width", [8, 32, 12])
def test_a_packed_prompt_gives_the_same_keys_as_its_hashes(width):
    """A Lookup's packed prompt goes to Redis as one slice of bytes (the per-block walk it replaced
    took ~2 ms of a 2,048-block Lookup); the keys are the same as from the hashes one by one."""
    hashes = [bytes([i % 251]) * width for i in range(2048)]
    packed = PackedHashes(b"".join(hashes) + b"\x00" * (width - 1), width)  # a stray tail is not a block
    assert list(packed) == hashes and len(packed) == 2048
    assert key_bytes(packed) == key_bytes(hashes) == b"".join(h[:8] for h in hashes)
    # what a client sends (kvloop.common.block_keys): the same keys, whatever the stray tail
    assert packed_keys(packed.data, width) == packed_keys(b"".join(hashes) + b"\x07" * (width - 1), width)
    assert packed_keys(packed.data, width) == b"".join(block_keys(hashes))
    with pytest.raises(ValueError, match="shorter than a key"):
        packed_keys(b"x" * 14, 7)


async def _store_holding_two_runs(redis_url):
    """A store on the session Redis where prompt A matches 6 blocks of a run and prompt B 3 of another."""
    from kvloop.daemon.index import IndexConfig
    from kvloop.daemon.index.redis_store import RedisStore
    from tests.test_index import retain, spec

    store = await RedisStore.connect(redis_url, IndexConfig())
    await store.flush()
    now = store.clock()
    await store.register(spec("a"), 0, now)
    a, b = conversation("lane-a", 8), conversation("lane-b", 8)
    await store.apply("a", 1, 1, [retain(a[:6], "ha"), retain(b[:3], "hb")], now)
    return store, a, b


async def test_a_lookup_cancelled_before_its_reply_leaves_nothing_for_the_next_lookup(redis_url):
    """Lookups go to Redis on connections of their own (the lane), not through redis-py's client. A
    call cancelled after sending (the RPC's deadline passed) leaves its reply unread on the
    connection; reading on from there would answer the next Lookup with this one's blocks."""
    from kvloop.daemon.index import Namespace

    store, a, b = await _store_holding_two_runs(redis_url)
    control = redis.Redis.from_url(redis_url)
    try:
        assert (await store.lookup(Namespace("m"), a, 0, "p", store.clock(), False)).best.matched_blocks == 6
        control.client_pause(20_000, all=False)  # WRITE: holds the FCALL (a write) but not INFO
        try:
            pending = asyncio.create_task(store.lookup(Namespace("m"), a, 0, "p", store.clock(), False))
            await wait_for_async(lambda: control.info("clients")["blocked_clients"] >= 1)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
        finally:
            control.client_unpause()
        match = await store.lookup(Namespace("m"), b, 0, "p", store.clock(), False)
        assert match.best is not None and match.best.matched_blocks == 3 and match.best.handle == "hb"
    finally:
        control.close()
        await store.close()


async def test_a_lookup_whose_connection_was_closed_is_answered_through_the_client(redis_url):
    """A lane connection the server closed (a restart, a failover, `CLIENT KILL`) fails the send or
    the read; the Lookup is answered through redis-py's client, which reconnects, and the next one
    opens a fresh lane connection."""
    from kvloop.daemon.index import Namespace

    store, a, b = await _store_holding_two_runs(redis_url)
    control = redis.Redis.from_url(redis_url)
    try:
        assert (await store.lookup(Namespace("m"), a, 0, "p", store.clock(), False)).best.matched_blocks == 6
        assert control.client_kill_filter(_type="normal", skipme=True) >= 1
        for prompt, blocks in ((b, 3), (a, 6)):
            match = await store.lookup(Namespace("m"), prompt, 0, "p", store.clock(), False)
            assert match.best is not None and match.best.matched_blocks == blocks
    finally:
        control.close()
        await store.close()


async def test_a_runs_keys_and_ids_live_beside_it_and_older_runs_are_still_served(redis_url):
    """A run's keys and block ids are strings of their own (a Lookup compares the keys in Redis and
    takes only the matched ids). A run stored with both inside the run hash, as before, answers the
    same (both groups, truncated to the match; FindBlock too; its keys are moved out on its first
    Lookup); a run whose ids are gone (a maxmemory policy) is never handed out; and dropping a run
    leaves neither string behind."""
    from kvloop.daemon.index import IndexConfig, Namespace
    from kvloop.daemon.index.redis_store import RedisStore
    from tests.test_index import retain, spec

    store = await RedisStore.connect(redis_url, IndexConfig())
    control = redis.Redis.from_url(redis_url)
    ns = Namespace("m")
    try:
        await store.flush()
        now = store.clock()
        await store.register(spec("a"), 0, now)
        prompt = conversation("apart", 12)
        await store.apply("a", 1, 1, [retain(prompt[:10], "h", groups=2)], now)
        expected = list(range(6)) + [1000 + i for i in range(6)]
        match = await store.lookup(ns, prompt[:6], 0, "p", store.clock(), False)
        assert match.best is not None and list(match.best.block_ids) == expected
        [ids_key] = control.keys("*:ids")
        run_key = ids_key.removesuffix(b":ids")
        keys_key = run_key + b":hs"
        assert control.strlen(keys_key) == 10 * 8 and not control.keys("*scratch*")

        control.hset(run_key, mapping={"ids": control.get(ids_key), "hs": control.get(keys_key)})
        control.delete(ids_key, keys_key)
        control.hdel(run_key, "k")  # the older layout
        [found] = await store.find(ns, prompt[4], store.clock())
        assert list(found.block_ids) == [4, 1004] and found.position == 4
        again = await store.lookup(ns, prompt[:6], 0, "p", store.clock(), False)
        assert again.best is not None and list(again.best.block_ids) == expected
        assert control.strlen(keys_key) == 10 * 8 and not control.hexists(run_key, "hs")

        control.set(ids_key, control.hget(run_key, "ids")[:-4])  # the last id lost
        control.hdel(run_key, "ids")
        short = await store.lookup(ns, prompt, 0, "p", store.clock(), False)
        assert short.best is None  # the whole run matches, so its ids must all be there
        control.set(ids_key, control.get(ids_key) + b"\x00" * 4)

        await store.apply("a", 1, 2, [retain(prompt[:3], "h")], store.clock())  # replaces the run
        match = await store.lookup(ns, prompt, 0, "p", store.clock(), False)
        assert match.best is not None and list(match.best.block_ids) == [0, 1, 2]
        assert not control.exists(ids_key, keys_key)
        assert len(control.keys("*:ids")) == len(control.keys("*:hs")) == 1
    finally:
        control.close()
        await store.close()


async def test_a_lookup_whose_longest_runs_lost_their_ids_answers_the_next_shorter_holder(redis_url):
    """Runs whose ids are gone (a maxmemory policy evicted them) are never handed out; a Lookup then
    answers the longest holder that has its ids, not RECOMPUTE."""
    from kvloop.daemon.index import IndexConfig, Namespace
    from kvloop.daemon.index.redis_store import RedisStore
    from tests.test_index import retain, spec

    store = await RedisStore.connect(redis_url, IndexConfig())
    control = redis.Redis.from_url(redis_url)
    try:
        await store.flush()
        now = store.clock()
        for worker in ("a", "b", "c"):
            await store.register(spec(worker), 0, now)
        prompt = conversation("evicted", 12)
        await store.apply("a", 1, 1, [retain(prompt[:10], "ha")], now)
        await store.apply("b", 1, 1, [retain(prompt[:10], "hb")], now)
        await store.apply("c", 1, 1, [retain(prompt[:6], "hc")], now)
        for run_key in control.keys("*:run:*"):
            if not run_key.endswith((b":ids", b":hs")) and control.hget(run_key, "w") in (b"a", b"b"):
                control.delete(run_key + b":ids")
        match = await store.lookup(Namespace("m"), prompt, 0, "p", store.clock(), False)
        assert match.best is not None and match.best.worker.worker_id == "c" and not match.others
        assert match.best.matched_blocks == 6 and list(match.best.block_ids) == list(range(6))
    finally:
        control.close()
        await store.close()


async def test_a_lookups_scratch_keys_never_reach_a_replica_and_its_claim_does(tmp_path):
    """A Lookup compares in scratch strings it deletes before returning, unreplicated: the primary's
    replication stream does not move for a Lookup that claims nothing, and moves, reaching the
    replica, for one that claims a single-use run."""
    from kvloop.daemon.index import IndexConfig, Namespace
    from kvloop.daemon.index.redis_store import RedisStore
    from tests.test_index import retain, spec

    primary_port = free_port()
    with ExitStack() as stack:
        primary_url = stack.enter_context(local_redis(tmp_path, port=primary_port))
        replica_url = stack.enter_context(
            local_redis(tmp_path, extra=["--replicaof", "127.0.0.1", str(primary_port)])
        )
        primary, replica = redis.Redis.from_url(primary_url), redis.Redis.from_url(replica_url)
        stack.callback(primary.close)
        stack.callback(replica.close)
        wait_until(lambda: replica.info("replication")["master_link_status"] == "up", what="replica sync")
        primary.config_set("repl-ping-replica-period", 3600)  # no PING in the stream while measuring
        store = await RedisStore.connect(primary_url, IndexConfig())
        try:
            now = store.clock()
            await store.register(spec("a"), 0, now)
            prompt = conversation("scratch", 8)
            await store.apply("a", 1, 1, [retain(prompt, "h", single_use=True)], now)

            def offsets() -> tuple[int, int]:
                return (
                    primary.info("replication")["master_repl_offset"],
                    replica.info("replication")["master_repl_offset"],
                )

            wait_until(lambda: len(set(offsets())) == 1, what="replica caught up")
            before = offsets()
            looked = await store.lookup(Namespace("m"), prompt, 0, "p", store.clock(), False)
            assert looked.best is not None and looked.best.matched_blocks == 8
            assert offsets() == before and not primary.keys("*scratch*")
            claimed = await store.lookup(Namespace("m"), prompt, 0, "p", store.clock(), True)
            assert claimed.best is not None and claimed.best.handle == "h"
            assert offsets()[0] > before[0]
            wait_until(lambda: replica.keys("*run:*") and replica.hget(replica.keys("*run:1")[0], "cl"))
            assert not replica.keys("*scratch*")
        finally:
            await store.close()


async def test_a_models_spec_past_its_second_is_refreshed_beside_the_lookup(redis_url, monkeypatch):
    """Every Lookup reads its model's spec. Past a second old the cached spec is still answered at once
    and refreshed in the background (a quiet model's Lookups each paid two round trips for it);
    past MODEL_SPEC_STALE_S it is fetched first."""
    from kvloop.daemon.index import IndexConfig, redis_registry
    from kvloop.daemon.index.redis_store import RedisStore
    from tests.test_index import spec

    store = await RedisStore.connect(redis_url, IndexConfig())
    control = redis.Redis.from_url(redis_url)

    def reads() -> int:  # the refresh's first command
        return control.info("commandstats").get("cmdstat_srandmember", {}).get("calls", 0)

    try:
        await store.flush()
        await store.register(spec("a", block_size=32), 0, store.clock())
        first = await store.model_spec("m")
        assert first is not None and first.block_size == 32
        monkeypatch.setattr(redis_registry, "MODEL_SPEC_FRESH_S", 0.0)  # every cached spec is past it
        before = reads()
        assert await store.model_spec("m") == first  # answered from the cache, nothing sent first
        assert reads() == before
        await wait_for_async(lambda: reads() == before + 1)  # refreshed in the background
        monkeypatch.setattr(redis_registry, "MODEL_SPEC_STALE_S", 0.0)
        before = reads()
        assert await store.model_spec("m") == first
        assert reads() == before + 1  # too old to answer with: fetched first
    finally:
        control.close()
        await store.close()
