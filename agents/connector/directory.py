"""Where the prefill side asks which peer holds the longest prefix.

``BlockDirectory`` is the seam the scheduler depends on; :class:`GrpcBlockDirectory` implements it
with kvloopd's ``Directory.Lookup`` (the directory's rules live in kvloopd only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from kvloop.agents.connector import telemetry as tm


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
    # The run's partly filled last block (only when the match is the holder's whole run): the
    # token ids it holds KV for, and its block id per group.
    tail_token_ids: tuple[int, ...] = ()
    tail_block_ids: tuple[int, ...] = ()


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


class GrpcBlockDirectory:
    """kvloopd's ``Directory.Lookup`` through the shared typed client, with a short deadline.

    Hashes go packed and block ids come back packed (no per-hash objects on either side). TLS and
    the bearer token come from the client's defaults (``KVLOOP_TOKEN``). Any error (deadline,
    unavailable, bad answer) returns None, and after a failure lookups are skipped for
    ``backoff_s`` so a dead daemon costs one timeout, not one per request.
    """

    inline = False

    def __init__(self, target: str, timeout_ms: float = 20.0, backoff_s: float = 2.0) -> None:
        from kvloop.clients.client import DirectoryClient, decision_reason_name
        from kvloop.v1 import directory_pb2

        self._pb = directory_pb2
        self._reason_name = decision_reason_name
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
            resp = self._client.lookup(
                model,
                b"".join(block_hashes),
                local_blocks=local_blocks,
                requester=requester,
                claim=True,
                lora_name=lora_name,
                block_size=block_size,
                pack_block_ids=True,
            )
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
        except Exception as e:
            tm.LOOKUP_ERRORS.labels("bad_response").inc()
            tm.log.warning("kvloop.lookup_bad_response", error=repr(e))
            return None

    def _convert(self, resp) -> LookupResult:
        pb = self._pb
        reason = self._reason_name(resp.reason)
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
        tail_token_ids=tuple(h.tail_token_ids),
        tail_block_ids=tuple(h.tail_block_ids),
    )
