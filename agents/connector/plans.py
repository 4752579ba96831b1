"""Route's pull plans for this prefill worker, streamed from kvloopd (``Plans``, daemon/plans.py).

When a router asks Route before sending a request here, kvloopd has already run the lookup this
worker's Lookup would run, and pushes its answer to this worker's stream. :class:`PlanInbox` keeps
each plan for ``ttl_s`` under the key of the prompt's last block hash, and the scheduler side takes
the one matching a new request instead of asking Lookup on the engine loop.

A plan is taken only when it answers exactly the question Lookup would be asked: the same prompt
(its last block hash, which chains all the others, and its block count), the same local prefix as
vLLM found for the request, a pull of at least this engine's minimum, a lease that still outlives
the engine's margin after the time the plan waited here, and a directory epoch no older than any
this engine has seen. Anything else is left to Lookup, so a plan can only save a round trip, never
change a decision or a READ. Plans come from kvloopd over this engine's own authenticated channel,
never from a request.

A continuation plan was made for a conversation as its last turn left it (that turn's prompt and
answer), before its next turn came (clients/proxy/continuation.py). It answers the next turn's
longer prompt when that prompt's full block at the plan's last position has the plan's key: the
blocks beyond are the new messages, which hash after the whole history and so are held by no one
(the decode that answered holds at most the history's blocks). It is kept until its lease, less the
engine's margin, runs out (at most ``continuation_ttl_s``), because the next turn comes after the
agent's tool or the user has answered.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.directory import LookupAnswer, answer_from_proto
from kvloop.clients.directory_client import DirectoryClient, KvloopError
from kvloop.common.block_keys import KEY_BYTES
from kvloop.v1 import directory_pb2 as pb


@dataclass(frozen=True)
class _Plan:
    answer: LookupAnswer
    prompt_blocks: int
    local_blocks: int
    received: float  # perf_counter
    expires: float  # perf_counter: past it the plan is not taken


class PlanInbox:
    def __init__(
        self,
        daemon: str,
        worker_id: str,
        *,
        block_size: int,
        min_pull_tokens: int,
        lease_margin_ms: int,
        epoch: Callable[[], int],
        ttl_s: float = 2.0,
        continuation_ttl_s: float = 120.0,
        max_plans: int = 1024,
        retry_s: float = 1.0,
    ) -> None:
        self.daemon = daemon
        self.worker_id = worker_id
        self.block_size = block_size
        self.min_pull_tokens = min_pull_tokens
        self.lease_margin_ms = lease_margin_ms
        self._epoch = epoch  # the highest directory epoch this engine has seen
        self.ttl_s = ttl_s
        self.continuation_ttl_s = continuation_ttl_s
        self.max_plans = max_plans
        self.retry_s = retry_s
        # by prompt key, oldest first: plans for exactly that prompt, and continuation plans
        self._plans: OrderedDict[bytes, _Plan] = OrderedDict()
        self._continuations: OrderedDict[bytes, _Plan] = OrderedDict()
        # how many continuation plans end at each block count: the positions take() probes
        self._continuation_ends: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._call: grpc.Call | None = None
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvloop-route-plans", daemon=True)

    def start(self) -> PlanInbox:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def put(self, plan: pb.PlansResponse, received: float | None = None) -> None:
        """Keep one plan (the stream's reader calls this; tests may too)."""
        try:
            answer = answer_from_proto(plan.lookup)
        except ValueError as e:
            tm.ROUTE_PLANS.labels("bad").inc()
            tm.log.warning("kvloop.route_plan_bad", error=str(e))
            return
        if answer.holder is None or answer.path != pb.TURN_PATH_TRANSFER or len(plan.prompt_key) != KEY_BYTES:
            tm.ROUTE_PLANS.labels("bad").inc()
            return
        tm.ROUTE_PLANS.labels("received").inc()
        now = time.perf_counter() if received is None else received
        life = self.ttl_s
        if plan.continuation:  # until the lease, less the margin, runs out
            life = min(self.continuation_ttl_s, (answer.holder.expires_in_ms - self.lease_margin_ms) / 1000)
        kept = _Plan(answer, plan.prompt_blocks, plan.local_blocks, now, now + life)
        key = plan.prompt_key
        with self._lock:
            if plan.continuation:
                if key in self._continuations:
                    self._pop_continuation(key)
                self._continuations[key] = kept
                self._continuation_ends[kept.prompt_blocks] += 1
                while self._evictable(self._continuations, now):
                    self._pop_continuation()
            else:
                self._plans.pop(key, None)
                self._plans[key] = kept
                while self._evictable(self._plans, now):
                    self._plans.popitem(last=False)

    def _evictable(self, plans: OrderedDict[bytes, _Plan], now: float) -> bool:
        """The oldest plan goes while over the bound or expired (one behind a live one waits its turn)."""
        return bool(plans) and (len(plans) > self.max_plans or now > next(iter(plans.values())).expires)

    def take(self, prompt_hashes: list[bytes], local_blocks: int) -> LookupAnswer | None:
        """The plan for this prompt (its full blocks' hashes) and local prefix, as the Lookup answer
        it stands for with its lease counted from now; None (Lookup decides) when there is none or
        it does not answer exactly this request's question."""
        if not prompt_hashes:
            return None
        source = "route_plan"
        with self._lock:
            plan = self._plans.pop(prompt_hashes[-1][:KEY_BYTES], None)
            if plan is None and self._continuations:
                plan = self._continuation_of(prompt_hashes, local_blocks)
                source = "continuation_plan"
        if plan is None:
            return None
        now = time.perf_counter()
        holder = plan.answer.holder
        assert holder is not None  # put() keeps transfers with a holder only
        waited_ms = int((now - plan.received) * 1000) + 1
        pulled_tokens = (plan.answer.matched_blocks - local_blocks) * self.block_size
        if source == "route_plan" and plan.prompt_blocks != len(prompt_hashes):
            outcome = "unmatched"
        elif plan.local_blocks != local_blocks or pulled_tokens < max(1, self.min_pull_tokens):
            outcome = "unmatched"
        elif now > plan.expires or holder.expires_in_ms - waited_ms < self.lease_margin_ms:
            outcome = "expired"
        elif holder.directory_epoch < self._epoch():
            outcome = "stale"
        else:
            tm.ROUTE_PLANS.labels("used").inc()
            said = "planned by Route" if source == "route_plan" else "planned by Route ahead of this turn"
            return dataclasses.replace(
                plan.answer,
                holder=dataclasses.replace(holder, expires_in_ms=holder.expires_in_ms - waited_ms),
                detail=said + (f": {plan.answer.detail}" if plan.answer.detail else ""),
                source=source,
            )
        tm.ROUTE_PLANS.labels(outcome).inc()
        return None

    def _continuation_of(self, prompt_hashes: list[bytes], local_blocks: int) -> _Plan | None:
        """The continuation plan made for this prompt's history, taken out (the caller holds the
        lock): the longest prefix ending at a plan's key, at the position the plan was made for, and
        beyond the local prefix (a plan pulls past it)."""
        ends = sorted(
            (e for e in self._continuation_ends if local_blocks < e <= len(prompt_hashes)), reverse=True
        )
        for end in ends:
            key = prompt_hashes[end - 1][:KEY_BYTES]
            plan = self._continuations.get(key)
            if plan is not None and plan.prompt_blocks == end:
                return self._pop_continuation(key)
        return None

    def _pop_continuation(self, key: bytes | None = None) -> _Plan:
        """Out of the continuation plans: the one under `key`, or the oldest (the caller holds the lock)."""
        plan = self._continuations.pop(key) if key is not None else self._continuations.popitem(last=False)[1]
        self._continuation_ends[plan.prompt_blocks] -= 1
        if not self._continuation_ends[plan.prompt_blocks]:
            del self._continuation_ends[plan.prompt_blocks]
        return plan

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans) + len(self._continuations)

    def _run(self) -> None:
        with DirectoryClient(self.daemon, timeout=None) as client:
            while not self._stop.is_set():
                try:
                    self._call = call = client.plans(self.worker_id)
                    call.initial_metadata()  # kvloopd sends them once this worker is subscribed
                    self.connected.set()
                    for plan in call:
                        self.put(plan)
                except (grpc.RpcError, KvloopError) as e:
                    if self._stop.is_set():
                        return
                    tm.log.debug("kvloop.route_plans_stream_ended", error=str(e))
                finally:
                    self.connected.clear()
                self._stop.wait(self.retry_s)  # kvloopd restarting: subscribe again; stop() wakes it
