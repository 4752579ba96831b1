"""A decode that holds retained runs and nothing else lets its engine loop sleep.

The decode here runs vLLM's busy loop in its own engine-core process, as `vllm serve` does, unlike
the session engines (in-process `vllm.LLM`, which step only inside `generate`); the session's prefill
engine prefills its turns. What is counted is engine steps (the connector's worker sees one per
step), not CPU time.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from conftest import HAVE_ENGINES, free_port, wait_until

TTL_S = 20.0  # retention lease of this engine's runs: short, so a test can watch leases end
WORKER = "idle-decode"


@pytest.fixture(scope="module")
def idle_decode(tiny_model):
    if not HAVE_ENGINES:
        pytest.skip("vLLM CPU build / NIXL not installed")
    from engine_harness import EngineHandle, EngineSpec

    os.environ["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "0")
    engine = EngineHandle(
        EngineSpec(
            WORKER,
            str(tiny_model),
            free_port(),
            WORKER,
            {"kvloop_retention_ttl_s": TTL_S, "kvloop_worker_id": WORKER},
            multiprocessing=True,
        )
    )
    try:
        engine.wait_ready()
        engine.generate(list(range(2, 100)), 1)  # warm (a plain request: nothing retained)
        yield engine
    finally:
        engine.stop()


def retain(engines, decode, rnd: random.Random) -> dict:
    """A turn prefilled by the session's prefill and decoded by ``decode``, which then keeps the
    finished run for reverse pulls (kvloop's default: until its lease ends)."""
    prompt = [rnd.randrange(2, 1024) for _ in range(100)]
    handle = engines.prefill.generate(prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    engines.prefill.call("spans")  # this module's turns are not the other tests' business
    kv = decode.generate(prompt, 4, handle)["kv_transfer_params"]
    assert kv and kv["remote_block_ids"] and kv["remote_blocks_expiry_time"], kv
    return kv


def state(engine) -> dict:
    s = engine.call("connector_state")
    s["t"] = time.perf_counter()  # CLOCK_MONOTONIC, the engine's lease clock too
    return s


def wait_quiet(engine, what: str, timeout: float = 10.0) -> dict:
    """The connector state once two readings 0.3 s apart saw the same number of engine steps."""
    last = [state(engine)]

    def quiet():
        now = state(engine)
        same = now["steps"] == last[0]["steps"]
        last[0] = now
        return now if same else None

    return wait_until(quiet, timeout, what, interval=0.3)


def test_engine_loop_sleeps_while_it_only_holds_retained_runs_and_wakes_at_lease_end(engines, idle_decode):
    rnd = random.Random(17)
    runs = [retain(engines, idle_decode, rnd) for _ in range(3)]
    ids = {kv["remote_request_id"] for kv in runs}
    expiries = sorted(kv["remote_blocks_expiry_time"] for kv in runs)
    rest = wait_quiet(idle_decode, "the engine loop to stop stepping while it only holds retained runs")
    assert ids <= set(rest["leases"]), "the runs are retained (leased) on the worker"
    assert rest["t"] < expiries[0] - 2, "the leases outlive the wait for rest (raise TTL_S)"

    samples = [rest]

    def released():
        samples.append(state(idle_decode))
        return not ids & set(samples[-1]["leases"])

    wait_until(released, TTL_S + 10, "the retained runs' release at lease end", interval=0.05)
    leased = [s for s in samples if s["t"] < expiries[0]]
    # no engine step while the leases ran (the state reads above are utility calls, not steps)
    assert leased[-1]["steps"] == rest["steps"], [s["steps"] for s in leased]
    assert leased[-1]["t"] > expiries[0] - 1.0
    # each run was released at its own lease end, while the engine had nothing else to do
    for kv in runs:
        rid, expiry = kv["remote_request_id"], kv["remote_blocks_expiry_time"]
        last_held = max(s["t"] for s in samples if rid in s["leases"])
        gone = min(s["t"] for s in samples if rid not in s["leases"])
        assert last_held > expiry - 0.5 and expiry <= gone < expiry + 1.0, (rid, last_held, gone, expiry)
    # a few steps per lease end (the worker's lease clock is rebased a little later), then rest: the
    # loop would keep stepping if the scheduler still held any of the runs
    after = wait_quiet(idle_decode, "the engine loop to rest again after the releases")
    # (a bound on steps, not a count: a loaded host takes more steps per lease end; a loop that never
    # rested would take a thousand a second)
    assert after["steps"] - rest["steps"] <= 50 * len(runs), after["steps"] - rest["steps"]
    # and it still serves
    assert len(idle_decode.generate([5] * 40, 3)["token_ids"]) == 3


def test_a_new_request_wakes_the_sleeping_loop(engines, idle_decode):
    rnd = random.Random(18)
    kv = retain(engines, idle_decode, rnd)
    rest = wait_quiet(idle_decode, "the engine loop to rest while it holds a retained run")
    assert kv["remote_request_id"] in rest["leases"]
    out = idle_decode.generate([rnd.randrange(2, 1024) for _ in range(64)], 8)
    assert len(out["token_ids"]) == 8
    assert state(idle_decode)["steps"] > rest["steps"]
