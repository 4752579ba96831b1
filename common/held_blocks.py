"""What a content-addressed pool of KV blocks holds, stated once for the connector's host pool
(agents/connector/host/tier.py) and ``kvloop bench replay``'s pools (clients/bench/replay/fleet.py).

A block is held once per key (its chained hash, within a LoRA and a KV-cache group): every run that
holds it names it, a run that needs it while the pool holds it takes nothing more, and the block
leaves the pool with the last run that names it. vLLM's own KV cache and its CPU offload tier hold a
block once per hash the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class HeldBlocks(Generic[K]):
    """The blocks a pool holds (by key) and the runs that name each."""

    def __init__(self) -> None:
        self._refs: dict[K, int] = {}
        self._runs: dict[Hashable, list[K]] = {}

    def __len__(self) -> int:
        """Blocks held: each key once, however many runs name it."""
        return len(self._refs)

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    def missing(self, keys: Iterable[K]) -> list[K]:
        """The distinct keys of ``keys`` the pool does not hold: what a run naming them adds."""
        return [k for k in dict.fromkeys(keys) if k not in self._refs]

    def hold(self, run: Hashable, keys: Iterable[K]) -> list[K]:
        """``run`` names ``keys`` (beside what it named already); the keys newly held."""
        named = self._runs.setdefault(run, [])
        mine = set(named)
        added = []
        for k in keys:
            if k in mine:
                continue
            mine.add(k)
            named.append(k)
            count = self._refs.get(k, 0)
            self._refs[k] = count + 1
            if not count:
                added.append(k)
        return added

    def release(self, run: Hashable) -> list[K]:
        """``run`` names nothing any more; the keys that left the pool with it (no run names them)."""
        left = []
        for k in self._runs.pop(run, ()):
            count = self._refs[k] - 1
            if count:
                self._refs[k] = count
            else:
                del self._refs[k]
                left.append(k)
        return left

    def rekey(self, old: K, new: K) -> None:
        """The block held as ``old`` is held as ``new`` from now on, for every run naming it."""
        if new in self._refs:
            raise ValueError(f"{new!r} is held already")
        self._refs[new] = self._refs.pop(old)
        for named in self._runs.values():
            if old in named:
                named[named.index(old)] = new

    def names(self, run: Hashable) -> list[K]:
        return list(self._runs.get(run, ()))

    def leaving(self, runs: Iterable[Hashable]) -> Leaving:
        """The blocks that would leave the pool with ``runs`` (no run beside them names them), counted
        on as runs are added to them."""
        out = Leaving(self)
        for run in dict.fromkeys(runs):
            out.add(run)
        return out

    def refs(self, key: K) -> int:
        """How many runs name ``key``."""
        return self._refs.get(key, 0)

    def runs(self) -> list[Hashable]:
        return list(self._runs)

    def clear(self) -> None:
        self._refs.clear()
        self._runs.clear()


class Leaving:
    """The blocks that would leave a pool with a set of runs that grows (a pool picking runs to
    release until enough would come free): each run added costs its own blocks, not the set's."""

    def __init__(self, held: HeldBlocks) -> None:
        self._held = held
        self._counts: Counter[Hashable] = Counter()
        self._runs: set[Hashable] = set()
        self.blocks = 0

    def add(self, run: Hashable) -> None:
        if run in self._runs:
            return
        self._runs.add(run)
        for key in self._held.names(run):
            count = self._counts[key] + 1
            self._counts[key] = count
            if count == self._held.refs(key):
                self.blocks += 1
