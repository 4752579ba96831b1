"""`kvloop bench directory`: a synthetic fleet of agents against a real kvloopd process over gRPC.

Figures: ingest (block-hash events/s, batched, until the daemon acked everything), server-side
Lookup p50/p99 for long prompts over a full directory, end-to-end gRPC Lookup p50 on loopback,
lookups/s with concurrent callers, and memory per directory entry (the daemon's RSS growth per entry
in memory; Redis's own ``used_memory`` growth per entry on Redis).

Each store named with ``--store`` is measured in turn with the same fleet: ``memory`` (the default),
``redis`` (a throwaway redis-server the bench starts from PATH) or a ``redis://`` URL (an existing
server; its database is flushed first).
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvloop.agents.sidecar.link import DirectoryLink
from kvloop.clients.bench.common import percentile, rss_bytes, start_daemon
from kvloop.clients.directory_client import AsyncDirectoryClient, DirectoryClient
from kvloop.common.processes import die_with_parent, supervisor
from kvloop.v1 import directory_pb2 as pb

MODEL = "bench-model"
HASH_LENGTH = 32  # sha256_cbor, vLLM's default
# A Lookup as the prefill connector makes it: block ids packed, hashes sent as their 8-byte keys.
_LOOKUP = {"requester": "bench-prefill", "pack_block_ids": True, "hash_length": HASH_LENGTH}


@dataclass
class BenchConfig:
    entries: int = 1_000_000
    workers: int = 64
    prompt_blocks: int = 2048
    lookups: int = 2000
    concurrency: int = 32
    batch_hashes: int = 512
    # Route: one conversation's turns scored over two prefill candidates (see _route_figures).
    route_turns: int = 200
    route_first_tokens: int = 2048
    route_turn_tokens: int = 64
    listen: str = "127.0.0.1:0"
    seed: int = 7
    stores: tuple[str, ...] = ("memory",)


class _Fleet:
    """Synthetic decode workers: each retains runs of `prompt_blocks` chained hashes."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        rng = random.Random(config.seed)
        runs = max(1, config.entries // config.prompt_blocks)
        self.runs: list[tuple[int, list[bytes]]] = []  # (worker index, hashes)
        for r in range(runs):
            parent = rng.randbytes(32)
            hashes = []
            for _ in range(config.prompt_blocks):
                parent = hashlib.sha256(parent).digest()
                hashes.append(parent)
            self.runs.append((r % config.workers, hashes))

    def batches_for(self, worker: int) -> list[list[pb.BlockEvent]]:
        """A run is one BlocksRetained event (runs are atomic); several events fill a batch."""
        per_batch = max(1, self.config.batch_hashes // self.config.prompt_blocks)
        events = [
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=hashes,
                    block_ids=list(range(len(hashes))),
                    num_groups=1,
                    retention_handle=f"run-{i}",
                    expires_in_ms=3_600_000,
                )
            )
            for i, (w, hashes) in enumerate(self.runs)
            if w == worker
        ]
        return [events[i : i + per_batch] for i in range(0, len(events), per_batch)]


def _registration(
    worker_id: str, role: int = pb.WORKER_ROLE_DECODE, model: str = MODEL, **extra
) -> pb.WorkerRegistration:
    fields = dict(
        worker_id=worker_id,
        role=role,
        model=model,
        engine_id=f"e-{worker_id}",
        nixl_endpoint="10.0.0.1:5600",
        block_size=16,
        hash_algorithm="sha256_cbor",
        hash_length=HASH_LENGTH,
        epoch=random.getrandbits(63) | 1,
        kv_bytes_per_block=160 * 1024,
    )
    return pb.WorkerRegistration(**{**fields, **extra})


async def _ingest(config: BenchConfig, target: str, conn) -> None:
    """The fleet: 64 agents (DirectoryLink, the sidecar's real stream code) in their own process,
    publishing every run, then heartbeating until told to stop."""
    fleet = _Fleet(config)
    async with AsyncDirectoryClient(target, timeout=60, max_message_bytes=256 * 1024 * 1024) as client:
        links = [
            DirectoryLink(client, _registration(f"bench-decode-{w}"), snapshot=lambda: [])
            for w in range(config.workers)
        ]
        runners = [asyncio.create_task(link.run()) for link in links]
        await asyncio.gather(*(link.connected.wait() for link in links))
        plans = [fleet.batches_for(w) for w in range(config.workers)]
        total = sum(len(e.retained.block_hashes) for plan in plans for batch in plan for e in batch)
        conn.send(("total", total))
        started = time.perf_counter()
        # Interleave workers batch by batch, keeping a window of unacked batches per worker.
        for round_ in range(max(len(p) for p in plans)):
            for link, plan in zip(links, plans, strict=False):
                if round_ < len(plan):
                    link.publish(plan[round_])
            if round_ % 4 == 3:
                await asyncio.gather(*(link.wait_acked(max(0, link.sequence - 8)) for link in links))
                conn.send(
                    (
                        "progress",
                        sum(
                            len(e.retained.block_hashes)
                            for plan in plans
                            for batch in plan[: round_ + 1]
                            for e in batch
                        ),
                    )
                )
        await asyncio.gather(*(link.wait_acked() for link in links))
        conn.send(("ingested", total, time.perf_counter() - started))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # keep the leases alive until the bench is done
        for runner in runners:
            runner.cancel()


def _fleet_process(config: BenchConfig, target: str, conn) -> None:
    from kvloop.common.logging import configure_logging

    parent = multiprocessing.parent_process()
    die_with_parent(parent_pid=parent.pid if parent else None)  # not left running if the bench dies
    configure_logging("warning")
    asyncio.run(_ingest(config, target, conn))


async def _concurrent_lookups(target: str, prompts: list[bytes], concurrency: int, count: int) -> float:
    async with AsyncDirectoryClient(target, timeout=30) as client:
        done = 0

        async def caller(i: int) -> None:
            nonlocal done
            while done < count:
                done += 1
                await client.lookup(MODEL, prompts[(i + done) % len(prompts)], **_LOOKUP)

        started = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        return count / (time.perf_counter() - started)


def _prompts(fleet: _Fleet, config: BenchConfig, count: int) -> list[bytes]:
    """Packed prompts: a retained run's prefix of random length, then blocks nobody holds."""
    rng = random.Random(config.seed + 1)
    prompts = []
    for _ in range(count):
        _, hashes = rng.choice(fleet.runs)
        keep = rng.randint(1, len(hashes))
        tail = [rng.randbytes(32) for _ in range(config.prompt_blocks - keep)]
        prompts.append(b"".join(hashes[:keep] + tail))
    return prompts


ROUTE_MODEL = "bench-route-model"
ROUTE_BLOCK_SIZE = 16


async def _route_figures(target: str, config: BenchConfig) -> dict:
    """Route as a router calls it, once per turn of one conversation that resends its history: token
    ids (packed, as the typed client sends them) scored over two prefill candidates, one holding the
    conversation's history in its prefix cache, the other the system prompt only, while a decode
    retains the history. kvloopd hashes the ids with the model's registered settings each call."""
    from kvloop.common import block_hash

    rng = random.Random(config.seed + 2)
    final = config.route_first_tokens + config.route_turns * config.route_turn_tokens
    tokens = [rng.randrange(32_000) for _ in range(final)]
    hashes = block_hash.block_hashes(tokens, ROUTE_BLOCK_SIZE, "sha256_cbor", block_hash.DEFAULT_SEED)

    system = config.route_first_tokens // ROUTE_BLOCK_SIZE // 2
    fleet = {
        "bench-route-prefill-0": (
            pb.WORKER_ROLE_PREFILL,
            pb.BlockEvent(stored=pb.BlocksStored(block_hashes=hashes)),
        ),
        "bench-route-prefill-1": (
            pb.WORKER_ROLE_PREFILL,
            pb.BlockEvent(stored=pb.BlocksStored(block_hashes=hashes[:system])),
        ),
        "bench-route-decode-0": (
            pb.WORKER_ROLE_DECODE,
            pb.BlockEvent(
                retained=pb.BlocksRetained(
                    block_hashes=hashes,
                    block_ids=list(range(len(hashes))),
                    num_groups=1,
                    retention_handle="route-run",
                    expires_in_ms=3_600_000,
                )
            ),
        ),
    }
    candidates = [pb.RouteCandidate(worker_id=w) for w in fleet if "prefill" in w]
    server_us, e2e_us, holder_first = [], [], 0
    async with AsyncDirectoryClient(target, timeout=30) as client:
        links = [
            DirectoryLink(
                client,
                _registration(
                    w,
                    role,
                    ROUTE_MODEL,
                    http_endpoint=f"http://{w}:8000",
                    block_size=ROUTE_BLOCK_SIZE,
                    hash_seed=block_hash.DEFAULT_SEED,
                ),
                snapshot=lambda: [],
            )
            for w, (role, _) in fleet.items()
        ]
        runners = [asyncio.create_task(link.run()) for link in links]
        try:
            await asyncio.gather(*(link.connected.wait() for link in links))
            for link, (_, event) in zip(links, fleet.values(), strict=True):
                link.publish([event])
            await asyncio.gather(*(link.wait_acked() for link in links))
            for turn in range(config.route_turns):
                prompt = tokens[: config.route_first_tokens + turn * config.route_turn_tokens]
                started = time.perf_counter()
                answer = await client.route(ROUTE_MODEL, candidates, token_ids=prompt)
                e2e_us.append((time.perf_counter() - started) * 1e6)
                server_us.append(answer.route_us)
                # the candidate with the whole history cached computes least and pulls nothing
                holder_first += answer.ranked[0].worker_id == "bench-route-prefill-0"
        finally:
            for runner in runners:
                runner.cancel()
    return {
        "route_server_p50_us": percentile(server_us, 0.50),
        "route_server_p99_us": percentile(server_us, 0.99),
        "route_e2e_p50_ms": round(percentile(e2e_us, 0.50) / 1e3, 3),
        "route_first_server_us": server_us[0],
        "route_turns": config.route_turns,
        "route_ranked_history_holder_first": holder_first,
        "route_prompt_tokens_mean": config.route_first_tokens
        + (config.route_turns - 1) * config.route_turn_tokens // 2,
    }


class _NoCall:
    """A handler's ServicerContext with no call on the wire: only abort (bad input) is reachable."""

    async def abort(self, code, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


async def _handler_figures(config: BenchConfig, prompts: list[bytes]) -> dict:
    """kvloopd's Lookup handler called back to back in this process, on an in-memory directory of its
    own that the same fleet fills over gRPC: what the handler's work costs with its code and data hot.

    A kvloopd answering one sequential caller idles between calls (the caller waits on the round
    trip), and each call starts on a core that was asleep, with the handler's code and the directory's
    hot entries out of its caches: ``lookup_server_*`` minus these figures is that price, which a
    daemon kept busy by concurrent callers does not pay, not work the handler could drop. The same
    calls, each after this process idled a millisecond (``lookup_handler_after_idle_p50_us``), show
    that price on this host without gRPC or a second process."""
    import gc

    import grpc

    from kvloop.common.block_keys import KEY_BYTES, packed_keys
    from kvloop.daemon.config import DaemonSettings
    from kvloop.daemon.index import MemoryStore
    from kvloop.daemon.index.instrumented import InstrumentedStore
    from kvloop.daemon.policy import Policy
    from kvloop.daemon.service import DirectoryService
    from kvloop.v1 import directory_pb2_grpc as pb_grpc

    settings = DaemonSettings(max_entries=100_000_000)
    service = DirectoryService(
        InstrumentedStore(MemoryStore(settings.index_config()), traced=False),
        Policy(settings.policy, settings.models),
        heartbeat_interval_s=settings.heartbeat_interval_s,
        max_hashes=settings.max_hashes_per_message,
        traced=False,
    )
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 * 1024 * 1024)])
    pb_grpc.add_DirectoryServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    fleet_proc = ctx.Process(
        target=_fleet_process, args=(config, f"127.0.0.1:{port}", child_conn), daemon=True
    )
    thresholds = gc.get_threshold()
    loop = asyncio.get_running_loop()
    try:
        fleet_proc.start()
        while (await loop.run_in_executor(None, conn.recv))[0] != "ingested":
            pass
        requests = [
            pb.LookupRequest(
                model=MODEL,
                requester_worker_id=_LOOKUP["requester"],
                pack_block_ids=True,
                packed_block_hashes=packed_keys(p, HASH_LENGTH),
                packed_hash_bytes=KEY_BYTES,
            )
            for p in prompts
        ]
        call = _NoCall()
        gc.set_threshold(settings.gc_young_threshold, *thresholds[1:])  # as kvloopd collects
        for request in requests[:50]:
            await service.Lookup(request, call)
        handler_us = []
        for i in range(config.lookups):
            t0 = time.perf_counter()
            await service.Lookup(requests[i % len(requests)], call)
            handler_us.append((time.perf_counter() - t0) * 1e6)
            if i % 16 == 15:
                await asyncio.sleep(0)  # the fleet's heartbeats are served meanwhile, as in kvloopd
        after_idle_us = []
        for i in range(min(config.lookups, _AFTER_IDLE_CALLS)):
            await asyncio.sleep(0.001)  # the loop waits in epoll: this core may sleep, as kvloopd's does
            t0 = time.perf_counter()
            await service.Lookup(requests[i % len(requests)], call)
            after_idle_us.append((time.perf_counter() - t0) * 1e6)
    finally:
        gc.set_threshold(*thresholds)
        conn.send("stop")
        fleet_proc.join(10)
        if fleet_proc.is_alive():
            fleet_proc.terminate()
        await server.stop(None)
    return {
        "lookup_handler_hot_p50_us": round(percentile(handler_us, 0.50)),
        "lookup_handler_hot_p99_us": round(percentile(handler_us, 0.99)),
        "lookup_handler_after_idle_p50_us": round(percentile(after_idle_us, 0.50)),
    }


_AFTER_IDLE_CALLS = 500


def _redis_used_memory(url: str | None) -> int:
    if url is None:
        return 0
    import redis

    with redis.Redis.from_url(url) as client:
        return int(client.info("memory")["used_memory"])


@dataclass
class _Sequential:
    """One caller's figures on one connection, once the fleet's runs are all in the directory."""

    alone_us: list[float]  # the health Check alone, before any Lookup
    entries: int
    rss_after: int
    redis_after: int
    prompts: list[bytes]
    server_us: list[float] = field(default_factory=list)
    e2e_us: list[float] = field(default_factory=list)
    floor_us: list[float] = field(default_factory=list)  # the health Check interleaved with Lookups
    transfers: int = 0


async def _run(config: BenchConfig, store: str, progress: Progress | None) -> dict:
    """One store's figures; ``store`` is "memory" or a Redis URL."""
    workdir = Path(tempfile.mkdtemp(prefix="kvloop-bench-"))
    redis_url = None if store == "memory" else store
    if redis_url is not None:
        import redis

        with redis.Redis.from_url(redis_url) as client:
            client.flushdb()
    daemon, target = start_daemon(config.listen, workdir, ["--store", store])
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    fleet_proc = ctx.Process(target=_fleet_process, args=(config, target, child_conn), daemon=True)
    try:
        rss_before = rss_bytes(daemon.pid)
        redis_before = _redis_used_memory(redis_url)
        fleet_proc.start()
        fleet = _Fleet(config)  # the same seeded runs, to build prompts that hit them
        hashes, ingest_seconds = _await_ingest(conn, progress)
        seq = _sequential_lookups(target, config, fleet, daemon.pid, redis_url, progress)
        if progress:
            progress.add_task(f"lookups ({config.concurrency} concurrent callers)", total=None)
        throughput = await _concurrent_lookups(target, seq.prompts, config.concurrency, config.lookups)
        if progress:
            progress.add_task(f"route ({config.route_turns} turns of one conversation)", total=None)
        more = await _route_figures(target, config)
        conn.send("stop")
        if redis_url is None:  # the handler's own cost, hot: with the in-memory store only
            if progress:
                progress.add_task("lookup handler, called in-process back to back", total=None)
            more |= await _handler_figures(config, seq.prompts)
        result = {
            "config": asdict(config),
            "entries": seq.entries,
            "workers": config.workers,
            "ingest_block_events": hashes,
            "ingest_seconds": round(ingest_seconds, 3),
            "ingest_block_events_per_s": round(hashes / ingest_seconds),
            **_lookup_figures(seq),
            "lookups_per_s_concurrent": round(throughput),
            "concurrency": config.concurrency,
            "lookups": config.lookups,
            "transfer_decisions": seq.transfers,
            "daemon_rss_before_mib": round(rss_before / 2**20, 1),
            "daemon_rss_after_mib": round(seq.rss_after / 2**20, 1),
            "bytes_per_entry": round(
                ((seq.redis_after - redis_before) if redis_url else (seq.rss_after - rss_before))
                / max(seq.entries, 1),
                1,
            ),
            "memory_measured": "redis used_memory" if redis_url else "daemon RSS",
            "redis_used_memory_mib": round(seq.redis_after / 2**20, 1) if redis_url else None,
            "cpu_count": os.cpu_count(),
            **more,
        }
        result["table"] = _table(result, config, redis_url is not None)
        return result
    finally:
        if fleet_proc.is_alive():
            fleet_proc.terminate()
        fleet_proc.join(10)
        supervisor().stop(daemon, grace_s=15)
        shutil.rmtree(workdir, ignore_errors=True)


def _await_ingest(conn, progress: Progress | None) -> tuple[int, float]:
    """The fleet's block-hash events and the seconds it took until the daemon acked them all."""
    _, total = conn.recv()
    task = progress.add_task("ingest", total=total) if progress else None
    while True:
        message = conn.recv()
        if message[0] == "ingested":
            _, hashes, ingest_seconds = message
            return hashes, ingest_seconds
        if progress and task is not None:
            progress.update(task, completed=message[1])


def _sequential_lookups(
    target: str,
    config: BenchConfig,
    fleet: _Fleet,
    daemon_pid: int,
    redis_url: str | None,
    progress: Progress | None,
) -> _Sequential:
    with DirectoryClient(target) as sync:
        health = health_pb2_grpc.HealthStub(sync._channel)
        check = health_pb2.HealthCheckRequest()
        # The gRPC round-trip floor on this machine: the standard health Check, which does nothing.
        # Alone it runs with all its code hot in the caches; the floor a Lookup is judged against
        # is the Check interleaved with the Lookups below, under the same machine state.
        alone_us = []
        for _ in range(min(config.lookups, 1000)):
            t0 = time.perf_counter()
            health.Check(check)
            alone_us.append((time.perf_counter() - t0) * 1e6)
        seq = _Sequential(
            alone_us=alone_us,
            entries=sync.stats().entries,
            rss_after=rss_bytes(daemon_pid),
            redis_after=_redis_used_memory(redis_url),
            prompts=_prompts(fleet, config, min(config.lookups, 500)),
        )
        prompts = seq.prompts
        for p in prompts[:50]:  # warm up
            sync.lookup(MODEL, p, **_LOOKUP)
        task = progress.add_task("lookups (sequential)", total=config.lookups) if progress else None
        for i in range(config.lookups):
            t0 = time.perf_counter()
            health.Check(check)
            t1 = time.perf_counter()
            answer = sync.lookup(MODEL, prompts[i % len(prompts)], **_LOOKUP)
            seq.e2e_us.append((time.perf_counter() - t1) * 1e6)
            seq.floor_us.append((t1 - t0) * 1e6)
            seq.server_us.append(answer.lookup_us)
            seq.transfers += answer.decision == pb.DECISION_TRANSFER
            if progress and task is not None:
                progress.advance(task)
    return seq


def _lookup_figures(seq: _Sequential) -> dict:
    server_us, e2e_us, floor_us = seq.server_us, seq.e2e_us, seq.floor_us
    return {
        "lookup_server_p50_us": percentile(server_us, 0.50),
        "lookup_server_p99_us": percentile(server_us, 0.99),
        "lookup_e2e_p50_ms": round(percentile(e2e_us, 0.50) / 1e3, 3),
        "lookup_e2e_p99_ms": round(percentile(e2e_us, 0.99) / 1e3, 3),
        "lookup_e2e_mean_ms": round(statistics.fmean(e2e_us) / 1e3, 3),
        "grpc_health_check_e2e_p50_ms": round(percentile(floor_us, 0.50) / 1e3, 3),
        "lookup_e2e_p50_over_health_check": round(percentile(e2e_us, 0.50) / percentile(floor_us, 0.50), 3),
        "grpc_health_check_alone_e2e_p50_ms": round(percentile(seq.alone_us, 0.50) / 1e3, 3),
    }


def _table(result: dict, config: BenchConfig, redis: bool) -> list[tuple[str, str, str]]:
    """The figures as (what, measured, target) rows; targets differ between the stores."""
    return [
        (
            "ingest (block-hash events/s)",
            f"{result['ingest_block_events_per_s']:,}",
            ">= 300,000" if redis else ">= 1,000,000",
        ),
        ("directory entries", f"{result['entries']:,}", f"{config.entries:,}"),
        (
            f"lookup server p50 ({config.prompt_blocks} blocks)",
            f"{result['lookup_server_p50_us']} us",
            "",
        ),
        (
            f"lookup server p99 ({config.prompt_blocks} blocks)",
            f"{result['lookup_server_p99_us']} us",
            "" if redis else "<= 100 us",  # Redis's target is relative: see its last row
        ),
        *([] if redis else _handler_rows(result)),
        (
            "lookup end-to-end p50 (gRPC, loopback)",
            f"{result['lookup_e2e_p50_ms']} ms",
            "" if redis else "<= 0.5 ms",
        ),
        (
            "  gRPC floor: empty health Check p50 (interleaved)",
            f"{result['grpc_health_check_e2e_p50_ms']} ms",
            "",
        ),
        (
            "  lookup end-to-end p50 / floor",
            f"{result['lookup_e2e_p50_over_health_check']}x",
            "<= 1.2x" if not redis else "",
        ),
        (
            f"lookups/s, {config.concurrency} concurrent callers",
            f"{result['lookups_per_s_concurrent']:,}",
            "",
        ),
        ("lookups that chose TRANSFER", f"{result['transfer_decisions']:,} / {config.lookups:,}", ""),
        (
            f"route server p50 / p99 ({result['route_prompt_tokens_mean']:,} token ids, 2 candidates)",
            f"{result['route_server_p50_us']} / {result['route_server_p99_us']} us",
            "",
        ),
        ("route end-to-end p50 (async client)", f"{result['route_e2e_p50_ms']} ms", ""),
        (
            f"memory per entry ({result['memory_measured']})",
            f"{result['bytes_per_entry']} B",
            "<= 250 B" if redis else "<= 200 B",
        ),
    ]


def _handler_rows(result: dict) -> list[tuple[str, str, str]]:
    return [
        (
            "  the handler alone, hot: p50 / p99 (in-process, back to back)",
            f"{result['lookup_handler_hot_p50_us']} / {result['lookup_handler_hot_p99_us']} us",
            "",
        ),
        (
            "  the handler alone, each call after 1 ms idle: p50 (in-process)",
            f"{result['lookup_handler_after_idle_p50_us']} us",
            "",
        ),
    ]


def _store_name(store: str) -> str:
    return "memory" if store == "memory" else "redis"


def run_directory_bench(config: BenchConfig, progress: bool = True) -> dict:
    """``{"stores": {name: figures}}``, one entry per store of ``config.stores``, measured in turn."""
    for store in config.stores:
        if store not in ("memory", "redis") and not store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--store must be memory, redis or a redis:// URL, got {store!r}")
    names = [_store_name(s) for s in config.stores]
    if len(set(names)) != len(names):
        raise ValueError(f"each store may be named once, got {list(config.stores)}")
    results: dict[str, dict] = {}
    with ExitStack() as stack:
        bar = (
            stack.enter_context(
                Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    TextColumn("{task.completed:,}/{task.total}"),
                    TimeElapsedColumn(),
                    transient=True,
                )
            )
            if progress
            else None
        )
        for store in config.stores:
            url = store
            if store == "redis":
                from kvloop.clients.fleet.redis_local import local_redis

                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvloop-bench-redis-")))
                url = stack.enter_context(local_redis(workdir))
            if bar is not None:
                bar.add_task(f"[{_store_name(store)}]", total=None)
            results[_store_name(store)] = asyncio.run(_run(config, url, bar))
    if "memory" in results and "redis" in results:
        _compare_to_memory(results["redis"], results["memory"])
    return {"stores": results}


def _compare_to_memory(redis: dict, memory: dict) -> None:
    """The Redis store's end-to-end Lookup against the in-memory store's of the same run (the issue's
    target is at most 1.5x): the host's speed moves between runs, so only figures of one run compare.

    Within one run the host's speed still moves between the two stores' halves, minutes apart, and
    moves both a Lookup and the floor interleaved with it: ``..._floor_adjusted`` compares each store's
    Lookup with its own floor (Redis's ratio to its floor over memory's), which takes that out."""
    ratio = round(redis["lookup_e2e_p50_ms"] / memory["lookup_e2e_p50_ms"], 3)
    redis["lookup_e2e_p50_over_memory"] = ratio
    adjusted = round(
        redis["lookup_e2e_p50_over_health_check"] / memory["lookup_e2e_p50_over_health_check"], 3
    )
    redis["lookup_e2e_p50_over_memory_floor_adjusted"] = adjusted
    redis["table"] += [
        ("  lookup end-to-end p50 / the memory store's (this run)", f"{ratio}x", "<= 1.5x"),
        ("    the same, each against its own floor", f"{adjusted}x", ""),
    ]
