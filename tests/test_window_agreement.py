"""The directory's sliding-window cut and the connector's read check agree, case by case.

One table of conversation shapes on a hybrid model (a 128-token sliding-window group, then full
attention; 32-token blocks, as the tiny Gemma-3-like model): what a decode's KV-cache run and its
host copy keep, the next prompt, the prefill's local prefix. Each case goes through kvloopd's
Lookup (a real store, the policy's cut and ranking, the wire format) and then through the
connector's choice of blocks to read from the holder it was given, and both are held against the
rule written out on its own here: the directory hands out exactly the holder and end the engine
then reads, and answers ``window_not_held`` exactly when no holder serves a pull past the local
prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvloop.agents.connector.directory import HolderInfo, answer_from_proto
from kvloop.agents.connector.remote_groups import RemoteGroups, remote_groups
from kvloop.daemon.convert import lookup_response
from kvloop.daemon.index import BlockTier, IndexConfig, MemoryStore, Namespace, Retained, WorkerSpec
from kvloop.daemon.layout import KvLayout
from kvloop.daemon.policy import Policy
from kvloop.daemon.policy_config import PolicyConfig
from kvloop.daemon.queries import LookupQuery
from kvloop.v1 import directory_pb2 as pb
from tests.support import conversation

BS = 32
WINDOW = 128
WINDOWS = (WINDOW, 0)
NULL = 0
SPEC = WorkerSpec(
    "decode-0",
    2,
    "m",
    "decode-engine",
    "h:1",
    BS,
    "sha256_cbor",
    32,
    1,
    kv_bytes_per_block=1 << 20,
    kv_group_windows=WINDOWS,
    host_engine_id="decode-host-pool",
    host_nixl_endpoint="h:2",
)


@dataclass(frozen=True)
class Turn:
    """A decode's finished turn: its prompt, and the tokens with KV at its end (prompt + answer - 1,
    the last sampled token never went through the model)."""

    prompt_tokens: int
    kv_tokens: int

    @property
    def blocks(self) -> int:
        return self.kv_tokens // BS

    @property
    def tail_tokens(self) -> int:
        return self.kv_tokens % BS


# 43 full prompt blocks; the answer ends with a tail of 31 tokens (a whole block but one), or 22
TURN = Turn(prompt_tokens=1400, kv_tokens=1599)
TURN_SHORT_TAIL = Turn(prompt_tokens=1400, kv_tokens=1590)


@dataclass(frozen=True)
class Run:
    """What one holder keeps of a turn: the decode's KV-cache run (the window at its end) or its host
    copy (that, and the window the decode captured at its prompt's end), less ``lost`` (group,
    position) blocks (a capture that found no room, a block never copied; ``tail`` positions are
    the partly filled last block)."""

    tier: str  # "device" | "host"
    turn: Turn
    lost: frozenset[tuple[int, int]] = frozenset()

    @property
    def handle(self) -> str:
        return "r" if self.tier == "device" else "r@host"

    def groups(self) -> tuple[list[int], list[int], list[int]]:
        """(sliding-window ids, full-attention ids, tail ids) by position, NULL where not kept."""
        turn, n = self.turn, self.turn.blocks
        kept = set(range(_skipped_blocks(turn.kv_tokens), n + 1))
        if self.tier == "host":
            prompt_end = turn.prompt_tokens // BS
            kept |= set(range(_skipped_blocks(prompt_end * BS), prompt_end))
        base = 100 if self.tier == "device" else 1000  # KV-cache block ids, or host pool slots
        sliding = [base + p if p in kept else NULL for p in range(n + 1)]
        full = [base + 500 + p for p in range(n + 1)]
        for g, p in self.lost:
            (sliding, full)[g][p] = NULL
        tail = [sliding[n], full[n]] if turn.tail_tokens else []
        return sliding[:n], full[:n], tail


def _skipped_blocks(end_tokens: int) -> int:
    """vLLM's ``SlidingWindowManager.get_num_skipped_tokens``, in whole blocks."""
    return max(0, end_tokens - WINDOW + 1) // BS


@dataclass(frozen=True)
class Case:
    runs: tuple[Run, ...]  # the holders the store matches, in the order they were announced
    agreeing_blocks: int  # leading blocks of the next prompt equal to the runs' (by chained hash)
    local_blocks: int  # the prefill's own prefix when it asks
    # what the connector then reads: the handle and the pull's end in tokens (None, 0: nothing)
    handle: str | None
    end_tokens: int
    # tokens of the runs' tail the prompt agrees with (when it agrees with every complete block)
    tail_agreement: int = BS
    engine_local_blocks: int | None = None  # the prefill's local prefix when the answer arrives


DEVICE, HOST = Run("device", TURN), Run("host", TURN)
DEVICE_SHORT_TAIL, HOST_SHORT_TAIL = Run("device", TURN_SHORT_TAIL), Run("host", TURN_SHORT_TAIL)
# the capture of the prompt's window lost its first two blocks (39, 40)
HOST_PART_CAPTURE = Run("host", TURN, frozenset({(0, 39), (0, 40)}))
WHOLE = TURN.blocks  # a continuation of the whole history agrees with every complete block

CASES = {
    # a regenerated answer: the same prompt again; only the host copy kept its window (blocks 39-42)
    "regenerate": Case((DEVICE, HOST), 43, 0, "r@host", 43 * BS),
    "regenerate, no host pool": Case((DEVICE,), 43, 0, None, 0),
    "regenerate, partial local hit": Case((DEVICE, HOST), 43, 41, "r@host", 43 * BS),
    "regenerate, capture lost its first blocks": Case((DEVICE, HOST_PART_CAPTURE), 43, 0, None, 0),
    "regenerate, capture lost blocks the local prefix covers": Case(
        (DEVICE, HOST_PART_CAPTURE), 43, 41, "r@host", 43 * BS
    ),
    # another conversation sharing the system prompt: no holder keeps a window ending there ...
    "shared prefix": Case((DEVICE, HOST), 30, 0, None, 0),
    "shared prefix, partial local hit": Case((DEVICE, HOST), 30, 29, None, 0),
    # ... unless it ends inside the captured window and the puller holds the blocks before it
    "shared prefix inside the captured window": Case((DEVICE, HOST), 41, 0, None, 0),
    "shared prefix inside the captured window, local hit": Case((DEVICE, HOST), 41, 39, "r@host", 41 * BS),
    # turns 2-3 of conversations prefilled side by side: the local prefix changed after the Lookup
    "concurrent, local blocks evicted before the pull": Case(
        (DEVICE, HOST_PART_CAPTURE), 43, 41, "r@host", 0, engine_local_blocks=38
    ),
    "concurrent, local blocks grew before the pull": Case(
        (DEVICE, HOST_PART_CAPTURE), 43, 41, "r@host", 43 * BS, engine_local_blocks=42
    ),
    # the next turn continues the whole history: the KV-cache run's last window serves it
    "repeated continuation": Case(
        (DEVICE_SHORT_TAIL, HOST_SHORT_TAIL), WHOLE, 0, "r", 1590, tail_agreement=22
    ),
    "repeated continuation, answer re-rendered in the tail": Case(
        (DEVICE_SHORT_TAIL, HOST_SHORT_TAIL), WHOLE, 0, "r", WHOLE * BS + 5, tail_agreement=5
    ),
    "repeated continuation, departing at the tail": Case(
        (DEVICE_SHORT_TAIL,), WHOLE, 0, "r", WHOLE * BS, tail_agreement=0
    ),
    # a tail of 31 tokens: the KV-cache run's window serves only a pull that reads all of it, so
    # the host copy, which serves the previous prompt whatever the tail, goes first ...
    "repeated continuation, tail of a block but one": Case(
        (DEVICE, HOST), WHOLE, 0, "r@host", 1599, tail_agreement=31
    ),
    "repeated continuation, tail of a block but one, re-rendered": Case(
        (DEVICE, HOST), WHOLE, 0, "r@host", 43 * BS, tail_agreement=10
    ),
    # ... unless the puller's local prefix covers what the KV-cache run lacks
    "repeated continuation, tail of a block but one, local hit": Case(
        (DEVICE, HOST), WHOLE, 47, "r", 1599, tail_agreement=31
    ),
    # the one shape the directory cannot foresee: it sees the prompt's full blocks, not the tokens
    # of its last, partly filled one
    "repeated continuation, tail of a block but one, re-rendered, no host pool": Case(
        (DEVICE,), WHOLE, 0, "r", 0, tail_agreement=10
    ),
    # blocks missing elsewhere: a full-attention block, a host copy's tail
    "full-attention block missing": Case(
        (Run("device", TURN_SHORT_TAIL, frozenset({(1, 20)})),), WHOLE, 0, None, 0, tail_agreement=22
    ),
    "full-attention block missing below the local prefix": Case(
        (Run("device", TURN_SHORT_TAIL, frozenset({(1, 20)})),), WHOLE, 21, "r", 1590, tail_agreement=22
    ),
    "host copy without its tail block": Case(
        (Run("host", TURN_SHORT_TAIL, frozenset({(0, WHOLE)})),),
        WHOLE,
        0,
        "r@host",
        WHOLE * BS,
        tail_agreement=22,
    ),
}


def holder_info(run: Run, agreeing_blocks: int) -> HolderInfo:
    """``run`` as the connector would get it for a prompt agreeing with its first blocks."""
    sliding, full, tail = run.groups()
    whole = agreeing_blocks >= run.turn.blocks
    matched = min(agreeing_blocks, run.turn.blocks)
    return HolderInfo(
        "decode-0",
        "e",
        "h",
        1,
        "",
        run.handle,
        (tuple(sliding[:matched]), tuple(full[:matched])),
        60_000,
        False,
        1,
        tail_token_ids=tuple(range(run.turn.tail_tokens)) if whole and tail else (),
        tail_block_ids=tuple(tail) if whole and tail else (),
    )


def pull_end(holder: HolderInfo, matched: int, tail_agreement: int, local_blocks: int) -> int:
    """The rule itself, block by block: the longest pull end past the local prefix at which every
    group keeps every block vLLM allocates for it (0: none)."""
    tail = min(tail_agreement, len(holder.tail_token_ids))
    ends = ([matched * BS + tail] if tail else []) + [e * BS for e in range(matched, local_blocks, -1)]
    for end in ends:
        needed = range(local_blocks, -(-end // BS))
        windowed = range(max(local_blocks, _skipped_blocks(end)), -(-end // BS))
        by_position = [
            [*g[:matched], *([holder.tail_block_ids[i]] if tail else [])]
            for i, g in enumerate(holder.block_ids)
        ]
        if all(by_position[1][p] != NULL for p in needed) and all(
            by_position[0][p] != NULL for p in windowed
        ):
            return end
    return 0


def engine_end(reads: RemoteGroups | str) -> int:
    return reads.end_tokens if isinstance(reads, RemoteGroups) else 0


async def directory_answer(case: Case) -> pb.LookupResponse:
    store = MemoryStore(IndexConfig())
    await store.register(SPEC, 0, 0.0)
    hashes = conversation("c", TURN.blocks)
    retained = []
    for run in case.runs:
        sliding, full, tail = run.groups()
        n = run.turn.blocks
        tier = BlockTier.DEVICE if run.tier == "device" else BlockTier.HOST
        tail_tokens = list(range(run.turn.tail_tokens)) if tail else []
        retained.append(
            Retained(
                hashes[:n],
                sliding + full,
                2,
                run.handle,
                60_000,
                False,
                tier=tier,
                tail_token_ids=tail_tokens,
                tail_block_ids=tail,
            )
        )
    await store.apply("decode-0", 1, 1, retained, 0.0)
    prompt = hashes[: case.agreeing_blocks] + conversation("next", 8)
    policy = Policy(PolicyConfig(recompute_threshold_tokens=0, transfer_cost_ratio=1e9))
    query = LookupQuery(
        Namespace("m"), prompt, case.local_blocks, "p", BS, layout=KvLayout(kv_group_windows=WINDOWS)
    )
    answer = await policy.answer(store, query, 1.0)
    return lookup_response(answer, BS, pack_block_ids=True, read_window_ms=60_000)


@pytest.mark.parametrize("name", list(CASES))
async def test_the_directory_hands_out_what_the_engine_reads(name):
    case = CASES[name]
    engine_local = case.local_blocks if case.engine_local_blocks is None else case.engine_local_blocks
    response = await directory_answer(case)
    # what each holder serves by the rule, for the prompt the directory sees (every tail token agreeing)
    best = max(
        pull_end(
            holder_info(run, case.agreeing_blocks),
            min(case.agreeing_blocks, run.turn.blocks),
            BS,
            case.local_blocks,
        )
        for run in case.runs
    )
    if case.handle is None:
        assert response.decision == pb.DECISION_RECOMPUTE, response
        assert response.reason == pb.DECISION_REASON_WINDOW_NOT_HELD, response
        assert "KV-cache group" in response.detail and not response.HasField("holder")
        assert best == 0
        # and the engine, asked to read any of the holders, finds nothing past its local prefix
        for run in case.runs:
            holder = holder_info(run, case.agreeing_blocks)
            matched = min(case.agreeing_blocks, run.turn.blocks)
            tail = min(case.tail_agreement, len(holder.tail_token_ids))
            reads = remote_groups(holder, WINDOWS, BS, matched, tail, engine_local)
            assert isinstance(reads, str) and "KV-cache group" in reads, reads
        return
    assert response.decision == pb.DECISION_TRANSFER, response
    answer = answer_from_proto(response)
    holder = answer.holder
    assert holder is not None and holder.retention_handle == case.handle
    # the directory cuts the holder to the furthest any holder serves
    assert answer.matched_blocks * BS + len(holder.tail_token_ids) == best
    tail = min(case.tail_agreement, len(holder.tail_token_ids))
    reads = remote_groups(holder, WINDOWS, BS, answer.matched_blocks, tail, engine_local)
    assert engine_end(reads) == case.end_tokens == pull_end(holder, answer.matched_blocks, tail, engine_local)
    if tail == len(holder.tail_token_ids) and engine_local == case.local_blocks:
        assert engine_end(reads) == best  # the engine reads exactly what was handed out
    if isinstance(reads, RemoteGroups):
        end = -(-reads.end_tokens // BS)
        sliding, full = reads.block_ids
        assert NULL not in sliding and NULL not in full[engine_local:]
        assert len(sliding) == end - max(engine_local, _skipped_blocks(reads.end_tokens))
        assert len(full) == end
