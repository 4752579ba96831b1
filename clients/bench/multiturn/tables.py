"""The tables `kvloop bench multiturn` and `multiturn-pool` print from a summary."""

from __future__ import annotations

from rich.table import Table

from kvloop.clients.cli.output import _blank, console


def print_multiturn(summary: dict) -> None:
    _print_continuation_turns(summary)
    _print_ttft_by_context(summary)
    _print_turn_time_breakdown(summary)
    _print_span_breakdown(summary)
    _print_decode_side(summary)
    _print_paired_ratios(summary)
    _print_one_line_findings(summary)
    _print_routing_choices(summary)


def _table(title: str, columns: tuple[str, ...] | list[str]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    return table


def _print_continuation_turns(summary: dict) -> None:
    from kvloop.clients.bench.multiturn.setup import ROUTING_ARMS

    routing = any(row["arm"] in ROUTING_ARMS and "route_outcomes" in row for row in summary["rows"])
    what = "first streamed token through the arm's proxy" if routing else "disaggregated prefill latency"
    table = _table(
        f"kvloop bench multiturn: continuation turns (TTFT = {what})",
        (
            "workload",
            "sessions",
            "arm",
            "turns",
            "p50 ms",
            "p90 ms",
            "p50 per repeat",
            "x recompute",
            "transfer share",
            "pulled tokens",
            "prompt tokens",
            "answers = recompute",
            "wrong blocks",
            "MiB moved",
            "READ ms",
            "lookup ms",
        ),
    )
    for row in summary["rows"]:
        table.add_row(
            row["workload"],
            str(row["concurrency"]),
            row["arm"],
            str(row["continuation_turns"]),
            f"{row['ttft_p50_ms']:.0f}",
            f"{row['ttft_p90_ms']:.0f}",
            " ".join(f"{v:.0f}" for v in row["ttft_p50_by_repeat_ms"]),
            str(row["ratio_to_recompute_p50"]),
            str(row["transfer_share"]),
            str(row["mean_pulled_tokens"]),
            str(row["mean_prompt_tokens"]),
            _blank(row["answer_agreement_with_recompute"]),
            f"{row['wrong_pulled_blocks']} of {row['pulled_blocks']}",
            _blank(row.get("bytes_moved_mib")),
            _blank(row.get("nixl_read_ms_mean")),
            _blank(row.get("lookup_ms_p50")),
        )
    console.print(table)


def _print_ttft_by_context(summary: dict) -> None:
    from kvloop.clients.bench.multiturn.setup import ARMS, NAMED_ARMS, ROUTING_ARMS

    present = [
        a
        for a in dict.fromkeys((*ARMS, *NAMED_ARMS, *ROUTING_ARMS))
        if any(r["arm"] == a for r in summary["rows"])
    ]
    table = _table(
        "continuation TTFT by context length (nearest 2K tokens): p50 ms (x recompute in that bucket)",
        ("workload", "sessions", "context", "turns", *present),
    )
    cells: dict[tuple, dict[str, dict]] = {}
    for cell in summary["by_context"]:
        cells.setdefault((cell["workload"], cell["concurrency"], cell["context_k"]), {})[cell["arm"]] = cell
    for (workload, concurrency, k), arms in cells.items():
        table.add_row(
            workload,
            str(concurrency),
            f"~{k}K",
            str(max(c["turns"] for c in arms.values())),
            *(
                f"{arms[a]['ttft_p50_ms']:.0f} ({arms[a]['ratio_to_recompute_p50']})" if a in arms else ""
                for a in present
            ),
        )
    console.print(table)


def _print_turn_time_breakdown(summary: dict) -> None:
    table = _table(
        "where a turn's time goes (means over all turns, ms): inside the prefill engine (vLLM's "
        "request metrics) and outside it (HTTP, chat template, tokenizer)",
        (
            "workload",
            "sessions",
            "arm",
            "TTFT",
            "waiting (lookup + READ)",
            "of which READ",
            "prefill compute",
            "outside the engine",
            "decode TPOT",
        ),
    )
    for row in summary["rows"]:
        if "engine_e2e_ms_mean" in row:
            ttft = row["ttft_mean_all_turns_ms"]
            table.add_row(
                row["workload"],
                str(row["concurrency"]),
                row["arm"],
                f"{ttft:.0f}",
                f"{row['engine_queue_ms_mean']:.0f}",
                _blank(row.get("nixl_read_ms_mean")),
                f"{row['engine_prefill_ms_mean']:.0f}",
                f"{ttft - row['engine_e2e_ms_mean']:.0f}",
                _blank(row.get("decode_tpot_ms_mean")),
            )
    console.print(table)


def _print_span_breakdown(summary: dict) -> None:
    from kvloop.clients.bench.multiturn.breakdown import PARTS

    rows = summary.get("span_breakdown")
    if not rows:
        return
    table = _table(
        "where a continuation turn's time goes, from its spans (means, ms; see breakdown.py)",
        ["workload", "sessions", "arm", "turns", *PARTS],
    )
    for row in rows:
        cells = ["" if row[f"{part}_ms"] is None else f"{row[f'{part}_ms']:.1f}" for part in PARTS]
        table.add_row(row["workload"], str(row["concurrency"]), row["arm"], str(row["turns"]), *cells)
    console.print(table)


def _print_decode_side(summary: dict) -> None:
    from kvloop.clients.bench.multiturn.arms import CPU_ROLES

    decode_rows = [row for row in summary["rows"] if "decode_tpot_ms_mean" in row]
    if not decode_rows:
        return
    cpu_columns = [f"CPU s {role}" for role in CPU_ROLES]
    table = _table(
        "the decode side: time per output token, mean batch (tokens per engine step) and CPU "
        "seconds each process used in the measured turns",
        ("workload", "sessions", "arm", "decode TPOT ms", "decode batch", *cpu_columns),
    )
    for row in decode_rows:
        cpu = row.get("cpu_s", {})
        table.add_row(
            row["workload"],
            str(row["concurrency"]),
            row["arm"],
            _blank(row.get("decode_tpot_ms_mean")),
            _blank(row.get("decode_batch_mean")),
            *(_blank(cpu.get(role)) for role in CPU_ROLES),
        )
    console.print(table)


def _print_paired_ratios(summary: dict) -> None:
    table = _table(
        "paired per-turn ratios (same turn, same prompt)",
        ("of", "workload", "sessions", "ratio", "turns", "median", "95% CI of the median", "IQR"),
    )
    paired = [("TTFT", p) for p in summary["paired"]]
    paired += [("decode TPOT", p) for p in summary.get("paired_decode_tpot", [])]
    for measure, pair in paired:
        low, high = pair["median_ci95"]
        table.add_row(
            measure,
            pair["workload"],
            str(pair["concurrency"]),
            pair["ratio"],
            str(pair["turns"]),
            f"{pair['median']:.3f}",
            f"{low:.2f}-{high:.2f}",
            f"{pair['q1']:.2f}-{pair['q3']:.2f}",
        )
    console.print(table)


def _print_one_line_findings(summary: dict) -> None:
    for row in summary.get("decode_step_at_equal_batch", []):
        console.print(
            f"decode step at equal batch (steps without an arrival), {row['ratio']}, {row['workload']}, "
            f"{row['concurrency']} sessions: {row['ratio_weighted']} weighted; by batch "
            + ", ".join(f"{b['batch']}: {b['ratio']}" for b in row["by_batch"])
        )
    for row in summary["shared_prefix_new_conversations"]:
        console.print(
            f"new conversation sharing a long prefix ({row['concurrency']} sessions), {row['arm']}: "
            f"first-turn "
            f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, pulled {row['mean_pulled_tokens']:.0f} of "
            f"{row['mean_prompt_tokens']:.0f} tokens, {row['wrong_pulled_blocks']} wrong blocks"
        )


def _print_routing_choices(summary: dict) -> None:
    routed_rows = [row for row in summary["rows"] if "route_outcomes" in row]
    if not routed_rows:
        return
    table = _table(
        "how each arm's proxy chose (its x-kvloop-* headers): the prefill leg as the proxy "
        "timed it (choosing included), choosing alone, outcomes, prefills used, turns that waited "
        "for their burst",
        (
            "workload",
            "sessions",
            "arm",
            "TTFT p50",
            "prefill leg p50",
            "choosing p50",
            "outcomes",
            "prefills",
            "burst waits",
        ),
    )
    for row in routed_rows:
        table.add_row(
            row["workload"],
            str(row["concurrency"]),
            row["arm"],
            f"{row['ttft_p50_ms']:.0f}",
            _blank(row.get("prefill_leg_ms_p50")),
            _blank(row.get("route_ms_p50")),
            ", ".join(f"{k} {v}" for k, v in sorted(row["route_outcomes"].items())),
            ", ".join(f"{k} {v}" for k, v in sorted(row["prefills_used"].items())),
            str(row["burst_waits"]),
        )
    console.print(table)
