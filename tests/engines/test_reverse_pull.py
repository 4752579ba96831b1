"""KvloopConnector on two real vLLM CPU engines: hash-matched reverse pulls are exact.

Every prefill that pulls is checked against a recompute of the same prompt on the same engine
(``cache_salt`` changes the block hashes, so the reference neither hits the local prefix cache
nor matches anything in the directory): KV over all full blocks within one bf16 step (0.0157),
same greedy tokens, logprobs equal up to bf16 noise.
"""

from __future__ import annotations

import random
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import LOOKUP_BACKOFF_S, PREFILL_LEASE_S, RETENTION_TTL_S

pytestmark = pytest.mark.engines

BS = 32
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
    for i, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"])):
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


def prefill_and_check(engines, prompt: list[int], *, check_kv: bool = True) -> Prefill:
    """Prefill `prompt` through kvloop, then recompute it as reference and compare."""
    P = engines.prefill
    out = P.generate(prompt, 1, {"do_remote_decode": True}, logprobs=5)
    ref = P.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"ref-{uuid.uuid4()}", logprobs=5)
    rid = out["kv_transfer_params"]["remote_request_id"]  # vLLM's internal request id
    spans = [s for s in P.call("spans") if s.get("kvloop.request_id") == rid]
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
    if salt is None:  # wait until the retained event reached the directory
        engines.directory.wait_for_handle(d["kv_transfer_params"]["remote_request_id"])
    return d


def first_turn(engines, prompt: list[int], n_decode: int, prefill_salt: str | None = None):
    """Turn 1: prefill (optionally salted = a prefill instance that has none of it cached),
    then decode, which retains prompt + generated blocks and announces them."""
    p = engines.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=prefill_salt)
    d = decode(engines, prompt, p["kv_transfer_params"], n_decode)
    engines.prefill.call("spans")
    return d


def test_retained_event_reaches_directory_via_vllm_kv_events(engines):
    rnd = random.Random(10)
    prompt = rand_tokens(rnd, 700)
    d = first_turn(engines, prompt, 20)
    handle = d["kv_transfer_params"]["remote_request_id"]
    run = engines.directory.index._runs[handle].ev
    # complete blocks only: 700 prompt + 20 generated, the last sampled token has no KV yet
    assert len(run.block_hashes) == (700 + 20 - 1) // BS
    assert all(isinstance(h, bytes) and len(h) == 32 for h in run.block_hashes)
    assert run.block_ids[0] == list(d["kv_transfer_params"]["remote_block_ids"][0][: len(run.block_hashes)])
    assert run.engine_id == "decode-0" and run.single_use is False
    assert 0 < run.lease_ms <= RETENTION_TTL_S * 1000
    assert run.nixl_port == engines.decode.spec.side_channel_port
    # 2 (K, V) x 32 tokens x 6 heads x 64 dims x 2 bytes (bf16) x 4 layers
    assert run.kv_bytes_per_block == 2 * 32 * 6 * 64 * 2 * 4
    assert {"BlockStored", "KvloopBlocksRetained"} <= engines.directory.kv_event_types


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
            f"turn {turn}: lookup {s['kvloop.lookup_ms']:.1f} ms, pulled {s['kvloop.bytes'] / 2**20:.1f} MiB, "
            f"{compared}/{len(d['token_ids'])} decoded tokens identical before any tie flip"
        )
    assert _transfers(engines) - transfers_before == 3  # prometheus agrees with the spans
    m = engines.prefill.call("metrics")
    assert m[("kvloop_connector_pulled_bytes_total", ())] > 0


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
    shared = prompt + d["token_ids"]
    n_shared_blocks = (len(shared) - 1) // BS  # the last sampled token has no KV on the decode
    for i in range(2):
        empty_prefill_cache(engines)  # the second conversation must read the run again
        conv = shared + rand_tokens(rnd, 150 + 40 * i)
        pf = prefill_and_check(engines, conv)
        assert pf.span["kvloop.path"] == "transfer", pf.span
        assert pf.span["kvloop.matched_tokens"] == n_shared_blocks * BS
        assert pf.out["num_cached_tokens"] == n_shared_blocks * BS
        # the decode polls READ notices only when it steps
        engines.decode.generate([5] * 40, 1, cache_salt="tick")
        assert engines.decode.call("kvloop_reads").get(handle) == i + 1
        assert handle in engines.directory.index.handles()  # still retained


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


def test_expiring_lease_recomputes(engines):
    _rnd, prompt = _history(engines, 5)

    def short_lease(resp):
        if resp.HasField("holder"):
            resp.holder.expires_in_ms = 1500  # below the connector's 6 s safety margin
        return resp

    engines.directory.override = short_lease
    try:
        pf = prefill_and_check(engines, prompt)
    finally:
        engines.directory.override = None
    assert pf.span["kvloop.path"] == "expired"
    assert pf.out["num_cached_tokens"] == 0


def test_dead_peer_read_fails_and_recomputes(engines):
    """The holder is unreachable: the NIXL handshake fails, vLLM's recompute policy recomputes."""
    _rnd, prompt = _history(engines, 6)

    def dead_peer(resp):
        if resp.HasField("holder"):
            resp.holder.engine_id = "ghost-engine"
            resp.holder.nixl_endpoint = "127.0.0.1:9"  # nothing listens there
        return resp

    engines.directory.override = dead_peer
    try:
        t = time.perf_counter()
        pf = prefill_and_check(engines, prompt)
        elapsed = time.perf_counter() - t
    finally:
        engines.directory.override = None
    assert pf.span["kvloop.path"] == "failed", pf.span
    assert pf.span["kvloop.bytes"] == 0
    assert pf.span["kvloop.recompute_tokens"] == len(prompt)
    print(f"dead peer: answered correctly after {elapsed:.1f}s (vLLM handshake timeout 5 s)")


def test_directory_down_recomputes(engines):
    """Lookups that error out recompute (the prefill engine keeps serving)."""
    _rnd, prompt = _history(engines, 7)

    def boom(resp):
        raise RuntimeError("daemon exploded")

    engines.directory.override = boom
    try:
        pf = prefill_and_check(engines, prompt)
    finally:
        engines.directory.override = None
        time.sleep(LOOKUP_BACKOFF_S + 0.2)  # the connector skips lookups for a while after an error
    assert pf.span["kvloop.path"] == "recompute"
    assert pf.span["kvloop.reason"] == "directory_unavailable"


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


def test_release_event_after_lease(engines):
    """When a lease ends (and the decode engine steps) the decode publishes the run's release."""
    index = engines.directory.index
    with index._lock:
        oldest = min(index._runs.values(), key=lambda r: r.deadline)
    handle = oldest.ev.retention_handle
    deadline = time.monotonic() + RETENTION_TTL_S + 30
    rnd = random.Random(8)
    while handle not in engines.directory.released:
        assert time.monotonic() < deadline, "no release event"
        time.sleep(1)
        # vLLM reaps expired leases only when the engine steps
        engines.decode.generate(rand_tokens(rnd, 40), 1, cache_salt="tick")
    ev = engines.directory.released[handle]
    assert ev.reason == "expired" and ev.worker_id == "decode-0"
    assert handle not in index.handles()
    assert "KvloopRetentionReleased" in engines.directory.kv_event_types
