"""`kvloop bench soak`: a fleet of simulated agents streaming block events at full rate into a real
kvloopd, with concurrent Lookup callers, then a check that the directory holds exactly what the
agents sent.

Each agent is the sidecar's own ``WorkerMirror`` + ``DirectoryLink`` (sequence numbers, acks,
heartbeats, snapshots) over its own Connect stream. Agents pick block hashes from a shared pool of
chains (prefixes shared across workers, as a fleet's system prompts are) and send stored, removed,
retained and released events, now and then ``AllBlocksCleared``; on a fleet-wide schedule an agent
restarts with a new epoch (its old stream cancelled, a fresh mirror) or loses engine events (the
sidecar's answer to a gap: forget retained runs, resend a snapshot). Each agent keeps a bounded
window of unacknowledged batches, so it runs as fast as the daemon acknowledges.

Every event an agent publishes is also applied to a plain reference model (sets and dicts, nothing
of the daemon's or the mirror's code). At the end, once every link is acknowledged, the directory
is read back over the public RPCs (ListWorkers, and FindBlock for every hash any agent could have
sent, in each namespace) and compared with the model: an entry the model holds that the directory
lacks is a lost event, one the directory holds that the model lacks is a phantom entry.

Event lag is sampled: now and then an agent publishes a run of fresh hashes and a prober asks
Lookup until the run is served. Agents and callers are spread over a few processes so that the
fleet is not bottlenecked on one interpreter lock.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import multiprocessing.connection
import queue
import random
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvloop.agents.connector.events import KvloopBlocksRetained, KvloopRetentionReleased
from kvloop.agents.sidecar.link import DirectoryLink
from kvloop.agents.sidecar.mirror import WorkerMirror
from kvloop.clients.bench.common import start_daemon
from kvloop.clients.bench.soak_report import ProcessWatch, SoakOutcome, build_report
from kvloop.clients.directory_client import AsyncDirectoryClient, KvloopError
from kvloop.common.processes import die_with_parent, supervisor
from kvloop.v1 import directory_pb2 as pb

MODEL = "soak-model"
LORAS = ("", "tenant-a")
BLOCK_SIZE = 16
HASH_LENGTH = 32
LEASE_MS = 3_600_000  # retained runs outlive any soak: expiry is not what is measured here
PROBE_BLOCKS = 4
PROBE_HOLD_S = 1.0
PROBE_POLL_S = 0.001
MAX_PROBES_POLLED = 4


@dataclass(frozen=True)
class SoakConfig:
    agents: int = 64
    callers: int = 32
    duration_s: float = 60.0
    store: str = "memory"  # memory, redis (a throwaway redis-server) or a redis:// URL
    processes: int = 2
    seed: int = 1
    chains: int = 256
    chain_blocks: int = 16
    # Per agent: prefix-cache blocks and retained runs it holds at most (it removes / releases beyond).
    max_stored: int = 256
    max_runs: int = 12
    # Unacknowledged batches an agent may have in flight before it waits for the daemon.
    window: int = 32
    # Fleet-wide schedule of faults (seconds between two, 0: none).
    restart_every_s: float = 2.0
    gap_every_s: float = 1.0
    clear_every_s: float = 3.0
    probe_every_s: float = 0.2
    listen: str = "127.0.0.1:0"
    # Stop publishing after this many events in all (None: only the duration bounds the run).
    max_events: int | None = None


# ---- the reference model ------------------------------------------------------------------------


@dataclass
class Reference:
    """What one worker holds after the events it sent, by the protocol's plain rules."""

    stored: set[tuple[str, bytes]] = field(default_factory=set)
    runs: dict[str, tuple[str, tuple[bytes, ...], tuple[int, ...]]] = field(default_factory=dict)

    def store(self, lora: str, hashes: list[bytes]) -> None:
        self.stored.update((lora, h) for h in hashes)

    def remove(self, lora: str, hashes: list[bytes]) -> None:
        self.stored.difference_update((lora, h) for h in hashes)

    def retain(self, handle: str, lora: str, hashes: list[bytes], block_ids: list[int]) -> None:
        self.runs[handle] = (lora, tuple(hashes), tuple(block_ids))

    def release(self, handle: str) -> None:
        self.runs.pop(handle, None)

    def clear(self) -> None:
        self.stored.clear()
        self.runs.clear()

    def forget_retained(self) -> None:
        self.runs.clear()

    def entries(self, worker: str) -> set[tuple]:
        out: set[tuple] = {(worker, "stored", lora, h) for lora, h in self.stored}
        for handle, (lora, hashes, ids) in self.runs.items():
            for position, h in enumerate(hashes):
                out.add((worker, "retained", lora, h, handle, position, ids[position]))
        return out


def chain_pool(seed: int, chains: int, blocks: int) -> list[list[bytes]]:
    """Chained block hashes (each the digest of its parent), the same in every process for a seed."""
    pool = []
    for c in range(chains):
        parent = hashlib.sha256(f"soak-{seed}-{c}".encode()).digest()
        chain = []
        for _ in range(blocks):
            parent = hashlib.sha256(parent).digest()
            chain.append(parent)
        pool.append(chain)
    return pool


def _registration(worker: str, epoch: int) -> pb.WorkerRegistration:
    return pb.WorkerRegistration(
        worker_id=worker,
        role=pb.WORKER_ROLE_DECODE,
        model=MODEL,
        engine_id=f"{worker}-{epoch}",
        nixl_endpoint="127.0.0.1:5600",
        block_size=BLOCK_SIZE,
        hash_algorithm="sha256_cbor",
        hash_length=HASH_LENGTH,
        epoch=epoch,
        kv_bytes_per_block=64 * 1024,
        kv_dtype="bfloat16",
    )


# ---- one agent ----------------------------------------------------------------------------------


class _Agent:
    def __init__(
        self,
        worker: str,
        client: AsyncDirectoryClient,
        pool: list[list[bytes]],
        seed: int,
        config: SoakConfig,
        probes: Any,
    ) -> None:
        self.worker = worker
        self.probes = probes  # where a probe run goes to the prober: (handle, hashes, monotonic sent)
        self.probe_sent: dict[str, float] = {}
        self.max_stored, self.max_runs, self.window = config.max_stored, config.max_runs, config.window
        self.probe_hashes: list[bytes] = []
        self.client = client
        self.pool = pool
        self.rng = random.Random(seed)
        self.reference = Reference()
        self.handles = 0
        self.next_block = 0
        # Faults the schedule asked for ("restart", "gap", "clear"), applied in order: none is dropped,
        # and the run ends only once every one asked for has been applied.
        self.pending: deque[str] = deque()
        self.probing = False
        self.counts: Counter[str] = Counter()
        self.epochs = 0
        self.links: list[DirectoryLink] = []
        self.runner: asyncio.Task | None = None
        self._start_link()

    def _start_link(self) -> None:
        self.epochs += 1
        self.mirror = WorkerMirror(HASH_LENGTH)
        epoch = (self.rng.getrandbits(62) << 1) | 1
        self.link = DirectoryLink(self.client, _registration(self.worker, epoch), self.mirror.snapshot)
        self.links.append(self.link)
        self.runner = asyncio.create_task(self.link.run())

    async def restart(self) -> None:
        """The engine and its sidecar restart: the old stream dies unacknowledged, a new epoch begins
        with an empty cache (kvloopd drops everything of the old epoch)."""
        if self.runner is not None:
            self.runner.cancel()
            await asyncio.gather(self.runner, return_exceptions=True)
        self.reference.clear()
        self.counts["restarts"] += 1
        self._start_link()

    def _ids(self, n: int) -> list[int]:
        ids = [(self.next_block + i) % 1_000_000 for i in range(n)]
        self.next_block = (self.next_block + n) % 1_000_000
        return ids

    def _event(self) -> pb.BlockEvent | None:
        """One event, applied to the mirror (what the sidecar sends) and to the reference."""
        rng, ref, mirror = self.rng, self.reference, self.mirror
        roll = rng.random()
        if roll < 0.40:
            chain = rng.choice(self.pool)
            lora = rng.choice(LORAS)
            start = rng.randrange(len(chain))
            hashes = chain[start : rng.randint(start + 1, len(chain))]
            if len(ref.stored) >= self.max_stored:
                return self._remove_some()
            ref.store(lora, hashes)
            self.counts["stored"] += 1
            return mirror.convert_vllm({"type": "BlockStored", "block_hashes": hashes, "lora_name": lora})
        if roll < 0.60:
            return self._remove_some()
        if roll < 0.85:
            if len(ref.runs) >= self.max_runs:
                return self._release_one()
            chain = rng.choice(self.pool)
            return self._retain(rng.choice(LORAS), chain[: rng.randint(1, len(chain))])[0]
        return self._release_one()

    def _retain(self, lora: str, hashes: list[bytes]) -> tuple[pb.BlockEvent | None, str]:
        self.handles += 1
        handle = f"{self.worker}/e{self.epochs}/r{self.handles}"
        ids = self._ids(len(hashes))
        event = self.mirror.convert_kvloop(
            KvloopBlocksRetained(
                block_hashes=hashes,
                block_ids=[ids],
                retention_handle=handle,
                lease_ms=LEASE_MS,
                single_use=False,
                lora_name=lora or None,
                ts=time.time(),
            )
        )
        if event is not None:
            self.reference.retain(handle, lora, hashes, ids)
            self.counts["retained"] += 1
        return event, handle

    def _remove_some(self) -> pb.BlockEvent | None:
        if not self.reference.stored:
            return None
        lora = self.rng.choice(LORAS)
        mine = [h for lo, h in self.reference.stored if lo == lora]
        if not mine:
            return None
        # Now and then a hash the worker never stored (vLLM may report a block twice): a no-op.
        hashes = self.rng.sample(mine, min(len(mine), self.rng.randint(1, 8)))
        if self.rng.random() < 0.1:
            hashes.append(self.rng.choice(self.rng.choice(self.pool)))
        self.reference.remove(lora, hashes)
        self.counts["removed"] += 1
        return self.mirror.convert_vllm({"type": "BlockRemoved", "block_hashes": hashes, "lora_name": lora})

    def _release_one(self) -> pb.BlockEvent | None:
        handles = [h for h in self.reference.runs if not self._probe_held(h)]
        if not handles:
            return None
        handle = self.rng.choice(handles)
        self.reference.release(handle)
        self.counts["released"] += 1
        return self.mirror.convert_kvloop(KvloopRetentionReleased(retention_handle=handle, ts=time.time()))

    def _probe_held(self, handle: str | None = None) -> bool:
        """A probe run is left alone (not released, no fault) for a while, for the prober to see it."""
        now = time.monotonic()
        if handle is not None:
            return now - self.probe_sent.get(handle, -PROBE_HOLD_S) < PROBE_HOLD_S
        return any(now - t < PROBE_HOLD_S for t in self.probe_sent.values())

    async def step(self) -> int:
        """Publish one batch (or apply one scheduled fault); returns the events sent."""
        fault = self.pending.popleft() if self.pending and not self._probe_held() else None
        if fault == "restart":
            await self.restart()
            return 0
        if fault == "gap":
            # What the sidecar does after a gap in the engine's own events (agents/sidecar/main.py).
            self.mirror.forget_retained()
            self.reference.forget_retained()
            sent = self.link.snapshots_sent
            self.link.request_snapshot("soak: engine event gap")
            self.counts["gaps"] += 1
            if self.link.snapshots_sent == sent:
                # between sessions (a restart's reconnect): the next session opens with a snapshot, and
                # gaps before it share that one
                self.counts["gaps_deferred"] += 1
            return 0
        events: list[pb.BlockEvent] = []
        if fault == "clear":
            event = self.mirror.convert_vllm({"type": "AllBlocksCleared"})
            self.reference.clear()
            self.counts["cleared"] += 1
            if event is not None:
                events.append(event)
        elif self.probing:
            self.probing = False
            hashes = [
                hashlib.sha256(f"{self.worker}/probe/{self.handles}/{i}".encode()).digest()
                for i in range(PROBE_BLOCKS)
            ]
            event, handle = self._retain("", hashes)
            if event is not None:
                events.append(event)
                self.probe_hashes.extend(hashes)
                self.probe_sent[handle] = time.monotonic()
                self.probes.put((handle, hashes, self.probe_sent[handle]))
        else:
            for _ in range(self.rng.randint(1, 4)):
                event = self._event()
                if event is not None:
                    events.append(event)
        if events:
            self.link.publish(events)  # the probe's time was taken just before: publish is synchronous
        link = self.link
        if link.sequence - link.acked > self.window:
            await link.wait_acked(link.sequence - self.window // 2, timeout=120)
        return len(events)


# ---- one process of agents ----------------------------------------------------------------------


async def _fleet(config: SoakConfig, index: int, target: str, conn: Any, probes: Any) -> None:
    share = [i for i in range(config.agents) if i % config.processes == index]
    pool = chain_pool(config.seed, config.chains, config.chain_blocks)
    rng = random.Random(config.seed * 1000 + index)
    event_budget = None if config.max_events is None else config.max_events // config.processes
    client = AsyncDirectoryClient(target, timeout=30)
    agents = [_Agent(f"soak-{i}", client, pool, config.seed * 100_000 + i, config, probes) for i in share]
    await asyncio.wait_for(asyncio.gather(*(a.link.connected.wait() for a in agents)), 60)
    conn.send(("ready",))
    conn.recv()  # "go": every process starts together
    stop = asyncio.Event()
    sent = 0

    async def agent_loop(agent: _Agent) -> None:
        nonlocal sent
        while not stop.is_set() or agent.pending:
            events = await agent.step()
            sent += events
            if event_budget is not None and sent >= event_budget:
                stop.set()
            await asyncio.sleep(0)  # let the links' readers and writers run between batches

    async def schedule(kind: str, every: float) -> None:
        if every <= 0 or not agents:
            return
        # Spread over the processes: each fires at its share of the fleet-wide rate.
        period = every * config.processes
        await asyncio.sleep(rng.uniform(0, period))
        while not stop.is_set():
            agent = rng.choice(agents)
            if kind == "probe":
                agent.probing = True
            else:
                agent.pending.append(kind)
            await asyncio.sleep(period)

    async def report() -> None:
        started = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.5)
            conn.send(("progress", sent, 0))
            if time.perf_counter() - started >= config.duration_s:
                stop.set()

    tasks = [asyncio.create_task(agent_loop(a)) for a in agents]
    tasks += [asyncio.create_task(schedule(k, e)) for k, e in _faults(config)]
    tasks += [asyncio.create_task(report())]
    await stop.wait()
    await asyncio.gather(*tasks)
    # Settle: every event sent has been acknowledged (applied) by the daemon.
    unacked = []
    for agent in agents:
        try:
            await agent.link.wait_acked(timeout=120)
        except TimeoutError:
            unacked.append(f"{agent.worker}: sent {agent.link.sequence}, acked {agent.link.acked}")
    counts: Counter[str] = Counter()
    for agent in agents:
        counts.update(agent.counts)
        counts["snapshots_sent"] += sum(link.snapshots_sent for link in agent.links)
        counts["sessions"] += sum(link.sessions for link in agent.links)
    conn.send(
        (
            "done",
            {
                "expected": {a.worker: a.reference for a in agents},
                "events_sent": sent,
                "batches_sent": sum(link.sequence for a in agents for link in a.links),
                "counts": dict(counts),
                "unacked": unacked,
                "probe_hashes": [h for a in agents for h in a.probe_hashes],
            },
        )
    )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, conn.recv)  # keep the streams up until the directory is read
    for agent in agents:
        if agent.runner is not None:
            agent.runner.cancel()
    await asyncio.gather(*(a.runner for a in agents if a.runner is not None), return_exceptions=True)
    await client.close()


# ---- the Lookup callers and the lag prober, in a process of their own ----------------------------


async def _lookups(config: SoakConfig, target: str, conn: Any, probes: Any) -> None:
    """Lookups timed where the agents' work cannot delay them; probe runs polled until served.

    Lag is measured on the system-wide monotonic clock, from the agent's publish() in its process."""
    pool = chain_pool(config.seed, config.chains, config.chain_blocks)
    client = AsyncDirectoryClient(target, timeout=30)
    conn.send(("ready",))
    conn.recv()
    stop = asyncio.Event()
    lags_ms: list[float] = []
    lookup_ms: list[float] = []
    errors: Counter[str] = Counter()
    unseen = skipped = 0
    loop = asyncio.get_running_loop()

    async def poll(handle: str, hashes: list[bytes], sent_at: float) -> None:
        nonlocal unseen
        while time.monotonic() - sent_at < 30:
            try:
                answer = await client.lookup(MODEL, hashes, requester="soak-probe")
            except KvloopError:
                continue
            holders = [answer.holder, *answer.other_holders] if answer.HasField("holder") else []
            if any(h.retention_handle == handle for h in holders):
                lags_ms.append((time.monotonic() - sent_at) * 1000)
                return
            await asyncio.sleep(PROBE_POLL_S)  # a poll every ~ms, not a flood of Lookups
        unseen += 1  # a restart, gap or clear of its agent took the run first: not a lag sample

    async def prober() -> None:
        nonlocal skipped
        polls: set[asyncio.Task] = set()
        while not stop.is_set():
            probe = await loop.run_in_executor(None, _next_probe, probes)
            if probe is None:
                continue
            if len(polls) >= MAX_PROBES_POLLED:
                skipped += 1
                continue
            task = asyncio.create_task(poll(*probe))
            polls.add(task)
            task.add_done_callback(polls.discard)
        await asyncio.gather(*polls)

    async def caller(n: int) -> None:
        rng = random.Random(config.seed * 7 + n)
        while not stop.is_set():
            chain = rng.choice(pool)
            hashes = chain[: rng.randint(1, len(chain))]
            t0 = time.perf_counter()
            try:
                await client.lookup(MODEL, hashes, requester="soak-prefill", lora_name=rng.choice(LORAS))
            except KvloopError as exc:
                errors[exc.code.name] += 1
                continue
            lookup_ms.append((time.perf_counter() - t0) * 1000)

    async def report() -> None:
        started = time.perf_counter()
        while time.perf_counter() - started < config.duration_s:
            await asyncio.sleep(0.5)
            conn.send(("progress", 0, len(lookup_ms)))
        stop.set()

    tasks = [asyncio.create_task(caller(n)) for n in range(config.callers)]
    tasks += [asyncio.create_task(prober()), asyncio.create_task(report())]
    await asyncio.gather(*tasks)
    conn.send(
        (
            "done",
            {
                "lags_ms": lags_ms,
                "lookup_ms": lookup_ms,
                "lookup_errors": dict(errors),
                "probes_unseen": unseen,
                "probes_skipped": skipped,
            },
        )
    )
    await loop.run_in_executor(None, conn.recv)
    await client.close()


def _next_probe(probes: Any) -> tuple[str, list[bytes], float] | None:
    try:
        return probes.get(timeout=0.2)
    except queue.Empty:
        return None


def _faults(config: SoakConfig) -> list[tuple[str, float]]:
    return [
        ("restart", config.restart_every_s),
        ("gap", config.gap_every_s),
        ("clear", config.clear_every_s),
        ("probe", config.probe_every_s),
    ]


def _fleet_process(config: SoakConfig, index: int, target: str, conn: Any, probes: Any) -> None:
    """Process ``index`` of the agents; the one past the last runs the Lookup callers and the prober."""
    from kvloop.common.logging import configure_logging

    parent = multiprocessing.parent_process()
    die_with_parent(parent_pid=parent.pid if parent else None)
    configure_logging("error")
    if index < config.processes:
        asyncio.run(_fleet(config, index, target, conn, probes))
    else:
        asyncio.run(_lookups(config, target, conn, probes))


# ---- reading the directory back -----------------------------------------------------------------


async def read_directory(target: str, hashes: set[bytes], workers: set[str]) -> tuple[set[tuple], dict]:
    """Every entry of ``workers`` FindBlock reports for ``hashes`` in each namespace, and ListWorkers'
    counts per worker."""
    found: set[tuple] = set()
    async with AsyncDirectoryClient(target, timeout=30) as client:
        queue = [(lora, h) for lora in LORAS for h in hashes]

        async def reader(part: list[tuple[str, bytes]]) -> None:
            for lora, h in part:
                for loc in await client.find_block(MODEL, h, lora_name=lora):
                    if loc.worker_id not in workers:
                        continue
                    if loc.kind == "stored":
                        found.add((loc.worker_id, "stored", lora, h))
                    else:
                        ids = tuple(loc.block_ids)
                        found.add(
                            (
                                loc.worker_id,
                                "retained",
                                lora,
                                h,
                                loc.retention_handle,
                                loc.position,
                                ids[0] if len(ids) == 1 else ids,
                            )
                        )

        await asyncio.gather(*(reader(queue[i::16]) for i in range(16)))
        listed = {
            w.registration.worker_id: {
                "stored_blocks": w.stored_blocks,
                "retained_runs": w.retained_runs,
                "retained_blocks": w.retained_blocks,
                "connected": w.connected,
            }
            for w in await client.list_workers(MODEL)
        }
    return found, listed


def compare(expected: dict[str, Reference], found: set[tuple], listed: dict[str, dict]) -> dict:
    want: set[tuple] = set()
    for worker, ref in expected.items():
        want |= ref.entries(worker)
    lost = want - found
    phantom = found - want
    count_mismatches = []
    for worker, ref in expected.items():
        counts = listed.get(worker)
        should = {
            "stored_blocks": len(ref.stored),
            "retained_runs": len(ref.runs),
            "retained_blocks": sum(len(h) for _, h, _ in ref.runs.values()),
        }
        if counts is None:
            count_mismatches.append(f"{worker}: not listed")
        elif any(counts[k] != v for k, v in should.items()):
            count_mismatches.append(f"{worker}: ListWorkers {counts}, reference {should}")
    return {
        "entries_expected": len(want),
        "entries_found": len(found),
        "lost_events": len(lost),
        "phantom_entries": len(phantom),
        "count_mismatches": count_mismatches,
        "lost_samples": [_show(e) for e in sorted(lost)[:5]],
        "phantom_samples": [_show(e) for e in sorted(phantom)[:5]],
    }


def _show(entry: tuple) -> str:
    return " ".join(x.hex()[:12] if isinstance(x, bytes) else str(x) for x in entry)


# ---- driver -------------------------------------------------------------------------------------


def _run(config: SoakConfig, store_url: str, progress: Callable[[dict], None], cluster: bool = False) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvloop-soak-"))
    if store_url != "memory" and not cluster:  # a cluster is the soak's own, new
        import redis

        with redis.Redis.from_url(store_url) as r:
            r.flushdb()
    env = {"KVLOOP_STORE__CLUSTER": "true"} if cluster else {}
    daemon, target = start_daemon(config.listen, workdir, ["--store", store_url], env)
    ctx = multiprocessing.get_context("spawn")
    conns: list[Any] = []
    procs: list[Any] = []
    probes = ctx.Queue()
    try:
        _start_fleet(ctx, config, target, probes, conns, procs)
        watch = ProcessWatch(daemon.pid, store_url)
        for conn in conns:
            conn.send("go")
        outcome = _soak(config, conns, procs, watch, progress)
        progress(
            {"elapsed": outcome.wall, "events": outcome.sent, "lookups": outcome.lookups, "settling": True}
        )
        expected, found, listed = _read_back(config, target, outcome.agents_done)
        for conn in conns:
            conn.send("stop")
        verdict = compare(expected, found, listed)
        return build_report(config, store_url, outcome, verdict, watch.rss, workdir)
    finally:
        for conn in conns:
            try:
                conn.send("stop")
            except OSError:
                pass
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        supervisor().stop(daemon, grace_s=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _start_fleet(
    ctx: Any, config: SoakConfig, target: str, probes: Any, conns: list[Any], procs: list[Any]
) -> None:
    """Start the fleet's processes and wait until each has connected its agents. ``conns`` and
    ``procs`` are the caller's, so that whatever did start is stopped when a later one fails."""
    for index in range(config.processes + 1):
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_fleet_process, args=(config, index, target, child, probes), daemon=True)
        proc.start()
        conns.append(conn)
        procs.append(proc)
    for conn in conns:
        if not conn.poll(120):
            raise RuntimeError("a fleet process did not connect its agents within 120 s")
        conn.recv()


def _soak(
    config: SoakConfig,
    conns: list[Any],
    procs: list[Any],
    watch: ProcessWatch,
    progress: Callable[[dict], None],
) -> SoakOutcome:
    """Until every fleet process has reported its results: their progress, and kvloopd's memory."""
    started = time.perf_counter()
    sent = [0] * len(conns)
    lookups = [0] * len(conns)
    results: list[dict | None] = [None] * len(conns)
    next_sample = started
    while any(r is None for r in results):
        now = time.perf_counter()
        if now >= next_sample and now - started <= config.duration_s + 1:
            watch.sample_rss(now - started)
            next_sample += 1.0
        for i, conn in enumerate(conns):
            while results[i] is None and conn.poll():
                message = conn.recv()
                if message[0] == "progress":
                    sent[i], lookups[i] = message[1], message[2]
                else:
                    results[i] = message[1]
            if results[i] is None and not procs[i].is_alive():
                raise RuntimeError(f"fleet process {i} exited with status {procs[i].exitcode}")
        progress({"elapsed": now - started, "events": sum(sent), "lookups": sum(lookups), "settling": False})
        multiprocessing.connection.wait(conns, timeout=0.2)
    wall = time.perf_counter() - started
    return SoakOutcome(
        results=[r for r in results if r is not None],
        wall=wall,
        cpu=watch.cpu_percent(wall),
        sent=sum(sent),
        lookups=sum(lookups),
    )


def _read_back(
    config: SoakConfig, target: str, agents_done: list[dict]
) -> tuple[dict[str, Reference], set[tuple], dict]:
    """What the agents sent (their reference models) and what the directory holds of every hash any
    agent could have sent."""
    expected: dict[str, Reference] = {}
    for r in agents_done:
        expected.update(r["expected"])
    hashes = {h for chain in chain_pool(config.seed, config.chains, config.chain_blocks) for h in chain}
    hashes.update(h for r in agents_done for h in r["probe_hashes"])
    found, listed = asyncio.run(read_directory(target, hashes, set(expected)))
    return expected, found, listed


def run_soak(config: SoakConfig, progress: Callable[[dict], None] = lambda state: None) -> dict:
    """Start kvloopd on ``config.store`` (and a redis-server for ``redis``, a 3-primary Redis Cluster
    for ``redis-cluster``), soak it, compare."""
    if config.store not in ("memory", "redis", "redis-cluster") and not config.store.startswith(
        ("redis://", "rediss://", "unix://")
    ):
        raise ValueError(
            f"--store must be memory, redis, redis-cluster or a redis:// URL, got {config.store!r}"
        )
    if config.agents < 1 or config.processes < 1 or config.duration_s <= 0:
        raise ValueError("--agents and --processes must be at least 1, --duration above 0")
    config = _replace(config, processes=min(config.processes, config.agents))
    with ExitStack() as stack:
        url = config.store
        if url == "redis":
            from kvloop.clients.fleet.redis_local import local_redis

            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvloop-soak-redis-")))
            url = stack.enter_context(local_redis(workdir))
        if url == "redis-cluster":
            from kvloop.clients.fleet.redis_local import local_redis_cluster

            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvloop-soak-redis-")))
            url = stack.enter_context(local_redis_cluster(workdir, primaries=3, replicas=0)).url
            return _run(config, url, progress, cluster=True)
        return _run(config, url, progress)


def _replace(config: SoakConfig, **changes: Any) -> SoakConfig:
    from dataclasses import replace

    return replace(config, **changes)
