"""`kvloop bench decode-tpot`: where a kvloop decode's time per output token goes.

One stack (kvloopd, a prefill and a decode `vllm serve` with the kvloop connector, their sidecars), and
the SAME decode engine decoding sets of requests under conditions that differ in one factor each,
interleaved round by round (a seeded shuffle every round) so that the host's noise lands on all alike:

- ``base``: the requests arrive together, the decode retains each finished run, nothing reads from it;
- ``no_retention``: as base, each request asks not to be retained (``kvloop_retain: false``);
- ``reads``: as base, while continuation prefills (one per session, one after another, from the start
  of the decode) pull earlier runs from this decode: READs hitting it, and the prefill's own short
  compute, as when other conversations' next turns are prefilled while these decode;
- ``prefills``: as reads, but the continuation prefills carry only their new tokens (a fresh prompt of
  that length): the prefill engine computes as much, and nothing reads from the decode;
- ``staggered``: as base, the requests arrive one by one, ``stagger_ms`` apart (as kvloop's faster,
  unbatched prefills release them);
- ``staggered_no_retention``: staggered, without retention.

Every request's prompt is prefilled on the prefill engine first (not timed), so the decode phase sees
only the condition's own arrival pattern. Each request is streamed; vLLM sends one chunk per engine
step, so the chunk arrivals time the decode's steps by content: every gap between two chunks of a
request is one step (or more, when a chunk carries more tokens), classified by how many requests were
decoding in it, whether a request arrived in it (its KV load done, its last prompt token computed) and
whether a READ was in flight. The decode's own metrics (vLLM's per-request TPOT, tokens per step, the
connector's retained runs) are read before and after every condition, as a second clock and a check.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvloop.clients.bench.multiturn.arms import engine_totals
from kvloop.clients.bench.multiturn.summary import median_ci95, quartiles
from kvloop.clients.bench.steps import Gap, Stream, equal_batch, step_gaps

MODEL = "kvloop-tiny"


@dataclass(frozen=True)
class Condition:
    retain: bool = True
    reads: bool = False
    staggered: bool = False
    # as reads, but the prefills pull nothing: as many new tokens, without the history (a control for
    # what the prefill engine's own compute takes from the decode, READ or not)
    prefills: bool = False


CONDITIONS = {
    "base": Condition(),
    "no_retention": Condition(retain=False),
    "reads": Condition(reads=True),
    "prefills": Condition(prefills=True),
    "staggered": Condition(staggered=True),
    "staggered_no_retention": Condition(retain=False, staggered=True),
}
# (numerator, denominator): each isolates one factor against the condition without it.
EFFECTS = (
    ("base", "no_retention", "retention"),
    ("reads", "base", "incoming READs"),
    ("prefills", "base", "concurrent prefills, no READ"),
    ("reads", "prefills", "READs beyond the prefill's compute"),
    ("staggered", "base", "staggered arrivals"),
    ("staggered", "staggered_no_retention", "retention, staggered"),
)
# The decode's own figures, read from its /metrics before and after each condition.
DECODE_SERIES = {
    "vllm:request_time_per_output_token_seconds_sum": "tpot_s",
    "vllm:request_time_per_output_token_seconds_count": "requests",
    "vllm:iteration_tokens_total_sum": "step_tokens",
    "vllm:iteration_tokens_total_count": "steps",
    "kvloop_connector_retained_runs_total": "retained_runs",
}


@dataclass
class DecodeTpotConfig:
    workdir: Path
    sessions: int = 4
    prompt_tokens: int = 1536
    answer_tokens: int = 16
    rounds: int = 12
    # fresh stacks, one after another, each running every round: the spread over stacks is the honest
    # error bar (one stack's paired CI misses what differs between stacks)
    stacks: int = 1
    stagger_ms: float = 100.0
    conditions: tuple[str, ...] = tuple(CONDITIONS)
    pin_engines: bool = False
    hidden_size: int = 384
    layers: int = 4
    dtype: str = "float32"
    block_size: int = 32
    kv_cache_gib: int = 2
    # Short leases: every round retains a few runs per condition, and a decode holding them for vLLM's
    # 480 s would fill up. Long enough for the reads condition to pull runs of the round before (a
    # round lasts 10-30 s on 2 busy cores).
    retention_ttl_s: float = 60.0
    seed: int = 5


def step_table(gaps: Sequence[Gap]) -> list[dict]:
    """Median step time per (batch, arrival, read) class."""
    classes: dict[tuple[int, bool, bool], list[float]] = {}
    for g in gaps:
        classes.setdefault((g.batch, g.arrival, g.read), []).append(g.step_ms)
    return [
        {
            "batch": batch,
            "arrival": arrival,
            "read": read,
            "steps": len(values),
            "step_ms_p50": round(statistics.median(values), 2),
        }
        for (batch, arrival, read), values in sorted(classes.items())
    ]


@dataclass
class Trial:
    """One condition in one round: its streams, the READs that hit the decode meanwhile, and the deltas
    of the decode's own metrics over it."""

    condition: str
    round: int
    streams: list[Stream]
    reads: list[tuple[float, float]] = field(default_factory=list)
    pulled_tokens: list[int] = field(default_factory=list)
    decode_metrics: dict[str, float] = field(default_factory=dict)
    # CPU seconds each process group used over the trial (idle.process_groups: "decode engine-core",
    # "decode api-server", "prefill engine-core", sidecars, kvloopd, ...)
    cpu_s: dict[str, float] = field(default_factory=dict)
    # which fresh stack (engines, sidecars, kvloopd) of a --stacks run it ran on: pairs never cross stacks
    stack: int = 0


def paired_ratios(trials: Sequence[Trial], top: str, bottom: str) -> dict | None:
    """Per-request TPOT ratios of condition `top` to `bottom`, paired by (round, session): the same
    slot of the same round, seconds apart on the same engine. Median, quartiles and the median's 95%
    bootstrap interval."""
    tpot = {
        (t.stack, t.round, t.condition, i): s.tpot_ms()
        for t in trials
        for i, s in enumerate(t.streams)
        if s.tpot_ms()
    }
    ratios = [
        value / base
        for (stack, rnd, condition, i), value in tpot.items()
        if condition == top and (base := tpot.get((stack, rnd, bottom, i)))
    ]
    if not ratios:
        return None
    q1, median, q3 = quartiles(ratios)
    low, high = median_ci95(ratios)
    return {
        "pairs": len(ratios),
        "median": round(median, 3),
        "q1": round(q1, 3),
        "q3": round(q3, 3),
        "median_ci95": [round(low, 3), round(high, 3)],
    }


def paired_cpu_ratios(
    trials: Sequence[Trial], top: str, bottom: str, group: str = "decode engine-core"
) -> dict | None:
    """CPU seconds per decoded token of a process group, `top` over `bottom`, paired by round: whether a
    condition makes the decode do more work, or only wait longer for a core."""
    per = {
        (t.stack, t.round, t.condition): t.cpu_s[group] / tokens
        for t in trials
        if group in t.cpu_s and (tokens := sum(sum(s.tokens) for s in t.streams))
    }
    ratios = [
        v / per[(stack, rnd, bottom)]
        for (stack, rnd, c), v in per.items()
        if c == top and per.get((stack, rnd, bottom))
    ]
    if not ratios:
        return None
    low, high = median_ci95(ratios)
    return {
        "rounds": len(ratios),
        "median": round(statistics.median(ratios), 3),
        "median_ci95": [round(low, 3), round(high, 3)],
    }


def equal_batch_ratios(trials: Sequence[Trial], top: str, bottom: str) -> list[dict]:
    """Step time of `top` over `bottom` at the same batch size, steps without an arrival only: what
    is left of a TPOT difference once the arrival pattern (the batch a request decodes in, and the
    steps it shares with arrivals) is the same."""
    by: dict[str, dict[int, list[float]]] = {top: {}, bottom: {}}
    for t in trials:
        if t.condition in by:
            for g in step_gaps(t.streams, t.reads):
                if not g.arrival:
                    by[t.condition].setdefault(g.batch, []).append(g.step_ms)
    return [asdict(r) for r in equal_batch(by[top], by[bottom])]


def summarize(trials: Sequence[Trial]) -> dict:
    """Per condition: TPOT (client clock; vLLM's own beside it), mean batch, steps by class; and the
    paired effect of each factor."""
    conditions = []
    for name in [c for c in CONDITIONS if any(t.condition == c for t in trials)]:
        mine = [t for t in trials if t.condition == name]
        tpots = [v for t in mine for s in t.streams if (v := s.tpot_ms())]
        gaps = [g for t in mine for g in step_gaps(t.streams, t.reads)]
        metrics = {key: sum(t.decode_metrics.get(key, 0.0) for t in mine) for key in DECODE_SERIES.values()}
        cpu: dict[str, float] = {}
        for t in mine:
            for group, seconds in t.cpu_s.items():
                cpu[group] = cpu.get(group, 0.0) + seconds
        tokens = sum(sum(s.tokens) for t in mine for s in t.streams)
        conditions.append(
            {
                "condition": name,
                **asdict(CONDITIONS[name]),
                "requests": len(tpots),
                "tpot_ms_mean": round(statistics.fmean(tpots), 2) if tpots else None,
                "tpot_ms_p50": round(statistics.median(tpots), 2) if tpots else None,
                "vllm_tpot_ms_mean": round(metrics["tpot_s"] * 1e3 / metrics["requests"], 2)
                if metrics["requests"]
                else None,
                "vllm_batch_mean": round(metrics["step_tokens"] / metrics["steps"], 2)
                if metrics["steps"]
                else None,
                "client_batch_mean": round(statistics.fmean(g.batch for g in gaps), 2) if gaps else None,
                "arrival_step_share": round(sum(g.arrival for g in gaps) / len(gaps), 3) if gaps else None,
                "read_step_share": round(sum(g.read for g in gaps) / len(gaps), 3) if gaps else None,
                "retained_runs": int(metrics["retained_runs"]),
                "reads": sum(len(t.reads) for t in mine),
                "pulled_tokens": sum(sum(t.pulled_tokens) for t in mine),
                # the decode's own work per token, apart from how long it waited for a core
                "decode_core_cpu_ms_per_token": round(cpu.get("decode engine-core", 0.0) * 1e3 / tokens, 2)
                if tokens
                else None,
                "cpu_s": {group: round(seconds, 2) for group, seconds in sorted(cpu.items())},
                "steps": step_table(gaps),
            }
        )
    names = {t.condition for t in trials}
    effects = []
    for top, bottom, factor in EFFECTS:
        if top in names and bottom in names:
            effects.append(
                {
                    "factor": factor,
                    "ratio": f"{top}/{bottom}",
                    "tpot": paired_ratios(trials, top, bottom),
                    "decode_core_cpu_per_token": paired_cpu_ratios(trials, top, bottom),
                    "step_at_equal_batch": equal_batch_ratios(trials, top, bottom),
                }
            )
    return {"conditions": conditions, "effects": effects}


# Two-sided 95% Student t quantiles by degrees of freedom (a few stacks are few samples).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def across_stacks(summaries: Sequence[dict]) -> list[dict]:
    """Each effect's paired median per stack, and their mean with its 95% t interval.

    One stack's paired CI counts only the noise between rounds: identical runs on fresh stacks (the
    same prompts and order) gave retention medians from 0.95 to 1.12, each with a CI excluding 1 on
    its own side. The spread over stacks is the figure to read."""
    out = []
    for factor in [e["factor"] for e in summaries[0]["effects"]] if summaries else []:
        medians = [
            e["tpot"]["median"]
            for summary in summaries
            for e in summary["effects"]
            if e["factor"] == factor and e["tpot"]
        ]
        row: dict = {"factor": factor, "stack_medians": medians}
        if medians:
            mean = statistics.fmean(medians)
            row["mean"] = round(mean, 3)
            if len(medians) > 1:
                sd = statistics.stdev(medians)
                half = _T95.get(len(medians) - 1, 1.96) * sd / len(medians) ** 0.5
                row["sd"] = round(sd, 3)
                row["mean_ci95"] = [round(mean - half, 3), round(mean + half, 3)]
        out.append(row)
    return out


# ------------------------------------------------------------------------------------ engines


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def _metrics(url: str) -> dict[str, float]:
    page = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return engine_totals(page, DECODE_SERIES)


class CpuClock:
    """CPU seconds used so far by each process group of a stack (idle.process_groups)."""

    def __init__(self, stack) -> None:
        from kvloop.clients.bench.idle import process_groups

        self.groups = process_groups(stack)

    def read(self) -> dict[str, float]:
        from kvloop.clients.bench.common import CLK_TCK, ticks

        totals = {
            group: sum(t for pid in pids if (t := ticks(pid)) is not None) / CLK_TCK
            for group, pids in self.groups.items()
        }
        for pid in self.groups.get(THREADS_OF, []):
            for name, seconds in thread_cpu_s(pid).items():
                key = f"{THREADS_OF} / {name}"
                totals[key] = totals.get(key, 0.0) + seconds
        return totals


# The process whose threads are timed one by one (name -> CPU seconds, in Trial.cpu_s as
# "decode engine-core / <thread name>"): where a condition's extra decode CPU goes (the model's
# forward in the main thread, NIXL's progress thread, the KV-event publisher, torch's workers).
THREADS_OF = "decode engine-core"


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` by thread name (several threads of one name summed),
    from /proc/<pid>/task/*/schedstat: nanoseconds on a CPU, finer than stat's clock ticks."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


class Driver:
    """Prefill -> decode requests on one stack, as a disaggregation proxy sends them."""

    def __init__(
        self, prefill_url: str, decode_url: str, cfg: DecodeTpotConfig, cpu: CpuClock | None = None
    ) -> None:
        self.cpu = cpu
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.cfg = cfg
        self.rnd = random.Random(cfg.seed)
        # runs the decode retained, newest last: (tokens, retained at), for the reads condition
        self.retained: list[tuple[list[int], float]] = []

    def prompt(self) -> list[int]:
        return [self.rnd.randrange(2, 1000) for _ in range(self.cfg.prompt_tokens)]

    def prefill(self, prompt: list[int]) -> dict:
        out = _post(
            f"{self.prefill_url}/v1/completions",
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        return out.get("kv_transfer_params") or {}

    def decode(self, prompt: list[int], params: dict, retain: bool, start_at: float) -> tuple[Stream, list]:
        kv = {k: v for k, v in params.items() if not k.startswith("kvloop_")}
        if not retain:
            kv["kvloop_retain"] = False
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": self.cfg.answer_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,  # random tokens often decode to no text: count token ids
            "kv_transfer_params": kv,
        }
        time.sleep(max(0.0, start_at - time.perf_counter()))  # the arrival schedule itself
        request = urllib.request.Request(
            f"{self.decode_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        stream = Stream(sent=time.perf_counter())
        ids: list[int] = []
        with urllib.request.urlopen(request, timeout=300) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                n = 0
                for choice in json.loads(line[5:]).get("choices") or []:
                    n += len(choice.get("token_ids") or ())
                    ids += choice.get("token_ids") or ()
                if n:
                    stream.times.append(now)
                    stream.tokens.append(n)
        if sum(stream.tokens) != self.cfg.answer_tokens:
            raise RuntimeError(f"the decode streamed {sum(stream.tokens)} of {self.cfg.answer_tokens} tokens")
        return stream, ids

    def continuation(self, run: list[int]) -> tuple[float, float, int, list[int], dict]:
        """The next turn of a retained run, prefilled: the prefill pulls the run from the decode (an
        empty run: only the new tokens, nothing to pull)."""
        sent = time.perf_counter()
        prompt = run + [self.rnd.randrange(2, 1000) for _ in range(32)]
        out = self.prefill(prompt)
        return sent, time.perf_counter(), int(out.get("kvloop_pulled_tokens") or 0), prompt, out

    def release(self, prompt: list[int], params: dict) -> None:
        """Hand a prefill's blocks held for a decode to it (one token, not retained): a prefill engine
        holding blocks no decode will read steps without pause until their lease ends (30 s), taking
        a core from the trials after."""
        kv = {k: v for k, v in params.items() if not k.startswith("kvloop_")}
        _post(
            f"{self.decode_url}/v1/completions",
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "kv_transfer_params": {**kv, "kvloop_retain": False},
            },
        )

    def trial(self, name: str, rnd: int) -> Trial:
        cond = CONDITIONS[name]
        n = self.cfg.sessions
        prompts = [self.prompt() for _ in range(n)]
        params = [self.prefill(p) for p in prompts]
        # runs still well inside their lease (the directory hands out none within its 6 s margin)
        fresh = time.perf_counter() - (self.cfg.retention_ttl_s - 15.0)
        sources = [tokens for tokens, at in self.retained if at > fresh][-n:] if cond.reads else []
        if cond.prefills:
            sources = [[] for _ in range(n)]
        before = _metrics(self.decode_url)
        cpu_before = self.cpu.read() if self.cpu else {}
        t0 = time.perf_counter() + 0.05
        gap = self.cfg.stagger_ms / 1e3 if cond.staggered else 0.0
        done = threading.Event()
        reads: list[tuple[float, float, int, list[int], dict]] = []

        def pull_while_decoding() -> None:
            # one next turn per session, one after another as a prefill engine serves them: a
            # conversation's continuation prefills arriving while other sessions decode
            for run in sources:
                if done.is_set():
                    break
                reads.append(self.continuation(run))

        reader = threading.Thread(target=pull_while_decoding, daemon=True)
        if sources:
            reader.start()
        try:
            with ThreadPoolExecutor(max_workers=n) as pool:
                outcomes = list(
                    pool.map(
                        lambda i: self.decode(prompts[i], params[i], cond.retain, t0 + i * gap), range(n)
                    )
                )
        finally:
            done.set()
            if sources:
                reader.join()
        after = _metrics(self.decode_url)
        cpu_after = self.cpu.read() if self.cpu else {}
        for _, _, _, prompt, out in reads:  # after the measurement
            self.release(prompt, out)
        if cond.retain:
            now = time.perf_counter()
            self.retained += [(p + ids[:-1], now) for p, (_, ids) in zip(prompts, outcomes, strict=True)]
        return Trial(
            name,
            rnd,
            [s for s, _ in outcomes],
            [(a, b) for a, b, *_ in reads],
            [pulled for _, _, pulled, *_ in reads],
            {k: after[k] - before[k] for k in after},
            {g: (cpu_after[g] - cpu_before.get(g, 0.0)) for g in cpu_after},
        )


def run_decode_tpot(cfg: DecodeTpotConfig, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Every round on each of ``cfg.stacks`` fresh stacks in turn (the same prompts and order on each):
    ``summary`` pools their trials (pairs within a stack), ``stacks`` has each stack's own summary and
    ``across_stacks`` the spread of each effect over them."""
    from kvloop.clients.fleet.model import build_tiny_llama

    cfg.workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(cfg.workdir / "model", hidden_size=cfg.hidden_size, layers=cfg.layers)
    started = time.monotonic()
    trials: list[Trial] = []
    per_stack = []
    for index in range(cfg.stacks):
        if cfg.stacks > 1:
            progress(f"stack {index + 1}/{cfg.stacks}")
        mine = _run_stack(cfg, model, index, progress)
        trials += mine
        per_stack.append(summarize(mine))
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "summary": summarize(trials),
        "stacks": per_stack,
        "across_stacks": across_stacks(per_stack),
        "trials": [asdict(t) for t in trials],
        "wall_s": round(time.monotonic() - started, 1),
    }


def _run_stack(
    cfg: DecodeTpotConfig, model: Path, index: int, progress: Callable[[str], None]
) -> list[Trial]:
    from kvloop.clients.fleet.stack import Stack, StackConfig

    stack = Stack(
        StackConfig(
            model_dir=model,
            workdir=cfg.workdir,
            kv_cache_gib=cfg.kv_cache_gib,
            block_size=cfg.block_size,
            dtype=cfg.dtype,
            retention_ttl_s=cfg.retention_ttl_s,
            pin_engines=cfg.pin_engines,
            mode="kvloop",
            decode_servers=1,
            with_proxy=False,
            start_timeout_s=600,  # 2 cores shared with other work: engines have taken 4 minutes to start
        )
    )
    trials: list[Trial] = []
    try:
        stack.start(lambda what, state: progress(f"{what}: {state}"))
        driver = Driver(stack.prefill.config.url, stack.decodes[0].config.url, cfg, CpuClock(stack))
        names = list(cfg.conditions)
        progress("warm-up round (not measured; leaves runs for the reads condition to pull)")
        for name in names:
            driver.trial(name, -1)
        for rnd in range(cfg.rounds):
            # shuffled (seeded): no condition always follows the same other one, whose after-effects
            # (a busier prefill engine, the directory's work) would land on it alone
            order = random.Random(cfg.seed * 1000 + rnd).sample(names, len(names))
            for name in order:
                trial = driver.trial(name, rnd)
                trial.stack = index
                trials.append(trial)
            progress(
                f"round {rnd + 1}/{cfg.rounds}: "
                + ", ".join(
                    f"{t.condition} {statistics.fmean(v for s in t.streams if (v := s.tpot_ms())):.1f}"
                    for t in trials[-len(names) :]
                )
                + " ms/token"
            )
        return trials
    finally:
        stack.stop()
