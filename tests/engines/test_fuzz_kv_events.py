"""The sidecar's reader of vLLM's KV events under malformed msgpack: a format it does
not know is a counted, logged error (EngineEventError), never a crash or a silent misparse."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.sidecar.kv_events import EngineEventError, read_engine_batch, read_or_count
from kvloop.agents.sidecar.mirror import WorkerMirror

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM is installed by `make setup-engines`"
)


def _errors(reason: str) -> float:
    return REGISTRY.get_sample_value("kvloop_agent_engine_event_errors_total", {"reason": reason}) or 0.0


def _hashes(n: int, seed: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{seed}{i}".encode()).digest() for i in range(n)]


def _stored(hashes: list[bytes], lora: str | None = None):
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=lora,
    )


def _payload(*events) -> bytes:
    """A batch exactly as vLLM's ZmqEventPublisher encodes it (its own classes, its encoder)."""
    return msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=1.5, events=list(events)))


# A batch as vLLM once published it: every event an array (array_like KVCacheEvent), tag first.
class _OldStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


def _well_formed() -> st.SearchStrategy[bytes]:
    hashes = st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=4)
    event = st.one_of(
        st.builds(_stored, hashes, st.sampled_from([None, "lora-a"])),
        st.builds(lambda h: kv_events.BlockRemoved(block_hashes=h, medium="CPU"), hashes),
        st.just(kv_events.AllBlocksCleared()),
        st.builds(
            lambda h: KvloopBlocksRetained(
                block_hashes=h,
                block_ids=[list(range(len(h)))],
                retention_handle="r",
                lease_ms=60_000,
                single_use=False,
            ),
            hashes,
        ),
        st.just(KvloopRetentionReleased(retention_handle="r")),
    )
    return st.lists(event, max_size=4).map(lambda events: _payload(*events))


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(_well_formed()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
    return bytes(data)


_shapes = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),  # what msgpack can carry
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.sampled_from(
            ["BlockStored", "BlockRemoved", "AllBlocksCleared", "kvloop.retained", "kvloop.prefill"]
        ),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["type", "block_hashes", "x"]), inner, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payload=st.one_of(
        st.binary(max_size=64),
        _mutated(),
        _shapes.map(msgspec.msgpack.encode),
        # Right frame, events of any shape (maps with wrong types, arrays, unknown tags).
        st.lists(_shapes, max_size=3).map(lambda events: msgspec.msgpack.encode([1.0, events, None])),
    )
)
def test_any_payload_is_read_or_refused_never_crashes(payload):
    try:
        decoded = read_engine_batch(payload)
    except EngineEventError as exc:
        assert exc.reason in {"msgpack", "batch_shape", "event_is_array", "event_shape", "malformed_event"}
        return
    # What was read converts into protocol events without an exception (types were checked).
    mirror = WorkerMirror(hash_length=32)
    for raw in decoded.vllm:
        converted = mirror.convert_vllm(raw)
        assert converted is None or converted.SerializeToString()
    for ours in decoded.kvloop:
        converted = mirror.convert_kvloop(ours)
        assert converted is None or converted.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(payload=_well_formed())
def test_well_formed_batches_read_exactly(payload):
    """No misparse: what vLLM encoded is what the reader returns."""
    raw = msgspec.msgpack.decode(payload)
    decoded = read_engine_batch(payload)
    assert decoded.ts == 1.5
    assert len(decoded.vllm) + len(decoded.kvloop) == len(raw[1])
    assert decoded.vllm == [e for e in raw[1] if not e["type"].startswith("kvloop.")]


def test_events_as_arrays_are_a_counted_error():
    """vLLM once published events as arrays; read as maps they would be misparsed or crash."""
    old = _OldStored(_hashes(2), None, list(range(32)), 16, None)
    payload = msgspec.msgpack.encode([1.0, [old], None])
    before = _errors("event_is_array")
    assert read_or_count(payload, seq=7) is None
    assert _errors("event_is_array") == before + 1
    with pytest.raises(EngineEventError, match="format kvloop does not read"):
        read_engine_batch(payload)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "msgpack"),  # a reserved msgpack byte
        (_payload(_stored(_hashes(3)))[:-5], "msgpack"),  # a truncated frame
        (msgspec.msgpack.encode({"ts": 1.0, "events": []}), "batch_shape"),  # the batch as a map
        (msgspec.msgpack.encode([1.0, "events", None]), "batch_shape"),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "abc"}], None]),
            "malformed_event",
        ),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [b"a"], "lora_name": 5}]]),
            "malformed_event",
        ),
        (
            msgspec.msgpack.encode([1.0, [{"type": "kvloop.retained", "block_hashes": [b"a"]}]]),
            "malformed_event",
        ),
        (msgspec.msgpack.encode([1.0, [{"block_hashes": []}]]), "event_shape"),
        (msgspec.msgpack.encode([1.0, [7]]), "event_shape"),
    ],
)
def test_malformed_payloads_are_counted_errors(payload, reason):
    before = _errors(reason)
    assert read_or_count(payload, seq=1) is None
    assert _errors(reason) == before + 1


def test_unknown_event_type_is_skipped_counted_and_the_rest_kept():
    hashes = _hashes(2, "known")
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockMovedToMars", "block_hashes": [b"x"]},
                msgspec.msgpack.decode(msgspec.msgpack.encode(_stored(hashes))),
            ],
            None,
        ]
    )
    before = _errors("unknown_type")
    decoded = read_engine_batch(payload)
    assert _errors("unknown_type") == before + 1
    [event] = decoded.vllm
    converted = WorkerMirror(hash_length=32).convert_vllm(event)
    assert converted is not None and list(converted.stored.block_hashes) == hashes


def test_an_event_without_hashes_is_not_forwarded():
    """kvloopd refuses an event without hashes, and with it the whole batch (the link would resend it
    forever)."""
    decoded = read_engine_batch(_payload(kv_events.BlockRemoved(block_hashes=[], medium="CPU")))
    assert WorkerMirror(hash_length=32).convert_vllm(decoded.vllm[0]) is None
