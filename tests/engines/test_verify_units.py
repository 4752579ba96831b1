"""Verified pulls' parts, without an engine: block digests over KV-cache tensors (digest.py), the
holder's announcements waiting for them (digest_gate.py), a READ's check (read_check.py) and the
puller's choice of what to check (verify.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kvloop.agents.connector.digest import BlockDigester, layer_weights
from kvloop.agents.connector.digest_gate import DigestGate
from kvloop.agents.connector.directory import HolderInfo
from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.connector.faults import FaultSwitch
from kvloop.agents.connector.metadata import VERIFY_FAILED, VERIFY_PASSED, VERIFY_UNCHECKED, PullCheck
from kvloop.agents.connector.read_check import ReadChecks
from kvloop.agents.connector.verify import PullVerifier
from kvloop.common import block_digests

NUM_BLOCKS = 16


def _caches(layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # the CPU backend's blocks-first layout, and a GPU backend's K/V-first one
    shape = (NUM_BLOCKS, 2, 8, 32) if layout == "blocks_first" else (2, NUM_BLOCKS, 8, 32)
    return {f"layer.{i}": torch.randn(shape, generator=g).to(torch.bfloat16) for i in range(3)}


def _digester(caches: dict[str, torch.Tensor], groups: list[list[str]] | None = None) -> BlockDigester:
    groups = groups or [list(caches)]
    config = SimpleNamespace(
        num_blocks=NUM_BLOCKS, transfer_groups=[SimpleNamespace(layer_names=names) for names in groups]
    )
    return BlockDigester(caches, config)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
def test_equal_blocks_digest_equal_and_any_changed_word_changes_the_digest(layout):
    caches = _caches(layout)
    copy = {name: t.clone() for name, t in caches.items()}
    mine, theirs = _digester(caches), _digester(copy)
    assert mine.run([[1, 2, 3]]) == theirs.run([[1, 2, 3]])
    assert len(set(mine.group(0, list(range(1, NUM_BLOCKS))))) == NUM_BLOCKS - 1
    assert mine.group(0, [0, 5])[0] == 0  # the null block is no block
    for layer in caches.values():  # a single element changed, in each layer, in either half (K, V)
        for index in (
            ((5, 0, 0, 0), (5, 1, 7, 31)) if layout == "blocks_first" else ((0, 5, 0, 0), (1, 5, 7, 31))
        ):
            before = mine.group(0, [5])
            saved = layer[index].clone()
            layer[index] = saved + 1
            assert mine.group(0, [5]) != before
            layer[index] = saved
            assert mine.group(0, [5]) == before


def test_swapped_blocks_or_layers_change_the_digests():
    caches = _caches("blocks_first")
    d = _digester(caches)
    before = d.group(0, [3, 4])
    swapped = _digester(
        {"layer.0": caches["layer.1"], "layer.1": caches["layer.0"], "layer.2": caches["layer.2"]}
    )
    assert swapped.group(0, [3, 4]) != before
    assert d.group(0, [4, 3]) == before[::-1]


def test_weights_are_odd_and_fixed():
    w = layer_weights(2, 64)
    assert bool((w & 1).all()) and torch.equal(w, layer_weights(2, 64))
    assert not torch.equal(w, layer_weights(3, 64))


def test_a_group_digests_only_its_own_layers():
    caches = _caches("blocks_first")
    d = _digester(caches, [["layer.0", "layer.1"], ["layer.2"]])
    before = d.run([[6], [6]])
    caches["layer.2"][6] += 1
    after = d.run([[6], [6]])
    assert after[0] == before[0] and after[1] != before[1]


def test_corrupting_a_block_changes_its_digest_and_no_other():
    d = _digester(_caches("kv_first"))
    before = d.run([[2, 3, 4]])
    d.corrupt(0, 3)
    after = d.run([[2, 3, 4]])
    assert after[0][0] == before[0][0] and after[0][2] == before[0][2] and after[0][1] != before[0][1]


def _retained(handle: str, tail: bool = True) -> KvloopBlocksRetained:
    return KvloopBlocksRetained(
        block_hashes=[b"a" * 32, b"b" * 32],
        block_ids=[[4, 5], [0, 6]],
        retention_handle=handle,
        lease_ms=1000,
        single_use=False,
        tail_token_ids=[1, 2] if tail else [],
        tail_block_ids=[7, 8] if tail else [],
    )


def test_a_run_is_announced_once_every_rank_reported_its_digests():
    sent: list = []
    gate = DigestGate(sent.append, ranks=2)
    gate.emit(_retained("r1"))
    assert sent == []
    (ask,) = gate.take_asks().values()
    assert ask.block_ids == [[4, 5, 7], [0, 6, 8]] and ask.tail
    gate.digested({"r1": {0: [[1, 2, 3], [0, 4, 5]]}})
    assert sent == []  # rank 1 has not reported
    gate.digested({"r1": {1: [[6, 7, 8], [0, 9, 10]]}})
    (event,) = sent
    digests = block_digests.unpack(event.block_digests)
    assert (digests.ranks, digests.groups, digests.positions) == (2, 2, 3)
    assert digests.of(1, 1, 2) == 10
    assert gate.held == 0


def test_a_run_released_before_its_digests_is_never_announced_nor_released():
    sent: list = []
    gate = DigestGate(sent.append, ranks=1)
    gate.emit(_retained("r1"))
    gate.emit(KvloopRetentionReleased(retention_handle="r1", reason="yielded"))
    gate.digested({"r1": {0: [[1, 2, 3], [0, 4, 5]]}})
    assert sent == [] and gate.take_asks() == {}
    other = KvloopRetentionReleased(retention_handle="r2")
    gate.emit(other)
    assert sent == [other]  # not held: passed on


def test_digests_that_do_not_fit_the_run_announce_it_unchecked():
    sent: list = []
    gate = DigestGate(sent.append, ranks=1)
    gate.emit(_retained("r1"))
    gate.digested({"r1": {0: [[1, 2, 3], [4]]}})
    (event,) = sent
    assert event.block_digests == b""


def _holder(digests: bytes, epoch: int = 1) -> HolderInfo:
    return HolderInfo(
        worker_id="decode-0",
        engine_id="decode-0",
        host="h",
        port=1,
        http_endpoint="",
        retention_handle="r1",
        block_ids=((4, 5),),
        expires_in_ms=1000,
        single_use=False,
        tp_size=1,
        tail_block_ids=(7,),
        holder_epoch=epoch,
        block_digests=digests,
    )


def test_a_read_matching_the_holders_digests_passes_and_one_changed_block_fails():
    holder_caches, puller_caches = _caches("blocks_first", 1), _caches("blocks_first", 2)
    holder, puller = _digester(holder_caches), _digester(puller_caches)
    blob = block_digests.pack([holder.run([[4, 5, 7]])])
    for name, cache in holder_caches.items():  # the READ: holder blocks 5, 7 land in local 10, 11
        puller_caches[name][[10, 11]] = cache[[5, 7]]
    checks = ReadChecks()
    check = PullCheck(blob, ((4, 5),), (7,))
    checks.expect({"q1": check, "q2": check, "q3": check})
    checks.paired("q1", 0, [[(10, 5), (11, 7)]])
    assert checks.check("q1", puller) == VERIFY_PASSED
    puller_caches["layer.1"][11, 0, 0, 0] += 1
    checks.paired("q2", 0, [[(10, 5), (11, 7)]])
    assert checks.check("q2", puller) == VERIFY_FAILED
    checks.paired("q3", 0, None)  # a layout the check does not cover
    assert checks.check("q3", puller) == VERIFY_UNCHECKED
    assert checks.take_found() == {"q1": VERIFY_PASSED, "q2": VERIFY_FAILED, "q3": VERIFY_UNCHECKED}
    assert checks.check("q4", puller) is None  # no check asked for


def test_reads_from_two_holder_ranks_into_one_request_are_not_checked():
    puller = _digester(_caches("blocks_first"))
    blob = block_digests.pack([puller.run([[4, 5, 7]])])
    checks = ReadChecks()
    checks.expect({"q": PullCheck(blob, ((4, 5),), (7,))})
    checks.paired("q", 0, [[(4, 4)]])
    checks.paired("q", 1, [[(5, 5)]])
    assert checks.check("q", puller) == VERIFY_UNCHECKED


@pytest.mark.parametrize("share, checked", [(1.0, 8), (0.25, 2), (0.0, 0)])
def test_the_share_of_pulls_checked_is_exact(share, checked):
    verifier = PullVerifier(share)
    blob = block_digests.pack([[[1, 2, 3]]])
    assert sum(verifier.check_for(_holder(blob)) is not None for _ in range(8)) == checked


def test_a_holder_that_failed_a_check_is_not_read_until_it_registers_anew():
    verifier = PullVerifier(1.0)
    holder = _holder(block_digests.pack([[[1, 2, 3]]]), epoch=5)
    assert verifier.refuses(holder) is None
    verifier.checked(holder, VERIFY_PASSED)
    assert verifier.refuses(holder) is None
    verifier.checked(holder, VERIFY_FAILED)
    assert "failed its digest check" in (verifier.refuses(holder) or "")
    assert verifier.refuses(_holder(b"", epoch=6)) is None  # registered anew
    assert verifier.refuses(holder) is None


def test_a_holder_without_digests_is_pulled_unchecked():
    assert PullVerifier(1.0).check_for(_holder(b"")) is None


def test_a_fault_fires_for_its_share_of_runs_taken_evenly():
    switch = FaultSwitch(device=0.5)
    assert [switch.fires("device") for _ in range(4)] == [False, True, False, True]
    assert not any(switch.fires("host") for _ in range(4))


def test_a_fault_file_turns_faults_on_and_off_in_a_running_engine(tmp_path, monkeypatch):
    from kvloop.agents.connector import faults

    monkeypatch.setattr(faults, "_RECHECK_S", 0.0)
    path = tmp_path / "faults"
    switch = FaultSwitch(path=str(path))
    assert not switch.fires("device")  # no file yet: nothing fires
    path.write_text("device=1 host=0.5\n")
    assert switch.fires("device") and switch.fires("device")
    assert [switch.fires("host") for _ in range(2)] == [False, True]
    path.write_text("device=0 host=bogus\n")
    os.utime(path, (1, 1))  # a new mtime, however fast the rewrite
    assert not switch.fires("device")
    assert switch.shares["host"] == 0.5  # an unreadable share leaves the last one


def test_a_run_whose_digests_never_come_is_announced_unchecked():
    sent: list = []
    gate = DigestGate(sent.append, ranks=1, wait_s=0.0)
    gate.emit(_retained("r1"))
    assert gate.take_asks()  # the first step asks the worker
    assert sent == []
    gate.take_asks()  # the next step: overdue
    (event,) = sent
    assert event.retention_handle == "r1" and event.block_digests == b"" and gate.held == 0
