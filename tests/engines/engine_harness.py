"""Real vLLM engines for the connector tests, one per subprocess.

Two in-process ``vllm.LLM`` engines cannot share one Python process (vLLM's parallel state,
forward context and env cache are process-global), so each engine runs in its own spawned process
with the in-process executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni``) and is driven over a
``multiprocessing`` pipe.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = 32


# ----------------------------------------------------------------------------------- model


# ----------------------------------------------------------------------------------- engine


@dataclass
class EngineSpec:
    name: str
    model_dir: str
    side_channel_port: int
    engine_id: str
    extra_config: dict[str, Any]
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_cache_gib: int = 1
    directory_target: str = ""
    # "uni" + in-process engine core (fast on 2 cores), or e.g. ("mp", True) = vLLM's default
    # multiprocess layout (scheduler and worker in different processes).
    executor: str = "uni"
    multiprocessing: bool = False
    # TP > 1 on the CPU build: the "mp" executor, one worker process per rank, each bound to its own
    # core (VLLM_CPU_OMP_THREADS_BIND; without it vLLM wants one NUMA node per rank).
    tensor_parallel_size: int = 1
    # Also export the engine's spans to this OTLP/gRPC receiver (a real one: kvloop.common.otlp_receiver).
    otlp_endpoint: str = ""


def _blocks(cache: Any, ids: list[int], num_blocks: int) -> Any:
    """Blocks ``ids`` of a layer's KV cache as rows, whatever the backend's layout: blocks first (the
    CPU build's [blocks, heads, bs, 2*hd]) or after K/V (a GPU attention backend's [2, blocks, ...])."""
    import torch

    dim = 0 if cache.shape[0] == num_blocks else 1
    rows = cache.index_select(dim, torch.tensor(ids, dtype=torch.long, device=cache.device))
    return rows.movedim(dim, 0).reshape(len(ids), -1)


def _kv_block_maxdiff(worker: Any, a_ids: list[int], b_ids: list[int]) -> list[float]:
    """Max |a - b| per block pair over all layers."""
    import torch

    caches = worker.model_runner.kv_caches
    num_blocks = worker.model_runner.kv_cache_config.num_blocks
    out = torch.zeros(len(a_ids), dtype=torch.float32)
    for c in caches:
        a, b = _blocks(c, a_ids, num_blocks).float(), _blocks(c, b_ids, num_blocks).float()
        out = torch.maximum(out, (a - b).abs().amax(dim=1).cpu())
    return out.tolist()


def _kv_group_maxdiff(worker: Any, a_groups: list[list[int]], b_groups: list[list[int]]) -> list[list[float]]:
    """Per KV-cache group, the largest difference per block pair over that group's layers only (a
    block id means nothing in another group's layers), in bf16 steps at the values' magnitude (at
    least 1.0: near zero an absolute step of 2**-7 counts as one). ``kv_caches`` is indexed by layer
    (vLLM's bind_kv_cache)."""
    import torch
    from vllm.model_executor.models.utils import extract_layer_index

    caches = worker.model_runner.kv_caches
    num_blocks = worker.model_runner.kv_cache_config.num_blocks
    groups = worker.model_runner.kv_cache_config.kv_cache_groups
    out = []
    for group, a_ids, b_ids in zip(groups, a_groups, b_groups, strict=True):
        diff = torch.zeros(len(a_ids), dtype=torch.float32)
        for name in group.layer_names:
            c = caches[extract_layer_index(name)]
            x, y = _blocks(c, a_ids, num_blocks).float(), _blocks(c, b_ids, num_blocks).float()
            one = torch.ones(1, device=x.device)
            step = torch.exp2(torch.floor(torch.log2(torch.maximum(x.abs().maximum(y.abs()), one))) - 7)
            d = ((x - y).abs() / step).amax(dim=1).cpu()
            diff = torch.maximum(diff, d)
        out.append(diff.tolist())
    return out


def _kv_groups(worker: Any) -> list[dict[str, Any]]:
    return [
        {
            "kind": type(g.kv_cache_spec).__name__,
            "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None) or 0,
            "layers": list(g.layer_names),
        }
        for g in worker.model_runner.kv_cache_config.kv_cache_groups
    ]


def _connector_state(worker: Any) -> dict[str, Any]:
    """The kvloop connector's worker half, read where it runs (through collective_rpc, so also in a
    multiprocess engine's worker process): engine steps it saw, leases it holds (vLLM's
    ``_reqs_to_send``: request id -> lease end, perf_counter) and READs it counted."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group().connector_worker  # type: ignore[attr-defined]
    return {"steps": w.kvloop_steps, "leases": dict(w._reqs_to_send), "reads": dict(w.kvloop_reads)}


def _set_fault_corrupt(worker: Any, where: str, share: float) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().connector_worker.faults.shares[where] = share  # type: ignore[attr-defined]


def _host_pool_diff(worker: Any, block_ids: list[int], slots: list[int]) -> list[int]:
    """Per (block, slot) pair, how many bytes of the host pool's slot differ from the KV-cache
    block's, over every region (the pool mirrors the connector's registered KV caches, in order)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group().connector_worker  # type: ignore[attr-defined]
    num_blocks = worker.model_runner.kv_cache_config.num_blocks
    regions = []
    for cache in w.device_kv_caches.values():
        # a layout with K and V apart ([2, blocks, ...]) registers each as a region of its own
        regions += [cache] if cache.shape[0] == num_blocks else [cache[0], cache[1]]
    pooled = w.host_pool.read_slots(slots)
    assert len(regions) == len(pooled), (len(regions), len(pooled))
    out = torch.zeros(len(block_ids), dtype=torch.long)
    for region, pool in zip(regions, pooled, strict=True):
        rows = _blocks(region.view(torch.uint8), block_ids, num_blocks).cpu()
        out += (rows != pool.reshape(len(block_ids), -1)).sum(dim=1)
    return out.tolist()


def _kv_shapes(worker: Any) -> list[list[int]]:
    return [list(c.shape) for c in worker.model_runner.kv_caches]


def _sampling(args: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=args["max_tokens"],
        logprobs=args.get("logprobs", 1),
        ignore_eos=True,
        extra_args={"kv_transfer_params": args.get("kv_transfer_params")}
        if args.get("kv_transfer_params") is not None
        else None,
    )


def _prompt(args: dict[str, Any]) -> Any:
    from vllm.inputs import TokensPrompt

    prompt: dict[str, Any] = {"prompt_token_ids": list(args["prompt_token_ids"])}
    if args.get("cache_salt"):
        prompt["cache_salt"] = args["cache_salt"]
    return TokensPrompt(**prompt)


def _result(res: Any, elapsed: float) -> dict[str, Any]:
    c = res.outputs[0]
    lps = [lp[tok].logprob for lp, tok in zip(c.logprobs or [], c.token_ids, strict=False)]
    return {
        "request_id": res.request_id,
        "token_ids": list(c.token_ids),
        "logprobs": lps,
        "top_logprobs": [
            sorted(((t, p.logprob) for t, p in lp.items()), key=lambda x: -x[1]) for lp in (c.logprobs or [])
        ],
        "kv_transfer_params": res.kv_transfer_params,
        "num_cached_tokens": res.num_cached_tokens,
        "elapsed_s": elapsed,
    }


def _step_for_announcements(llm: Any, spec: EngineSpec) -> None:
    """Step an in-process engine until its retained runs are announced: an announcement waits for the
    worker's digests of the run, made at the next engine step, which a serving engine's loop takes
    (it steps while it holds retained runs) and ``LLM.generate`` does not once its requests end."""
    if spec.multiprocessing:
        return  # vLLM's engine-core loop steps by itself
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    gate = getattr(getattr(connector, "connector_scheduler", None), "digests", None)
    # A step asks the worker for the digests and a later one brings them; with vLLM's async scheduling
    # a step may return before its batch ran, so the steps are counted by the gate, not by number.
    deadline = time.monotonic() + 60
    while gate is not None and gate.held and time.monotonic() < deadline:
        llm.llm_engine.step()


def _serve(conn: Any, spec: EngineSpec) -> None:
    from kvloop.common.processes import die_with_parent

    parent = mp.parent_process()
    die_with_parent(parent_pid=parent.pid if parent else None)  # not left running if pytest dies
    os.environ.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if spec.multiprocessing else "0",
            "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "NIXL_LOG_LEVEL": "WARN",
            "VLLM_LOGGING_LEVEL": os.environ.get("KVLOOP_TEST_VLLM_LOG", "WARNING"),
            "TOKENIZERS_PARALLELISM": "false",
            # full 32-byte digests in BlockStored/BlockRemoved (kvloop-agent indexes those)
            "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",
        }
    )
    # `make gpu-check` runs the KV-equality tests on a GPU (KVLOOP_PLATFORM=cuda), both engines on it
    on_gpu = os.environ.get("KVLOOP_PLATFORM") == "cuda"
    if not on_gpu:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if spec.tensor_parallel_size > 1 and not on_gpu:
        cores = os.cpu_count() or 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(r % cores) for r in range(spec.tensor_parallel_size)
        )
    if spec.multiprocessing:  # collective_rpc with a function across processes (test-only)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": f"vllm-{spec.name}"}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        if spec.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(
                SimpleSpanProcessor(OTLPSpanExporter(endpoint=spec.otlp_endpoint, insecure=True))
            )
        trace.set_tracer_provider(provider)

        from vllm import LLM

        extra = {"bidirectional_kv_xfer": True, **spec.extra_config}
        if spec.directory_target:
            extra["kvloop_daemon"] = spec.directory_target
        kv_transfer_config = {
            "kv_connector": "KvloopConnector",
            "kv_connector_module_path": "kvloop.agents.connector.connector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cuda" if on_gpu else "cpu",
            "engine_id": spec.engine_id,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        kwargs: dict[str, Any] = {"gpu_memory_utilization": 0.4} if on_gpu else {}
        if spec.kv_events_endpoint:
            kwargs["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": spec.kv_events_endpoint,
                "replay_endpoint": spec.kv_events_replay_endpoint,
                "topic": "",
            }
        t0 = time.perf_counter()
        llm = LLM(
            model=spec.model_dir,
            dtype="bfloat16",
            enforce_eager=True,
            block_size=BLOCK_SIZE,
            max_model_len=16384,
            max_num_batched_tokens=16384,
            distributed_executor_backend=spec.executor,
            tensor_parallel_size=spec.tensor_parallel_size,
            prefix_caching_hash_algo="sha256_cbor",
            enable_prefix_caching=True,
            seed=0,
            kv_transfer_config=kv_transfer_config,
            **kwargs,
        )
        start_s = time.perf_counter() - t0
        conn.send(("ready", {"start_s": start_s, "kv_shapes": llm.collective_rpc(_kv_shapes)[0]}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return

    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                try:  # the multiprocess layout leaves orphaned engine-core processes otherwise
                    llm.llm_engine.engine_core.shutdown()
                except Exception:
                    pass
                conn.send(("ok", None))
                break
            if cmd == "generate":
                t = time.perf_counter()
                (res,) = llm.generate([_prompt(args)], _sampling(args), use_tqdm=False)
                elapsed = time.perf_counter() - t
                _step_for_announcements(llm, spec)
                conn.send(("ok", _result(res, elapsed)))
            elif cmd == "generate_many":  # several requests in one batch, side by side
                t = time.perf_counter()
                results = llm.generate(
                    [_prompt(a) for a in args], [_sampling(a) for a in args], use_tqdm=False
                )
                elapsed = time.perf_counter() - t
                _step_for_announcements(llm, spec)
                conn.send(("ok", [_result(res, elapsed) for res in results]))
            elif cmd == "block_hashes":  # this engine's chained hashes of the full blocks
                from vllm.utils.hashing import sha256_cbor
                from vllm.v1.core import kv_cache_utils
                from vllm.v1.core.kv_cache_utils import hash_block_tokens

                # a multiprocess engine seeds its hashes in its core process: seed this one alike
                # (PYTHONHASHSEED, as every engine of the pair has it)
                kv_cache_utils.init_none_hash(sha256_cbor)
                toks, hashes, parent = list(args), [], None
                for i in range(len(toks) // BLOCK_SIZE):
                    parent = hash_block_tokens(
                        sha256_cbor, parent, toks[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    )
                    hashes.append(bytes(parent))
                conn.send(("ok", hashes))
            elif cmd == "kv_diff_groups":
                conn.send(("ok", llm.collective_rpc(_kv_group_maxdiff, args=(args["a"], args["b"]))[0]))
            elif cmd == "kv_groups":
                conn.send(("ok", llm.collective_rpc(_kv_groups)[0]))
            elif cmd == "kv_diff":
                # every rank's heads: a TP engine's ranks each hold a part of every block
                per_rank = llm.collective_rpc(_kv_block_maxdiff, args=(args["a"], args["b"]))
                conn.send(("ok", [max(d) for d in zip(*per_rank, strict=True)]))
            elif cmd == "spans":
                spans = [
                    {"name": s.name, **{k: v for k, v in (s.attributes or {}).items()}}
                    for s in exporter.get_finished_spans()
                ]
                exporter.clear()
                conn.send(("ok", spans))
            elif cmd == "reset_prefix_cache":
                conn.send(("ok", llm.reset_prefix_cache()))
            elif cmd == "kvloop_reads":  # completed READs of retained runs (decode role)
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                w = get_kv_transfer_group().connector_worker
                conn.send(("ok", dict(w.kvloop_reads)))
            elif cmd == "metrics":  # this process's kvloop prometheus samples (running totals)
                from kvloop.agents.connector.telemetry import LOCAL

                conn.send(
                    (
                        "ok",
                        {
                            (m.name + s.name[len(m.name) :], tuple(sorted(s.labels.items()))): s.value
                            for m in LOCAL.collect()
                            if m.name.startswith("kvloop_")
                            for s in m.samples
                        },
                    )
                )
            elif cmd == "host_pool_diff":
                conn.send(("ok", llm.collective_rpc(_host_pool_diff, args=(args["ids"], args["slots"]))[0]))
            elif cmd == "host_release":  # release one host copy as the pool's eviction does (in-process)
                connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
                tier = connector.connector_scheduler.decode._host
                tier._release(args, tier._copies[args], "evicted")
                conn.send(("ok", None))
            elif (
                cmd == "fault_corrupt"
            ):  # the share of retained runs (device) or host copies (host) overwritten
                conn.send(("ok", llm.collective_rpc(_set_fault_corrupt, args=(args["where"], args["share"]))))
            elif cmd == "connector_state":
                conn.send(("ok", llm.collective_rpc(_connector_state)[0]))
            elif cmd == "sleep":  # let the engine idle without stepping
                time.sleep(args)
                conn.send(("ok", None))
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class EngineHandle:
    def __init__(self, spec: EngineSpec, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(child, spec),
            name=f"engine-{spec.name}",
            daemon=not (spec.multiprocessing or spec.executor != "uni"),  # vLLM then spawns children
        )
        self.proc.start()
        self.timeout_s = timeout_s
        self.info: dict[str, Any] | None = None

    def wait_ready(self) -> dict[str, Any]:
        if self.info is None:
            status, info = self._recv()
            if status != "ready":
                self.proc.kill()
                raise RuntimeError(f"engine {self.spec.name} failed to start:\n{info}")
            self.info = info
        return self.info

    def _recv(self) -> tuple[str, Any]:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"engine {self.spec.name} did not answer in {self.timeout_s}s")
        return self.conn.recv()

    def call(self, cmd: str, args: Any = None) -> Any:
        self.conn.send((cmd, args))
        status, out = self._recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.spec.name} {cmd} failed:\n{out}")
        return out

    def generate(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        kv_transfer_params=None,
        cache_salt=None,
        logprobs=1,
    ):
        return self.call(
            "generate",
            {
                "logprobs": logprobs,
                "prompt_token_ids": prompt_token_ids,
                "max_tokens": max_tokens,
                "kv_transfer_params": kv_transfer_params,
                "cache_salt": cache_salt,
            },
        )

    def generate_many(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Several requests in one ``generate`` call: the engine schedules them side by side. Each is
        a dict of :meth:`generate`'s arguments (``prompt_token_ids``, ``max_tokens``, ...)."""
        return self.call("generate_many", [{"logprobs": 1, **r} for r in requests])

    def kill(self) -> None:
        """Crash the engine (SIGKILL): no shutdown, no release events."""
        self.proc.kill()
        self.proc.join(timeout=20)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("stop")
        except Exception:
            pass
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()


def dumps(x: Any) -> str:
    return json.dumps(x, default=str)
