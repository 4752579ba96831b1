"""bench chaos's verdicts and report: what counts as a wrong answer, a near-tie, a failed request, and
when a fault counts as recovered (the run itself needs engines: `kvloop bench chaos --quick`)."""

from __future__ import annotations

from pathlib import Path

from kvloop.clients.bench.chaos import (
    MEMORY_FAULTS,
    REDIS_FAULTS,
    ChaosConfig,
    Fault,
    Turn,
    compare,
    schedule,
    summarize,
)

CONFIG = ChaosConfig(workdir=Path("unused"), logprob_bound=1e-3, tie_bound=1e-4)


def reference(tokens: list[tuple[str, float, float]]) -> dict:
    """A chat completion's logprobs: (token, its logprob, the runner-up's logprob) per position."""
    return {
        "choices": [
            {
                "logprobs": {
                    "content": [
                        {
                            "token": t,
                            "logprob": lp,
                            "top_logprobs": [
                                {"token": t, "logprob": lp},
                                {"token": "other", "logprob": second},
                            ],
                        }
                        for t, lp, second in tokens
                    ]
                }
            }
        ]
    }


def turn(tokens: list[str], logprobs: list[float], **kw) -> Turn:
    fields = {"conversation": 0, "turn": 2, "started_s": 0.0, "ended_s": 1.0, "request": {}, **kw}
    return Turn(tokens=tokens, logprobs=logprobs, **fields)


def test_same_tokens_within_the_bound_are_the_same_answer():
    t = turn(["token_id:5", "token_id:9"], [-1.0, -2.0000005])
    compare(t, reference([("token_id:5", -1.0, -3.0), ("token_id:9", -2.0, -4.0)]), CONFIG)
    assert t.verdict == "same", t.detail


def test_a_logprob_off_by_more_than_the_bound_is_wrong_even_with_the_same_tokens():
    t = turn(["token_id:5", "token_id:9"], [-1.0, -2.01])
    compare(t, reference([("token_id:5", -1.0, -3.0), ("token_id:9", -2.0, -4.0)]), CONFIG)
    assert t.verdict == "wrong" and "logprob" in t.detail


def test_a_different_token_is_wrong_unless_the_reference_had_a_near_tie_there():
    clear = turn(["token_id:5", "token_id:7"], [-1.0, -2.0])
    compare(clear, reference([("token_id:5", -1.0, -3.0), ("token_id:9", -2.0, -2.5)]), CONFIG)
    assert clear.verdict == "wrong" and "token 1" in clear.detail
    tie = turn(["token_id:5", "token_id:7"], [-1.0, -2.00001])
    compare(tie, reference([("token_id:5", -1.0, -3.0), ("token_id:9", -2.0, -2.00001)]), CONFIG)
    assert tie.verdict == "near_tie"


def test_a_shorter_answer_is_wrong():
    t = turn(["token_id:5"], [-1.0])
    compare(t, reference([("token_id:5", -1.0, -3.0), ("token_id:9", -2.0, -4.0)]), CONFIG)
    assert t.verdict == "wrong"


def test_schedule_is_seeded_and_covers_every_kind():
    quick = ChaosConfig(workdir=Path("unused"), quick=True, seed=3)
    assert sorted(schedule(quick)) == sorted(MEMORY_FAULTS)
    assert schedule(quick) == schedule(ChaosConfig(workdir=Path("unused"), quick=True, seed=3))
    redis = ChaosConfig(workdir=Path("unused"), store="redis", duration_s=600, fault_interval_s=20)
    order = schedule(redis)
    cycles = int(600 // (20 * len(REDIS_FAULTS)))  # every kind once per cycle, as many as fit
    assert cycles > 1 and len(order) == len(REDIS_FAULTS) * cycles and set(order) == set(REDIS_FAULTS)


def test_summary_counts_failures_and_recovery_from_the_worker_the_fault_hit():
    turns = [
        turn([], [], started_s=9.0, ended_s=10.5, path="transfer", holder="decode-1", verdict="same"),
        turn([], [], started_s=10.2, ended_s=11.0, error="HTTP 502: decode server failed"),
        turn([], [], started_s=11.0, ended_s=12.0, path="transfer", holder="decode-0", verdict="same"),
        turn([], [], started_s=14.0, ended_s=15.0, path="transfer", holder="decode-1", verdict="wrong"),
        turn([], [], started_s=30.0, ended_s=31.0, path="recompute", verdict="same"),
    ]
    faults = [Fault("decode_kill", 10.0, target="decode-1", worker="decode-1"), Fault("stream_reset", 25.0)]
    report = summarize(CONFIG, turns, faults, 40.0)
    assert report["failed_requests"] == 1 and report["wrong_answers"] == 1
    kill, reset = report["faults"]
    assert kill["failed_requests"] == 1 and kill["wrong_answers"] == 1 and kill["turns"] == 4
    assert kill["transfer_again_s"] == 1.0  # decode-0's, at 11 s
    assert kill["worker_transfer_again_s"] == 4.0  # from decode-1, the worker it hit
    assert reset["transfer_again_s"] is None and reset["worker_transfer_again_s"] is None
    assert reset["turns"] == 1


def test_the_pools_faults_join_only_where_decodes_have_pools():
    from kvloop.clients.bench.chaos import HOST_FAULTS

    assert not set(HOST_FAULTS) & set(schedule(CONFIG))
    pooled = ChaosConfig(workdir=Path("unused"), quick=True, host_retention_gib=0.05)
    assert sorted(schedule(pooled)) == sorted((*MEMORY_FAULTS, *HOST_FAULTS))
    redis = ChaosConfig(workdir=Path("unused"), quick=True, store="redis", host_retention_gib=0.05)
    assert set(HOST_FAULTS) <= set(schedule(redis)) and "redis_primary_kill" in schedule(redis)


def test_the_pool_holder_is_the_one_that_served_the_latest_pull_from_a_pool():
    from kvloop.clients.bench.chaos import Conversations

    conversations = Conversations(CONFIG, "http://unused", "m", lambda: 0.0)
    assert conversations.latest_pulled() is None
    for i, (path, tier, holder) in enumerate(
        [("transfer", "host", "decode-0@host"), ("transfer", "device", "decode-1"), ("recompute", "", "")]
    ):
        conversations.turns.append(Turn(1, i + 1, 0.0, 0.0, {}, path=path, tier=tier, holder=holder))
    latest = conversations.latest_pulled()
    assert latest is not None and latest.holder == "decode-0@host"
    conversations.turns.append(Turn(2, 1, 0.0, 0.0, {}, path="transfer", tier="host", error="HTTP 503"))
    assert conversations.latest_pulled() is latest  # a failed turn served nothing
