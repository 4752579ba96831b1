"""Whether one worker's KV can be READ into another's: the layout each states (parallelism, KV dtype,
bytes per block, KV-cache groups) and vLLM's NIXL connector's rules, as a store lookup's ``accept``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import msgspec

from kvloop.daemon.index.model import WorkerSpec


class KvLayout(msgspec.Struct, frozen=True, gc=False):
    """What decides whether one worker's KV can be READ into another's (0 / "" / (): unknown).

    Each Lookup's layout is a key of the acceptor cache: a frozen msgspec struct, hashed in C."""

    tensor_parallel_size: int = 0
    pipeline_parallel_size: int = 0
    kv_dtype: str = ""
    kv_bytes_per_block: int = 0
    # Sliding window in tokens of each KV-cache group, in vLLM's group order (0: full attention).
    kv_group_windows: tuple[int, ...] = ()

    @classmethod
    def of(cls, spec: WorkerSpec) -> KvLayout:
        tp, pp, _, _ = spec.parallel
        return cls(tp, pp, spec.kv_dtype, spec.kv_bytes_per_block, tuple(spec.kv_group_windows))


UNKNOWN_LAYOUT = KvLayout()


def layout_mismatch(holder: KvLayout, puller: KvLayout) -> str | None:
    """Why vLLM's NIXL connector cannot READ the holder's KV into the puller (None: it can).

    Its rules (vllm 0.32 ``TransferTopology.tp_ratio`` and the NIXL worker's handshake checks): one TP
    size must divide the other; the element types must agree; the KV-cache groups must be the same
    ones (a block id is read into the same group on the other side, and a sliding-window group only
    holds its window). With equal TP sizes the bytes per block must agree too (a different
    model or KV layout); across TP sizes a rank holds a share of the heads, so they are not compared.
    """
    if holder.kv_dtype and puller.kv_dtype and holder.kv_dtype != puller.kv_dtype:
        return f"KV dtype {holder.kv_dtype} cannot be read into {puller.kv_dtype}"
    hg, pg = holder.kv_group_windows, puller.kv_group_windows
    if hg and pg and hg != pg:
        return f"KV-cache groups differ (sliding windows {list(hg)} on the holder, {list(pg)} on the puller)"
    htp, ptp = holder.tensor_parallel_size, puller.tensor_parallel_size
    if htp and ptp and max(htp, ptp) % min(htp, ptp):
        return f"tensor-parallel sizes {htp} (holder) and {ptp} (puller) do not divide each other"
    hpp, ppp = holder.pipeline_parallel_size, puller.pipeline_parallel_size
    if hpp and ppp and hpp != ppp:
        return f"pipeline-parallel sizes {hpp} (holder) and {ppp} (puller) differ"
    hb, pb_ = holder.kv_bytes_per_block, puller.kv_bytes_per_block
    if htp == ptp and hb and pb_ and hb != pb_:
        return f"a block is {hb} bytes on the holder and {pb_} bytes on the puller at the same TP size"
    return None


class _ReadableInto:
    """A store lookup's ``accept``: whether a holder's KV can be READ into the puller's layout.

    The verdict is kept per holder spec: a worker's layout changes only when it registers again,
    which makes a new spec object (kept here, so its id is not reused while its verdict is)."""

    __slots__ = ("_puller", "_verdicts")

    def __init__(self, puller: KvLayout) -> None:
        self._puller = puller
        self._verdicts: dict[int, tuple[WorkerSpec, bool]] = {}

    def __call__(self, spec: WorkerSpec) -> bool:
        seen = self._verdicts.get(id(spec))
        if seen is not None and seen[0] is spec:
            return seen[1]
        readable = layout_mismatch(KvLayout.of(spec), self._puller) is None
        if len(self._verdicts) >= _MAX_VERDICTS:  # workers re-registering over a long life
            self._verdicts.clear()
        self._verdicts[id(spec)] = (spec, readable)
        return readable


_MAX_VERDICTS = 4096


@functools.lru_cache(maxsize=256)
def readable_into(puller: KvLayout) -> Callable[[WorkerSpec], bool] | None:
    """The ``accept`` of a puller's lookups, one per layout a puller states; None when it states
    none (every check needs both sides' values, so every holder passes)."""
    if puller == UNKNOWN_LAYOUT:
        return None
    return _ReadableInto(puller)
