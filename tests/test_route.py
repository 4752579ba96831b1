"""Route against a real kvloopd (memory and Redis stores): candidates ranked by expected TTFT from their
prefix caches, the pull Lookup would add and their queues; token ids hashed as vLLM hashes them."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from kvloop.clients.client import AsyncDirectoryClient, KvloopError
from kvloop.common import block_hash
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation, retained, running_agent

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
    assert (plain["p-plain"].local_blocks, plain["p-salted"].local_blocks) == (7, 0)
    assert (salty["p-plain"].local_blocks, salty["p-salted"].local_blocks) == (0, 10)
    # the partial last block is still computed
    assert salty["p-salted"].compute_tokens == 5


def test_block_hashes_equal_vllms_own():
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256, sha256_cbor

    tokens = list(range(100, 100 + 3 * BS))
    for name, fn in (("sha256_cbor", sha256_cbor), ("sha256", sha256)):
        parent, expected = fn("vllm-none-hash"), []
        for i in range(3):
            extra = (("cache_salt", "s"),) if i == 0 else None
            parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[i * BS : (i + 1) * BS], extra)
            expected.append(bytes(parent))
        assert block_hash.block_hashes(tokens, BS, name, cache_salt="s") == expected


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
