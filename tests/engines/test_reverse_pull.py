"""KvloopConnector on two real vLLM CPU engines: hash-matched reverse pulls are exact.

Every prefill that pulls is checked against a recompute of the same prompt on the same engine
(``cache_salt`` changes the block hashes, so the reference neither hits the local prefix cache
nor matches anything in the directory): KV over all full blocks within one bf16 step (0.0157),
same greedy tokens, logprobs equal up to bf16 noise.

The directory is the real one: kvloopd, fed by a kvloop-agent subscribed to the decode engine's
KV events (see conftest.py). Failures are produced for real: kvloopd killed / restarted with
another expiry margin, the agent restarted, the decode engine killed (the last test).
"""

from __future__ import annotations

import math
import random
import signal
import time
import uuid
import zlib
from dataclasses import dataclass, replace
from typing import Any

import pytest
from conftest import (
    BS,
    DECODE_WORKER,
    KV_BYTES_PER_BLOCK,
    MODEL,
    PREFILL_LEASE_S,
    RETENTION_TTL_S,
    Run,
    wait_until,
)

from kvloop.common.addresses import free_port_pair
from kvloop.v1 import directory_pb2 as pb

pytestmark = pytest.mark.engines

KV_TOL = 0.0157  # one bf16 step at |x| in [1, 2)
LOGPROB_TOL = 0.02
# Logits are bf16, so near-ties are common and any numerically different (but equally correct)
# computation order can flip one: measured, a recompute split at a cached prefix moved one logit
# by one bf16 step (0.0078) and turned a tie into a 0.0078 lead. A differing greedy token is
# accepted only when it is such a near-tie in the reference's own distribution.
TIE_TOL = 0.02


def assert_same_greedy(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Greedy tokens equal up to the first bf16 near-tie; logprobs equal within LOGPROB_TOL.

    Returns the number of tokens compared (comparison stops at a tie flip, since the two
    continuations then condition on different histories).
    """
    for i, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"], strict=False)):
        if ta != tb:
            ref_top = dict(b["top_logprobs"][i])
            assert ta in ref_top, f"token {i}: {ta} not in reference top-k {b['top_logprobs'][i]}"
            assert ref_top[tb] - ref_top[ta] <= TIE_TOL, f"token {i}: {ta} vs {tb}, not a near-tie"
            return i
        assert abs(a["logprobs"][i] - b["logprobs"][i]) <= LOGPROB_TOL, (
            i,
            a["logprobs"][i],
            b["logprobs"][i],
        )
    return len(a["token_ids"])


def rand_tokens(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(2, 1024) for _ in range(n)]


@dataclass
class Prefill:
    out: dict[str, Any]
    ref: dict[str, Any]
    span: dict[str, Any]
    kv_diffs: list[float]


def prefill_and_check(engines, prompt: list[int], *, check_kv: bool = True, span: bool = True) -> Prefill:
    """Prefill `prompt` through kvloop, then recompute it as reference and compare. Without ``span``
    (a multiprocess prefill keeps its spans in its engine-core process) the span is not read."""
    P = engines.prefill
    out = P.generate(prompt, 1, {"do_remote_decode": True}, logprobs=5)
    ref = P.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"ref-{uuid.uuid4()}", logprobs=5)
    rid = out["kv_transfer_params"]["remote_request_id"]  # vLLM's internal request id
    spans = [s for s in P.call("spans") if s.get("kvloop.request_id") == rid] if span else [{}]
    assert len(spans) == 1, spans
    diffs: list[float] = []
    nfull = len(prompt) // BS
    if check_kv and nfull:
        a = out["kv_transfer_params"]["remote_block_ids"][0][:nfull]
        b = ref["kv_transfer_params"]["remote_block_ids"][0][:nfull]
        assert len(a) == len(b) == nfull
        diffs = P.call("kv_diff", {"a": a, "b": b})
        assert max(diffs) <= KV_TOL, (
            f"KV differs from recompute: {[i for i, d in enumerate(diffs) if d > KV_TOL]}"
        )
    assert_same_greedy(out, ref)
    return Prefill(out, ref, spans[0], diffs)


def decode(engines, prompt: list[int], p_params: dict[str, Any], n: int, salt: str | None = None):
    d = engines.decode.generate(prompt, n, p_params, cache_salt=salt, logprobs=5)
    if salt is None:  # wait until the retained run reached kvloopd (engine -> ZMQ -> agent -> daemon)
        run = Run(
            d["kv_transfer_params"]["remote_request_id"],
            engines.decode.call("block_hashes", prompt),
            time.monotonic(),
        )
        engines.kvloop.wait_for_run(run)
        engines.kvloop.runs.append(run)
    return d


def first_turn(engines, prompt: list[int], n_decode: int, prefill_salt: str | None = None):
    """Turn 1: prefill (optionally salted = a prefill instance that has none of it cached),
    then decode, which retains prompt + generated blocks and announces them."""
    p = engines.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=prefill_salt)
    d = decode(engines, prompt, p["kv_transfer_params"], n_decode)
    engines.prefill.call("spans")
    return d


@pytest.fixture(autouse=True)
def default_stack(engines):
    """Each test starts with kvloopd (default settings) and the agent up, whatever the last did."""
    engines.ensure_default_stack()


def test_retained_event_reaches_directory_via_vllm_kv_events(engines):
    """vLLM's BlockStored and the connector's retained event travel engine -> ZMQ -> kvloop-agent
    -> kvloopd; kvloopd then serves the run with the decode's block ids."""
    rnd = random.Random(10)
    prompt = rand_tokens(rnd, 700)
    d = first_turn(engines, prompt, 36)
    handle = d["kv_transfer_params"]["remote_request_id"]
    hashes = engines.decode.call("block_hashes", prompt + d["token_ids"])
    assert len(hashes) == (700 + 36) // BS == 23
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    k = engines.kvloop
    # complete blocks only: the last sampled token has no KV yet, so block 22 is not retained
    n = (700 + 36 - 1) // BS
    ids = list(d["kv_transfer_params"]["remote_block_ids"][0][:n])
    (loc,) = wait_until(lambda: k.locations(hashes[n - 1], "retained", handle), 10, "last retained block")
    assert loc.worker_id == DECODE_WORKER and loc.position == n - 1 and list(loc.block_ids) == [ids[n - 1]]
    assert 0 < loc.expires_in_ms <= RETENTION_TTL_S * 1000 and loc.servable
    assert not k.locations(hashes[n], "retained", handle)
    # the decode's own prefix cache (vLLM's BlockStored, full digests) is indexed as well
    first = k.locations(hashes[0])
    assert {(x.worker_id, x.kind) for x in first} >= {(DECODE_WORKER, "stored"), (DECODE_WORKER, "retained")}
    ans = k.client.lookup(MODEL, hashes, requester="prefill-0", block_size=BS)
    assert ans.decision == pb.DECISION_TRANSFER, ans
    h = ans.holder
    assert ans.matched_blocks == h.matched_blocks == n and h.retention_handle == handle
    assert list(h.block_ids) == ids and h.num_groups == 1 and not h.single_use
    assert h.engine_id == DECODE_WORKER and h.worker_id == DECODE_WORKER
    assert h.nixl_endpoint == f"127.0.0.1:{engines.decode.spec.side_channel_port}"
    assert h.kv_bytes_per_block == KV_BYTES_PER_BLOCK
    # the agent's --kv-bytes-per-block matches the decode engine's real KV cache (bf16)
    shapes = engines.decode.info["kv_shapes"]
    assert sum(math.prod(sh[1:]) * 2 for sh in shapes) == KV_BYTES_PER_BLOCK
    # the requester itself is never offered as a holder
    assert (
        k.client.lookup(MODEL, hashes, requester=DECODE_WORKER, block_size=BS).decision
        != pb.DECISION_TRANSFER
    )


def _transfers(engines) -> float:
    m = engines.prefill.call("metrics")
    return sum(
        v
        for (name, labels), v in m.items()
        if name == "kvloop_connector_requests_total" and ("path", "transfer") in labels
    )


def test_four_turn_conversation_transfers_each_turn(engines):
    transfers_before = _transfers(engines)
    rnd = random.Random(1)
    prompt = rand_tokens(rnd, 1500)
    d = first_turn(engines, prompt, 96)
    for turn in range(2, 5):
        prompt = prompt + d["token_ids"] + rand_tokens(rnd, 200)
        pf = prefill_and_check(engines, prompt)
        s = pf.span
        assert s["kvloop.path"] == "transfer", s
        assert s["kvloop.bytes"] > 0 and s["kvloop.holder"] == "decode-0"
        # the prefill had the previous prompt cached; it pulled the decode's later blocks
        assert pf.out["num_cached_tokens"] >= s["kvloop.local_tokens"] + 64
        # decode from the pulled prefill and from the reference: same greedy continuation
        d = decode(engines, prompt, pf.out["kv_transfer_params"], 96)
        d_ref = decode(engines, prompt, pf.ref["kv_transfer_params"], 96, salt=f"dref-{turn}")
        compared = assert_same_greedy(d, d_ref)
        assert s["kvloop.lookup_ms"] < 1000
        print(
            f"turn {turn}: lookup {s['kvloop.lookup_ms']:.1f} ms, "
            f"pulled {s['kvloop.bytes'] / 2**20:.1f} MiB, "
            f"{compared}/{len(d['token_ids'])} decoded tokens identical before any tie flip"
        )
    assert _transfers(engines) - transfers_before == 3  # prometheus agrees with the spans
    m = engines.prefill.call("metrics")
    assert m[("kvloop_connector_pulled_bytes_total", ())] > 0


def _plans(engines, outcome: str) -> float:
    return engines.prefill.call("metrics").get(
        ("kvloop_connector_route_plans_total", (("outcome", outcome),)), 0.0
    )


@pytest.mark.parametrize("continuation", [False, True], ids=["asked_with_the_turn", "asked_at_the_last_turn"])
def test_a_turn_route_planned_takes_the_plan_instead_of_a_lookup(engines, tmp_path, continuation):
    """A router asked Route before sending the turn: kvloopd pushed the pull it planned for this prefill
    to the prefill's connector, which takes it instead of asking Lookup - and the pulled KV still
    equals a recompute's, block by block. Asked at the last turn (continuation): Route scored the
    conversation as that turn left it (its prompt and answer), and the plan answers the longer prompt
    of the next turn, which appends a tool's output."""
    k = engines.kvloop
    # Route plans for registered prefills: the prefill gets its agent (no KV events here, so Route
    # counts no local prefix for it, as vLLM finds none: the first turn is salted on the prefill)
    agent = k.spawn_agent(
        "prefill-0",
        "prefill",
        engines.prefill.spec.side_channel_port,
        free_port_pair(),
        tmp_path / "prefill-agent.log",
        tp=1,
    )
    try:
        wait_until(  # connected: the other case's agent, terminated, may still be listed
            lambda: any(
                w.registration.worker_id == "prefill-0" and w.connected for w in k.client.list_workers(MODEL)
            ),
            30,
            "the prefill's agent registered",
        )
        rnd = random.Random(12 if continuation else 11)  # each its own prompt: not in the prefill's cache
        prompt = rand_tokens(rnd, 1000)
        d = first_turn(engines, prompt, 64, prefill_salt=f"planned-{uuid.uuid4()}")
        history = prompt + d["token_ids"]
        prompt = history + rand_tokens(rnd, 100)
        hashes = engines.decode.call("block_hashes", history if continuation else prompt)
        received = _plans(engines, "received")

        def planned() -> bool:  # Route again until the connector's stream (re)subscribed has one
            answer = k.client.route(MODEL, ["prefill-0"], block_hashes=hashes, continuation=continuation)
            if not answer.ranked[0].registered:  # Route's roster has not seen the new agent yet
                return False
            assert answer.ranked[0].pull_blocks > 0 and answer.ranked[0].local_blocks == 0, answer
            return _plans(engines, "received") > received

        wait_until(planned, 30, "Route's plan at the prefill's connector", interval=0.2)
        used, lookups = _plans(engines, "used"), k.client.stats().lookups
        pf = prefill_and_check(engines, prompt)
        assert pf.span["kvloop.path"] == "transfer" and pf.span["kvloop.holder"] == DECODE_WORKER, pf.span
        said = "planned by Route ahead of this turn" if continuation else "planned by Route"
        assert pf.span["kvloop.detail"].startswith(said), pf.span
        assert _plans(engines, "used") == used + 1
        # only the reference (salted, so no plan matches it) asked Lookup
        assert k.client.stats().lookups == lookups + 1
    finally:
        agent.terminate()
        agent.wait(15)


@pytest.mark.parametrize("edit", ["replace_middle", "drop_segment"])
def test_edited_history_pulls_only_matching_blocks(engines, edit):
    rnd = random.Random(zlib.crc32(edit.encode()))
    prompt = rand_tokens(rnd, 2048)
    # turn 1 on a prefill that caches nothing of it (salted): every block must come from the peer
    d = first_turn(engines, prompt, 32, prefill_salt=f"cold-{uuid.uuid4()}")
    history = prompt + d["token_ids"]
    cut = 1000  # edit starts inside block 31 -> blocks 0..30 still match
    if edit == "replace_middle":
        edited = history[:cut] + rand_tokens(rnd, 64) + history[cut + 64 :]
    else:
        edited = history[:cut] + history[cut + 64 :]
    edited += rand_tokens(rnd, 100)
    pf = prefill_and_check(engines, edited)
    s = pf.span
    assert s["kvloop.path"] == "transfer", s
    assert s["kvloop.matched_tokens"] == (cut // BS) * BS
    assert pf.out["num_cached_tokens"] == (cut // BS) * BS
    assert len(pf.kv_diffs) == len(edited) // BS  # all full blocks compared, not only pulled ones


def empty_prefill_cache(engines) -> None:
    """Forget everything the prefill engine cached (waits out its forward leases)."""
    deadline = time.monotonic() + PREFILL_LEASE_S + 30
    while not engines.prefill.call("reset_prefix_cache"):
        assert time.monotonic() < deadline, "prefill cache never became resettable"
        time.sleep(1)
        engines.prefill.generate([5] * 40, 1, cache_salt="tick")  # steps reap expired leases


def test_shared_prefix_read_by_two_conversations(engines):
    """Multi-reader lease: two conversations pull the same retained run; both reads exact.

    vLLM alone frees a retained run after its first READ (a second read then returns another
    request's KV silently); kvloop keeps it until the lease ends.
    """
    rnd = random.Random(3)
    prompt = rand_tokens(rnd, 2048)
    d = first_turn(engines, prompt, 32, prefill_salt=f"cold-{uuid.uuid4()}")
    handle = d["kv_transfer_params"]["remote_request_id"]
    shared_hash0 = engines.kvloop.runs[-1].hashes[0]
    shared = prompt + d["token_ids"]
    with_kv = len(shared) - 1  # the last sampled token has no KV on the decode
    assert with_kv % BS, "the run must end in a partly filled block: its tail is pulled too"
    for i in range(2):
        empty_prefill_cache(engines)  # the second conversation must read the run again
        conv = shared + rand_tokens(rnd, 150 + 40 * i)
        pf = prefill_and_check(engines, conv)  # KV compared on every full block, the tail's included
        assert pf.span["kvloop.path"] == "transfer", pf.span
        assert pf.span["kvloop.matched_tokens"] == with_kv
        assert pf.out["num_cached_tokens"] == with_kv
        # the decode polls READ notices only when it steps
        engines.decode.generate([5] * 40, 1, cache_salt="tick")
        assert engines.decode.call("kvloop_reads").get(handle) == i + 1
        # still retained and servable in kvloopd after the read
        (loc,) = engines.kvloop.locations(shared_hash0, "retained", handle)
        assert loc.servable


def test_prompt_departing_inside_the_tail_pulls_its_agreeing_start(engines):
    """A turn whose prompt leaves the decode's tokens inside the run's partly filled last block (as a
    re-rendered answer does) pulls the tail up to that token; the engine computes the rest of the
    block over the pulled KV, and every full block, that one included, equals a recompute."""
    rnd = random.Random(13)
    prompt = rand_tokens(rnd, 2048)
    d = first_turn(engines, prompt, 32, prefill_salt=f"cold-{uuid.uuid4()}")
    history = prompt + d["token_ids"]
    assert (len(history) - 1) % BS > 10, "the run must end in a partly filled block longer than the cut"
    cut = 2048 + 10  # inside the tail block (2048..)
    departing = 2 if history[cut] != 2 else 3
    conv = [*history[:cut], departing, *rand_tokens(rnd, 150)]
    pf = prefill_and_check(engines, conv)  # KV compared on every full block, the departed one included
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.matched_tokens"] == cut
    assert pf.out["num_cached_tokens"] == cut
    assert len(pf.kv_diffs) == len(conv) // BS > cut // BS


def test_missing_holder_recomputes(engines):
    rnd = random.Random(4)
    pf = prefill_and_check(engines, rand_tokens(rnd, 900))
    assert pf.span["kvloop.path"] == "miss"
    assert pf.out["num_cached_tokens"] == 0


def _history(engines, seed: int, n: int = 1200):
    rnd = random.Random(seed)
    prompt = rand_tokens(rnd, n)
    d = first_turn(engines, prompt, 32, prefill_salt=f"cold-{uuid.uuid4()}")
    return rnd, prompt + d["token_ids"] + rand_tokens(rnd, 64)


@pytest.mark.parametrize("n_tokens", [2048, 4096])
def test_ttft_transfer_vs_recompute(engines, n_tokens, record_property):
    rnd = random.Random(n_tokens)
    prompt = rand_tokens(rnd, n_tokens - 64)
    d = first_turn(engines, prompt, 32, prefill_salt=f"cold-{uuid.uuid4()}")
    nxt = prompt + d["token_ids"] + rand_tokens(rnd, 32)
    pf = prefill_and_check(engines, nxt)
    assert pf.span["kvloop.path"] == "transfer"
    t_pull, t_rec = pf.out["elapsed_s"], pf.ref["elapsed_s"]
    record_property("ttft_pull_ms", round(t_pull * 1000, 1))
    record_property("ttft_recompute_ms", round(t_rec * 1000, 1))
    print(
        f"{len(nxt)} tokens: prefill with pull {t_pull * 1000:.0f} ms, recompute {t_rec * 1000:.0f} ms, "
        f"pulled {pf.span['kvloop.bytes'] / 2**20:.1f} MiB"
    )


def test_expired_lease_recomputes(engines):
    """kvloopd judges every retained run too close to its lease end (expiry margin > the decode's
    retention TTL): it answers RECOMPUTE/EXPIRED and the connector records 'expired'."""
    _rnd, prompt = _history(engines, 5)
    run = engines.kvloop.runs[-1]
    engines.kvloop.restart_daemon(env={"KVLOOP_EXPIRY_MARGIN_S": str(RETENTION_TTL_S * 10)})
    # rebuilt from the agent's resync, but not servable under this margin
    engines.kvloop.wait_for_run(run, servable=False)
    engines.probe_directory()
    pf = prefill_and_check(engines, prompt)
    assert pf.span["kvloop.path"] == "expired", pf.span
    assert pf.span["kvloop.reason"] == "expired", pf.span
    assert pf.out["num_cached_tokens"] == 0


def test_directory_down_recomputes(engines):
    """kvloopd crashed: lookups fail fast, the prefill engine keeps serving by recomputing."""
    _rnd, prompt = _history(engines, 7)
    engines.kvloop.kill_daemon()
    pf = prefill_and_check(engines, prompt)
    assert pf.span["kvloop.path"] == "recompute", pf.span
    assert pf.span["kvloop.reason"] == "directory_unavailable", pf.span
    assert pf.out["num_cached_tokens"] == 0
    assert pf.span["kvloop.lookup_ms"] < 1000


def test_daemon_restart_rebuilds_directory_and_transfers(engines):
    """A crashed kvloopd restarted on the same port has an empty directory; the agent reconnects,
    resyncs its state (snapshot), and the next turn pulls the run retained before the crash."""
    _rnd, prompt = _history(engines, 9)
    run = engines.kvloop.runs[-1]
    engines.kvloop.kill_daemon()
    engines.kvloop.start_daemon()
    loc = engines.kvloop.wait_for_run(run, timeout=30, servable=True)
    assert loc.worker_id == DECODE_WORKER
    (worker,) = [
        w for w in engines.kvloop.client.list_workers(MODEL) if w.registration.worker_id == DECODE_WORKER
    ]
    assert worker.connected and worker.retained_runs >= 1
    engines.probe_directory()
    pf = prefill_and_check(engines, prompt)
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.holder"] == DECODE_WORKER
    # the whole run, its partly filled last block included (resynced with it): prompt + generated
    # tokens but the last sampled one (64 new tokens follow)
    assert (len(prompt) - 64 - 1) % BS
    assert pf.out["num_cached_tokens"] == pf.span["kvloop.matched_tokens"] == len(prompt) - 64 - 1


def test_agent_restart_rebuilds_from_engine_replay_and_transfers(engines):
    """The agent stops: kvloopd stops serving its worker's runs at once. A new agent process
    rebuilds the state from the engine's KV-event replay buffer; the next turn transfers again."""
    _rnd, prompt = _history(engines, 11)
    k = engines.kvloop
    run = k.runs[-1]
    assert k.stop_agent() == 0
    ans = k.client.lookup(MODEL, run.hashes, requester="prefill-0", block_size=BS)
    assert ans.decision == pb.DECISION_RECOMPUTE and ans.reason == pb.DECISION_REASON_PEER_UNAVAILABLE, ans
    k.start_agent()
    k.wait_for_run(run, timeout=30, servable=True)
    pf = prefill_and_check(engines, prompt)
    assert pf.span["kvloop.path"] == "transfer", pf.span
    # rebuilt from the replay with the run's partly filled last block
    assert pf.out["num_cached_tokens"] == pf.span["kvloop.matched_tokens"] == len(prompt) - 64 - 1


def test_release_after_lease(engines):
    """When a retained run's lease ends kvloopd stops listing it (the daemon reaps leases itself;
    the decode publishes the release when it steps)."""
    k = engines.kvloop
    if not k.runs:  # run alone: make one
        first_turn(engines, rand_tokens(random.Random(12), 300), 8)
    run = min(k.runs, key=lambda r: r.created)
    deadline = run.created + RETENTION_TTL_S + 30
    rnd = random.Random(8)
    while k.locations(run.hashes[0], "retained", run.handle):
        assert time.monotonic() < deadline, f"retained run {run.handle} still listed after its lease"
        time.sleep(1)  # let the lease run out (the condition above is what is waited for)
        engines.decode.generate(rand_tokens(rnd, 40), 1, cache_salt="tick")  # reap on the engine too
    assert time.monotonic() >= run.created + RETENTION_TTL_S - 10  # not dropped early
    # nobody is offered the run any more
    ans = k.client.lookup(MODEL, run.hashes, requester="prefill-0", block_size=BS)
    assert ans.decision != pb.DECISION_TRANSFER or ans.holder.retention_handle != run.handle


def decode_epoch(engines) -> int:
    (worker,) = [
        w for w in engines.kvloop.client.list_workers(MODEL) if w.registration.worker_id == DECODE_WORKER
    ]
    return worker.registration.epoch


def test_dead_decode_engine_recomputes(engines):
    """LAST TEST to use the first decode engine (kills it). Until its agent notices, the directory
    still offers the dead engine's runs: the prefill's READ from the dead peer fails and vLLM's
    recompute policy recomputes, with the right answer. The agent notices the KV-event publisher's
    connection close within milliseconds, so that window is held open by freezing the agent
    (SIGSTOP); once it runs again it drops every run of the dead process under a new epoch."""
    # A transfer first: the prefill then holds a NIXL agent of this decode process (the relaunch
    # test below needs it replaced).
    _rnd, earlier = _history(engines, 25)
    assert prefill_and_check(engines, earlier).span["kvloop.path"] == "transfer"
    _rnd, prompt = _history(engines, 6)
    run = engines.kvloop.runs[-1]
    old_epoch = decode_epoch(engines)
    agent = engines.kvloop.agent
    agent.send_signal(signal.SIGSTOP)
    try:
        engines.decode.kill()
        engines.prefill.timeout_s = 120  # a hung READ must fail the test, not stall the session
        t = time.perf_counter()
        pf = prefill_and_check(engines, prompt)
        elapsed = time.perf_counter() - t
    finally:
        agent.send_signal(signal.SIGCONT)
    assert pf.span["kvloop.path"] in ("failed", "recompute"), pf.span
    assert pf.span["kvloop.bytes"] == 0
    print(f"dead peer: path {pf.span['kvloop.path']}, answered correctly after {elapsed:.1f}s")
    wait_until(
        lambda: not engines.kvloop.locations(run.hashes[0]) and decode_epoch(engines) != old_epoch,
        what="the dead engine's blocks dropped under a new epoch",
    )
    assert "engine process ended" in engines.kvloop.agent_log()


def test_every_path_reached_the_otlp_receiver(engines, otlp_receiver):
    """Runs after the path tests: the prefill engine's kvloop.prefill spans arrived at a real OTLP
    receiver for every path the session produced, with the per-turn attributes."""
    wanted = {"transfer", "miss", "expired", "failed", "recompute"}
    spans = otlp_receiver.wait_for(
        lambda s: s["name"] == "kvloop.prefill" and s["service"] == "vllm-prefill", timeout=30
    )
    deadline = time.monotonic() + 30
    while not wanted <= {s["attributes"].get("kvloop.path") for s in spans}:
        assert time.monotonic() < deadline, sorted({s["attributes"].get("kvloop.path") for s in spans})
        time.sleep(0.2)  # polling the receiver's file for late exports
        spans = [s for s in otlp_receiver.spans() if s["name"] == "kvloop.prefill"]
    transfer = next(s for s in spans if s["attributes"]["kvloop.path"] == "transfer")
    for key in (
        "kvloop.matched_tokens",
        "kvloop.recompute_tokens",
        "kvloop.bytes",
        "kvloop.holder",
        "kvloop.lookup_ms",
        "kvloop.pull_ms",
    ):
        assert key in transfer["attributes"], key
    assert transfer["attributes"]["kvloop.bytes"] > 0 and transfer["duration_ns"] > 0


def relaunch_decode(engines, **extra_config: Any) -> dict[str, Any]:
    """The decode engine killed (if it still runs) and started again on the same NIXL side-channel
    and KV-event ports under the same engine id, its agent still running; ``extra_config`` goes over
    its kv_connector_extra_config. Returns the new engine's ready info."""
    from engine_harness import EngineHandle

    if engines.decode.proc.is_alive():
        old_epoch = decode_epoch(engines)
        engines.decode.kill()
        wait_until(lambda: decode_epoch(engines) != old_epoch, what="the agent's new epoch")
    spec = engines.decode.spec
    engines.decode = EngineHandle(replace(spec, extra_config={**spec.extra_config, **extra_config}))
    info = engines.decode.wait_ready()
    engines.kvloop.wait_agent_connected()
    engines.prefill.timeout_s = 120
    return info


def test_relaunched_decode_engine_serves_pulls_again(engines):
    """AFTER the dead-decode test: the decode engine relaunched (see relaunch_decode). The prefill's
    connector drops the dead process's NIXL agent (vLLM alone would keep it and every READ would
    fail) and handshakes the new one: the next turn transfers from the new engine, KV equal to
    recompute."""
    relaunch_decode(engines)
    _rnd, prompt = _history(engines, 21)
    assert engines.kvloop.runs[-1].handle  # announced by the new process, under the agent's epoch
    pf = prefill_and_check(engines, prompt)
    assert pf.span["kvloop.path"] == "transfer", pf.span
    assert pf.span["kvloop.bytes"] > 0
    assert pf.out["num_cached_tokens"] == pf.span["kvloop.matched_tokens"] == len(prompt) - 64 - 1


def _declined_capped(engine) -> float:
    return engine.call("metrics").get(
        ("kvloop_connector_retention_declined_total", (("reason", "capped"),)), 0.0
    )


def test_retention_stops_at_its_share_of_the_kv_cache(engines):
    """LAST TEST of this pair (relaunches the decode with a retention cap, kvloop_retention_max_share):
    one conversation's run fits under the cap, a second's would not. The second decode still
    answers in full, but its blocks are freed at once (vLLM holds no lease for it) and never
    announced: its next turn misses and recomputes, with the same answer as a recompute, while the
    first conversation's next turn still transfers."""
    share = 0.03
    # leases far longer than the test, however slow the host: a's run must still be held at its next turn
    info = relaunch_decode(engines, kvloop_retention_max_share=share, kvloop_retention_ttl_s=600)
    max_pinned = int(share * info["kv_shapes"][0][0])  # KV layout [blocks, heads, bs, 2 * head_dim]
    tokens = int(0.6 * max_pinned) * BS  # one such run fits, two do not
    rnd = random.Random(31)
    prompt_a = rand_tokens(rnd, tokens)
    d_a = first_turn(engines, prompt_a, 32, prefill_salt=f"cold-{uuid.uuid4()}")
    declined = _declined_capped(engines.decode)

    prompt_b = rand_tokens(rnd, tokens)
    p_b = engines.prefill.generate(prompt_b, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
    d_b = engines.decode.generate(prompt_b, 32, p_b["kv_transfer_params"], logprobs=5)
    assert len(d_b["token_ids"]) == 32 and d_b["kv_transfer_params"] is None
    assert _declined_capped(engines.decode) == declined + 1
    # the worker takes a finished request's lease from the next step's metadata: one more step,
    # then only a's run holds blocks
    engines.decode.generate(rand_tokens(rnd, 8), 1)
    leases = set(engines.decode.call("connector_state")["leases"])
    assert leases == {d_a["kv_transfer_params"]["remote_request_id"]}
    assert not engines.kvloop.locations(engines.decode.call("block_hashes", prompt_b)[0], "retained")

    pf_b = prefill_and_check(engines, prompt_b + d_b["token_ids"] + rand_tokens(rnd, 64))
    assert pf_b.span["kvloop.path"] == "miss", pf_b.span
    pf_a = prefill_and_check(engines, prompt_a + d_a["token_ids"] + rand_tokens(rnd, 64))
    assert pf_a.span["kvloop.path"] == "transfer", pf_a.span


def _yielded(engine, outcome: str) -> float:
    return engine.call("metrics").get(("kvloop_connector_yielded_runs_total", (("outcome", outcome),)), 0.0)


def test_past_most_of_its_share_retention_gives_up_the_oldest_run(engines):
    """LAST TEST of this pair (relaunches the decode with a retention cap and a daemon to confirm drops
    with; kvloopd runs with a 10 s read window). Three conversations of 0.4 of the share each: the
    third takes retention past its share, so it is declined, and the oldest run is given up. The
    directory drops it at once; the decode frees it only a read window after kvloopd confirmed the
    drop. Its next turn misses (same answer and KV as a recompute), the second conversation's next
    turn still transfers, and a fourth conversation fits again once the first is freed."""
    engines.kvloop.restart_daemon(env={"KVLOOP_READ_WINDOW_S": "10"})
    engines.probe_directory()
    share = 0.03
    info = relaunch_decode(
        engines,
        kvloop_retention_max_share=share,
        kvloop_daemon=engines.kvloop.address,
        kvloop_model=engines.kvloop.model,
        kvloop_retention_yield_after_s=0,  # any run may go (by default only those older than 60 s)
    )
    max_pinned = int(share * info["kv_shapes"][0][0])
    # each run: 0.35 of the share, and up to 3 blocks of answer: two stay within 0.9 of it when the
    # share holds 30 blocks or more
    assert max_pinned >= 30, max_pinned
    tokens = int(0.35 * max_pinned) * BS
    rnd = random.Random(37)
    prompts = [rand_tokens(rnd, tokens) for _ in range(4)]
    d_a = first_turn(engines, prompts[0], 32, prefill_salt=f"cold-{uuid.uuid4()}")
    d_b = first_turn(engines, prompts[1], 32, prefill_salt=f"cold-{uuid.uuid4()}")
    run_a = engines.kvloop.runs[-2]
    handle_a = d_a["kv_transfer_params"]["remote_request_id"]
    assert run_a.handle == handle_a
    given_up, declined = _yielded(engines.decode, "given_up"), _declined_capped(engines.decode)

    # c can only be declined, and a given up, after this: a's blocks may not be freed before a read window
    # from here has passed (a bound that a loaded machine only makes looser, never tighter)
    before_c = time.monotonic()
    p_c = engines.prefill.generate(
        prompts[2], 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}"
    )
    d_c = engines.decode.generate(prompts[2], 32, p_c["kv_transfer_params"], logprobs=5)
    assert d_c["kv_transfer_params"] is None  # past the share: declined
    assert _declined_capped(engines.decode) == declined + 1
    assert _yielded(engines.decode, "given_up") == given_up + 1
    # a's release went out at once: the directory hands it out no more ...
    wait_until(
        lambda: not engines.kvloop.locations(run_a.hashes[0], "retained", handle_a), 20, "a's run dropped"
    )

    # ... but the decode keeps its blocks until the drop is confirmed and a read window has passed.
    # (This harness's engine runs in process and steps only for requests: a one-token request steps it.)
    def step() -> None:
        engines.decode.generate(rand_tokens(rnd, 8), 1)

    def held_after_a_step() -> bool:
        step()
        return handle_a in engines.decode.call("connector_state")["leases"]

    def confirmed_after_a_step() -> bool:
        step()
        return _yielded(engines.decode, "confirmed") >= 1

    # held when the directory had already dropped it, unless a whole read window has passed since
    assert held_after_a_step() or time.monotonic() - before_c >= 10.0
    wait_until(confirmed_after_a_step, 20, "the drop confirmed")
    wait_until(
        lambda: not held_after_a_step(), 40, "a's blocks freed a read window after the drop", interval=0.5
    )
    assert time.monotonic() - before_c >= 10.0  # never before the read window
    released = engines.decode.call("metrics").get(
        ("kvloop_connector_released_runs_total", (("reason", "yielded"),)), 0.0
    )
    assert released >= 1

    pf_a = prefill_and_check(engines, prompts[0] + d_a["token_ids"] + rand_tokens(rnd, 64))
    assert pf_a.span["kvloop.path"] == "miss", pf_a.span
    pf_b = prefill_and_check(engines, prompts[1] + d_b["token_ids"] + rand_tokens(rnd, 64))
    assert pf_b.span["kvloop.path"] == "transfer", pf_b.span
    # with a's blocks back, a fourth conversation is retained again
    d_d = first_turn(engines, prompts[3], 32, prefill_salt=f"cold-{uuid.uuid4()}")
    assert d_d["kv_transfer_params"] is not None
    assert _declined_capped(engines.decode) == declined + 1
