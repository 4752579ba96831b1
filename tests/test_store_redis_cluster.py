"""The directory sharded over a real Redis Cluster: a model's runs spread over every primary while a
Lookup stays one call, agents' chain roots place prefix-cache blocks with their first block, replicas
share it through kvloopd, and a shard's failover fences the old state until agents re-pushed it.
(The behavioural suite in tests/test_index.py runs on the cluster too.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from kvloop.agents.sidecar.mirror import WorkerMirror
from kvloop.clients.directory_client import AsyncDirectoryClient
from kvloop.clients.fleet.redis_local import local_redis_cluster
from kvloop.daemon.config import DaemonSettings
from kvloop.daemon.convert import events_from_batch
from kvloop.daemon.index import IndexConfig, Namespace, Removed, Retained, Stored, WorkerSpec
from kvloop.daemon.index.cluster_layout import LAYOUT_KEY, OtherLayout, merged_lookup
from kvloop.daemon.index.redis_cluster_store import RedisClusterStore
from kvloop.daemon.index.redis_wire import key_bytes
from kvloop.v1 import directory_pb2 as pb
from tests.store_backends import CLUSTER_BUCKETS
from tests.support import conversation, retained, running_agent, wait_until

NS = Namespace("m")


def spec(worker_id: str, epoch: int = 1) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id,
        role=2,
        model="m",
        engine_id=f"e-{worker_id}",
        nixl_endpoint="127.0.0.1:1",
        block_size=16,
        hash_algorithm="sha256_cbor",
        hash_length=32,
        epoch=epoch,
        kv_bytes_per_block=1024,
    )


async def open_cluster(url: str, **config) -> RedisClusterStore:
    store = await RedisClusterStore.connect_cluster(url, IndexConfig(**config), buckets=CLUSTER_BUCKETS)
    await store.flush()
    return store


def keys_per_node(url: str) -> list[int]:
    cluster = redis.RedisCluster.from_url(url)
    try:
        return [len(cluster.keys("kvl:*", target_nodes=node)) for node in cluster.get_primaries()]
    finally:
        cluster.close()


async def test_a_models_runs_spread_over_every_primary_and_each_prompt_finds_its_own(redis_cluster_url):
    store = await open_cluster(redis_cluster_url)
    try:
        await store.register(spec("d"), 0, 0.0)
        prompts = [conversation(f"c{i}", 12) for i in range(40)]
        events = [Retained(p, list(range(12)), 1, f"h{i}", 60_000) for i, p in enumerate(prompts)]
        await store.apply("d", 1, 1, events, 0.0)
        # every primary holds some of the model's keys (the registry's slot is one of them)
        assert all(n > 0 for n in keys_per_node(redis_cluster_url)), keys_per_node(redis_cluster_url)
        for i, prompt in enumerate(prompts):
            match = await store.lookup(NS, prompt + conversation("next", 3), 0, "p", 1.0, claim=False)
            assert match.best is not None and match.best.handle == f"h{i}" and match.best.matched_blocks == 12
        assert (await store.counts()).retained_runs == 40
        [view] = await store.workers(1.0)
        assert view.retained_runs == 40 and view.retained_blocks == 480
    finally:
        await store.close()


async def test_an_agents_chain_roots_keep_a_prompts_cached_blocks_together(redis_cluster_url):
    """vLLM stores a prompt's blocks in pieces, each naming only its parent: the agent names each
    piece's root, so a Route counts the whole chain, after removals and after a resync snapshot."""
    store = await open_cluster(redis_cluster_url)
    try:
        worker = spec("d")
        await store.register(worker, 0, 0.0)
        mirror = WorkerMirror(32)
        prompt = conversation("chained", 40)
        pieces = [(prompt[i : i + 8], prompt[i - 1] if i else None) for i in range(0, 40, 8)]
        sequence = 0

        async def push(*raw: dict) -> None:
            nonlocal sequence
            sequence += 1
            batch = pb.EventBatch(sequence=sequence, events=[mirror.convert_vllm(e) for e in raw])
            await store.apply("d", 1, sequence, events_from_batch(batch, worker, 10_000).events, 1.0)

        await push(
            *(
                {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": parent}
                for hs, parent in pieces
            )
        )
        assert (await store.stored_prefixes(NS, prompt, ["d"], 1.0)) == {"d": 40}
        await push({"type": "BlockRemoved", "block_hashes": prompt[30:]})
        assert (await store.stored_prefixes(NS, prompt, ["d"], 1.0)) == {"d": 30}
        # a resync re-pushes the mirror's state in one event per chain
        await store.begin_snapshot("d", 1.0)
        assert (await store.stored_prefixes(NS, prompt, ["d"], 1.0)) == {"d": 0}
        snapshot = pb.EventBatch(sequence=0, events=mirror.snapshot())
        await store.apply("d", 1, 0, events_from_batch(snapshot, worker, 10_000).events, 1.0)
        await store.end_snapshot("d", sequence, 1.0)
        assert (await store.stored_prefixes(NS, prompt, ["d"], 1.0)) == {"d": 30}
        assert (await store.counts()).entries == 30
    finally:
        await store.close()


async def test_conversations_sharing_a_system_prompt_spread_over_every_primary(redis_cluster_url):
    """Every conversation starts with the same system prompt: its runs and cached blocks still spread
    over the primaries (a column's buckets, one on each), and Lookups and Routes answer as one bucket."""
    store = await open_cluster(redis_cluster_url)
    try:
        await store.register(spec("d"), 0, 0.0)
        system = conversation("system", 20)
        prompts = [system + conversation(f"c{i}", 10) for i in range(30)]
        root = key_bytes(system[:1])
        events: list = [Retained(p, list(range(30)), 1, f"h{i}", 60_000) for i, p in enumerate(prompts)]
        events += [Stored(p, root=root) for p in prompts]
        await store.apply("d", 1, 1, events, 0.0)
        cluster = redis.RedisCluster.from_url(redis_cluster_url)
        try:
            runs = [len(cluster.keys("kvl:*run:*:hs", target_nodes=n)) for n in cluster.get_primaries()]
        finally:
            cluster.close()
        assert sorted(runs)[0] >= 5 and sum(runs) == 30, runs  # 30 runs: about 10 on each primary
        for i, prompt in enumerate(prompts):
            match = await store.lookup(NS, prompt + conversation("next", 3), 0, "p", 1.0, claim=False)
            assert match.best is not None and match.best.handle == f"h{i}" and match.best.matched_blocks == 30
        fresh = system + conversation("fresh", 5)
        match = await store.lookup(NS, fresh, 0, "p", 1.0, claim=False)
        assert match.best is not None and match.best.matched_blocks == 20
        assert await store.stored_prefixes(NS, fresh, ["d", "other"], 1.0) == {"d": 20, "other": 0}
        assert await store.stored_prefixes(NS, prompts[7], ["d"], 1.0) == {"d": 30}
        await store.apply("d", 1, 2, [Removed(prompts[7][25:], roots=[root] * 5)], 1.0)
        assert await store.stored_prefixes(NS, prompts[7], ["d"], 1.0) == {"d": 25}
    finally:
        await store.close()


async def test_a_single_use_run_is_claimed_once_whichever_bucket_holds_it(redis_cluster_url):
    store = await open_cluster(redis_cluster_url)
    try:
        await store.register(spec("d"), 0, 0.0)
        system = conversation("system", 4)
        runs = [
            Retained(system + conversation(f"c{i}", i + 1), list(range(5 + i)), 1, f"h{i}", 60_000, True)
            for i in range(6)
        ]
        await store.apply("d", 1, 1, runs, 0.0)
        prompt = system + conversation("c5", 6)
        first = await store.lookup(NS, prompt, 0, "p", 1.0, claim=True)
        assert first.best is not None and first.best.handle == "h5" and first.best.matched_blocks == 10
        # the buckets whose shorter runs were claimed for the answer gave them back
        for i in range(5):
            match = await store.lookup(NS, system + conversation(f"c{i}", i + 1), 0, "q", 1.0, claim=True)
            assert match.best is not None and match.best.handle == f"h{i}", (i, match)
        again = await store.lookup(NS, prompt, 4, "p", 1.0, claim=True)
        assert again.best is None and again.unservable_reason == "claimed"
    finally:
        await store.close()


async def test_a_cluster_holding_a_directory_of_another_layout_is_refused(redis_cluster_url):
    """Block keys of another layout (an older release's, or other bucket counts) would be neither found
    nor removed: kvloopd does not start on it."""
    cluster = redis.RedisCluster.from_url(redis_cluster_url)
    try:
        cluster.flushall()
        cluster.hset("kvl:models", "m", "kvl:{tag}:")  # a directory, without the layout's record
        with pytest.raises(OtherLayout, match="older key layout"):
            await RedisClusterStore.connect_cluster(redis_cluster_url, buckets=CLUSTER_BUCKETS)
        cluster.flushall()
        store = await open_cluster(redis_cluster_url)  # a new cluster takes this store's layout
        await store.register(spec("d"), 0, 0.0)
        await store.close()
        assert cluster.get(LAYOUT_KEY) == f"2:{CLUSTER_BUCKETS}:3".encode()
        for other in ({"buckets": 2 * CLUSTER_BUCKETS}, {"buckets": CLUSTER_BUCKETS, "spread": 1}):
            with pytest.raises(OtherLayout, match="same cluster_buckets"):
                await RedisClusterStore.connect_cluster(redis_cluster_url, **other)
        store = await RedisClusterStore.connect_cluster(redis_cluster_url, buckets=CLUSTER_BUCKETS)
        await store.close()
    finally:
        cluster.flushall()
        cluster.close()


def test_a_columns_answers_merge_as_one_buckets():
    def entry(worker: str, expires_ms: int, tier: int = 1, single_use: str = "0") -> list:
        return [worker, "1", f"h-{worker}", expires_ms, b"", 1, single_use, b"", b"", tier, 0, b""]

    none = [["none", ""], ["none", "peer_unavailable"], ["none", "claimed"]]
    assert merged_lookup(none, claim=True) == (["none", "claimed"], -1, [])
    replies = [
        ["found", 5, entry("a", 100, single_use="1")],
        ["none", "expired"],
        ["found", 7, entry("b", 50, tier=2, single_use="1"), entry("c", 10)],
        ["found", 7, entry("d", 20, single_use="1")],
    ]
    reply, winner, claimed = merged_lookup(replies, claim=True)
    # the longest match, device runs first, then the longest-lived; the other buckets' claims go back
    assert reply[:2] == ["found", 7] and [e[0] for e in reply[2:]] == ["d", "c", "b"]
    assert winner == 3 and claimed == [0, 2]
    assert merged_lookup(replies, claim=False)[2] == []


async def test_a_run_of_an_epoch_its_worker_left_is_never_handed_out(redis_cluster_url):
    """Replica B's view of the workers is behind replica A's writes: a run retained under an epoch the
    worker has left (its purge on A not yet done) is skipped, and a worker B has not seen is read."""
    a, b = await open_cluster(redis_cluster_url), await open_cluster(redis_cluster_url)
    try:
        prompt = conversation("epochs", 6)
        await a.register(spec("d", epoch=1), 0, 0.0)
        await a.apply("d", 1, 1, [retained_run(prompt, "old")], 0.0)
        assert (await b.lookup(NS, prompt, 0, "p", 1.0, claim=False)).best.handle == "old"
        # the run of epoch 1 stays where it is (as if A's purge of it had not run), the worker moves on
        await a._fcall("kvl_disconnect", [f"{a._base('m')}w:d"], a._base("m"), "d", "1", "1.0")
        await a._fcall(
            "kvl_register",
            [f"{a._base('m')}w:d"],
            a._base("m"),
            "d",
            "2",
            0,
            "1.0",
            "10.0",
            "10000",
            '{"worker_id": "d"}',
            "16|sha256_cbor|32",
            "1",
        )
        b._forget_view("m")
        match = await b.lookup(NS, prompt, 0, "p", 1.5, claim=True)
        assert match.best is None
        # a worker registered after B's view was read is looked up, not taken for dead
        await a.register(spec("e"), 0, 2.0)
        await a.apply("e", 1, 1, [retained_run(prompt, "new")], 2.0)
        assert (await b.lookup(NS, prompt, 0, "p", 2.0, claim=False)).best.handle == "new"
    finally:
        await a.close()
        await b.close()


def retained_run(hashes, handle) -> Retained:
    return Retained(hashes, list(range(len(hashes))), 1, handle, 60_000)


async def test_a_shards_failover_fences_the_old_state_until_agents_re_pushed_it(daemon_factory, tmp_path):
    """Two kvloopd replicas on a 3-primary cluster with a replica each; the primary holding a run dies
    and its replica is promoted: nothing is handed out until the agent re-pushed its state."""
    with local_redis_cluster(tmp_path, primaries=3, replicas=1, node_timeout_ms=1000) as cluster:
        config = tmp_path / "kvloopd.toml"
        # a lease longer than the failover: the agent stays registered while it is away
        config.write_text(
            f'lease_s = 60.0\n[store]\nurl = "{cluster.url}"\ncluster = true\ncluster_buckets = 8\n'
        )
        a = daemon_factory("--config", str(config), "--log-level", "debug")
        b = daemon_factory("--config", str(config), "--log-level", "debug")
        model, prompt = "m-cluster", conversation("cluster", 16)
        held = [retained(prompt, "h")]
        async with AsyncDirectoryClient(a.address) as on_a, AsyncDirectoryClient(b.address) as on_b:
            async with running_agent(on_a, "dec-c", model, *held, snapshot=lambda: held, epoch=77):
                before = await on_b.lookup(model, prompt, requester="pre", block_size=16)
                assert before.decision == pb.DECISION_TRANSFER and before.matched_blocks == 16
                # max_entries bounds each of a model's 8 buckets: the bound a model has is 8 times it
                assert (await on_b.stats()).max_entries == 8 * DaemonSettings().max_entries
            # the primary holding the run dies
            roles = cluster.roles()
            holder = next(
                port
                for port, role in roles.items()
                if role == "master" and redis.Redis(port=port).keys("*:run:*")
            )
            cluster.stop_node(holder)
            # one replica wins the epoch's compare-and-set and marks every worker; the other follows
            wait_until(
                lambda: "every worker must resync" in a.log() + b.log(),
                timeout=30,
                what="kvloopd to see the failover",
            )
            during = await lookup_until_answered(on_b, model, prompt)
            assert during.decision == pb.DECISION_RECOMPUTE
            assert during.reason == pb.DECISION_REASON_DIRECTORY_RESYNCING
            # the agent comes back under its epoch, is asked for its state, re-pushes it: served again
            async with running_agent(on_a, "dec-c", model, snapshot=lambda: held, epoch=77) as link:
                deadline = time.monotonic() + 30
                while link.snapshots_sent < 1:
                    assert time.monotonic() < deadline, "no snapshot asked for"
                    await asyncio.sleep(0.05)  # polling a condition, not synchronising on time
                while True:
                    after = await lookup_until_answered(on_b, model, prompt)
                    if after.decision == pb.DECISION_TRANSFER:
                        break
                    assert time.monotonic() < deadline, f"transfers did not resume: {after}"
                    await asyncio.sleep(0.1)  # polling a condition, not synchronising on time
                assert after.matched_blocks == 16 and after.holder.worker_id == "dec-c"
        assert any(role == "master" for port, role in cluster.roles().items() if port != holder)


async def lookup_until_answered(client, model, prompt) -> pb.LookupResponse:
    """A Lookup, retried while the cluster client finds the promoted primary (UNAVAILABLE)."""
    from kvloop.clients.directory_client import KvloopError

    deadline = time.monotonic() + 30
    while True:
        try:
            return await client.lookup(model, prompt, requester="pre", block_size=16)
        except KvloopError:
            assert time.monotonic() < deadline, "kvloopd did not reach the promoted primary"
        await asyncio.sleep(0.1)  # polling a condition, not synchronising on time


async def test_a_call_sent_to_a_node_that_no_longer_owns_its_slot_follows_the_redirection(redis_cluster_url):
    """The request path's calls go straight to the node the client's slot map names; when that map is
    out of date (a slot moved) the node answers MOVED and the call takes the client's way, which
    follows it."""
    from redis.crc import key_slot

    store = await open_cluster(redis_cluster_url)
    try:
        await store.register(spec("d"), 0, 0.0)
        prompt = conversation("moved", 5)
        await store.apply("d", 1, 1, [retained_run(prompt, "h")], 0.0)
        bucket = store._layout.of_run("", key_bytes(prompt[:1]), "h")
        _, prefix = store._bucket_namespace(NS, bucket)
        slot = key_slot(f"{prefix}ret".encode())
        manager = store._r.nodes_manager
        owner = manager.slots_cache[slot][0]
        manager.slots_cache[slot] = [next(n for n in store._r.get_primaries() if n.name != owner.name)]
        match = await store.lookup(NS, prompt, 0, "p", 1.0, claim=False)
        assert match.best is not None and match.best.handle == "h"
        assert manager.get_node_from_slot(slot).name == owner.name  # the client learnt the owner again
    finally:
        await store.close()


async def test_a_burst_of_calls_beyond_the_connection_pools_waits_instead_of_failing(redis_cluster_url):
    """redis-py's cluster client refuses a call outright when a node's pool is exhausted; kvloopd bounds
    the calls it has in flight, so many finds at once (each asks every bucket) are all answered."""
    store = await open_cluster(redis_cluster_url)
    try:
        await store.register(spec("d"), 0, 0.0)
        prompt = conversation("burst", 40)
        await store.apply("d", 1, 1, [retained_run(prompt, "h")], 0.0)
        found = await asyncio.gather(*(store.find(NS, h, 1.0) for h in prompt))  # 40 x 16 bucket calls
        assert [len(locations) for locations in found] == [1] * 40
    finally:
        await store.close()


def test_a_cluster_with_no_reachable_node_stops_startup_with_a_message(tmp_path):
    import subprocess

    from kvloop.common.addresses import free_port
    from tests.conftest import KVLOOPD

    config = tmp_path / "kvloopd.toml"
    config.write_text(f'[store]\nurl = "redis://127.0.0.1:{free_port()}"\ncluster = true\n')
    down = subprocess.run(
        [KVLOOPD, "--config", str(config), "--check-config", "--connect"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1 and "Traceback" not in down.stderr, down.stderr
    assert "cannot use the store at redis://127.0.0.1:" in down.stderr and "Redis Cluster" in down.stderr
    both = config.with_name("both.toml")
    both.write_text('[store]\nurl = "redis://127.0.0.1:1"\ncluster = true\nsentinels = ["127.0.0.1:2"]\n')
    refused = subprocess.run(
        [KVLOOPD, "--config", str(both), "--check-config"], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "give cluster or sentinels, not both" in refused.stderr
