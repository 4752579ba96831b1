"""`kvloop bench multiturn`'s figures from its turns: TTFT percentiles per cell, paired per-turn
ratios with bootstrap CIs, context buckets, pulled blocks checked against what each holder computed,
decode steps at equal batch, and runs pooled (seeds apart)."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, fields

from kvloop.clients.bench.multiturn.arms import CPU_ROLES
from kvloop.clients.bench.multiturn.setup import (
    FLOOR_ARM,
    PAIRED_RATIOS,
    PAIRED_TPOT_RATIOS,
    ROUTING_PAIRED_RATIOS,
    TurnSample,
)
from kvloop.clients.bench.steps import Stream, equal_batch, step_gaps, weighted_ratio
from kvloop.common.tokens import agreeing_prefix_length


def wrong_pulled_blocks(held: list[list[int]], prompt: list[int], pulled_tokens: int, block_size: int) -> int:
    """Pulled blocks whose KV differs from what this prompt's own prefill would compute.

    With causal attention the KV at position p is a function of tokens[0..p] alone, so a pulled
    position is right iff the sequence it was computed for (one of ``held``: what the holders had
    computed) agrees with the prompt up to and including p. A block is wrong if any of its pulled
    positions is at or past the longest such agreement."""
    if pulled_tokens <= 0:
        return 0
    common = max((agreeing_prefix_length(sequence, prompt) for sequence in held), default=0)
    if pulled_tokens <= common:
        return 0
    return -(-pulled_tokens // block_size) - common // block_size


def decode_steps_of(mine: Stream | None, streams: list[Stream]) -> list[list]:
    """[batch, arrival, step ms] of each step of `mine`, among the streams decoded at the same time."""
    if mine is None or not mine.times:
        return []
    # the routing bench spreads an arm's sessions over several decodes: a step holds only its engine's
    others = [s for s in streams if s is not mine and s.where == mine.where]
    return [
        [g.batch, g.arrival, round(g.step_ms, 3)] for g in step_gaps([mine, *others])[: len(mine.times) - 1]
    ]


def equal_batch_decode_steps(
    samples: list[TurnSample], pairs: tuple[tuple[str, str], ...] = PAIRED_TPOT_RATIOS
) -> list[dict]:
    """Decode step time of one arm over another at the same batch size, steps without an arrival: the
    TPOT comparison with the arrival pattern taken out (arms whose prefills release sessions to the
    decode together or one by one decode in different batches, and a step grows with its batch).
    ``ratio_weighted``: the per-batch ratios weighted by the denominator arm's steps at that batch."""
    steps: dict[tuple[str, int, str, int], list[float]] = {}
    for s in samples:
        for batch, arrival, ms in s.decode_steps:
            if not arrival:
                steps.setdefault((s.workload, s.concurrency, s.arm, batch), []).append(ms)
    out = []
    for workload, concurrency in sorted({(s.workload, s.concurrency) for s in samples}):
        for top, bottom in pairs:

            def arm(name: str, cell: tuple[str, int] = (workload, concurrency)) -> dict[int, list[float]]:
                return {k[3]: v for k, v in steps.items() if k[:3] == (*cell, name)}

            rows = equal_batch(arm(top), arm(bottom))
            if rows:
                out.append(
                    {
                        "workload": workload,
                        "concurrency": concurrency,
                        "ratio": f"{top}/{bottom}",
                        "by_batch": [asdict(r) for r in rows],
                        "ratio_weighted": weighted_ratio(rows),
                    }
                )
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


def context_bucket(prompt_tokens: int) -> int:
    """Context length to the nearest 2K tokens (in K): ~8K covers 7,000-8,999 tokens."""
    return 2 * ((prompt_tokens + 1000) // 2000)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (0.0, 0.0, 0.0)
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(
    samples: list[TurnSample],
    block_size: int,
    transfers: dict[tuple[str, int, str], dict[str, float]] | None = None,
    pairs: tuple[tuple[str, str], ...] = PAIRED_RATIOS,
) -> dict:
    """Continuation turns per (workload, concurrency, arm): TTFT percentiles (and the per-repeat p50s,
    their spread), ratio to recompute, path shares, tokens and blocks pulled (and how many were wrong),
    answer agreement, and from ``transfers`` (ENGINE_SERIES totals measured on each arm's prefill engine)
    bytes moved, READ time and where the time went inside the engine. Also the same TTFTs per context
    length, per-turn paired ratios between arms,
    and the first turns of new conversations that share a long prefix."""
    continuations = [s for s in samples if s.turn > 1]
    groups = by_cell(continuations)
    all_turns = by_cell(samples)
    rows = []
    for (workload, concurrency, arm), group in sorted(groups.items()):
        ttfts = [s.ttft_ms for s in group]
        recompute = groups.get((workload, concurrency, "recompute"), [])
        base = statistics.median([s.ttft_ms for s in recompute]) if recompute else None
        reference = {(s.repeat, s.session, s.turn): s.answer for s in recompute}
        agree = [
            s.answer == reference[(s.repeat, s.session, s.turn)]
            for s in group
            if (s.repeat, s.session, s.turn) in reference
        ]
        by_repeat: dict[int, list[float]] = {}
        for s in group:
            by_repeat.setdefault(s.repeat, []).append(s.ttft_ms)
        rows.append(
            {
                "workload": workload,
                "concurrency": concurrency,
                "arm": arm,
                "continuation_turns": len(group),
                "ttft_p50_ms": percentile(ttfts, 0.5),
                "ttft_p90_ms": percentile(ttfts, 0.9),
                # Engine metrics cover every turn of the workload, so the breakdown beside them does too.
                "ttft_mean_all_turns_ms": round(
                    statistics.fmean(x.ttft_ms for x in all_turns[(workload, concurrency, arm)]), 1
                ),
                "ttft_p50_by_repeat_ms": [
                    round(statistics.median(v), 1) for _, v in sorted(by_repeat.items())
                ],
                "ratio_to_recompute_p50": round(statistics.median(ttfts) / base, 3) if base else None,
                "transfer_share": round(sum(s.cached_tokens > 0 for s in group) / len(group), 3),
                "mean_pulled_tokens": round(statistics.fmean(s.cached_tokens for s in group), 1),
                "mean_prompt_tokens": round(statistics.fmean(s.prompt_tokens for s in group), 1),
                # The floor arm stops at the first token: it has no answer to compare.
                "answer_agreement_with_recompute": round(sum(agree) / len(agree), 3)
                if agree and arm != FLOOR_ARM
                else None,
                "pulled_blocks": sum(-(-s.cached_tokens // block_size) for s in group),
                "pulled_tokens_by_tier": _by_tier(group),
                "wrong_pulled_blocks": sum(s.wrong_blocks for s in group),
                "decode_tpot_p50_ms": _median_or_none(
                    [x.decode_tpot_ms for x in all_turns[(workload, concurrency, arm)] if x.decode_tpot_ms]
                ),
                **_transfer_columns((transfers or {}).get((workload, concurrency, arm))),
                **_connector_columns(group),
                **_routing_columns(group),
            }
        )
    return {
        "rows": rows,
        "by_context": _by_context(continuations),
        "paired": _paired(continuations, pairs=pairs),
        # every turn, the first included: the decode generates an answer on each
        "paired_decode_tpot": _paired(samples, "decode_tpot_ms", PAIRED_TPOT_RATIOS),
        "decode_step_at_equal_batch": equal_batch_decode_steps(samples),
        "shared_prefix_new_conversations": _new_conversations(samples),
    }


# What runs being pooled must agree on: the same arms measured the same way.
POOLED_CONFIG_KEYS = (
    "arms",
    "prefills",
    "decodes",
    "block_size",
    "prefill_prefix_caching",
    "answer_tokens",
    "tokenizer",
    "dtype",
    "hidden_size",
    "layers",
    "ucx_tls",
)


def pooled_summary(results: Sequence[dict]) -> dict:
    """One summary of several runs' results JSONs (seeds apart, as ``--repeats`` cannot be on a fleet
    whose retained runs fill the decodes): each run's turns count as a repeat of their own. Runs that
    measured other arms or another setup are refused (ValueError, naming the setting)."""
    if not results:
        raise ValueError("no results to pool")
    first = results[0]["config"]
    for i, result in enumerate(results[1:], 2):
        for key in POOLED_CONFIG_KEYS:
            if result["config"].get(key) != first.get(key):
                raise ValueError(
                    f"run {i} has {key}={result['config'].get(key)!r}, run 1 {first.get(key)!r}: "
                    "only runs of one setup pool"
                )
    names = {f.name for f in fields(TurnSample)}
    samples: list[TurnSample] = []
    offset = 0  # each run's repeats numbered after those of the runs before it
    for result in results:
        run = [TurnSample(**{k: v for k, v in raw.items() if k in names}) for raw in result["samples"]]
        for sample in run:
            sample.repeat += offset
        offset = 1 + max((s.repeat for s in run), default=offset - 1)
        samples += run
    routing = first.get("prefills", 1) > 1 or first.get("decodes", 1) > 1
    return summarize(samples, first["block_size"], pairs=ROUTING_PAIRED_RATIOS if routing else PAIRED_RATIOS)


def _by_tier(group: list[TurnSample]) -> dict[str, int]:
    """Prompt tokens pulled from each tier of the holders (kvloop arms; empty for the others)."""
    out: dict[str, int] = {}
    for s in group:
        if s.tier and s.cached_tokens:
            out[s.tier] = out.get(s.tier, 0) + s.cached_tokens
    return out


def by_cell(samples: list[TurnSample]) -> dict[tuple[str, int, str], list[TurnSample]]:
    """Samples per (workload, concurrency, arm), in their order."""
    cells: dict[tuple[str, int, str], list[TurnSample]] = {}
    for s in samples:
        cells.setdefault((s.workload, s.concurrency, s.arm), []).append(s)
    return cells


def _by_context(continuations: list[TurnSample]) -> list[dict]:
    """TTFT per (workload, concurrency, arm, context length to the nearest 2K), with the ratio of its
    p50 to recompute's p50 in the same context bucket."""
    cells: dict[tuple, list[float]] = {}
    for s in continuations:
        cells.setdefault((s.workload, s.concurrency, context_bucket(s.prompt_tokens), s.arm), []).append(
            s.ttft_ms
        )
    out = []
    for (workload, concurrency, k, arm), ttfts in sorted(cells.items()):
        base = cells.get((workload, concurrency, k, "recompute"))
        out.append(
            {
                "workload": workload,
                "concurrency": concurrency,
                "context_k": k,
                "arm": arm,
                "turns": len(ttfts),
                "ttft_p50_ms": percentile(ttfts, 0.5),
                "ttft_p90_ms": percentile(ttfts, 0.9),
                "ratio_to_recompute_p50": round(statistics.median(ttfts) / statistics.median(base), 3)
                if base
                else None,
            }
        )
    return out


def median_ci95(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap confidence interval of the median (seeded: the same samples give the same interval)."""
    rnd = random.Random(seed)
    medians = sorted(statistics.median(rnd.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _median_or_none(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _paired(
    samples: list[TurnSample],
    metric: str = "ttft_ms",
    pairs: tuple[tuple[str, str], ...] = PAIRED_RATIOS,
) -> list[dict]:
    """Per-turn ratios of `metric` between two arms on the same turn (same prompt, run within seconds of
    each other): their median and interquartile range are far less noisy than a ratio of two runs'
    p50s, and the median's confidence interval says whether a target such as "<= 1.05x" is met or
    only not excluded."""
    values = {
        (s.workload, s.concurrency, s.repeat, s.session, s.turn, s.arm): getattr(s, metric)
        for s in samples
        if getattr(s, metric)
    }
    out = []
    for workload, concurrency in sorted({(s.workload, s.concurrency) for s in samples}):
        for top, bottom in pairs:
            ratios = [
                values[(*key[:5], top)] / value
                for key, value in values.items()
                if key[:2] == (workload, concurrency) and key[5] == bottom and (*key[:5], top) in values
            ]
            if ratios:
                q1, median, q3 = quartiles(ratios)
                low, high = median_ci95(ratios)
                out.append(
                    {
                        "workload": workload,
                        "concurrency": concurrency,
                        "ratio": f"{top}/{bottom}",
                        "turns": len(ratios),
                        "median": round(median, 3),
                        "q1": round(q1, 3),
                        "q3": round(q3, 3),
                        "median_ci95": [round(low, 3), round(high, 3)],
                    }
                )
    return out


def _new_conversations(samples: list[TurnSample]) -> list[dict]:
    firsts: dict[tuple, list[TurnSample]] = {}
    for s in samples:
        if s.turn == 1 and s.session > 0 and s.workload == "shared_prefix":
            firsts.setdefault((s.concurrency, s.arm), []).append(s)
    return [
        {
            "concurrency": c,
            "arm": arm,
            "first_turns": len(g),
            "ttft_p50_ms": percentile([s.ttft_ms for s in g], 0.5),
            "mean_pulled_tokens": round(statistics.fmean(s.cached_tokens for s in g), 1),
            "mean_prompt_tokens": round(statistics.fmean(s.prompt_tokens for s in g), 1),
            "wrong_pulled_blocks": sum(s.wrong_blocks for s in g),
        }
        for (c, arm), g in sorted(firsts.items())
    ]


def _transfer_columns(totals: dict[str, float] | None) -> dict:
    if not totals:
        return {}
    reads, requests = int(totals["reads"]), int(totals["requests"])
    columns: dict[str, object] = {
        "nixl_reads": reads,
        "bytes_moved_mib": round(totals["bytes"] / 2**20, 1),
        "nixl_read_ms_mean": round(totals["xfer_s"] * 1e3 / reads, 2) if reads else None,
    }
    if requests:
        columns.update(
            {
                f"engine_{phase}_ms_mean": round(totals[f"{phase}_s"] * 1e3 / requests, 1)
                for phase in ("queue", "prefill", "e2e")
            }
        )
    if totals.get("decode_requests"):
        columns["decode_tpot_ms_mean"] = round(totals["decode_tpot_s"] * 1e3 / totals["decode_requests"], 2)
    cpu = {role: totals.get(f"cpu_{role}_s") for role in CPU_ROLES}
    if any(cpu.values()):
        columns["cpu_s"] = {role: round(seconds or 0.0, 2) for role, seconds in cpu.items()}
    if totals.get("decode_steps"):
        columns["decode_batch_mean"] = round(totals["decode_step_tokens"] / totals["decode_steps"], 2)
    return columns


def _connector_columns(group: list[TurnSample]) -> dict:
    lookups = [s.lookup_ms for s in group if s.lookup_ms is not None]
    pulls = [s.pull_ms for s in group if s.pull_ms is not None]
    columns = {}
    if lookups:
        columns["lookup_ms_p50"] = round(statistics.median(lookups), 2)
    if pulls:
        columns["lookup_to_pulled_ms_p50"] = round(statistics.median(pulls), 1)
    return columns


def _routing_columns(group: list[TurnSample]) -> dict:
    """Routing bench: how the arm's proxy chose the prefills, what choosing took, the prefill leg as
    the proxy timed it, and how many turns waited for their burst."""
    routed = [s for s in group if s.route is not None]
    if not routed:
        return {}
    columns: dict[str, object] = {
        "route_outcomes": dict(Counter(s.route for s in routed)),
        "prefills_used": dict(Counter(s.prefill_worker for s in routed)),
        "burst_waits": sum(1 for s in routed if s.burst_wait_ms),
    }
    for name, values in (
        ("route_ms_p50", [s.route_ms for s in routed if s.route_ms is not None]),
        ("prefill_leg_ms_p50", [s.prefill_leg_ms for s in routed if s.prefill_leg_ms is not None]),
    ):
        if values:
            columns[name] = round(statistics.median(values), 2)
    return columns
