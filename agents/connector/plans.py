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
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvloop.agents.connector import telemetry as tm
from kvloop.agents.connector.directory import LookupAnswer, answer_from_proto
from kvloop.clients.client import DirectoryClient, KvloopError
from kvloop.common.block_keys import KEY_BYTES
from kvloop.v1 import directory_pb2 as pb


@dataclass(frozen=True)
class _Plan:
    answer: LookupAnswer
    prompt_blocks: int
    local_blocks: int
    received: float  # perf_counter


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
        self.max_plans = max_plans
        self.retry_s = retry_s
        self._plans: OrderedDict[bytes, _Plan] = OrderedDict()  # oldest first
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
        kept = _Plan(answer, plan.prompt_blocks, plan.local_blocks, now)
        with self._lock:
            self._plans.pop(plan.prompt_key, None)
            self._plans[plan.prompt_key] = kept
            while self._plans:
                _, oldest = next(iter(self._plans.items()))
                if len(self._plans) <= self.max_plans and now - oldest.received <= self.ttl_s:
                    break
                self._plans.popitem(last=False)

    def take(self, prompt_hashes: list[bytes], local_blocks: int) -> LookupAnswer | None:
        """The plan for this prompt (its full blocks' hashes) and local prefix, as the Lookup answer
        it stands for with its lease counted from now; None (Lookup decides) when there is none or
        it does not answer exactly this request's question."""
        if not prompt_hashes:
            return None
        with self._lock:
            plan = self._plans.pop(prompt_hashes[-1][:KEY_BYTES], None)
        if plan is None:
            return None
        now = time.perf_counter()
        holder = plan.answer.holder
        assert holder is not None  # put() keeps transfers with a holder only
        waited_ms = int((now - plan.received) * 1000) + 1
        pulled_tokens = (plan.answer.matched_blocks - local_blocks) * self.block_size
        if plan.prompt_blocks != len(prompt_hashes) or plan.local_blocks != local_blocks:
            outcome = "unmatched"
        elif pulled_tokens < max(1, self.min_pull_tokens):
            outcome = "unmatched"
        elif now - plan.received > self.ttl_s or holder.expires_in_ms - waited_ms < self.lease_margin_ms:
            outcome = "expired"
        elif holder.directory_epoch < self._epoch():
            outcome = "stale"
        else:
            tm.ROUTE_PLANS.labels("used").inc()
            return dataclasses.replace(
                plan.answer,
                holder=dataclasses.replace(holder, expires_in_ms=holder.expires_in_ms - waited_ms),
                detail="planned by Route" + (f": {plan.answer.detail}" if plan.answer.detail else ""),
            )
        tm.ROUTE_PLANS.labels(outcome).inc()
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)

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
