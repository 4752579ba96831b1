"""The prefill role of the kvloop connector's scheduler side.

For each request that asks for a disaggregated prefill (``do_remote_decode``), :meth:`PrefillSide.match`
asks kvloopd (off the engine loop) for the longest prefix a peer holds (unless the router's Route
already found none beyond this prefill's own prefix, ``kvloop_route_settled``), and applies the answer:
on TRANSFER it rewrites ``kv_transfer_params`` into a hash-matched NixlConnector reverse pull
(truncated per KV-cache group) and lets vLLM allocate it; otherwise it strips any handle, so no
peer frees blocks nobody read. The READ itself starts in the worker
(``KvloopConnectorWorker._read_blocks_for_req``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from kvloop.agents.connector import compat
from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.compute_time import ComputeTime
from kvloop.agents.connector.config import KvloopConfig
from kvloop.agents.connector.directory import DirectoryLookups, HolderInfo, LookupAnswer
from kvloop.agents.connector.events import KvloopPrefillReport, KvloopTransferReport
from kvloop.agents.connector.metadata import VERIFY_FAILED, PullCheck, ReadTiming
from kvloop.agents.connector.outcome import Outcome, record
from kvloop.agents.connector.plans import PlanInbox
from kvloop.agents.connector.remote_groups import remote_groups
from kvloop.agents.connector.verify import PullVerifier
from kvloop.common.outcomes import path_name
from kvloop.common.route_estimate import PULL_KEY, ROUTE_SETTLED_KEY, SETTLED_REASONS
from kvloop.common.sliding_window import NULL_BLOCK, first_needed_block
from kvloop.common.tokens import agreeing_prefix_length
from kvloop.v1 import directory_pb2 as pb

if TYPE_CHECKING:
    from opentelemetry.trace import Span
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
    compat.GENERATION_PARAM,
)
# A request's kv_transfer_params may set this to false: no lookup, no reverse pull.
NO_PULL_KEY = PULL_KEY
# Private marker: kvloop already decided for this request.
_DECIDED = "_kvloop_decided"

VllmMatch = Callable[["Request", int], tuple[int | None, bool]]


def _settled_reason(value: Any) -> int | None:
    """The DecisionReason a router's ROUTE_SETTLED_KEY names; anything else (a value from a newer
    router, a typo) is ignored and the connector asks kvloopd as usual."""
    for reason, name in SETTLED_REASONS.items():
        if value == name:
            return reason
    return None


@dataclass
class _Pull:
    span: Span
    outcome: Outcome
    holder: HolderInfo
    prompt_tokens: int
    started: float  # perf_counter at the lookup
    read_started: float = 0.0
    stale: bool = False  # refused before its READ: the directory failed over since the answer


@dataclass
class _Lookup:
    future: Future[LookupAnswer | None]
    started: float
    span: Span  # the turn's kvloop.prefill span, opened when the lookup was sent
    lookup_span: Span  # current while the RPC runs: kvloopd's Lookup span becomes its grandchild


class PrefillSide:
    def __init__(
        self,
        cfg: KvloopConfig,
        directory: DirectoryLookups,
        block_size: int,
        kv_bytes_per_block: int,
        transfer_tp_size: int,
        emit: Callable[[Any], None],
        group_windows: Sequence[int] = (0,),
        group_bytes_per_block: Sequence[int] = (),
        plans: PlanInbox | None = None,
    ) -> None:
        self.cfg = cfg
        # Route's plans for this worker (plans.py): a request one matches needs no Lookup.
        self.plans = plans
        # Per KV-cache group: its sliding window in tokens (0: full attention), and the bytes one
        # block of it occupies over its layers.
        self.group_windows = tuple(group_windows)
        self.group_bytes_per_block = tuple(group_bytes_per_block) or (kv_bytes_per_block,)
        self.directory = directory
        self.block_size = block_size
        self.kv_bytes_per_block = kv_bytes_per_block
        self.transfer_tp_size = transfer_tp_size
        self._emit = emit if cfg.publish_events else (lambda event: None)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvloop-lookup")
        self._lookups: dict[str, _Lookup] = {}
        self._pulls: dict[str, _Pull] = {}
        # Requests computing their prompt here -> (decided at, tokens), for the prefill report, and
        # the engine steps' time charged to them (the report's duration: compute, not queueing).
        self._computing: dict[str, tuple[float, int]] = {}
        self._compute_time = ComputeTime()
        # Each request's recorded outcome, returned to the caller in kv_transfer_params.
        self._outcomes: dict[str, dict[str, Any]] = {}
        # Holders read from, for READs NIXL did not time: the first one from a holder may have paid
        # the NIXL handshake (kept out of the cost model). Timed READs say so themselves.
        self._holders_read: set[str] = set()
        # For the worker: when each new pull's holder lease ends (this process's perf_counter).
        self.pull_deadlines: dict[str, float] = {}
        # ... and the holder's registration epoch the run was announced under.
        self.pull_holder_epochs: dict[str, int] = {}
        # ... and, for the pulls whose READ is checked, the holder's digests (verify.py).
        self.verifier = PullVerifier(cfg.verify_share)
        self.pull_checks: dict[str, PullCheck] = {}

    def wants(self, params: dict[str, Any] | None) -> bool:
        return params is not None and bool(params.get("do_remote_decode"))

    # ---- get_num_new_matched_tokens ----------------------------------------------------------

    def match(
        self, request: Request, num_computed_tokens: int, vllm_match: VllmMatch
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        assert params is not None
        if params.get("_remote_blocks_processed") or (
            params.get(_DECIDED) and not params.get("remote_block_ids")
        ):
            # Already pulled (or decided not to): a reschedule after preemption computes locally.
            return 0, False
        if params.get(_DECIDED):
            return vllm_match(request, num_computed_tokens)
        if params.get(NO_PULL_KEY) is False:
            # The router wants vLLM's own prefix cache only (prefix routing without reverse pulls).
            params[_DECIDED] = True
            declined = LookupAnswer(
                pb.TURN_PATH_LOCAL if num_computed_tokens else pb.TURN_PATH_RECOMPUTE,
                pb.DECISION_REASON_DISABLED,
                0,
                None,
                f"the request set {NO_PULL_KEY}=false",
            )
            return self._apply(
                request, params, num_computed_tokens, declined, time.perf_counter(), vllm_match
            )
        settled = _settled_reason(params.get(ROUTE_SETTLED_KEY))
        if settled is not None:
            # The router's Route found no peer holding more than this prefill's own prefix: a Lookup
            # would find the same, a few milliseconds and possibly an engine step later.
            params[_DECIDED] = True
            if num_computed_tokens:
                path, reason = pb.TURN_PATH_LOCAL, pb.DECISION_REASON_LOCAL_PREFIX
            else:
                path = pb.TURN_PATH_MISS if settled == pb.DECISION_REASON_MISS else pb.TURN_PATH_RECOMPUTE
                reason = settled
            detail = (
                "the router's Route found no peer holding more than this prefill's prefix (asked for this "
                "prompt, or for the history it edited): no Lookup"
            )
            answer_from_route = LookupAnswer(path, reason, 0, None, detail)
            return self._apply(
                request, params, num_computed_tokens, answer_from_route, time.perf_counter(), vllm_match
            )
        bs = self.block_size
        hashes = [bytes(h) for h in request.block_hashes[: request.num_prompt_tokens // bs]]
        lora = request.lora_request.lora_name if request.lora_request else ""
        if not hashes:
            answer: LookupAnswer | None = LookupAnswer(
                pb.TURN_PATH_MISS, pb.DECISION_REASON_SHORT_PROMPT, 0, None, "no full block in the prompt"
            )
            started = time.perf_counter()
        else:
            lookup = self._lookups.get(request.request_id)
            planned = None
            if lookup is None and self.plans is not None:
                planned = self.plans.take(hashes, num_computed_tokens // bs)
            if planned is not None:
                params[_DECIDED] = True
                now = time.perf_counter()
                return self._apply(
                    request, params, num_computed_tokens, planned, now, vllm_match, planned=True
                )
            if lookup is None:
                started = time.perf_counter()
                span = self._start_span(request, started)
                lookup_span = tm.tracer.start_span(
                    "kvloop.lookup", context=trace.set_span_in_context(span), start_time=tm.wall_ns(started)
                )
                future = self._pool.submit(
                    self._lookup_in_span, lookup_span, hashes, num_computed_tokens // bs, lora
                )
                lookup = self._lookups[request.request_id] = _Lookup(future, started, span, lookup_span)
                if self.cfg.lookup_wait_ms:
                    wait([future], timeout=self.cfg.lookup_wait_ms / 1000)
            if not lookup.future.done():
                return None, False  # ask again next step; never block the engine loop longer
            del self._lookups[request.request_id]
            try:
                answer = lookup.future.result()
            except Exception:  # must never break the engine loop
                answer = None
            params[_DECIDED] = True
            return self._apply(
                request, params, num_computed_tokens, answer, lookup.started, vllm_match, lookup
            )
        params[_DECIDED] = True
        return self._apply(request, params, num_computed_tokens, answer, started, vllm_match)

    def _start_span(self, request: Request, started: float) -> Span:
        """The turn's kvloop.prefill span, a child of the caller's trace context (the proxy's)."""
        return tm.tracer.start_span(
            "kvloop.prefill",
            context=tm.request_context(request),
            start_time=tm.wall_ns(started),
            attributes={"kvloop.request_id": request.request_id},
        )

    def _lookup_in_span(
        self, lookup_span: Span, hashes: list[bytes], local_blocks: int, lora: str
    ) -> LookupAnswer | None:
        # Runs in the lookup pool: the span is made current here, where the gRPC call reads it.
        with trace.use_span(lookup_span, end_on_exit=False):
            return self.directory.lookup(hashes, local_blocks, lora)

    def _apply(
        self,
        request: Request,
        params: dict[str, Any],
        num_computed_tokens: int,
        answer: LookupAnswer | None,
        started: float,
        vllm_match: VllmMatch,
        lookup: _Lookup | None = None,
        planned: bool = False,
    ) -> tuple[int | None, bool]:
        answered = time.perf_counter()
        for k in HANDLE_KEYS:  # never act on a handle kvloop did not choose
            params.pop(k, None)
        span = lookup.span if lookup is not None else self._start_span(request, started)
        outcome = Outcome(
            pb.TURN_PATH_RECOMPUTE,
            pb.DECISION_REASON_DIRECTORY_UNAVAILABLE,
            local_tokens=num_computed_tokens,
            lookup_ms=(answered - started) * 1000,
        )
        if answer is not None:
            outcome.path, outcome.reason, outcome.detail = answer.path, answer.reason, answer.detail
            outcome.matched_tokens = answer.matched_blocks * self.block_size
            if answer.holder is not None:
                outcome.holder, outcome.holder_http = answer.holder.worker_id, answer.holder.http_endpoint
        if lookup is not None:
            lookup.lookup_span.set_attribute("kvloop.path", path_name(outcome.path))
            lookup.lookup_span.end(end_time=tm.wall_ns(answered))
        else:
            attributes = {"kvloop.path": path_name(outcome.path)}
            if planned and answer is not None:
                attributes["kvloop.lookup.source"] = answer.source  # no RPC: Route's answer, pushed here
            tm.child_span(span, "kvloop.lookup", started, answered, attributes)
        if (
            answer is not None
            and answer.path == pb.TURN_PATH_TRANSFER
            and answer.holder is not None
            and self.directory.stale(answer.holder)
        ):
            self._refuse_stale(outcome, answer.holder)
        elif (
            answer is not None
            and answer.path == pb.TURN_PATH_TRANSFER
            and answer.holder is not None
            and (refused := self.verifier.refuses(answer.holder))
        ):
            outcome.path, outcome.reason, outcome.detail = (
                pb.TURN_PATH_RECOMPUTE,
                pb.DECISION_REASON_VERIFY_FAILED,
                refused,
            )
            if answer.holder.single_use:
                self._pool.submit(self.directory.release_claim, answer.holder)
        elif answer is not None and answer.path == pb.TURN_PATH_TRANSFER and answer.holder is not None:
            detail_before = outcome.detail
            count, is_async = self._pull(request, params, num_computed_tokens, answer, vllm_match, outcome)
            unservable = outcome.detail != detail_before
            if count:
                self._pulls[request.request_id] = _Pull(
                    span, outcome, answer.holder, request.num_prompt_tokens, started, answered
                )
                outcome.tier = answer.holder.tier  # recorded with the outcome (span, kv_transfer_params)
                return count, is_async
            outcome.path, outcome.reason = pb.TURN_PATH_RECOMPUTE, pb.DECISION_REASON_ENGINE_DECLINED
            if not unservable:
                outcome.detail = f"vLLM declined a pull of {outcome.matched_tokens} tokens"
            if answer.holder.single_use:
                self._pool.submit(self.directory.release_claim, answer.holder)
        outcome.recompute_tokens = max(0, request.num_prompt_tokens - num_computed_tokens)
        if outcome.recompute_tokens:
            self._computing[request.request_id] = (answered, outcome.recompute_tokens)
            self._compute_time.track(request.request_id)
        self._outcomes[request.request_id] = record(request.request_id, outcome, span, time.perf_counter())
        return 0, False

    def _refuse_stale(self, outcome: Outcome, holder: HolderInfo) -> None:
        outcome.path, outcome.reason = pb.TURN_PATH_RECOMPUTE, pb.DECISION_REASON_STALE_EPOCH
        outcome.detail = (
            f"handle {holder.retention_handle!r} was handed out under directory epoch "
            f"{holder.directory_epoch}; the directory has failed over since (epoch {self.directory.epoch})"
        )
        tm.log.warning(
            "kvloop.stale_handle_refused",
            holder=holder.worker_id,
            handle=holder.retention_handle,
            handle_epoch=holder.directory_epoch,
            directory_epoch=self.directory.epoch,
        )

    def take_pulls(self) -> tuple[dict[str, float], dict[str, int]]:
        """This step's new pulls for the worker, with the lease end it checks before posting each READ
        and the holder epoch the run belongs to.

        A pull whose handle predates a directory failover seen since the answer (another lookup
        brought the new epoch) gets a deadline already past: the worker does not post its READ, vLLM
        recomputes the blocks, and the outcome names the stale epoch."""
        deadlines, self.pull_deadlines = self.pull_deadlines, {}
        holder_epochs, self.pull_holder_epochs = self.pull_holder_epochs, {}
        for request_id in deadlines:
            pull = self._pulls.get(request_id)
            if pull is not None and self.directory.stale(pull.holder):
                pull.stale = True
                deadlines[request_id] = float("-inf")
        return deadlines, holder_epochs

    def take_checks(self) -> dict[str, PullCheck]:
        """This step's new pulls whose READ the worker checks, with what it checks them against."""
        checks, self.pull_checks = self.pull_checks, {}
        return checks

    def _pull(
        self,
        request: Request,
        params: dict[str, Any],
        num_computed_tokens: int,
        answer: LookupAnswer,
        vllm_match: VllmMatch,
        outcome: Outcome,
    ) -> tuple[int | None, bool]:
        """Turn the answer into vLLM's reverse-pull params; vLLM allocates the blocks."""
        h = answer.holder
        assert h is not None
        m = answer.matched_blocks
        tail = self._usable_tail(request, h, m)
        outcome.matched_tokens = min(m * self.block_size + tail, request.num_prompt_tokens)
        reads = remote_groups(
            h, self.group_windows, self.block_size, m, tail, num_computed_tokens // self.block_size
        )
        if isinstance(reads, str):
            outcome.detail = reads
            return 0, False
        outcome.matched_tokens = min(reads.end_tokens, request.num_prompt_tokens)
        params.update(
            remote_block_ids=reads.block_ids,
            remote_engine_id=h.engine_id,
            remote_request_id=h.retention_handle,
            remote_host=h.host,
            remote_port=h.port,
            remote_num_tokens=reads.end_tokens,
            remote_blocks_expiry_time=None,  # the worker checks the relative lease (pull_deadlines)
            tp_size=h.tp_size or self.transfer_tp_size,
        )
        compat.forward_generation(params, h.registration_generation)
        count, is_async = vllm_match(request, num_computed_tokens)
        if count:
            counted_from = answer.asked_at if answer.asked_at is not None else time.perf_counter()
            self.pull_deadlines[request.request_id] = counted_from + h.expires_in_ms / 1000.0
            self.pull_holder_epochs[request.request_id] = h.holder_epoch
            check = self.verifier.check_for(h)
            if check is not None:
                self.pull_checks[request.request_id] = check
        else:
            for k in HANDLE_KEYS:
                params.pop(k, None)
        return count, is_async

    def group_bytes(self, pulled_tokens: int, local_tokens: int) -> list[int]:
        """Bytes a pull of ``pulled_tokens`` past ``local_tokens`` moves, per KV-cache group."""
        bs = self.block_size
        end_tokens = local_tokens + pulled_tokens
        end, local = -(-end_tokens // bs), local_tokens // bs
        out = []
        for window, nbytes in zip(self.group_windows, self.group_bytes_per_block, strict=False):
            first = max(local, first_needed_block(end_tokens, window, bs))
            out.append(max(0, end - first) * nbytes if pulled_tokens else 0)
        return out

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
        if (
            not tail
            or len(holder.tail_block_ids) != len(holder.block_ids)
            or NULL_BLOCK in holder.tail_block_ids
        ):
            return 0
        prompt = request.prompt_token_ids or []
        limit = min(len(tail), request.num_prompt_tokens - 1 - start)
        return agreeing_prefix_length(prompt[start : start + limit], tail) if limit > 0 else 0

    # ---- allocation, READ completion, finish -------------------------------------------------

    def allocated(self, request_id: str, num_external_tokens: int) -> None:
        pull = self._pulls.get(request_id)
        if pull is not None:
            pull.outcome.pulled_tokens = num_external_tokens

    def reads_done(
        self,
        finished: set[str],
        failed: set[str],
        timings: dict[str, ReadTiming],
        verified: Mapping[str, str] | None = None,
    ) -> None:
        """READs the worker saw end this step, with NIXL's own timing of each (when it had one) and
        what the check of each checked one found (metadata.VERIFY_*)."""
        verified = verified or {}
        for rid in failed:
            self._end_pull(rid, ok=False, timing=timings.get(rid), verified=verified.get(rid))
        for rid in finished - failed:
            self._end_pull(rid, ok=True, timing=timings.get(rid), verified=verified.get(rid))

    def _end_pull(
        self, request_id: str, ok: bool, timing: ReadTiming | None = None, verified: str | None = None
    ) -> None:
        pull = self._pulls.pop(request_id, None)
        if pull is None:
            return
        done = time.perf_counter()  # one reading: the outcome, the report and the span agree
        outcome = pull.outcome
        if verified is not None:
            self.verifier.checked(pull.holder, verified)
        if verified == VERIFY_FAILED:
            # The READ ran, but a block it brought is not what the holder retained: recomputed.
            outcome.path, outcome.reason = pb.TURN_PATH_FAILED, pb.DECISION_REASON_VERIFY_FAILED
            outcome.detail = "a pulled block did not match the holder's digest; the prompt was recomputed"
            outcome.pulled_tokens = 0
        elif not ok and pull.stale:
            self._refuse_stale(outcome, pull.holder)
            outcome.pulled_tokens = 0
        elif not ok:
            # The claim is kept: the holder may have seen the READ's completion notice and freed
            # the blocks, and handing the run out again could make the next puller read them.
            outcome.path, outcome.reason = pb.TURN_PATH_FAILED, pb.DECISION_REASON_READ_FAILED
            outcome.pulled_tokens = 0
        blocks = -(-outcome.pulled_tokens // self.block_size)
        outcome.group_bytes = self.group_bytes(outcome.pulled_tokens, outcome.local_tokens)
        outcome.bytes = sum(outcome.group_bytes)
        outcome.recompute_tokens = pull.prompt_tokens - outcome.local_tokens - outcome.pulled_tokens
        outcome.pull_ms = (done - pull.started) * 1000
        # A peer warmed at start-up (peers.py) is connected before the first READ: that READ is
        # steady state and teaches the cost model; only one that waited for a handshake does not.
        if timing is not None:
            first_contact = timing.waited_handshake
        else:
            first_contact = pull.holder.engine_id not in self._holders_read
        if ok:
            self._holders_read.add(pull.holder.engine_id)
        # The engine sees a READ end only at a step boundary: the time from the lookup answer to
        # then includes waiting for steps. NIXL's own timing is what the cost model learns from.
        engine_us = int((done - pull.read_started) * 1e6)
        xfer_us = int(timing.xfer_s * 1e6) if timing else engine_us
        self._emit(
            KvloopTransferReport(
                source_worker_id=outcome.holder,
                bytes=timing.bytes if timing else outcome.bytes,
                blocks=blocks,
                duration_us=xfer_us,
                setup_us=int(timing.post_s * 1e6) if timing else 0,
                ok=ok,
                ts=time.time(),
                first_contact=first_contact,
                nixl_measured=timing is not None,
                wait_us=max(0, engine_us - xfer_us) if timing else 0,
                source_tier=pull.holder.tier,
                verify_failed=verified == VERIFY_FAILED,
            )
        )
        attributes: dict[str, Any] = {
            "kvloop.bytes": outcome.bytes,
            "kvloop.blocks": blocks,
            "kvloop.holder": outcome.holder,
            "kvloop.ok": ok,
            "kvloop.first_contact": first_contact,
            # passed | failed | unchecked, or not_checked (not sampled, no digests, READ not run)
            "kvloop.verify": verified or "not_checked",
        }
        if timing is not None:
            attributes["kvloop.nixl_xfer_ms"] = round(timing.xfer_s * 1e3, 3)
        tm.child_span(pull.span, "kvloop.nixl_read", pull.read_started, done, attributes)
        pull.span.set_attribute("kvloop.verify", attributes["kvloop.verify"])
        self._outcomes[request_id] = record(request_id, outcome, pull.span, done)

    def finished(self, request: Request) -> dict[str, Any] | None:
        """The request left the engine: its outcome's kv_transfer_params fields (None if none)."""
        rid = request.request_id
        lookup = self._lookups.pop(rid, None)
        if lookup is not None:  # aborted while its lookup ran: give back what the answer claimed
            # (off the engine loop: a done future runs its callback here and now)
            lookup.future.add_done_callback(lambda future: self._pool.submit(self._release_unused, future))
            for span in (lookup.lookup_span, lookup.span):
                span.set_attribute("kvloop.aborted", True)
                span.end()
        if rid in self._pulls:
            self._end_pull(rid, ok=False)
        self._report_prefill(request)
        return self._outcomes.pop(rid, None)

    def _release_unused(self, future: Future[LookupAnswer | None]) -> None:
        try:
            answer = future.result()
        except Exception:
            return
        if (
            answer is not None
            and answer.path == pb.TURN_PATH_TRANSFER
            and answer.holder
            and answer.holder.single_use
        ):
            self.directory.release_claim(answer.holder)

    def step(self, scheduled: Mapping[str, int], total_tokens: int) -> None:
        """An engine step starts (the scheduler built its metadata) with these tokens per request."""
        self._compute_time.step(scheduled, total_tokens)

    def _report_prefill(self, request: Request) -> None:
        computing = self._computing.pop(request.request_id, None)
        compute_s = self._compute_time.finish(request.request_id)
        if computing is None or request.num_computed_tokens < request.num_prompt_tokens:
            return  # nothing computed here, or aborted before its prefill ended
        decided, tokens = computing
        # No step seen (a scheduler that never built metadata): the wall time since the decision.
        duration_s = compute_s or time.perf_counter() - decided
        self._emit(KvloopPrefillReport(tokens=tokens, duration_us=int(duration_s * 1e6), ts=time.time()))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.directory.close()
