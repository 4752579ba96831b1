"""Fuzzing kvloopd through its public RPCs, and the regression tests of what
the fuzzer found. Every daemon here is a real kvloopd process."""

from __future__ import annotations

import hashlib
import itertools
import os
import queue
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.clients.bench.fuzz import (
    FUZZ_WORKERS,
    MODEL,
    SERVICE,
    FuzzConfig,
    Tokens,
    fuzz_target,
    good_registration,
    run_fuzz,
)
from kvloop.clients.directory_client import DirectoryClient, KvloopError
from kvloop.common.security import ClientSecurity
from kvloop.v1 import directory_pb2 as pb
from kvloop.v1 import directory_pb2_grpc as pb_grpc
from tests.support import registration, retained, wait_until

# Inputs the test sends: a few thousand where the machine allows; the time cap keeps the test short on
# a loaded 2-core machine, and the test checks that a meaningful number ran.
FUZZ_INPUTS = int(os.environ.get("KVLOOP_FUZZ_INPUTS", "2000"))
FUZZ_SECONDS = float(os.environ.get("KVLOOP_FUZZ_SECONDS", "25"))


def test_fuzzed_inputs_get_precise_statuses_and_leave_other_agents_alone():
    result = run_fuzz(FuzzConfig(inputs=FUZZ_INPUTS, seed=12, max_seconds=FUZZ_SECONDS))
    _check_fuzz_result(result)


def test_fuzzed_inputs_on_the_redis_store(redis_url):
    """The same fuzzing with the directory on Redis (a shorter run: it shares the host's time)."""
    result = run_fuzz(FuzzConfig(inputs=FUZZ_INPUTS, seed=13, max_seconds=FUZZ_SECONDS / 2, store=redis_url))
    assert result["store"] == "redis"
    # Fewer inputs: the memory run above is the one that must reach every method.
    _check_fuzz_result(result, least=100, every_method=False)


def _check_fuzz_result(result: dict, least: int = 150, every_method: bool = True) -> None:
    assert result["inputs"] >= min(FUZZ_INPUTS, least), result["inputs"]
    assert result["crashes"] == 0
    assert result["failure_count"] == 0, result["failures"]
    assert result["invariant_violations"] == []
    assert result["daemon_errors_logged"] == 0, result["daemon_error_samples"]
    # The inputs reach every kind of refusal, and enough of them are accepted.
    for code in ("OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED", "UNAUTHENTICATED"):
        assert result["statuses"].get(code, 0) > 0, (code, result["statuses"])
    assert result["statuses_by_method"]["Connect"].get("OK", 0) > 0
    if every_method:
        assert set(result["statuses_by_method"]) >= {"Connect", "Lookup", "FindBlock", "DrainWorker"}


# ---- a raw Connect stream, message by message --------------------------------------------------


class RawStream:
    """A Connect stream whose requests are sent one at a time (bytes or messages) and whose answers
    are read one at a time."""

    def __init__(self, channel: grpc.Channel, token: str | None = None) -> None:
        self._requests: queue.Queue = queue.Queue()
        call = channel.stream_stream(SERVICE + "Connect", response_deserializer=pb.ConnectResponse.FromString)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.call = call(iter(self._requests.get, None), metadata=metadata, timeout=20)

    def send(self, message: pb.ConnectRequest | bytes) -> None:
        self._requests.put(message if isinstance(message, bytes) else message.SerializeToString())

    def receive(self) -> pb.ConnectResponse:
        return next(self.call)

    def status(self) -> tuple[grpc.StatusCode, str]:
        """Half-close and read to the end: the stream's final status."""
        self._requests.put(None)
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""


@pytest.fixture
def channel(daemon) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.address) as ch:
        yield ch


# ---- regression tests of the fuzzer's findings --------------------------------------------------


@pytest.mark.parametrize(
    ("method", "payload"),
    [
        ("GetStats", b"\x01"),  # a truncated tag
        ("Lookup", b"\x0a\x02\xc3\x28"),  # model: 2 bytes that are not UTF-8
        ("FindBlock", b"\x1a\x20\x00"),  # block_hash: length 32, one byte given
        ("Watch", b"\x0a\x05ab"),
    ],
)
def test_undecodable_request_is_invalid_argument(channel, method, payload):
    """Was UNKNOWN ("Unexpected DecodeError raised by servicer method")."""
    stub = (channel.unary_stream if method == "Watch" else channel.unary_unary)(SERVICE + method)
    with pytest.raises(grpc.RpcError) as raised:
        result = stub(payload, timeout=5)
        if method == "Watch":
            next(iter(result))
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in raised.value.details()


def test_undecodable_connect_message_is_invalid_argument(channel):
    """Was INTERNAL ("internal error handling agent stream")."""
    stream = RawStream(channel)
    stream.send(pb.ConnectRequest(register=registration("fuzz-undecodable")))
    assert stream.receive().HasField("registered")
    stream.send(b"\x12\x03\x08")  # batch: 3 bytes announced, 1 given
    code, details = stream.status()
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in details


def test_unknown_role_number_is_refused_before_registering(channel, daemon):
    """proto3 enums are open: role 7 parsed, registered the worker, then failed with INTERNAL."""
    stream = RawStream(channel)
    stream.send(pb.ConnectRequest(register=registration("fuzz-role-7", role=7)))
    code, details = stream.status()
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "role must be PREFILL, DECODE or BOTH, got 7" in details
    with DirectoryClient(daemon.address) as client:
        assert "fuzz-role-7" not in {w.registration.worker_id for w in client.list_workers()}


def test_lookup_whose_tokens_overflow_uint32_is_invalid_argument(daemon):
    """A worker registered with a huge block_size made Lookup's matched/recompute token counts overflow
    uint32: UNKNOWN ("Value out of range"). Now refused before the lookup."""
    model = "fuzz-huge-blocks"
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    with grpc.insecure_channel(daemon.address) as ch, DirectoryClient(daemon.address) as client:
        stream = RawStream(ch)
        stream.send(pb.ConnectRequest(register=registration("fuzz-huge", model=model, block_size=2**32 - 1)))
        assert stream.receive().HasField("registered")
        with pytest.raises(KvloopError) as raised:
            client.lookup(model, hashes, requester="p")
        assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "exceed 4294967295 tokens" in str(raised.value)
        stream.status()


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_lookup_with_hashes_of_mixed_lengths_is_invalid_argument(store, daemon_factory, request):
    """A Lookup for a model nobody registered, with hashes of 32, 32 and 10 bytes: the Redis store
    packed them at one width and failed with UNKNOWN (found by `bench fuzz --store redis`)."""
    args = ("--store", request.getfixturevalue("redis_url")) if store == "redis" else ()
    daemon = daemon_factory(*args)
    hashes = [hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest(), b"0123456789"]
    with DirectoryClient(daemon.address) as client:
        with pytest.raises(KvloopError) as raised:
            client.lookup("fuzz-nobody", hashes, requester="p", block_size=16)
        assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "all of one length" in str(raised.value) and "[10]" in str(raised.value)
        # one length, any length, for a model nobody registered: a plain miss
        answer = client.lookup("fuzz-nobody", hashes[:2], requester="p", block_size=16)
    assert answer.decision == pb.DECISION_RECOMPUTE


def test_stream_of_a_dropped_worker_is_aborted(daemon_factory):
    """The reaper dropped a silent worker under its open stream; its next heartbeat raised KeyError
    (INTERNAL). Now the stream ends with ABORTED and the agent registers again."""
    daemon = daemon_factory(
        env={
            "KVLOOP_LEASE_S": "0.3",
            "KVLOOP_HEARTBEAT_INTERVAL_S": "0.1",
            "KVLOOP_DROP_AFTER_S": "0.3",
            "KVLOOP_REAP_INTERVAL_S": "0.05",
        }
    )
    with grpc.insecure_channel(daemon.address) as ch, DirectoryClient(daemon.address) as client:
        stream = RawStream(ch)
        stream.send(pb.ConnectRequest(register=registration("fuzz-silent")))
        assert stream.receive().HasField("registered")
        wait_until(lambda: not client.list_workers(), timeout=10, what="the silent worker dropped")
        stream.send(pb.ConnectRequest(heartbeat=pb.Heartbeat(sent_at_us=1)))
        code, details = stream.status()
    assert code is grpc.StatusCode.ABORTED
    assert "dropped from the directory" in details
    assert '"level": "error"' not in daemon.log()


# ---- tenant isolation (item 5, the daemon's part) ------------------------------------------------


@pytest.fixture(scope="module")
def secured() -> Iterator[tuple[str, Tokens]]:
    """A kvloopd with per-role tokens; agent tokens are bound to one fuzz worker id each."""
    with fuzz_target() as (_process, address, tokens, _workdir):
        yield address, tokens


def _run(name: str, blocks: int, salt: str = "") -> list[bytes]:
    # Like vLLM: the cache salt enters the first block's hash, so every later hash differs too.
    parent, out = b"", []
    for i in range(blocks):
        extra = salt.encode() if i == 0 else b""
        parent = hashlib.sha256(parent + f"{name}:{i}".encode() + extra).digest()
        out.append(parent)
    return out


_epochs = itertools.count(100)


def _publish(address: str, token: str, worker: str, *events: pb.BlockEvent) -> RawStream:
    ch = grpc.insecure_channel(address)
    stream = RawStream(ch, token)
    reg = good_registration(worker, pb.WORKER_ROLE_DECODE, epoch=next(_epochs))
    stream.send(pb.ConnectRequest(register=reg))
    assert stream.receive().HasField("registered")
    if events:
        stream.send(pb.ConnectRequest(batch=pb.EventBatch(sequence=1, events=events)))
        assert stream.receive().ack.sequence == 1
    return stream


def test_bound_agent_token_cannot_publish_or_drain_for_another_worker(secured):
    address, tokens = secured
    victim, intruder = FUZZ_WORKERS[0], FUZZ_WORKERS[1]
    run = _run("victim", 4)
    victim_stream = _publish(address, tokens.agents[victim], victim, retained(run, "victim-run"))
    with DirectoryClient(address, ClientSecurity(token=tokens.admin)) as admin:
        before = [w for w in admin.list_workers() if w.registration.worker_id == victim]
        assert before and before[0].retained_runs == 1

        # Registering as the victim with the intruder's token.
        with grpc.insecure_channel(address) as ch:
            stream = RawStream(ch, tokens.agents[intruder])
            stream.send(pb.ConnectRequest(register=good_registration(victim, pb.WORKER_ROLE_DECODE, epoch=8)))
            code, details = stream.status()
        assert code is grpc.StatusCode.PERMISSION_DENIED
        assert f"may only publish for worker {intruder!r}" in details

        # Registered as itself, the intruder cannot switch to the victim on the same stream.
        stream = _publish(address, tokens.agents[intruder], intruder)
        stream.send(pb.ConnectRequest(register=good_registration(victim, pb.WORKER_ROLE_DECODE, epoch=9)))
        code, _ = stream.status()
        assert code is grpc.StatusCode.FAILED_PRECONDITION

        # Draining needs the admin role: any agent token is refused, for another worker or itself.
        for target in (victim, intruder):
            with grpc.insecure_channel(address) as ch:
                drain = pb_grpc.DirectoryStub(ch).DrainWorker
                with pytest.raises(grpc.RpcError) as raised:
                    drain(
                        pb.DrainWorkerRequest(worker_id=target),
                        metadata=(("authorization", f"Bearer {tokens.agents[intruder]}"),),
                        timeout=5,
                    )
                assert raised.value.code() is grpc.StatusCode.PERMISSION_DENIED

        after = [w for w in admin.list_workers() if w.registration.worker_id == victim]
        assert after[0].registration == before[0].registration
        assert after[0].lease_state == pb.LEASE_STATE_ACTIVE
        assert (after[0].retained_runs, after[0].last_applied_sequence) == (1, 1)
        answer = admin.lookup(MODEL, run, requester="someone")
        assert answer.holder.worker_id == victim and answer.holder.matched_blocks == 4
    victim_stream.status()


_namespaces = st.sampled_from(["", "lora-a", "lora-b", "adapter/with/slash", "Lora-A"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lookups_never_cross_lora_or_cache_salt_namespaces(secured, data):
    """A run published under one (LoRA, cache salt) is only returned to lookups of that same pair."""
    address, tokens = secured
    lora_pub, lora_look = data.draw(_namespaces), data.draw(_namespaces)
    salt_pub, salt_look = (
        data.draw(st.sampled_from(["", "s1", "s2"])),
        data.draw(st.sampled_from(["", "s1", "s2"])),
    )
    worker = FUZZ_WORKERS[2]
    hashes = _run("tenant", 5, salt_pub)
    event = retained(hashes, "tenant-run")
    event.retained.lora_name = lora_pub
    stream = _publish(address, tokens.agents[worker], worker, event)
    try:
        with DirectoryClient(address, ClientSecurity(token=tokens.read)) as client:
            asked = _run("tenant", 5, salt_look)
            answer = client.lookup(MODEL, asked, lora_name=lora_look, requester="tenant-prefill")
            holders = [answer.holder, *answer.other_holders] if answer.HasField("holder") else []
            found = client.find_block(MODEL, asked[0], lora_name=lora_look)
        same = (lora_pub, salt_pub) == (lora_look, salt_look)
        assert any(h.worker_id == worker for h in holders) is same
        assert any(loc.worker_id == worker for loc in found) is same
    finally:
        stream.status()
