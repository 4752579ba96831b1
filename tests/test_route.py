"""Route against a real kvloopd (memory and Redis stores): candidates ranked by expected TTFT from their
prefix caches, the pull Lookup would add and their queues; token ids hashed as vLLM hashes them."""

from __future__ import annotations

import asyncio
import contextlib
import random

import aiohttp
import grpc
import pytest

from kvloop.agents.connector.directory import answer_from_proto
from kvloop.agents.connector.plans import PlanInbox
from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient, KvloopError
from kvloop.clients.proxy.backends import BackendPool
from kvloop.clients.proxy.continuation import HISTORY_PREFIX_ROUTES, ContinuationRoutes
from kvloop.clients.proxy.routing import BURST_WAITS, Router
from kvloop.common import block_hash
from kvloop.common.route_estimate import settled_without_pull
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, retained, running_agent, wait_until

BS = 16  # tests.support.registration's block size


def stored(hashes: list[bytes]) -> pb.BlockEvent:
    return pb.BlockEvent(stored=pb.BlocksStored(block_hashes=hashes))


@pytest.fixture(params=["memory", "redis"])
def routed_daemon(request, daemon, daemon_factory):
    if request.param == "memory":
        return daemon
    return daemon_factory("--store", request.getfixturevalue("redis_url"))


@contextlib.asynccontextmanager
async def fleet(client, model: str, workers: dict[str, tuple[int, list[pb.BlockEvent]]], **reg):
    """Real agent links: worker id -> (role, events it published)."""
    async with contextlib.AsyncExitStack() as stack:
        for worker, (role, events) in workers.items():
            await stack.enter_async_context(
                running_agent(
                    client, worker, model, *events, role=role, http_endpoint=f"http://{worker}", **reg
                )
            )
        yield


@contextlib.asynccontextmanager
async def plan_inbox(address: str, worker: str, **settings):
    """A prefill connector's plan inbox, subscribed to kvloopd's Plans stream."""
    defaults = {"block_size": BS, "min_pull_tokens": 64, "lease_margin_ms": 5_000, "epoch": lambda: 0}
    inbox = PlanInbox(address, worker, **(defaults | settings)).start()
    try:
        assert await asyncio.to_thread(inbox.connected.wait, 10)
        yield inbox
    finally:
        inbox.stop()


def proxy_pool(*urls: str) -> BackendPool:
    """The proxy's prefill pool over these candidates, all healthy (no health checks run)."""
    pool = BackendPool("prefill", list(urls))
    for backend in pool.backends:
        backend.healthy = True
    return pool


def by_worker(answer: pb.RouteResponse) -> dict[str, pb.RouteScore]:
    return {s.worker_id: s for s in answer.ranked}


async def test_route_weighs_local_prefix_pull_and_queue(routed_daemon):
    model = "m-route"
    prompt = conversation("route", 64)  # 1024 tokens
    prefill, decode = pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_DECODE
    async with AsyncDirectoryClient(routed_daemon.address) as client:
        workers = {
            "p-warm": (prefill, [stored(prompt[:50])]),
            "p-cold": (prefill, []),
            "p-near": (prefill, [stored(prompt[:38])]),
            "d-hold": (decode, [retained(prompt[:40], "h-1", single_use=True)]),
        }
        async with fleet(client, model, workers):
            answer = await client.route(model, ["p-cold", "p-warm", "nobody"], block_hashes=prompt)
            # the candidate with the longer local prefix wins clearly
            assert [s.worker_id for s in answer.ranked][:2] == ["p-warm", "p-cold"]
            assert answer.tied == 1 and answer.prompt_blocks == 64 and answer.prompt_tokens == 1024
            scores = by_worker(answer)
            warm, cold, nobody = scores["p-warm"], scores["p-cold"], scores["nobody"]
            assert (warm.local_blocks, warm.pull_blocks, warm.compute_tokens) == (50, 0, 14 * BS)
            assert warm.pull_reason == pb.DECISION_REASON_LOCAL_PREFIX
            # the cold one would pull the decode's 40 blocks, as Lookup would decide
            assert (cold.local_blocks, cold.pull_blocks, cold.compute_tokens) == (0, 40, 24 * BS)
            assert cold.pull_holder_worker_id == "d-hold" and cold.pull_holder_blocks == 40
            assert cold.pull_reason == pb.DECISION_REASON_TRANSFER_FASTER
            assert cold.pull_cost.transfer_ms == pytest.approx(cold.transfer_ms)
            assert cold.transfer_ms < cold.pull_cost.recompute_ms
            for s in answer.ranked:
                assert s.expected_ttft_ms == pytest.approx(s.queue_ms + s.transfer_ms + s.compute_ms)
                assert s.compute_ms == pytest.approx(s.compute_tokens / s.prefill_tokens_per_s * 1e3)
            assert not nobody.registered and nobody.local_blocks == 0 and nobody.compute_tokens == 1024
            assert answer.ranked[-1].worker_id == "nobody"
            # Route settles the warm one (no peer holds more than its own prefix: its connector may skip
            # the Lookup), not one that pulls, nor an unknown one
            assert settled_without_pull(warm) == "local_prefix"
            assert settled_without_pull(cold) is None and settled_without_pull(nobody) is None
            # a holder with 2 blocks more is below the threshold, but the connector still asks: its
            # Lookup may re-measure the pair
            near = by_worker(await client.route(model, ["p-near"], block_hashes=prompt))["p-near"]
            assert near.pull_reason == pb.DECISION_REASON_BELOW_THRESHOLD and near.pull_holder_worker_id
            assert settled_without_pull(near) is None
            # a prompt nobody holds is settled as a miss for a prefill without it
            unheld = await client.route(model, ["p-cold"], block_hashes=conversation("unheld", 8))
            assert settled_without_pull(unheld.ranked[0]) == "miss"

            # a queue outweighs the cache: 1000 tokens queued on the warm one
            queued = await client.route(
                model,
                [
                    pb.RouteCandidate(worker_id="p-warm", queued_tokens=1000),
                    pb.RouteCandidate(worker_id="p-cold"),
                ],
                block_hashes=prompt,
            )
            assert [s.worker_id for s in queued.ranked] == ["p-cold", "p-warm"]
            assert by_worker(queued)["p-warm"].queue_ms == pytest.approx(
                1000 / by_worker(queued)["p-warm"].prefill_tokens_per_s * 1e3
            )
            # in-flight requests without tokens count as this prompt each; by http_endpoint too
            busy = await client.route(
                model,
                [pb.RouteCandidate(http_endpoint="http://p-warm/", in_flight_requests=2)],
                block_hashes=prompt,
            )
            assert busy.ranked[0].worker_id == "p-warm"
            assert busy.ranked[0].queue_ms == pytest.approx(
                2 * 1024 / busy.ranked[0].prefill_tokens_per_s * 1e3
            )

            # Route claimed nothing: the single-use run still goes to a claiming Lookup
            looked = await client.lookup(model, prompt, requester="p-cold", claim=True)
            assert looked.decision == pb.DECISION_TRANSFER and looked.holder.worker_id == "d-hold"
            # ... and once claimed, Route no longer counts on it
            after = by_worker(await client.route(model, ["p-cold"], block_hashes=prompt))["p-cold"]
            assert after.pull_blocks == 0 and after.compute_tokens == 1024
            # held but claimed: not settled, the claim may come back before this prefill asks
            assert after.pull_reason == pb.DECISION_REASON_CLAIMED and settled_without_pull(after) is None


async def test_a_pull_that_makes_up_for_the_missing_cache_ties(routed_daemon):
    model = "m-route-tie"
    prompt = conversation("tie", 64)
    async with AsyncDirectoryClient(routed_daemon.address) as client:
        workers = {
            "p-a": (pb.WORKER_ROLE_PREFILL, [stored(prompt[:10])]),
            "p-b": (pb.WORKER_ROLE_PREFILL, []),
            "d": (pb.WORKER_ROLE_DECODE, [retained(prompt[:40], "h")]),
        }
        async with fleet(client, model, workers):
            answer = await client.route(model, ["p-a", "p-b"], block_hashes=b"".join(prompt))
    # both end at block 40 (one pulls 30 on top of 10, the other all 40): the router's load rule decides
    assert answer.tied == 2
    scores = by_worker(answer)
    assert (scores["p-a"].local_blocks, scores["p-a"].pull_blocks) == (10, 30)
    assert (scores["p-b"].local_blocks, scores["p-b"].pull_blocks) == (0, 40)


@pytest.mark.parametrize(
    "waits_ms, step_wait_ms, tied",
    [
        ((150, 250), 175.0, 1),  # every step the pair's READs waited for was long
        ((2, 3, 2, 3, 2, 400, 600, 500), 2.0, 2),  # short steps, but for a burst's busy ones
    ],
    ids=["long_steps", "short_steps_and_a_burst"],
)
async def test_a_pull_costs_its_pairs_step_wait_and_a_local_hit_does_not(
    routed_daemon, waits_ms, step_wait_ms, tied
):
    """The pulling prefill schedules the request a step after its READ is done; a local prefix hit is
    scheduled at once. With equal coverage, the pair's step wait decides for the local hit when the
    pair's steps are long. The wait counted is the lower quartile of the pair's latest: a READ issued
    while its engine computes other requests' prompts waits out that step, which is the queue Route
    counts apart, so a burst's few long waits do not make the pair's every later pull look dear."""
    model = f"m-route-wait-{len(waits_ms)}"
    # workers of their own: the cost model learns per (holder, puller) pair, whatever the model
    a, b, d = (f"{w}-{len(waits_ms)}" for w in ("p-a", "p-b", "d"))
    prompt = conversation("wait", 64)
    # b's READs from d, each timed by NIXL at 2 ms and waiting for engine steps
    reads = [
        pb.BlockEvent(
            transfer=pb.TransferReport(
                source_worker_id=d,
                bytes=4 << 20,
                duration_us=2_000,
                ok=True,
                nixl_measured=True,
                wait_us=wait_ms * 1000,
            )
        )
        for wait_ms in waits_ms
    ]
    async with AsyncDirectoryClient(routed_daemon.address) as client:
        workers = {
            a: (pb.WORKER_ROLE_PREFILL, [stored(prompt[:40])]),
            b: (pb.WORKER_ROLE_PREFILL, reads),
            d: (pb.WORKER_ROLE_DECODE, [retained(prompt[:40], "h")]),
        }
        async with fleet(client, model, workers):
            after = await client.route(model, [b, a], block_hashes=prompt)
    # both end at block 40 (with no waits measured they tie: the test above)
    scores = by_worker(after)
    assert (scores[b].pull_blocks, scores[b].pull_wait_ms) == (40, step_wait_ms)
    assert scores[a].pull_wait_ms == 0
    assert after.ranked[0].worker_id == a and after.tied == tied
    assert scores[b].expected_ttft_ms == pytest.approx(
        scores[b].queue_ms + scores[b].transfer_ms + step_wait_ms + scores[b].compute_ms
    )


async def test_route_pushes_the_pull_it_planned_to_the_candidates_connector(routed_daemon):
    """A candidate whose pull Route judged worth a READ gets the answer its own Lookup would get, over
    its Plans stream; its connector takes it for exactly that prompt and local prefix, once."""
    model = "m-route-plan"
    prompt, single = conversation("plan", 64), conversation("plan-single", 64)
    seen_epoch = [0]
    async with AsyncDirectoryClient(routed_daemon.address) as client:
        workers = {
            "p-cold": (pb.WORKER_ROLE_PREFILL, []),
            "p-warm": (pb.WORKER_ROLE_PREFILL, [stored(prompt[:50])]),
            "d": (
                pb.WORKER_ROLE_DECODE,
                [retained(prompt[:40], "h-multi"), retained(single[:40], "h-single", single_use=True)],
            ),
        }
        async with fleet(client, model, workers):
            async with plan_inbox(routed_daemon.address, "p-cold", epoch=lambda: seen_epoch[0]) as inbox:
                # a single-use run needs a claim, which Route never makes: no plan for it
                await client.route(model, ["p-cold"], block_hashes=single)
                # p-warm's own prefix is longer than the pull: planned for p-cold only
                answer = await client.route(model, ["p-cold", "p-warm"], block_hashes=prompt)
                assert by_worker(answer)["p-cold"].pull_blocks == 40
                await asyncio.to_thread(wait_until, lambda: len(inbox) == 1, 10, "Route's plan")
                # the stream keeps Route's order, so the single-use prompt's turn came first: nothing
                assert inbox.take(single, 0) is None

                planned = inbox.take(prompt, 0)
                looked_up = answer_from_proto(
                    await client.lookup(model, prompt, requester="p-cold", pack_block_ids=True)
                )
                assert planned is not None and planned.path == looked_up.path == pb.TURN_PATH_TRANSFER
                assert (planned.reason, planned.matched_blocks) == (looked_up.reason, 40)
                assert planned.holder is not None and looked_up.holder is not None
                assert planned.holder.retention_handle == "h-multi"
                assert planned.holder.block_ids == looked_up.holder.block_ids
                assert planned.holder.expires_in_ms <= looked_up.holder.expires_in_ms + 1_000
                assert planned.detail.startswith("planned by Route")
                assert inbox.take(prompt, 0) is None  # taken once

                async def plan_again() -> None:
                    await client.route(model, ["p-cold"], block_hashes=prompt)
                    await asyncio.to_thread(wait_until, lambda: len(inbox) == 1, 10, "Route's plan")

                # another local prefix than Route counted, or another prompt length: Lookup decides
                await plan_again()
                assert inbox.take(prompt, 3) is None and len(inbox) == 0
                await plan_again()
                assert inbox.take(prompt[:63], 0) is None
                # a lease that would not outlive the engine's margin
                await plan_again()
                inbox.lease_margin_ms = 10**9
                assert inbox.take(prompt, 0) is None
                inbox.lease_margin_ms = 5_000
                # minted under an older directory epoch than this engine has seen since
                await plan_again()
                seen_epoch[0] = planned.holder.directory_epoch + 1
                assert inbox.take(prompt, 0) is None
                seen_epoch[0] = 0
                await plan_again()
                assert inbox.take(prompt, 0) is not None


async def test_a_continuation_plan_answers_the_next_turns_longer_prompt(routed_daemon):
    """Route asked for a conversation as its last turn left it (continuation): the plan it pushes
    answers the next turn, which resends that history and appends new blocks, as that turn's own
    Lookup would - and is kept for it past an exact plan's life. It is not taken for a prompt that
    departs from the history, for another local prefix, or twice."""
    model = "m-route-continuation"
    prompt = conversation("continued", 64)  # the next turn: the 40-block history, then 24 new blocks
    history, departed = prompt[:40], prompt[:39] + conversation("departed", 64)[39:]
    async with AsyncDirectoryClient(routed_daemon.address) as client:
        workers = {
            "p-cold": (pb.WORKER_ROLE_PREFILL, []),
            "d": (pb.WORKER_ROLE_DECODE, [retained(history, "h-history")]),
        }
        async with fleet(client, model, workers):
            async with plan_inbox(routed_daemon.address, "p-cold") as inbox:

                async def plan(continuation: bool) -> None:
                    await client.route(model, ["p-cold"], block_hashes=history, continuation=continuation)
                    await asyncio.to_thread(wait_until, lambda: len(inbox) == 1, 10, "Route's plan")

                # a plan for exactly the history answers that prompt only, not a longer one
                await plan(continuation=False)
                assert inbox.take(prompt, 0) is None and len(inbox) == 1
                assert inbox.take(history, 0) is not None

                await plan(continuation=True)
                inbox.ttl_s = 0.0  # an exact plan's life: past it, a continuation plan is still kept
                assert inbox.take(departed, 0) is None  # the departed prompt shares 39 blocks only
                assert inbox.take(prompt, 3) is None and len(inbox) == 0  # another local prefix
                await plan(continuation=True)
                planned = inbox.take(prompt, 0)
                looked_up = answer_from_proto(
                    await client.lookup(model, prompt, requester="p-cold", pack_block_ids=True)
                )
                assert planned is not None and planned.source == "continuation_plan"
                assert planned.path == looked_up.path == pb.TURN_PATH_TRANSFER
                assert (planned.reason, planned.matched_blocks) == (looked_up.reason, 40)
                assert planned.holder is not None and looked_up.holder is not None
                assert planned.holder.retention_handle == looked_up.holder.retention_handle == "h-history"
                assert planned.holder.block_ids == looked_up.holder.block_ids
                assert planned.detail.startswith("planned by Route ahead of this turn")
                assert inbox.take(prompt, 0) is None  # taken once


async def test_a_plan_reaches_a_connector_streaming_from_another_replica(daemon_factory, redis_url):
    """Replicas sharing a Redis store: the router asks one, the prefill's connector streams from another,
    and the plan crosses over Redis."""
    asked, streamed = daemon_factory("--store", redis_url), daemon_factory("--store", redis_url)
    model, prompt = "m-route-plan-ha", conversation("plan-ha", 32)
    async with AsyncDirectoryClient(asked.address) as client:
        workers = {
            "p": (pb.WORKER_ROLE_PREFILL, []),
            "d": (pb.WORKER_ROLE_DECODE, [retained(prompt[:20], "h")]),
        }
        async with fleet(client, model, workers):
            async with plan_inbox(streamed.address, "p", min_pull_tokens=0, lease_margin_ms=0) as inbox:
                with DirectoryClient(asked.address) as sync:

                    def crossed() -> bool:  # pub/sub is at most once: Route again until one crossed
                        sync.route(model, ["p"], block_hashes=prompt)
                        return len(inbox) > 0

                    await asyncio.to_thread(wait_until, crossed, 20, "a plan over Redis", 0.2)
                planned = inbox.take(prompt, 0)
                assert planned is not None and planned.holder is not None
                assert (planned.matched_blocks, planned.holder.retention_handle) == (20, "h")


async def test_plans_go_over_redis_only_for_workers_another_replica_streams(redis_url):
    """Each replica announces the workers whose connectors stream plans from it; another replica
    relays a plan only for a worker announced lately, and stops once that stream ends."""
    import redis.asyncio as aioredis

    from kvloop.daemon.index.redis_wire import RedisChangeRelay
    from kvloop.daemon.plans import PlanBoard

    client = aioredis.from_url(redis_url)
    asked, streamed = (PlanBoard(relay=RedisChangeRelay(client, "kvl:test-plans")) for _ in range(2))
    relays = [asyncio.create_task(board.relay()) for board in (asked, streamed)]
    try:
        assert not asked.wants("p")  # no replica streams p's plans: Route posts none
        with streamed.subscription("p") as queue:
            await asyncio.to_thread(wait_until, lambda: asked.wants("p"), 10, "the announcement")
            assert not asked.wants("q") and not streamed.wants("q")
            asked.post("p", pb.PlansResponse(prompt_blocks=7))
            plan = await asyncio.wait_for(queue.get(), 10)
            assert plan is not None and plan.prompt_blocks == 7
        await asyncio.to_thread(wait_until, lambda: not asked.wants("p"), 10, "the stream's end announced")
    finally:
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        await client.aclose()


def test_shutdown_ends_the_plans_streams_at_once(daemon_factory):
    """A connector's Plans stream ends cleanly when kvloopd shuts down, so a shutdown does not wait out
    its grace for it (the stream would then end cancelled)."""
    proc = daemon_factory(env={"KVLOOP_SHUTDOWN_GRACE_S": "60"})
    with DirectoryClient(proc.address) as client:
        plans = client.plans("p")
        plans.initial_metadata()  # subscribed
        proc.process.terminate()
        assert list(plans) == []
        assert plans.code() == grpc.StatusCode.OK
    assert proc.process.wait(30) == 0


@pytest.mark.parametrize("rate", ["pooled", "per_worker"])
async def test_route_ranks_a_pool_of_like_prefills_with_one_rate(daemon_factory, rate):
    """Two prefills whose latest prefills ran at 1,000 and 3,000 tokens/s (one had busy co-tenants):
    pooled (the default), both are ranked with the rate of all their samples, so the one with the
    longer local prefix wins; per_worker, the faster one wins despite it."""
    model = "m-route-rate"
    prompt = conversation("rate", 64)  # 1024 tokens
    daemon = daemon_factory(env={"KVLOOP_POLICY__ROUTE_PREFILL_RATE": rate})

    def prefills(tokens_per_s: int) -> list[pb.BlockEvent]:
        return [
            pb.BlockEvent(prefill=pb.PrefillReport(tokens=1000, duration_us=int(1000 / tokens_per_s * 1e6)))
            for _ in range(5)
        ]

    async with AsyncDirectoryClient(daemon.address) as client:
        workers = {
            "p-slow": (pb.WORKER_ROLE_PREFILL, [stored(prompt[:8]), *prefills(1000)]),
            "p-fast": (pb.WORKER_ROLE_PREFILL, prefills(3000)),
        }
        async with fleet(client, model, workers):
            answer = await client.route(model, ["p-fast", "p-slow"], block_hashes=prompt)
    scores = by_worker(answer)
    if rate == "pooled":
        assert scores["p-slow"].prefill_tokens_per_s == scores["p-fast"].prefill_tokens_per_s
        assert scores["p-fast"].prefill_tokens_per_s == pytest.approx(2000, rel=1e-4)
        assert scores["p-slow"].prefill_basis.startswith("pooled (10 prefills")
        assert answer.ranked[0].worker_id == "p-slow"  # 896 tokens to compute against 1024
    else:
        rates = (scores["p-slow"].prefill_tokens_per_s, scores["p-fast"].prefill_tokens_per_s)
        assert rates == pytest.approx((1000, 3000), rel=1e-4)
        assert answer.ranked[0].worker_id == "p-fast"


async def test_route_hashes_token_ids_with_the_models_registered_settings(daemon):
    model = "m-route-tokens"
    tokens = list(range(3, 3 + 10 * BS + 5))
    hashes = block_hash.block_hashes(tokens, BS, "sha256_cbor", "0")
    salted = block_hash.block_hashes(tokens, BS, "sha256_cbor", "0", cache_salt="tenant-1")
    assert len(hashes) == 10 and salted[0] != hashes[0]
    async with AsyncDirectoryClient(daemon.address) as client:
        workers = {
            "p-plain": (pb.WORKER_ROLE_PREFILL, [stored(hashes[:7])]),
            "p-salted": (1, [stored(salted)]),
        }
        async with fleet(client, model, workers, hash_seed="0"):
            plain = by_worker(await client.route(model, ["p-plain", "p-salted"], token_ids=tokens))
            salty = by_worker(
                await client.route(model, ["p-plain", "p-salted"], token_ids=tokens, cache_salt="tenant-1")
            )
            # The client sends the ids packed; grpcurl and other languages send them as the repeated field.
            candidates = [pb.RouteCandidate(worker_id=w) for w in ("p-plain", "p-salted")]
            repeated = by_worker(
                await client._invoke(
                    "Route", pb.RouteRequest(model=model, token_ids=tokens, candidates=candidates)
                )
            )
            for bad, fragment in [
                (pb.RouteRequest(packed_token_ids=b"\0" * 6), "not a multiple of 4"),
                (pb.RouteRequest(packed_token_ids=b"\0" * 64, token_ids=tokens), "exactly one"),
            ]:
                bad.model = model
                bad.candidates.extend(candidates)
                with pytest.raises(KvloopError, match=fragment) as refused:
                    await client._invoke("Route", bad)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (plain["p-plain"].local_blocks, plain["p-salted"].local_blocks) == (7, 0)
    assert {w: (s.local_blocks, s.compute_tokens) for w, s in repeated.items()} == {
        w: (s.local_blocks, s.compute_tokens) for w, s in plain.items()
    }
    assert (salty["p-plain"].local_blocks, salty["p-salted"].local_blocks) == (0, 10)
    # the partial last block is still computed
    assert salty["p-salted"].compute_tokens == 5


def test_the_remembering_hasher_gives_the_reference_hashes_turn_after_turn():
    """Route's BlockHasher against block_hashes over a conversation that grows and is edited, salted
    and not, both algorithms and block sizes, with room for fewer blocks than the conversation has."""
    rng = random.Random(7)
    for algorithm, block_size, salt, room, turn_tokens in [
        ("sha256_cbor", 16, "", 1 << 16, (20, 90)),
        ("sha256", 32, "", 1 << 16, (20, 90)),
        ("sha256_cbor", 16, "tenant-1", 1 << 16, (20, 90)),
        ("sha256_cbor", 16, "", 5, (20, 90)),  # evicts within every call, remembers no span
        ("sha256_cbor", 16, "", 0, (20, 90)),  # remembers nothing
        # histories of several spans of blocks, edited inside one and where one begins
        ("sha256_cbor", 16, "", 1 << 16, (100, 400)),
        ("sha256_cbor", 16, "tenant-2", 1 << 16, (100, 400)),
        ("sha256_cbor", 4, "", 40, (100, 400)),  # room for two spans: they are evicted too
    ]:
        hasher = block_hash.BlockHasher(room)
        history: list[int] = []
        resent = found = known = 0
        span_tokens = block_hash.BlockHasher.SPAN_BLOCKS * block_size
        for turn in range(6):
            history += [rng.randrange(1 << 17) for _ in range(rng.randrange(*turn_tokens))]
            if turn == 3:
                history[40] += 1  # an edited history: every block from the third on changes
            if turn == 4 and len(history) > 2 * span_tokens:
                history[span_tokens] += 1  # the first block of the second span
            expected = block_hash.block_hashes(history, block_size, algorithm, "0", salt)
            hits_before = hasher.hits
            assert hasher.hashes(history, block_size, algorithm, "0", salt) == expected
            found, known, resent = hasher.hits - hits_before, resent, len(expected)
        assert len(hasher._chains.get(algorithm, ())) <= room
        assert len(hasher._spans.get(algorithm, ())) <= room // block_hash.BlockHasher.SPAN_BLOCKS
        if room >= 1 << 10:
            # the last turn resent the one before: that history was found, not hashed again
            assert found >= known - (1 if salt else 0)
        else:
            assert hasher.hits == 0 if room == 0 else hasher.misses > 0
    wide = [1 << 40] * 32  # not uint32: hashed as the reference does, not remembered
    assert block_hash.BlockHasher().hashes(wide, 16, "sha256_cbor") == block_hash.block_hashes(
        wide, 16, "sha256_cbor"
    )
    with pytest.raises(block_hash.UnsupportedHashing, match="xxhash"):
        block_hash.BlockHasher().hashes([1] * 32, 16, "xxhash")


@pytest.mark.parametrize(
    ("kwargs", "code", "fragment"),
    [
        ({"candidates": [], "token_ids": [1] * 32}, grpc.StatusCode.INVALID_ARGUMENT, "no candidates"),
        (
            {"token_ids": [1] * 32, "block_hashes": [b"x" * 32]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "exactly one",
        ),
        ({"token_ids": [1] * 32, "lora_name": "l"}, grpc.StatusCode.INVALID_ARGUMENT, "LoRA"),
        (
            {"token_ids": [1] * 32, "model": "m-route-unseeded"},
            grpc.StatusCode.FAILED_PRECONDITION,
            "hash seed",
        ),
        (
            {"token_ids": [1] * 32, "model": "m-route-nobody"},
            grpc.StatusCode.FAILED_PRECONDITION,
            "registered",
        ),
        (
            {"block_hashes": [b"x" * 32], "cache_salt": "s"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "cache_salt only applies",
        ),
    ],
)
async def test_bad_routes_are_refused_precisely(daemon, kwargs, code, fragment):
    arguments = {"model": "m-route-unseeded", "candidates": ["p"], **kwargs}
    model, candidates = arguments.pop("model"), arguments.pop("candidates")
    async with AsyncDirectoryClient(daemon.address) as client:
        async with running_agent(client, "p-unseeded", "m-route-unseeded", role=pb.WORKER_ROLE_PREFILL):
            with pytest.raises(KvloopError) as failure:
                await client.route(model, candidates, **arguments)
    assert failure.value.code == code and fragment in str(failure.value)


async def test_a_burst_the_proxy_routes_at_once_is_spread_by_the_queues_it_adds(daemon):
    """Four requests routed together, each best on the same prefill when the queues are empty: each
    choice is counted into its prefill's queue before the next is ranked, so they alternate (ranked on
    the queues the Route requests were sent with, all four would go to the one prefill)."""
    model = "m-route-burst"
    tokens = list(range(3, 3 + 20 * BS))
    hashes = block_hash.block_hashes(tokens, BS, "sha256_cbor", "0")
    pool = proxy_pool("http://burst-a", "http://burst-b")
    async with AsyncDirectoryClient(daemon.address) as client:
        # burst-a holds 4 of the 20 blocks: idle, it computes 256 tokens against burst-b's 320
        workers = {"burst-a": (pb.WORKER_ROLE_PREFILL, [stored(hashes[:4])]), "burst-b": (1, [])}
        async with fleet(client, model, workers, hash_seed="0"), aiohttp.ClientSession() as session:
            router = Router(pool, client, timeout_s=5.0)
            body = {"model": model, "prompt": tokens}  # token ids already: no tokenizing
            alone = await router.choose(session, body, chat=False)
            assert (alone.outcome, alone.backend.url, alone.queued_tokens) == ("route", "http://burst-a", 256)
            alone.release()
            burst = await asyncio.gather(*(router.choose(session, body, chat=False) for _ in range(4)))
    chosen = [c.backend.url for c in burst]
    assert sorted(chosen) == ["http://burst-a"] * 2 + ["http://burst-b"] * 2, chosen
    # each request counted where it went, with what it computes there
    assert {b.url: (b.in_flight, b.queued_tokens) for b in pool.backends} == {
        "http://burst-a": (2, 512),
        "http://burst-b": (2, 640),
    }
    # the expected TTFT each was chosen with includes the queue the earlier ones of the burst made
    assert sorted(c.expected_ttft_ms for c in burst)[-1] > alone.expected_ttft_ms


async def test_the_proxy_breaks_a_tie_for_the_candidate_that_pulls_less(daemon):
    """Route ties a prefill with 10 blocks of its own + 30 pulled and one pulling all 40; the proxy,
    both idle, takes the one that pulls less every time rather than alternating (a READ also costs
    the holder's decode time, which the estimate leaves out)."""
    model = "m-route-tie-break"
    tokens = list(range(5, 5 + 64 * BS))
    hashes = block_hash.block_hashes(tokens, BS, "sha256_cbor", "0")
    pool = proxy_pool("http://tb-a", "http://tb-b")
    async with AsyncDirectoryClient(daemon.address) as client:
        workers = {
            "tb-a": (pb.WORKER_ROLE_PREFILL, [stored(hashes[:10])]),
            "tb-b": (pb.WORKER_ROLE_PREFILL, []),
            "tb-d": (pb.WORKER_ROLE_DECODE, [retained(hashes[:40], "h-tb")]),
        }
        async with fleet(client, model, workers, hash_seed="0"), aiohttp.ClientSession() as session:
            router = Router(pool, client, timeout_s=5.0)
            chosen = []
            for _ in range(3):
                choice = await router.choose(session, {"model": model, "prompt": tokens}, chat=False)
                chosen.append((choice.outcome, choice.backend.url, choice.score.pull_blocks))
                choice.release()
    assert chosen == [("tie", "http://tb-a", 30)] * 3


async def test_routing_by_prefix_takes_the_longest_own_prefix_and_ignores_what_a_pull_would_add(daemon):
    """`--route-by prefix`: the prefill whose own cache holds the longest prefix of the prompt, whatever
    a decode retains; the load rule decides among equals, and a prompt no prefill holds any of is a
    miss the load rule places. What a prefix choice queues is all its own cache lacks: it counts on
    no pull, where Route's estimate counts on pulling the rest from the decode."""
    model = "m-route-by-prefix"
    tokens = list(range(7, 7 + 40 * BS))
    hashes = block_hash.block_hashes(tokens, BS, "sha256_cbor", "0")
    shared = list(range(5000, 5000 + 10 * BS))
    shared_hashes = block_hash.block_hashes(shared, BS, "sha256_cbor", "0")
    fresh = list(range(9000, 9000 + 8 * BS))
    pool = proxy_pool("http://pr-a", "http://pr-b", "http://pr-c")
    async with AsyncDirectoryClient(daemon.address) as client:
        workers = {
            "pr-a": (pb.WORKER_ROLE_PREFILL, [stored(hashes[:12])]),
            "pr-b": (pb.WORKER_ROLE_PREFILL, [stored(hashes[:8]), stored(shared_hashes[:6])]),
            "pr-c": (pb.WORKER_ROLE_PREFILL, [stored(shared_hashes[:6])]),
            "pr-d": (pb.WORKER_ROLE_DECODE, [retained(hashes[:40], "h-pr")]),
        }
        async with fleet(client, model, workers, hash_seed="0"), aiohttp.ClientSession() as session:
            router = Router(pool, client, timeout_s=5.0, by_prefix=True)
            chosen = []
            for prompt in (tokens, tokens, shared, shared, fresh, fresh, fresh):
                choice = await router.choose(session, {"model": model, "prompt": prompt}, chat=False)
                chosen.append((choice.outcome, choice.backend.url[-1], choice.queued_tokens))
                if prompt is tokens:
                    assert choice.score.compute_tokens < 28 * BS  # Route counted on the decode's run
                choice.release()
    assert chosen[:2] == [("prefix", "a", 28 * BS)] * 2
    assert sorted(chosen[2:4]) == [("prefix_tie", "b", 4 * BS), ("prefix_tie", "c", 4 * BS)]
    assert [c[0] for c in chosen[4:]] == ["prefix_miss"] * 3 and {c[2] for c in chosen[4:]} == {8 * BS}
    assert sorted(c[1] for c in chosen[4:]) == ["a", "b", "c"]  # round-robin over the idle three
    assert not router.keeps_turns  # a prefix choice asks Route on every request's path


async def test_the_python_example_scores_candidates_from_token_ids(daemon):
    """examples/score_candidates.py, run as a user would, against a real kvloopd."""
    import asyncio
    import json
    import subprocess
    import sys
    from pathlib import Path

    model = "m-route-example"
    tokens = list(range(7, 7 + 6 * BS))
    hashes = block_hash.block_hashes(tokens, BS, "sha256_cbor", "0")
    example = Path(__file__).parents[1] / "examples" / "score_candidates.py"
    async with AsyncDirectoryClient(daemon.address) as client:
        workers = {"ex-warm": (pb.WORKER_ROLE_PREFILL, [stored(hashes[:4])]), "ex-cold": (1, [])}
        async with fleet(client, model, workers, hash_seed="0"):
            done = await asyncio.to_thread(
                subprocess.run,
                [
                    sys.executable,
                    str(example),
                    "--daemon",
                    daemon.address,
                    "--model",
                    model,
                    "--token-ids",
                    ",".join(map(str, tokens)),
                    "--candidate",
                    "http://ex-cold",
                    "--candidate",
                    "ex-warm=1",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
    assert done.returncode == 0, done.stderr
    ranked = json.loads(done.stdout)["ranked"]
    warm = next(r for r in ranked if r["worker_id"] == "ex-warm")
    cold = next(r for r in ranked if r["worker_id"] == "ex-cold")
    assert warm["local_blocks"] == 4 and "local_blocks" not in cold  # proto3 JSON omits zeros
    assert warm["queue_ms"] > 0 and cold["http_endpoint"] == "http://ex-cold"


async def test_the_proxy_routes_a_conversations_next_turn_from_routes_answer_at_its_last(daemon):
    """When a streamed turn ends the proxy asks Route about the conversation as it now stands; the next
    turn, which resends it with a new message, is routed from that answer - no tokenizing, no Route on
    its path - with its queue counted from the estimate plus the new message's tokens. A history that
    shares no message with the kept one, or a second use, asks Route as before; one that edited the
    kept answer is ranked from the kept answer cut to the messages before it."""
    model = "m-route-continued"
    tokens = list(range(11, 11 + 48 * BS))
    hashes = block_hash.block_hashes(tokens, BS, "sha256_cbor", "0")
    pool = proxy_pool("http://ct-a", "http://ct-b")
    first = [
        {"role": "system", "content": "be terse " * 40},
        {"role": "user", "content": "list the files " * 30},
    ]
    answer = "README.md pyproject.toml " * 20
    new_message = {"role": "user", "content": "Tool output: " + "x.py " * 60}
    async with AsyncDirectoryClient(daemon.address) as client:
        workers = {
            "ct-a": (pb.WORKER_ROLE_PREFILL, [stored(hashes[:36])]),  # the last turn's prompt
            "ct-b": (pb.WORKER_ROLE_PREFILL, []),
            "ct-d": (pb.WORKER_ROLE_DECODE, [retained(hashes[:48], "h-ct")]),  # prompt and answer
        }
        async with fleet(client, model, workers, hash_seed="0"), aiohttp.ClientSession() as session:
            # without a directory to ask, no turn is kept (and the proxy asks no decode for token ids)
            undirected = Router(pool, None, timeout_s=5.0, continuations=ContinuationRoutes())
            assert not undirected.keeps_turns
            await undirected.turn_ended({"model": model, "messages": first}, answer, tokens, delay_s=0)
            assert len(undirected.continuations) == 0
            router = Router(pool, client, timeout_s=5.0, continuations=ContinuationRoutes())
            assert router.keeps_turns
            body = {"model": model, "messages": first, "stream": True}
            await router.turn_ended(body, answer, tokens, delay_s=0)
            assert len(router.continuations) == 1

            def next_turn(assistant: str, edited: bool = False) -> dict:
                history = [{"role": "system", "content": "be brief"}, *first[1:]] if edited else first
                return {
                    "model": model,
                    "messages": [*history, {"role": "assistant", "content": assistant}, new_message],
                }

            # not the kept conversation: Route on the turn's path (no tokenizer here: the load rule)
            choice = await router.choose(session, next_turn(answer, edited=True), chat=True)
            assert choice.outcome == "load_tokenize_failed", choice.outcome
            choice.release()
            choice = await router.choose(session, next_turn(answer), chat=True)
            # ct-a's own prefix plus a pull leads (or ties ct-b's whole pull, and pulls less)
            assert (
                choice.outcome in ("continuation", "continuation_tie") and choice.backend.url == "http://ct-a"
            )
            assert choice.score is not None and (choice.score.local_blocks, choice.score.pull_blocks) == (
                36,
                12,
            )
            assert choice.settled is None  # the answer is a turn old: the connector still looks
            # the new message's tokens, estimated at the history's characters per token
            assert 0 < choice.new_tokens < len(new_message["content"])
            assert choice.queued_tokens == choice.score.compute_tokens + choice.new_tokens
            choice.release()
            again = await router.choose(session, next_turn(answer), chat=True)
            assert again.outcome == "load_tokenize_failed"  # taken once
            again.release()

            # A turn whose answer the client edited shares the system and task messages with the
            # kept conversation: ranked from its answer cut to them, ct-a's cache covers them.
            await router.turn_ended(body, answer, tokens, delay_s=0)
            edited = await router.choose(session, next_turn(answer + " more"), chat=True)
            # (or ties ct-b's pull of them, and pulls less)
            assert edited.outcome in HISTORY_PREFIX_ROUTES and edited.backend.url == "http://ct-a"
            assert edited.score is not None and 0 < edited.score.local_blocks < 36
            assert edited.score.pull_blocks == 0 and edited.settled == "local_prefix"
            assert (
                edited.new_tokens > 0
                and edited.queued_tokens == edited.score.compute_tokens + edited.new_tokens
            )
            edited.release()
            again = await router.choose(session, next_turn(answer), chat=True)
            assert again.outcome == "load_tokenize_failed"  # taken once
            again.release()


def test_continuation_routes_are_bounded_and_expire():
    routes = ContinuationRoutes(ttl_s=60.0, max_entries=2)
    turns = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    for messages in turns:
        routes.keep("m", "", messages, "a", 10, pb.RouteResponse(prompt_tokens=10))
    assert len(routes) == 2  # the oldest out

    def next_of(messages):
        return [*messages, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]

    assert routes.take("m", "", next_of(turns[0])) is None
    assert routes.take("m", "other-salt", next_of(turns[1])) is None  # another tenant's salt
    assert routes.take("m", "", turns[1] + [{"role": "assistant", "content": "a"}]) is None  # nothing new
    taken = routes.take("m", "", next_of(turns[1]))
    assert taken is not None and taken.answer.prompt_tokens == 10
    routes.ttl_s = 0.0
    routes.keep("m", "", turns[0], "a", 10, pb.RouteResponse())
    assert routes.take("m", "", next_of(turns[0])) is None  # expired


def test_an_edited_history_is_ranked_from_the_kept_answer_cut_to_the_messages_it_shares():
    """A turn that departs from a kept conversation after its first messages (an agent dropping an
    earlier answer) takes that conversation's kept answer, cut to the shared messages: the home prefill's
    cache covers them, so no peer adds to it (its connector may skip the Lookup); the peer holding the
    history pulls only the shared part. A request sharing only a system prompt takes nothing, and the
    answer is taken once, whichever way."""
    system = {"role": "system", "content": "s" * 300}
    task = {"role": "user", "content": "t" * 100}
    answer = "a" * 400  # 800 characters, 160 tokens: 0.2 tokens a character

    def score(endpoint: str, local: int, pull: int, transfer_ms: float) -> pb.RouteScore:
        return pb.RouteScore(
            http_endpoint=endpoint,
            registered=True,
            local_blocks=local,
            pull_blocks=pull,
            pull_holder_worker_id="decode",
            pull_holder_blocks=10,
            pull_reason=pb.DECISION_REASON_TRANSFER_FASTER,
            transfer_ms=transfer_ms,
            pull_wait_ms=1.0,
            prefill_tokens_per_s=1000.0,
        )

    kept = pb.RouteResponse(
        prompt_tokens=160,
        prompt_blocks=10,
        block_size=16,
        ranked=[score("http://home", 8, 2, 4.0), score("http://away", 0, 10, 20.0)],
    )
    routes = ContinuationRoutes()

    def keep() -> None:
        routes.keep("m", "", [system, task], answer, 160, kept)

    keep()
    edited = [
        system,
        task,
        {"role": "assistant", "content": "b" * 400},
        {"role": "user", "content": "u" * 50},
    ]
    taken = routes.take("m", "", edited)
    assert taken is not None and taken.outcome == "history_prefix"
    assert taken.new_tokens == 90  # the edited answer and the new message, at 0.2 tokens a character
    cut = taken.answer
    assert (cut.prompt_tokens, cut.prompt_blocks) == (80, 5)  # system and task: 400 characters
    home, away = cut.ranked
    assert (home.local_blocks, home.pull_blocks, home.compute_tokens) == (5, 0, 0)
    assert settled_without_pull(home) == "local_prefix"  # no peer holds more of the shared part
    assert (home.transfer_ms, home.pull_wait_ms, home.expected_ttft_ms) == (0.0, 0.0, 0.0)
    assert (away.local_blocks, away.pull_blocks, away.pull_holder_blocks) == (0, 5, 5)
    assert away.transfer_ms == pytest.approx(10.0) and away.expected_ttft_ms == pytest.approx(11.0)
    assert settled_without_pull(away) is None
    assert routes.take("m", "", [system, task, {"role": "assistant", "content": answer}, edited[3]]) is None

    keep()
    other_task = [system, {"role": "user", "content": "other"}, *edited[2:]]
    assert routes.take("m", "", other_task) is None  # a shared system prompt is not a conversation
    later = [system, task, {"role": "assistant", "content": answer}, edited[3], edited[2], edited[3]]
    taken = routes.take("m", "", later)  # the whole kept history, a turn later: a continuation
    assert taken is not None and taken.outcome == "continuation" and taken.answer == kept
    assert routes.take("m", "", edited) is None and len(routes) == 0


@contextlib.asynccontextmanager
async def homed_conversations(daemon, model: str, homes: list[str], burst_window_s: float):
    """A proxy Router over prefills bh-a and bh-b, and conversations whose last turn each ended (Route
    asked and kept, as when a streamed turn ends): conversation i's last prompt is in prefill homes[i]'s
    prefix cache (36 blocks) and its history, answer included, retained by the decode (40 blocks). Yields
    the router and each conversation's next turn (its history and a new message)."""
    pool = proxy_pool("http://bh-a", "http://bh-b")
    histories = [list(range(1000 * (i + 1), 1000 * (i + 1) + 40 * BS)) for i in range(len(homes))]
    hashes = [block_hash.block_hashes(t, BS, "sha256_cbor", "0") for t in histories]
    stored_at = {
        h: [stored(hs[:36]) for hs, home in zip(hashes, homes, strict=True) if home == h] for h in "ab"
    }
    workers = {
        "bh-a": (pb.WORKER_ROLE_PREFILL, stored_at["a"]),
        "bh-b": (pb.WORKER_ROLE_PREFILL, stored_at["b"]),
        "bh-d": (pb.WORKER_ROLE_DECODE, [retained(hs[:40], f"h-bh-{i}") for i, hs in enumerate(hashes)]),
    }
    async with AsyncDirectoryClient(daemon.address) as client:
        async with fleet(client, model, workers, hash_seed="0"):
            router = Router(
                pool, client, timeout_s=5.0, continuations=ContinuationRoutes(), burst_window_s=burst_window_s
            )
            turns = []
            for i, tokens in enumerate(histories):
                first = [{"role": "user", "content": f"conversation {i}: " + "list the files " * 40}]
                answer = "README.md pyproject.toml " * 10
                await router.turn_ended({"model": model, "messages": first}, answer, tokens, delay_s=0)
                turns.append(
                    {
                        "model": model,
                        "messages": [
                            *first,
                            {"role": "assistant", "content": answer},
                            {"role": "user", "content": "Tool output: " + "x.py " * 10},
                        ],
                    }
                )
            assert len(router.continuations) == len(homes)
            yield router, turns


@pytest.mark.parametrize("window_s", [0.005, 0.0], ids=["placed_together", "placed_as_they_come"])
async def test_a_burst_of_turns_is_placed_together_so_each_stays_with_its_cache(daemon, window_s):
    """Four conversations' next turns arrive together, the first two homed on bh-a (its prefix cache holds
    their history), the other two on bh-b. Placed as they come, the second goes to idle bh-b, pulling its
    whole history there, and the fourth then to bh-a: half the burst leaves its cache. With the window,
    the second waits for the rest of the burst and is placed home then, every conversation pulling only
    its last answer."""
    homes = ["a", "a", "b", "b"]
    async with homed_conversations(daemon, f"m-burst-home-{window_s}", homes, window_s) as (router, turns):
        waited_home = BURST_WAITS.labels("home")._value.get()
        async with aiohttp.ClientSession() as session:
            choices = await asyncio.gather(*(router.choose(session, t, chat=True) for t in turns))
    placed = [c.backend.url[-1] for c in choices]
    assert all(c.outcome in ("continuation", "continuation_tie") for c in choices)
    if window_s:
        assert placed == homes
        assert [c.score.pull_blocks for c in choices] == [4] * 4
        assert [c.burst_wait_ms > 0 for c in choices] == [False, True, False, False]
        assert BURST_WAITS.labels("home")._value.get() == waited_home + 1
    else:
        assert placed == ["a", "b", "b", "a"]
        assert all(c.burst_wait_ms == 0 for c in choices)
    assert {b.url: b.in_flight for b in router.pool.backends} == {"http://bh-a": 2, "http://bh-b": 2}


async def test_a_turn_leaving_its_cache_with_no_burst_to_wait_for_still_leaves(daemon):
    """Two conversations homed on bh-a and an idle bh-b: the second waits out the window, no one else
    comes, and it goes to bh-b after all (the window costs it the wait, not the better prefill)."""
    async with homed_conversations(daemon, "m-burst-alone", ["a", "a"], 0.005) as (router, turns):
        waited_away = BURST_WAITS.labels("away")._value.get()
        async with aiohttp.ClientSession() as session:
            first = await router.choose(session, turns[0], chat=True)
            second = await router.choose(session, turns[1], chat=True)
    assert (first.backend.url, first.burst_wait_ms) == ("http://bh-a", 0)
    assert second.backend.url == "http://bh-b" and second.burst_wait_ms >= 5.0 * 0.9
    assert second.score.pull_blocks == 40
    assert BURST_WAITS.labels("away")._value.get() == waited_away + 1


async def test_a_turn_cancelled_while_it_waits_for_its_burst_is_never_placed(daemon):
    """A client that goes away while its turn waits for the window: nothing is counted into a prefill's
    queue for it, and the window still places the rest."""
    async with homed_conversations(daemon, "m-burst-cancel", ["a", "a", "a"], 0.005) as (router, turns):
        async with aiohttp.ClientSession() as session:
            first = await router.choose(session, turns[0], chat=True)
            gone = asyncio.create_task(router.choose(session, turns[1], chat=True))
            await asyncio.sleep(0)  # its first step: ranked, and waiting (no I/O before the window)
            assert router.burst is not None and router.burst.waiting == 1
            gone.cancel()
            kept = await router.choose(session, turns[2], chat=True)
            with pytest.raises(asyncio.CancelledError):
                await gone
    assert kept.burst_wait_ms > 0 and first.backend.url == "http://bh-a"
    assert sum(b.in_flight for b in router.pool.backends) == 2
    assert sum(b.queued_tokens for b in router.pool.backends) == first.queued_tokens + kept.queued_tokens
