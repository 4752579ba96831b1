"""common/held_blocks.py: a block is held once per key and leaves with the last run naming it."""

from __future__ import annotations

from kvloop.common.held_blocks import HeldBlocks


def test_a_block_two_runs_name_is_held_once_and_leaves_with_the_last():
    held: HeldBlocks[str] = HeldBlocks()
    assert held.hold("a", ["sys0", "sys1", "a2"]) == ["sys0", "sys1", "a2"]
    assert held.missing(["sys0", "sys1", "b2", "b2"]) == ["b2"]
    assert held.hold("b", ["sys0", "sys1", "b2"]) == ["b2"]
    assert len(held) == 4 and held.leaving(["a"]).blocks == 1 and held.leaving(["b"]).blocks == 1
    both = held.leaving(["a"])
    both.add("b")
    both.add("b")  # a run added twice counts once
    assert both.blocks == held.leaving(["a", "b"]).blocks == 4  # the prompt leaves only with both
    assert held.release("a") == ["a2"]
    assert "sys0" in held and len(held) == 3 and held.leaving(["b"]).blocks == 3
    assert sorted(held.release("b")) == ["b2", "sys0", "sys1"] and len(held) == 0


def test_a_run_naming_more_keys_later_counts_each_once():
    held: HeldBlocks[int] = HeldBlocks()
    held.hold("a", [1, 2])
    assert held.hold("a", [2, 3]) == [3]  # a names 2 already: not twice
    assert held.names("a") == [1, 2, 3]
    held.hold("b", [3])
    assert held.release("a") == [1, 2] and held.release("unknown") == []
    assert held.runs() == ["b"]
