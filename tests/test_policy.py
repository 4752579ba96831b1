"""The transfer-vs-recompute policy: threshold, cost model fed by telemetry, reasons."""

from __future__ import annotations

from kvloop.daemon.index import Holding, PrefixMatch, WorkerSpec
from kvloop.daemon.policy import CostModel, PolicyConfig
from kvloop.v1 import directory_pb2 as pb

HOLDER = WorkerSpec("decode-0", 2, "m", "e", "h:1", 16, "sha256_cbor", 32, 1, kv_bytes_per_block=1 << 20)


def match(blocks: int) -> PrefixMatch:
    return PrefixMatch(Holding(HOLDER, blocks, "h", 60_000, list(range(blocks)), 1, False), [])


def test_threshold_then_cost_then_measurements():
    model = CostModel(
        PolicyConfig(
            recompute_threshold_tokens=64,
            default_prefill_tokens_per_s=1000,
            default_transfer_gbytes_per_s=1.0,
            default_transfer_setup_ms=1.0,
        )
    )
    below = model.decide("m", match(3), 10, 0, 16, "prefill-0")  # 48 tokens
    assert (below.decision, below.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_BELOW_THRESHOLD)
    fast = model.decide("m", match(100), 100, 0, 16, "prefill-0")  # 1600 tokens: 1.6 s vs ~106 ms
    assert (fast.decision, fast.reason) == (pb.DECISION_TRANSFER, pb.DECISION_REASON_TRANSFER_FASTER)
    assert fast.cost.transfer_basis == "default"
    # measured: this pair moves 1 MiB in 1 s (slow link) -> recomputing 1,600 tokens is faster
    for _ in range(5):
        model.record_transfer("prefill-0", "decode-0", 1 << 20, 1_000_000, 0, True, "m")
    slow = model.decide("m", match(100), 100, 0, 16, "prefill-0")
    assert (slow.decision, slow.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_RECOMPUTE_FASTER)
    assert slow.cost.transfer_basis == "measured (5 reads)"
    # another puller has no measurements of its own
    assert model.decide("m", match(100), 100, 0, 16, "prefill-1").cost.transfer_basis == "default"
    # failed reads teach nothing about bandwidth
    model.record_transfer("prefill-1", "decode-0", 1, 10, 0, False, "m")
    assert model.decide("m", match(100), 100, 0, 16, "prefill-1").cost.transfer_basis == "default"


def test_per_model_policy_and_local_and_miss():
    model = CostModel(PolicyConfig(), {"big": PolicyConfig(recompute_threshold_tokens=10_000)})
    assert model.decide("big", match(100), 100, 0, 16, "p").reason == pb.DECISION_REASON_BELOW_THRESHOLD
    assert model.decide("m", PrefixMatch(None, []), 10, 4, 16, "p").decision == pb.DECISION_LOCAL
    assert model.decide("m", PrefixMatch(None, []), 10, 0, 16, "p").reason == pb.DECISION_REASON_MISS
    expired = model.decide("m", PrefixMatch(None, [], "expired"), 10, 0, 16, "p")
    assert (expired.decision, expired.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_EXPIRED)


def test_first_contact_reads_do_not_count_as_steady_state_cost():
    model = CostModel(PolicyConfig(default_prefill_tokens_per_s=1000))
    # the first READ from a holder waited ~2 s for the NIXL handshake
    model.record_transfer("prefill-0", "decode-0", 1 << 20, 2_000_000, 0, True, "m", first_contact=True)
    verdict = model.decide("m", match(100), 100, 0, 16, "prefill-0")
    assert (verdict.decision, verdict.cost.transfer_basis) == (pb.DECISION_TRANSFER, "default")
    model.record_transfer("prefill-0", "decode-0", 1 << 20, 1_000, 0, True, "m")
    assert model.decide("m", match(100), 100, 0, 16, "prefill-0").cost.transfer_basis == "measured (1 reads)"


def test_estimates_favouring_recompute_are_reprobed():
    model = CostModel(PolicyConfig(default_prefill_tokens_per_s=1000, reprobe_every=4))
    model.record_transfer("prefill-0", "decode-0", 1 << 20, 10_000_000, 0, True, "m")  # one very slow READ
    reasons = [model.decide("m", match(100), 100, 0, 16, "prefill-0").reason for _ in range(8)]
    recompute, probe = pb.DECISION_REASON_RECOMPUTE_FASTER, pb.DECISION_REASON_PROBE
    assert reasons == [recompute] * 3 + [probe] + [recompute] * 3 + [probe]
    # the probe's READ is fast again: the estimate recovers and transfers resume
    for _ in range(20):
        model.record_transfer("prefill-0", "decode-0", 1 << 20, 1_000, 0, True, "m")
    assert model.decide("m", match(100), 100, 0, 16, "prefill-0").reason == pb.DECISION_REASON_TRANSFER_FASTER
    # default estimates are not probed: nothing was measured to go stale
    never = CostModel(PolicyConfig(default_prefill_tokens_per_s=1e9, reprobe_every=1))
    assert (
        never.decide("m", match(100), 100, 0, 16, "prefill-0").reason == pb.DECISION_REASON_RECOMPUTE_FASTER
    )
