"""`kvloop bench multiturn`: continuation-turn latency of three arms side by side, on real engines.

Arms (same model, histories, tool outputs and order; interleaved turn by turn):
- recompute: disaggregated prefill/decode without reverse transfer;
- builtin: vLLM's NixlConnector reverse mode (`bidirectional_kv_xfer`), the reverse handle returned by
  the decode cached per conversation and passed to the next prefill, as vLLM's proxy does;
- kvloop: the directory (the prefill's connector looks the prompt's block hashes up in kvloopd);
- local (a reference, not a contender): one engine with prefix caching on that never lost its cache, so
  each turn computes only what is new. No transfer scheme can beat it; kvloop's distance to it is what
  moving the KV costs, and its ratio to recompute is the floor the workload allows.

Each arm has its own prefill + decode `vllm serve` pair; the bench orchestrates prefill -> decode itself
so that all arms are timed the same way: TTFT is the prefill request's latency (the disaggregated first
token, including any KV pull), measured per turn.

The routing bench (more than one prefill or decode) runs the product instead: one shared fleet, and
per arm a `kvloop proxy` process with that arm's routing options (ROUTING_PROXY_OPTIONS) in front of
all its engines. Each arm's sessions send streamed chat requests to their proxy, and a turn's TTFT is
the time to the first token the client receives; the proxy's `x-kvloop-*` headers say how it chose
the prefill and what the prefill's connector did.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kvloop.clients.bench.multiturn.arms import (
    ArmClient,
    ProxiedArmClient,
    stack_processes,
    wait_tokenizer_loaded,
)
from kvloop.clients.bench.multiturn.breakdown import SPAN_FILE, breakdown
from kvloop.clients.bench.multiturn.plot import plot
from kvloop.clients.bench.multiturn.setup import (
    FLOOR_ARM,
    HOST_ARM,
    NAMED_ARMS,
    PAIRED_RATIOS,
    ROUTING_PAIRED_RATIOS,
    ROUTING_PROXY_OPTIONS,
    UNVERIFIED_ARM,
    MultiturnConfig,
    Session,
    TurnSample,
    arm_order,
    build_sessions,
    next_turn_messages,
    session_seed_base,
)
from kvloop.clients.bench.multiturn.summary import decode_steps_of, summarize, wrong_pulled_blocks
from kvloop.clients.fleet.model import REASONING_CHAT_TEMPLATE, build_tiny_llama

if TYPE_CHECKING:
    from kvloop.clients.fleet.stack import Stack, StackConfig


def run_workload(
    clients: dict[str, ArmClient],
    workload: str,
    concurrency: int,
    config: MultiturnConfig,
    on_turn,
    repeat: int = 0,
) -> list[TurnSample]:
    """Every arm replays the same sessions turn by turn (interleaved). The history each arm sends next
    is the same in all arms: the reference arm's answer (recompute) is appended everywhere, so every
    turn's prompt is identical across arms and answers can be compared turn by turn."""
    samples: list[TurnSample] = []
    base_seed = session_seed_base(config.seed, workload, concurrency, repeat)
    per_arm = {arm: build_sessions(workload, concurrency, config, base_seed) for arm in clients}
    reference = "recompute" if "recompute" in clients else next(a for a in clients if a != FLOOR_ARM)
    arms = list(clients)
    # shared_prefix: conversations arrive one turn apart, so every later one is a NEW conversation whose
    # long prefix (system prompt, tool schema) another conversation already holds.
    stagger = workload == "shared_prefix"
    for turn in range(1, config.turns + 1):
        answers: dict[str, list[str]] = {}
        active = [i for i in range(concurrency) if not stagger or i < turn]
        # Arms interleaved turn by turn, in an order that changes every turn so that no arm always
        # runs right after another's turn (whose decode and sidecar work may still be winding down).
        order = arm_order(arms, turn)
        for arm in order:
            client = clients[arm]
            if config.pause_other_arms:
                for other, other_client in clients.items():
                    other_client.pause(other != arm)
            sessions = [per_arm[arm][i] for i in active]
            # shared_prefix: the arriving conversation's first turn runs alone, then the others together,
            # so its TTFT shows what its shared prefix saves rather than the other sessions' load.
            arriving = sessions[-1:] if stagger and turn - 1 in active and turn > 1 else []
            max_tokens = config.thinking_tokens if workload == "reasoning" else config.answer_tokens
            results = [client.turn(s, max_tokens) for s in arriving]
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                results = (
                    list(
                        pool.map(
                            client.turn,
                            sessions[: len(sessions) - len(arriving)],
                            [max_tokens] * concurrency,
                        )
                    )
                    + results
                )
            answers[arm] = [r.answer for r in results]
            if config.pause_other_arms:
                client.settle(sessions)  # before another arm's turn pauses it
            # Checked once the turn is over: a concurrent session's run may have been the one pulled.
            client.computed.extend(r.computed_ids for r in results)
            streams = [r.decode_stream for r in results if r.decode_stream and r.decode_stream.times]
            for i, session, r in zip(active, sessions, results, strict=False):
                own_turn = turn - i if stagger else turn
                wrong = wrong_pulled_blocks(
                    client.sources(session), r.prompt_ids, r.cached_tokens, config.block_size
                )
                samples.append(
                    TurnSample(
                        arm,
                        workload,
                        concurrency,
                        i,
                        own_turn,
                        r.prompt_tokens,
                        r.ttft_ms,
                        r.cached_tokens,
                        r.path,
                        r.answer,
                        repeat,
                        wrong,
                        r.lookup_ms,
                        r.pull_ms,
                        r.decode_tpot_ms,
                        r.prefill_worker,
                        r.route,
                        r.route_ms,
                        r.prefill_leg_ms,
                        r.burst_wait_ms,
                        decode_steps=decode_steps_of(r.decode_stream, streams),
                        tier=r.tier,
                        trace_id=r.trace_id,
                    )
                )
                client.latest[session.seed] = r.computed_ids
            on_turn()
        for arm in clients:
            for i, answer in zip(active, answers[reference], strict=False):
                session = per_arm[arm][i]
                next_turn_messages(
                    session, answer, turn - i if stagger else turn, workload, config.tool_tokens
                )
    for client in clients.values():
        client.pause(False)
    return samples


def run_multiturn(config: MultiturnConfig, progress: bool = True) -> dict:
    from rich.progress import Progress

    from kvloop.clients.console import make_console
    from kvloop.clients.fleet.stack import Stack

    config.workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(
        config.workdir / "model",
        hidden_size=config.hidden_size,
        layers=config.layers,
        chat_template=REASONING_CHAT_TEMPLATE,  # renders other workloads' prompts as the plain one
        tokenizer=config.tokenizer,
    )
    stacks: dict[str, Stack] = {}
    started = time.monotonic()
    try:
        stacks.update((arm, Stack(cfg)) for arm, cfg in _stack_configs(config, model).items())
        # On stderr: stdout keeps the results (a table, or the JSON with --json).
        with Progress(disable=not progress, transient=True, console=make_console(stderr=True)) as bar:
            task = bar.add_task(f"starting {len(stacks)} arms' engines", total=None)

            def say(text: str) -> None:
                bar.update(task, description=text)
                if progress and not bar.console.is_terminal:  # a log file gets a line per stage instead
                    bar.console.print(f"[{time.monotonic() - started:5.0f}s] {text}")

            for arm, stack in stacks.items():
                stack.start(lambda what, state, arm=arm: say(f"{arm}: {what} {state}"))
            clients = _arm_clients(config, stacks, say)
            if config.warmup_turns:
                say(f"warm-up: {config.warmup_turns} turns per arm, not measured")
                warmup = MultiturnConfig(**{**asdict(config), "turns": config.warmup_turns})
                run_workload(clients, "plain", 1, warmup, lambda: None, repeat=-1)
                for client in clients.values():
                    client.forget()
            samples, transfers = _run_rounds(clients, config, bar, task, say)
        summary = summarize(
            samples, config.block_size, transfers, ROUTING_PAIRED_RATIOS if config.routing else PAIRED_RATIOS
        )
        result = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
            "summary": summary,
            "samples": [asdict(s) for s in samples],
            "engine_start_s": {
                arm: [round(e.started_s or 0, 1) for e in s.engines] for arm, s in stacks.items()
            },
            "wall_s": round(time.monotonic() - started, 1),
        }
        if config.spans:
            # the receivers write what the processes exported; the stacks stop (flushing) first
            for stack in stacks.values():
                stack.stop()
            summary["span_breakdown"] = breakdown(
                samples, [config.workdir / name / SPAN_FILE for name in stacks]
            )
        result["plots"] = plot(samples, summary["by_context"], config.workdir)
        return result
    finally:
        for stack in stacks.values():
            for engine in stack.engines:
                engine.pause(False)  # a stopped process group takes no SIGTERM
            stack.stop()


def _stack_configs(config: MultiturnConfig, model: Path) -> dict[str, StackConfig]:
    """The stacks to start: with routing one fleet all arms' proxies share, else a prefill + decode
    pair per arm (the floor arm a prefill alone, with prefix caching)."""
    from kvloop.clients.fleet.stack import StackConfig

    shared = {
        "model_dir": model,
        "kv_cache_gib": config.kv_cache_gib,
        "block_size": config.block_size,
        "dtype": config.dtype,
        "pin_engines": config.pin_engines,
        "retention_ttl_s": config.retention_ttl_s,
        "retention_max_share": config.retention_max_share,
        "retention_yield": config.retention_yield,
        "ucx_tls": config.ucx_tls,
        "with_proxy": False,
    }
    if config.routing:
        fleet = StackConfig(
            workdir=config.workdir / "fleet",
            prefill_prefix_caching=config.prefill_prefix_caching,
            mode="kvloop",
            prefill_servers=config.prefills,
            decode_servers=config.decodes,
            span_file=config.workdir / "fleet" / SPAN_FILE if config.spans else None,
            # four engines starting at once on a small shared host take several minutes
            start_timeout_s=900,
            **shared,
        )
        return {"fleet": fleet}
    configs = {}
    for arm in config.arms:
        floor = arm == FLOOR_ARM
        if arm == HOST_ARM and not config.host_retention_gib:
            raise ValueError(f"the {HOST_ARM} arm needs --host-retention-gib")
        configs[arm] = StackConfig(
            workdir=config.workdir / arm,
            host_retention_gib=config.host_retention_gib if arm == HOST_ARM else 0.0,
            prefill_prefix_caching=floor or config.prefill_prefix_caching,
            mode="recompute" if floor else "kvloop" if arm in NAMED_ARMS else arm,
            verify="off" if arm == UNVERIFIED_ARM else "all",
            decode_servers=0 if floor else 1,
            span_file=config.workdir / arm / SPAN_FILE if config.spans else None,
            **shared,
        )
    return configs


def _arm_clients(config: MultiturnConfig, stacks: dict[str, Stack], say) -> dict[str, ArmClient]:
    """A client per arm: straight to its own pair's engines, or (routing) through its proxy on the
    shared fleet."""
    if not config.routing:
        return {
            arm: ArmClient(
                arm,
                s.prefill.config.url,
                s.decodes[0].config.url if s.decodes else "",
                stack_processes(s),
                traced=config.spans,
                stream_decodes=config.streams_decodes,
                engines=list(s.engines),
                settle=_announced(s) if s.config.mode == "kvloop" and s.decodes else None,
            )
            for arm, s in stacks.items()
        }
    fleet = stacks["fleet"]
    clients: dict[str, ArmClient] = {}
    for arm in config.arms:
        url = fleet.start_proxy(
            f"proxy-{arm}", ROUTING_PROXY_OPTIONS[arm], lambda what, state: say(f"{what}: {state}")
        )
        if "--route" in ROUTING_PROXY_OPTIONS[arm]:
            say(f"proxy-{arm}: loading the model's tokenizer")
            wait_tokenizer_loaded(url)
        clients[arm] = ProxiedArmClient(arm, url, traced=config.spans)
    return clients


def _announced(stack: Stack):
    """After a turn: wait until the arm's decode has announced each session's run (at most a few
    seconds each: a run the decode declined never is)."""

    def settle(sessions: list[Session]) -> None:
        for session in sessions:
            stack.wait_turn_retained(session.messages, timeout_s=5.0)

    return settle


def _run_rounds(
    clients: dict[str, ArmClient], config: MultiturnConfig, bar, task, say
) -> tuple[list[TurnSample], dict[tuple[str, int, str], dict[str, float]]]:
    """Every repeat x workload x concurrency round on every arm: the turns' samples, and per round
    and arm what the engines transferred meanwhile (their counters' growth)."""
    turns_in_all = (
        len(config.workloads) * len(config.concurrency) * config.turns * len(clients) * config.repeats
    )
    bar.update(task, total=turns_in_all, completed=0)
    samples: list[TurnSample] = []
    transfers: dict[tuple[str, int, str], dict[str, float]] = {}
    for repeat in range(config.repeats):
        for workload in config.workloads:
            for concurrency in config.concurrency:
                say(
                    f"repeat {repeat + 1}/{config.repeats}: {workload}, {concurrency} session(s), "
                    f"{config.turns} turns x {len(clients)} arms "
                    f"({int(bar.tasks[0].completed)}/{turns_in_all} arm-turns done)"
                )
                before = {arm: c.engine_totals() for arm, c in clients.items()}
                samples += run_workload(
                    clients, workload, concurrency, config, lambda: bar.advance(task), repeat
                )
                for arm, c in clients.items():
                    totals = transfers.setdefault(
                        (workload, concurrency, arm), dict.fromkeys(before[arm], 0.0)
                    )
                    for key, value in c.engine_totals().items():
                        totals[key] += value - before[arm][key]
    say(f"all {turns_in_all} arm-turns done")
    return samples, transfers
