"""`kvloop bench decode-tpot`'s arithmetic: steps classified by what the decode held, paired ratios."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvloop.clients.bench.decode_tpot import (
    Trial,
    across_stacks,
    equal_batch_ratios,
    paired_ratios,
    step_table,
    summarize,
    thread_cpu_s,
)
from kvloop.clients.bench.steps import Gap, Stream, step_gaps


def stream(*times: float, sent: float = 0.0) -> Stream:
    return Stream(sent=sent, times=list(times), tokens=[1] * len(times))


def test_tpot_counts_the_tokens_after_the_first():
    s = Stream(sent=0.0, times=[1.0, 1.02, 1.06], tokens=[1, 1, 2])  # the last chunk carried two steps
    assert s.tpot_ms() == pytest.approx(60 / 3)
    assert stream(1.0).tpot_ms() is None


def test_a_lone_request_decodes_in_a_batch_of_one():
    gaps = step_gaps([stream(0.0, 0.010, 0.020)])
    assert gaps == [Gap(pytest.approx(10.0), 1, False, False)] * 2


def test_batch_arrival_and_read_are_read_off_the_chunk_times():
    a = stream(0.000, 0.010, 0.020, 0.030, 0.040)
    b = stream(0.020, 0.030, 0.040)  # arrives in a's second step, then decodes beside it
    gaps = step_gaps([a, b], reads=[(0.031, 0.035)])
    mine = gaps[:4]
    assert [g.batch for g in mine] == [1, 1, 2, 2]
    assert [g.arrival for g in mine] == [False, True, False, False]
    assert [g.read for g in mine] == [False, False, False, True]
    assert [(g.batch, g.arrival, g.read) for g in gaps[4:]] == [(2, False, False), (2, False, True)]


def test_a_first_chunk_just_after_a_gap_belongs_to_that_step():
    a = stream(0.000, 0.010, 0.020)
    b = stream(0.0112, 0.021)  # 1.2 ms after a's chunk: written out by the same step
    assert [g.arrival for g in step_gaps([a, b])[:2]] == [True, False]
    late = stream(0.016, 0.021)  # mid-gap: not a's first step's
    assert [g.arrival for g in step_gaps([a, late])[:2]] == [False, True]


def test_step_table_groups_by_class():
    gaps = [Gap(10.0, 1, False, False), Gap(14.0, 1, False, False), Gap(30.0, 2, True, False)]
    assert step_table(gaps) == [
        {"batch": 1, "arrival": False, "read": False, "steps": 2, "step_ms_p50": 12.0},
        {"batch": 2, "arrival": True, "read": False, "steps": 1, "step_ms_p50": 30.0},
    ]


def _trial(condition: str, rnd: int, step_s: float, reads=()) -> Trial:
    times = [i * step_s for i in range(5)]
    return Trial(condition, rnd, [stream(*times), stream(*times)], list(reads))


def test_paired_ratios_pair_the_same_round_and_slot():
    trials = [_trial("reads", r, 0.012) for r in range(3)] + [_trial("base", r, 0.010) for r in range(3)]
    trials.append(_trial("reads", 9, 0.050))  # no base trial beside it: unpaired, left out
    out = paired_ratios(trials, "reads", "base")
    assert out is not None
    assert out["pairs"] == 6
    assert out["median"] == pytest.approx(1.2)
    assert out["median_ci95"] == [pytest.approx(1.2), pytest.approx(1.2)]
    assert paired_ratios(trials, "staggered", "base") is None


def test_pairs_never_cross_stacks_and_the_spread_over_stacks_is_reported():
    """Round r of stack 0 pairs with round r of stack 0 only; each stack's median, their mean and its
    t interval come out of across_stacks."""

    def on(stack: int, trial: Trial) -> Trial:
        trial.stack = stack
        return trial

    stacks = [
        [on(0, _trial("base", 0, 0.011)), on(0, _trial("no_retention", 0, 0.010))],
        [on(1, _trial("base", 0, 0.010)), on(1, _trial("no_retention", 0, 0.010))],
        [on(2, _trial("no_retention", 0, 0.010))],  # its base never ran: nothing to pair
    ]
    pooled = paired_ratios([t for s in stacks for t in s], "base", "no_retention")
    assert pooled is not None and pooled["pairs"] == 4  # not 2 x 2 cross-stack pairs more
    rows = across_stacks([summarize(s) for s in stacks[:2]])
    assert rows[0]["factor"] == "retention"
    assert rows[0]["stack_medians"] == [pytest.approx(1.1), pytest.approx(1.0)]
    assert rows[0]["mean"] == pytest.approx(1.05)
    low, high = rows[0]["mean_ci95"]
    assert low < 1.0 < 1.1 < high  # two stacks 0.1 apart: t(1) makes the interval wide
    assert across_stacks([]) == []


def test_equal_batch_ratios_leave_arrival_steps_out():
    slow_arrival = Trial("staggered", 0, [stream(0.0, 0.010, 0.020, 0.030), stream(0.0205, 0.0305)])
    base = _trial("base", 0, 0.010)
    rows = equal_batch_ratios([slow_arrival, base], "staggered", "base")
    assert [r["batch"] for r in rows] == [2]  # staggered has batch 1 steps only while alone
    assert rows[0]["ratio"] == pytest.approx(1.0)


def test_summarize_reports_each_condition_and_the_effects_present():
    trials = [_trial("base", 0, 0.010), _trial("no_retention", 0, 0.009)]
    trials[0].decode_metrics = {
        "tpot_s": 0.02,
        "requests": 2,
        "step_tokens": 8,
        "steps": 4,
        "retained_runs": 2,
    }
    out = summarize(trials)
    assert [c["condition"] for c in out["conditions"]] == ["base", "no_retention"]
    base = out["conditions"][0]
    assert (base["tpot_ms_p50"], base["vllm_tpot_ms_mean"], base["vllm_batch_mean"]) == (10.0, 10.0, 2.0)
    assert base["retained_runs"] == 2 and out["conditions"][1]["retained_runs"] == 0
    assert [e["factor"] for e in out["effects"]] == ["retention"]
    assert out["effects"][0]["tpot"]["median"] == pytest.approx(10 / 9, abs=1e-3)


def test_decode_cpu_per_token_is_paired_by_round():
    from kvloop.clients.bench.decode_tpot import paired_cpu_ratios

    trials = []
    for rnd, (reads_cpu, base_cpu) in enumerate(((1.1, 1.0), (2.2, 2.0), (3.0, 3.0))):
        trials += [_trial("reads", rnd, 0.01), _trial("base", rnd, 0.01)]
        trials[-2].cpu_s = {"decode engine-core": reads_cpu}
        trials[-1].cpu_s = {"decode engine-core": base_cpu}
    trials.append(_trial("reads", 7, 0.01))  # no CPU read: left out
    out = paired_cpu_ratios(trials, "reads", "base")
    assert out is not None and (out["rounds"], out["median"]) == (3, 1.1)
    assert paired_cpu_ratios(trials, "reads", "base", group="kvloopd") is None


def test_thread_cpu_adds_up_to_the_process():
    """The per-thread split of a process's CPU (where a condition's extra decode CPU goes) accounts
    for all of it, the other threads' included."""
    release = threading.Event()

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def worker_burn() -> None:
        burn(0.2)
        release.wait()  # alive while the split is read: a thread that has ended has no schedstat

    worker = threading.Thread(target=worker_burn)
    before_threads, before = thread_cpu_s(os.getpid()), time.process_time()
    worker.start()
    burn(0.2)
    while worker.is_alive() and time.process_time() - before < 0.4:
        time.sleep(0.01)
    after_threads, after = thread_cpu_s(os.getpid()), time.process_time()
    release.set()
    worker.join()
    used = sum(after_threads.values()) - sum(before_threads.values())
    assert used == pytest.approx(after - before, abs=0.05)
    assert used >= 0.35
