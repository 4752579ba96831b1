"""The prefill side's calls to kvloopd: ``Lookup`` with the puller's constraints, ``ReleaseClaim``.

The directory's rules live in kvloopd only (``Policy.answer``): this module states what the puller
needs (its minimum pull, its lease margin, its KV layout), and converts the answer into plain
values the scheduler applies. Path and reason stay the proto's enum values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from kvloop.agents.connector import telemetry as tm
from kvloop.clients.directory_client import DirectoryClient, KvloopError, holder_block_ids
from kvloop.common.outcomes import tier_name
from kvloop.v1 import directory_pb2 as pb


@dataclass(frozen=True)
class HolderInfo:
    worker_id: str
    engine_id: str
    host: str
    port: int
    http_endpoint: str
    retention_handle: str
    # Physical block ids per KV-cache group for blocks [0, matched_blocks) (at least).
    block_ids: tuple[tuple[int, ...], ...]
    expires_in_ms: int
    single_use: bool
    tp_size: int  # the holder's tensor-parallel size (0: not registered)
    # The run's partly filled last block (only when the match is the holder's whole run): the
    # token ids it holds KV for, and its block id per group.
    tail_token_ids: tuple[int, ...] = ()
    tail_block_ids: tuple[int, ...] = ()
    # The directory epoch the handle was minted under (LookupResponse.directory_epoch).
    directory_epoch: int = 0
    # The holder's registration epoch the run was announced under: its agent registers a new one
    # when the engine process behind it ended (another process's KV then sits at these block ids).
    holder_epoch: int = 0
    # Where the run lives on the holder: "device" (its KV cache) or "host" (its host-memory pool, whose
    # engine id, side channel and slot ids engine_id, host, port and block_ids then are).
    tier: str = "device"
    # The holder engine's KV-cache registration generation the run was retained under (vLLM >= 0.33;
    # forwarded to vLLM as remote_registration_generation).
    registration_generation: int = 0
    # The run's block digests (common/block_digests.py), whole-run; empty when the holder sent none.
    block_digests: bytes = b""


@dataclass(frozen=True)
class LookupAnswer:
    path: int  # pb.TurnPath
    reason: int  # pb.DecisionReason
    matched_blocks: int  # what the best holder serves, pulled or not
    holder: HolderInfo | None
    detail: str
    # Where it came from: "lookup" (the RPC), "route_plan" or "continuation_plan" (plans.py)
    source: str = "lookup"
    # perf_counter when the Lookup was sent: the holder's expires_in_ms counts from no earlier, so a
    # READ deadline taken from here is never later than the directory meant, however long the answer
    # waited for the engine loop. None: expires_in_ms counts from when the answer is used (plans.py
    # takes the time a plan waited off it).
    asked_at: float | None = None


@dataclass(frozen=True)
class PullerConstraints:
    """What this engine tells the directory with every lookup."""

    model: str
    requester: str
    block_size: int
    min_pull_tokens: int
    lease_margin_ms: int
    tensor_parallel_size: int
    kv_dtype: str
    kv_bytes_per_block: int
    kv_group_windows: tuple[int, ...] = ()


def holder_from_proto(h: pb.Holder, directory_epoch: int = 0) -> HolderInfo:
    host, _, port = h.nixl_endpoint.rpartition(":")
    num_groups = max(1, int(h.num_groups))
    ids = holder_block_ids(h)
    if len(ids) % num_groups:
        raise ValueError(f"block_ids ({len(ids)}) not divisible by num_groups ({num_groups})")
    per = len(ids) // num_groups
    if per < h.matched_blocks:
        raise ValueError(f"{per} block ids per group for {h.matched_blocks} matched blocks")
    return HolderInfo(
        worker_id=h.worker_id,
        engine_id=h.engine_id,
        host=host,
        port=int(port),
        http_endpoint=h.http_endpoint,
        retention_handle=h.retention_handle,
        block_ids=tuple(tuple(ids[g * per : (g + 1) * per]) for g in range(num_groups)),
        expires_in_ms=int(h.expires_in_ms),
        single_use=h.single_use,
        tp_size=int(h.tensor_parallel_size),
        tail_token_ids=tuple(h.tail_token_ids),
        tail_block_ids=tuple(h.tail_block_ids),
        directory_epoch=directory_epoch,
        holder_epoch=int(h.epoch),
        tier=tier_name(h.tier),
        registration_generation=int(h.registration_generation),
        block_digests=bytes(h.block_digests),
    )


def answer_from_proto(resp: pb.LookupResponse, asked_at: float | None = None) -> LookupAnswer:
    holder = (
        holder_from_proto(resp.holder, resp.directory_epoch)
        if resp.HasField("holder") and resp.holder.engine_id
        else None
    )
    if resp.path == pb.TURN_PATH_TRANSFER and (holder is None or resp.matched_blocks == 0):
        raise ValueError("TRANSFER without a holder")
    return LookupAnswer(
        resp.path, resp.reason, int(resp.matched_blocks), holder, resp.detail, asked_at=asked_at
    )


class TracedDirectoryClient(DirectoryClient):
    """A client whose calls carry the caller's W3C trace context (OpenTelemetry's gRPC client
    interceptor, which also records a client span): kvloopd's Lookup span then joins the turn's trace."""

    def _open(self, options: list) -> grpc.Channel:
        from opentelemetry.instrumentation.grpc import client_interceptor
        from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

        return intercept_channel(super()._open(options), client_interceptor())


class DirectoryLookups:
    """kvloopd's ``Lookup`` through the shared typed client, with a short deadline.

    Hashes go packed and block ids come back packed (no per-hash objects on either side). TLS and
    the bearer token come from the client's defaults (``KVLOOP_TOKEN``). Any error (deadline,
    unavailable, bad answer) returns None, and after a failure lookups are skipped for
    ``backoff_s`` so a dead daemon costs one timeout, not one per request. With ``traced`` each call
    carries the current trace context (the caller makes the turn's span current).
    """

    def __init__(
        self,
        target: str,
        constraints: PullerConstraints,
        timeout_ms: float = 20.0,
        backoff_s: float = 0.5,
        traced: bool = False,
    ) -> None:
        self.target = target
        self.constraints = constraints
        self.backoff_s = backoff_s
        client_class = TracedDirectoryClient if traced else DirectoryClient
        self._client = client_class(target, timeout=timeout_ms / 1000.0)
        self._down_until = 0.0
        # The highest directory epoch any answer carried: a handle minted under a lower one came
        # from a store that has failed over since (it may describe blocks freed meanwhile).
        self.epoch = 0

    def stale(self, holder: HolderInfo) -> bool:
        """Whether ``holder``'s handle predates a directory failover this engine has seen."""
        return holder.directory_epoch < self.epoch

    def lookup(
        self, block_hashes: list[bytes], local_blocks: int, lora_name: str = ""
    ) -> LookupAnswer | None:
        """The directory's answer; None when it could not answer (the caller recomputes)."""
        if time.monotonic() < self._down_until:
            tm.LOOKUP_ERRORS.labels("backoff").inc()
            return None
        c = self.constraints
        t0 = time.perf_counter()
        try:
            resp = self._client.lookup(
                c.model,
                b"".join(block_hashes),
                local_blocks=local_blocks,
                requester=c.requester,
                claim=True,
                lora_name=lora_name,
                block_size=c.block_size,
                pack_block_ids=True,
                min_pull_tokens=c.min_pull_tokens,
                lease_margin_ms=c.lease_margin_ms,
                parallel=pb.ParallelLayout(tensor_parallel_size=c.tensor_parallel_size),
                kv_dtype=c.kv_dtype,
                kv_bytes_per_block=c.kv_bytes_per_block,
                kv_group_windows=c.kv_group_windows,
                hash_length=len(block_hashes[0]) if block_hashes else 0,  # vLLM's: one length
            )
        except KvloopError as e:
            self._down_until = time.monotonic() + self.backoff_s
            code = e.code.name if e.code else "error"
            tm.LOOKUP_ERRORS.labels(code.lower()).inc()
            tm.log.warning("kvloop.lookup_failed", target=self.target, code=code, error=str(e))
            return None
        finally:
            tm.LOOKUP_SECONDS.observe(time.perf_counter() - t0)
        self.epoch = max(self.epoch, resp.directory_epoch)
        try:
            return answer_from_proto(resp, asked_at=t0)
        except Exception as e:  # must never break the engine loop
            tm.LOOKUP_ERRORS.labels("bad_response").inc()
            tm.log.warning("kvloop.lookup_bad_response", error=repr(e))
            return None

    def release_claim(self, holder: HolderInfo, lora_name: str = "") -> None:
        """Give back a single-use run this engine was handed but did not read."""
        try:
            released = self._client.release_claim(
                self.constraints.model,
                holder.worker_id,
                holder.retention_handle,
                requester=self.constraints.requester,
                lora_name=lora_name,
                directory_epoch=holder.directory_epoch,
            )
        except KvloopError as e:  # the run stays claimed until its lease ends: safe, only wasteful
            tm.log.warning("kvloop.release_claim_failed", handle=holder.retention_handle, error=str(e))
            return
        tm.CLAIMS_RELEASED.labels(str(released).lower()).inc()

    def close(self) -> None:
        self._client.close()
