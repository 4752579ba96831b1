"""The digest blob a retained run's announcement carries (common/block_digests.py)."""

from __future__ import annotations

import pytest

from kvloop.common import block_digests as bd


def _run(ranks: int = 2, groups: int = 2, positions: int = 3) -> list[list[list[int]]]:
    return [
        [[1000 * r + 100 * g + p + 1 for p in range(positions)] for g in range(groups)] for r in range(ranks)
    ]


def test_a_blob_reads_back_per_rank_group_and_position():
    digests = bd.unpack(bd.pack(_run()))
    assert (digests.ranks, digests.groups, digests.positions) == (2, 2, 3)
    assert digests.of(1, 0, 2) == 1003 and digests.of(0, 1, 0) == 101


def test_digests_by_block_id_follow_the_run_and_its_tail():
    digests = bd.unpack(bd.pack(_run(ranks=1, groups=2, positions=3)))
    # two complete blocks and a tail; group 1 freed its first block (null block 0)
    by_id = bd.by_block_id(digests, 0, [[7, 8], [0, 9]], tail_block_ids=[11, 12])
    assert by_id == [{7: 1, 8: 2, 11: 3}, {9: 102, 12: 103}]
    # a prefix of the run (no tail): the same positions
    assert bd.by_block_id(digests, 0, [[7], [0]]) == [{7: 1}, {}]


@pytest.mark.parametrize(
    "rank, ids",
    [(1, [[7], [8]]), (0, [[7]]), (0, [[1, 2, 3, 4], [5, 6, 7, 8]])],
    ids=["another_rank", "another_group_count", "longer_than_the_run"],
)
def test_digests_that_do_not_cover_the_run_check_nothing(rank, ids):
    digests = bd.unpack(bd.pack(_run(ranks=1, groups=2, positions=3)))
    assert bd.by_block_id(digests, rank, ids) is None


def test_a_run_is_checked_against_its_blob():
    blob = bd.pack(_run(ranks=1, groups=2, positions=3))
    bd.check_run(blob, num_groups=2, blocks=2, has_tail=True)
    bd.check_run(blob, num_groups=2, blocks=3, has_tail=False)
    with pytest.raises(ValueError, match="2 groups x 3 positions; the run has 2 groups x 4"):
        bd.check_run(blob, num_groups=2, blocks=3, has_tail=True)
    with pytest.raises(ValueError, match="the run has 1 groups"):
        bd.check_run(blob, num_groups=1, blocks=3, has_tail=False)


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"\x01\x01", "shorter than its 8-byte header"),
        (bd.pack(_run())[:-1], "its header"),
        (b"\x02" + bd.pack(_run())[1:], "version 2"),
        (bd.pack([]), "its header"),
    ],
    ids=["short", "truncated", "version", "no_ranks"],
)
def test_a_malformed_blob_is_refused_with_what_is_wrong(blob, message):
    with pytest.raises(ValueError, match=message):
        bd.header(blob)


def test_ragged_digests_are_not_packed():
    with pytest.raises(ValueError, match="a digest per position"):
        bd.pack([[[1, 2], [3]]])
