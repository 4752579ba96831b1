"""The directory on Redis with real engines: two kvloopd replicas over a Redis primary, its replica and
three Sentinels; a prefill and a decode `vllm serve` (float32) with their sidecars; the proxy. A
conversation streams through the proxy while a replica dies, the Redis primary fails over, and every
replica restarts. No request fails, the KV a turn pulls gives the answer a recompute of the same tokens
gives (same greedy tokens, logprobs within 1e-3), and turns transfer again within the targets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvloop.clients.bench.chaos import checked_request, stream_chat
from kvloop.clients.demo.conversation import AgentConversation
from kvloop.clients.directory_client import DirectoryClient
from tests.e2e.conftest import HAVE_ENGINES
from tests.support import wait_until

MODEL = "kvloop-tiny"
LOGPROB_BOUND = 1e-3


@pytest.fixture(scope="module")
def ha_stack(tmp_path_factory) -> Iterator:
    if not HAVE_ENGINES:
        pytest.fail("the e2e tests need vLLM's CPU build and NIXL: run `make setup-engines` (make test does)")
    from kvloop.clients.fleet.model import build_tiny_llama
    from kvloop.clients.fleet.stack import Stack, StackConfig

    workdir = tmp_path_factory.mktemp("ha")
    model = build_tiny_llama(workdir / "model")
    stack = Stack(StackConfig(model_dir=model, workdir=workdir, ha=True, dtype="float32", kv_cache_gib=1))
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


class Turns:
    """One conversation through the proxy; every turn's answer recorded, none may fail."""

    def __init__(self, stack, seed: int) -> None:
        self.stack = stack
        self.conversation = AgentConversation(seed=seed, system_words=300, tool_words=120)

    def request(self, salt: str | None = None) -> dict:
        body = checked_request(MODEL, self.conversation.messages, 8)
        return body | ({"cache_salt": salt} if salt else {})

    def ask(self, salt: str | None = None) -> dict:
        result = stream_chat(self.stack.proxy_url, self.request(salt), 180)
        assert not result["error"], result["error"]
        return result

    def next(self) -> dict:
        """The next turn; its answer joins the conversation and its retained run reaches kvloopd."""
        prompt = list(self.conversation.messages)
        result = self.ask()
        self.conversation.record(result["answer"])
        assert self.stack.wait_turn_retained(prompt), "the retained run never reached kvloopd"
        return result

    def check_against_recompute(self, pulled: dict) -> None:
        """The same tokens under another cache_salt match nothing: a full recompute to compare with."""
        reference = self.ask(salt=f"reference-{time.monotonic_ns()}")
        assert reference["path"] != "transfer"
        assert pulled["tokens"] == reference["tokens"]
        worst = max(abs(a - b) for a, b in zip(pulled["logprobs"], reference["logprobs"], strict=True))
        assert worst <= LOGPROB_BOUND, f"logprobs differ by {worst:.2e}"


def test_killing_the_replica_the_sidecar_streams_to(ha_stack):
    turns = Turns(ha_stack, seed=61)
    turns.next()
    assert turns.next()["path"] == "transfer"
    decode = ha_stack.decodes[0].config.worker_id
    index = ha_stack.replica_of(decode)
    assert index is not None
    killed_at = time.monotonic()
    ha_stack.kill_replica(index)
    try:
        # the conversation goes on at once: the first turn that transfers must start within 2 s
        while True:
            started = time.monotonic() - killed_at
            result = turns.ask()
            if result["path"] == "transfer":
                break
            assert started < 2.0, f"no transfer within 2 s of the kill (last: {result['reason']})"
        assert started <= 2.0
        print(f"replica killed: a turn transferred again {started:.2f}s after")
        turns.check_against_recompute(result)
    finally:
        ha_stack.restart_replica(index)
        with DirectoryClient(ha_stack.replicas[index][0]) as client:
            client.wait_ready(30)


def test_redis_primary_failover(ha_stack):
    turns = Turns(ha_stack, seed=62)
    turns.next()
    assert turns.next()["path"] == "transfer"
    old = ha_stack.primary()
    promoted: list[float] = []

    def watch_sentinel() -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not promoted:
            if ha_stack.primary() != old:
                promoted.append(time.monotonic())
            time.sleep(0.05)  # polling Sentinel for the promotion

    watcher = threading.Thread(target=watch_sentinel)
    past_epoch = ha_stack.directory_epoch()
    ha_stack.kill_redis_primary()
    killed_at = time.monotonic()
    watcher.start()
    paths = []
    # turns keep coming; none fails; after Sentinel promotes the replica, one transfers within 2 s
    while True:
        started = time.monotonic()
        result = turns.ask()
        paths.append(f"{result['path']}/{result['reason']}")
        if result["path"] == "transfer" and promoted and started >= promoted[0]:
            break
        assert started - killed_at < 90, f"no transfer after the failover: {paths}"
    watcher.join()
    assert started - promoted[0] <= 2.0, f"failover at {promoted[0] - killed_at:.1f}s, paths {paths}"
    print(
        f"Redis primary stopped: Sentinel promoted after {promoted[0] - killed_at:.1f}s, a turn transferred "
        f"again {started - promoted[0]:.2f}s after that; paths {paths}"
    )
    turns.check_against_recompute(result)
    # what `kvloop demo --ha` waits for: every replica past the old epoch, the agents' state re-pushed
    assert ha_stack.wait_failed_over(old, past_epoch, timeout_s=30)
    ha_stack.rejoin_redis(old)


def test_restarting_every_replica_keeps_the_directory(ha_stack):
    turns = Turns(ha_stack, seed=63)
    turns.next()
    # An earlier failover's resyncs must be over before counting the ones a restart would cause.
    wait_until(ha_stack.settled, timeout=60, what="every replica on one epoch, no resync pending")
    with DirectoryClient(ha_stack.daemon_address) as directory:
        before = {w.registration.worker_id: w.resyncs for w in directory.list_workers(MODEL)}
        retained = directory.stats().retained_runs
    for index in range(len(ha_stack.replicas)):
        ha_stack.kill_replica(index)
        ha_stack.restart_replica(index)
        with DirectoryClient(ha_stack.replicas[index][0]) as client:
            client.wait_ready(30)
    with DirectoryClient(ha_stack.daemon_address) as directory:
        after = {w.registration.worker_id: w.resyncs for w in directory.list_workers(MODEL)}
        assert directory.stats().retained_runs == retained
    assert after == before, "a replica restart made agents resync"
    result = turns.ask()
    assert result["path"] == "transfer", result
