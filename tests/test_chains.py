"""The in-memory index's tree of chains (daemon/index/chains.py) against a plain list of runs: every
walk finds, per node on the prompt's path, the runs that reach exactly as far as the prompt agrees
with them, and the tree stays compact (no empty node, no node whose one child holds the same runs)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.daemon.index.chains import Chains, Node

W = 8
TRUNKS = [[bytes([t, i]) * 4 for i in range(20)] for t in range(3)]


def run_keys(trunk: int, keep: int, tail: int, name: int) -> list[bytes]:
    """``keep`` blocks of a trunk, then ``tail`` blocks of the run's own."""
    return TRUNKS[trunk][:keep] + [bytes([9, name, i, 0]) * 2 for i in range(tail)]


def common_blocks(a: list[bytes], b: list[bytes]) -> int:
    m = 0
    while m < min(len(a), len(b)) and a[m] == b[m]:
        m += 1
    return m


def check_compact(chains: Chains) -> None:
    stack = [(node, None) for node in chains.roots.values()]
    while stack:
        node, parent = stack.pop()
        assert node.runs, "a node no run holds"
        if parent is not None:
            assert set(node.runs) <= set(parent.runs)
        if len(node.children) == 1:
            (child,) = node.children.values()
            assert len(child.runs) < len(node.runs), "a node whose one child holds the same runs"
        stack.extend((child, node) for child in node.children.values())


def reach(levels: list[tuple[Node, int]]) -> dict[int, int]:
    """Each run on the path, with how far the prompt agrees with it."""
    out: dict[int, int] = {}
    for node, agreed in levels:
        for rid in node.runs:
            out[rid] = agreed  # deeper nodes overwrite: the run reaches there
    return out


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 20), st.integers(0, 6)),
        st.tuples(st.just("drop"), st.integers(0, 30)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, trunk=st.integers(0, 2), length=st.integers(1, 20))
def test_walks_agree_with_a_plain_list_of_runs(ops, trunk, length):
    chains = Chains(W)
    runs: dict[int, list[bytes]] = {}
    next_id = 1
    for op in ops:
        if op[0] == "add":
            _, t, keep, tail = op
            keys = run_keys(t, keep, tail, next_id)
            if not keys:
                continue
            chains.insert(next_id, b"".join(keys), len(keys))
            runs[next_id] = keys
            next_id += 1
        elif runs:
            rid = sorted(runs)[op[1] % len(runs)]
            keys = runs.pop(rid)
            chains.remove(rid, b"".join(keys), len(keys))
        check_compact(chains)
    prompt = TRUNKS[trunk][:length]
    found = reach(chains.walk(b"".join(prompt), len(prompt)))
    expected = {rid: common_blocks(keys, prompt) for rid, keys in runs.items()}
    assert found == {rid: m for rid, m in expected.items() if m}
    for rid in runs:  # FindBlock's scan
        key = runs[rid][0]
        assert rid in chains.holding(key)
    for rid in list(runs):
        keys = runs.pop(rid)
        chains.remove(rid, b"".join(keys), len(keys))
    assert not chains.roots
