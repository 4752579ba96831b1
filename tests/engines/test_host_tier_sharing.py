"""The host pool holds a block once (agents/connector/host/tier.py): copies of runs that share blocks
(a system prompt, an earlier turn) name the same slots, and a slot is never written while a copy names
it (no engine needed; tests/engines/test_host_tier.py covers the pool's other rules)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.agents.connector.events import KvloopBlocksRetained
from kvloop.agents.connector.host.tier import HostTier
from kvloop.agents.connector.yielding import Confirmed
from kvloop.common.sliding_window import NULL_BLOCK
from tests.support import RecordingConfirmer, named_hash, wait_until


class Decode:
    """A decode's KV cache as the tier sees it: each block id holds one block's content, fresh ids for
    each run (a run's content is what its chained hashes say)."""

    def __init__(self) -> None:
        self.next_id = 1
        self.content: dict[int, tuple[bytes, int] | str] = {}  # block id -> (hash, group) or a tail

    def run(self, handle: str, hashes: list[bytes], tail: bool = True) -> KvloopBlocksRetained:
        ids = list(range(self.next_id, self.next_id + len(hashes) + tail))
        self.next_id += len(ids)
        for b, h in zip(ids, hashes, strict=False):
            self.content[b] = (h, 0)
        if tail:
            self.content[ids[-1]] = "tail of " + handle
        return KvloopBlocksRetained(
            block_hashes=hashes,
            block_ids=[ids[: len(hashes)]],
            retention_handle=handle,
            lease_ms=60_000,
            single_use=False,
            tail_token_ids=[7] if tail else [],
            tail_block_ids=ids[-1:] if tail else [],
        )


def _copy(tier: HostTier, handle: str) -> list[list[int]]:
    (copy,) = [c for c in tier.take_copies() if c.handle == handle + "@host"]
    tier.copied({copy.handle: True})
    return copy.slots


def _announced(events: list, handle: str) -> KvloopBlocksRetained:
    (event,) = [
        e for e in events if isinstance(e, KvloopBlocksRetained) and e.retention_handle == handle + "@host"
    ]
    return event


def _pass_fence(tier: HostTier, handle: str) -> None:
    tier.confirmed(Confirmed(handle + "@host", time.perf_counter() - 0.001))
    tier.step()


def test_two_conversations_on_one_system_prompt_hold_it_once():
    events: list = []
    tier = HostTier(32, 600.0, 2.0, events.append, RecordingConfirmer())  # type: ignore[arg-type]
    decode = Decode()
    system = [named_hash("system", i) for i in range(4)]
    tier.plan(decode.run("a", [*system, named_hash("a", 4), named_hash("a", 5)]))
    _copy(tier, "a")
    assert tier.free_slots == 32 - 7  # 6 blocks and the tail
    tier.plan(decode.run("b", [*system, named_hash("b", 4)]))
    written = _copy(tier, "b")
    assert sum(len(g) for g in written) == 2  # its own block and its tail: the prompt is held already
    a, b = _announced(events, "a").block_ids[0], _announced(events, "b").block_ids[0]
    assert b[:4] == a[:4] and b[4] not in a and tier.free_slots == 32 - 7 - 2
    # a's copy released and fenced: only its own blocks come free; b's pull reads the same slots
    tier._release("a@host", tier._copies["a@host"], "evicted")
    _pass_fence(tier, "a")
    assert tier.free_slots == 32 - 4 - 2 and not set(b) & set(tier._free)
    assert tier.has_copy("b") and not tier.has_copy("a")
    tier._release("b@host", tier._copies["b@host"], "evicted")
    _pass_fence(tier, "b")
    assert tier.free_slots == 32


def test_a_block_still_being_written_is_written_again_not_named():
    """Two copies of one prompt in flight at once: neither may name a slot the other has not finished
    writing (that WRITE may fail), so each writes its own; the next copy names the first announced."""
    events: list = []
    tier = HostTier(32, 600.0, 2.0, events.append, RecordingConfirmer())  # type: ignore[arg-type]
    decode = Decode()
    system = [named_hash("system", i) for i in range(3)]
    tier.plan(decode.run("a", system))
    tier.plan(decode.run("b", system))
    copies = {c.handle: c for c in tier.take_copies()}
    assert sum(len(g) for g in copies["b@host"].slots) == 4  # nothing announced yet to name
    tier.copied({"a@host": False, "b@host": True})  # a's WRITE failed: its slots were never named
    assert tier.free_slots == 32 - 4
    tier.plan(decode.run("c", system))
    assert sum(len(g) for g in _copy(tier, "c")) == 1
    assert _announced(events, "c").block_ids[0] == _announced(events, "b").block_ids[0]


PROMPTS = ["system-x", "system-y"]


@st.composite
def operations(draw: st.DrawFn) -> list[tuple]:
    ops = []
    for _ in range(draw(st.integers(5, 40))):
        kind = draw(st.sampled_from(["plan", "plan", "write", "confirm", "release", "step"]))
        if kind == "plan":
            prompt = draw(st.sampled_from(PROMPTS))
            conversation = draw(st.integers(0, 3))
            ops.append((kind, prompt, conversation, draw(st.integers(1, 6)), draw(st.booleans())))
        else:
            ops.append((kind, draw(st.integers(0, 10)), draw(st.booleans())))
    return ops


@settings(max_examples=150, deadline=None)
@given(ops=operations())
def test_no_slot_is_written_while_a_copy_names_it_and_every_named_slot_holds_its_block(ops):
    """Random traffic on a small pool (shared prompts, later turns, failed WRITEs, evictions,
    fences): the slots of every WRITE handed to the worker are named by no copy a prefill may read
    (announced, or released and not yet past its fence) and are not free; and every slot an
    announced copy names holds the block its hash says, as the WRITEs that reached it left it; no
    slot is lost."""
    events: list = []
    tier = HostTier(24, 600.0, 0.0, events.append, RecordingConfirmer())  # type: ignore[arg-type]
    decode = Decode()
    slot_holds: dict[int, tuple[bytes, int] | str] = {}  # what the worker's WRITEs left in each slot
    in_flight: list = []
    turns: dict[tuple[str, int], int] = {}
    for n, op in enumerate(ops):
        if op[0] == "plan":
            _, prompt, conversation, blocks, tail = op
            turn = turns[(prompt, conversation)] = turns.get((prompt, conversation), 0) + 1
            history = [named_hash(prompt, i) for i in range(3)] + [
                named_hash(f"{prompt}/{conversation}", i) for i in range(blocks * turn)
            ]
            tier.plan(decode.run(f"r{n}", history, tail))
        elif op[0] == "write" and in_flight:
            copy = in_flight.pop(op[1] % len(in_flight))
            if op[2]:  # the WRITE lands
                for ids, slots in zip(copy.block_ids, copy.slots, strict=True):
                    for b, s in zip(ids, slots, strict=True):
                        slot_holds[s] = decode.content[b]
            else:  # it failed part way: its slots hold nothing anyone may read
                for s in (s for g in copy.slots for s in g):
                    slot_holds.pop(s, None)
            tier.copied({copy.handle: op[2]})
        elif op[0] == "confirm":
            released = [h for h, c in tier._copies.items() if c.state == "released"]
            if released:
                tier.confirmed(Confirmed(released[op[1] % len(released)], time.perf_counter() - 0.001))
        elif op[0] == "release":
            announced = [h for h, c in tier._copies.items() if c.state == "announced"]
            if announced:
                handle = announced[op[1] % len(announced)]
                tier._release(handle, tier._copies[handle], "evicted")
        else:
            tier.step()
        fresh = tier.take_copies()
        readable = {
            s
            for c in tier._copies.values()
            if c.state in ("announced", "released")
            for g in c.event.block_ids
            for s in g
            if s != NULL_BLOCK
        }
        for copy in fresh:
            written = {s for g in copy.slots for s in g}
            assert not written & readable, (op, written & readable)
            assert not written & set(tier._free)
            for s in written:
                slot_holds.pop(s, None)  # being written: nothing readable there until it lands
        in_flight.extend(fresh)
        for copy in tier._copies.values():
            if copy.state not in ("announced", "released"):
                continue
            for g, slots in enumerate(copy.event.block_ids):
                for p, s in enumerate(slots):
                    assert slot_holds.get(s) == (copy.event.block_hashes[p], g), (
                        copy.event.retention_handle,
                        p,
                        s,
                    )
        # no slot lost or handed out twice: each is free or named by a copy, never both
        named = {tier._slot_of[k] for h in tier._blocks.runs() for k in tier._blocks.names(h)}
        assert len(tier._free) == len(set(tier._free)) and not set(tier._free) & named
        assert set(tier._free) | named == set(range(1, 25))


# ------------------------------------------------------------------------------------ with engines


def _host_slots(pair, hashes: list[bytes], handle: str) -> list[int]:
    """The pool slot of each block of ``handle``'s copy, as the directory lists it."""
    slots = []
    for h in hashes:
        (run,) = pair.kvloop.locations(h, "retained", handle)
        slots.append(run.block_ids[0])
    return slots


@pytest.mark.engines
def test_conversations_sharing_a_prompt_hold_it_once_and_each_pulls_its_whole_history(host_pair, monkeypatch):
    """Two conversations on one 320-token system prompt, copied one after the other: the second copy
    names the first's slots for the prompt's blocks and writes only its own. Each conversation's
    next turn pulls its whole history from the pool, the KV equal to a recompute's block by block;
    with the first conversation's copy released and new copies written while the second's pull
    READs the pool, that pull is whole and exact still."""
    import random
    import uuid

    from conftest import BS
    from test_host_tier import _metric
    from test_reverse_pull import empty_prefill_cache, prefill_and_check, rand_tokens

    pair = host_pair
    rnd = random.Random(53)

    system = rand_tokens(rnd, 320)
    n = len(system) // BS
    shared_before = pair.decode.call("metrics").get(("kvloop_connector_host_shared_blocks_total", ()), 0.0)
    conversations = []
    for _ in range(2):
        prompt = system + rand_tokens(rnd, 150)
        p = pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}")
        d = pair.decode.generate(prompt, 32, p["kv_transfer_params"])
        handle = d["kv_transfer_params"]["remote_request_id"]
        history = prompt + d["token_ids"]
        hashes = pair.decode.call("block_hashes", history)

        def copied(hashes=hashes, handle=handle) -> list:
            pair.decode.generate(rand_tokens(rnd, 8), 1)  # the in-process engine steps only for requests
            return pair.kvloop.locations(hashes[-1], "retained", f"{handle}@host")

        # the pool may have to make room first: copies it releases come free a read window (30 s)
        # after kvloopd confirmed their drop
        wait_until(copied, 120, "the host copy announced")
        conversations.append((handle, history, hashes))
    (a, _, hashes_a), (b, history_b, hashes_b) = conversations
    slots_a, slots_b = _host_slots(pair, hashes_a, f"{a}@host"), _host_slots(pair, hashes_b, f"{b}@host")
    assert slots_b[:n] == slots_a[:n]  # the system prompt's blocks, held once
    assert not set(slots_b[n:]) & set(slots_a) and 0 not in slots_b
    shared = pair.decode.call("metrics").get(("kvloop_connector_host_shared_blocks_total", ()), 0.0)
    assert shared - shared_before >= n

    def pull(history: list[int]):
        empty_prefill_cache(pair)  # nothing of it local: the whole history is pulled
        nxt = history + rand_tokens(rnd, 64)
        pf = prefill_and_check(pair, nxt)
        assert pf.span["kvloop.path"] == "transfer" and pf.span["kvloop.tier"] == "host", pf.span
        assert pf.out["num_cached_tokens"] == len(nxt) - 64 - 1
        return pf

    def gone(hashes: list[bytes], handle: str) -> bool:
        pair.decode.generate(rand_tokens(rnd, 8), 1)
        return not pair.kvloop.locations(hashes[0], "retained", handle)

    for handle, history, hashes in conversations:
        wait_until(lambda h=hashes, r=handle: gone(h, r), 30, "the KV-cache run dropped")
        pull(history)

    # a's copy released as the pool's eviction releases one, racing b's pull from the pool: in the
    # decode the release and new copies (written into a's own slots once their fence passed), in
    # the prefill meanwhile b's READ of slots both copies named. Whatever the interleaving, b's
    # slots are never written and its pull is whole and exact.
    lock = threading.Lock()  # the two threads share the prefill's pipe, one call at a time
    call = pair.prefill.call

    def one_at_a_time(cmd: str, args=None):
        with lock:
            return call(cmd, args)

    monkeypatch.setattr(pair.prefill, "call", one_at_a_time)
    released = _metric(pair, "kvloop_connector_host_released_total", ("reason", "evicted"))
    fresh = [rand_tokens(rnd, 300) for _ in range(3)]
    nxt_b = history_b + rand_tokens(rnd, 64)
    empty_prefill_cache(pair)

    def churn() -> None:
        pair.decode.call("host_release", f"{a}@host")
        for prompt in fresh:
            p = pair.prefill.generate(
                prompt, 1, {"do_remote_decode": True}, cache_salt=f"cold-{uuid.uuid4()}"
            )
            pair.decode.generate(prompt, 16, p["kv_transfer_params"])

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        pf = prefill_and_check(pair, nxt_b)
    finally:
        writer.join()
    assert pf.span["kvloop.path"] == "transfer" and pf.span["kvloop.tier"] == "host", pf.span
    assert pf.out["num_cached_tokens"] == len(nxt_b) - 64 - 1
    wait_until(lambda: gone(hashes_a, f"{a}@host"), 30, "a's copy dropped")
    assert _metric(pair, "kvloop_connector_host_released_total", ("reason", "evicted")) == released + 1
    assert _host_slots(pair, hashes_b, f"{b}@host") == slots_b
    pull(history_b)  # and again, a's own slots possibly rewritten by now
