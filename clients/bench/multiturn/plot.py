"""`kvloop bench multiturn`'s plots: TTFT against context length, and TTFT per arm."""

from __future__ import annotations

from pathlib import Path

from kvloop.clients.bench.multiturn.setup import ARMS, FLOOR_ARM, NAMED_ARMS, ROUTING_ARMS, TurnSample
from kvloop.clients.bench.multiturn.summary import by_cell


def plot(samples: list[TurnSample], by_context: list[dict], out: Path) -> list[str]:
    """Two PNGs, a panel per (workload, sessions): TTFT vs context length (each turn a dot, the line through
    each arm's p50 per 2K bucket from the summary's ``by_context``) and the TTFT distribution per arm.
    Log scale: recompute is 5-20x the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = by_cell([s for s in samples if s.turn > 1])
    groups = sorted({(workload, concurrency) for workload, concurrency, _ in cells})
    if not groups:
        return []
    every = tuple(dict.fromkeys((*ARMS, *NAMED_ARMS, *ROUTING_ARMS)))
    arms = [arm for arm in every if any(a == arm for _, _, a in cells)]
    colors = {arm: f"C{i}" for i, arm in enumerate(every)}
    labels = {arm: f"{arm} (ideal: own cache kept)" if arm == FLOOR_ARM else arm for arm in arms}
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)

    def panels(title: str):
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
        fig.suptitle(title, fontsize="medium")
        for ax in axes.flat[len(groups) :]:
            ax.set_visible(False)
        return fig, list(axes.flat)

    def panel_title(workload: str, concurrency: int) -> str:
        return f"{workload}, {concurrency} session{'s' if concurrency > 1 else ''}"

    paths = []
    fig, axes = panels("Continuation TTFT vs context (dots: turns; line: p50 per 2K tokens)")
    for ax, (workload, concurrency) in zip(axes, groups, strict=False):
        for arm in arms:
            group = cells.get((workload, concurrency, arm))
            if not group:
                continue
            ax.scatter(
                [s.prompt_tokens for s in group],
                [s.ttft_ms for s in group],
                s=10,
                alpha=0.3,
                color=colors[arm],
            )
            line = [
                (c["context_k"] * 1000, c["ttft_p50_ms"])
                for c in by_context
                if (c["workload"], c["concurrency"], c["arm"]) == (workload, concurrency, arm)
            ]
            ax.plot(
                [x for x, _ in line],
                [y for _, y in line],
                "o--" if arm == FLOOR_ARM else "o-",
                color=colors[arm],
                label=labels[arm],
            )
        ax.set_yscale("log")
        ax.set_title(panel_title(workload, concurrency))
        ax.set_xlabel("context length (prompt tokens)")
        ax.set_ylabel("continuation TTFT (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_context.png", dpi=110)
    paths.append(str(out / "ttft_vs_context.png"))

    fig, axes = panels("Continuation TTFT distribution per arm")
    for ax, (workload, concurrency) in zip(axes, groups, strict=False):
        present = [arm for arm in arms if (workload, concurrency, arm) in cells]
        ax.boxplot(
            [[s.ttft_ms for s in cells[(workload, concurrency, arm)]] for arm in present], tick_labels=present
        )
        ax.set_yscale("log")
        ax.set_title(panel_title(workload, concurrency))
        ax.set_ylabel("continuation TTFT (ms)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ttft_distribution.png", dpi=110)
    paths.append(str(out / "ttft_distribution.png"))
    plt.close("all")
    return paths
