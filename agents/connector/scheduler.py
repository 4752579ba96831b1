"""Scheduler-side half of the kvloop connector (runs in vLLM's engine-core process).

Decode role: announce retained runs (``KvloopBlocksRetained``) when a request finishes and their
release (``KvloopRetentionReleased``) when vLLM frees the blocks; mark kvloop-retained runs
multi-reader so the worker keeps them until the lease ends instead of freeing after one READ.

Prefill role: in ``get_num_new_matched_tokens`` ask the directory for the longest prefix a peer
holds, rewrite ``kv_transfer_params`` into a hash-matched NixlConnector reverse pull (truncated
per KV-cache group) and delegate to vLLM; otherwise strip any handle so no peer frees blocks.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.directory import BlockDirectory, HolderInfo, LookupResult
from kvloop.agents.connector.events import (
    KvloopBlocksRetained,
    KvloopPrefillReport,
    KvloopRetentionReleased,
    KvloopTransferReport,
)
from kvloop.common.tokens import agreeing_prefix_length
from kvloop.common.tracing import configure_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# kv_transfer_params keys that make vLLM pull from (and notify) a peer.
HANDLE_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
)
# Private marker: kvloop already decided for this request.
_DECIDED = "_kvloop_decided"


def kv_bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one logical block occupies over all layers of all KV-cache groups on this worker."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        total += group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    return total


@dataclass
class _Retained:
    handle: str
    deadline: float  # perf_counter
    blocks: int


@dataclass
class _Pull:
    span: Span
    matched_tokens: int
    local_tokens: int
    prompt_tokens: int
    holder: str
    holder_engine: str  # NIXL handshakes are per remote engine id
    pulled_tokens: int = 0
    started: float = 0.0
    lookup_ms: float = 0.0
    read_started: float = 0.0
    detail: str = ""  # the directory's why (estimated costs)


class KvloopConnectorScheduler(NixlPullConnectorScheduler):
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        cfg: KvloopConfig,
        directory: BlockDirectory | None,
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # Spans leave this (engine-core) process over OTLP (OTEL_* env) or to KVLOOP_SPAN_FILE.
        configure_tracing(os.environ.get("OTEL_SERVICE_NAME", f"vllm-{engine_id}"))
        self.cfg = cfg
        self.directory = directory
        self.worker_id = cfg.worker_id or engine_id
        self.kv_bytes_per_block = kv_bytes_per_block(kv_cache_config)
        if cfg.retention_ttl_s is not None:
            self.decoder_kv_blocks_ttl = cfg.retention_ttl_s
        self._events: list[Any] = []
        self._retained: dict[str, _Retained] = {}
        self._multi_reader_new: set[str] = set()
        # Prefill role: lease deadline (this process's perf_counter) of each pull, for the worker.
        self._pull_deadlines_new: dict[str, float] = {}
        self._pulls: dict[str, _Pull] = {}
        # Holders this engine has read from: the first READ from a holder also pays the NIXL
        # handshake, which the daemon keeps out of its steady-state cost estimate.
        self._holders_read: set[str] = set()
        # Prefill role: requests computing their prompt themselves -> (decided at, tokens to compute),
        # measured at request_finished for the daemon's prefill tokens/s estimate.
        self._computing: dict[str, tuple[float, int]] = {}
        # Prefill role: each request's kvloop outcome, returned to the caller in kv_transfer_params.
        self._outcomes: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, tuple[Future[LookupResult | None], float]] = {}
        self._lookup_ms = 0.0  # latency of the decision being applied (for spans)
        self._pool: ThreadPoolExecutor | None = None
        if directory is not None and not directory.inline:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvloop-lookup")
        tm.log.info(
            "kvloop.scheduler_init",
            engine_id=engine_id,
            worker_id=self.worker_id,
            nixl_endpoint=f"{self.side_channel_host}:{self.side_channel_port}",
            kv_bytes_per_block=self.kv_bytes_per_block,
            block_size=self.block_size,
            bidirectional=self.is_bidirectional_kv_xfer_enabled,
            retention_ttl_s=self.decoder_kv_blocks_ttl,
            sharing=cfg.sharing,
            directory=type(directory).__name__ if directory else None,
        )

    # ------------------------------------------------------------------ prefill role

    def _wants_kvloop(self, params: dict[str, Any] | None) -> bool:
        return (
            self.directory is not None
            and self.cfg.lookup
            and self.is_bidirectional_kv_xfer_enabled
            and params is not None
            and bool(params.get("do_remote_decode"))
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not self._wants_kvloop(params):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        assert params is not None
        rid = request.request_id
        if params.get("_remote_blocks_processed") or (
            params.get(_DECIDED) and not params.get("remote_block_ids")
        ):
            # Already pulled (or decided not to): a reschedule after preemption computes locally.
            return 0, False
        if params.get(_DECIDED):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

        bs = self.block_size
        n_prompt_blocks = request.num_prompt_tokens // bs
        hashes = [bytes(h) for h in request.block_hashes[:n_prompt_blocks]]
        local_blocks = num_computed_tokens // bs
        result: LookupResult | None
        t0 = time.perf_counter()
        if not hashes:
            result = LookupResult(tm.PATH_MISS, "short_prompt", 0)
        elif self.directory.inline:  # type: ignore[union-attr]
            result = self._lookup(hashes, local_blocks)
        else:
            pending = self._pending.get(rid)
            if pending is None:
                assert self._pool is not None
                fut = self._pool.submit(self._lookup, hashes, local_blocks)
                self._pending[rid] = (fut, t0)
                if self.cfg.lookup_wait_ms:
                    wait([fut], timeout=self.cfg.lookup_wait_ms / 1000)
                if not fut.done():
                    return None, False  # ask again next step; never block the engine loop longer
                pending = self._pending[rid]
            fut, t0 = pending
            if not fut.done():
                return None, False
            del self._pending[rid]
            try:
                result = fut.result()
            except Exception:
                result = None
        params[_DECIDED] = True
        self._lookup_ms = (time.perf_counter() - t0) * 1000
        return self._apply_decision(request, params, num_computed_tokens, result, t0)

    def _lookup(self, hashes: list[bytes], local_blocks: int) -> LookupResult | None:
        assert self.directory is not None
        try:
            return self.directory.lookup(
                hashes,
                local_blocks,
                requester=self.worker_id,
                block_size=self.block_size,
                model=self.cfg.model,
            )
        except Exception as e:
            tm.log.warning("kvloop.lookup_exception", error=repr(e))
            return None

    def _apply_decision(
        self,
        request: Request,
        params: dict[str, Any],
        num_computed_tokens: int,
        result: LookupResult | None,
        t0: float,
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        prompt = request.num_prompt_tokens
        for k in HANDLE_KEYS:  # never act on a handle kvloop did not choose
            params.pop(k, None)
        if result is None:
            self._finish_now(request, tm.PATH_RECOMPUTE, "directory_unavailable", 0, num_computed_tokens)
            return 0, False
        if result.path != tm.PATH_TRANSFER or result.holder is None:
            matched = result.matched_blocks * bs
            self._finish_now(request, result.path, result.reason, matched, num_computed_tokens, result.detail)
            return 0, False
        h = result.holder
        m = result.matched_blocks
        if h.expires_in_ms < self.cfg.expiry_margin_s * 1000:
            self._finish_now(request, tm.PATH_EXPIRED, "lease_too_short", m * bs, num_computed_tokens)
            return 0, False
        if m * bs - num_computed_tokens < max(1, self.cfg.min_pull_tokens):
            path = tm.PATH_LOCAL if m * bs <= num_computed_tokens else tm.PATH_RECOMPUTE
            self._finish_now(request, path, "below_threshold", m * bs, num_computed_tokens)
            return 0, False
        if any(len(g) < m for g in h.block_ids):
            self._finish_now(request, tm.PATH_RECOMPUTE, "short_block_list", m * bs, num_computed_tokens)
            return 0, False
        tail = self._usable_tail(request, h, m)
        params.update(
            remote_block_ids=tuple(
                list(g[:m]) + ([h.tail_block_ids[i]] if tail else []) for i, g in enumerate(h.block_ids)
            ),
            remote_engine_id=h.engine_id,
            remote_request_id=h.retention_handle,
            remote_host=h.host,
            remote_port=h.port,
            remote_num_tokens=m * bs + tail,
            remote_blocks_expiry_time=None,  # expiry checked here from the relative lease
            tp_size=h.tp_size or self.transfer_tp_size,
        )
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not count:
            for k in HANDLE_KEYS:
                params.pop(k, None)
            self._finish_now(request, tm.PATH_RECOMPUTE, "vllm_threshold", m * bs, num_computed_tokens)
            return 0, False
        self._pull_deadlines_new[request.request_id] = time.perf_counter() + h.expires_in_ms / 1000.0
        now = time.perf_counter()
        span = tm.tracer.start_span(
            "kvloop.prefill",
            context=tm.request_context(request),
            start_time=tm.wall_ns(t0),
            attributes={"kvloop.request_id": request.request_id, "kvloop.holder": h.worker_id or h.engine_id},
        )
        tm.child_span(
            span,
            "kvloop.lookup",
            t0,
            t0 + self._lookup_ms / 1000,
            {"kvloop.decision": "transfer", "kvloop.matched_blocks": m},
        )
        self._pulls[request.request_id] = _Pull(
            span=span,
            matched_tokens=min(m * bs + tail, prompt),
            local_tokens=num_computed_tokens,
            prompt_tokens=prompt,
            holder=h.worker_id or h.engine_id,
            holder_engine=h.engine_id,
            started=t0,
            lookup_ms=self._lookup_ms,
            read_started=now,
            detail=result.detail,
        )
        tm.log.debug(
            "kvloop.pull",
            request_id=request.request_id,
            holder=h.engine_id,
            matched_blocks=m,
            local_tokens=num_computed_tokens,
            pull_tokens=count,
        )
        return count, is_async

    def _usable_tail(self, request: Request, holder: HolderInfo, matched_blocks: int) -> int:
        """Tokens of the holder's partly filled last block this prompt can pull as well.

        The directory sends the tail only when it matched every complete block of the run by chained
        hash. KV at position p depends on tokens 0..p only, so the tail's KV is right for this prompt up
        to the first token where the two differ: a turn whose re-rendered answer departs from the tokens
        the decode generated still pulls the tail's agreeing start (the engine computes the rest of
        the block over it). The prompt's last token is always left to compute (vLLM needs one to
        sample from)."""
        tail = holder.tail_token_ids
        start = matched_blocks * self.block_size
        if not tail or len(holder.tail_block_ids) != len(holder.block_ids):
            return 0
        prompt = request.prompt_token_ids or []
        limit = min(len(tail), request.num_prompt_tokens - 1 - start)
        return agreeing_prefix_length(prompt[start : start + limit], tail) if limit > 0 else 0

    def _finish_now(
        self,
        request: Request,
        path: str,
        reason: str,
        matched_tokens: int,
        local_tokens: int,
        detail: str = "",
    ) -> None:
        prompt = request.num_prompt_tokens
        recompute = max(0, prompt - local_tokens)
        outcome = {
            "path": path,
            "reason": reason,
            "detail": detail,
            "matched_tokens": matched_tokens,
            "recompute_tokens": recompute,
            "bytes": 0,
            "holder": "",
            "local_tokens": local_tokens,
            "lookup_ms": round(self._lookup_ms, 3),
        }
        self._outcomes[request.request_id] = outcome
        if recompute > 0:
            self._computing[request.request_id] = (time.perf_counter(), recompute)
        looked_up = time.perf_counter() - self._lookup_ms / 1000
        with tm.tracer.start_as_current_span(
            "kvloop.prefill",
            context=tm.request_context(request),
            start_time=tm.wall_ns(looked_up),
            attributes={"kvloop.request_id": request.request_id},
        ) as span:
            span.set_attributes({f"kvloop.{k}": v for k, v in outcome.items()})
            tm.child_span(
                span,
                "kvloop.lookup",
                looked_up,
                time.perf_counter(),
                {"kvloop.decision": path, "kvloop.reason": reason},
            )
        tm.REQUESTS.labels(path, reason).inc()
        tm.TOKENS.labels("recomputed").inc(recompute)
        tm.TOKENS.labels("local").inc(local_tokens)
        tm.log.info(
            "kvloop.prefill_path",
            request_id=request.request_id,
            path=path,
            reason=reason,
            matched_tokens=matched_tokens,
            recompute_tokens=recompute,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pull = self._pulls.get(request.request_id)
        if pull is not None:
            pull.pulled_tokens = num_external_tokens
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _end_pull(self, req_id: str, failed: bool) -> None:
        pull = self._pulls.pop(req_id, None)
        if pull is None:
            return
        done = time.perf_counter()  # one reading: the outcome, the report and the span agree
        bs = self.block_size
        pulled_blocks = -(-pull.pulled_tokens // bs) if not failed else 0
        nbytes = pulled_blocks * self.kv_bytes_per_block
        if failed:
            path, reason = tm.PATH_FAILED, "read_failed"
            recompute = pull.prompt_tokens - pull.local_tokens
        else:
            path, reason = tm.PATH_TRANSFER, "pulled"
            recompute = pull.prompt_tokens - pull.local_tokens - pull.pulled_tokens
        outcome = {
            "path": path,
            "reason": reason,
            "detail": pull.detail,
            "matched_tokens": pull.matched_tokens,
            "recompute_tokens": recompute,
            "bytes": nbytes,
            "holder": pull.holder,
            "local_tokens": pull.local_tokens,
            "pulled_tokens": 0 if failed else pull.pulled_tokens,
            "lookup_ms": round(pull.lookup_ms, 3),
            "pull_ms": round((done - pull.started) * 1000, 3),
        }
        self._outcomes[req_id] = outcome
        first_contact = pull.holder_engine not in self._holders_read
        if not failed:
            self._holders_read.add(pull.holder_engine)
        if self.cfg.publish_events:
            self._events.append(
                KvloopTransferReport(
                    source_worker_id=pull.holder,
                    bytes=nbytes,
                    blocks=pulled_blocks,
                    duration_us=int((done - pull.read_started) * 1e6),
                    ok=not failed,
                    ts=time.time(),
                    first_contact=first_contact,
                )
            )
        tm.child_span(
            pull.span,
            "kvloop.nixl_read",
            pull.read_started,
            done,
            {
                "kvloop.bytes": nbytes,
                "kvloop.blocks": pulled_blocks,
                "kvloop.holder": pull.holder,
                "kvloop.ok": not failed,
            },
        )
        pull.span.set_attributes({f"kvloop.{k}": v for k, v in outcome.items()})
        pull.span.end()
        tm.REQUESTS.labels(path, reason).inc()
        tm.TOKENS.labels("pulled").inc(0 if failed else pull.pulled_tokens)
        tm.TOKENS.labels("recomputed").inc(recompute)
        tm.TOKENS.labels("local").inc(pull.local_tokens)
        tm.BYTES.inc(nbytes)
        tm.log.info(
            "kvloop.prefill_path",
            request_id=req_id,
            path=path,
            reason=reason,
            holder=pull.holder,
            matched_tokens=pull.matched_tokens,
            pulled_tokens=0 if failed else pull.pulled_tokens,
            recompute_tokens=recompute,
            bytes=nbytes,
            ms=round((time.perf_counter() - pull.started) * 1000, 2),
        )

    # ------------------------------------------------------------------ decode role

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        # Forget a pending lookup or pull of an aborted request.
        self._pending.pop(request.request_id, None)
        if request.request_id in self._pulls:
            self._end_pull(request.request_id, failed=True)
        self._report_prefill(request)
        delay, out = super().request_finished(request, block_ids)
        outcome = self._outcomes.pop(request.request_id, None)
        if outcome is not None and out is not None:
            # What this prefill did, for the caller (a proxy shows it per turn): kvloop_path, ...
            out.update({f"kvloop_{k}": v for k, v in outcome.items()})
        if (
            delay
            and out is not None
            and out.get("do_remote_decode")  # this engine is the holder (reverse direction)
            and self.is_bidirectional_kv_xfer_enabled
        ):
            self._announce(request, out)
        return delay, out

    def _report_prefill(self, request: Request) -> None:
        computing = self._computing.pop(request.request_id, None)
        if computing is None or not self.cfg.publish_events:
            return
        decided, tokens = computing
        if request.num_computed_tokens < request.num_prompt_tokens:  # aborted before its prefill ended
            return
        self._events.append(
            KvloopPrefillReport(
                tokens=tokens, duration_us=int((time.perf_counter() - decided) * 1e6), ts=time.time()
            )
        )

    def _announce(self, request: Request, out: dict[str, Any]) -> None:
        bs = self.block_size
        n = min(len(request.block_hashes), request.num_computed_tokens // bs)
        groups = [list(g) for g in out["remote_block_ids"]]
        n = min([n] + [len(g) for g in groups])
        rid = request.request_id
        deadline = self._reqs_need_send.get(rid, time.perf_counter() + self.decoder_kv_blocks_ttl)
        multi = self.cfg.sharing == "multi"
        self._retained[rid] = _Retained(handle=rid, deadline=deadline, blocks=n)
        if multi:
            self._multi_reader_new.add(rid)
        if n <= 0 or not self.cfg.publish_events:
            return
        lease_ms = max(0, int((deadline - time.perf_counter()) * 1000))
        lora = request.lora_request.lora_name if request.lora_request else None
        # The last sampled token never went through the model: KV exists for the tokens before it.
        with_kv = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
        tail = (
            list(request.all_token_ids[n * bs : with_kv])
            if n == with_kv // bs and all(len(g) > n for g in groups)
            else []
        )
        self._events.append(
            KvloopBlocksRetained(
                block_hashes=[bytes(h) for h in request.block_hashes[:n]],
                block_ids=[g[:n] for g in groups],
                retention_handle=rid,
                lease_ms=lease_ms,
                single_use=not multi,
                engine_id=self.engine_id,
                nixl_host=self.side_channel_host,
                nixl_port=self.side_channel_port,
                block_size=bs,
                num_tokens=n * bs,
                worker_id=self.worker_id,
                lora_name=lora,
                tp_size=self.transfer_tp_size,
                kv_bytes_per_block=self.kv_bytes_per_block,
                ts=time.time(),
                tail_token_ids=tail,
                tail_block_ids=[g[n] for g in groups] if tail else [],
            )
        )
        tm.RETAINED.inc()
        tm.RETAINED_BLOCKS.inc(n)
        tm.log.debug("kvloop.retained", handle=rid, blocks=n, lease_ms=lease_ms, multi=multi)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        failed = connector_output.failed_recving or set()
        for rid in failed:
            self._end_pull(rid, failed=True)
        for rid in connector_output.finished_recving or ():
            if rid not in failed:
                self._end_pull(rid, failed=False)
        now = time.perf_counter()
        for rid in connector_output.finished_sending or ():
            r = self._retained.pop(rid, None)
            if r is None:
                continue
            reason = "expired" if now >= r.deadline - 1.0 else "read"
            tm.RELEASED.labels(reason).inc()
            if self.cfg.publish_events:
                self._events.append(
                    KvloopRetentionReleased(
                        retention_handle=r.handle, reason=reason, worker_id=self.worker_id, ts=time.time()
                    )
                )

    def build_connector_meta(self, scheduler_output):  # type: ignore[override]
        meta = super().build_connector_meta(scheduler_output)
        # Worker-side: keep these runs until the lease ends (multi-reader), see worker.py.
        meta.kvloop_multi_reader = self._multi_reader_new  # type: ignore[attr-defined]
        self._multi_reader_new = set()
        # Worker-side: decline a READ that would start too close to the holder's lease end
        # (e.g. after a slow handshake). Same clock domain as meta.scheduler_clock.
        meta.kvloop_pull_deadlines = self._pull_deadlines_new  # type: ignore[attr-defined]
        self._pull_deadlines_new = {}
        return meta

    def take_events(self) -> list[Any]:
        ev, self._events = self._events, []
        return ev

    def shutdown(self) -> None:
        super().shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.directory is not None:
            self.directory.close()
