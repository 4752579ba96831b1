"""A prefill's compute time is the engine steps' time charged to it by its share of their tokens:
not the time it waited for steps, not the other requests' share of the steps it was batched in."""

from __future__ import annotations

import pytest

from kvloop.agents.connector.compute_time import ComputeTime


def test_a_request_alone_is_charged_its_steps():
    clock = ComputeTime()
    clock.track("a")
    clock.step({"a": 512}, 512, now=10.0)  # a chunk
    clock.step({"a": 256}, 256, now=10.4)  # the rest
    assert clock.finish("a", now=10.6) == pytest.approx(0.6)


def test_batched_requests_share_each_step_by_their_tokens():
    clock = ComputeTime()
    for r in ("a", "b"):
        clock.track(r)
    clock.step({"a": 300, "b": 100, "decode": 4}, 404, now=0.0)
    assert clock.finish("b", now=0.404) == pytest.approx(0.404 * 100 / 404)
    assert clock.finish("a", now=0.404) == pytest.approx(0.404 * 300 / 404)


def test_waiting_for_other_requests_steps_is_not_charged():
    clock = ComputeTime()
    clock.track("a")
    clock.track("late")  # decided, but scheduled only after "a"'s step
    clock.step({"a": 800}, 800, now=0.0)
    clock.step({"late": 400}, 400, now=0.8)
    assert clock.finish("a", now=0.8) == pytest.approx(0.8)
    assert clock.finish("late", now=1.2) == pytest.approx(0.4)


def test_untracked_and_finished_requests_are_forgotten():
    clock = ComputeTime()
    clock.track("a")
    clock.step({"a": 100, "other": 100}, 200, now=0.0)
    assert clock.finish("other", now=0.1) == 0.0  # never tracked (a hit, a decode)
    assert clock.finish("a", now=0.2) == pytest.approx(0.1)
    # finished: the next step charges it nothing and a second finish finds nothing
    clock.step({}, 0, now=0.3)
    assert clock.finish("a", now=0.4) == 0.0
