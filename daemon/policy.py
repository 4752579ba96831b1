"""Whether a turn pulls, and why: the one place kvloop decides (``Policy.answer``).

The puller states its constraints in the Lookup (its minimum pull, its lease margin, its KV layout);
``Policy.answer`` asks the store for the longest servable prefix under them, weighs moving it
against recomputing it, claims a single-use run only when it answers TRANSFER, and names the turn's
path and reason in the proto's vocabulary. The connector applies the answer and adds only what it
alone can know (the READ's own outcome, a lease that ran out before the READ was posted).

The cost model (cost_model.py) compares like with like: NIXL-timed READs against the puller's own
prefills. Real traffic cannot fool it with a few bad samples: estimates are windowed medians with the
configured default filling a short window; a pair's first READ (it pays the NIXL handshake) is never
charged to later transfers; and a pair whose estimate says "recompute" is re-measured (reason PROBE)
every ``reprobe_every`` verdicts and at least every ``reprobe_interval_s`` while lookups arrive (a
probe is always correct, only possibly slower).

``Policy.pairs`` shows all of it per holder -> puller pair and tier (``ListPairs``, ``kvloop pairs``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import msgspec
import structlog

from kvloop.common.route_estimate import queue_ms, tie_margin_ms
from kvloop.daemon.cost_model import Cost, CostModel, Estimates, PairState
from kvloop.daemon.index.model import PrefixMatch
from kvloop.daemon.index.store import BlockIndex
from kvloop.daemon.layout import KvLayout, readable_into
from kvloop.daemon.policy_config import PolicyConfig
from kvloop.daemon.queries import Answer, LookupQuery, RouteQuery, RouteScore
from kvloop.daemon.windows import WINDOW_NOT_HELD, fit_windows
from kvloop.v1 import directory_pb2 as pb

log = structlog.get_logger("kvloop.daemon")


_UNSERVABLE = {
    "expired": pb.DECISION_REASON_EXPIRED,
    "claimed": pb.DECISION_REASON_CLAIMED,
    "peer_unavailable": pb.DECISION_REASON_PEER_UNAVAILABLE,
    "incompatible_layout": pb.DECISION_REASON_INCOMPATIBLE_LAYOUT,
    "directory_resyncing": pb.DECISION_REASON_DIRECTORY_RESYNCING,
    WINDOW_NOT_HELD: pb.DECISION_REASON_WINDOW_NOT_HELD,
}


def _same_holding(a: PrefixMatch, b: PrefixMatch) -> bool:
    if a.best is None or b.best is None:
        return a.best is b.best
    return (a.best.worker.worker_id, a.best.handle, a.best.matched_blocks) == (
        b.best.worker.worker_id,
        b.best.handle,
        b.best.matched_blocks,
    )


def _answer(query: LookupQuery, match: PrefixMatch, verdict: _Verdict) -> Answer:
    """What the query's puller is told of the verdict on a match (Lookup's answer, Route's plan)."""
    matched = match.best.matched_blocks if match.best else 0
    pulled = matched if verdict.decision == pb.DECISION_TRANSFER else 0
    return Answer(
        decision=verdict.decision,
        reason=verdict.reason,
        path=path_of(verdict.decision, verdict.reason),
        detail=verdict.detail,
        cost=verdict.cost,
        match=match,
        matched_blocks=matched,
        recompute_blocks=len(query.hashes) - max(pulled, query.local_blocks),
    )


def _fitted(query: LookupQuery, match: PrefixMatch) -> PrefixMatch:
    """The match as the puller can read it: each holder cut to the end its sliding-window groups
    serve (windows.py); unchanged for a puller without sliding windows."""
    windows = query.layout.kv_group_windows
    if not any(windows):
        return match
    return fit_windows(match, windows, query.block_size, query.local_blocks)


def path_of(decision: int, reason: int) -> int:
    """The turn path a daemon answer sends the turn on."""
    if decision == pb.DECISION_TRANSFER:
        return pb.TURN_PATH_TRANSFER
    if decision == pb.DECISION_LOCAL:
        return pb.TURN_PATH_LOCAL
    if reason == pb.DECISION_REASON_MISS:
        return pb.TURN_PATH_MISS
    if reason == pb.DECISION_REASON_EXPIRED:
        return pb.TURN_PATH_EXPIRED
    return pb.TURN_PATH_RECOMPUTE


class _Verdict(msgspec.Struct, gc=False):
    decision: int
    reason: int
    detail: str
    cost: Cost | None = None


class Policy:
    def __init__(self, default: PolicyConfig, per_model: dict[str, PolicyConfig] | None = None) -> None:
        self.default = default
        self.per_model = per_model or {}
        self.cost = CostModel(self.config_for)

    def config_for(self, model: str) -> PolicyConfig:
        return self.per_model.get(model, self.default)

    async def answer(self, store: BlockIndex, query: LookupQuery, now: float) -> Answer:
        """The one function that decides a turn's path."""
        margin_s, accept = query.lease_margin_s, readable_into(query.layout)
        match = await store.lookup(
            query.namespace,
            query.hashes,
            query.local_blocks,
            query.requester,
            now,
            False,
            margin_s=margin_s,
            accept=accept,
        )
        match = _fitted(query, match)
        verdict = self.decide(query, match, now)
        if verdict.decision == pb.DECISION_TRANSFER and query.claim and match.best and match.best.single_use:
            # Claim only what is handed out: the same query again, now claiming in one store step.
            # Another puller may have claimed the run in between; then judge what is left.
            claimed = await store.lookup(
                query.namespace,
                query.hashes,
                query.local_blocks,
                query.requester,
                now,
                True,
                margin_s=margin_s,
                accept=accept,
            )
            raw, claimed = claimed.best, _fitted(query, claimed)
            if (
                raw is not None
                and raw.single_use
                and (claimed.best is None or claimed.best.handle != raw.handle)
            ):
                # the store claimed the run it ranks first, and a sliding window serves another one further
                await store.release_claim(query.namespace, raw.worker.worker_id, raw.handle, query.requester)
            if not _same_holding(claimed, match):
                verdict = self.decide(query, claimed, now)
                best = claimed.best
                if verdict.decision != pb.DECISION_TRANSFER and best is not None and best.single_use:
                    await store.release_claim(
                        query.namespace, best.worker.worker_id, best.handle, query.requester
                    )
            match = claimed
        return _answer(query, match, verdict)

    def decide(
        self, query: LookupQuery, match: PrefixMatch, now: float | None = None, *, peek: bool = False
    ) -> _Verdict:
        """The verdict on a match; ``peek`` (Route) judges by the estimates alone and records nothing
        (no verdict counts, no probe)."""
        config = self.per_model.get(query.namespace.model, self.default)  # config_for, on every Lookup
        local_blocks = query.local_blocks
        best = match.best
        if best is None:
            if match.unservable_reason == "directory_resyncing":
                return _Verdict(
                    pb.DECISION_RECOMPUTE,
                    pb.DECISION_REASON_DIRECTORY_RESYNCING,
                    "the directory store failed over: nothing is handed out until its workers have "
                    "re-pushed their state",
                )
            if match.unservable_reason:
                detail = (
                    f"blocks beyond the local prefix are held but not servable: {match.unservable_reason}"
                )
                if match.unservable_detail:
                    detail += f" ({match.unservable_detail})"
                return _Verdict(pb.DECISION_RECOMPUTE, _UNSERVABLE[match.unservable_reason], detail)
            if local_blocks > 0:
                return _Verdict(
                    pb.DECISION_LOCAL,
                    pb.DECISION_REASON_LOCAL_PREFIX,
                    f"no peer holds more than the local {local_blocks} blocks",
                )
            return _Verdict(pb.DECISION_RECOMPUTE, pb.DECISION_REASON_MISS, "no peer holds the first block")
        if not config.enabled:
            return _Verdict(pb.DECISION_RECOMPUTE, pb.DECISION_REASON_DISABLED, "transfer disabled")
        blocks = best.matched_blocks - local_blocks
        gain_tokens = blocks * query.block_size
        holder, puller, tier = best.worker.worker_id, query.requester, best.tier
        pair = self.cost.pairs.get((holder, puller, tier))
        cost = self.cost.estimate_on(
            pair, puller, best.worker.kv_bytes_per_block, blocks, gain_tokens, config
        )
        threshold = max(config.recompute_threshold_tokens, query.min_pull_tokens)
        if gain_tokens < threshold:
            return _Verdict(
                pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_BELOW_THRESHOLD,
                f"{gain_tokens} transferable tokens < threshold {threshold}",
                cost,
            )
        if peek:
            faster = cost.transfer_ms <= cost.recompute_ms * config.transfer_cost_ratio
            return _Verdict(
                pb.DECISION_TRANSFER if faster else pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_TRANSFER_FASTER if faster else pb.DECISION_REASON_RECOMPUTE_FASTER,
                "",
                cost,
            )
        if pair is None:  # kept from the first verdict on: ListPairs shows its verdicts
            pair = self.cost.pair(holder, puller, query.namespace.model, tier)
        return self._weigh(cost, pair, config, now)

    def _weigh(self, cost: Cost, pair: PairState, config: PolicyConfig, now: float | None) -> _Verdict:
        now = time.monotonic() if now is None else now
        if cost.transfer_ms <= cost.recompute_ms * config.transfer_cost_ratio:
            verdict = _Verdict(
                pb.DECISION_TRANSFER,
                pb.DECISION_REASON_TRANSFER_FASTER,
                f"transfer ~{cost.transfer_ms:.2f} ms < recompute ~{cost.recompute_ms:.2f} ms",
                cost,
            )
        elif pair.bandwidth.samples and self._reprobe_due(pair, config, now):
            verdict = _Verdict(
                pb.DECISION_TRANSFER,
                pb.DECISION_REASON_PROBE,
                f"re-measuring after {pair.recompute_streak} estimates favoured recompute "
                f"(~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms)",
                cost,
            )
        else:
            pair.recompute_streak += 1
            verdict = _Verdict(
                pb.DECISION_RECOMPUTE,
                pb.DECISION_REASON_RECOMPUTE_FASTER,
                f"recompute ~{cost.recompute_ms:.2f} ms <= transfer ~{cost.transfer_ms:.2f} ms",
                cost,
            )
        if verdict.decision == pb.DECISION_TRANSFER:
            pair.recompute_streak = 0
            pair.last_transfer = now
        pair.verdicts[verdict.reason] += 1
        return verdict

    @staticmethod
    def _reprobe_due(pair: PairState, config: PolicyConfig, now: float) -> bool:
        """A pair that keeps losing to recompute is re-measured every reprobe_every verdicts and at
        least every reprobe_interval_s while lookups arrive (its estimate only moves with READs)."""
        if config.reprobe_every and pair.recompute_streak + 1 >= config.reprobe_every:
            return True
        since = now - pair.last_transfer if pair.last_transfer is not None else None
        return bool(config.reprobe_interval_s) and (since is None or since >= config.reprobe_interval_s)

    async def route(self, store: BlockIndex, query: RouteQuery, now: float) -> list[RouteScore]:
        """Candidates ranked by expected time to first token (best first); read-only.

        Per candidate: its own prefix-cache blocks from block 0, then the pull Lookup would decide on
        top of them (same store query, same estimates, no claim, no probe), then what is left to
        compute at its measured prefill rate, after its queue."""
        config = self.config_for(query.namespace.model)
        n = len(query.hashes)
        registered = [c.worker_id for c in query.candidates if c.spec is not None]
        local = await store.stored_prefixes(query.namespace, query.hashes, registered, now)
        pooled = (
            self.cost.pooled_prefill_rate(registered, config)
            if config.route_prefill_rate == "pooled"
            else None
        )
        scores = []
        pulls: list[tuple[RouteScore, LookupQuery]] = []
        for c in query.candidates:
            score = RouteScore(c, local_blocks=local.get(c.worker_id, 0) if c.spec is not None else 0)
            if c.spec is None:  # not a worker of the model: nothing measured of it
                rate, score.prefill_basis = config.default_prefill_tokens_per_s, "default"
            elif pooled is not None:
                rate, score.prefill_basis = pooled
            else:
                rate, score.prefill_basis = self.cost.prefill_rate(c.worker_id, config)
            score.prefill_tokens_per_s = rate
            if c.spec is not None and score.local_blocks < n:
                lookup = LookupQuery(
                    query.namespace,
                    query.hashes,
                    score.local_blocks,
                    c.worker_id,
                    query.block_size,
                    layout=KvLayout.of(c.spec),
                )
                pulls.append((score, lookup))
            elif score.local_blocks:
                score.pull_reason = pb.DECISION_REASON_LOCAL_PREFIX
            scores.append(score)
        # The candidates' pull lookups at once: on a networked store their round trips overlap.
        matches = await asyncio.gather(
            *(
                store.lookup(
                    lookup.namespace,
                    lookup.hashes,
                    lookup.local_blocks,
                    lookup.requester,
                    now,
                    claim=False,
                    accept=readable_into(lookup.layout),
                )
                for _, lookup in pulls
            )
        )
        for (score, lookup), found in zip(pulls, matches, strict=True):
            match = _fitted(lookup, found)
            verdict = self.decide(lookup, match, now, peek=True)
            score.pull_reason, score.pull_cost = verdict.reason, verdict.cost
            if match.best is not None:
                score.pull_holder = match.best.worker.worker_id
                score.pull_holder_blocks = match.best.matched_blocks
                score.pull_holder_tier = match.best.tier
            if verdict.decision == pb.DECISION_TRANSFER and match.best is not None:
                score.pull_blocks = match.best.matched_blocks - score.local_blocks
                assert verdict.cost is not None
                score.transfer_ms = verdict.cost.transfer_ms
                score.pull_wait_ms = self.cost.step_wait_ms(
                    score.pull_holder, lookup.requester, score.pull_holder_tier
                )
                if not match.best.single_use:
                    score.plan = _answer(lookup, match, verdict)
        for score in scores:
            c, rate = score.candidate, score.prefill_tokens_per_s
            covered = (score.local_blocks + score.pull_blocks) * query.block_size
            score.compute_tokens = max(0, query.prompt_tokens - covered)
            score.compute_ms = score.compute_tokens / rate * 1e3
            score.queue_ms = queue_ms(c.queued_tokens, c.in_flight_requests, query.prompt_tokens, rate)
            score.expected_ttft_ms = (
                score.queue_ms + score.transfer_ms + score.pull_wait_ms + score.compute_ms
            )
        # Stable: equal estimates keep the caller's order (its own tie-break).
        scores.sort(key=lambda s: s.expected_ttft_ms)
        return scores

    def tie_rule(self, model: str) -> tuple[float, float]:
        """The model's (route_tie_ms, route_tie_ratio): Route answers them, so a router that re-ranks
        ties as kvloopd does."""
        config = self.config_for(model)
        return config.route_tie_ms, config.route_tie_ratio

    def tied(self, model: str, ranked: Sequence[RouteScore]) -> int:
        """How many leading candidates are within the model's tie margin of the best."""
        if not ranked:
            return 0
        best = ranked[0].expected_ttft_ms
        margin = tie_margin_ms(best, *self.tie_rule(model))
        return sum(1 for s in ranked if s.expected_ttft_ms - best <= margin)

    def pairs(self) -> Estimates:
        return self.cost.views()
