"""`kvloop bench replay`'s host pool (clients/bench/replay/fleet.py) and the connector's
(agents/connector/host/tier.py) hold the same blocks through the same runs: a crafted trace of
conversations sharing system prompts, later turns superseding earlier ones, and evictions for room."""

from __future__ import annotations

import time

from kvloop.agents.connector.events import KvloopBlocksRetained
from kvloop.agents.connector.host.eviction import eviction_policy
from kvloop.agents.connector.host.tier import HostTier
from kvloop.agents.connector.yielding import Confirmed
from kvloop.clients.bench.replay.fleet import _Pool, _Run
from kvloop.common.host_names import HOST_SUFFIX
from tests.support import RecordingConfirmer, named_hash

SLOTS = 100


def _trace() -> list[tuple[str, list[bytes]]]:
    """Turns of six conversations on two system prompts (8 blocks each), interleaved; each turn
    resends its conversation's history and adds 3-5 blocks."""
    histories: dict[int, list[bytes]] = {}
    out = []
    for step in range(30):
        c = (step * 7) % 6
        history = histories.setdefault(c, [named_hash(f"system{c % 2}", i) for i in range(8)])
        history += [named_hash(f"conversation{c}", len(history) + i) for i in range(3 + step % 3)]
        out.append((f"t{step}", list(history)))
    return out


def test_the_replays_pool_and_the_connectors_hold_the_same_blocks_turn_by_turn():
    events: list = []
    confirmer = RecordingConfirmer()
    tier = HostTier(SLOTS, 600.0, 0.0, events.append, confirmer)  # type: ignore[arg-type]
    pool = _Pool(SLOTS, policy=eviction_policy("lru", 600.0))
    next_id = 1
    evicted = superseded = 0
    shared = False
    for n, (handle, hashes) in enumerate(_trace()):
        # the connector: the run (its blocks and a tail block) copied, released copies fenced, announced
        ids = list(range(next_id, next_id + len(hashes) + 1))
        next_id += len(ids)
        tier.plan(
            KvloopBlocksRetained(
                block_hashes=hashes,
                block_ids=[ids[:-1]],
                retention_handle=handle,
                lease_ms=60_000,
                single_use=False,
                tail_token_ids=[1],
                tail_block_ids=ids[-1:],
            )
        )
        while True:  # until every release is past its fence and every copy is written
            for asked in confirmer.asked:
                tier.confirmed(Confirmed(asked.handle, time.perf_counter() - 0.001))
            confirmer.asked.clear()
            tier.step()
            copies = tier.take_copies()
            if not copies and not confirmer.asked:
                break
            tier.copied({c.handle: True for c in copies})
        # the replay: the same run, its tail block a block of its own
        run = _Run(handle + HOST_SUFFIX, hashes, 1, withdraw_ms=1e12, expire_ms=1e12, tier="host")
        evicted += len(pool.make_room(run, float(n)))
        pool.add(run)
        superseded += len(pool.supersede(run))

        live = {h for h, c in tier._copies.items() if c.state == "announced"}
        assert live == set(pool.runs), (handle, live ^ set(pool.runs))
        assert SLOTS - tier.free_slots == pool.used, handle
        shared |= pool.used < sum(len(pool.blocks.names(h)) for h in pool.runs)
    # the trace exercised what it is for: blocks shared, earlier turns superseded, copies evicted
    assert evicted and superseded and shared, (evicted, superseded, shared)


def test_a_pool_holding_each_runs_blocks_apart_holds_more():
    shared = _Pool(10_000)
    apart = _Pool(10_000, shared=False)
    for handle, hashes in _trace()[:6]:
        for pool in (shared, apart):
            pool.add(_Run(handle, hashes, 1, withdraw_ms=1e12, expire_ms=1e12, tier="host"))
    assert apart.used == sum(len(h) + 1 for _, h in _trace()[:6])
    assert shared.used == apart.used - 4 * 8  # six conversations on two system prompts
