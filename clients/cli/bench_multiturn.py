"""`kvloop bench multiturn`, `multiturn-pool`: continuation TTFT per arm on real engines, and its tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvloop.clients.bench.multiturn.tables import print_multiturn
from kvloop.clients.cli.output import JsonFlag, _emit_json, _fail, console, state

_Quick = Annotated[
    bool, typer.Option("--quick", help="a few minutes: 2 sessions x 5 turns, concurrency 1 and 4")
]
_Workload = Annotated[
    list[str] | None,
    typer.Option(help="plain, shared_prefix, edited, reasoning (repeatable; default: all but reasoning)"),
]
_Arm = Annotated[
    list[str] | None,
    typer.Option(
        help="recompute, builtin, kvloop, local (repeatable; local is the "
        "ideal reference: a prefill that kept its own cache); kvloop_host: kvloop with a host pool on "
        "the decode (--host-retention-gib; not run unless asked for)"
    ),
]
_ToolTokens = Annotated[
    Optional[int],
    typer.Option(min=1, help="words of tool output appended per turn [default: 600, --quick 400]"),
]
_SystemTokens = Annotated[
    Optional[int], typer.Option(min=1, help="words of system prompt [default: 1500, --quick 800]")
]
_AnswerTokens = Annotated[
    int,
    typer.Option(
        min=2,
        help="tokens each turn's answer decodes: an agent's tool call (the reasoning workload "
        "decodes 128 tokens of thinking instead)",
    ),
]
_Tokenizer = Annotated[
    str,
    typer.Option(
        help="words: answers tokenize back to the ids generated, as a real model's mostly do; "
        "bpe: a random-weight model's answers almost never do (the next turn departs from its KV)"
    ),
]
_RetentionTtl = Annotated[
    float,
    typer.Option(
        min=1,
        help="seconds a decode retains a finished turn's KV (vLLM's retention, the builtin arm's, never "
        "yields to new runs: long leases with several sessions fill a decode with runs no one needs)",
    ),
]
_RetentionMaxShare = Annotated[
    float,
    typer.Option(
        min=0.01,
        max=1.0,
        help="share of a kvloop decode's KV cache retained runs may pin (kvloop engines default to "
        "0.5; 1: no bound, as vLLM's, and as this bench's figures were taken)",
    ),
]
_HostRetentionGib = Annotated[
    float, typer.Option(min=0, help="the kvloop_host arm's decode: GiB of host memory for retained runs")
]
_RetentionYield = Annotated[
    bool,
    typer.Option(help="past 0.9 of that share, kvloop decodes give up their oldest runs for newer ones"),
]
_UcxTls = Annotated[
    str,
    typer.Option(
        help="UCX transports of the engines' pulls (UCX_TLS): cma moves KV between processes of this "
        "host at memory speed; tcp,self costs what a pull between hosts over TCP does",
    ),
]
_Prefills = Annotated[
    int,
    typer.Option(
        min=1,
        help="prefill engines; with --prefills or --decodes above 1 the routing bench runs instead: "
        "arms kvloop (Route + pull), load_pull, prefix_route, recompute on one shared fleet, each "
        "through a `kvloop proxy` of its own",
    ),
]
_PinEngines = Annotated[
    bool,
    typer.Option(
        help="prefill engines compute on the first half of the cores, decodes on the other half "
        "(as on separate hosts): a decode's TPOT without co-located prefill compute"
    ),
]
_Seed = Annotated[
    int, typer.Option(help="conversations' seed: runs with other seeds replay other conversations")
]
_Dtype = Annotated[
    str,
    typer.Option(
        help="engines' dtype: float32 keeps bf16 rounding from flipping the "
        "random-weight model's greedy near-ties"
    ),
]
_Spans = Annotated[
    bool,
    typer.Option(
        "--spans",
        help="each turn a trace; every process's spans to WORKDIR/ARM/spans.jsonl, and a table of "
        "where each arm's turns spent their time (queue, lookup, READ, steps, compute, outside)",
    ),
]
_StreamDecodes = Annotated[
    Optional[bool],
    typer.Option(
        "--stream-decodes/--whole-decodes",
        help="the direct arms' decode legs streamed (per-turn TPOT) or answered whole; default: whole "
        "when the builtin arm runs (vLLM gives it its handle only in a whole answer), so every arm's "
        "decode costs the host the same",
    ),
]
_PauseOtherArms = Annotated[
    bool,
    typer.Option(
        "--pause-other-arms/--no-pause-other-arms",
        help="each arm's turns with the other arms' vLLM servers paused, as if it had the host to "
        "itself (builtin's decode steps without pause while it holds a handle)",
    ),
]
_Output = Annotated[
    Optional[Path],
    typer.Option("--output", "-o", help="write the results JSON here [default: WORKDIR/multiturn.json]"),
]


def bench_multiturn(
    quick: _Quick = False,
    sessions_turns: Annotated[int, typer.Option("--turns", min=2, help="turns per session")] = 10,
    concurrency: Annotated[list[int] | None, typer.Option(help="concurrent sessions (repeatable)")] = None,
    workload: _Workload = None,
    arm: _Arm = None,
    tool_tokens: _ToolTokens = None,
    system_tokens: _SystemTokens = None,
    answer_tokens: _AnswerTokens = 128,
    tokenizer: _Tokenizer = "words",
    retention_ttl: _RetentionTtl = 90.0,
    retention_max_share: _RetentionMaxShare = 1.0,
    kv_cache_gib: Annotated[int, typer.Option(min=1, help="each engine's KV cache, GiB")] = 1,
    host_retention_gib: _HostRetentionGib = 0.0,
    retention_yield: _RetentionYield = True,
    prefix_caching: Annotated[bool, typer.Option(help="prefix caching on the prefill engines")] = False,
    ucx_tls: _UcxTls = "cma,tcp,self",
    prefills: _Prefills = 1,
    decodes: Annotated[int, typer.Option(min=1, help="decode engines (see --prefills)")] = 1,
    pin_engines: _PinEngines = False,
    repeats: Annotated[int, typer.Option(min=1, help="repeat every workload")] = 1,
    seed: _Seed = 1,
    dtype: _Dtype = "float32",
    warmup_turns: Annotated[int, typer.Option(min=0, help="throwaway turns per arm before measuring")] = 2,
    workdir: Annotated[Path, typer.Option(help="engines' logs, results and plots")] = Path(".kvloop-bench"),
    output: _Output = None,
    spans: _Spans = False,
    stream_decodes: _StreamDecodes = None,
    pause_other_arms: _PauseOtherArms = True,
    json_output: JsonFlag = False,
) -> None:
    """Continuation TTFT: recompute vs vLLM's built-in reverse mode vs kvloop (and the local-cache
    ideal), on real engines; with --prefills/--decodes above 1, prefill routing arms on one fleet.
    --json prints the results JSON on stdout instead of the tables."""
    from kvloop.clients.bench.multiturn.runner import run_multiturn
    from kvloop.clients.bench.multiturn.setup import MultiturnConfig
    from kvloop.common.processes import supervisor

    _check_engine_options(dtype, tokenizer)
    arms, workloads = _arms_and_workloads(arm, workload, prefills, decodes, host_retention_gib)
    config = MultiturnConfig(
        workdir=workdir.resolve(),
        turns=5 if quick else sessions_turns,
        concurrency=(1, 4) if quick else tuple(concurrency or (1, 4, 8)),
        workloads=workloads,
        arms=arms,
        prefill_prefix_caching=prefix_caching,
        prefills=prefills,
        decodes=decodes,
        pin_engines=pin_engines,
        repeats=repeats,
        seed=seed,
        quick=quick,
        system_tokens=system_tokens or (800 if quick else 1500),
        tool_tokens=tool_tokens or (400 if quick else 600),
        answer_tokens=answer_tokens,
        tokenizer=tokenizer,
        retention_ttl_s=retention_ttl,
        retention_max_share=retention_max_share,
        retention_yield=retention_yield,
        kv_cache_gib=kv_cache_gib,
        host_retention_gib=host_retention_gib,
        dtype=dtype,
        warmup_turns=warmup_turns,
        ucx_tls=ucx_tls,
        spans=spans,
        stream_decodes=stream_decodes,
        pause_other_arms=pause_other_arms,
    )
    with supervisor().stop_on_signals():
        result = run_multiturn(config)  # progress on stderr (a line per stage off a terminal)
    out = output or (config.workdir / "multiturn.json")
    out.write_text(json.dumps(result, indent=2))
    if state.json:
        _emit_json(result)
        return
    print_multiturn(result["summary"])
    console.print(f"results: {out}; plots: {', '.join(result['plots'])}")


def _check_engine_options(dtype: str, tokenizer: str) -> None:
    from kvloop.clients.fleet.model import DTYPE_BYTES, TOKENIZERS

    if dtype not in DTYPE_BYTES:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(DTYPE_BYTES)}", param_hint="--dtype")
    if tokenizer not in TOKENIZERS:
        raise typer.BadParameter(
            f"{tokenizer!r} is not one of {', '.join(TOKENIZERS)}", param_hint="--tokenizer"
        )


def _arms_and_workloads(
    arm: list[str] | None,
    workload: list[str] | None,
    prefills: int,
    decodes: int,
    host_retention_gib: float,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The arms to run, in their running order, and the workloads; unknown names are refused. More
    than one prefill or decode makes it the routing bench, whose arms are others."""
    from kvloop.clients.bench.multiturn.setup import (
        ARMS,
        DEFAULT_WORKLOADS,
        HOST_ARM,
        NAMED_ARMS,
        ROUTING_ARMS,
        WORKLOADS,
    )

    known_arms = ROUTING_ARMS if prefills > 1 or decodes > 1 else (*ARMS, *NAMED_ARMS)
    if arm is None:
        arm = [a for a in known_arms if a not in NAMED_ARMS or (a == HOST_ARM and host_retention_gib)]
    if workload is None:
        workload = list(DEFAULT_WORKLOADS)
    for name, given, known in (("--arm", arm, known_arms), ("--workload", workload, WORKLOADS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise typer.BadParameter(f"{', '.join(unknown)}: choose from {', '.join(known)}", param_hint=name)
    return tuple(a for a in known_arms if a in arm), tuple(workload)


def bench_multiturn_pool(
    results: Annotated[
        list[Path], typer.Argument(help="results JSONs of `bench multiturn` runs of one setup (seeds apart)")
    ],
    json_output: JsonFlag = False,
) -> None:
    """The tables of `bench multiturn` over several runs pooled (each run's turns a repeat of their
    own), as seeds run apart instead of --repeats on one fleet. --json prints the pooled summary."""
    from kvloop.clients.bench.multiturn.summary import pooled_summary

    loaded = []
    for path in results:
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            _fail(f"cannot read {path}: {exc}")
    try:
        summary = pooled_summary(loaded)
    except KeyError as exc:
        _fail(f"not results of `kvloop bench multiturn` (no {exc} in one of them)", 2)
    except ValueError as exc:
        _fail(f"cannot pool these results: {exc}", 2)
    if state.json:
        _emit_json(summary)
        return
    print_multiturn(summary)
