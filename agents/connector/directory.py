"""Where the prefill side asks which peer holds the longest prefix.

``BlockDirectory`` is the seam: the production implementation is :class:`GrpcBlockDirectory`
(kvloopd's ``Directory.Lookup``); :class:`InMemoryBlockDirectory` applies the same rules to
retained events fed to it directly (tests, a single-host setup, or a fake daemon).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased


@dataclass(frozen=True)
class HolderInfo:
    engine_id: str
    host: str
    port: int
    retention_handle: str
    # Physical block ids per KV-cache group for blocks [0, matched_blocks) (at least).
    block_ids: tuple[tuple[int, ...], ...]
    expires_in_ms: int
    single_use: bool = False
    worker_id: str = ""
    # Holder's tensor-parallel size; None = same as the puller (kvloopd's Holder has no TP field:
    # the directory only pairs compatible layouts).
    tp_size: int | None = None
    kv_bytes_per_block: int = 0


@dataclass(frozen=True)
class LookupResult:
    # "transfer" | "recompute" | "local" | "miss" | "expired"
    path: str
    reason: str
    matched_blocks: int
    holder: HolderInfo | None = None
    detail: str = ""


class BlockDirectory(Protocol):
    """Answers "who holds the longest prefix of these chained block hashes"."""

    #: True when lookup() answers without I/O (safe to call inline in the scheduler loop).
    inline: bool

    def lookup(
        self,
        block_hashes: list[bytes],
        local_blocks: int,
        *,
        requester: str = "",
        block_size: int = 0,
        model: str = "",
        lora_name: str = "",
    ) -> LookupResult | None:
        """None means the directory could not answer (the caller recomputes)."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------
# gRPC (kvloopd)
# --------------------------------------------------------------------------------------------

_REASON_NAMES = {
    0: "unspecified",
    1: "miss",
    2: "below_threshold",
    3: "transfer_faster",
    4: "recompute_faster",
    5: "local_prefix",
    6: "expired",
    7: "claimed",
    8: "peer_unavailable",
    9: "disabled",
}


class GrpcBlockDirectory:
    """kvloopd's ``Directory.Lookup`` through the shared typed client, with a short deadline.

    Hashes go packed and block ids come back packed (no per-hash objects on either side). TLS and
    the bearer token come from the client's defaults (``KVLOOP_TOKEN``). Any error (deadline,
    unavailable, bad answer) returns None, and after a failure lookups are skipped for
    ``backoff_s`` so a dead daemon costs one timeout, not one per request.
    """

    inline = False

    def __init__(self, target: str, timeout_ms: float = 20.0, backoff_s: float = 2.0) -> None:
        from kvloop.clients.client import DirectoryClient
        from kvloop.v1 import directory_pb2

        self._pb = directory_pb2
        self.target = target
        self.backoff_s = backoff_s
        self._client = DirectoryClient(target, timeout=timeout_ms / 1000.0)
        self._down_until = 0.0

    def lookup(
        self,
        block_hashes: list[bytes],
        local_blocks: int,
        *,
        requester: str = "",
        block_size: int = 0,
        model: str = "",
        lora_name: str = "",
    ) -> LookupResult | None:
        from kvloop.clients.client import KvloopError

        if time.monotonic() < self._down_until:
            tm.LOOKUP_ERRORS.labels("backoff").inc()
            return None
        t0 = time.perf_counter()
        try:
            resp = self._client.lookup(model, b"".join(block_hashes), local_blocks=local_blocks,
                                       requester=requester, claim=True, lora_name=lora_name,
                                       block_size=block_size, pack_block_ids=True)
        except KvloopError as e:
            self._down_until = time.monotonic() + self.backoff_s
            code = e.code.name if e.code else "error"
            tm.LOOKUP_ERRORS.labels(code.lower()).inc()
            tm.log.warning("kvloop.lookup_failed", target=self.target, code=code, error=str(e))
            return None
        finally:
            tm.LOOKUP_SECONDS.observe(time.perf_counter() - t0)
        try:
            return self._convert(resp)
        except Exception as e:  # noqa: BLE001 - must never break the engine loop
            tm.LOOKUP_ERRORS.labels("bad_response").inc()
            tm.log.warning("kvloop.lookup_bad_response", error=repr(e))
            return None

    def _convert(self, resp) -> LookupResult:
        pb = self._pb
        reason = _REASON_NAMES.get(resp.reason, str(resp.reason))
        holder = None
        if resp.HasField("holder") and resp.holder.engine_id:
            h = resp.holder
            holder = holder_from_proto(h)
        if resp.decision == pb.DECISION_TRANSFER:
            if holder is None or resp.matched_blocks == 0:
                raise ValueError("TRANSFER without a holder")
            path = tm.PATH_TRANSFER
        elif resp.decision == pb.DECISION_LOCAL:
            path = tm.PATH_LOCAL
        elif reason == "miss":
            path = tm.PATH_MISS
        elif reason == "expired":
            path = tm.PATH_EXPIRED
        else:
            path = tm.PATH_RECOMPUTE
        return LookupResult(
            path=path,
            reason=reason,
            matched_blocks=int(resp.matched_blocks),
            holder=holder,
            detail=resp.detail,
        )

    def close(self) -> None:
        self._client.close()


def holder_from_proto(h) -> HolderInfo:
    from kvloop.clients.client import holder_block_ids

    host, _, port = h.nixl_endpoint.rpartition(":")
    num_groups = max(1, int(h.num_groups))
    ids = holder_block_ids(h)
    if len(ids) % num_groups:
        raise ValueError(f"block_ids ({len(ids)}) not divisible by num_groups ({num_groups})")
    per = len(ids) // num_groups
    groups = tuple(tuple(ids[g * per : (g + 1) * per]) for g in range(num_groups))
    return HolderInfo(
        engine_id=h.engine_id,
        host=host,
        port=int(port),
        retention_handle=h.retention_handle,
        block_ids=groups,
        expires_in_ms=int(h.expires_in_ms),
        single_use=h.single_use,
        worker_id=h.worker_id,
        kv_bytes_per_block=int(h.kv_bytes_per_block),
    )


# --------------------------------------------------------------------------------------------
# In-memory (tests / fake daemon)
# --------------------------------------------------------------------------------------------


@dataclass
class _Run:
    ev: KvloopBlocksRetained
    deadline: float  # time.monotonic()
    claimed: bool = False
    index: dict[bytes, int] = field(default_factory=dict)


class InMemoryBlockDirectory:
    """Longest-consecutive-prefix lookup over retained runs fed with :meth:`ingest`.

    Same decision rules kvloopd is expected to apply: a run is servable until its lease ends
    (minus ``expiry_margin_s``), single-use runs are claimed by the first TRANSFER, the caller's
    own worker is never a holder, and pulls below ``min_pull_tokens`` are not worth it.
    """

    inline = True

    def __init__(self, expiry_margin_s: float = 6.0, min_pull_tokens: int = 64) -> None:
        self.expiry_margin_s = expiry_margin_s
        self.min_pull_tokens = min_pull_tokens
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()

    def ingest(self, events: Iterable[object]) -> None:
        now = time.monotonic()
        with self._lock:
            for ev in events:
                if isinstance(ev, KvloopBlocksRetained):
                    self._runs[ev.retention_handle] = _Run(ev=ev, deadline=now + ev.lease_ms / 1000.0)
                elif isinstance(ev, KvloopRetentionReleased):
                    self._runs.pop(ev.retention_handle, None)

    def handles(self) -> set[str]:
        with self._lock:
            return set(self._runs)

    def lookup(
        self,
        block_hashes: list[bytes],
        local_blocks: int,
        *,
        requester: str = "",
        block_size: int = 0,
        model: str = "",
        lora_name: str = "",
    ) -> LookupResult | None:
        now = time.monotonic()
        best: tuple[int, _Run] | None = None
        best_expired = 0
        with self._lock:
            for handle, run in list(self._runs.items()):
                if now >= run.deadline:
                    del self._runs[handle]
                    continue
                if requester and run.ev.worker_id == requester:
                    continue
                if block_size and run.ev.block_size != block_size:
                    continue
                hs = run.ev.block_hashes
                m = 0
                for a, b in zip(hs, block_hashes):
                    if a != b:
                        break
                    m += 1
                if m == 0:
                    continue
                if run.deadline - now < self.expiry_margin_s:
                    best_expired = max(best_expired, m)
                    continue
                if run.claimed:
                    continue
                if best is None or m > best[0] or (m == best[0] and run.deadline > best[1].deadline):
                    best = (m, run)
            if best is None:
                if best_expired > local_blocks:
                    return LookupResult(tm.PATH_EXPIRED, "expired", best_expired)
                return LookupResult(tm.PATH_MISS, "miss", 0)
            m, run = best
            if m <= local_blocks:
                return LookupResult(tm.PATH_LOCAL, "local_prefix", m)
            bs = run.ev.block_size
            if (m - local_blocks) * bs < self.min_pull_tokens:
                return LookupResult(tm.PATH_RECOMPUTE, "below_threshold", m)
            if run.ev.single_use:
                run.claimed = True
            ev = run.ev
            holder = HolderInfo(
                engine_id=ev.engine_id,
                host=ev.nixl_host,
                port=ev.nixl_port,
                retention_handle=ev.retention_handle,
                block_ids=tuple(tuple(g[:m]) for g in ev.block_ids),
                expires_in_ms=int((run.deadline - now) * 1000),
                single_use=ev.single_use,
                worker_id=ev.worker_id,
                tp_size=ev.tp_size,
            )
            return LookupResult(tm.PATH_TRANSFER, "transfer_faster", m, holder)

    def close(self) -> None:
        pass
