"""The decision's questions and answers in domain terms: a Lookup, a Route and its candidates, their
answers. convert.py makes them from protocol messages and protocol messages from them; policy.py
answers them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvloop.daemon.cost_model import Cost
from kvloop.daemon.index.model import Namespace, PrefixMatch, WorkerSpec
from kvloop.daemon.layout import UNKNOWN_LAYOUT, KvLayout
from kvloop.v1 import directory_pb2 as pb


class LookupQuery(msgspec.Struct, gc=False):  # request-path values are msgspec structs (model.py)
    """A Lookup in domain terms: the prompt and the puller's constraints."""

    namespace: Namespace
    hashes: Sequence[bytes]
    local_blocks: int
    requester: str
    block_size: int
    claim: bool = False
    min_pull_tokens: int = 0
    lease_margin_s: float = 0.0
    layout: KvLayout = UNKNOWN_LAYOUT


@dataclass(frozen=True, slots=True)
class RouteCandidate:
    """A prefill a router could send the prompt to, with its queue as the router knows it."""

    worker_id: str
    http_endpoint: str
    spec: WorkerSpec | None  # None: not an active, registered worker of the model
    in_flight_requests: int = 0
    queued_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteQuery:
    namespace: Namespace
    hashes: Sequence[bytes]
    block_size: int
    prompt_tokens: int
    candidates: Sequence[RouteCandidate]


@dataclass(slots=True)
class RouteScore:
    candidate: RouteCandidate
    local_blocks: int = 0
    pull_blocks: int = 0
    pull_holder: str = ""
    pull_holder_blocks: int = 0
    pull_holder_tier: int = 0  # the tier of the run the pull would read (set with pull_holder)
    pull_reason: int = pb.DECISION_REASON_MISS
    pull_cost: Cost | None = None
    compute_tokens: int = 0
    queue_ms: float = 0.0
    transfer_ms: float = 0.0
    pull_wait_ms: float = 0.0
    compute_ms: float = 0.0
    expected_ttft_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0
    prefill_basis: str = ""
    # The answer the candidate's own Lookup would get now, when Route judged its pull worth a READ
    # of a multi-reader run (see plans.py; a single-use run needs a claim, which Route never makes).
    plan: Answer | None = None


class Answer(msgspec.Struct, gc=False):
    decision: int
    reason: int
    path: int
    detail: str
    cost: Cost | None
    match: PrefixMatch
    # Leading blocks the best holder serves, pulled or not (0 when none); with the local ones.
    matched_blocks: int
    # Prompt blocks the caller computes under this decision.
    recompute_blocks: int
