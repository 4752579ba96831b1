"""The in-memory index of retained runs: a tree of chains, not an entry per block.

Every retained run starts at the first block of its sequence and block hashes are chained (a block's
hash covers every block before it), so two runs that agree on block i agree on every block before
it: the runs of a namespace form a tree. Each node is a stretch of chain that the same runs hold
(its blocks' keys concatenated in one buffer), each run is a path from a root to the node where it
ends, and a node knows the runs that pass through it (ids in announcement order, as a dict).

What that buys: announcing or releasing a run of n blocks costs a walk down its path (one dict
probe and one key comparison per node, and a binary search where the run leaves the tree), not n
dict operations; a lookup walks the prompt's path the same way and judges only the runs that reach
furthest. A conversation's turns extend one another, so paths are a few nodes deep (a shared system
prompt, then a node per turn) whatever the prompt's length.
"""

from __future__ import annotations

from collections.abc import Iterator


class Node:
    """Blocks [start, start + len(keys) // width) of a chain, and the runs holding all of them."""

    __slots__ = ("children", "keys", "runs", "start")

    def __init__(self, start: int, keys: bytes, runs: dict[int, None]) -> None:
        self.start = start
        self.keys = keys
        self.runs = runs
        self.children: dict[bytes, Node] = {}  # the first key of each child's stretch -> the child


def common(keys: bytes, other: bytes, at: int, m: int, w: int) -> int:
    """Leading blocks (at most ``m``) that ``keys`` shares with ``other``'s blocks from ``at`` on,
    given that the first agrees: chained hashes make equality at block i imply it before i, so the
    last is compared first (the usual case: all agree) and a binary search finds the end otherwise."""
    end = at + m
    # keys.startswith(key, offset): one slice a probe, compared in place
    if keys.startswith(other[(end - 1) * w : end * w], (m - 1) * w):
        return m
    lo, hi = 0, m - 2
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if keys.startswith(other[(at + mid) * w : (at + mid + 1) * w], mid * w):
            lo = mid
        else:
            hi = mid - 1
    return lo + 1


class Chains:
    """The runs of one namespace (one model and LoRA), keyed by their blocks' keys of one width."""

    __slots__ = ("roots", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self.roots: dict[bytes, Node] = {}  # first block's key -> the node starting there

    def insert(self, rid: int, keys: bytes, n: int) -> None:
        """Add run ``rid`` holding the ``n`` blocks whose keys ``keys`` concatenates; ``rid`` must be
        above every id inserted before it (the nodes keep their runs in announcement order)."""
        w = self.width
        first = keys[:w]
        node = self.roots.get(first)
        if node is None:
            self.roots[first] = Node(0, keys, {rid: None})
            return
        pos = 0
        while True:
            seg = len(node.keys) // w
            c = common(node.keys, keys, pos, min(seg, n - pos), w)
            if c < seg:
                _split(node, c, w)
            node.runs[rid] = None
            pos += c
            if pos == n:
                return
            key = keys[pos * w : (pos + 1) * w]
            child = node.children.get(key)
            if child is None:
                node.children[key] = Node(pos, keys[pos * w :], {rid: None})
                return
            node = child

    def remove(self, rid: int, keys: bytes, n: int) -> None:
        """Drop run ``rid`` (inserted with these keys): nodes no run holds any more go, and a node
        whose only child holds the same runs absorbs it, so paths stay as short as the runs need."""
        w = self.width
        path: list[Node] = []
        node = self.roots.get(keys[:w])
        while node is not None:
            del node.runs[rid]
            path.append(node)
            pos = node.start + len(node.keys) // w
            if pos >= n:
                break
            node = node.children.get(keys[pos * w : (pos + 1) * w])
        while path and not path[-1].runs:
            dead = path.pop()
            del (path[-1].children if path else self.roots)[dead.keys[:w]]
        for node in reversed(path):
            if len(node.children) == 1:
                (child,) = node.children.values()
                if len(child.runs) == len(node.runs):  # no run ends at node
                    node.keys += child.keys
                    node.children = child.children
                    node.runs = child.runs

    def walk(self, data: bytes, n: int) -> list[tuple[Node, int]]:
        """The nodes on the path of a prompt (``n`` blocks of keys ``data``, this width), root first,
        each with how far the prompt agrees with the chain by its end (blocks from block 0)."""
        w = self.width
        node = self.roots.get(data[:w])
        levels: list[tuple[Node, int]] = []
        pos = 0
        while node is not None:
            seg = len(node.keys) // w
            c = common(node.keys, data, pos, min(seg, n - pos), w)
            pos += c
            levels.append((node, pos))
            if c < seg or pos == n:
                break
            node = node.children.get(data[pos * w : (pos + 1) * w])
        return levels

    def holding(self, key: bytes) -> Iterator[int]:
        """Ids of the runs holding a block of this key (each once), in announcement order: a scan of
        every node, for the directory's debugging call (FindBlock), not for the request path."""
        w = self.width
        found: dict[int, None] = {}
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            at = node.keys.find(key)
            while at != -1 and at % w:  # a match across two blocks' bytes is not a block
                at = node.keys.find(key, at + 1)
            if at != -1:
                found.update(node.runs)
        return iter(sorted(found))


def _split(node: Node, c: int, w: int) -> None:
    """Cut ``node`` after its first ``c`` blocks; its runs hold both parts."""
    tail = Node(node.start + c, node.keys[c * w :], dict(node.runs))
    tail.children = node.children
    node.keys = node.keys[: c * w]
    node.children = {tail.keys[:w]: tail}
