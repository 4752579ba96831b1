"""The host pool's eviction policies (agents/connector/host/eviction.py): lru's order, what
predicted_return learns from the conversation chain, and unknown names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.host.eviction import (
    MIN_SAMPLES,
    Lru,
    PredictedReturn,
    eviction_policy,
)

HORIZON_S = 474.0


def _run(conversation: str, turn: int) -> list[bytes]:
    """Turn ``turn`` of a conversation's run: every earlier turn's blocks, then two of its own (block
    hashes chain their prefix, so a later turn starts with the earlier turn's hashes)."""
    return [f"{conversation}/{i}".encode() for i in range(2 * turn + 2)]


def _converse(policy: PredictedReturn, conversation: str, start: float, gaps: list[float]) -> float:
    """Turns of ``conversation`` from ``start``, ``gaps`` apart; when its last turn ended."""
    at = start
    policy.turn(_run(conversation, 0), at)
    for turn, gap in enumerate(gaps, start=1):
        at += gap
        policy.turn(_run(conversation, turn), at)
    return at


def test_lru_gives_copies_up_in_the_order_they_entered_the_pool():
    lru = Lru()
    for i, key in enumerate(["a", "b", "c", "d"]):
        lru.add(key, _run(key, 0), float(i))
    lru.forget("b")
    lru.add("e", _run("a", 1), 9.0)  # a later turn changes nothing: the oldest copy goes first
    assert lru.victims(100.0) == ["a", "c", "d", "e"]
    assert eviction_policy("lru", HORIZON_S).victims(0.0) == []


def test_a_long_idle_fast_returner_goes_before_a_slow_returner_idle_as_long():
    policy = PredictedReturn(HORIZON_S)
    # History: agents come back within ~2 s, chats after ~100 s.
    for i in range(12):
        _converse(policy, f"agent{i}", i * 10.0, [1.5, 2.0, 2.5, 2.0])
        _converse(policy, f"chat{i}", i * 10.0, [80.0, 100.0, 125.0, 100.0])
    assert policy._n >= MIN_SAMPLES
    t = 1000.0
    slow_at = _converse(policy, "slow", t, [90.0, 110.0, 100.0])
    fast_at = _converse(policy, "fast", slow_at - 5.0, [2.0, 2.0, 3.0])
    assert fast_at > slow_at  # the fast conversation's turn is the more recent: lru keeps it
    policy.add("slow@host", _run("slow", 3), slow_at)
    policy.add("fast@host", _run("fast", 3), fast_at)
    now = fast_at + 30.0  # both idle about 30 s: long for an agent, short for a person
    assert policy.victims(now) == ["fast@host", "slow@host"]
    assert policy.score("fast@host", now) < policy.score("slow@host", now) / 10
    lru = Lru()
    lru.add("slow@host", [], slow_at)
    lru.add("fast@host", [], fast_at)
    assert lru.victims(now) == ["slow@host", "fast@host"]


def test_where_conversations_do_not_differ_predicted_return_keeps_lrus_order():
    policy, lru = PredictedReturn(HORIZON_S), Lru()
    for i in range(20):  # every conversation has the same gaps: idle time is the only signal
        _converse(policy, f"c{i}", i * 3.0, [5.0, 20.0, 5.0, 20.0])
    for i in range(20):
        end = _converse(policy, f"d{i}", 500.0 + 7.0 * i, [5.0, 20.0])
        policy.add(f"d{i}", _run(f"d{i}", 2), end)
        lru.add(f"d{i}", _run(f"d{i}", 2), end)
    assert policy.victims(700.0) == lru.victims(700.0)


def test_a_copy_behind_a_later_turn_of_its_conversation_goes_first():
    policy = PredictedReturn(HORIZON_S)
    policy.add("other@host", _run("other", 0), 0.0)
    policy.add("a1@host", _run("a", 0), 10.0)
    policy.turn(_run("a", 1), 12.0)  # a's next turn: its first copy holds nothing the next prompt needs
    assert policy.victims(13.0)[0] == "a1@host" and policy.score("a1@host", 13.0) < 0
    # a copy past its horizon can no longer be pulled
    assert policy.score("other@host", HORIZON_S + 1.0) == 0.0


def test_continuation_is_learned_per_class_of_turns_seen():
    policy = PredictedReturn(HORIZON_S)
    for i in range(30):  # one-turn conversations that never come back, long ones that go on
        policy.turn(_run(f"once{i}", 0), float(i))
        _converse(policy, f"long{i}", float(i), [2.0] * 8)
    policy.turn(_run("late", 0), 2000.0)  # past the horizon: the first ones count as ended
    assert policy.continue_chance(1) < 0.6 < 0.9 < policy.continue_chance(4)


def test_an_unknown_policy_is_a_clear_error():
    choices = "choose from lru, predicted_return"
    with pytest.raises(ValueError, match=f"unknown host eviction policy 'mru': {choices}"):
        eviction_policy("mru", HORIZON_S)
    with pytest.raises(ValidationError, match=f"kvloop_host_eviction 'mru': {choices}"):
        KvloopConfig.from_extra_config({"kvloop_host_eviction": "mru"})
    assert KvloopConfig().host_eviction == "lru"
    cfg = KvloopConfig.from_extra_config({"kvloop_host_eviction": "predicted_return"})
    assert cfg.host_eviction == "predicted_return"
